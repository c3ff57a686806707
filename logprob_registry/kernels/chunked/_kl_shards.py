"""``chunked``'s vocabulary-parallel ops of ``kl_divergence`` (``kl_shard_stats``, ``kl_shard_grad``;
see :mod:`logprob_registry.distributed.kl`).

One grid tile at a time (:func:`~logprob_registry.kit.grid`), a block of rows at a time: each
side's tile of ``z / T`` is loaded from its logits (a strided copy into a fresh ``(rows, TILE)``
buffer, the shard's columns at their places in the tile, -inf around them) or formed from its
hidden states and a whole tile of its weight shard (as :mod:`._shards` does for
``logprobs_from_hidden``), so neither ``(N, V_local)`` is ever formed. A tile's statistics are
maxima (exact; at least the ``references`` the core gives for a piece of a shared tile) and exact
sums (:func:`~logprob_registry.kit.exact_sum`; the cross term's terms at multiples of
``2**-CROSS_BITS``): they depend bitwise on the tile's own columns only, and the pieces of a tile
two shards share add up to its bits, so the merged result does not depend on the group size or the
split. The gradient is elementwise per column (the weight's: one whole tile's matmul per tile).
"""

from __future__ import annotations

from typing import Optional

import torch

from logprob_registry.kit import CROSS_BITS, Slot, add_matmul, exact_sum, grid, pad_rows, result_dtype

from ._hidden import resolve_chunk_bytes
from ._shards import _rows_per_chunk, _tile_logits, _weight_tile

NEG_INF = float("-inf")


def _tile_z(flat: torch.Tensor, weight_tile: Optional[torch.Tensor], r0: int, r1: int, slot: Slot, tile: int,
            temperature: float, acc: torch.dtype) -> torch.Tensor:
    """``z / T`` of rows ``[r0, r1)`` of one side's columns of ``slot``, at their places in a ``tile``
    of columns, -inf around them."""
    if weight_tile is not None:
        return _tile_logits(flat[r0:r1].to(acc), weight_tile, None, temperature, slot)
    z = torch.full((r1 - r0, tile), NEG_INF, dtype=acc, device=flat.device)
    z[:, slot.p0:slot.p1].copy_(flat[r0:r1, slot.c0:slot.c1])
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _exp_to_max(z: torch.Tensor, reference: Optional[torch.Tensor]):
    """``(m, e)``: the row max of ``z`` (rows, tile), at least ``reference`` (rows,) when given, and
    ``exp(z - m)`` (0 for -inf entries)."""
    m = z.amax(-1)
    if reference is not None:
        m = torch.maximum(m, reference.to(m.dtype))
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    return m, torch.exp(z - m_safe.unsqueeze(-1))


