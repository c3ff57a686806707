"""The steps every vocabulary-parallel call shares, written once: the header exchange, the
statistics gather, and the merge into per-row results.

A call (the skeleton of :mod:`.sharded`) arrives validated and computes its shard's tile
statistics through the registry *before* any collective, keeping any error in
:class:`~.header.Local` instead of raising it; then:

1. :func:`exchange`: one all-gather of the header rows; every rank raises the same error, or
   learns the :class:`~.header.Layout`;
2. :func:`complete` (only where a shard edge is off the tile grid, so that two ranks share a grid
   tile): one all-gather of each rank's first and last tile maxima per row; a piece's rows below
   their tile's max are recomputed against it (:attr:`Stats.recompute`);
3. :func:`gather`: one all-gather of the packed statistics (:class:`Stats`), ``(N, K * max_tiles
   + E + C + 1)`` per rank in the result dtype (``K`` per-tile statistics: 2, or 3 with the entropy, 5
   for ``kl_divergence``; ``E``: the exact float64 sums of the shared tiles' pieces, their bits in
   two float32 words each; ``C`` per-row columns: the label's logit where this rank owns the label;
   the last one a failure flag); :func:`in_order` reads one statistic in global tile order, the
   pieces of a shared tile added exactly;
4. :func:`combine`: the merge (:func:`~.merge.merge`) in global tile order, and the label's logit
   taken from the rank that owns it: selected, never summed, so it is exact.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import header
from .group import Group
from .merge import merge
from .tiles import NEG_INF, n_tiles


class Stats(NamedTuple):
    """One shard's statistics, flattened to rows: per-tile statistics (N, n_tiles) each (None: not
    asked for; the maxima in the result dtype, the sums the grid's exact float64), per-row columns
    (N, C) or None (the label logits), and ``recompute(slot, references, rows)``: the per-tile
    statistics of that one grid tile for the flat rows ``rows`` (an index (R,)) against
    ``references`` (one (R,) per maximum), each (R, 1)."""

    tiles: Tuple[Optional[torch.Tensor], ...]
    rows: Optional[torch.Tensor] = None
    recompute: Optional[Callable] = None


class Merged(NamedTuple):
    """Per-row results, identical on every rank: (N,) each, on the group's device."""

    lse: torch.Tensor
    entropy: Optional[torch.Tensor]
    logprobs: Optional[torch.Tensor]


def per_row_grads(g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor], lead: tuple, acc: torch.dtype,
                  labels: Optional[torch.Tensor], ignore_index, label_shape: Optional[tuple] = None) -> tuple:
    """The upstream gradients of logprobs and entropy as a backward's shard op takes them: shape
    ``lead`` (the logprobs' ``label_shape`` when given: candidate labels (..., K)), dtype ``acc``,
    contiguous (an upstream gradient is often expanded), and zero where the label is
    ``ignore_index`` (validated; None where not given)."""
    if g_lp is not None:
        g_lp = g_lp.reshape(lead if label_shape is None else label_shape).to(acc).contiguous()
        if ignore_index is not None:
            g_lp = g_lp.masked_fill(labels == ignore_index, 0.0)
    if g_ent is not None:
        g_ent = g_ent.reshape(lead).to(acc).contiguous()
    return g_lp, g_ent


def exchange(group: Group, local: header.Local, device: torch.device) -> header.Layout:
    """The header all-gather and its checks (see :mod:`.header`)."""
    table = group.all_gather(header.row(local, device), device).cpu()
    return header.check(table, local)


def _words(acc: torch.dtype) -> int:
    """Columns of a packet in ``acc`` holding one float64's bits."""
    return 1 if acc == torch.float64 else 2


def _sums(count: int, maxima: Tuple[int, ...]) -> Tuple[int, ...]:
    """The indices of the sums among ``count`` statistics (the others are maxima)."""
    return tuple(i for i in range(count) if i not in maxima)


