"""``naive``: the textbook ``log_softmax`` + gather in float32, on every device type it lists (pure
torch: add one by registering a copy of it for your device type), autograd by torch.

The portable fallback of last resort: it materialises a float32 copy of the logits (and its
log-softmax), so it has the lowest priority. It implements every feature of the op table (the
sampler's processing, candidate labels, ``topk_logprobs``, ``logits_dtype``, ``kl_divergence``
with ``kl_hidden`` and ``kl_support``) as
:mod:`logprob_registry.reference` defines it, in float32: the reference implementation of them.
"""

from __future__ import annotations

import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry import reference as ref
from logprob_registry.kit import FLOAT_DTYPES, label_columns, pad_rows, result_dtype, tiled


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                        dtype=result_dtype(logits.dtype), **sampler)


def entropy(logits, *, temperature, **sampler):
    return ref.entropy(logits, temperature=temperature, dtype=result_dtype(logits.dtype), **sampler)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    return ref.logprobs_and_entropy(
        logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=result_dtype(logits.dtype),
        **sampler,
    )


def topk_logprobs(logits, *, k, temperature, **sampler):
    return ref.topk_logprobs(logits, k, temperature=temperature, dtype=result_dtype(logits.dtype), **sampler)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         keep=None, **sampler):
    lead = hidden.shape[:-1]
    n = lead.numel()
    candidates = labels.dim() == hidden.dim()
    # a few rows are padded so that the matmul takes the path it takes for a batch (batch invariance)
    flat = pad_rows(hidden.reshape(n, hidden.shape[-1]))
    pad = flat.shape[0] - n
    flat_labels = labels.reshape((n, labels.shape[-1]) if candidates else (n,))
    padded_labels = torch.cat([flat_labels, flat_labels.new_zeros((pad,) + flat_labels.shape[1:])])
    if keep is not None:  # padded rows keep every token
        flat_keep = ref.keep_mask(keep, weight.shape[0]).reshape(n, weight.shape[0])
        keep = torch.cat([flat_keep, flat_keep.new_ones(pad, weight.shape[0])])
    out = ref.logprobs_from_hidden(
        flat, weight, padded_labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=result_dtype(hidden.dtype), keep=keep, **sampler,
    )
    shape = labels.shape
    if return_entropy:
        return out[0][:n].reshape(shape), out[1][:n].reshape(lead)
    return out[:n].reshape(shape)


def kl_divergence(student, teacher, *, direction, temperature, mask, tail, student_weight=None,
                  teacher_weight=None, support=None):
    kw = dict(dtype=result_dtype(student.dtype), direction=direction, temperature=temperature, tail=tail)
    if student_weight is None and teacher_weight is None:
        return ref.kl_divergence(student, teacher, mask=mask, support=support, **kw)
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
    out = ref.kl_divergence(s, t, student_weight=student_weight, teacher_weight=teacher_weight, support=support, **kw)
    out = out[:n].reshape(lead)
    return out if mask is None else torch.where(mask, out, torch.zeros_like(out))


# ------------------------------------------------- vocabulary-parallel ops (the textbook formulas)
# Per tile: max, then plain sums. Correct, but a plain sum's order is the kernel's choice (on CUDA it
# depends on the shape), so naive does not declare group_invariant.
def _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, lead):
    """The shard_stats outputs of z (N, V_local) in the result dtype."""
    z3 = tiled(z, tile)
    m = z3.amax(-1)
    d = z3 - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1)
    e = d.exp()
    nt = z3.shape[1]
    s = e.sum(-1).view(*lead, nt)
    t = torch.where(e == 0, 0.0, e * d).sum(-1).view(*lead, nt) if with_entropy else None
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


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy):
    z = logits.reshape(-1, logits.shape[-1]).to(result_dtype(logits.dtype)) / temperature
    return _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, logits.shape[:-1])


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward):
    z = logits.reshape(-1, logits.shape[-1]).to(lse.dtype) / temperature
    grad = _dz(z, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start, temperature)
    return grad.to(logits.dtype).view(logits.shape)  # out of place even with inplace_backward


def _hidden_logits(hidden, weight, bias, temperature):
    acc = result_dtype(hidden.dtype)
    h = hidden.reshape(-1, hidden.shape[-1]).to(acc)
    return h, torch.nn.functional.linear(h, weight.to(acc), None if bias is None else bias.to(acc)) / temperature


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy):
    _, z = _hidden_logits(hidden, weight, bias, temperature)
    return _stats(z, labels, vocab_start, tile, ignore_index, with_entropy, hidden.shape[:-1])


def hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, *, bias, vocab_start,
                      tile, temperature, needs_grad):
    h, z = _hidden_logits(hidden, weight, bias, temperature)
    dz = _dz(z, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start, temperature)
    need_h, need_w, need_b = needs_grad
    gh = (dz @ weight.to(dz.dtype)).view(hidden.shape) if need_h else None
    gw = (dz.t() @ h).to(weight.dtype) if need_w else None
    gb = dz.sum(0).to(bias.dtype) if need_b and bias is not None else None
    return gh, gw, gb


# kl_divergence with process_group=: both sides' shards (logits, or hidden states and a weight shard)
def _kl_side(x, weight, acc, temperature):
    """``(rows 2-D in acc, z = logits / T (N, V_local))`` of one side of kl_divergence."""
    h = x.reshape(-1, x.shape[-1]).to(acc)
    z = h if weight is None else torch.nn.functional.linear(h, weight.to(acc))
    return h, z / temperature


def kl_shard_stats(student, teacher, *, student_weight, teacher_weight, vocab_start, tile, temperature, direction):
    acc = result_dtype(student.dtype)
    _, zs = _kl_side(student, student_weight, acc, temperature)
    _, zt = _kl_side(teacher, teacher_weight, acc, temperature)
    lead = student.shape[:-1]
    zs3, zt3 = tiled(zs, tile), tiled(zt, tile)
    out = []
    for z3 in (zs3, zt3):
        m = z3.amax(-1)
        e = (z3 - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1)).exp()
        out += [m, e]
    (ms, es), (mt, et) = out[:2], out[2:]
    weight, diff = (et, zt3 - zs3) if direction == "forward" else (es, zs3 - zt3)
    cross = torch.where(weight == 0, 0.0, weight * diff).sum(-1)
    nt = zs3.shape[1]
    return tuple(x.reshape(*lead, nt) for x in (ms, es.sum(-1), mt, et.sum(-1), cross))


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
            "topk_logprobs": topk_logprobs,
            "kl_divergence": kl_divergence,
            "shard_stats": shard_stats,
            "shard_grad": shard_grad,
            "hidden_shard_stats": hidden_shard_stats,
            "hidden_shard_grad": hidden_shard_grad,
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
                  "kl_hidden", "kl_support"},
        description="log_softmax + gather in float32; materialises the logits in float32; every feature, "
                    "as the reference defines it",
    ))
