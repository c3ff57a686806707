"""``chunked``'s vocabulary-parallel ops: tile statistics of a shard and its gradient, for the
logits ops and for ``logprobs_from_hidden`` (see :mod:`logprob_registry.distributed`).

Tiles lie on the global grid (:func:`~logprob_registry.kit.grid`): the shard's columns sit at
their global positions in tiles of ``TILE``, -inf around them. Tile statistics use
:func:`~logprob_registry.kit.tile_stats_`: a max (exact) and exact sums (terms rounded to a fixed
grid, added in float64 without rounding), so a tile's statistics, or a piece's against the
``reference`` the core gives, depend bitwise on its own columns whatever the rows around it, the
shard's width, the device or the thread count: ``chunked`` declares ``group_invariant``. Rows go a
chunk at a time through a workspace of a few MiB (the backend's budget), so no copy of the logits
is made; the fused op forms one tile of logits (a block of rows against ``TILE`` columns of the
weight) at a time and never the ``(N, V_local)`` logits.

The fused op's matmuls have the same shapes whatever the shard: a block of rows of a size fixed by
the budget only (padded to ``MIN_GEMM_ROWS``), against one whole tile of the weight in a fresh
buffer, the shard's rows at their places in the tile and zeros elsewhere (a shard's edge pays for a
whole tile). Whether a matmul library then gives the same bits is up to the library: true of the
CPU build tested; GPUs' libraries pick kernels by shape, which is the same here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from logprob_registry import kit
from logprob_registry.kit import (
    MIN_GEMM_ROWS,
    Slot,
    add_matmul,
    grid,
    label_columns,
    n_tiles,
    overlapping,
    pad_rows,
    result_dtype,
    tile_stats_,
)

from ._hidden import resolve_chunk_bytes
from ._rows import chunks

#: (rows, tiles, tile) scratch, with_entropy, reference (rows,) or None -> (m, s, t), each (rows, tiles)
TileStats = Callable[[torch.Tensor, bool, Optional[torch.Tensor]], tuple]


def _rows_per_chunk(columns: int, acc: torch.dtype, budget: int) -> int:
    itemsize = 8 if acc == torch.float64 else 4
    return max(MIN_GEMM_ROWS, budget // max(1, 3 * columns * itemsize))


def _load(scratch: torch.Tensor, chunk: torch.Tensor, temperature: float, offset: int = 0) -> torch.Tensor:
    """``chunk / temperature`` in the scratch's dtype from its column ``offset``, -inf around it."""
    r, v = chunk.shape
    out = scratch[:r]
    out[:, offset:offset + v].copy_(chunk)
    if offset:
        out[:, :offset].fill_(float("-inf"))
    if offset + v < out.shape[1]:
        out[:, offset + v:].fill_(float("-inf"))
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _on_grid(z: torch.Tensor, offset: int, nt: int, tile: int, fill: float = float("-inf")) -> torch.Tensor:
    """``z`` (rows, width) at its columns of ``nt`` grid tiles (from ``offset``), ``fill`` around it."""
    width = z.shape[1]
    if offset == 0 and width == nt * tile:
        return z
    return torch.nn.functional.pad(z, (offset, nt * tile - width - offset), value=fill)


def _reference_rows(reference, sl):
    return None if reference is None else reference.reshape(-1)[sl]


def _empty_stats(n, nt, acc, device, with_entropy):
    """Empty per-tile ``(m, s, t)`` of ``n`` rows and ``nt`` tiles (``t``: None without the entropy);
    the sums are exact float64."""
    m = torch.empty(n, nt, dtype=acc, device=device)
    s = torch.empty(n, nt, dtype=torch.float64, device=device)
    return m, s, torch.empty(n, nt, dtype=torch.float64, device=device) if with_entropy else None


