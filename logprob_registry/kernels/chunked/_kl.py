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

``direction="jsd"`` (the generalized Jensen-Shannon divergence ``beta KL(t || m) + (1 - beta) KL(s ||
m)``, ``m = beta pt + (1 - beta) ps``) is no online one-pass quantity: ``log m`` needs both sides'
final log-probabilities. So it makes two passes over the tiles: the first accumulates both sides' max
and sum of ``exp(z - max)`` (as above), the second forms ``log p = (z - max) - log sum`` per side and
``log m = log beta + logaddexp(log pt, log ps + log((1 - beta) / beta))`` per entry
(:func:`_log_mixture`, not by ``torch.logaddexp``) and sums ``A = sum pt (log pt - log m)`` and
``B = sum ps (log ps - log m)`` per row (an entry without mass on a side adds nothing to that side's
sum; without mass on both, nothing at all): ``jsd = beta A + (1 - beta) B``. Its gradient:
``d jsd / d ps_j = (1 - beta) log(ps_j / m_j) =: g_j``, so ``d jsd / d student = ps (g - E_ps[g]) /
T`` with ``E_ps[g] = (1 - beta) B`` from the forward; the backward recomputes each tile of both
sides (one more pass), like the other directions.

Memory: a tile holds at most ``budget / 4`` bytes (fp32; three such tiles and a bool one live at
once), ``budget / 5`` for ``"jsd"`` (:data:`JSD_LIVE_TILES`: four and a bool one) and, for
bf16/fp16 weights, the fp32 copy of a vocabulary block of the weight is capped to the budget.
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
#: The same for ``direction="jsd"`` (four tiles and a bool one: both sides' log-probabilities, log m
#: and one side's probabilities).
JSD_LIVE_TILES = 5

__all__ = ["JSD_LIVE_TILES", "LIVE_TILES", "Tiles", "kl_divergence", "plan"]


class Tiles(NamedTuple):
    """``rows`` x ``cols`` tiles; ``fixed``: every tile padded to ``rows`` rows (accelerators)."""

    rows: int
    cols: int
    fixed: bool


def plan(v: int, dtype: torch.dtype, budget: int, fixed: bool, hidden_sizes: Tuple[int, ...] = (),
         live: int = LIVE_TILES) -> Tiles:
    """Tile shape for a vocabulary of ``v`` within ``budget`` bytes, independent of the number of
    rows, ``live`` tiles at once. ``hidden_sizes``: the hidden sizes of the sides given as hidden
    states whose weight is bf16/fp16 (an fp32 copy of a vocabulary block of it is also capped to the
    budget)."""
    elem = 8 if dtype == torch.float64 else 4
    cells = max(1, budget // (live * elem))
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


def _walk(tiles: Tiles, n: int, v: int, *blocks):
    """The tile loop: each block of columns ``v0:v1`` (each of ``blocks`` started on it, and ended
    after its rows where it has ``end_block``), each padded block of rows in it: ``(v0, v1, r0, pad,
    sl)``, ``sl`` the rows' slice of the per-row state."""
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        for b in blocks:
            b.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            pad = _pad(tiles, n, r0)
            yield v0, v1, r0, pad, slice(r0, r0 + pad)
        for b in blocks:
            if hasattr(b, "end_block"):
                b.end_block(v0, v1)


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
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, s, t):
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


def _log_probs(z: torch.Tensor, shift: torch.Tensor, log_sum: torch.Tensor, sl: slice) -> torch.Tensor:
    """``log p = (z - max) - log sum`` in place into ``z`` (``z - max`` exact near the max)."""
    return z.sub_(shift[sl].unsqueeze(1)).sub_(log_sum[sl].unsqueeze(1))


def _log_mixture(ls: torch.Tensor, lt: torch.Tensor, beta: float) -> torch.Tensor:
    """``log m = log(beta pt + (1 - beta) ps)``, a new tile (one more lives meanwhile): with ``u = ls +
    log((1 - beta) / beta)``, ``log beta + max(lt, u) + log1p(exp(-|lt - u|))``; NaN where neither side
    has mass (every use weighs it by a zero probability). Not ``torch.logaddexp``: on the CPU its
    vectorised loop and its scalar tail round differently, so a row's bits would depend on where it
    lies in the tile (batch invariance); ``exp``, ``log1p`` and ``maximum`` round alike in both."""
    u = ls.add(math.log1p(-beta) - math.log(beta))
    top = torch.maximum(lt, u)
    u.sub_(lt).abs_().neg_().exp_().log1p_()
    return u.add_(top).add_(math.log(beta))


