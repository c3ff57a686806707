"""``kl_divergence`` for the ``chunked`` backend: the KL divergence of two tempered distributions per
position, in bounded memory, from logits or from hidden states whose logits are never formed.

Both sides are cut into the same tiles (a block of rows against a block of the vocabulary). A
tile's logits are formed in fp32 (fp64 for fp64 input): copied from the logits, or, for hidden
states, ``hidden @ weight.T`` for the tile (the weight block upcast once per vocabulary block). One
pass over the vocabulary per row accumulates, online (rescaled as the running maxima grow), both
sides' max and sum of ``exp(z - max)`` and the cross sum ``sum_j p_j (z_j - z'_j)`` of the side
that weighs it, so with ``a = student / T``, ``b = teacher / T``::

    forward  KL(t || s) = sum pt (b - a) - lse_t + lse_s
    reverse  KL(s || t) = sum ps (a - b) - lse_s + lse_t

(``lse_s - lse_t`` taken as ``(max_s - max_t) + (log S_s - log S_t)``, without the cancellation of
two large log-sum-exps). Entries with zero probability (``-inf`` logits) add nothing (``0 * log 0 =
0``). The backward keeps the inputs and two or three numbers per row and recomputes each tile:
``d KL / d student = (ps - pt) / T`` (forward) and ``ps ((a - b) - E_ps[a - b]) / T`` (reverse),
written into the student's gradient tile by tile, or, for hidden states, met with the weight block
and the hidden rows as in :mod:`._hidden`. Only the student gets a gradient.

``support`` (K ids per position): both sides reduce, in the same one pass, to K gathered logits
and the log-sum-exp of the complement (the support's columns masked out), ``(N, K + 1)`` bucket
logits, whose KL (over K + 1 buckets, or the K renormalised with ``tail=False``) is formed by
differentiable torch ops; the bucket logits' backward recomputes tiles likewise.

Memory: a tile holds at most ``budget / 4`` bytes (fp32; three such tiles and a bool one live at once) and,
for bf16/fp16 weights, the fp32 copy of a vocabulary block of the weight is capped to the budget.
Batch invariance: the tile shape does not depend on the number of rows; on the CPU a tile has at
least :data:`~logprob_registry.kit.MIN_GEMM_ROWS` rows (zero rows pad it), elsewhere every tile is
padded to the plan's row count, so that every kernel sees one shape whatever the batch.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from logprob_registry.kit import MIN_GEMM_ROWS, backward_without_autocast, result_dtype, second_order_gradient

#: The budget's share of one tile (three tiles, a bool tile and small vectors live at once).
LIVE_TILES = 4

__all__ = ["LIVE_TILES", "Tiles", "kl_divergence", "plan"]


class Tiles(NamedTuple):
    """``rows`` x ``cols`` tiles; ``fixed``: every tile padded to ``rows`` rows (accelerators)."""

    rows: int
    cols: int
    fixed: bool


def plan(v: int, dtype: torch.dtype, budget: int, fixed: bool, hidden_sizes: Tuple[int, ...] = ()) -> Tiles:
    """Tile shape for a vocabulary of ``v`` within ``budget`` bytes, independent of the number of
    rows. ``hidden_sizes``: the hidden sizes of the sides given as hidden states whose weight is
    bf16/fp16 (an fp32 copy of a vocabulary block of it is also capped to the budget)."""
    elem = 8 if dtype == torch.float64 else 4
    cells = max(1, budget // (LIVE_TILES * elem))
    cols = min(v, max(1, math.isqrt(cells)))
    for h in hidden_sizes:
        cols = min(cols, max(1, budget // (4 * max(h, 1))))
    rows = max(MIN_GEMM_ROWS, cells // cols)
    return Tiles(rows, cols, fixed)


class _Side:
    """One side's tiles: logits ``(..., V)`` or hidden states ``(..., H)`` with a weight ``(V, H)``,
    as ``(pad, cols)`` tiles of ``logits / T`` in the compute dtype ``cd`` (rows past ``n`` zero)."""

    def __init__(self, x: torch.Tensor, w: Optional[torch.Tensor], cd: torch.dtype, inv_t: float) -> None:
        self.w, self.cd, self.inv_t = w, cd, inv_t
        lead = x.shape[:-1]
        self.n = math.prod(lead)
        if w is None:
            try:
                self.x = x.view(self.n, x.shape[-1])
            except RuntimeError:  # leading dims that cannot be flattened (logits[:, :-1]): index them
                self.x = x
        else:
            self.x = x.reshape(self.n, x.shape[-1])  # hidden states: (N, H), never N x V
        self.v = x.shape[-1] if w is None else w.shape[0]
        self._block: Optional[torch.Tensor] = None

    def start_block(self, v0: int, v1: int) -> None:
        if self.w is not None:
            w = self.w[v0:v1]
            self._block = w if w.dtype == self.cd else w.to(self.cd)

    def hidden_rows(self, r0: int, pad: int) -> torch.Tensor:
        """Rows ``r0:r0+pad`` of the hidden states in ``cd`` (zero past the end)."""
        h = self.x[r0:r0 + pad]
        h = h if h.dtype == self.cd else h.to(self.cd)
        if h.shape[0] < pad:
            h = torch.cat([h, h.new_zeros(pad - h.shape[0], h.shape[1])])
        return h

    def tile(self, r0: int, pad: int, v0: int, v1: int, h: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``logits[r0:r0+pad, v0:v1] / T`` in ``cd``, a new tensor; ``h``: :meth:`hidden_rows`."""
        if self.w is not None:
            z = (self.hidden_rows(r0, pad) if h is None else h) @ self._block.t()
        else:
            r1 = min(self.n, r0 + pad)
            z = torch.empty(pad, v1 - v0, device=self.x.device, dtype=self.cd)
            if self.x.dim() == 2:
                z[:r1 - r0].copy_(self.x[r0:r1, v0:v1])
            else:
                rows = torch.arange(r0, r1, device=self.x.device)
                index = torch.unravel_index(rows, self.x.shape[:-1])
                z[:r1 - r0].copy_(self.x[..., v0:v1][index])
            if r1 - r0 < pad:
                z[r1 - r0:].zero_()
        if self.inv_t != 1.0:
            z.mul_(self.inv_t)
        return z