class Sink:
    """Where the loops put a stats function's outputs beyond ``(m, s, t)`` (``kit.token_tile_stats_``'
    ``q, zs, first``): ``parts``, (n, nt) each, made at the first block (None: no block, or none)."""

    def __init__(self, n: int, nt: int) -> None:
        self.n, self.nt, self.parts = n, nt, None

    def put(self, rows: slice, tiles, more) -> None:
        if not more:
            return
        if self.parts is None:
            self.parts = [torch.empty(self.n, self.nt, dtype=v.dtype, device=v.device) for v in more]
        for part, value in zip(self.parts, more):
            target = part[rows, tiles]  # a view: (rows, nt) for a block of rows, (rows,) for one tile
            target.copy_(value.reshape(target.shape))


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, budget: int,
                stats_fn: Optional[TileStats] = None, softcap=None, keep=None, boundary=None, reference=None,
                sink: Optional[Sink] = None):
    """Per-tile ``(m, s, t)`` of the shard and the label logits (see the op table), a chunk of rows
    at a time in a workspace of about ``budget`` bytes; with the sampler's options (feature
    ``shard_sampler``) or candidate labels, :func:`sampled_shard_stats`."""
    if sampler_given(labels, logits.shape[:-1], softcap, keep, boundary, temperature=temperature):
        return sampled_shard_stats(logits, labels, vocab_start=vocab_start, tile=tile, temperature=temperature,
                                   ignore_index=ignore_index, with_entropy=with_entropy, softcap=softcap,
                                   keep=keep, boundary=boundary, budget=budget, stats_fn=stats_fn,
                                   reference=reference, sink=sink)
    stats_fn = stats_fn or tile_stats_
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = vocab_start % tile
    n, nt = labels_rows(lead), n_tiles(offset + width, tile)
    m, s, t = _empty_stats(n, nt, acc, logits.device, with_entropy)
    picked = owned = column = None
    if labels is not None:
        owned, column = label_columns(labels, vocab_start, width, ignore_index)
        picked = torch.zeros(n, dtype=acc, device=logits.device)
    rows = _rows_per_chunk(nt * tile, acc, budget)
    scratch = torch.empty(min(rows, max(n, 1)), nt * tile, dtype=acc, device=logits.device)
    for start, chunk in chunks(logits, rows):
        r = chunk.shape[0]
        z = _load(scratch, chunk, temperature, offset)
        sl = slice(start, start + r)
        if picked is not None:
            got = z.gather(1, (column[sl] + offset).unsqueeze(1)).squeeze(1)
            picked[sl] = torch.where(owned[sl], got, picked[sl])
        cm, cs, ct, *more = stats_fn(z.view(r, nt, tile), with_entropy, _reference_rows(reference, sl))
        if sink is not None:
            sink.put(sl, slice(None), more)
        m[start:start + r], s[start:start + r] = cm, cs
        if t is not None:
            t[start:start + r] = ct
    tiles = tuple(lead) + (nt,)
    return (m.view(tiles), s.view(tiles), None if t is None else t.view(tiles),
            None if picked is None else picked.view(lead))


def labels_rows(lead) -> int:
    n = 1
    for size in lead:
        n *= size
    return n


def _dz(z, lse, entropy, g_lp, g_ent, owned, column, temperature) -> torch.Tensor:
    """In place over ``z`` (rows, columns) = logits / T: the gradient with respect to the logits.
    ``column`` are the label columns within ``z`` where ``owned``."""
    logp = z.sub_(lse.unsqueeze(1))
    p = torch.exp(logp)
    if g_ent is not None:
        # -g_ent * p * (log p + H), 0 where p is 0 (masked entries: 0 * -inf)
        grad = logp.add_(entropy.unsqueeze(1)).mul_(p).masked_fill_(p == 0, 0.0).mul_(-g_ent.unsqueeze(1))
        if g_lp is not None:
            grad.sub_(p.mul_(g_lp.unsqueeze(1)))
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
    if g_lp is not None and owned is not None:
        _add_at_labels(grad, owned, column, g_lp)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def _add_at_labels(grad: torch.Tensor, owned: torch.Tensor, column: torch.Tensor, g: torch.Tensor) -> None:
    """``grad[i, column[i]] += g[i]`` on the rows where ``owned``, and nothing elsewhere: adding a 0
    would turn a -0.0 into +0.0, and the bits of a column would then depend on the shard it is in."""
    rows = owned.nonzero().squeeze(1)
    if rows.numel():
        grad.index_put_((rows, column[rows]), g[rows], accumulate=True)


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward, budget: int, softcap=None, keep=None, boundary=None):
    """The shard's gradient, a chunk of rows at a time; over the logits' storage when asked."""
    if sampler_given(labels, logits.shape[:-1], softcap, keep, boundary, temperature=temperature):
        return sampled_shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy,
                                  vocab_start=vocab_start, temperature=temperature,
                                  inplace_backward=inplace_backward, softcap=softcap, keep=keep, boundary=boundary,
                                  budget=budget)
    acc = lse.dtype
    width = logits.shape[-1]
    lse, n = lse.reshape(-1), lse.numel()
    entropy = None if entropy is None else entropy.reshape(-1)
    g_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1)
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1)
    owned = column = None
    if g_lp is not None:
        owned, column = label_columns(labels, vocab_start, width, None)
    inplace = inplace_backward and not overlapping(logits)
    out = logits.detach() if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n == 0:
        return out
    rows = _rows_per_chunk(width, acc, budget)
    scratch = torch.empty(min(rows, n), width, dtype=acc, device=logits.device)
    flat_out = None if inplace else out.view(-1, width)
    for start, chunk in chunks(out if inplace else logits, rows):
        r = chunk.shape[0]
        sl = slice(start, start + r)
        z = _load(scratch, chunk, temperature)
        grad = _dz(z, lse[sl], None if entropy is None else entropy[sl], None if g_lp is None else g_lp[sl],
                   None if g_ent is None else g_ent[sl], None if owned is None else owned[sl],
                   None if column is None else column[sl], temperature)
        (chunk if inplace else flat_out[sl]).copy_(grad)
    if inplace and hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(logits)  # its values are gone: stale readers must fail
    return out