def _jsd_forward(s: _Side, t: _Side, beta: float, tiles: Tiles):
    """Per row: the generalized JSD, each side's max and log sum of ``exp(z - max)`` (pass one) and
    ``E_ps[g]``, ``g = (1 - beta) log(ps / m)`` (pass two), as the backward needs them."""
    n, v, cd = s.n, s.v, s.cd
    dev = s.x.device
    size = n + tiles.rows
    os_, ot = _Online(size, dev, cd), _Online(size, dev, cd)
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, s, t):
        os_.add(sl, s.tile(r0, pad, v0, v1), keep=False)
        ot.add(sl, t.tile(r0, pad, v0, v1), keep=False)
    stats = (_safe(os_.m), os_.s.log(), _safe(ot.m), ot.s.log())
    ut = torch.zeros(size, device=dev, dtype=cd)  # sum pt (log pt - log m)
    us = torch.zeros(size, device=dev, dtype=cd)  # sum ps (log ps - log m)
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, s, t):
        ls = _log_probs(s.tile(r0, pad, v0, v1), stats[0], stats[1], sl)
        lt = _log_probs(t.tile(r0, pad, v0, v1), stats[2], stats[3], sl)
        lm = _log_mixture(ls, lt, beta)
        p = lt.exp()
        ut[sl] += _mul_zero(lt.sub_(lm), p).sum(1)
        torch.exp(ls, out=p)
        us[sl] += _mul_zero(ls.sub_(lm), p).sum(1)
        del ls, lt, lm, p
    jsd = beta * ut[:n] + (1 - beta) * us[:n]
    return jsd, tuple(x[:n] for x in stats) + ((1 - beta) * us[:n],)


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


def _backward(s: _Side, t: _Side, direction: str, beta: Optional[float], tiles: Tiles, stats, coef,
              grads: _StudentGrads):
    """The student's gradient; ``stats``: ``(lse_s, lse_t, E_ps[a - b] or None)`` from :func:`_forward`,
    or, for ``"jsd"``, ``(max_s, log sum_s, max_t, log sum_t, E_ps[g])`` from :func:`_jsd_forward`."""
    n, v, cd = s.n, s.v, s.cd
    size = n + tiles.rows
    reverse, jsd = direction == "reverse", direction == "jsd"

    def row(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(size, device=x.device, dtype=cd)
        out[:n] = x
        return out

    stats = tuple(None if x is None else row(x) for x in stats)
    if jsd:
        mean = stats[4]
    else:
        lse_s, lse_t, mean = stats
    dead = coef == 0  # masked rows and padding: exactly 0, whatever their logits
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, s, t, grads):
        h = s.hidden_rows(r0, pad) if s.w is not None else None
        a = s.tile(r0, pad, v0, v1, h)
        b = t.tile(r0, pad, v0, v1)
        if jsd:
            # ps (g - E_ps[g]), g = (1 - beta) (log ps - log m); 0 where ps is 0
            ls = _log_probs(a, stats[0], stats[1], sl)
            lm = _log_mixture(ls, _log_probs(b, stats[2], stats[3], sl), beta)
            ps = torch.exp(ls, out=b)
            dz = _mul_zero(ls.sub_(lm).mul_(1 - beta).sub_(mean[sl].unsqueeze(1)), ps)
            del lm
        elif reverse:
            # ps ((a - b) - E_ps[a - b]); 0 where ps is 0
            ps = a.sub(lse_s[sl].unsqueeze(1)).exp_()
            dz = _mul_zero(a.sub_(b).sub_(mean[sl].unsqueeze(1)), ps)
        else:
            ps = a.sub(lse_s[sl].unsqueeze(1)).exp_()
            dz = ps.sub_(b.sub_(lse_t[sl].unsqueeze(1)).exp_())
        dz.mul_(coef[sl].unsqueeze(1)).masked_fill_(dead[sl].unsqueeze(1), 0.0)
        grads.add(r0, pad, v0, v1, dz, h)
        del a, b, ps, dz


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
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, side):
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
    for v0, v1, r0, pad, sl in _walk(tiles, n, v, s, grads):
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


def _kl_terms(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """``sum p (log p - log q)`` over the last dim; 0 log 0 = 0, with a zero gradient too."""
    zero = lp == float("-inf")
    diff = torch.where(zero, torch.zeros((), dtype=lp.dtype, device=lp.device), lp - lq)
    return (lp.exp() * diff).sum(-1)


def _bucket_kl(ls: torch.Tensor, lt: torch.Tensor, direction: str, beta: Optional[float]) -> torch.Tensor:
    """KL (or JSD) over the last dim of bucket logits (differentiable torch ops)."""
    qs, qt = ls.log_softmax(-1), lt.log_softmax(-1)
    if direction != "jsd":
        return _kl_terms(qs, qt) if direction == "reverse" else _kl_terms(qt, qs)
    # log m as _log_mixture forms it, its inputs replaced where both sides have no mass (a NaN there
    # would reach the gradient)
    both = (qs == float("-inf")) & (qt == float("-inf"))
    zero = torch.zeros((), dtype=qs.dtype, device=qs.device)
    lt, u = torch.where(both, zero, qt), torch.where(both, zero, qs) + math.log((1 - beta) / beta)
    lm = torch.maximum(lt, u) + torch.log1p(torch.exp(-(lt - u).abs())) + math.log(beta)
    lm = torch.where(both, torch.full((), float("-inf"), dtype=qs.dtype, device=qs.device), lm)
    return beta * _kl_terms(qt, lm) + (1 - beta) * _kl_terms(qs, lm)


def _support_kl(student, teacher, sw, tw, support, keep, direction, beta, inv_t, tail, tiles, cd):
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
    return _bucket_kl(ls, lt, direction, beta)


# ------------------------------------------------------------------------------ the autograd function
def _dense_kl(student, sw, teacher, tw, direction: str, beta: Optional[float], inv_t: float, cd) -> torch.Tensor:
    """The KL by differentiable torch ops, materialising the logits: for a double backward only."""
    a = (student.to(cd) if sw is None else student.to(cd) @ sw.to(cd).t()) * inv_t
    b = (teacher.to(cd) if tw is None else teacher.to(cd) @ tw.to(cd).t()) * inv_t
    return _bucket_kl(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), direction, beta)


