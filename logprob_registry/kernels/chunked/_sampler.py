"""The ``chunked`` backend's ops for calls that use the sampler's processing (``softcap``, ``top_k``,
``top_p``, ``min_p``, ``keep``), candidate labels ``(..., K)``, ``topk_logprobs`` or the fused op's
``logits_dtype``: the same semantics as :mod:`logprob_registry.reference`, a chunk of rows at a time.

A chunk of rows is processed whole: its processed logits ``z = softcap(x) / T`` (the softcap in
float64, rounded once; with the fused op's ``logits_dtype``, the engine's three ops each rounded to
it, as :func:`logprob_registry.truncation.softcapped`), the truncation decision on the float32
processed logits (the reference's own row-wise functions, ``kit.truncation_boundary`` and
``kit.kept_from_boundary``, so that the kept set is the reference's bit for bit, vLLM's
fp32 procedure; its ``top_p`` sorts this chunk's rows and no more), then the log-sum-exp over the
kept tokens, the labels' values, the entropy, or the top k. A chunk holds as many rows as fit
:data:`BYTES_PER_ELEMENT` bytes per logit in the workspace budget (at least one row): every
temporary of the chunk (the float32 processed logits, the float64 softcap, the sort's values and
int64 ids, the softmax and cumulative sum, the masks) counts in it, so memory stays bounded
whatever the vocabulary (a 262144-token row alone is 10 MiB of temporaries, an fp32 row being 1 MiB).

Per row, the forward keeps the log-sum-exp (``m``, ``log s``), the entropy and the truncation
boundary ``(t, j)`` (the kept tokens are those at or after it in ``(value, id)`` order), so the
backward recomputes the kept set of any tile of columns without sorting again. Gradients: a label
outside the kept set gets none; ``d z / d x = (1 - tanh(u)**2) / T`` with ``u = x / cap`` (rounded
to ``logits_dtype`` when given; each rounding straight through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from logprob_registry import kit
from logprob_registry.kit import (
    MIN_GEMM_ROWS,
    Sampler,
    backward_without_autocast,
    first_order_only,
    overlapping,
    result_dtype,
)

from . import _hidden
from . import _rows as loops

NEG_INF = float("-inf")
#: Bytes of workspace counted per logit of a chunk: a truncating call (the decision's sort, softmax,
#: cumulative sum and masks besides the processed logits), and one that only softcaps or gathers.
BYTES_PER_ELEMENT = {"truncate": 48, "plain": 24}


@dataclass
class Plan:
    """What one call computes (validated options) and how it is cut. ``temperature``, ``top_k``,
    ``top_p`` and ``min_p`` are numbers, or per row flat tensors ``(N,)`` (:func:`row_values`
    gives a chunk's)."""

    temperature: float
    softcap: Optional[float]
    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]
    keep: Optional[torch.Tensor]  # flat: a bool mask (N, V) or ids (N, K)
    topk: Optional[int]           # topk_logprobs' k
    want_logprobs: bool
    want_entropy: bool
    rows: int                     # rows per chunk
    fixed_shape: bool             # chunks padded to ``rows`` rows (accelerators)
    cdt: torch.dtype              # compute dtype
    logits_dtype: Optional[torch.dtype] = None  # the fused op's: the softcap runs in it
    order: Optional[str] = None   # sampler=: None (vLLM's order), "hf" or "sglang"

    @property
    def boundary(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def truncates(self) -> bool:
        return self.boundary or self.keep is not None


@dataclass
class Stats:
    """Per-row results of the forward, flat: what the outputs and the backward need."""

    m: torch.Tensor               # max of the kept processed logits (0 in a row with nothing kept)
    log_s: torch.Tensor           # log sum exp(z - m) over the kept tokens
    entropy: Optional[torch.Tensor] = None
    t: Optional[torch.Tensor] = None   # truncation boundary: value (float32) ...
    j: Optional[torch.Tensor] = None   # ... and id
    empty: Optional[torch.Tensor] = None  # rows where nothing is kept
    label_kept: Optional[torch.Tensor] = None  # whether each label (or topk id) is kept, (N, K)


def rows_per_chunk(vocab: int, truncates: bool, budget: int) -> int:
    per_row = max(1, vocab) * BYTES_PER_ELEMENT["truncate" if truncates else "plain"]
    return max(1, budget // per_row)


def make_plan(logits_shape, dtype: torch.dtype, device: torch.device, budget: int, *, temperature, softcap,
              top_k, top_p, min_p, keep, topk=None, want_logprobs=True, want_entropy=False,
              fixed_shape=False, sampler=None) -> Plan:
    vocab = logits_shape[-1]
    if keep is not None:
        keep = keep.reshape(-1, keep.shape[-1])
    temperature, top_k, top_p, min_p = (v.reshape(-1) if isinstance(v, torch.Tensor) else v
                                        for v in (temperature, top_k, top_p, min_p))
    plan = Plan(temperature, softcap, top_k, top_p, min_p, keep, topk, want_logprobs, want_entropy, 1,
                fixed_shape, result_dtype(dtype), order=sampler)
    plan.rows = rows_per_chunk(vocab, plan.truncates, budget)
    return plan


# ------------------------------------------------------------------------------ one block of rows
def _pad(t: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    short = rows - t.shape[0]
    if short <= 0:
        return t
    return torch.cat([t, t.new_full((short,) + tuple(t.shape[1:]), value)])


#: A padding row's per-row values: temperature 1, every truncation off.
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def row_values(plan: Plan, name: str, sl: slice, rows: int):
    """``plan``'s ``name`` for flat rows ``sl`` padded to ``rows`` rows: a number as is, per-row
    values as a tensor ``(rows,)`` (padding rows neutral, :data:`NEUTRAL`)."""
    value = getattr(plan, name)
    if not isinstance(value, torch.Tensor):
        return value
    return _pad(value[sl], rows, NEUTRAL[name])


def _divide_(t: torch.Tensor, temperature) -> torch.Tensor:
    """``t /= temperature`` (in place): a number as a 0-d tensor of ``t``'s dtype, per-row values
    as a column; both a true division, so a row divides alike either way."""
    if isinstance(temperature, torch.Tensor):
        return t.div_(temperature.to(t.dtype).unsqueeze(-1))
    if temperature == 1.0:
        return t
    return t.div_(torch.tensor(temperature, dtype=t.dtype, device=t.device))


def _engine_round_(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded in place as a ``dtype`` kernel rounds (float32, then ``dtype``):
    :func:`logprob_registry.truncation.engine_round`'s value."""
    return t.copy_(t.to(torch.float32).to(dtype))


def _softcap_in_dtype(src: torch.Tensor, plan: Plan, want_grad: bool):
    """``(s, d)``: the softcap of rows ``src`` as an engine whose lm_head runs in ``plan.logits_dtype``
    computes it (``x / cap``, ``tanh``, ``* cap``, each rounded to it;
    :func:`logprob_registry.truncation.softcapped`), in the compute dtype (a buffer of its own),
    and, if asked, its float64 derivative ``1 - tanh(u)**2`` at the rounded ``u = x / cap`` (0 at
    -inf)."""
    ld, cap = plan.logits_dtype, kit.float32_value(plan.softcap)
    f32_max = torch.finfo(torch.float32).max
    u = torch.empty(src.shape, dtype=torch.float64, device=src.device).copy_(src)
    neg = torch.isneginf(u)
    _engine_round_(u.clamp_(-f32_max, f32_max).div_(cap), ld)
    u.tanh_()  # now tanh(u), accurate
    s = torch.empty(src.shape, dtype=plan.cdt, device=src.device).copy_(u)
    _engine_round_(_engine_round_(s, ld).mul_(cap), ld).masked_fill_(neg, NEG_INF)
    d = None
    if want_grad:
        d = u.square_().neg_().add_(1.0).masked_fill_(neg, 0.0)
    return s, d


def _processed(src: torch.Tensor, plan: Plan, want_grad: bool = False, sl: slice = slice(None)):
    """``(z, y32, d)`` of rows ``src`` (flat rows ``sl``, padded as ``src`` is): the processed logits
    in the compute dtype (a buffer of their own), the float32 decision logits (``z`` itself when
    that is float32) and, if asked (and softcapped), the float64 derivative of the softcap. The same
    arithmetic as :func:`logprob_registry.truncation.processed_logits`."""
    cdt = plan.cdt
    temperature = row_values(plan, "temperature", sl, src.shape[0])
    cap = d = None
    if plan.softcap is not None and plan.logits_dtype is not None:
        z, d = _softcap_in_dtype(src, plan, want_grad)
        s = z
    elif plan.softcap is not None:
        cap = torch.empty(src.shape, dtype=torch.float64, device=src.device).copy_(src)
        neg = torch.isneginf(cap)
        cap.div_(plan.softcap).tanh_().mul_(plan.softcap).masked_fill_(neg, NEG_INF)
        del neg
        s = cap
        z = torch.empty(src.shape, dtype=cdt, device=src.device).copy_(s)
    else:
        s = src
        z = torch.empty(src.shape, dtype=cdt, device=src.device).copy_(s)
    y32 = None
    if plan.truncates and cdt != torch.float32:
        y32 = _divide_(torch.empty(src.shape, dtype=torch.float32, device=src.device).copy_(s), temperature)
    _divide_(z, temperature)
    if y32 is None and plan.truncates:
        y32 = z
    if cap is not None and want_grad:  # d softcap(x) / dx = 1 - tanh(x / cap)**2, 0 at -inf
        neg = torch.isneginf(cap)
        d = cap.div_(plan.softcap).square_().neg_().add_(1.0).masked_fill_(neg, 0.0)
    return z, y32, d


def _keep_tile(plan: Plan, sl: slice, rows: int, v0: int, v1: int) -> Optional[torch.Tensor]:
    """The caller's ``keep`` for flat rows ``sl`` and columns ``[v0, v1)``, as a bool mask of
    ``rows`` rows (padding rows keep everything)."""
    if plan.keep is None:
        return None
    part = plan.keep[sl]
    if part.dtype == torch.bool:
        mask = part[:, v0:v1]
    else:
        ids = part.long() - v0
        inside = (ids >= 0) & (ids < v1 - v0) & (part >= 0)
        index = torch.where(inside, ids, v1 - v0)
        mask = torch.zeros(part.shape[0], v1 - v0 + 1, dtype=torch.bool, device=part.device)
        mask.scatter_(1, index, True)
        mask = mask[:, : v1 - v0]
    return _pad(mask, rows, True)


def _kept(y32, plan: Plan, stats: Stats, sl: slice, v0: int = 0, decide: bool = False) -> Optional[torch.Tensor]:
    """The kept tokens of rows ``y32`` (flat rows ``sl``, columns from ``v0``): decided (and the
    boundary stored) when ``decide``, else from the stored boundary."""
    if not plan.truncates:
        return None
    rows = y32.shape[0]
    r = sl.stop - sl.start
    boundary = None
    if plan.boundary:
        if decide:
            top_k, top_p, min_p = (row_values(plan, name, sl, rows) for name in ("top_k", "top_p", "min_p"))
            t, j = kit.truncation_boundary(y32, top_k=top_k, top_p=top_p, min_p=min_p, order=plan.order)
            stats.t[sl], stats.j[sl] = t[:r], j[:r]
        else:
            t, j = _pad(stats.t[sl], rows, float("inf")), _pad(stats.j[sl], rows)
        boundary = (t, j)
    keep = _keep_tile(plan, sl, rows, v0, v0 + y32.shape[1])
    return kit.kept_from_boundary(y32, boundary, keep, first_id=v0, order=plan.order)


def _row_reduce(op, t: torch.Tensor) -> torch.Tensor:
    """``op(t, -1)``; a lone row is reduced as two (torch may split a single row's reduction across
    threads, and its sum would then depend on the batch around it)."""
    if t.shape[0] == 1:
        return op(t.expand(2, t.shape[1]), -1)[:1]
    return op(t, -1)


def forward_rows(src: torch.Tensor, sl: slice, plan: Plan, stats: Stats, index: Optional[torch.Tensor],
                 lp_out: Optional[torch.Tensor], extras=None) -> Optional[torch.Tensor]:
    """Forward of flat rows ``sl`` whose logits (or, for the fused op, logits block) are ``src``
    ``(r, V)``: fills ``stats`` and ``lp_out`` (the labels' values, or topk's), returns topk's ids.
    ``extras`` (token_stats, :mod:`._stats`): ``extras.raw(z, sl, r)`` sees the processed logits
    before truncation, ``extras.processed(z, e, s, kept, empty, sl, r)`` them over the kept tokens
    (``e = exp(z - m)``, ``s`` its row sum), both read-only, in the same pass."""
    r = src.shape[0]
    if plan.fixed_shape:
        src = _pad(src, plan.rows)
    z, y32, _ = _processed(src, plan, sl=sl)
    kept = _kept(y32, plan, stats, sl, decide=True)
    del y32
    if extras is not None:
        extras.raw(z, sl, r)
    empty = None
    if kept is not None:
        empty = ~kept.any(-1)
        z.masked_fill_(~kept, NEG_INF)
        z.masked_fill_(empty.unsqueeze(-1), 0.0)
        stats.empty[sl] = empty[:r]
    m = _row_reduce(torch.amax, z)
    e = torch.sub(z, m.unsqueeze(-1)).exp_()
    s = _row_reduce(torch.sum, e)
    log_s = s.log()
    stats.m[sl], stats.log_s[sl] = m[:r], log_s[:r]
    if extras is not None:
        extras.processed(z, e, s, kept, empty, sl, r)
    outside = None
    if kept is not None:
        nan = torch.full((), float("nan"), dtype=z.dtype, device=z.device)
        outside = torch.where(torch.isnan(m), nan, torch.full_like(nan, NEG_INF))[:r].unsqueeze(-1)
    ids = None
    if plan.topk is not None:
        full = z.sub(m.unsqueeze(-1)).sub_(log_s.unsqueeze(-1))[:r]
        if kept is not None:
            full = torch.where(kept[:r], full, outside)
        ids = kit.topk_ids(full, plan.topk)
        lp_out[sl] = full.gather(1, ids)
        if kept is not None:
            stats.label_kept[sl] = kept[:r].gather(1, ids)
        del full
    elif lp_out is not None:
        idx = index[sl]
        picked = z[:r].gather(1, idx)
        value = (picked - m[:r].unsqueeze(-1)) - log_s[:r].unsqueeze(-1)
        if kept is not None:
            label_kept = kept[:r].gather(1, idx)
            stats.label_kept[sl] = label_kept
            value = torch.where(label_kept, value, outside)
        lp_out[sl] = value
    if plan.want_entropy:
        pz = _row_reduce(torch.sum, z.sub_(m.unsqueeze(-1)).clamp_(min=torch.finfo(z.dtype).min).mul_(e))
        h = log_s - pz / s
        if empty is not None:
            h = h.masked_fill(empty, 0.0)
        stats.entropy[sl] = h[:r]
    return ids


def backward_tile(src: torch.Tensor, sl: slice, v0: int, plan: Plan, stats: Stats, index: Optional[torch.Tensor],
                  g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]) -> torch.Tensor:
    """``d loss / d src`` for flat rows ``sl`` and the columns ``[v0, v0 + src.shape[1])`` of their
    logits (``src``, r rows): the gradient of the labels' values (``g_lp``, ``(r, K)``, 0 where
    ignored) and of the entropy (``g_ent``, ``(r,)``), in the compute dtype, ``(r, cols)``."""
    r, cols = src.shape
    rows = plan.rows if plan.fixed_shape else r
    if plan.fixed_shape:
        src = _pad(src, rows)
    z, y32, dcap = _processed(src, plan, want_grad=True, sl=sl)
    kept = _kept(y32, plan, stats, sl, v0)
    del y32
    m, log_s = _pad(stats.m[sl], rows), _pad(stats.log_s[sl], rows)
    if kept is not None:
        empty = _pad(stats.empty[sl], rows, True)
        z.masked_fill_(~kept, NEG_INF)
        z.masked_fill_(empty.unsqueeze(-1), 0.0)
        m = m.masked_fill(empty, 0.0)
    logq = z.sub_(m.unsqueeze(-1)).sub_(log_s.unsqueeze(-1))
    q = torch.exp(logq)
    if kept is not None:
        q.masked_fill_(~kept, 0.0)
    coef = torch.zeros(rows, dtype=q.dtype, device=q.device)
    g = None
    if g_lp is not None:
        idx = _pad(index[sl], rows)
        g = _pad(g_lp.to(q.dtype), rows)
        inside = (idx >= v0) & (idx < v0 + cols)
        local = torch.where(inside, idx - v0, 0)
        if stats.label_kept is not None:  # a label outside the kept set has no gradient
            g = g * _pad(stats.label_kept[sl], rows, False)
        coef -= g.sum(-1)
        g = torch.where(inside, g, 0.0)
    dz = q * coef.unsqueeze(-1)
    if g_ent is not None:
        h = _pad(stats.entropy[sl], rows)
        term = logq.clamp_(min=torch.finfo(logq.dtype).min).add_(h.unsqueeze(-1)).mul_(q)
        dz.sub_(term.mul_(_pad(g_ent.to(q.dtype), rows).unsqueeze(-1)))
        del term
    del q, logq, z
    if g is not None:
        dz.scatter_add_(1, local, g)
    _divide_(dz, row_values(plan, "temperature", sl, rows))
    if dcap is not None:
        dz.mul_(dcap)
    return dz[:r]


# ------------------------------------------------------------------------------------- logits ops
def _new_stats(n: int, plan: Plan, device, labels_per_row: int = 0) -> Stats:
    cdt = plan.cdt
    stats = Stats(torch.empty(n, dtype=cdt, device=device), torch.empty(n, dtype=cdt, device=device))
    if plan.want_entropy:
        stats.entropy = torch.empty(n, dtype=cdt, device=device)
    if plan.boundary:
        stats.t = torch.empty(n, dtype=torch.float32, device=device)
        stats.j = torch.empty(n, dtype=torch.int64, device=device)
    if plan.truncates:
        stats.empty = torch.empty(n, dtype=torch.bool, device=device)
        if labels_per_row:
            stats.label_kept = torch.ones(n, labels_per_row, dtype=torch.bool, device=device)
    return stats


def _logits_forward(logits: torch.Tensor, plan: Plan, index: Optional[torch.Tensor], valid: Optional[torch.Tensor]):
    vocab = logits.shape[-1]
    n = logits.numel() // vocab
    per_row = plan.topk if plan.topk is not None else (index.shape[1] if index is not None else 0)
    stats = _new_stats(n, plan, logits.device, per_row)
    lp = None
    if plan.topk is not None:
        lp = torch.empty(n, plan.topk, dtype=plan.cdt, device=logits.device)
        index = torch.empty(n, plan.topk, dtype=torch.int64, device=logits.device)
    elif plan.want_logprobs:
        lp = torch.empty(index.shape, dtype=plan.cdt, device=logits.device)
    with torch.no_grad():
        for start, chunk in loops.chunks(logits, plan.rows):
            sl = slice(start, start + chunk.shape[0])
            ids = forward_rows(chunk, sl, plan, stats, index, lp)
            if ids is not None:
                index[sl] = ids
    if lp is not None and valid is not None:
        lp.masked_fill_(~valid, 0.0)
    return lp, index, stats


def _logits_backward(logits, out, plan: Plan, stats: Stats, index, valid, g_lp, g_ent, inplace: bool):
    vocab = logits.shape[-1]
    if g_lp is not None:
        g_lp = g_lp.reshape(index.shape)
        if valid is not None:
            g_lp = g_lp.masked_fill(~valid, 0.0)
    if g_ent is not None:
        g_ent = g_ent.reshape(-1)
    flat_out = None if inplace else out.view(-1, vocab)
    for start, chunk in loops.chunks(out if inplace else logits, plan.rows):
        r = chunk.shape[0]
        sl = slice(start, start + r)
        dz = backward_tile(chunk, sl, 0, plan, stats, index, None if g_lp is None else g_lp[sl],
                           None if g_ent is None else g_ent[sl])
        (chunk if inplace else flat_out[sl]).copy_(dz)
    return out


class _SamplerFunction(torch.autograd.Function):
    """Outputs ``(values or None, entropy or None, ids or None)``; backward by chunks."""

    @staticmethod
    def forward(ctx, logits, plan, index, valid, inplace):
        lp, index, stats = _logits_forward(logits, plan, index, valid)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.index, ctx.valid, ctx.inplace = plan, stats, index, valid, inplace
        ctx.set_materialize_grads(False)
        ids = index if plan.topk is not None else None
        if ids is not None:
            ctx.mark_non_differentiable(ids)
        return lp, stats.entropy if plan.want_entropy else None, ids

    @staticmethod
    @backward_without_autocast
    @first_order_only("backend 'chunked' with the sampler's options (or candidates, topk_logprobs)")
    @once_differentiable
    def backward(ctx, g_lp, g_ent, _g_ids):
        (logits,) = ctx.saved_tensors
        plan = ctx.plan
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        inplace = ctx.inplace and not overlapping(logits)
        if inplace:
            out = logits.detach()
        else:
            out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        _logits_backward(logits, out, plan, ctx.stats, ctx.index, ctx.valid, g_lp, g_ent, inplace)
        return out, None, None, None, None


def run(logits, labels, *, temperature, ignore_index=None, inplace_backward=False, want_logprobs=True,
        want_entropy=False, topk=None, budget: int, fixed_shape: bool, softcap=None, top_k=None, top_p=None,
        min_p=None, keep=None, sampler=None):
    """The logits ops: ``logprobs`` / ``entropy`` / ``logprobs_and_entropy`` / ``topk_logprobs``."""
    lead = logits.shape[:-1]
    if topk is None and softcap is None and keep is None and (labels is None or labels.dim() < logits.dim()):
        plain = _plain_rows(lead.numel(), logits.shape[-1], temperature, top_k, top_p, min_p)
        if plain is not None:
            return _split_logits(logits, labels, plain, temperature=temperature, ignore_index=ignore_index,
                                 want_logprobs=want_logprobs, want_entropy=want_entropy, budget=budget,
                                 fixed_shape=fixed_shape, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler)
    plan = make_plan(logits.shape, logits.dtype, logits.device, budget, temperature=temperature, softcap=softcap,
                     top_k=top_k, top_p=top_p, min_p=min_p, keep=keep, topk=topk, want_logprobs=want_logprobs,
                     want_entropy=want_entropy, fixed_shape=fixed_shape, sampler=sampler)
    index = valid = None
    label_shape = None
    if labels is not None and want_logprobs:
        label_shape = labels.shape
        candidates = labels.dim() == logits.dim()
        index = labels.reshape(-1, labels.shape[-1] if candidates else 1).long()
        if ignore_index is not None:
            valid = index != ignore_index
            index = index.masked_fill(~valid, 0)
    if torch.is_grad_enabled() and logits.requires_grad:
        lp, ent, ids = _SamplerFunction.apply(logits, plan, index, valid, inplace_backward)
    else:
        lp, index, stats = _logits_forward(logits, plan, index, valid)
        ent = stats.entropy
        ids = index if topk is not None else None
    if topk is not None:
        return lp.view(lead + (topk,)), ids.view(lead + (topk,))
    outs = []
    if want_logprobs:
        outs.append(lp.view(label_shape))
    if want_entropy:
        outs.append(ent.view(lead))
    return tuple(outs) if len(outs) > 1 else outs[0]


# ------------------------------------------------------------------------------- per-row values
# A row whose values switch every truncation off is, as a call with numbers, not a sampler call at
# all: the plain chunked code computes it (its own online log-sum-exp). So that such a row of a
# per-row call is bitwise that call, those rows go to the plain code, one call per distinct
# temperature; the other rows stay here, their values per row (vectorised).
def _per_row(*values) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _plain_rows(n: int, vocab: int, temperature, top_k, top_p, min_p) -> Optional[torch.Tensor]:
    """The bool mask ``(n,)`` of the rows of a per-row call whose truncations are all off (None
    when the call has no per-row value or no such row: nothing to split)."""
    if not _per_row(temperature, top_k, top_p, min_p) or n == 0:
        return None
    plain = None
    for value, off in ((top_k, None), (top_p, 1.0), (min_p, 0.0)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            return None  # a number in use: every row truncates
        flat = value.reshape(-1)
        row_off = ((flat <= 0) | (flat >= vocab)) if off is None else flat == off
        plain = row_off if plain is None else plain & row_off
    if plain is None:
        return torch.ones(n, dtype=torch.bool, device=temperature.device)
    return plain if bool(plain.any()) else None


def _groups(plain: torch.Tensor, temperature):
    """``[(rows, temperature as a number)]`` for the plain rows, one entry per distinct value, and
    the other rows (int64 indices)."""
    rows = plain.nonzero().squeeze(1)
    rest = (~plain).nonzero().squeeze(1)
    if not isinstance(temperature, torch.Tensor):
        return [(rows, temperature)], rest
    values = temperature.reshape(-1)[rows]
    return [(rows[values == t], float(t)) for t in torch.unique(values).tolist()], rest


def _take(value, rows):
    return value.reshape(-1)[rows] if isinstance(value, torch.Tensor) else value


def _assemble(n: int, parts, lead, like: torch.Tensor):
    """The outputs of every group ``[(rows, outputs tuple)]`` put back in row order (differentiable)."""
    outs = []
    for k in range(len(parts[0][1])):
        full = None
        for rows, out in parts:
            piece = out[k].reshape(rows.shape[0])
            full = piece.new_zeros(n) if full is None else full
            full = full.index_copy(0, rows, piece)
        outs.append(full.view(lead))
    return tuple(outs)


def _split_logits(logits, labels, plain, *, temperature, ignore_index, want_logprobs, want_entropy, budget,
                  fixed_shape, top_k, top_p, min_p, sampler):
    from logprob_registry.kernels import chunked  # the backend's ops, as a call with numbers runs them

    vocab, lead = logits.shape[-1], logits.shape[:-1]
    flat = logits.reshape(-1, vocab)
    flat_labels = None if labels is None else labels.reshape(-1)
    groups, rest = _groups(plain, temperature)
    parts = []
    for rows, t in groups:
        if not want_logprobs:
            out = chunked.entropy(flat[rows], temperature=t)
        else:
            op = chunked.logprobs_and_entropy if want_entropy else chunked.logprobs
            out = op(flat[rows], flat_labels[rows], temperature=t, ignore_index=ignore_index, inplace_backward=False)
        parts.append((rows, out if isinstance(out, tuple) else (out,)))
    if rest.numel():
        y = None if flat_labels is None else flat_labels[rest]
        out = run(flat[rest], y, temperature=_take(temperature, rest), ignore_index=ignore_index,
                  want_logprobs=want_logprobs, want_entropy=want_entropy, budget=budget, fixed_shape=fixed_shape,
                  top_k=_take(top_k, rest), top_p=_take(top_p, rest), min_p=_take(min_p, rest), sampler=sampler)
        parts.append((rest, out if isinstance(out, tuple) else (out,)))
    outs = _assemble(flat.shape[0], parts, lead, logits)
    return outs if len(outs) > 1 else outs[0]


# --------------------------------------------------------------------------------------- fused op
def _logits_block(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cols: int,
                  cdt: torch.dtype, logits_dtype: Optional[torch.dtype], v0: int = 0,
                  v1: Optional[int] = None) -> torch.Tensor:
    """``h @ weight[v0:v1].T + bias`` in the compute dtype, one vocabulary block at a time (bf16/fp16
    weights upcast a block at a time), rounded to ``logits_dtype`` when given."""
    v1 = weight.shape[0] if v1 is None else v1
    out = torch.empty(h.shape[0], v1 - v0, dtype=cdt, device=h.device)
    hc = h if h.dtype == cdt else h.to(cdt)
    for c0 in range(v0, v1, cols):
        c1 = min(v1, c0 + cols)
        w = weight[c0:c1].to(cdt)
        b = None if bias is None else bias[c0:c1].to(cdt)
        out[:, c0 - v0:c1 - v0] = _hidden._tile(hc, w, b, 1.0)
    if logits_dtype is not None:
        out.copy_(out.to(logits_dtype))
    return out


class _FusedSampler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, plan, index, valid, logits_dtype, tiles):
        lp, stats = _fused_forward(hidden, weight, bias, plan, index, valid, logits_dtype, tiles)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.plan, ctx.stats, ctx.index, ctx.valid = plan, stats, index, valid
        ctx.logits_dtype, ctx.tiles = logits_dtype, tiles
        ctx.set_materialize_grads(False)
        return lp, stats.entropy if plan.want_entropy else None

    @staticmethod
    @backward_without_autocast
    @first_order_only("backend 'chunked' (logprobs_from_hidden) with the sampler's options")
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        if (g_lp is None and g_ent is None) or not any(need):
            return (None,) * 8
        grads = _fused_backward(hidden, weight, bias, ctx.plan, ctx.stats, ctx.index, ctx.valid, ctx.logits_dtype,
                                ctx.tiles, g_lp, g_ent, need)
        return grads + (None,) * 5


def _fused_forward(hidden, weight, bias, plan: Plan, index, valid, logits_dtype, tiles):
    n = hidden.shape[0]
    stats = _new_stats(n, plan, hidden.device, index.shape[1])
    lp = torch.empty(index.shape, dtype=plan.cdt, device=hidden.device)
    with torch.no_grad():
        for r0 in range(0, n, plan.rows):
            r1 = min(n, r0 + plan.rows)
            src = _logits_block(hidden[r0:r1], weight, bias, tiles.cols, plan.cdt, logits_dtype)
            forward_rows(src, slice(r0, r1), plan, stats, index, lp)
            del src
    if valid is not None:
        lp.masked_fill_(~valid, 0.0)
    return lp, stats


def _fused_backward(hidden, weight, bias, plan: Plan, stats: Stats, index, valid, logits_dtype, tiles,
                    g_lp, g_ent, need):
    """Tile by tile (vocabulary blocks outside, blocks of rows inside), as the plain fused op: the kept
    set of a tile comes from the stored boundary, so nothing is sorted again."""
    n, v = hidden.shape[0], weight.shape[0]
    cdt = plan.cdt
    if g_lp is not None:
        g_lp = g_lp.reshape(index.shape)
        if valid is not None:
            g_lp = g_lp.masked_fill(~valid, 0.0)
    grads = _hidden.Grads(hidden, weight, bias, cdt, need)
    rows = max(1, tiles.rows)
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        w = weight[v0:v1].to(cdt)
        grads.start_block(v0, v1)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            h = hidden[r0:r1].to(cdt)
            src = _logits_block(h, weight, bias, tiles.cols, cdt, logits_dtype, v0, v1)
            dz = backward_tile(src, slice(r0, r1), v0, plan, stats, index,
                               None if g_lp is None else g_lp[r0:r1], None if g_ent is None else g_ent[r0:r1])
            del src
            grads.add(r0, r1, v0, v1, dz, h, w)
            del dz
        grads.end_block(v0, v1)
    return grads.result()


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy, budget: int,
                         chunk_bytes: Optional[int] = None, softcap=None, top_k=None, top_p=None, min_p=None,
                         keep=None, logits_dtype=None, sampler=None):
    """The fused op with the sampler's processing, candidates or ``logits_dtype``: the logits of a
    block of rows are formed whole (every vocabulary block), processed as the logits ops process a
    chunk, and reduced; backward goes tile by tile."""
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    if softcap is None and keep is None and logits_dtype is None and labels.dim() < hidden.dim():
        plain = _plain_rows(lead.numel(), weight.shape[0], temperature, top_k, top_p, min_p)
        if plain is not None:
            return _split_hidden(hidden, weight, labels, plain, bias=bias, temperature=temperature,
                                 ignore_index=ignore_index, return_entropy=return_entropy, budget=budget,
                                 chunk_bytes=chunk_bytes, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler)
    flat = hidden.reshape(-1, hdim)
    n, v = flat.shape[0], weight.shape[0]
    candidates = labels.dim() == hidden.dim()
    index = labels.reshape(n, labels.shape[-1] if candidates else 1).long()
    valid = None
    if ignore_index is not None:
        valid = index != ignore_index
        index = index.masked_fill(~valid, 0)
    plan = make_plan((n, v), hidden.dtype, hidden.device, budget, temperature=temperature, softcap=softcap,
                     top_k=top_k, top_p=top_p, min_p=min_p, keep=keep, want_entropy=return_entropy, sampler=sampler)
    plan.logits_dtype = logits_dtype
    plan.rows = max(plan.rows, min(n, MIN_GEMM_ROWS)) if n else 1
    tiles = _hidden.plan(n, v, hdim, hidden.dtype, _hidden.resolve_chunk_bytes(hidden.device, chunk_bytes))
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if grad:
        lp, ent = _FusedSampler.apply(flat, weight, bias, plan, index, valid, logits_dtype, tiles)
    else:
        lp, stats = _fused_forward(flat, weight, bias, plan, index, valid, logits_dtype, tiles)
        ent = stats.entropy
    lp = lp.view(labels.shape)
    return (lp, ent.view(lead)) if return_entropy else lp


def _split_hidden(hidden, weight, labels, plain, *, bias, temperature, ignore_index, return_entropy, budget,
                  chunk_bytes, top_k, top_p, min_p, sampler):
    """:func:`logprobs_from_hidden` of a per-row call with plain rows (see :func:`_plain_rows`)."""
    from logprob_registry.kernels import chunked  # the backend's op, as a call with numbers runs it

    lead = hidden.shape[:-1]
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    groups, rest = _groups(plain, temperature)
    parts = []
    for rows, t in groups:
        out = chunked.logprobs_from_hidden(flat[rows], weight, flat_labels[rows], bias=bias, temperature=t,
                                           ignore_index=ignore_index, return_entropy=return_entropy,
                                           chunk_bytes=chunk_bytes)
        parts.append((rows, out if isinstance(out, tuple) else (out,)))
    if rest.numel():
        out = logprobs_from_hidden(flat[rest], weight, flat_labels[rest], bias=bias,
                                   temperature=_take(temperature, rest), ignore_index=ignore_index,
                                   return_entropy=return_entropy, budget=budget, chunk_bytes=chunk_bytes,
                                   top_k=_take(top_k, rest), top_p=_take(top_p, rest), min_p=_take(min_p, rest),
                                   sampler=sampler)
        parts.append((rest, out if isinstance(out, tuple) else (out,)))
    outs = _assemble(flat.shape[0], parts, lead, hidden)
    return outs if len(outs) > 1 else outs[0]


def used(keywords, temperature=1.0) -> bool:
    """Whether a call's sampler keywords (and ``logits_dtype``) use anything of this module (else the
    plain chunked code runs, unchanged); a per-row ``temperature`` comes here too."""
    return Sampler.in_use(keywords) or keywords.get("logits_dtype") is not None or isinstance(temperature, torch.Tensor)


__all__ = ["BYTES_PER_ELEMENT", "Plan", "Stats", "backward_tile", "forward_rows", "logprobs_from_hidden",
           "make_plan", "rows_per_chunk", "run", "used"]