def _pad(tiles: Tiles, n: int, r0: int) -> int:
    k = min(tiles.rows, n - r0)
    return tiles.rows if tiles.fixed else max(k, MIN_GEMM_ROWS)


def _safe(m: torch.Tensor) -> torch.Tensor:
    return m.masked_fill(m == float("-inf"), 0.0)


class _Online:
    """A running max ``m`` and sum ``s`` of ``exp(z - m)`` per row (state of length ``n + rows``,
    so that a padded tile's rows always fit)."""

    def __init__(self, size: int, device, cd) -> None:
        self.m = torch.full((size,), float("-inf"), device=device, dtype=cd)
        self.s = torch.zeros(size, device=device, dtype=cd)

    def add(self, sl: slice, z: torch.Tensor, mask: Optional[torch.Tensor] = None, keep: bool = True):
        """Fold tile ``z`` (entries where ``mask`` is True left out) into rows ``sl``; returns
        ``exp(z - m_new)`` (zero where masked; None unless ``keep``: freed at once) and the rescale
        factor ``alpha`` of the old sums."""
        zz = z if mask is None else z.masked_fill(mask, float("-inf"))
        m_old = self.m[sl]
        m_new = torch.maximum(m_old, zz.amax(1))
        m_safe = _safe(m_new)
        alpha = (m_old - m_safe).exp_()
        e = zz.sub(m_safe.unsqueeze(1)).exp_()
        self.s[sl] = self.s[sl] * alpha + e.sum(1)
        self.m[sl] = m_new
        return (e if keep else None), alpha

    def lse(self, n: int) -> torch.Tensor:
        return _safe(self.m[:n]) + self.s[:n].log()


