"""The tile protocol shared by the core and the backends' shard ops.

The vocabulary is cut in tiles of :data:`TILE` columns at fixed global column indices (a global
grid): a shard starting at ``vocab_start`` has ``offset = vocab_start % TILE`` columns of its first
tile outside it, and its last tile may end past it (:func:`grid_slots`). Per row and tile (the
shard's piece of it) a backend returns ``m = max z``, ``s = sum e`` and ``t = sum e (z - m)`` with
``e = exp(z - m)``, the sums *exact*: each term rounded to a multiple of ``2**-QUANTUM_BITS`` and
summed in float64, where sums of at most a tile of such terms never round (:func:`exact_sum`; a
kernel computes the same bits with three float32 sums, :func:`exact_parts`). So a tile's statistics
are the same bits in whatever order or pieces its terms are added.

A tile that two shards share (a shard edge off the grid) is completed by the core: each piece's max
is gathered, a piece's rows below the tile's max are recomputed against it (the option ``reference``), and
the pieces' exact sums are added. Every tile then has the statistics it has in a group of one, and
the core merges the tiles in global order (:mod:`.merge`): results, whatever the shards' widths and
the number of ranks, are the same bits (a gather moves bytes and never rounds).

:func:`tree_sum` is the fixed-order reduction of the merge (only elementwise adds, so an output's
bits depend on its own inputs whatever the shape, device or thread count); :func:`tile_stats_`
is the pure-PyTorch tile statistics that ``chunked`` uses.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

#: Columns per tile. 4096 keeps a tile's reduction below torch's CPU grain size (32768 elements),
#: so even a plain ``sum`` is never split across threads; it is also a common multiple of the
#: vocabulary shards of real models (a shard of 151936 / 8 columns is not, and is still correct).
TILE = 4096
NEG_INF = float("-inf")
#: The terms of a tile's exact sums are multiples of ``2**-QUANTUM_BITS``: a tile of 4096 terms of at
#: most 1 in magnitude sums below ``2**48`` of them, so float64 adds them without rounding (a term's
#: rounding, at most ``2**-37``, keeps a tile's sum, at least 1, within ``2**-25``: float32's own).
#: 36 bits is also what three float32 sums hold exactly (:func:`exact_parts`), so a kernel needs no
#: float64 in its loop.
QUANTUM_BITS = 36
#: :func:`exact_parts`' constants ``1.5 * 2**k``: adding one rounds a float32 term below its binade's
#: width to a multiple of its ulp (``2**-12``, ``2**-24``, ``2**-36``).
PART_CONSTANTS = (1.5 * 2.0 ** 11, 1.5 * 2.0 ** -1, 1.5 * 2.0 ** -13)
#: kl_divergence's cross term sums terms ``w (z_t - z_s)`` of magnitude up to ``2 * max |z|``: at
#: multiples of ``2**-CROSS_BITS`` a tile's sum stays exact in float64 for ``|z| <= 2**14`` (the
#: contract's 1e4 logits; beyond, it rounds like any sum); each term's rounding, at most ``2**-26``,
#: is below float32's for terms above 0.25.
CROSS_BITS = 25


def grid_offset(vocab_start: int, tile: int = TILE) -> int:
    """Columns of the shard's first tile that lie before it (the global grid)."""
    return vocab_start % tile


def grid_slots(vocab_start: int, width: int, tile: int = TILE) -> int:
    """Tiles of the global grid a shard of ``width`` columns from ``vocab_start`` meets."""
    return n_tiles(grid_offset(vocab_start, tile) + width, tile) if width else 0


class Slot(NamedTuple):
    """A shard's piece of one grid tile: its columns ``[c0, c1)`` of the shard, at the columns
    ``[p0, p1)`` of the tile."""

    c0: int
    c1: int
    p0: int

    @property
    def p1(self) -> int:
        return self.p0 + self.c1 - self.c0


def grid(vocab_start: int, width: int, tile: int = TILE) -> List[Slot]:
    """The :class:`Slot` of each grid tile a shard of ``width`` columns from ``vocab_start`` meets."""
    offset = grid_offset(vocab_start, tile)
    out = []
    for j in range(grid_slots(vocab_start, width, tile)):
        first = j * tile - offset  # the tile's first column, in the shard's columns
        c0, c1 = max(0, first), min(width, first + tile)
        out.append(Slot(c0, c1, c0 - first))
    return out


def exact_sum(x: torch.Tensor, bits: int = QUANTUM_BITS) -> torch.Tensor:
    """The sum over the last dim (at most a tile, ``|x| <= 1``; :data:`CROSS_BITS`: ``|x| <= 2**15``) of
    ``x`` rounded to multiples of ``2**-bits`` (ties to even), in float64, with no rounding in the adds:
    the same bits in any order or split (NaN and infinities propagate). The rounding is an add and a
    subtract of ``1.5 * 2**(52 - bits)``, whose ulp is ``2**-bits`` (faster than ``torch.round``)."""
    magic = 1.5 * 2.0 ** (52 - bits)
    return x.to(torch.float64, copy=True).add_(magic).sub_(magic).sum(-1)


