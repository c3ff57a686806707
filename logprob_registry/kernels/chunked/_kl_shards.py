"""``chunked``'s vocabulary-parallel ops of ``kl_divergence`` (``kl_shard_stats``, ``kl_shard_grad``;
see :mod:`logprob_registry.distributed.kl`).

One tile of columns at a time, a block of rows at a time: each side's tile of ``z / T`` is loaded
from its logits (a strided copy into a fresh ``(rows, TILE)`` buffer, padded with -inf) or formed
from its hidden states and one tile of its weight shard (as :mod:`._shards` does for
``logprobs_from_hidden``), so neither ``(N, V_local)`` is ever formed. A tile's statistics are a max
(exact) and sums by :func:`~logprob_registry.kit.tree_sum_` over the tile's own columns: they depend
bitwise on those columns only, whatever the shard, so the merged result does not depend on the
group size when shards start at multiples of the tile. The gradient is elementwise per column.
"""

from __future__ import annotations

from typing import Optional

import torch

from logprob_registry.kit import Slot, add_matmul, n_tiles, pad_rows, result_dtype, tree_sum_

from ._hidden import resolve_chunk_bytes
from ._shards import _rows_per_chunk, _tile_logits, _weight_tile

NEG_INF = float("-inf")


def _tile_z(flat: torch.Tensor, weight_tile: Optional[torch.Tensor], r0: int, r1: int, c0: int, c1: int,
            width: int, temperature: float, acc: torch.dtype) -> torch.Tensor:
    """``z / T`` of rows ``[r0, r1)`` and columns ``[c0, c1)`` of one side, padded with -inf to ``width``."""
    if weight_tile is not None:
        z = _tile_logits(flat[r0:r1].to(acc), weight_tile, None, temperature)
        return z if z.shape[1] == width else torch.nn.functional.pad(z, (0, width - z.shape[1]), value=NEG_INF)
    z = torch.empty(r1 - r0, width, dtype=acc, device=flat.device)
    z[:, :c1 - c0].copy_(flat[r0:r1, c0:c1])
    if c1 - c0 < width:
        z[:, c1 - c0:].fill_(NEG_INF)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _exp_to_max(z: torch.Tensor):
    """``(m, e)``: the row max of ``z`` (rows, tile) and ``exp(z - m)`` (0 for -inf entries)."""
    m = z.amax(-1)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    return m, torch.exp(z - m_safe.unsqueeze(-1))


class _Side:
    """One side of the call: its rows (2-D) and its weight shard (None for logits)."""

    def __init__(self, x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
        self.flat = x.reshape(-1, x.shape[-1])
        self.weight = weight

    def tile(self, c0: int, c1: int, acc: torch.dtype) -> Optional[torch.Tensor]:
        return None if self.weight is None else _weight_tile(self.weight, None, Slot(c0, c1, 0), acc, c1 - c0)[0]


def _rows(acc: torch.dtype, budget: int, tile: int) -> int:
    return _rows_per_chunk(2 * tile, acc, budget)


def kl_shard_stats(student, teacher, *, student_weight, teacher_weight, vocab_start, tile, temperature, direction,
                   budget: Optional[int] = None):
    """Per row and tile: each side's max and sum of exponentials, and the cross term (see the op table)."""
    budget = budget or resolve_chunk_bytes(student.device)
    acc = result_dtype(student.dtype)
    lead = student.shape[:-1]
    s_side, t_side = _Side(student, student_weight), _Side(teacher, teacher_weight)
    n = s_side.flat.shape[0]
    width = student_weight.shape[0] if student_weight is not None else student.shape[-1]
    nt = n_tiles(width, tile)
    out = [torch.empty(n, nt, dtype=acc, device=student.device) for _ in range(5)]
    rows = _rows(acc, budget, tile)
    forward = direction == "forward"
    for j in range(nt):
        c0, c1 = j * tile, min(width, (j + 1) * tile)
        ws, wt = s_side.tile(c0, c1, acc), t_side.tile(c0, c1, acc)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            zs = _tile_z(s_side.flat, ws, r0, r1, c0, c1, tile, temperature, acc)
            zt = _tile_z(t_side.flat, wt, r0, r1, c0, c1, tile, temperature, acc)
            ms, es = _exp_to_max(zs)
            mt, et = _exp_to_max(zt)
            weight, diff = (et, zt.sub_(zs)) if forward else (es, zs.sub_(zt))
            cross = diff.mul_(weight).masked_fill_(weight == 0, 0.0)
            for k, value in enumerate((ms, tree_sum_(es), mt, tree_sum_(et), tree_sum_(cross))):
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
    for j in range(n_tiles(width, tile)):
        c0, c1 = j * tile, min(width, (j + 1) * tile)
        ws, wt = s_side.tile(c0, c1, acc), t_side.tile(c0, c1, acc)
        gw_j = torch.zeros(c1 - c0, student.shape[-1], dtype=acc, device=dev) if hidden and need_w else None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            zs = _tile_z(s_side.flat, ws, r0, r1, c0, c1, c1 - c0, temperature, acc)
            zt = _tile_z(t_side.flat, wt, r0, r1, c0, c1, c1 - c0, temperature, acc)
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
                flat_out[r0:r1, c0:c1].copy_(dz)
                continue
            if need_h:
                add_matmul(gh[r0:r1], dz, ws)
            if need_w:
                gw_j.addmm_(pad_rows(dz).t(), pad_rows(s_side.flat[r0:r1].to(acc)))
        if gw_j is not None:
            gw[c0:c1].copy_(gw_j)
    if not hidden:
        return out, None
    return None if gh is None else gh.view(student.shape), gw