# ------------------------------------------------------------------------- the fused op
def _weight_tile(weight, bias, slot: Slot, acc, tile: int):
    """The weight's (and bias's) rows of ``slot`` at their places in a fresh ``(tile, H)`` buffer of
    the compute dtype, zeros elsewhere: every tile's matmul has one shape, whatever the shard."""
    c0, c1, p0 = slot.c0, slot.c1, slot.p0
    new = torch.empty if c1 - c0 == tile else torch.zeros  # a whole tile is all copied: no zeros to write
    w = new((tile, weight.shape[1]), dtype=acc, device=weight.device)
    w[p0:p0 + c1 - c0].copy_(weight[c0:c1])
    b = None
    if bias is not None:
        b = new(tile, dtype=acc, device=bias.device)
        b[p0:p0 + c1 - c0].copy_(bias[c0:c1])
    return w, b


def _tile_logits(h, w, b, temperature, slot: Optional[Slot] = None):
    """``(h @ w.T + b) / T`` for a block of rows against a tile buffer (:func:`_weight_tile`), -inf
    outside ``slot``'s columns (None: keep every column)."""
    r = h.shape[0]
    hp = pad_rows(h)
    z = hp @ w.t() if b is None else torch.addmm(b, hp, w.t())
    z = z[:r]
    if slot is not None:
        z[:, :slot.p0].fill_(float("-inf"))
        z[:, slot.p1:].fill_(float("-inf"))
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _hidden_rows(hidden: torch.Tensor, acc: torch.dtype, budget: int, tile: int) -> int:
    return _rows_per_chunk(tile, acc, budget)


def _hidden_tile_stats(hidden, weight, bias, *, vocab_start, tile, with_entropy, budget, stats_fn, tile_of,
                       reference=None, sink: Optional[Sink] = None):
    """Per-tile ``(m, s, t)`` of a weight shard's logits, one grid tile of logits at a time, the
    logits of a block of rows ``r0:r1`` against a tile buffer (:func:`_weight_tile`) of ``slot``
    being ``tile_of(hb, w, b, r0, r1, slot)`` (``tile`` columns, -inf outside the slot's; it also
    picks the label logits): the loop of the plain and the sampler's paths, which differ only in that."""
    stats_fn = stats_fn or tile_stats_
    budget = budget or resolve_chunk_bytes(hidden.device)
    acc = result_dtype(hidden.dtype)
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    h = hidden.reshape(-1, hdim)
    n, width = h.shape[0], weight.shape[0]
    slots = grid(vocab_start, width, tile)
    nt = len(slots)
    m, s, t = _empty_stats(n, nt, acc, hidden.device, with_entropy)
    rows = _hidden_rows(h, acc, budget, tile)
    for j, slot in enumerate(slots):
        w, b = _weight_tile(weight, bias, slot, acc, tile)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            z = tile_of(h[r0:r1].to(acc), w, b, r0, r1, slot)
            cm, cs, ct, *more = stats_fn(z.view(r1 - r0, 1, tile), with_entropy,
                                         _reference_rows(reference, slice(r0, r1)))
            if sink is not None:
                sink.put(slice(r0, r1), j, more)
            m[r0:r1, j], s[r0:r1, j] = cm[:, 0], cs[:, 0]
            if t is not None:
                t[r0:r1, j] = ct[:, 0]
    tiles = tuple(lead) + (nt,)
    return m.view(tiles), s.view(tiles), None if t is None else t.view(tiles)