def exact_parts(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (float32, ``|x| <= 1``) rounded to a multiple of ``2**-36`` as three float32 parts whose
    sums over a tile never round, in any order: ``hi`` (multiples of ``2**-12``, a tile's sum at most
    ``2**12``), ``mid`` (of ``2**-24``, at most ``2**-13`` each) and ``lo`` (of ``2**-36``, at most
    ``2**-25`` each), each 24 bits at most. Then ``hi.sum() + mid.sum() + lo.sum()``, in float64, is
    :func:`exact_sum`'s bits (ties to even, as ``torch.round``): how a kernel computes it with float32
    adds only (twice as fast on a CPU; a GPU's float64 is slower still). Only adds, no rounding mode
    or fast-math assumption beyond IEEE round to nearest."""
    c1, c2, c3 = PART_CONSTANTS
    hi = (x + c1) - c1
    r = x - hi
    mid = (r + c2) - c2
    lo = ((r - mid) + c3) - c3
    return hi, mid, lo


def n_tiles(width: int, tile: int = TILE) -> int:
    """Tiles of a shard of ``width`` columns."""
    return -(-width // tile)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_sum(y: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by halving: ``y[..., :w] + y[..., w:]`` until one is
    left, out of place."""
    w = y.shape[-1]
    if w & (w - 1):
        raise ValueError(f"tree_sum needs a power-of-two last dim, got {w}; pad with zeros first")
    while w > 1:
        w //= 2
        y = y[..., :w] + y[..., w:]
    return y[..., 0]


def tiled(z: torch.Tensor, tile: int) -> torch.Tensor:
    """``z`` (rows, width) as (rows, n_tiles, tile): a view when ``width`` is a multiple of ``tile``,
    else a copy with the last tile padded by ``-inf`` (columns that add nothing)."""
    rows, width = z.shape
    nt = n_tiles(width, tile)
    if nt * tile != width:
        z = torch.nn.functional.pad(z, (0, nt * tile - width), value=NEG_INF)
    return z.reshape(rows, nt, tile)


def tile_stats_(z: torch.Tensor, with_entropy: bool, reference: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(m, s, t)`` of ``z`` (rows, tiles, tile), each (rows, tiles); ``z`` is overwritten.

    ``m = max z`` (exact; with ``reference`` (rows,), at least it: a piece of a tile measured against
    the whole tile's max), ``s = sum exp(z - m)``, ``t = sum exp(z - m) (z - m)`` (0 for -inf
    entries), both :func:`exact_sum` (float64); a tile of nothing but -inf gives ``(-inf, 0, 0)`` and
    a NaN anywhere in a tile makes all three NaN. The outputs are fresh tensors.
    """
    m = z.amax(-1)
    if reference is not None:
        m = torch.maximum(m, reference.to(m.dtype).view(-1, 1).expand_as(m))
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    d = z.sub_(m_safe.unsqueeze(-1))
    e = torch.exp(d)
    s = exact_sum(e)
    if not with_entropy:
        return m, s, None
    ed = d.mul_(e).masked_fill_(e == 0, 0.0)  # e * d, and 0 where e is 0 (0 * -inf for masked entries)
    return m, s, exact_sum(ed)


def token_tile_stats_(z: torch.Tensor, with_entropy: bool, reference: Optional[torch.Tensor] = None) -> tuple:
    """:func:`tile_stats_` (``z`` overwritten) and, from the same tile, ``q = sum exp(z - m)**2`` (as
    exact as ``s``), ``zs = sum z`` over the ``z`` above -inf (exact at multiples of ``2**-CROSS_BITS``),
    ``first``, the index in the tile of the first ``z == m`` (or NaN; the tile's width where none is:
    a piece below its tile's ``reference``), and ``low``, the count of -inf entries (a shard op
    tells its own from the tile's padding): ``(m, s, t, q, zs, first, low)``, each (rows, tiles)."""
    floor = torch.isneginf(z)
    low = floor.sum(-1)
    zs = exact_sum(z.masked_fill(floor, 0.0), CROSS_BITS)
    m = z.amax(-1)
    if reference is not None:
        m = torch.maximum(m, reference.to(m.dtype).view(-1, 1).expand_as(m))
    hit = (z == m.unsqueeze(-1)) | torch.isnan(z)
    first = torch.where(hit.any(-1), hit.to(torch.uint8).argmax(-1), torch.full_like(m, z.shape[-1], dtype=torch.int64))
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    d = z.sub_(m_safe.unsqueeze(-1))
    e = torch.exp(d)
    s = exact_sum(e)
    q = exact_sum(e * e)
    t = exact_sum(d.mul_(e).masked_fill_(e == 0, 0.0)) if with_entropy else None
    return m, s, t, q, zs, first, low


def label_columns(labels: torch.Tensor, vocab_start: int, width: int,
                  ignore_index: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owned, column)`` for flat labels: whether this shard holds the label (and it is not
    ``ignore_index``), and its column in the shard (0 where not owned, so always a safe index)."""
    lab = labels.reshape(-1).long()
    owned = (lab >= vocab_start) & (lab < vocab_start + width)
    if ignore_index is not None:
        owned &= lab != ignore_index
    return owned, torch.where(owned, lab - vocab_start, torch.zeros_like(lab))