def _mul_zero(d: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``d * e`` in place into ``d``, an entry with ``e == 0`` (zero probability) giving 0 even where
    ``d`` is infinite (``0 * log 0 = 0``); a NaN input still reaches the row through its sums."""
    d.mul_(e)
    return d.masked_fill_(e == 0, 0.0)


def _forward(s: _Side, t: _Side, reverse: bool, tiles: Tiles):
    """Per row: the KL, both log-sum-exps and ``E[a - b]`` under the weighing side."""
    n, v, cd = s.n, s.v, s.cd
    dev = s.x.device
    size = n + tiles.rows
    os_, ot = _Online(size, dev, cd), _Online(size, dev, cd)
    u = torch.zeros(size, device=dev, dtype=cd)  # sum of exp(z_w - m_w) * (z_w - z_other)
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        s.start_block(v0, v1)
        t.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            pad = _pad(tiles, n, r0)
            sl = slice(r0, r0 + pad)
            a = s.tile(r0, pad, v0, v1)
            b = t.tile(r0, pad, v0, v1)
            # the other side first: its exp(z - m) is summed and freed before the weighing side's
            if reverse:
                ot.add(sl, b, keep=False)
                es, alpha = os_.add(sl, a)
                d = _mul_zero(a.sub_(b), es)
            else:
                os_.add(sl, a, keep=False)
                et, alpha = ot.add(sl, b)
                d = _mul_zero(b.sub_(a), et)
            u[sl] = u[sl] * alpha + d.sum(1)
            del a, b, d
    lse_s, lse_t = os_.lse(n), ot.lse(n)
    # lse_s - lse_t without the cancellation of two large numbers
    gap = (_safe(os_.m[:n]) - _safe(ot.m[:n])) + (os_.s[:n].log() - ot.s[:n].log())
    if reverse:
        mean = u[:n] / os_.s[:n]          # E_ps[a - b]
        kl = mean - gap
    else:
        mean = -(u[:n] / ot.s[:n])        # E_pt[a - b]
        kl = gap - mean
    return kl, lse_s, lse_t, mean


class _StudentGrads:
    """The student's gradient, tile by tile: the logits' own (a new tensor of their shape and dtype),
    or hidden and weight (fp32 accumulators rounded once at the end)."""

    def __init__(self, s: _Side, student: torch.Tensor, weight: Optional[torch.Tensor], need: Tuple[bool, bool],
                 tiles: Tiles) -> None:
        self.s = s
        cd, dev = s.cd, s.x.device
        self.need = need
        if weight is None:
            self.g = torch.empty(student.shape, dtype=student.dtype, device=dev)
            self.gflat = self.g.view(s.n, s.v)
            self.gh = self.gw = None
        else:
            self.g = None
            self.gh = torch.zeros(s.n + tiles.rows, s.x.shape[1], dtype=cd, device=dev) if need[0] else None
            self.gw = torch.zeros(weight.shape, dtype=weight.dtype, device=dev) if need[1] else None
            self.block: Optional[torch.Tensor] = None

    def start_block(self, v0: int, v1: int) -> None:
        if self.gw is not None:
            self.block = (self.gw[v0:v1] if self.gw.dtype == self.s.cd else
                          torch.zeros(v1 - v0, self.gw.shape[1], dtype=self.s.cd, device=self.gw.device))

    def add(self, r0: int, pad: int, v0: int, v1: int, dz: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        if self.g is not None:
            r1 = min(self.s.n, r0 + pad)
            self.gflat[r0:r1, v0:v1].copy_(dz[:r1 - r0])
            return
        if self.gh is not None:
            self.gh[r0:r0 + pad].addmm_(dz, self.s._block)
        if self.block is not None:
            self.block.addmm_(dz.t(), h)

    def end_block(self, v0: int, v1: int) -> None:
        if self.gw is not None and self.block is not None and self.gw.dtype != self.s.cd:
            self.gw[v0:v1].copy_(self.block)

    def result(self, student: torch.Tensor):
        if self.g is not None:
            return self.g, None
        gh = None if self.gh is None else self.gh[:self.s.n].to(student.dtype).view(student.shape)
        return gh, self.gw


def _coefficient(grad: torch.Tensor, keep: Optional[torch.Tensor], inv_t: float, size: int, cd) -> torch.Tensor:
    """Per row ``grad / T``, 0 at masked rows and past the end (length ``size``)."""
    n = grad.numel()
    c = torch.zeros(size, device=grad.device, dtype=cd)
    c[:n] = grad.reshape(-1).to(cd) * inv_t
    if keep is not None:
        c[:n].masked_fill_(~keep, 0.0)
    return c


def _backward(s: _Side, t: _Side, reverse: bool, tiles: Tiles, lse_s, lse_t, mean, coef, grads: _StudentGrads):
    n, v, cd = s.n, s.v, s.cd
    size = n + tiles.rows

    def row(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(size, device=x.device, dtype=cd)
        out[:n] = x
        return out

    lse_s, lse_t, mean = row(lse_s), row(lse_t), None if mean is None else row(mean)
    dead = coef == 0  # masked rows and padding: exactly 0, whatever their logits
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        s.start_block(v0, v1)
        t.start_block(v0, v1)
        grads.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            pad = _pad(tiles, n, r0)
            sl = slice(r0, r0 + pad)
            h = s.hidden_rows(r0, pad) if s.w is not None else None
            a = s.tile(r0, pad, v0, v1, h)
            b = t.tile(r0, pad, v0, v1)
            ps = a.sub(lse_s[sl].unsqueeze(1)).exp_()
            if reverse:
                # ps ((a - b) - E_ps[a - b]); 0 where ps is 0
                dz = _mul_zero(a.sub_(b).sub_(mean[sl].unsqueeze(1)), ps)
            else:
                dz = ps.sub_(b.sub_(lse_t[sl].unsqueeze(1)).exp_())
            dz.mul_(coef[sl].unsqueeze(1)).masked_fill_(dead[sl].unsqueeze(1), 0.0)
            grads.add(r0, pad, v0, v1, dz, h)
            del a, b, ps, dz
        grads.end_block(v0, v1)


# ------------------------------------------------------------------------------ support
def _hits(z: torch.Tensor, ids: torch.Tensor, inside: torch.Tensor, v0: int) -> torch.Tensor:
    """Bool tile, True at the support's columns (ids outside the tile go to a spare column, so that
    no two writes meet)."""
    c = z.shape[1]
    hit = torch.zeros(z.shape[0], c + 1, dtype=torch.bool, device=z.device)
    hit.scatter_(1, torch.where(inside, ids - v0, c), True)
    return hit[:, :c]


def _buckets_forward(side: _Side, support: torch.Tensor, tiles: Tiles):
    """Per row the K gathered logits ``/ T`` and the log-sum-exp of the complement (``-inf`` when
    the support is the whole vocabulary), in one pass over the vocabulary."""
    n, v, cd = side.n, side.v, side.cd
    dev = side.x.device
    size = n + tiles.rows
    k = support.shape[1]
    sup = torch.zeros(size, k, dtype=torch.long, device=dev)
    sup[:n] = support
    sup[n:] = -1
    on = _Online(size, dev, cd)
    got = torch.zeros(size, k, device=dev, dtype=cd)
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        side.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            pad = _pad(tiles, n, r0)
            sl = slice(r0, r0 + pad)
            z = side.tile(r0, pad, v0, v1)
            ids = sup[sl]
            inside = (ids >= v0) & (ids < v1)
            col = (ids - v0).clamp_(0, v1 - v0 - 1)
            got[sl] = torch.where(inside, z.gather(1, col), got[sl])
            on.add(sl, z, _hits(z, ids, inside, v0))
            del z
    return got[:n], on.lse(n)


def _buckets_backward(s: _Side, support: torch.Tensor, tail_lse: torch.Tensor, g_got: torch.Tensor,
                      g_tail: torch.Tensor, keep: Optional[torch.Tensor], tiles: Tiles, grads: _StudentGrads):
    n, v, cd = s.n, s.v, s.cd
    dev = s.x.device
    size = n + tiles.rows
    k = support.shape[1]
    sup = torch.full((size, k), -1, dtype=torch.long, device=dev)
    sup[:n] = support
    inv_t = s.inv_t
    gg = _coefficient(g_got, None, inv_t, size * k, cd).view(size, k)[:size]
    gt = _coefficient(g_tail, None, inv_t, size, cd)
    lse = torch.zeros(size, device=dev, dtype=cd)
    lse[:n] = tail_lse
    if keep is not None:
        gg[:n].masked_fill_(~keep.unsqueeze(1), 0.0)
        gt[:n].masked_fill_(~keep, 0.0)
    dead = gt == 0
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        s.start_block(v0, v1)
        grads.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            pad = _pad(tiles, n, r0)
            sl = slice(r0, r0 + pad)
            h = s.hidden_rows(r0, pad) if s.w is not None else None
            z = s.tile(r0, pad, v0, v1, h)
            ids = sup[sl]
            inside = (ids >= v0) & (ids < v1)
            col = (ids - v0).clamp_(0, v1 - v0 - 1)
            # the tail's share: g_tail exp(z - lse_tail) over the complement
            dz = z.sub_(lse[sl].unsqueeze(1)).exp_().mul_(gt[sl].unsqueeze(1))
            dz.masked_fill_(dead[sl].unsqueeze(1) | _hits(dz, ids, inside, v0), 0.0)
            dz.scatter_add_(1, col, torch.where(inside, gg[sl], torch.zeros((), device=dev, dtype=cd)))
            grads.add(r0, pad, v0, v1, dz, h)
            del z, dz
        grads.end_block(v0, v1)


class _Buckets(torch.autograd.Function):
    """The student's ``(N, K)`` gathered logits and ``(N,)`` complement log-sum-exp (both ``/ T``),
    differentiable; backward recomputes tiles."""

    @staticmethod
    def forward(ctx, student, weight, support, keep, inv_t, tiles):
        s = _Side(student, weight, result_dtype(student.dtype), inv_t)
        got, tail = _buckets_forward(s, support, tiles)
        ctx.save_for_backward(student, weight, support, keep, tail)
        ctx.options = (inv_t, tiles)
        return got, tail

    @staticmethod
    @backward_without_autocast
    def backward(ctx, g_got, g_tail):
        student, weight, support, keep, tail = ctx.saved_tensors
        inv_t, tiles = ctx.options
        if torch.is_grad_enabled():
            raise RuntimeError("chunked's kl_divergence with support= does not support double backward "
                               "(create_graph=True); use backend='naive'")
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        cd = result_dtype(student.dtype)
        s = _Side(student, weight, cd, inv_t)
        if g_got is None:
            g_got = torch.zeros(s.n, support.shape[1], device=student.device, dtype=cd)
        if g_tail is None:
            g_tail = torch.zeros(s.n, device=student.device, dtype=cd)
        grads = _StudentGrads(s, student, weight, need, tiles)
        _buckets_backward(s, support, tail, g_got, g_tail, keep, tiles, grads)
        gx, gw = grads.result(student)
        return (gx if need[0] else None), (gw if need[1] else None), None, None, None, None


def _bucket_kl(ls: torch.Tensor, lt: torch.Tensor, reverse: bool) -> torch.Tensor:
    """KL over the last dim of bucket logits (differentiable torch ops)."""
    qs, qt = ls.log_softmax(-1), lt.log_softmax(-1)
    lp, lq = (qs, qt) if reverse else (qt, qs)
    zero = lp == float("-inf")  # 0 log 0 = 0, with a zero gradient too
    diff = torch.where(zero, torch.zeros((), dtype=lp.dtype, device=lp.device), lp - lq)
    return (lp.exp() * diff).sum(-1)


def _support_kl(student, teacher, sw, tw, support, keep, reverse, inv_t, tail, tiles, cd):
    n = math.prod(student.shape[:-1])
    sup = support.reshape(n, support.shape[-1]).long()
    t_side = _Side(teacher, tw, cd, inv_t)
    with torch.no_grad():
        t_got, t_tail = _buckets_forward(t_side, sup, tiles)
    if torch.is_grad_enabled() and (student.requires_grad or (sw is not None and sw.requires_grad)):
        s_got, s_tail = _Buckets.apply(student, sw, sup, keep, inv_t, tiles)
    else:
        s_got, s_tail = _buckets_forward(_Side(student, sw, cd, inv_t), sup, tiles)
    if tail:
        ls = torch.cat([s_got, s_tail.unsqueeze(1)], 1)
        lt = torch.cat([t_got, t_tail.unsqueeze(1)], 1)
    else:
        ls, lt = s_got, t_got
    return _bucket_kl(ls, lt, reverse)


# ------------------------------------------------------------------------------ the autograd function
def _dense_kl(student, sw, teacher, tw, reverse: bool, inv_t: float, cd) -> torch.Tensor:
    """The KL by differentiable torch ops, materialising the logits: for a double backward only."""
    a = (student.to(cd) if sw is None else student.to(cd) @ sw.to(cd).t()) * inv_t
    b = (teacher.to(cd) if tw is None else teacher.to(cd) @ tw.to(cd).t()) * inv_t
    return _bucket_kl(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), reverse)


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, weight, teacher, teacher_weight, reverse, inv_t, tiles):
        cd = result_dtype(student.dtype)
        s, t = _Side(student, weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        kl, lse_s, lse_t, mean = _forward(s, t, reverse, tiles)
        ctx.save_for_backward(student, weight, teacher, teacher_weight, lse_s, lse_t, mean if reverse else None)
        ctx.options = (reverse, inv_t, tiles)
        ctx.set_materialize_grads(False)
        return kl

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        student, weight, teacher, teacher_weight, lse_s, lse_t, mean = ctx.saved_tensors
        reverse, inv_t, tiles = ctx.options
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if grad is None or not any(need):
            return (None,) * 7
        cd = result_dtype(student.dtype)
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            inputs = (student if need[0] else None, weight if need[1] else None)
            outputs = lambda: (_dense_kl(student, weight, teacher, teacher_weight, reverse, inv_t, cd),)
            return second_order_gradient(outputs, inputs, (grad.reshape(-1),)) + (None,) * 5
        s, t = _Side(student, weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        coef = _coefficient(grad, None, inv_t, s.n + tiles.rows, cd)
        grads = _StudentGrads(s, student, weight, need, tiles)
        _backward(s, t, reverse, tiles, lse_s, lse_t, mean, coef, grads)
        gx, gw = grads.result(student)
        return (gx if need[0] else None), (gw if need[1] else None), None, None, None, None, None


def kl_divergence(student: torch.Tensor, teacher: torch.Tensor, *, direction: str, temperature: float,
                  mask: Optional[torch.Tensor], tail: bool, student_weight: Optional[torch.Tensor] = None,
                  teacher_weight: Optional[torch.Tensor] = None, support: Optional[torch.Tensor] = None,
                  budget: int, fixed: bool) -> torch.Tensor:
    """The backend op behind :func:`logprob_registry.kl_divergence` (inputs validated, the teacher
    detached): float32 ``(...)`` (float64 for float64 input). ``budget``: bytes of the tile buffers;
    ``fixed``: pad every tile to one shape (accelerators)."""
    lead = student.shape[:-1]
    cd = result_dtype(student.dtype)
    reverse = direction == "reverse"
    inv_t = 1.0 / temperature
    teacher = teacher.detach()
    teacher_weight = None if teacher_weight is None else teacher_weight.detach()
    v = student.shape[-1] if student_weight is None else student_weight.shape[0]
    low: List[int] = [w.shape[1] for w in (student_weight, teacher_weight)
                      if w is not None and w.dtype in (torch.float16, torch.bfloat16)]
    tiles = plan(v, student.dtype, budget, fixed, tuple(low))
    keep = None if mask is None else mask.reshape(-1)
    if support is not None:
        kl = _support_kl(student, teacher, student_weight, teacher_weight, support, keep, reverse, inv_t, tail,
                         tiles, cd)
    elif torch.is_grad_enabled() and (student.requires_grad or
                                      (student_weight is not None and student_weight.requires_grad)):
        kl = _KL.apply(student, student_weight, teacher, teacher_weight, reverse, inv_t, tiles)
    else:
        s, t = _Side(student, student_weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        kl = _forward(s, t, reverse, tiles)[0]
    if keep is not None:
        kl = torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return kl.view(lead)