def _hidden_tile_grad(hidden, weight, bias, *, vocab_start, acc, tile, needs_grad, budget, dz_of):
    """The hidden, weight and bias gradients (see :func:`hidden_shard_grad`), one grid tile of logits
    at a time, the gradient of a block of rows ``r0:r1``'s logits against a tile buffer of ``slot``
    being ``dz_of(hb, w, b, r0, r1, slot)`` (``tile`` columns, 0 outside the slot's): the loop of the
    plain and the sampler's paths, which differ only in that."""
    budget = budget or resolve_chunk_bytes(hidden.device)
    need_h, need_w, need_b = needs_grad
    need_b = need_b and bias is not None
    hdim = hidden.shape[-1]
    h = hidden.reshape(-1, hdim)
    n, width = h.shape[0], weight.shape[0]
    dev = hidden.device
    gh = torch.zeros(n, hdim, dtype=acc, device=dev) if need_h else None
    gw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
    gb = torch.empty(bias.shape, dtype=bias.dtype, device=dev) if need_b else None
    rows = _hidden_rows(h, acc, budget, tile)
    for slot in grid(vocab_start, width, tile):
        c0, c1, p0, p1 = slot.c0, slot.c1, slot.p0, slot.p1
        w, b = _weight_tile(weight, bias, slot, acc, tile)
        gw_j = torch.zeros(tile, hdim, dtype=acc, device=dev) if need_w else None
        gb_j = torch.zeros(tile, dtype=acc, device=dev) if need_b else None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            hb = h[r0:r1].to(acc)
            dz = dz_of(hb, w, b, r0, r1, slot)
            if need_h:
                add_matmul(gh[r0:r1], dz, w)
            if need_w:
                gw_j.addmm_(pad_rows(dz).t(), pad_rows(hb))
            if need_b:
                gb_j += pad_rows(dz).sum(0)
        if need_w:
            gw[c0:c1].copy_(gw_j[p0:p1])
        if need_b:
            gb[c0:c1].copy_(gb_j[p0:p1])
    return None if gh is None else gh.view(hidden.shape), gw, gb


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       budget: Optional[int] = None, stats_fn: Optional[TileStats] = None, softcap=None, keep=None,
                       boundary=None, logits_dtype=None, reference=None, sink: Optional[Sink] = None):
    """Per-tile statistics of ``hidden @ weight.T + bias`` for a weight shard, one tile of logits at a time
    (``budget``: bytes of a tile of logits, default :func:`._hidden.resolve_chunk_bytes`; ``stats_fn``:
    a backend's own tile statistics, as ``compiled`` and ``triton`` pass)."""
    if sampler_given(labels, hidden.shape[:-1], softcap, keep, boundary, logits_dtype, temperature):
        return sampled_hidden_shard_stats(hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile,
                                          temperature=temperature, ignore_index=ignore_index,
                                          with_entropy=with_entropy, softcap=softcap, keep=keep, boundary=boundary,
                                          logits_dtype=logits_dtype, budget=budget, stats_fn=stats_fn,
                                          reference=reference, sink=sink)
    lead = hidden.shape[:-1]
    owned, column = label_columns(labels, vocab_start, weight.shape[0], ignore_index)
    picked = torch.zeros(labels_rows(lead), dtype=result_dtype(hidden.dtype), device=hidden.device)

    def tile_of(hb, w, b, r0, r1, slot):
        c0, c1 = slot.c0, slot.c1
        z = _tile_logits(hb, w, b, temperature, slot)
        inside = owned[r0:r1] & (column[r0:r1] >= c0) & (column[r0:r1] < c1)
        got = z.gather(1, (column[r0:r1] - c0).clamp(0, c1 - c0 - 1).add_(slot.p0).unsqueeze(1)).squeeze(1)
        picked[r0:r1] = torch.where(inside, got, picked[r0:r1])
        return z

    m, s, t = _hidden_tile_stats(hidden, weight, bias, vocab_start=vocab_start, tile=tile, with_entropy=with_entropy,
                                 budget=budget, stats_fn=stats_fn, tile_of=tile_of, reference=reference, sink=sink)
    return m, s, t, picked.view(lead)


def hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, *, bias, vocab_start,
                      tile, temperature, needs_grad, budget: Optional[int] = None, softcap=None, keep=None,
                      boundary=None, logits_dtype=None):
    """This shard's share of the hidden gradient (compute dtype), and the weight and bias shards'
    gradients (their dtypes), recomputing one tile of logits at a time (``budget`` as in
    :func:`hidden_shard_stats`)."""
    if sampler_given(labels, hidden.shape[:-1], softcap, keep, boundary, logits_dtype, temperature):
        return sampled_hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy,
                                         bias=bias, vocab_start=vocab_start, tile=tile, temperature=temperature,
                                         needs_grad=needs_grad, softcap=softcap, keep=keep, boundary=boundary,
                                         logits_dtype=logits_dtype, budget=budget)
    lse = lse.reshape(-1)
    entropy = None if entropy is None else entropy.reshape(-1)
    g_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1)
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1)
    owned, column = label_columns(labels, vocab_start, weight.shape[0], None)

    def dz_of(hb, w, b, r0, r1, slot):
        c0, c1 = slot.c0, slot.c1
        z = _tile_logits(hb, w, b, temperature, slot)
        inside = owned[r0:r1] & (column[r0:r1] >= c0) & (column[r0:r1] < c1)
        return _dz(z, lse[r0:r1], None if entropy is None else entropy[r0:r1],
                   None if g_lp is None else g_lp[r0:r1], None if g_ent is None else g_ent[r0:r1],
                   inside, (column[r0:r1] - c0).clamp(0, c1 - c0 - 1).add_(slot.p0), temperature)

    return _hidden_tile_grad(hidden, weight, bias, vocab_start=vocab_start, acc=lse.dtype, tile=tile,
                             needs_grad=needs_grad, budget=budget, dz_of=dz_of)


# ------------------------------------------------- the sampler's processing (feature shard_sampler)
# The same steps as naive's (kit.shard_processed, kit.shard_kept, ...), a chunk of rows (or, for the
# fused op, one tile of logits) at a time; the tile statistics by tile_stats_, so that they stay
# bitwise independent of the shard boundaries.
def sampler_given(labels, lead, softcap, keep, boundary, logits_dtype=None, temperature=1.0) -> bool:
    """Whether the sampler's path is needed: its options, candidate labels, or a per-row temperature
    (the plain path divides by a number)."""
    return (softcap is not None or keep is not None or boundary is not None or logits_dtype is not None
            or isinstance(temperature, torch.Tensor) or (labels is not None and labels.dim() > len(lead)))


def _temperature_rows(temperature, sl):
    """A per-row temperature's flat rows ``sl`` (the block's own divisors); a number as is."""
    return temperature.reshape(-1)[sl] if isinstance(temperature, torch.Tensor) else temperature


def _flat_keep(keep, n):
    return None if keep is None else keep.reshape(n, -1)


def _flat_boundary(boundary):
    return None if boundary is None else tuple(b.reshape(-1) for b in boundary)


def _part(boundary, sl):
    return None if boundary is None else tuple(b[sl] for b in boundary)


def _processed_block(x, first_id, temperature, softcap, keep, boundary, acc, logits_dtype=None):
    """``(xr, z, kept)`` of a block of raw logits ``x`` (rows, columns) whose column 0 is ``first_id``."""
    xr = kit.shard_rounded(x.to(acc), logits_dtype)
    z, y = kit.shard_processed(xr, temperature=temperature, softcap=softcap, acc=acc, logits_dtype=logits_dtype)
    if z is xr:
        z = z.clone()
    return xr, z, kit.shard_kept(y, first_id, keep, boundary)


def sampled_shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, softcap,
                        keep, boundary, budget: int, stats_fn: Optional[TileStats] = None, reference=None,
                        sink: Optional[Sink] = None):
    stats_fn = stats_fn or tile_stats_
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = vocab_start % tile
    n, nt = labels_rows(lead), n_tiles(offset + width, tile)
    m, s, t = _empty_stats(n, nt, acc, logits.device, with_entropy)
    lab = None if labels is None else labels.reshape(n, -1)
    picked = None if labels is None else torch.zeros(lab.shape, dtype=acc, device=logits.device)
    keep, boundary = _flat_keep(keep, n), _flat_boundary(boundary)
    rows = _rows_per_chunk(nt * tile, acc, budget)
    for start, chunk in chunks(logits, rows):
        r = chunk.shape[0]
        sl = slice(start, start + r)
        _, z, kept = _processed_block(chunk, vocab_start, _temperature_rows(temperature, sl), softcap,
                                      None if keep is None else keep[sl],
                                      _part(boundary, sl), acc)
        if picked is not None:
            owned, value = kit.shard_label_values(z, kept, lab[sl], vocab_start, ignore_index)
            picked[sl] = torch.where(owned, value, 0.0)
        kit.shard_masked(z, kept)
        z = _on_grid(z, offset, nt, tile)
        cm, cs, ct, *more = stats_fn(z.view(r, nt, tile), with_entropy, _reference_rows(reference, sl))
        if sink is not None:
            sink.put(sl, slice(None), more)
        m[sl], s[sl] = cm, cs
        if t is not None:
            t[sl] = ct
    tiles = tuple(lead) + (nt,)
    return (m.view(tiles), s.view(tiles), None if t is None else t.view(tiles),
            None if picked is None else picked.view(labels.shape))


