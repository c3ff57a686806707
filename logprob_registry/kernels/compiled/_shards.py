"""``compiled``'s vocabulary-parallel ops (see :mod:`logprob_registry.distributed`).

``shard_stats``: one compiled kernel (:func:`._math._tile_stats`) reduces each row of a
contiguous ``(rows, TILE)`` block of one grid tile: a block of rows of the shard viewed as whole
tiles where it starts on the grid and is contiguous and a multiple of the tile wide, else copied, a
block at a time, into a buffer at the columns' places in their tiles, -inf around them. Every call
has that one layout, and the kernel is compiled in inductor's deterministic and batch-invariant
modes with split reductions off; its sums are exact (``kit.exact_sum``'s terms, added in float64),
so a tile's statistics are bitwise the same whatever the rows, the shard, the group or the pieces
it comes in. ``z = logits * (1 / temperature)`` inside the kernel and for the label's logit, with
the same operation, so that a label at the tile's maximum is exactly it.

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
from ._ops import _grad, _grad_args, _overlapping, _plain, _planes, _rows, _take

#: Bytes of the block of rows one kernel call reduces (a copy only where the rows cannot be viewed
#: as whole tiles). Few, large calls: a call costs far more than a tile's arithmetic.
BLOCK_BYTES = 16 << 20


def _tile_block(block: torch.Tensor, inv_t: float, ref: Optional[torch.Tensor], with_entropy: bool):
    """Per row of ``block`` (rows, TILE), contiguous, against ``ref`` (rows, 1) or None: the max of
    ``z = block * inv_t``, the exact sums, each (rows,). Every call has this one layout, so one
    compiled kernel, one order, serves them all."""
    name = ("tile_stats_entropy" if with_entropy else "tile_stats") + ("" if ref is None else "_ref")
    extra = () if ref is None else (ref,)
    if block.shape[0] == 1:  # a dim of size 1 would get a kernel of its own: the row twice, contiguous
        outs = _run(name, block.expand(2, -1).contiguous(), inv_t, *(r.expand(2, -1).contiguous() for r in extra))
        return tuple(o[:1].reshape(1) for o in outs)
    return tuple(o.reshape(-1) for o in _run(name, block.detach(), inv_t, *extra))


def _blocks(plane: torch.Tensor, tile: int, offset: int):
    """``(first row, (rows * n_tiles, tile) contiguous view or copy)`` over the rows of ``plane``, its
    columns from column ``offset`` of its first grid tile."""
    r, width = plane.shape
    nt = n_tiles(offset + width, tile)
    direct = offset == 0 and width == nt * tile and plane.is_contiguous()
    step = max(1, BLOCK_BYTES // (nt * tile * plane.element_size()))
    scratch = None
    for r0 in range(0, r, step):
        rows = plane[r0:r0 + step]
        if direct:
            yield r0, rows.detach().view(-1, tile)
            continue
        if scratch is None:
            scratch = torch.full((min(step, r), nt * tile), float("-inf"), dtype=plane.dtype, device=plane.device)
        part = scratch[:rows.shape[0]]
        part[:, offset:offset + width].copy_(rows)
        yield r0, part.view(-1, tile)


def _references(reference, n: int, nt: int, acc) -> Optional[torch.Tensor]:
    """The per-row reference for each of ``nt`` tiles of ``n`` rows, (n * nt, 1), or None."""
    if reference is None:
        return None
    return reference.reshape(n, 1).to(acc).expand(n, nt).reshape(n * nt, 1).contiguous()


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, reference=None):
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = grid_offset(vocab_start, tile)
    n, nt = math.prod(lead), n_tiles(offset + width, tile)
    inv_t = 1.0 / temperature
    dev = logits.device
    m = torch.empty(n, nt, dtype=acc, device=dev)
    s = torch.empty(n, nt, dtype=torch.float64, device=dev)
    u = torch.empty(n, nt, dtype=torch.float64, device=dev) if with_entropy else None
    refs = _references(reference, n, nt, acc)
    first = 0
    for _, plane in _planes(_rows(logits)):
        for r0, block in _blocks(plane, tile, offset):
            rows = slice(first + r0, first + r0 + block.shape[0] // nt)
            ref = None if refs is None else refs[rows.start * nt:rows.stop * nt]
            outs = _tile_block(block, inv_t, ref, with_entropy)
            m[rows], s[rows] = outs[0].view(-1, nt), outs[1].view(-1, nt)
            if u is not None:
                u[rows] = outs[2].view(-1, nt)
        first += plane.shape[0]
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
    outs = _tile_block(z3.view(rows, z3.shape[2]), 1.0, _references(reference, rows, 1, z3.dtype), with_entropy)
    m, s = outs[0].unsqueeze(1), outs[1].unsqueeze(1)
    return m, s, outs[2].unsqueeze(1) if with_entropy else None


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       reference=None):
    """``chunked``'s loop over grid tiles of a weight shard, with this backend's tile statistics."""
    return chunked_shards.hidden_shard_stats(
        hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile, temperature=temperature,
        ignore_index=ignore_index, with_entropy=with_entropy, stats_fn=_compiled_tile_stats, reference=reference)


#: the fused op's backward is ``chunked``'s (its tiles are matmuls and elementwise work)
hidden_shard_grad = chunked_shards.hidden_shard_grad
