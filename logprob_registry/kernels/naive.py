"""``naive``: the textbook ``log_softmax`` + gather in float32, on every device type it lists (pure
torch: add one by registering a copy of it for your device type), autograd by torch.

The portable fallback of last resort: it materialises a float32 copy of the logits (and its
log-softmax), so it has the lowest priority. It implements every feature of the op table (the
sampler's processing, candidate labels, ``topk_logprobs``, ``logits_dtype``, ``kl_divergence``
with ``kl_hidden`` and ``kl_support``) as
:mod:`logprob_registry.reference` defines it (``kit.reference_function``), in float32: the reference
implementation of them.
"""

from __future__ import annotations

import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import FLOAT_DTYPES, label_columns, pad_rows, result_dtype, tiled

_RESULT_DTYPES = (torch.float32, torch.float64)  # logits already in the dtype naive computes and returns in


# The sampler's keywords by name, not ``**sampler``: collecting them into a dict and passing it on
# costs a microsecond a call, the half of a small call's kernel (issue #36).
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None, top_k=None, top_p=None,
             min_p=None, keep=None, sampler=None):
    if (temperature.__class__ is float and temperature == 1.0 and ignore_index is None and softcap is None
            and top_k is None and top_p is None and min_p is None and keep is None
            and logits.dtype in _RESULT_DTYPES and labels.dtype is torch.int64 and labels.dim() + 1 == logits.dim()):
        # The reference's formula for this call as its three torch ops, without its layers (dtype,
        # temperature and candidate checks): a small call's kernel near torch's (issue #36); bitwise
        # the reference's (tests/test_call.py).
        return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return kit.reference_function("logprobs")(logits, labels, temperature=temperature, ignore_index=ignore_index,
                                              dtype=result_dtype(logits.dtype), softcap=softcap, top_k=top_k,
                                              top_p=top_p, min_p=min_p, keep=keep, sampler=sampler)


def entropy(logits, *, temperature, softcap=None, top_k=None, top_p=None, min_p=None, keep=None, sampler=None):
    return kit.reference_function("entropy")(logits, temperature=temperature, dtype=result_dtype(logits.dtype),
                                             softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep,
                                             sampler=sampler)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None, top_k=None,
                         top_p=None, min_p=None, keep=None, sampler=None):
    return kit.reference_function("logprobs_and_entropy")(
        logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=result_dtype(logits.dtype),
        softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep, sampler=sampler,
    )


def topk_logprobs(logits, *, k, temperature, **sampler):
    return kit.reference_function("topk_logprobs")(logits, k, temperature=temperature,
                                                   dtype=result_dtype(logits.dtype), **sampler)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         keep=None, **sampler):
    lead = hidden.shape[:-1]
    n = lead.numel()
    candidates = labels.dim() == hidden.dim()
    rows = _per_row(temperature, sampler)
    if not (candidates or return_entropy or keep is not None or rows):  # only the active rows cost (kit.on_active_rows)
        def active(h, y):
            return logprobs_from_hidden(h, weight, y, bias=bias, temperature=temperature, ignore_index=None,
                                        return_entropy=False, **sampler)

        out = kit.on_active_rows(active, hidden.reshape(n, hidden.shape[-1]), labels.reshape(n), ignore_index)
        if out is not None:
            return out.view(lead)
    # a few rows are padded so that the matmul takes the path it takes for a batch (batch invariance)
    flat = pad_rows(hidden.reshape(n, hidden.shape[-1]))
    pad = flat.shape[0] - n
    flat_labels = labels.reshape((n, labels.shape[-1]) if candidates else (n,))
    padded_labels = torch.cat([flat_labels, flat_labels.new_zeros((pad,) + flat_labels.shape[1:])])
    if keep is not None:  # padded rows keep every token
        flat_keep = kit.keep_mask(keep, weight.shape[0]).reshape(n, weight.shape[0])
        keep = torch.cat([flat_keep, flat_keep.new_ones(pad, weight.shape[0])])
    if rows:  # per-row values: padded rows take the neutral ones (temperature 1, truncation off)
        temperature, sampler = _pad_per_row(lead, pad, temperature, sampler)
    out = kit.reference_function("logprobs_from_hidden")(
        flat, weight, padded_labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=result_dtype(hidden.dtype), keep=keep, **sampler,
    )
    shape = labels.shape
    if return_entropy:
        return out[0][:n].reshape(shape), out[1][:n].reshape(lead)
    return out[:n].reshape(shape)