def _exact_at(count: int, width: int, maxima: Tuple[int, ...], acc: torch.dtype, edge: int, i: int) -> int:
    """The packet's column of sum ``i``'s exact float64 bits for ``edge`` (0: the first tile, 1: the last)."""
    sums = _sums(count, maxima)
    return count * width + (edge * len(sums) + sums.index(i)) * _words(acc)


def _exact_columns(layout: header.Layout, count: int, acc: torch.dtype, maxima: Tuple[int, ...]) -> int:
    """The packet's columns of the shared tiles' exact sums: the first and the last tile's, per sum."""
    return 0 if layout.aligned else 2 * len(_sums(count, maxima)) * _words(acc)


def _edges(layout: header.Layout, rank: int) -> tuple:
    """``(edge, slot)`` of ``rank``'s shared grid tiles: edge 0 its first tile, edge 1 its last."""
    first, last = layout.shared(rank)
    n = layout.slots[rank]
    return tuple((edge, slot) for edge, (shared, slot) in enumerate(((first, 0), (last, n - 1))) if shared)


def _tile_max(table: torch.Tensor, layout: header.Layout, tile: int, k: int) -> torch.Tensor:
    """The ``k``-th max per row of grid tile ``tile`` over every rank's piece (``table``: (W, N, 2 K),
    each rank's first and last tile maxima, K of each)."""
    out = None
    for r in layout.order:
        first = layout.first_tile(r)
        last = first + layout.slots[r] - 1
        for edge, at in ((0, first), (1, last)):
            if at == tile:
                piece = table[r, :, 2 * k + edge]
                out = piece if out is None else torch.maximum(out, piece)
                break
    return out


def complete(group: Group, layout: header.Layout, stats: Optional[Stats], device: torch.device,
             acc: torch.dtype, failure: Optional[BaseException] = None, maxima: Tuple[int, ...] = (0,)
             ) -> Tuple[Optional[Stats], Optional[BaseException]]:
    """The grid tiles this rank shares with another (a shard edge off the grid) measured against the
    whole tile's max, so that their pieces' exact sums add up to the tile's own (see :mod:`.tiles`):
    one all-gather of every rank's first and last tile maxima per row, then :attr:`Stats.recompute`
    of a piece's rows that are below their tile's max (about half of them where two shards share a
    tile). Nothing happens when every shard starts on the grid. A rank that failed (``failure``, or
    failing here) still joins the all-gather, and its failure goes on to :func:`gather`.
    ``maxima``: the indices of the statistics that are maxima (each sum is measured against one of
    them)."""
    if layout.aligned or not layout.rows:
        return stats, failure
    me = group.rank
    edges = torch.full((layout.rows, 2 * len(maxima)), NEG_INF, dtype=acc, device=device)
    if failure is None and stats is not None:
        for k, i in enumerate(maxima):
            m = stats.tiles[i]
            edges[:, 2 * k], edges[:, 2 * k + 1] = m[:, 0].to(device), m[:, -1].to(device)
    table = group.all_gather(edges, device)
    if failure is not None or stats is None:
        return stats, failure
    try:
        parts, done = list(stats.tiles), set()
        for _, slot in _edges(layout, me):
            if slot in done:
                continue
            done.add(slot)
            at = parts[maxima[0]].device
            references = tuple(_tile_max(table, layout, layout.first_tile(me) + slot, k).to(at)
                               for k in range(len(maxima)))
            below = None
            for i, ref in zip(maxima, references):
                low = parts[i][:, slot] < ref
                below = low if below is None else below | low
            rows = below.nonzero().squeeze(1)
            if not rows.numel():
                continue  # this piece holds its tile's maxima in every row: measured against them already
            # only the rows where it does not (a row where it does has its statistics already)
            for k, value in enumerate(stats.recompute(slot, tuple(ref[rows] for ref in references), rows)):
                if parts[k] is not None and value is not None:
                    if parts[k] is stats.tiles[k]:  # the shard op's own tensor: written into a copy
                        parts[k] = parts[k].clone()
                    parts[k][rows, slot] = value.reshape(-1).to(parts[k].dtype)
        return stats._replace(tiles=tuple(parts)), None
    except Exception as exc:  # carried by the statistics gather's failure column
        return None, exc


