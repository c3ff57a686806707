"""Merging the gathered tile statistics into per-row results, the same way on every rank.

Every rank holds the same ``(N, T)`` statistics in global tile order after the gather, and runs the
same code on them, so every rank gets the same bits. The merge rescales each tile to the row
maximum (a max is exact) and sums over tiles with :func:`~.tiles.tree_sum` over the tile index
padded with zeros to a power of two: a fixed binary tree whatever the number of ranks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .tiles import NEG_INF, next_power_of_two, tree_sum


def _tree_over_tiles(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    padded = next_power_of_two(width)
    if padded != width:
        x = torch.nn.functional.pad(x, (0, padded - width), value=0.0)
    return tree_sum(x)


def merge(m: torch.Tensor, s: torch.Tensor, t: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(lse, entropy)`` per row from tile statistics ``m, s, t`` of shape (N, T), global order.

    With ``M = max m`` and ``w = exp(m - M)`` per tile: ``S = sum s w``, ``lse = M + log S``, and
    ``H = log S - sum w (t + s (m - M)) / S``. Tiles of nothing but -inf weigh 0; a row of nothing
    but -inf gives ``lse = -inf`` (and NaN log-probabilities and entropy, as the textbook formula).
    """
    big = m.amax(-1)
    big_safe = big.masked_fill(big == NEG_INF, 0.0)
    live = m != NEG_INF
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    dm = torch.where(live, m - big_safe.unsqueeze(-1), zero)
    w = torch.where(live, torch.exp(dm), zero)
    total = _tree_over_tiles(s * w)
    log_total = torch.log(total)
    lse = big + log_total
    if t is None:
        return lse, None
    return lse, log_total - _tree_over_tiles((t + s * dm) * w) / total


def merge_squares(m: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``log sum p**2`` per row from tile statistics ``m, s`` and ``q = sum exp(z - m)**2`` (N, T),
    global order: ``log sum q w**2 - 2 log sum s w`` with ``w = exp(m - M)``, by the same fixed tree."""
    big = m.amax(-1)
    big_safe = big.masked_fill(big == NEG_INF, 0.0)
    live = m != NEG_INF
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    w = torch.where(live, torch.exp(torch.where(live, m - big_safe.unsqueeze(-1), zero)), zero)
    return torch.log(_tree_over_tiles(q * w * w)) - 2.0 * torch.log(_tree_over_tiles(s * w))


def merge_cross(m: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lse, mean)`` per row from one side's tile statistics ``m, s`` and a per-tile sum ``c`` weighted
    by that side's ``exp(z - m)`` (all (N, T), global order): ``lse`` as :func:`merge`, and ``mean =
    sum w c / S`` (the expectation of the summed quantity under that side's softmax), with the same
    fixed tree. Tiles of nothing but -inf weigh 0."""
    big = m.amax(-1)
    big_safe = big.masked_fill(big == NEG_INF, 0.0)
    live = m != NEG_INF
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    w = torch.where(live, torch.exp(torch.where(live, m - big_safe.unsqueeze(-1), zero)), zero)
    total = _tree_over_tiles(s * w)
    weighted = torch.where(live, c * w, zero)
    return big + torch.log(total), _tree_over_tiles(weighted) / total


def max_and_total(m: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(M, S)`` per row from tile statistics ``m, s`` (N, T), global order: ``M = max m`` and ``S =
    sum exp(z - M)``, summed as :func:`merge` sums it (the softmax's max and normaliser, for min_p)."""
    big = m.amax(-1)
    big_safe = big.masked_fill(big == NEG_INF, 0.0)
    live = m != NEG_INF
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    w = torch.where(live, torch.exp(torch.where(live, m - big_safe.unsqueeze(-1), zero)), zero)
    return big, _tree_over_tiles(s * w)
