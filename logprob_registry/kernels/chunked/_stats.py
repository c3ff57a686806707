"""``token_stats`` for the ``chunked`` backend: every statistic of a position from the one pass its
other ops already make over the vocabulary.

Each path runs the very row functions of the op it duplicates, so the fields those ops return come
out bitwise the same, and adds a few running reductions to the same pass, on the chunk (or tile)
while it is in cache:

* logits, no sampler keywords (:func:`_plain_forward`): the loop of :mod:`._rows` (torch's softmax
  of an fp32 chunk ``p``, ``norm = sum p``, ``max y``, ``max p``, ``sum p (y - m)``, and ``p[label]``
  for the log-probabilities, which :func:`._rows.logprobs` turns into ``logprobs_from_logits``' bits)
  plus ``sum y`` (the mean), ``|p|`` (one vectorised norm: ``log_sum_p2 = 2 (log |p| - log norm)``)
  and, for ``is_argmax``, in the rows whose label is at the maximum, the max of the columns before
  it (``kit.first_max``: an argmax reduction is 30 times slower than a max on the CPU);
* logits with the sampler's processing, candidates or per-row values: :func:`._sampler.forward_rows`
  with its ``extras`` hooks, which see the processed logits ``z`` before truncation (the raw
  log-sum-exp, entropy, label values, mean and max) and over the kept tokens (``sum e**2`` and the
  argmax of ``z`` masked outside the kept set);
* hidden states, plain: the tile loop of :func:`._hidden._forward` (online log-sum-exp over
  vocabulary blocks) with its ``extras`` hooks: a running ``sum z``, ``sum exp(2 (z - m))`` rescaled
  by ``alpha**2`` as the running max moves, and the label's logit with the max of the columns before
  it;
* hidden states with the sampler's processing: :func:`._sampler.forward_rows` on each block of rows'
  logits, as chunked's fused sampler op forms them.

Without truncation the raw fields are the processed ones (copies). Backward keeps per-row statistics
only and recomputes each chunk or tile: the processed fields' gradient through the op's own backward,
the raw fields' (with truncation) through the same backward with the truncation left out, the two
summed chunk by chunk. ``log_sum_p2``, ``mean_logit``, ``max_logit`` and ``is_argmax`` are not
differentiable (``kit.DIFFERENTIABLE_STATS``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Optional

import torch
from torch.autograd.function import once_differentiable

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import MIN_GEMM_ROWS, backward_without_autocast, first_max, first_order_only, result_dtype

from . import _hidden, _sampler
from . import _rows as loops

FIELDS = lr.TokenStats._fields
LABELLED = kit.LABEL_STATS
NEG_INF = float("-inf")
_ONCE = "backend 'chunked' (token_stats)"


def _pack(named: Dict[str, torch.Tensor]):
    """The 8 fields in order (None where not computed) for an autograd Function's outputs."""
    return tuple(named.get(f) for f in FIELDS)


def _mark(ctx, outs) -> None:
    ctx.mark_non_differentiable(*kit.fixed_stats(outs))


