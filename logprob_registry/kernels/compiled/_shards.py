"""``compiled``'s vocabulary-parallel ops (see :mod:`logprob_registry.distributed`).

``shard_stats``: one compiled kernel (:func:`._math._tile_stats`) reduces the rows of a block
of the shard read in place: a block of rows' whole grid tiles as one ``(rows, tiles, TILE)`` view,
and each piece of a grid tile at a shard edge as a ``(rows, columns)`` view (copied into a tile of
-inf only where the shard's columns are not contiguous). The kernel is compiled in inductor's
deterministic and batch-invariant modes with split reductions off; its max is exact and its sums
are exact (``kit.exact_sum``'s terms, as three float32 parts added in float64 after it), and every
element is computed by the same vector code, so a tile's statistics are bitwise the same whatever
the rows, the shard, the group or the pieces it comes in, and no block needs the tile's layout.
``z = logits * (1 / temperature)`` inside the kernel and for the label's logit, with the same
operation, so that a label at the tile's maximum is exactly it.

``shard_grad``: the backend's own one-pass gradient kernel with the merged statistics (``m = 0``,
``log2 s = lse * log2 e``) and the label's column within the shard (outside it: no one-hot).

``hidden_shard_stats`` / ``hidden_shard_grad``: ``chunked``'s tile loop (one tile of logits at a
time through the matmul) with the compiled tile kernel for the statistics.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from logprob_registry.kit import grid_offset, label_columns, n_tiles, result_dtype

from ..chunked import _shards as chunked_shards
from ._kernels import _run
from ._math import _add_parts, parts_of
from ._ops import _grad, _grad_args, _overlapping, _plain, _planes, _rows, _take

#: Bytes of the block of rows one kernel call reduces. Few, large calls: a call costs far more
#: than a tile's arithmetic.
BLOCK_BYTES = 16 << 20


def _tile_block(block: torch.Tensor, inv_t: float, ref: Optional[torch.Tensor], with_entropy: bool) -> tuple:
    """Per row of ``block`` ((rows, width), or (rows, tiles, width) for whole tiles), its last dim
    contiguous, against ``ref`` ((rows, 1), (rows, 1, 1)) or None: the max of ``z = block * inv_t``,
    then the parts of each exact sum (:func:`._math._part_sums`), each shaped as ``block`` without
    its last dim."""
    name = ("tile_stats_entropy" if with_entropy else "tile_stats") + ("" if ref is None else "_ref")
    extra = () if ref is None else (ref,)
    if block.shape[0] == 1:  # a dim of size 1 would get a kernel of its own: the row twice
        twice = (2,) + (-1,) * (block.dim() - 1)
        outs = _run(name, block.expand(*twice).contiguous(), inv_t, *(r.expand(*twice).contiguous() for r in extra))
        return tuple(o[:1].reshape(block.shape[:-1]) for o in outs)
    return tuple(o.reshape(block.shape[:-1]) for o in _run(name, block.detach(), inv_t, *extra))


def _pieces(plane: torch.Tensor, tile: int, offset: int):
    """``(first row, first slot, block)`` over ``plane`` (rows, width) whose column 0 is column
    ``offset`` of its first grid tile, read in place: the whole grid tiles of a block of rows as one
    ``(rows, tiles, tile)`` view (every row's tiles in memory order: a view of one tile's column of
    rows, row after row, reads far slower), each piece of a tile at a shard edge as a ``(rows,
    columns)`` view. A tile's statistics are the same bits whatever columns or rows a block holds of
    it: the max is exact, the sums are exact, and every element is computed by the same vector code."""
    r, width = plane.shape
    size = plane.element_size()
    head = min(width, (tile - offset) % tile)  # the columns of a first tile shared with the shard before
    whole = (width - head) // tile
    spans = [(0, 0, head)] if head else []
    spans.append((1 if head else 0, head, head + whole * tile))
    if head + whole * tile < width:
        spans.append((spans[-1][0] + whole, head + whole * tile, width))
    scratch = None
    for slot, c0, c1 in spans:
        tiles = (c1 - c0) // tile if c1 - c0 >= tile else 0
        if c1 == c0:
            continue
        if tiles > 1 and plane.stride(-1) == 1:
            step = max(1, BLOCK_BYTES // (tiles * tile * size))
            for r0 in range(0, r, step):
                rows = plane[r0:r0 + step]
                yield r0, slot, rows.detach().as_strided((rows.shape[0], tiles, tile), (rows.stride(0), tile, 1),
                                                         rows.storage_offset() + c0)
            continue
        step = max(1, BLOCK_BYTES // (tile * size))
        for j in range(max(1, tiles)):
            a, b = (c0 + j * tile, c0 + (j + 1) * tile) if tiles else (c0, c1)
            for r0 in range(0, r, step):
                rows = plane[r0:r0 + step]
                if plane.stride(-1) == 1 and b - a > 1:  # a column alone would get a kernel of its own
                    yield r0, slot + j, rows.detach().as_strided((rows.shape[0], b - a), (rows.stride(0), 1),
                                                                 rows.storage_offset() + a)
                    continue
                if scratch is None:  # strided columns: copied into a tile of -inf (which adds nothing)
                    scratch = torch.full((min(step, r), tile), float("-inf"), dtype=plane.dtype, device=plane.device)
                part = scratch[:rows.shape[0]]
                p0 = (offset + a) % tile
                part[:, p0:p0 + b - a].copy_(rows[:, a:b])
                yield r0, slot + j, part
                part[:, p0:p0 + b - a].fill_(float("-inf"))


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, reference=None):
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = grid_offset(vocab_start, tile)
    n, nt = math.prod(lead), n_tiles(offset + width, tile)
    inv_t = 1.0 / temperature
    dev = logits.device
    sums = 2 if with_entropy else 1
    parts = parts_of(logits.dtype)
    m = torch.empty(n, nt, dtype=acc, device=dev)
    # the parts of each sum, (parts, n, nt) in their dtype: added once at the end, in float64
    pieces = torch.empty(sums * parts, n, nt, dtype=torch.float64 if parts == 1 else torch.float32, device=dev)
    refs = None if reference is None else reference.reshape(n, 1).to(acc)
    first = 0
    for _, plane in _planes(_rows(logits)):
        for r0, slot, block in _pieces(plane, tile, offset):
            rows = slice(first + r0, first + r0 + block.shape[0])
            cols = slice(slot, slot + (block.shape[1] if block.dim() == 3 else 1))
            ref = None
            if refs is not None:
                ref = refs[rows].view((-1,) + (1,) * (block.dim() - 1))
            outs = _tile_block(block, inv_t, ref, with_entropy)
            m[rows, cols] = outs[0].view(m[rows, cols].shape)
            for i, value in enumerate(outs[1:]):
                pieces[i, rows, cols] = value.view(pieces[i, rows, cols].shape)
        first += plane.shape[0]
    s = _add_parts(pieces[:parts])
    u = _add_parts(pieces[parts:]) if with_entropy else None
    picked = None
    if labels is not None:
        owned, column = label_columns(labels, vocab_start, width, ignore_index)
        got = logits.gather(-1, column.view(*lead, 1)).reshape(-1).to(acc) * inv_t
        picked = torch.where(owned, got, 0.0).view(lead)
    tiles = tuple(lead) + (nt,)
    return m.view(tiles), s.view(tiles), None if u is None else u.view(tiles), picked


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward):
    rows = _rows(logits)
    lead = rows.shape[:-1] + (1,)
    acc = lse.dtype
    if labels is not None:
        idx = _plain((labels.reshape(lead).to(torch.int64) - vocab_start))  # outside [0, V_local): no one-hot
    else:
        idx = torch.zeros(lead, dtype=torch.int64, device=logits.device)
    want = (grad_logprobs is not None, grad_entropy is not None)
    m = torch.zeros(lead, dtype=acc, device=logits.device)
    args = _grad_args(want, idx, None, m, lse.reshape(lead), None if entropy is None else entropy.reshape(lead),
                      grad_logprobs, grad_entropy, 1.0 / temperature)
    if inplace_backward and not _overlapping(logits):
        for index, plane in _planes(rows):
            _grad(plane, want, _take(args, index), inplace=True)
        return logits.detach()
    return _grad(rows, want, args, inplace=False).view(logits.shape)


def _compiled_tile_stats(z3: torch.Tensor, with_entropy: bool, reference=None):
    """``chunked``'s tile-statistics hook: ``z3`` (rows, 1, TILE) is already ``logits / T``."""
    rows = z3.shape[0]
    ref = None if reference is None else reference.reshape(rows, 1).to(z3.dtype).contiguous()
    outs = _tile_block(z3.view(rows, z3.shape[2]), 1.0, ref, with_entropy)
    parts = parts_of(z3.dtype)
    s = _add_parts(outs[1:1 + parts]).unsqueeze(1)
    return outs[0].unsqueeze(1), s, _add_parts(outs[1 + parts:]).unsqueeze(1) if with_entropy else None


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       reference=None):
    """``chunked``'s loop over grid tiles of a weight shard, with this backend's tile statistics."""
    return chunked_shards.hidden_shard_stats(
        hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile, temperature=temperature,
        ignore_index=ignore_index, with_entropy=with_entropy, stats_fn=_compiled_tile_stats, reference=reference)


#: the fused op's backward is ``chunked``'s (its tiles are matmuls and elementwise work)
hidden_shard_grad = chunked_shards.hidden_shard_grad