def sampled_shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
                       inplace_backward, softcap, keep, boundary, budget: int):
    acc = lse.dtype
    width = logits.shape[-1]
    n = lse.numel()
    lse = lse.reshape(-1)
    entropy = None if entropy is None else entropy.reshape(-1)
    lab = None if labels is None else labels.reshape(n, -1)
    g_lp = None if grad_logprobs is None else grad_logprobs.reshape(n, -1)
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1)
    keep, boundary = _flat_keep(keep, n), _flat_boundary(boundary)
    inplace = inplace_backward and not overlapping(logits)
    out = logits.detach() if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n == 0:
        return out
    rows = _rows_per_chunk(width, acc, budget)
    flat_out = None if inplace else out.view(-1, width)
    for start, chunk in chunks(out if inplace else logits, rows):
        r = chunk.shape[0]
        sl = slice(start, start + r)
        xr, z, kept = _processed_block(chunk, vocab_start, _temperature_rows(temperature, sl), softcap,
                                       None if keep is None else keep[sl], _part(boundary, sl), acc)
        dz = kit.shard_grad_z(z, kept, None if lab is None else lab[sl], vocab_start, lse[sl],
                              None if entropy is None else entropy[sl], None if g_lp is None else g_lp[sl],
                              None if g_ent is None else g_ent[sl])
        grad = kit.shard_chain(dz, xr, temperature=_temperature_rows(temperature, sl), softcap=softcap)
        (chunk if inplace else flat_out[sl]).copy_(grad)
    if inplace and hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(logits)
    return out


def shard_topk(logits, *, vocab_start, temperature, k, decision, softcap=None, keep=None, boundary=None,
               budget: int):
    """A shard's top-k (values, global ids), a chunk of rows at a time (see the op table)."""
    acc = result_dtype(logits.dtype)
    lead, width = logits.shape[:-1], logits.shape[-1]
    n = labels_rows(lead)
    keep, boundary = _flat_keep(keep, n), _flat_boundary(boundary)
    values = torch.empty(n, k, dtype=torch.float32 if decision else acc, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    rows = _rows_per_chunk(width, acc, budget)
    for start, chunk in chunks(logits, rows):
        sl = slice(start, start + chunk.shape[0])
        xr = chunk.to(acc)
        z, y = kit.shard_processed(xr, temperature=_temperature_rows(temperature, sl), softcap=softcap, acc=acc)
        if decision:
            ranked = y
        else:
            kept = kit.shard_kept(y, vocab_start, None if keep is None else keep[sl], _part(boundary, sl))
            ranked = kit.shard_masked(z.clone(), kept)
        values[sl], ids[sl] = kit.shard_top_list(ranked, vocab_start, k)
    return values.view(*lead, k), ids.view(*lead, k)


def _tile_raw(h, w, b):
    """``h @ w.T + b`` for a block of rows against a tile buffer (no temperature), in the compute dtype."""
    return _tile_logits(h, w, b, 1.0)


def _tile_processing(n, *, vocab_start, temperature, softcap, keep, boundary, acc, logits_dtype):
    """``process(hb, w, b, r0, r1, c0, c1) -> (xr, z, kept)``: :func:`_processed_block` of the logits
    of the rows ``r0:r1`` (``hb``, of ``n``) against the weight tile ``w, b`` (the shard's columns
    ``c0:c1``), for the fused op's statistics and gradient alike."""
    keep, boundary = _flat_keep(keep, n), _flat_boundary(boundary)

    def process(hb, w, b, r0, r1, slot):
        c0, c1 = slot.c0, slot.c1
        x = _tile_raw(hb, w, b)[:, slot.p0:slot.p1]
        return _processed_block(x, vocab_start + c0, _temperature_rows(temperature, slice(r0, r1)), softcap,
                                None if keep is None else keep[r0:r1, c0:c1], _part(boundary, slice(r0, r1)),
                                acc, logits_dtype)

    return process


def sampled_hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index,
                               with_entropy, softcap, keep, boundary, logits_dtype, budget: Optional[int] = None,
                               stats_fn: Optional[TileStats] = None, reference=None, sink: Optional[Sink] = None):
    """hidden_shard_stats with the sampler's processing, one tile of logits at a time."""
    acc = result_dtype(hidden.dtype)
    n = labels_rows(hidden.shape[:-1])
    lab = labels.reshape(n, -1)
    picked = torch.zeros(lab.shape, dtype=acc, device=hidden.device)
    process = _tile_processing(n, vocab_start=vocab_start, temperature=temperature, softcap=softcap, keep=keep,
                               boundary=boundary, acc=acc, logits_dtype=logits_dtype)

    def tile_of(hb, w, b, r0, r1, slot):
        _, z, kept = process(hb, w, b, r0, r1, slot)
        owned, value = kit.shard_label_values(z, kept, lab[r0:r1], vocab_start + slot.c0, ignore_index)
        picked[r0:r1] = torch.where(owned, value, picked[r0:r1])
        kit.shard_masked(z, kept)
        return _on_grid(z, slot.p0, 1, tile)

    m, s, t = _hidden_tile_stats(hidden, weight, bias, vocab_start=vocab_start, tile=tile, with_entropy=with_entropy,
                                 budget=budget, stats_fn=stats_fn, tile_of=tile_of, reference=reference, sink=sink)
    return m, s, t, picked.view(labels.shape)