def token_stats(inputs, labels, *, weight, bias, outputs, temperature, ignore_index, keep=None, **sampler):
    """Every statistic from one float32 distribution (the reference's formulas); hidden states: rows
    padded as in logprobs_from_hidden (batch invariance)."""
    run = kit.reference_function("token_stats")
    kw = dict(outputs=outputs, ignore_index=ignore_index, dtype=result_dtype(inputs.dtype), **sampler)
    if weight is None:
        return lr.TokenStats(**run(inputs, labels, temperature=temperature, keep=keep, **kw))
    lead = inputs.shape[:-1]
    n = lead.numel()
    flat = pad_rows(inputs.reshape(n, inputs.shape[-1]))
    pad = flat.shape[0] - n
    flat_labels = None
    if labels is not None:
        flat_labels = labels.reshape((n, labels.shape[-1]) if labels.dim() == inputs.dim() else (n,))
        flat_labels = torch.cat([flat_labels, flat_labels.new_zeros((pad,) + flat_labels.shape[1:])])
    if keep is not None:
        flat_keep = kit.keep_mask(keep, weight.shape[0]).reshape(n, weight.shape[0])
        keep = torch.cat([flat_keep, flat_keep.new_ones(pad, weight.shape[0])])
    if _per_row(temperature, sampler):
        temperature, sampler = _pad_per_row(lead, pad, temperature, sampler)
        kw.update(sampler)
    got = run(flat, flat_labels, weight=weight, bias=bias, temperature=temperature, keep=keep, **kw)

    def back(name, value):
        if value is None:
            return None
        label_shaped = labels is not None and name in ("logprobs", "raw_logprobs", "is_argmax")
        return value[:n].reshape(labels.shape if label_shaped else lead)

    return lr.TokenStats(**{name: back(name, value) for name, value in got.items()})


_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # per row: unchanged, or "off"


def _per_row(temperature, sampler) -> bool:
    """Whether a call has per-row values (tensors of the positions' shape)."""
    return isinstance(temperature, torch.Tensor) or any(
        isinstance(sampler.get(name), torch.Tensor) for name in ("top_k", "top_p", "min_p"))


def _pad_per_row(lead, pad, temperature, sampler):
    """The per-row values flattened and extended by ``pad`` neutral rows (see :data:`_NEUTRAL`)."""
    def extend(name, value):
        if not isinstance(value, torch.Tensor):
            return value
        flat = value.reshape(lead.numel())
        return torch.cat([flat, flat.new_full((pad,), _NEUTRAL[name])])

    return extend("temperature", temperature), {k: extend(k, v) if k in _NEUTRAL else v for k, v in sampler.items()}


def kl_divergence(student, teacher, *, direction, temperature, mask, tail, student_weight=None,
                  teacher_weight=None, support=None, beta=None):
    kw = dict(dtype=result_dtype(student.dtype), direction=direction, temperature=temperature, tail=tail, beta=beta)
    if student_weight is None and teacher_weight is None:
        return kit.reference_function("kl_divergence")(student, teacher, mask=mask, support=support, **kw)
    # Hidden states: rows flattened and a few padded, so that the matmul takes the path it takes for a
    # batch (batch invariance); padded rows get support ids 0..K-1 (distinct) and are dropped.
    lead = student.shape[:-1]
    n = lead.numel()
    s = pad_rows(student.reshape(n, student.shape[-1]))
    t = pad_rows(teacher.reshape(n, teacher.shape[-1]))
    pad = s.shape[0] - n
    if support is not None:
        flat = support.reshape(n, support.shape[-1])
        filler = torch.arange(flat.shape[1], device=flat.device, dtype=flat.dtype).expand(pad, -1)
        support = torch.cat([flat, filler])
    out = kit.reference_function("kl_divergence")(s, t, student_weight=student_weight, teacher_weight=teacher_weight,
                                                  support=support, **kw)
    out = out[:n].reshape(lead)
    return out if mask is None else torch.where(mask, out, torch.zeros_like(out))


# ------------------------------------------------- vocabulary-parallel ops (the textbook formulas)
# Per tile: max, then plain sums. Correct, but a plain sum's order is the kernel's choice (on CUDA it
# depends on the shape), so naive does not declare group_invariant.
def _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, lead, reference=None):
    """The shard_stats outputs of z (N, V_local): the max in z's dtype, the sums in float64 (plain
    sums, not exact), on the global tile grid."""
    offset = kit.grid_offset(vocab_start, tile)
    z3 = tiled(torch.nn.functional.pad(z, (offset, 0), value=float("-inf")) if offset else z, tile)
    m = z3.amax(-1)
    if reference is not None:
        m = torch.maximum(m, reference.reshape(-1, 1).to(m.dtype))
    d = z3 - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1)
    e = d.exp()
    nt = z3.shape[1]
    s = e.double().sum(-1).view(*lead, nt)
    t = torch.where(e == 0, 0.0, e * d).double().sum(-1).view(*lead, nt) if with_entropy else None
    picked = None
    if labels is not None:
        owned, column = label_columns(labels, vocab_start, z.shape[1], ignore_index)
        picked = torch.where(owned, z.gather(1, column.unsqueeze(1)).squeeze(1), 0.0).view(lead)
    return m.view(*lead, nt), s, t, picked