# ----------------------------------------------------------------------------- logits, plain
def _norm2(t: torch.Tensor, dim: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The row 2-norm (one vectorised reduction, far faster on the CPU than a product and a sum)."""
    return torch.linalg.vector_norm(t, 2, dim, out=out)


def _before_max(rows: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """The maximum of each row of ``rows`` ``(k, V)`` over the columns before its ``label`` (-inf for
    label 0); ``rows`` is overwritten."""
    cols = torch.arange(rows.shape[1], device=rows.device)
    return rows.masked_fill_(cols >= label.unsqueeze(-1), NEG_INF).amax(-1) if rows.shape[0] else rows.new_empty(0)


def _plain_forward(logits, plan: loops.Plan, index, valid, want: FrozenSet[str]):
    """Every asked field (flat) and the backward's statistics, one pass of :mod:`._rows`' loop."""
    vocab = logits.shape[-1]
    n = logits.numel() // vocab
    cdt = result_dtype(logits.dtype)
    dev = logits.device

    def new(dtype=cdt):
        return torch.empty(n, dtype=dtype, device=dev)

    labelled = index is not None
    need_lp = labelled and bool(want & {"logprobs", "raw_logprobs"})
    need_ent = bool(want & {"entropy", "raw_entropy"})
    norm, m, pmax = new(), new(), new()
    pz = new() if need_ent else None
    plabel = new() if need_lp else None
    top = torch.zeros(n, dtype=torch.bool, device=dev) if labelled and "is_argmax" in want else None
    picked = None if top is None else loops._picked(logits, index, plan, cdt)
    zsum = new() if "mean_logit" in want else None
    p2 = new() if "log_sum_p2" in want else None
    if n:
        rows = plan.rows_per_chunk if plan.fixed_shape else min(plan.rows_per_chunk, n)
        ws = loops._Workspace(rows, vocab, cdt, dev, plan.fixed_shape)
        index2 = None if plabel is None else index.view(-1, 1)
        plabel2 = None if plabel is None else plabel.view(-1, 1)
        for start, chunk in loops.chunks(logits, plan.rows_per_chunk):
            end = start + chunk.shape[0]
            sl = slice(start, end)
            y = ws.load(chunk, plan.temperature)
            p = torch.softmax(y, -1, out=ws.p if y.shape[0] == rows else ws.p[: y.shape[0]])
            loops._reduce_into(torch.sum, p, norm[sl])
            if plabel is not None:
                torch.gather(p[: end - start], 1, index2[sl], out=plabel2[sl])
            loops._reduce_into(torch.amax, y, m[sl])
            if top is not None and kit.capturing(m):  # no row count on the host: every row
                before = _before_max(y[: end - start].clone(), index[sl])
                top[sl] = first_max(picked[sl], m[sl], before, index[sl])
            elif top is not None:  # rows whose label is at the maximum: is any column before it there too?
                cand = (picked[sl] == m[sl]) | torch.isnan(m[sl])
                at = cand.nonzero().squeeze(-1)
                before = _before_max(y[at], index[sl][at])
                top[sl][at] = first_max(picked[sl][at], m[sl][at], before, index[sl][at])
            loops._reduce_into(torch.amax, p, pmax[sl])
            if zsum is not None:
                loops._reduce_into(torch.sum, y, zsum[sl])
            if pz is not None:  # overwrites y when y is the workspace: the reductions of y come first
                z = loops._z_times_p(y, loops._pad(m[sl], y.shape[0]), p, out=ws.y[: y.shape[0]])
                loops._reduce_into(torch.sum, z, pz[sl])
            if p2 is not None:  # |p|, squared below
                loops._reduce_into(_norm2, p, p2[sl])
    logz = torch.log(norm / pmax)
    mean_z = None if pz is None else pz / norm
    out = {}
    if need_lp:  # logprobs_from_logits' own arithmetic (label probability, rare rows redone)
        lp = loops.logprobs(logits, plan, index, valid, loops.Stats(norm, plabel=plabel))
        out["logprobs"] = lp
    if need_ent:  # logprobs_and_entropy's
        out["entropy"] = logz - mean_z
    if p2 is not None:  # log sum q**2 with q = p / norm
        out["log_sum_p2"] = 2.0 * (p2.log() - norm.log())
    if zsum is not None:
        out["mean_logit"] = zsum / vocab
    if "max_logit" in want:
        out["max_logit"] = m.clone()
    if top is not None:
        out["is_argmax"] = top if valid is None else top & valid
    return kit.asked_stats(out, want), loops.Stats(norm, m, logz, mean_z)


class _PlainStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, valid, plan, want):
        out, stats = _plain_forward(logits, plan, index, valid, want)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.index, ctx.valid = plan, stats, index, valid
        ctx.set_materialize_grads(False)
        outs = _pack(out)
        _mark(ctx, outs)
        return outs

    @staticmethod
    @backward_without_autocast
    @first_order_only(_ONCE)
    @once_differentiable
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        g_lp, g_ent, _, _ = _grads_of(grads, ctx.index, ctx.valid, truncates=False)  # raw = processed here
        if g_lp is None and g_ent is None:
            return (None,) * 5
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        loops.backward(logits, ctx.plan, ctx.stats, ctx.index, g_lp, g_ent, out, inplace=False)
        return out, None, None, None, None


def _plain(logits, labels, want, temperature, ignore_index, budget, fixed_shape):
    plan = loops.Plan(temperature=temperature, want_logprobs=labels is not None, want_entropy=True,
                      rows_per_chunk=loops.rows_per_chunk(logits.shape[-1], logits.dtype, budget),
                      fixed_shape=fixed_shape)
    index = valid = None
    if labels is not None:
        index = labels.reshape(-1).long()
        if ignore_index is not None:
            valid = index != ignore_index
            index = index.masked_fill(~valid, 0)
    if torch.is_grad_enabled() and logits.requires_grad:
        return dict(zip(FIELDS, _PlainStats.apply(logits, index, valid, plan, want)))
    return _plain_forward(logits, plan, index, valid, want)[0]


# --------------------------------------------------------------- with the sampler's processing
class _Extras:
    """token_stats' running reductions beside :func:`._sampler.forward_rows` (its ``extras``)."""

    def __init__(self, n: int, vocab: int, plan: _sampler.Plan, want, index, device):
        cdt = plan.cdt
        self.vocab, self.index, self.cdt = vocab, index, cdt
        self.truncates = plan.truncates
        raw = self.truncates and bool(want & {"raw_logprobs", "raw_entropy"})

        def new(on: bool, shape=(n,), dtype=cdt):
            return torch.empty(shape, dtype=dtype, device=device) if on else None

        self.raw_m, self.raw_log_s = new(raw), new(raw)
        self.raw_ent = new(raw and "raw_entropy" in want)
        self.raw_lp = new(raw and index is not None and "raw_logprobs" in want,
                          (n, 0 if index is None else index.shape[1]))
        self.mean = new("mean_logit" in want)
        self.max = new("max_logit" in want)
        self.p2 = new("log_sum_p2" in want)
        self.top = new(index is not None and "is_argmax" in want, dtype=torch.int64)

    def raw(self, z: torch.Tensor, sl: slice, r: int) -> None:
        if self.mean is not None:
            self.mean[sl] = _sampler._row_reduce(torch.sum, z)[:r] / self.vocab
        if self.max is None and self.raw_m is None:
            return
        zm = _sampler._row_reduce(torch.amax, z)
        if self.max is not None:
            self.max[sl] = zm[:r]
        if self.raw_m is None:
            return
        # the non-truncating forward of forward_rows, on the same z
        e = torch.sub(z, zm.unsqueeze(-1)).exp_()
        s = _sampler._row_reduce(torch.sum, e)
        log_s = s.log()
        self.raw_m[sl], self.raw_log_s[sl] = zm[:r], log_s[:r]
        if self.raw_lp is not None:
            picked = z[:r].gather(1, self.index[sl])
            self.raw_lp[sl] = (picked - zm[:r].unsqueeze(-1)) - log_s[:r].unsqueeze(-1)
        if self.raw_ent is not None:
            d = torch.sub(z, zm.unsqueeze(-1)).clamp_(min=torch.finfo(z.dtype).min).mul_(e)
            self.raw_ent[sl] = (log_s - _sampler._row_reduce(torch.sum, d) / s)[:r]

    def processed(self, z, e, s, kept, empty, sl: slice, r: int) -> None:
        if self.p2 is not None:
            v = _sampler._row_reduce(lambda t, d: _norm2(t, d), e).log_().sub_(s.log()).mul_(2.0)
            if empty is not None:
                v.masked_fill_(empty, NEG_INF)
            self.p2[sl] = v[:r]
        if self.top is not None:  # z is -inf outside the kept set here (0 in a row with nothing kept)
            self.top[sl] = torch.argmax(z[:r], -1)


def _raw_plan(plan: _sampler.Plan) -> _sampler.Plan:
    """The same processing without truncation (the raw fields' distribution)."""
    return dataclasses.replace(plan, top_k=None, top_p=None, min_p=None, keep=None, topk=None)


def _sampler_outputs(lp, stats: _sampler.Stats, ex: _Extras, index, valid, want):
    """The asked fields (flat) from forward_rows' statistics and the extras; raw fields are copies
    of the processed ones when nothing truncates."""
    out = {}
    if lp is not None:
        out["logprobs"] = lp
    if stats.entropy is not None:
        out["entropy"] = stats.entropy
    if "raw_logprobs" in want and index is not None:
        if ex.truncates:
            raw = ex.raw_lp
            out["raw_logprobs"] = raw if valid is None else raw.masked_fill_(~valid, 0.0)
        else:
            out["raw_logprobs"] = lp.clone()
    if "raw_entropy" in want:
        out["raw_entropy"] = ex.raw_ent if ex.truncates else stats.entropy.clone()
    if ex.p2 is not None:
        out["log_sum_p2"] = ex.p2
    if ex.mean is not None:
        out["mean_logit"] = ex.mean
    if ex.max is not None:
        out["max_logit"] = ex.max
    if ex.top is not None:
        hit = index == ex.top.unsqueeze(-1)
        out["is_argmax"] = hit if valid is None else hit & valid
    return {k: v for k, v in out.items() if k in want}


def _sampler_plan(shape, dtype, device, budget, fixed_shape, labels_given, want, temperature, sampler):
    plan = _sampler.make_plan(
        shape, dtype, device, budget, temperature=temperature, softcap=sampler.get("softcap"),
        top_k=sampler.get("top_k"), top_p=sampler.get("top_p"), min_p=sampler.get("min_p"), keep=sampler.get("keep"),
        fixed_shape=fixed_shape, sampler=sampler.get("sampler"))
    # without truncation the raw fields are the processed ones
    label_fields = {"logprobs"} if plan.truncates else {"logprobs", "raw_logprobs"}
    plan.want_logprobs = labels_given and bool(want & label_fields)
    plan.want_entropy = bool(want & ({"entropy"} if plan.truncates else {"entropy", "raw_entropy"}))
    return plan


def _index(labels, lead_n: int, ignore_index):
    if labels is None:
        return None, None
    index = labels.reshape(lead_n, -1).long()
    valid = None
    if ignore_index is not None:
        valid = index != ignore_index
        index = index.masked_fill(~valid, 0)
    return index, valid


def _rows_forward(blocks, n, vocab, plan, index, valid, want, device):
    """forward_rows (with the extras) over ``blocks``: ``(first row, logits rows)`` pairs."""
    stats = _sampler._new_stats(n, plan, device, 0 if index is None else index.shape[1])
    ex = _Extras(n, vocab, plan, want, index, device)
    lp = torch.empty(index.shape, dtype=plan.cdt, device=device) if plan.want_logprobs else None
    with torch.no_grad():
        for start, src in blocks:
            _sampler.forward_rows(src, slice(start, start + src.shape[0]), plan, stats, index, lp, extras=ex)
    if lp is not None and valid is not None:
        lp.masked_fill_(~valid, 0.0)
    raw_stats = None
    if ex.raw_m is not None:
        raw_stats = _sampler.Stats(ex.raw_m, ex.raw_log_s, ex.raw_ent)
    return _sampler_outputs(lp, stats, ex, index, valid, want), stats, raw_stats


def _grads_of(grads, index, valid, truncates: bool):
    """``(g_lp, g_ent, g_raw_lp, g_raw_ent)`` from the fields' upstream gradients: the label ones
    ``(N, K)``, 0 where ignored; the raw ones folded into the processed ones when nothing truncates."""
    g = dict(zip(FIELDS, grads))
    g_lp, g_ent, r_lp, r_ent = g["logprobs"], g["entropy"], g["raw_logprobs"], g["raw_entropy"]
    if not truncates:
        (g_lp, g_ent), r_lp, r_ent = kit.stats_gradients(grads), None, None

    def labelled(t):
        if t is None:
            return None
        t = t.reshape(index.shape)
        return t if valid is None else t.masked_fill(~valid, 0.0)

    def rows(t):
        return None if t is None else t.reshape(-1)

    return labelled(g_lp), rows(g_ent), labelled(r_lp), rows(r_ent)


def _dz(src, sl, v0, plan, stats, raw_stats, index, g):
    """The gradient of a chunk (or tile) of rows ``sl``: the processed fields' and the raw ones'."""
    g_lp, g_ent, r_lp, r_ent = g
    dz = None
    if g_lp is not None or g_ent is not None:
        dz = _sampler.backward_tile(src, sl, v0, plan, stats, index, None if g_lp is None else g_lp[sl],
                                    None if g_ent is None else g_ent[sl])
    if r_lp is not None or r_ent is not None:
        raw = _sampler.backward_tile(src, sl, v0, _raw_plan(plan), raw_stats, index,
                                     None if r_lp is None else r_lp[sl], None if r_ent is None else r_ent[sl])
        dz = raw if dz is None else dz.add_(raw)
    return dz


class _SamplerStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, plan, index, valid, want):
        blocks = loops.chunks(logits, plan.rows)
        vocab = logits.shape[-1]
        out, stats, raw_stats = _rows_forward(blocks, logits.numel() // vocab, vocab, plan, index, valid, want,
                                              logits.device)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.raw_stats, ctx.index, ctx.valid = plan, stats, raw_stats, index, valid
        ctx.set_materialize_grads(False)
        outs = _pack(out)
        _mark(ctx, outs)
        return outs

    @staticmethod
    @backward_without_autocast
    @first_order_only(_ONCE)
    @once_differentiable
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        g = _grads_of(grads, ctx.index, ctx.valid, ctx.plan.truncates)
        if all(t is None for t in g):
            return (None,) * 5
        vocab = logits.shape[-1]
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_out = out.view(-1, vocab)
        for start, chunk in loops.chunks(logits, ctx.plan.rows):
            sl = slice(start, start + chunk.shape[0])
            flat_out[sl].copy_(_dz(chunk, sl, 0, ctx.plan, ctx.stats, ctx.raw_stats, ctx.index, g))
        return out, None, None, None, None