def sampled_hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, *, bias,
                              vocab_start, tile, temperature, needs_grad, softcap, keep, boundary, logits_dtype,
                              budget: Optional[int] = None):
    acc = lse.dtype
    n = labels_rows(hidden.shape[:-1])
    lse = lse.reshape(-1)
    entropy = None if entropy is None else entropy.reshape(-1)
    lab = labels.reshape(n, -1)
    g_lp = None if grad_logprobs is None else grad_logprobs.reshape(n, -1)
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1)
    process = _tile_processing(n, vocab_start=vocab_start, temperature=temperature, softcap=softcap, keep=keep,
                               boundary=boundary, acc=acc, logits_dtype=logits_dtype)

    def dz_of(hb, w, b, r0, r1, slot):
        xr, z, kept = process(hb, w, b, r0, r1, slot)
        dz = kit.shard_grad_z(z, kept, lab[r0:r1], vocab_start + slot.c0, lse[r0:r1],
                              None if entropy is None else entropy[r0:r1], None if g_lp is None else g_lp[r0:r1],
                              None if g_ent is None else g_ent[r0:r1])
        dz = kit.shard_chain(dz, xr, temperature=_temperature_rows(temperature, slice(r0, r1)), softcap=softcap,
                             logits_dtype=logits_dtype)
        return _on_grid(dz, slot.p0, 1, tile, fill=0.0)  # the tile's shape, zeros outside the slot

    return _hidden_tile_grad(hidden, weight, bias, vocab_start=vocab_start, acc=acc, tile=tile,
                             needs_grad=needs_grad, budget=budget, dz_of=dz_of)