class _Side:
    """One side of the call: its rows (2-D) and its weight shard (None for logits)."""

    def __init__(self, x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
        self.flat = x.reshape(-1, x.shape[-1])
        self.weight = weight

    def tile(self, slot: Slot, acc: torch.dtype, tile: int) -> Optional[torch.Tensor]:
        return None if self.weight is None else _weight_tile(self.weight, None, slot, acc, tile)[0]


def _rows(acc: torch.dtype, budget: int, tile: int) -> int:
    return _rows_per_chunk(2 * tile, acc, budget)


def kl_shard_stats(student, teacher, *, student_weight, teacher_weight, vocab_start, tile, temperature, direction,
                   student_reference=None, teacher_reference=None, budget: Optional[int] = None):
    """Per row and grid tile: each side's max and exact sum of exponentials, and the exact cross term
    (see the op table)."""
    budget = budget or resolve_chunk_bytes(student.device)
    acc = result_dtype(student.dtype)
    lead = student.shape[:-1]
    s_side, t_side = _Side(student, student_weight), _Side(teacher, teacher_weight)
    n = s_side.flat.shape[0]
    width = student_weight.shape[0] if student_weight is not None else student.shape[-1]
    slots = grid(vocab_start, width, tile)
    nt = len(slots)
    out = [torch.empty(n, nt, dtype=acc if k in (0, 2) else torch.float64, device=student.device) for k in range(5)]
    refs = [None if r is None else r.reshape(-1) for r in (student_reference, teacher_reference)]
    rows = _rows(acc, budget, tile)
    forward = direction == "forward"
    for j, slot in enumerate(slots):
        ws, wt = s_side.tile(slot, acc, tile), t_side.tile(slot, acc, tile)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            zs = _tile_z(s_side.flat, ws, r0, r1, slot, tile, temperature, acc)
            zt = _tile_z(t_side.flat, wt, r0, r1, slot, tile, temperature, acc)
            ms, es = _exp_to_max(zs, None if refs[0] is None else refs[0][r0:r1])
            mt, et = _exp_to_max(zt, None if refs[1] is None else refs[1][r0:r1])
            weight, diff = (et, zt.sub_(zs)) if forward else (es, zs.sub_(zt))
            cross = diff.mul_(weight).masked_fill_(weight == 0, 0.0)
            for k, value in enumerate((ms, exact_sum(es), mt, exact_sum(et), exact_sum(cross, CROSS_BITS))):
                out[k][r0:r1, j] = value
    return tuple(x.view(*lead, nt) for x in out)


def kl_shard_grad(student, teacher, lse_student, lse_teacher, kl, grad_kl, mask, *, student_weight, teacher_weight,
                  vocab_start, tile, temperature, direction, needs_grad, budget: Optional[int] = None):
    """The student's gradient on this shard: its logits' (their dtype), or its share of the hidden gradient
    (compute dtype) and the weight shard's gradient (its dtype)."""
    budget = budget or resolve_chunk_bytes(student.device)
    acc = lse_student.dtype
    s_side, t_side = _Side(student, student_weight), _Side(teacher, teacher_weight)
    n = s_side.flat.shape[0]
    width = student_weight.shape[0] if student_weight is not None else student.shape[-1]
    lse_s, lse_t, kl = lse_student.reshape(-1, 1), lse_teacher.reshape(-1, 1), kl.reshape(-1, 1)
    g = grad_kl.reshape(-1, 1)
    live = None if mask is None else mask.reshape(-1, 1)
    hidden = student_weight is not None
    need_h, need_w = needs_grad if hidden else (True, False)
    dev = student.device
    if hidden:
        gh = torch.zeros(n, student.shape[-1], dtype=acc, device=dev) if need_h else None
        gw = torch.empty(student_weight.shape, dtype=student_weight.dtype, device=dev) if need_w else None
    else:
        out = torch.empty(student.shape, dtype=student.dtype, device=dev)
        flat_out = out.view(-1, width)
    rows = _rows(acc, budget, tile)
    for slot in grid(vocab_start, width, tile):
        c0, c1, p0, p1 = slot.c0, slot.c1, slot.p0, slot.p1
        ws, wt = s_side.tile(slot, acc, tile), t_side.tile(slot, acc, tile)
        gw_j = torch.zeros(tile, student.shape[-1], dtype=acc, device=dev) if hidden and need_w else None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            zs = _tile_z(s_side.flat, ws, r0, r1, slot, tile, temperature, acc)
            zt = _tile_z(t_side.flat, wt, r0, r1, slot, tile, temperature, acc)
            logps = zs.sub_(lse_s[r0:r1])
            ps = torch.exp(logps)
            logpt = zt.sub_(lse_t[r0:r1])
            if direction == "forward":
                dz = ps.sub_(logpt.exp_())
            else:
                dz = logps.sub_(logpt).sub_(kl[r0:r1]).mul_(ps).masked_fill_(ps == 0, 0.0)
            dz.mul_(g[r0:r1])
            if temperature != 1.0:
                dz.div_(temperature)
            if live is not None:
                dz.masked_fill_(~live[r0:r1], 0.0)
            if not hidden:
                flat_out[r0:r1, c0:c1].copy_(dz[:, p0:p1])
                continue
            if need_h:
                add_matmul(gh[r0:r1], dz, ws)
            if need_w:
                gw_j.addmm_(pad_rows(dz).t(), pad_rows(s_side.flat[r0:r1].to(acc)))
        if gw_j is not None:
            gw[c0:c1].copy_(gw_j[p0:p1])
    if not hidden:
        return out, None
    return None if gh is None else gh.view(student.shape), gw