def _sampled(logits, labels, want, temperature, ignore_index, budget, fixed_shape, sampler):
    n = logits.numel() // max(logits.shape[-1], 1)
    plan = _sampler_plan(logits.shape, logits.dtype, logits.device, budget, fixed_shape, labels is not None, want,
                         temperature, sampler)
    index, valid = _index(labels, n, ignore_index)
    if torch.is_grad_enabled() and logits.requires_grad:
        return dict(zip(FIELDS, _SamplerStats.apply(logits, plan, index, valid, want)))
    vocab = logits.shape[-1]
    return _rows_forward(loops.chunks(logits, plan.rows), n, vocab, plan, index, valid, want, logits.device)[0]


# ---------------------------------------------------------------------------- hidden, plain
class _HiddenExtras:
    """token_stats' running reductions beside :func:`._hidden._forward` (its ``extras``): ``sum z``,
    the running max, ``sum exp(2 (z - m))`` rescaled as the max moves, and for ``is_argmax`` the
    label's logit and the max of the columns before it (the tiles wholly before the label give
    their max, the label's own tile the max of its columns before it: ``kit.first_max``)."""

    def __init__(self, n: int, vocab: int, want, lab, labelled: bool, device, cd):
        opts = dict(device=device, dtype=cd)
        self.vocab, self.lab = vocab, lab
        self.zsum = torch.zeros(n, **opts) if "mean_logit" in want else None
        argmax = labelled and "is_argmax" in want
        self.mx = torch.full((n,), NEG_INF, **opts) if argmax or want & {"max_logit", "log_sum_p2"} else None
        self.before = torch.full((n,), NEG_INF, **opts) if argmax else None
        self.picked = torch.zeros(n, **opts) if argmax else None
        self.s2 = torch.zeros(n, **opts) if "log_sum_p2" in want else None

    def logits(self, r0: int, r1: int, v0: int, z: torch.Tensor, m_old: torch.Tensor, m_new: torch.Tensor) -> None:
        if self.zsum is not None:
            self.zsum[r0:r1] += z.sum(1)
        if self.mx is None:
            return
        self.mx[r0:r1] = m_new  # the running max, exact
        if self.before is not None:
            idx = self.lab.index[r0:r1]
            after = idx >= v0 + z.shape[1]  # every column so far is before the label: their max is m_new
            self.before[r0:r1] = torch.where(after, m_new, self.before[r0:r1])
            inside = (idx >= v0) & ~after
            if kit.capturing(z):  # no row count on the host: every row of the tile
                local = (idx - v0).clamp(0, z.shape[1] - 1)
                got = z.gather(1, local.unsqueeze(-1)).squeeze(-1)
                self.picked[r0:r1] = torch.where(inside, got, self.picked[r0:r1])
                self.before[r0:r1] = torch.where(inside, torch.maximum(m_old, _before_max(z.clone(), local)),
                                                 self.before[r0:r1])
                return
            at = inside.nonzero().squeeze(-1)
            if at.numel():  # the label's tile: the columns seen before it, and those of this tile before it
                local = idx[at] - v0
                rows = z[at]
                self.picked[r0 + at] = rows.gather(1, local.unsqueeze(-1)).squeeze(-1)
                self.before[r0 + at] = torch.maximum(m_old[at], _before_max(rows, local))

    def exps(self, r0: int, r1: int, e: torch.Tensor, alpha: torch.Tensor) -> None:
        if self.s2 is not None:
            self.s2[r0:r1] = self.s2[r0:r1] * (alpha * alpha) + _norm2(e, 1).square_()