def _dz(z, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start, temperature):
    """d(loss)/d(logits) for z = logits / T of shape (N, V_local), in z's dtype."""
    logp = z - lse.reshape(-1, 1)
    p = logp.exp()
    grad = torch.zeros_like(z)
    if grad_logprobs is not None:
        g = grad_logprobs.reshape(-1, 1)
        grad -= p * g
        owned, column = label_columns(labels, vocab_start, z.shape[1], None)
        rows = owned.nonzero().squeeze(1)  # only there: adding 0 elsewhere would turn -0.0 into +0.0
        grad.index_put_((rows, column[rows]), g[rows, 0], accumulate=True)
    if grad_entropy is not None:
        grad -= grad_entropy.reshape(-1, 1) * torch.where(torch.isneginf(z), 0.0, p * (logp + entropy.reshape(-1, 1)))
    return grad / temperature


def _sampled(x, labels, lead, *, vocab_start, tile, temperature, ignore_index, with_entropy, softcap, keep,
             boundary, logits_dtype=None, reference=None):
    """shard_stats with the sampler's processing (feature shard_sampler): the tile statistics of z over
    the kept tokens; labels (...) or candidates (..., K)."""
    z, y = kit.shard_processed(kit.shard_rounded(x, logits_dtype), temperature=temperature, softcap=softcap,
                               acc=result_dtype(x.dtype) if x.dtype != torch.float64 else x.dtype,
                               logits_dtype=logits_dtype)
    mask = kit.shard_kept(y, vocab_start, None if keep is None else keep.reshape(z.shape), _rows(boundary))
    picked = None
    if labels is not None:
        lab = labels.reshape(z.shape[0], -1)
        owned, value = kit.shard_label_values(z, mask, lab, vocab_start, ignore_index)
        picked = torch.where(owned, value, 0.0).view(labels.shape)
    m, s, t, _ = _stats(kit.shard_masked(z.clone(), mask), None, vocab_start, tile, ignore_index, with_entropy, lead,
                        reference)
    return m, s, t, picked


def _rows(boundary):
    return None if boundary is None else tuple(b.reshape(-1) for b in boundary)


def _sampled_grad(x, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature, softcap, keep,
                  boundary, logits_dtype=None):
    """d(loss)/d(x) of the raw logits x (N, V_local) in lse's dtype, with the sampler's processing."""
    xr = kit.shard_rounded(x, logits_dtype)
    z, y = kit.shard_processed(xr, temperature=temperature, softcap=softcap, acc=lse.dtype, logits_dtype=logits_dtype)
    mask = kit.shard_kept(y, vocab_start, None if keep is None else keep.reshape(z.shape), _rows(boundary))
    n = z.shape[0]
    lab = None if labels is None else labels.reshape(n, -1)
    g_lp = None if grad_logprobs is None else grad_logprobs.reshape(n, -1)
    dz = kit.shard_grad_z(z, mask, lab, vocab_start, lse, entropy, g_lp, grad_entropy)
    return kit.shard_chain(dz, xr, temperature=temperature, softcap=softcap, logits_dtype=logits_dtype)


def _sampler_given(labels, lead, softcap, keep, boundary, logits_dtype=None, temperature=1.0):
    """Whether the sampler's path is needed: its options, candidate labels, or a per-row temperature
    (the plain path divides by a number)."""
    return (softcap is not None or keep is not None or boundary is not None or logits_dtype is not None
            or isinstance(temperature, torch.Tensor) or (labels is not None and labels.dim() > len(lead)))


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, reference=None,
                softcap=None, keep=None, boundary=None):
    if _sampler_given(labels, logits.shape[:-1], softcap, keep, boundary, temperature=temperature):
        x = logits.reshape(-1, logits.shape[-1])
        return _sampled(x, labels, logits.shape[:-1], vocab_start=vocab_start, tile=tile, temperature=temperature,
                        ignore_index=ignore_index, with_entropy=with_entropy, softcap=softcap, keep=keep,
                        boundary=boundary, reference=reference)
    z = logits.reshape(-1, logits.shape[-1]).to(result_dtype(logits.dtype)) / temperature
    return _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, logits.shape[:-1], reference)


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward, softcap=None, keep=None, boundary=None):
    if _sampler_given(labels, logits.shape[:-1], softcap, keep, boundary, temperature=temperature):
        x = logits.reshape(-1, logits.shape[-1])
        grad = _sampled_grad(x.to(lse.dtype), labels, lse.reshape(-1),
                             None if entropy is None else entropy.reshape(-1), grad_logprobs, grad_entropy,
                             vocab_start=vocab_start, temperature=temperature, softcap=softcap, keep=keep,
                             boundary=boundary)
        return grad.to(logits.dtype).view(logits.shape)
    z = logits.reshape(-1, logits.shape[-1]).to(lse.dtype) / temperature
    grad = _dz(z, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start, temperature)
    return grad.to(logits.dtype).view(logits.shape)  # out of place even with inplace_backward


