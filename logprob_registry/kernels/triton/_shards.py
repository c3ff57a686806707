"""``triton``'s vocabulary-parallel ops (see :mod:`logprob_registry.distributed`); imported only
when one of them runs, like :mod:`._kernels`.

``shard_stats``: :func:`_tile_stats_kernel`, one program per row and grid tile, reads the shard's
columns of the tile at once (in the logits' dtype and strides, in float32, float64 for float64) and
reduces them with ``tl.max`` and exact sums (each term rounded to a multiple of ``2**-36``:
``kit.exact_sum``'s bits, from three float32 sums that never round, ``kit.exact_parts``). The max is exact and the sums
do not depend on their order, so a tile's statistics are bitwise the same whatever the group, and
its pieces on two shards add up to them (``group_invariant``). The program that holds a row's label
also writes its logit, divided by the temperature with the same operation as the tile.

``shard_grad``: the backend's own backward kernel with the merged statistics (``m = lse``,
``log s = 0``) and the label's column within the shard (outside it: no one-hot).

``hidden_shard_stats`` / ``hidden_shard_grad``: ``chunked``'s tile loop (one tile of logits at a
time through the matmul) with this tile kernel for the statistics.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from logprob_registry.kit import result_dtype

from ..chunked import _shards as chunked_shards
from ._kernels import _TL, INTERPRETED, _backward, _check_device, _geometry, _on, _row_offset, _split_temperature


@triton.jit
def _exact_sum(x):
    """``kit.exact_sum`` of a block, terms rounded to multiples of 2**-36 (ties to even), as float64:
    float32 terms by ``kit.exact_parts``' three float32 sums, which never round (no float64 in the
    loop: a GPU's float64 is slow); float64 terms rounded and added as they are."""
    if x.dtype == tl.float64:  # 1.5 * 2**16: its ulp is 2**-36
        return tl.sum((x + 98304.0) - 98304.0, 0)
    hi = (x + 3072.0) - 3072.0
    r = x - hi
    mid = (r + 0.75) - 0.75
    lo = ((r - mid) + 0.00018310546875) - 0.00018310546875
    return (tl.sum(hi, 0).to(tl.float64) + tl.sum(mid, 0).to(tl.float64)) + tl.sum(lo, 0).to(tl.float64)