def _hidden_outputs(logp, lse, ent, hx: _HiddenExtras, lab, labelled: bool, want):
    out = {}
    if labelled:
        out["logprobs"] = logp
    if ent is not None:
        out["entropy"] = ent
    if hx.s2 is not None:  # log sum q**2 = log sum exp(2 (z - m)) - 2 log s, log s = lse - m
        m_safe = hx.mx.masked_fill(hx.mx == NEG_INF, 0.0)
        out["log_sum_p2"] = hx.s2.log() - 2.0 * (lse - m_safe)
    if hx.zsum is not None:
        out["mean_logit"] = hx.zsum / hx.vocab
    if "max_logit" in want:
        out["max_logit"] = hx.mx
    if hx.before is not None:
        out["is_argmax"] = first_max(hx.picked, hx.mx, hx.before, lab.index) & lab.keep
    return kit.asked_stats(out, want)


def _hidden_forward(hidden, weight, bias, lab, temperature, want, labelled, tiles):
    entropy = bool(want & {"entropy", "raw_entropy"})
    hx = _HiddenExtras(hidden.shape[0], weight.shape[0], want, lab, labelled, hidden.device, result_dtype(hidden.dtype))
    logp, lse, ent, _ = _hidden._forward(hidden, weight, bias, lab, temperature, entropy, tiles, extras=hx)
    return _hidden_outputs(logp, lse, ent, hx, lab, labelled, want), lse, ent