def shard_topk(logits, *, vocab_start, temperature, k, decision, softcap=None, keep=None, boundary=None):
    x = logits.reshape(-1, logits.shape[-1])
    return _topk(x, logits.shape[:-1], vocab_start=vocab_start, temperature=temperature, k=k, decision=decision,
                 softcap=softcap, keep=keep, boundary=boundary)


def _topk(x, lead, *, vocab_start, temperature, k, decision, softcap, keep, boundary, logits_dtype=None):
    """A shard's top-k (values, global ids), largest first, ties by smaller id: of the float32 decision
    logits y (decision=True: no mask), else of z over the kept tokens."""
    acc = torch.float64 if x.dtype == torch.float64 else result_dtype(x.dtype)
    z, y = kit.shard_processed(kit.shard_rounded(x.to(acc) if logits_dtype is None else x, logits_dtype),
                               temperature=temperature, softcap=softcap, acc=acc, logits_dtype=logits_dtype)
    if decision:
        values = y
    else:
        kept = kit.shard_kept(y, vocab_start, None if keep is None else keep.reshape(z.shape), _rows(boundary))
        values = kit.shard_masked(z.clone(), kept)
    top, ids = kit.shard_top_list(values, vocab_start, k)
    return top.view(*lead, k), ids.view(*lead, k)


def _hidden_logits(hidden, weight, bias, temperature):
    acc = result_dtype(hidden.dtype)
    h = hidden.reshape(-1, hidden.shape[-1]).to(acc)
    return h, torch.nn.functional.linear(h, weight.to(acc), None if bias is None else bias.to(acc)) / temperature


def _hidden_raw(hidden, weight, bias):
    """The raw logits (N, V_local) of a weight shard in the compute dtype, and the rows."""
    acc = result_dtype(hidden.dtype)
    h = hidden.reshape(-1, hidden.shape[-1]).to(acc)
    return h, torch.nn.functional.linear(h, weight.to(acc), None if bias is None else bias.to(acc))


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       reference=None, softcap=None, keep=None, boundary=None, logits_dtype=None):
    if _sampler_given(labels, hidden.shape[:-1], softcap, keep, boundary, logits_dtype, temperature):
        _, x = _hidden_raw(hidden, weight, bias)
        return _sampled(x, labels, hidden.shape[:-1], vocab_start=vocab_start, tile=tile, temperature=temperature,
                        ignore_index=ignore_index, with_entropy=with_entropy, softcap=softcap, keep=keep,
                        boundary=boundary, logits_dtype=logits_dtype, reference=reference)
    _, z = _hidden_logits(hidden, weight, bias, temperature)
    return _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, hidden.shape[:-1], reference)


def hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, *, bias, vocab_start,
                      tile, temperature, needs_grad, softcap=None, keep=None, boundary=None, logits_dtype=None):
    if _sampler_given(labels, hidden.shape[:-1], softcap, keep, boundary, logits_dtype, temperature):
        h, x = _hidden_raw(hidden, weight, bias)
        dz = _sampled_grad(x, labels, lse.reshape(-1), None if entropy is None else entropy.reshape(-1),
                           grad_logprobs, grad_entropy, vocab_start=vocab_start, temperature=temperature,
                           softcap=softcap, keep=keep, boundary=boundary, logits_dtype=logits_dtype)
    else:
        h, z = _hidden_logits(hidden, weight, bias, temperature)
        dz = _dz(z, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start, temperature)
    need_h, need_w, need_b = needs_grad
    gh = (dz @ weight.to(dz.dtype)).view(hidden.shape) if need_h else None
    gw = (dz.t() @ h).to(weight.dtype) if need_w else None
    gb = dz.sum(0).to(bias.dtype) if need_b and bias is not None else None
    return gh, gw, gb