def _divergence(s: _Side, t: _Side, direction: str, beta: Optional[float], tiles: Tiles):
    """The per-row value and the statistics its backward needs (:func:`_backward`)."""
    if direction == "jsd":
        return _jsd_forward(s, t, beta, tiles)
    reverse = direction == "reverse"
    kl, lse_s, lse_t, mean = _forward(s, t, reverse, tiles)
    return kl, (lse_s, lse_t, mean if reverse else None)


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, weight, teacher, teacher_weight, direction, beta, inv_t, tiles):
        cd = result_dtype(student.dtype)
        s, t = _Side(student, weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        kl, stats = _divergence(s, t, direction, beta, tiles)
        ctx.save_for_backward(student, weight, teacher, teacher_weight, *stats)
        ctx.options = (direction, beta, inv_t, tiles)
        ctx.set_materialize_grads(False)
        return kl

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        student, weight, teacher, teacher_weight, *stats = ctx.saved_tensors
        direction, beta, inv_t, tiles = ctx.options
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if grad is None or not any(need):
            return (None,) * 8
        cd = result_dtype(student.dtype)
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            inputs = (student if need[0] else None, weight if need[1] else None)
            outputs = lambda: (_dense_kl(student, weight, teacher, teacher_weight, direction, beta, inv_t, cd),)
            return second_order_gradient(outputs, inputs, (grad.reshape(-1),)) + (None,) * 6
        s, t = _Side(student, weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        coef = _coefficient(grad, None, inv_t, s.n + tiles.rows, cd)
        grads = _StudentGrads(s, student, weight, need, tiles)
        _backward(s, t, direction, beta, tiles, stats, coef, grads)
        gx, gw = grads.result(student)
        return (gx if need[0] else None), (gw if need[1] else None), None, None, None, None, None, None


def kl_divergence(student: torch.Tensor, teacher: torch.Tensor, *, direction: str, temperature: float,
                  mask: Optional[torch.Tensor], tail: bool, student_weight: Optional[torch.Tensor] = None,
                  teacher_weight: Optional[torch.Tensor] = None, support: Optional[torch.Tensor] = None,
                  beta: Optional[float] = None, budget: int, fixed: bool) -> torch.Tensor:
    """The backend op behind :func:`logprob_registry.kl_divergence` (inputs validated, the teacher
    detached): float32 ``(...)`` (float64 for float64 input). ``beta``: direction ``"jsd"``'s
    (validated in (0, 1)). ``budget``: bytes of the tile buffers; ``fixed``: pad every tile to one
    shape (accelerators)."""
    lead = student.shape[:-1]
    cd = result_dtype(student.dtype)
    if direction == "jsd":
        beta = 0.5 if beta is None else float(beta)
    inv_t = 1.0 / temperature
    teacher = teacher.detach()
    teacher_weight = None if teacher_weight is None else teacher_weight.detach()
    v = student.shape[-1] if student_weight is None else student_weight.shape[0]
    low: List[int] = [w.shape[1] for w in (student_weight, teacher_weight)
                      if w is not None and w.dtype in (torch.float16, torch.bfloat16)]
    live = JSD_LIVE_TILES if direction == "jsd" and support is None else LIVE_TILES
    tiles = plan(v, student.dtype, budget, fixed, tuple(low), live)
    keep = None if mask is None else mask.reshape(-1)
    if support is not None:
        kl = _support_kl(student, teacher, student_weight, teacher_weight, support, keep, direction, beta, inv_t,
                         tail, tiles, cd)
    elif torch.is_grad_enabled() and (student.requires_grad or
                                      (student_weight is not None and student_weight.requires_grad)):
        kl = _KL.apply(student, student_weight, teacher, teacher_weight, direction, beta, inv_t, tiles)
    else:
        s, t = _Side(student, student_weight, cd, inv_t), _Side(teacher, teacher_weight, cd, inv_t)
        kl = _divergence(s, t, direction, beta, tiles)[0]
    if keep is not None:
        kl = torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return kl.view(lead)