class _HiddenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, lab, temperature, want, labelled, tiles):
        out, lse, ent = _hidden_forward(hidden, weight, bias, lab, temperature, want, labelled, tiles)
        ctx.save_for_backward(hidden, weight, bias, lse, None if ent is None else lse - ent)
        ctx.lab, ctx.options = lab, (temperature, tiles)
        ctx.set_materialize_grads(False)
        outs = _pack(out)
        _mark(ctx, outs)
        return outs

    @staticmethod
    @backward_without_autocast
    @first_order_only(_ONCE)
    @once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias, lse, sbar = ctx.saved_tensors
        temperature, tiles = ctx.options
        g_lp, g_ent = kit.stats_gradients(grads)
        need = tuple(ctx.needs_input_grad[:3])
        if (g_lp is None and g_ent is None) or not any(need):
            return (None,) * 8
        gh, gw, gb = _hidden._backward(hidden, weight, bias, ctx.lab, temperature, lse, sbar, g_lp, g_ent, need, tiles)
        return gh, gw, gb, None, None, None, None, None


def _hidden_plain(flat, weight, bias, labels, want, temperature, ignore_index, chunk_bytes):
    n = flat.shape[0]
    labelled = labels is not None
    if labelled:
        lab = _hidden._labels(labels.reshape(-1), ignore_index)
    else:  # a label everywhere masked: the label-free fields only
        zeros = torch.zeros(n, dtype=torch.int64, device=flat.device)
        lab = _hidden._Labels(zeros, torch.zeros(n, dtype=torch.bool, device=flat.device))
    tiles = _hidden.plan(n, weight.shape[0], flat.shape[1], flat.dtype,
                         _hidden.resolve_chunk_bytes(flat.device, chunk_bytes))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias)):
        return dict(zip(FIELDS, _HiddenStats.apply(flat, weight, bias, lab, temperature, want, labelled, tiles)))
    return _hidden_forward(flat, weight, bias, lab, temperature, want, labelled, tiles)[0]