def gather(group: Group, layout: header.Layout, stats: Optional[Stats], count: int, columns: int,
           device: torch.device, acc: torch.dtype, failure: Optional[BaseException] = None,
           maxima: Tuple[int, ...] = (0,)):
    """The statistics all-gather: ``(W, N, count * width + E + columns)`` on ``device``, and
    ``width``, the most tiles of a rank (each per-tile statistic padded to it).

    ``count``: the per-tile statistics gathered (the first ``count`` of ``stats.tiles``, in ``acc``,
    on the global tile grid: :attr:`.header.Layout.slots`); the exact float64 sums of a shared
    tile's pieces travel as their bits in ``E`` columns (:func:`complete` first; ``maxima``: the
    indices of the statistics that are maxima, the others are sums); ``columns``: the per-row columns after them
    (``stats.rows``, the label logits; K for candidate labels). ``failure``: this rank could not
    compute its statistics after the header (a sampler's second round); it still joins the gather,
    with its failure flag set (one more column, after the others), so that every rank raises
    instead of the others hanging."""
    rows, width = layout.rows, max(layout.slots)
    exact = _exact_columns(layout, count, acc, maxima)
    first = count * width + exact
    packet = torch.zeros(rows, first + columns + 1, dtype=acc, device=device)
    if failure is not None:
        packet[:, -1] = 1.0
    else:
        for i, part in enumerate(stats.tiles[:count]):
            if part is not None:
                packet[:, i * width:i * width + part.shape[1]] = part.to(device=device, dtype=acc)
        words = _words(acc)
        for edge, slot in (_edges(layout, group.rank) if exact else ()):
            for i in _sums(count, maxima):
                bits = stats.tiles[i][:, slot].to(device=device, dtype=torch.float64).contiguous().view(acc)
                at = _exact_at(count, width, maxima, acc, edge, i)
                packet[:, at:at + words] = bits.view(rows, words)
        if stats.rows is not None:
            packet[:, first:first + columns] = stats.rows.reshape(rows, -1).to(device)
    gathered = group.all_gather(packet, device)
    if rows:
        failed = [r for r in range(gathered.shape[0]) if float(gathered[r, 0, -1]) != 0.0]
        if failed:
            raise RuntimeError(
                f"computing the statistics of the process_group= call failed on rank(s) {failed} (this rank's own "
                "error, if any, is chained as its cause); no rank has a result") from failure
    return gathered[..., :-1], width


def in_order(gathered: torch.Tensor, width: int, layout: header.Layout, i: int, count: int,
             maxima: Tuple[int, ...] = (0,)) -> torch.Tensor:
    """The ``i``-th of the ``count`` per-tile statistics of :func:`gather`'s result, ``(N, total
    tiles)`` in global tile order (``maxima``: the indices of the maxima): the max of a shared tile
    is its pieces' max, a sum its pieces' exact sums added (exact: the same bits as the whole
    tile's) and rounded once to the packet's dtype."""
    rows, acc = gathered.shape[1], gathered.dtype
    total = n_tiles(layout.vocab, layout.tile)
    exact = _exact_columns(layout, count, acc, maxima)
    words = _words(acc)
    if i in maxima:
        out = torch.full((rows, total), NEG_INF, dtype=acc, device=gathered.device)
    else:
        out = torch.zeros(rows, total, dtype=torch.float64, device=gathered.device)
    for r in layout.order:
        g0, n = layout.first_tile(r), layout.slots[r]
        values = gathered[r, :, i * width:i * width + n]
        if i in maxima:
            out[:, g0:g0 + n] = torch.maximum(out[:, g0:g0 + n], values)
            continue
        values = values.to(torch.float64)
        for edge, slot in (_edges(layout, r) if exact else ()):
            at = _exact_at(count, width, maxima, acc, edge, i)
            values[:, slot] = gathered[r, :, at:at + words].contiguous().view(torch.float64).view(rows)
        out[:, g0:g0 + n] += values
    return out.to(acc)