@triton.jit
def _tile_stats_kernel(
    x_ptr, lab_ptr, ref_ptr, m_ptr, s_ptr, t_ptr, pick_ptr,
    V, n_tiles, D1, D2, xs0, xs1, xs2, xsv, ls0, ls1, ls2,
    t_hi, t_lo, vocab_start, offset, ignore_index,
    TILE: tl.constexpr, ACC: tl.constexpr, LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr,
    REF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + _row_offset(row, D1, D2, xs0, xs1, xs2)
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    lo = tile * TILE - offset  # the grid tile's first column, in the shard's columns
    cols = lo + tl.arange(0, TILE).to(tl.int64)
    x = tl.load(x_row + cols * xsv, mask=(cols >= 0) & (cols < V), other=float("-inf")).to(ACC) / temp
    m = tl.max(x, 0)
    if REF:
        m = tl.maximum(m, tl.load(ref_ptr + row).to(ACC))
    ref = tl.where(m == float("-inf"), 0.0, m)
    masked = x == float("-inf")
    d = tl.where(masked, 0.0, x - ref)  # never -inf - (-inf); NaN still spreads
    e = tl.where(masked, 0.0, tl.exp(d))
    at = row * n_tiles + tile
    tl.store(m_ptr + at, m)
    tl.store(s_ptr + at, _exact_sum(e))
    if ENTROPY:
        tl.store(t_ptr + at, _exact_sum(e * d))
    if LABELS:
        label = tl.load(lab_ptr + _row_offset(row, D1, D2, ls0, ls1, ls2)).to(tl.int64)
        col = label - vocab_start
        own = (col >= lo) & (col >= 0) & (col < lo + TILE) & (col < V)
        if IGNORE:
            own = own & (label != ignore_index)
        value = tl.load(x_row + col * xsv, mask=own, other=0.0).to(ACC) / temp
        tl.store(pick_ptr + row, value, mask=own)


def _num_warps(dtype: torch.dtype) -> int:
    return 1 if INTERPRETED else (16 if dtype == torch.float64 else 8)


def _launch(logits, labels, ref, m, s, t, pick, vocab_start, offset, tile, temperature, ignore_index):
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    label_strides = labels.stride() if labels is not None else (0,) * len(lead)
    geometry = _geometry(lead, logits.stride()[:-1], label_strides)
    nt = m.shape[1]
    if geometry is None:  # more than three unmergeable leading dims: one launch per outer index
        rows = math.prod(lead[1:])
        for i in range(lead[0]):
            sl = slice(i * rows, (i + 1) * rows)
            _launch(logits[i], None if labels is None else labels[i], None if ref is None else ref[sl], m[sl],
                    s[sl], t[sl], pick[sl], vocab_start, offset, tile, temperature, ignore_index)
        return
    d1, d2, (xs, ls) = geometry
    n = math.prod(lead)
    t_hi, t_lo = _split_temperature(temperature)
    _tile_stats_kernel[(n, nt)](
        logits, labels if labels is not None else pick, ref if ref is not None else pick, m, s, t, pick,
        vocab, nt, d1, d2, *xs, logits.stride(-1), *ls, t_hi, t_lo, int(vocab_start), int(offset),
        0 if ignore_index is None else int(ignore_index),
        TILE=tile, ACC=_TL[m.dtype], LABELS=labels is not None, IGNORE=ignore_index is not None,
        ENTROPY=t is not s, REF=ref is not None, num_warps=_num_warps(m.dtype),
    )


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, reference=None):
    _check_device(logits)
    if tile & (tile - 1):
        raise ValueError(f"the triton backend needs a power-of-two tile, got {tile}")
    if ignore_index is not None and not -2**63 <= ignore_index < 2**63:
        ignore_index = None  # no int64 label can equal it
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = vocab_start % tile
    n, nt = math.prod(lead), -(-(offset + width) // tile)
    dev = logits.device
    m = torch.empty(n, nt, dtype=acc, device=dev)
    s = torch.empty(n, nt, dtype=torch.float64, device=dev)
    t = torch.empty(n, nt, dtype=torch.float64, device=dev) if with_entropy else s
    pick = torch.zeros(n, dtype=acc, device=dev)
    ref = None if reference is None else reference.reshape(n).to(device=dev, dtype=acc).contiguous()
    if n:
        with _on(dev):
            _launch(logits, labels, ref, m, s, t, pick, vocab_start, offset, tile, temperature, ignore_index)
    tiles = tuple(lead) + (nt,)
    return (m.view(tiles), s.view(tiles), t.view(tiles) if with_entropy else None,
            pick.view(lead) if labels is not None else None)


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward):
    _check_device(logits)
    n = lse.numel()
    local = None if labels is None else (labels.to(torch.int64) - vocab_start)  # outside [0, V_local): no one-hot
    m = lse.reshape(-1).contiguous()
    log_s = torch.zeros(n, dtype=lse.dtype, device=lse.device)
    ent = None if entropy is None or grad_entropy is None else entropy.reshape(-1).contiguous()
    return _backward(logits, local, grad_logprobs, grad_entropy, ent, m, log_s, temperature, None, inplace_backward)


def _triton_tile_stats(z3: torch.Tensor, with_entropy: bool, reference=None):
    """``chunked``'s tile-statistics hook: ``z3`` (rows, 1, TILE) is already ``logits / T``, on the grid."""
    m, s, t, _ = shard_stats(z3.view(z3.shape[0], z3.shape[2]), None, vocab_start=0, tile=z3.shape[2],
                             temperature=1.0, ignore_index=None, with_entropy=with_entropy, reference=reference)
    return m, s, t


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       reference=None):
    """``chunked``'s loop over grid tiles of a weight shard, with this backend's tile statistics."""
    return chunked_shards.hidden_shard_stats(
        hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile, temperature=temperature,
        ignore_index=ignore_index, with_entropy=with_entropy, stats_fn=_triton_tile_stats, reference=reference)


#: the fused op's backward is ``chunked``'s (its tiles are matmuls and elementwise work)
hidden_shard_grad = chunked_shards.hidden_shard_grad