# ------------------------------------------------------------- hidden, with the sampler's processing
def _hidden_blocks(hidden, weight, bias, plan, tiles, logits_dtype):
    for r0 in range(0, hidden.shape[0], plan.rows):
        r1 = min(hidden.shape[0], r0 + plan.rows)
        yield r0, _sampler._logits_block(hidden[r0:r1], weight, bias, tiles.cols, plan.cdt, logits_dtype)


class _FusedSamplerStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, plan, index, valid, want, tiles):
        out, stats, raw_stats = _rows_forward(_hidden_blocks(hidden, weight, bias, plan, tiles, plan.logits_dtype),
                                              hidden.shape[0], weight.shape[0], plan, index, valid, want,
                                              hidden.device)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.plan, ctx.stats, ctx.raw_stats, ctx.tiles = plan, stats, raw_stats, tiles
        ctx.index, ctx.valid = index, valid
        ctx.set_materialize_grads(False)
        outs = _pack(out)
        _mark(ctx, outs)
        return outs

    @staticmethod
    @backward_without_autocast
    @first_order_only(_ONCE)
    @once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        g = _grads_of(grads, ctx.index, ctx.valid, ctx.plan.truncates)
        if all(t is None for t in g) or not any(need):
            return (None,) * 8
        plan, tiles = ctx.plan, ctx.tiles
        n, v, cdt = hidden.shape[0], weight.shape[0], plan.cdt
        result = _hidden.Grads(hidden, weight, bias, cdt, need)
        rows = max(1, tiles.rows)
        for v0 in range(0, v, tiles.cols):  # as chunked's fused sampler op: vocabulary blocks outside
            v1 = min(v, v0 + tiles.cols)
            w = weight[v0:v1].to(cdt)
            result.start_block(v0, v1)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                h = hidden[r0:r1].to(cdt)
                src = _sampler._logits_block(h, weight, bias, tiles.cols, cdt, plan.logits_dtype, v0, v1)
                dz = _dz(src, slice(r0, r1), v0, plan, ctx.stats, ctx.raw_stats, ctx.index, g)
                del src
                result.add(r0, r1, v0, v1, dz, h, w)
                del dz
            result.end_block(v0, v1)
        return result.result() + (None,) * 5


