"""The tile protocol shared by the core and the backends' shard ops.

A shard's columns are cut in tiles of :data:`TILE` columns from its first column (the last tile may
be shorter). Per row and tile a backend returns ``m = max z``, ``s = sum e`` and ``t = sum e log e``
with ``e = exp(z - m)``; the core gathers them and merges them in global tile order. When every
shard starts at a multiple of ``TILE``, the global tiles are the same whatever the number of
ranks, so a backend whose tile statistics depend (bitwise) on the tile's own columns only makes
the whole result independent of the group size: a gather moves bytes and never rounds.

:func:`tree_sum` is the fixed-order reduction used for that (only elementwise adds, so an output's
bits depend on its own inputs whatever the shape, device or thread count); :func:`tile_stats_`
is the pure-PyTorch tile statistics that ``chunked`` uses.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

#: Columns per tile. 4096 keeps a tile's reduction below torch's CPU grain size (32768 elements),
#: so even a plain ``sum`` is never split across threads; it is also a common multiple of the
#: vocabulary shards of real models (a shard of 151936 / 8 columns is not, and is still correct).
TILE = 4096
NEG_INF = float("-inf")


def n_tiles(width: int, tile: int = TILE) -> int:
    """Tiles of a shard of ``width`` columns."""
    return -(-width // tile)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_sum(y: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by halving: ``y[..., :w] + y[..., w:]`` until one is
    left. Out of place; see :func:`tree_sum_` for the same adds in place."""
    w = y.shape[-1]
    if w & (w - 1):
        raise ValueError(f"tree_sum needs a power-of-two last dim, got {w}; pad with zeros first")
    while w > 1:
        w //= 2
        y = y[..., :w] + y[..., w:]
    return y[..., 0]


def tree_sum_(y: torch.Tensor) -> torch.Tensor:
    """:func:`tree_sum` in place: ``y`` (last dim a power of two) is overwritten and its first column,
    a view, holds the sums. The same adds in the same pairs, so the same bits, without temporaries."""
    w = y.shape[-1]
    if w & (w - 1):
        raise ValueError(f"tree_sum_ needs a power-of-two last dim, got {w}; pad with zeros first")
    while w > 1:
        w //= 2
        y[..., :w].add_(y[..., w:2 * w])
    return y[..., 0]


def tiled(z: torch.Tensor, tile: int) -> torch.Tensor:
    """``z`` (rows, width) as (rows, n_tiles, tile): a view when ``width`` is a multiple of ``tile``,
    else a copy with the last tile padded by ``-inf`` (columns that add nothing)."""
    rows, width = z.shape
    nt = n_tiles(width, tile)
    if nt * tile != width:
        z = torch.nn.functional.pad(z, (0, nt * tile - width), value=NEG_INF)
    return z.reshape(rows, nt, tile)


def tile_stats_(z: torch.Tensor, with_entropy: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(m, s, t)`` of ``z`` (..., tile) with a power-of-two ``tile``, each (...) ; ``z`` is overwritten.

    ``m = max z`` (exact), ``s = sum exp(z - m)``, ``t = sum exp(z - m) (z - m)`` (0 for -inf
    entries), both summed by :func:`tree_sum_`; a tile of nothing but -inf gives ``(-inf, 0, 0)``
    and a NaN anywhere in a tile makes all three NaN. The outputs are fresh tensors.
    """
    m = z.amax(-1)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    d = z.sub_(m_safe.unsqueeze(-1))
    if not with_entropy:
        return m, tree_sum_(d.exp_()).clone(), None
    e = torch.exp(d)
    ed = d.mul_(e).masked_fill_(e == 0, 0.0)  # e * d, and 0 where e is 0 (0 * -inf for masked entries)
    return m, tree_sum_(e).clone(), tree_sum_(ed).clone()


def label_columns(labels: torch.Tensor, vocab_start: int, width: int,
                  ignore_index: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owned, column)`` for flat labels: whether this shard holds the label (and it is not
    ``ignore_index``), and its column in the shard (0 where not owned, so always a safe index)."""
    lab = labels.reshape(-1).long()
    owned = (lab >= vocab_start) & (lab < vocab_start + width)
    if ignore_index is not None:
        owned &= lab != ignore_index
    return owned, torch.where(owned, lab - vocab_start, torch.zeros_like(lab))