def hidden_shard_topk(hidden, weight, *, bias, vocab_start, temperature, k, decision, softcap=None, keep=None,
                      boundary=None, logits_dtype=None, budget: Optional[int] = None):
    """A weight shard's top-k (values, global ids), one tile of logits at a time: each tile's own
    top-k, concatenated in vocabulary order, then merged (:func:`~logprob_registry.kit.merge_top_lists`)."""
    budget = budget or resolve_chunk_bytes(hidden.device)
    acc = result_dtype(hidden.dtype)
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    h = hidden.reshape(-1, hdim)
    n, width = h.shape[0], weight.shape[0]
    keep, boundary = _flat_keep(keep, n), _flat_boundary(boundary)
    tile = kit.TILE
    rows = _hidden_rows(h, acc, budget, tile)
    parts_v, parts_i = [], []
    for slot in grid(vocab_start, width, tile):
        c0, c1 = slot.c0, slot.c1
        w, b = _weight_tile(weight, bias, slot, acc, tile)
        vs, is_ = [], []
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            x = _tile_raw(h[r0:r1].to(acc), w, b)[:, slot.p0:slot.p1]
            xr = kit.shard_rounded(x, logits_dtype)
            z, y = kit.shard_processed(xr, temperature=_temperature_rows(temperature, slice(r0, r1)),
                                       softcap=softcap, acc=acc, logits_dtype=logits_dtype)
            ranked = y if decision else kit.shard_masked(z.clone(), kit.shard_kept(
                y, vocab_start + c0, None if keep is None else keep[r0:r1, c0:c1], _part(boundary, slice(r0, r1))))
            v, i = kit.shard_top_list(ranked, vocab_start + c0, min(k, c1 - c0))
            vs.append(v)
            is_.append(i)
        parts_v.append(torch.cat(vs))
        parts_i.append(torch.cat(is_))
    values, ids = torch.cat(parts_v, 1), torch.cat(parts_i, 1)
    if values.shape[1] < k:
        values = torch.cat([values, values.new_full((n, k - values.shape[1]), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_full((n, k - ids.shape[1]), kit.PAD_ID)], 1)
    values, ids = kit.merge_top_lists(values, ids, k)
    return values.view(*lead, k), ids.view(*lead, k)


def _with_token_stats(stats, sink: Sink, n: int, lead, vocab_start: int, width: int, tile: int, acc, device):
    """shard_token_stats' outputs from a stats op's ``(m, s, t, labels)`` run with
    ``kit.token_tile_stats_`` into ``sink`` for the shard ``[vocab_start, vocab_start + width)``: the
    per-tile ``q, zs`` after ``(m, s, t)`` (``zs`` -inf where the shard has a -inf logit, not only the
    tile's padding), the labels, then the shard's row max and the global id of its first maximum
    (the first tile reaching the row's max, its first column there)."""
    m, s, t, picked = stats
    slots = grid(vocab_start, width, tile)
    nt = len(slots)
    if sink.parts is None:  # no rows
        q, zs = (torch.zeros(n, nt, dtype=torch.float64, device=device) for _ in range(2))
        first = torch.zeros(n, nt, dtype=torch.int64, device=device)
    else:
        q, zs, first, low = sink.parts
        padding = torch.tensor([tile - (slot.c1 - slot.c0) for slot in slots], device=device)
        zs = zs.masked_fill(low > padding, float("-inf"))
    flat = m.reshape(n, nt)
    row_max = flat.amax(-1) if nt else torch.full((n,), float("-inf"), dtype=acc, device=device)
    hit = (flat == row_max.unsqueeze(-1)) | torch.isnan(flat)
    j = hit.to(torch.uint8).argmax(-1, keepdim=True) if nt else torch.zeros(n, 1, dtype=torch.int64, device=device)
    at = first.gather(1, j).squeeze(1) if nt else torch.zeros(n, dtype=torch.int64, device=device)
    argmax = (vocab_start - vocab_start % tile) + j.squeeze(1) * tile + at
    tiles = tuple(lead) + (nt,)
    return (m, s, t, q.view(tiles), zs.view(tiles), picked, row_max.view(lead), argmax.view(lead))


def shard_token_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, budget: int,
                      **sampler):
    """shard_stats (see the op table) with ``kit.token_tile_stats_``: the sums of ``e**2`` and ``z``
    (-inf with a -inf logit) and the first maximum, in the same pass."""
    lead, width = logits.shape[:-1], logits.shape[-1]
    offset = vocab_start % tile
    n, nt = labels_rows(lead), n_tiles(offset + width, tile)
    sink = Sink(n, nt)
    stats = shard_stats(logits, labels, vocab_start=vocab_start, tile=tile, temperature=temperature,
                        ignore_index=ignore_index, with_entropy=with_entropy, budget=budget,
                        stats_fn=kit.token_tile_stats_, sink=sink, **sampler)
    return _with_token_stats(stats, sink, n, lead, vocab_start, width, tile, result_dtype(logits.dtype),
                             logits.device)


def hidden_shard_token_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index,
                             with_entropy, budget: Optional[int] = None, **sampler):
    """hidden_shard_stats with ``kit.token_tile_stats_`` (see :func:`shard_token_stats`); ``labels``
    may be None (no label field asked: no column is a label's)."""
    lead = hidden.shape[:-1]
    n, nt = labels_rows(lead), len(grid(vocab_start, weight.shape[0], tile))
    none = labels is None
    if none:
        labels = torch.full(lead, -1, dtype=torch.int64, device=hidden.device)
    sink = Sink(n, nt)
    stats = hidden_shard_stats(hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile,
                               temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy,
                               budget=budget, stats_fn=kit.token_tile_stats_, sink=sink, **sampler)
    if none:
        stats = stats[:3] + (None,)
    return _with_token_stats(stats, sink, n, lead, vocab_start, weight.shape[0], tile, result_dtype(hidden.dtype),
                             hidden.device)