def _hidden_sampled(flat, weight, bias, labels, want, temperature, ignore_index, budget, chunk_bytes, sampler):
    n, v = flat.shape[0], weight.shape[0]
    logits_dtype = sampler.pop("logits_dtype", None)
    plan = _sampler_plan((n, v), flat.dtype, flat.device, budget, False, labels is not None, want, temperature,
                         sampler)
    plan.logits_dtype = logits_dtype
    plan.rows = max(plan.rows, min(n, MIN_GEMM_ROWS)) if n else 1
    tiles = _hidden.plan(n, v, flat.shape[1], flat.dtype, _hidden.resolve_chunk_bytes(flat.device, chunk_bytes))
    index, valid = _index(labels, n, ignore_index)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias)):
        return dict(zip(FIELDS, _FusedSamplerStats.apply(flat, weight, bias, plan, index, valid, want, tiles)))
    return _rows_forward(_hidden_blocks(flat, weight, bias, plan, tiles, logits_dtype), n, v, plan, index, valid,
                         want, flat.device)[0]


# ------------------------------------------------------------------------------------ the op
def _per_row_split(x, labels, vocab, temperature, sampler, call):
    """A per-row call with rows whose truncation is all off: those rows as calls with numbers (the
    plain path, as chunked's other ops split them), the others with their values per row; then the
    fields put back in row order. None when there is nothing to split."""
    if sampler.get("softcap") is not None or sampler.get("keep") is not None \
            or sampler.get("logits_dtype") is not None or (labels is not None and labels.dim() == x.dim()):
        return None
    n = x.numel() // max(x.shape[-1], 1)
    plain = _sampler._plain_rows(n, vocab, temperature, sampler.get("top_k"), sampler.get("top_p"),
                                 sampler.get("min_p"))
    if plain is None:
        return None
    flat = x.reshape(n, x.shape[-1])
    flat_labels = None if labels is None else labels.reshape(n)
    groups, rest = _sampler._groups(plain, temperature)
    parts = []
    off = {k: None for k in ("top_k", "top_p", "min_p")}
    for rows, t in groups:
        parts.append((rows, call(flat[rows], None if flat_labels is None else flat_labels[rows], t,
                                 dict(sampler, **off))))
    if rest.numel():
        kw = dict(sampler, **{k: _sampler._take(sampler.get(k), rest) for k in off})
        parts.append((rest, call(flat[rest], None if flat_labels is None else flat_labels[rest],
                                 _sampler._take(temperature, rest), kw)))
    out = {}
    for name in parts[0][1]:
        full = None
        for rows, got in parts:
            piece = got[name].reshape(rows.shape[0])
            full = piece.new_zeros(n) if full is None else full
            full = full.index_copy(0, rows, piece)
        out[name] = full
    return out