def combine(gathered: torch.Tensor, width: int, layout: header.Layout, labels: Optional[torch.Tensor],
            ignore_index: Optional[int], with_entropy: bool, count: Optional[int] = None) -> Merged:
    """Merge the gathered statistics in global tile order; the log-probabilities of ``labels``
    (global ids, or None) from the owner's label logit (the packet's last columns). ``count``: the
    per-tile statistics gathered (default: 3 with the entropy, else 2)."""
    count = count or (3 if with_entropy else 2)

    def part(i: int) -> torch.Tensor:
        return in_order(gathered, width, layout, i, count)

    lse, entropy = merge(part(0), part(1), part(2) if with_entropy else None)
    logprobs = None
    if labels is not None:
        device = gathered.device
        rows = lse.shape[0]
        lab = labels.reshape(rows, -1).to(device=device, dtype=torch.int64)  # (N, K): K = 1 but for candidates
        per = lab.shape[1]
        first = gathered.shape[-1] - per
        valid = torch.ones_like(lab, dtype=torch.bool) if ignore_index is None else lab != ignore_index
        lab = torch.where(valid, lab, torch.zeros_like(lab))
        starts = torch.tensor([layout.starts[r] for r in layout.order], dtype=torch.int64, device=device)
        order = torch.tensor(layout.order, dtype=torch.int64, device=device)
        owner = order[torch.searchsorted(starts, lab, right=True) - 1]
        row = torch.arange(rows, device=device).unsqueeze(1).expand_as(lab)
        column = first + torch.arange(per, device=device).unsqueeze(0).expand_as(lab)
        picked = gathered[owner, row, column]
        logprobs = torch.where(valid, picked - lse.unsqueeze(1), torch.zeros((), dtype=lse.dtype, device=device))
        logprobs = logprobs.reshape(labels.shape)
    return Merged(lse, entropy, logprobs)


class BackwardFailedError(RuntimeError):
    """The backward of a process_group= call failed on some rank(s); raised on every rank."""


def sum_over_group(group: Group, like: torch.Tensor, partial: Optional[torch.Tensor], acc: torch.dtype,
                   failure: Optional[BaseException], what: str) -> torch.Tensor:
    """``partial`` (this rank's share of a gradient shaped like ``like``) summed over the group, in
    ``acc``, returned in ``like``'s dtype and device. The all-reduce carries one more number, a
    failure flag: a rank whose backward failed (``failure``) joins it with zeros, so that every rank
    raises :class:`BackwardFailedError` (naming ``what``) instead of the others hanging."""
    device = group.device_for(like)
    size = like.numel()
    buffer = torch.zeros(size + 1, dtype=acc, device=device)
    if failure is not None:
        buffer[size] = 1.0
    elif partial is not None:
        buffer[:size] = partial.reshape(-1).to(device=device, dtype=acc)
    group.all_reduce_sum_(buffer)
    failed = int(buffer[size].item())
    if failed:
        raise BackwardFailedError(
            f"the backward of {what} failed on {failed} rank(s) of the group (each failing rank's own error is "
            "chained as its cause); no rank has a hidden gradient") from failure
    return buffer[:size].view(like.shape).to(device=like.device, dtype=like.dtype)


def describe(local: header.Local, on: torch.Tensor, vocab: int, temperature, group: Group,
             vocab_start: Optional[int], checked: Optional[torch.Tensor], hidden: bool) -> int:
    """Fill this rank's header row with what every rank must agree on (the input's dtype and leading
    shape, the shard's width, the temperature (a number, or per row: its checksum is compared,
    :func:`.header.temperature_code`), the tensor whose checksum is compared, the hidden
    size); returns the shard's global start (``vocab_start``, or ``rank * vocab``)."""
    lead = tuple(on.shape[:-1])
    local.dtype, local.shape, local.rows, local.width = on.dtype, lead, math.prod(lead), vocab
    local.temperature = temperature
    local.labels = checked
    if hidden:
        local.hidden = on.shape[-1]
    local.start = vocab_start if vocab_start is not None else group.rank * vocab
    return local.start