def hidden_shard_topk(hidden, weight, *, bias, vocab_start, temperature, k, decision, softcap=None, keep=None,
                      boundary=None, logits_dtype=None):
    _, x = _hidden_raw(hidden, weight, bias)
    return _topk(x, hidden.shape[:-1], vocab_start=vocab_start, temperature=temperature, k=k, decision=decision,
                 softcap=softcap, keep=keep, boundary=boundary, logits_dtype=logits_dtype)


# kl_divergence with process_group=: both sides' shards (logits, or hidden states and a weight shard)
def _kl_side(x, weight, acc, temperature):
    """``(rows 2-D in acc, z = logits / T (N, V_local))`` of one side of kl_divergence."""
    h = x.reshape(-1, x.shape[-1]).to(acc)
    z = h if weight is None else torch.nn.functional.linear(h, weight.to(acc))
    return h, z / temperature


def kl_shard_stats(student, teacher, *, student_weight, teacher_weight, vocab_start, tile, temperature, direction,
                   student_reference=None, teacher_reference=None):
    acc = result_dtype(student.dtype)
    _, zs = _kl_side(student, student_weight, acc, temperature)
    _, zt = _kl_side(teacher, teacher_weight, acc, temperature)
    lead = student.shape[:-1]
    offset = kit.grid_offset(vocab_start, tile)
    zs3, zt3 = (tiled(torch.nn.functional.pad(z, (offset, 0), value=float("-inf")) if offset else z, tile)
                for z in (zs, zt))
    out = []
    for z3, reference in ((zs3, student_reference), (zt3, teacher_reference)):
        m = z3.amax(-1)
        if reference is not None:
            m = torch.maximum(m, reference.reshape(-1, 1).to(m.dtype))
        e = (z3 - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1)).exp()
        out += [m, e]
    (ms, es), (mt, et) = out[:2], out[2:]
    weight, diff = (et, zt3 - zs3) if direction == "forward" else (es, zs3 - zt3)
    cross = torch.where(weight == 0, 0.0, weight * diff).double().sum(-1)
    nt = zs3.shape[1]
    return tuple(x.reshape(*lead, nt) for x in (ms, es.double().sum(-1), mt, et.double().sum(-1), cross))


def kl_shard_grad(student, teacher, lse_student, lse_teacher, kl, grad_kl, mask, *, student_weight, teacher_weight,
                  vocab_start, tile, temperature, direction, needs_grad):
    acc = lse_student.dtype
    h, zs = _kl_side(student, student_weight, acc, temperature)
    _, zt = _kl_side(teacher, teacher_weight, acc, temperature)
    logps = zs - lse_student.reshape(-1, 1)
    ps = logps.exp()
    if direction == "forward":
        dz = ps - (zt - lse_teacher.reshape(-1, 1)).exp()
    else:
        dz = torch.where(ps == 0, 0.0, ps * (logps - (zt - lse_teacher.reshape(-1, 1)) - kl.reshape(-1, 1)))
    dz = dz * grad_kl.reshape(-1, 1) / temperature
    if mask is not None:
        dz = torch.where(mask.reshape(-1, 1), dz, 0.0)
    if student_weight is None:
        return dz.to(student.dtype).view(student.shape), None
    need_h, need_w = needs_grad
    gh = (dz @ student_weight.to(acc)).view(student.shape) if need_h else None
    gw = (dz.t() @ h).to(student_weight.dtype) if need_w else None
    return gh, gw


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="naive",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "logprobs_from_hidden": logprobs_from_hidden,
            "token_stats": token_stats,
            "topk_logprobs": topk_logprobs,
            "kl_divergence": kl_divergence,
            "shard_stats": shard_stats,
            "shard_grad": shard_grad,
            "hidden_shard_stats": hidden_shard_stats,
            "hidden_shard_grad": hidden_shard_grad,
            "shard_topk": shard_topk,
            "hidden_shard_topk": hidden_shard_topk,
            "kl_shard_stats": kl_shard_stats,
            "kl_shard_grad": kl_shard_grad,
        },
        devices={"cpu", "cuda", "npu", "xpu", "mps", "hpu"},
        dtypes=set(FLOAT_DTYPES),
        priority=kit.Priority.LAST_RESORT,
        autograd=True,
        batch_invariant=True,
        copies_logits=True,
        features={"functorch", "candidates", "softcap", "top_k", "top_p", "min_p", "keep", "logits_dtype",
                  "kl_hidden", "kl_support", "kl_jsd", "stats_hidden", "shard_sampler", "per_row", "sampler"},
        description="log_softmax + gather in float32; materialises the logits in float32; every feature, "
                    "as the reference defines it",
    ))