def token_stats(inputs, labels, *, weight, bias, outputs, temperature, ignore_index, budget: int, fixed_shape: bool,
                chunk_bytes: Optional[int] = None, **sampler):
    """The backend op behind :func:`logprob_registry.token_stats` (inputs validated): a
    :class:`logprob_registry.TokenStats` of the fields in ``outputs``."""
    want = frozenset(outputs)
    if labels is None:
        want = want - LABELLED
    hidden = weight is not None
    lead = inputs.shape[:-1]
    vocab = weight.shape[0] if hidden else inputs.shape[-1]
    if vocab == 0 or lead.numel() == 0:  # nothing to chunk; the textbook formulas give the textbook answer
        got = kit.reference_function("token_stats")(inputs, labels, weight=weight, bias=bias, outputs=tuple(want),
                                                    temperature=temperature, ignore_index=ignore_index,
                                                    dtype=result_dtype(inputs.dtype), **sampler)
        return lr.TokenStats(**{k: v for k, v in got.items() if k in want})

    def run(x, y, t, kw):
        if hidden:
            flat = x.reshape(-1, x.shape[-1])
            if _sampler.used(kw, t) or (y is not None and y.dim() == x.dim()):
                return _hidden_sampled(flat, weight, bias, y, want, t, ignore_index, budget, chunk_bytes, dict(kw))
            return _hidden_plain(flat, weight, bias, y, want, t, ignore_index, chunk_bytes)
        if _sampler.used(kw, t) or (y is not None and y.dim() == x.dim()):
            return _sampled(x, y, want, t, ignore_index, budget, fixed_shape, kw)
        return _plain(x, y, want, t, ignore_index, budget, fixed_shape)

    got = _per_row_split(inputs, labels, vocab, temperature, sampler, run)
    if got is None:
        got = run(inputs, labels, temperature, sampler)
    label_shape = None if labels is None else labels.shape

    def shaped(name, value):
        if value is None:
            return None
        return value.view(label_shape if name in LABELLED else lead)

    return lr.TokenStats(**{name: shaped(name, got.get(name)) for name in FIELDS if name in want})


__all__ = ["token_stats"]
