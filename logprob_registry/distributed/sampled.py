"""The sampler's keywords on the vocabulary-parallel path: what each shard is told, and the
truncation decision (``top_k``, ``min_p``, ``top_p``: :class:`Truncation`), made the same way on
every rank.

Elementwise keywords only change what each shard computes, so they travel to the shard ops as
options (feature ``shard_sampler``, :mod:`.processing`): ``softcap``, ``logits_dtype``, ``keep``
(a mask's shard ``(..., V_local)`` as given, or global ids ``(..., K)`` turned into this shard's
columns of the mask here, without any communication) and candidate labels ``(..., K)``.

Truncation needs a global view, decided in rounds from gathered lists and statistics
(:class:`Truncation`), in the order of the engine replayed (``sampler``: vLLM's min_p, top_k,
top_p; transformers' top_k, top_p, min_p over the survivors; SGLang's every filter on the whole
row's softmax):

- ``top_k``: each shard's top-k ``(value, id)`` of the float32 processed logits (``shard_topk`` /
  ``hidden_shard_topk`` with ``decision=True``) is gathered, concatenated in vocabulary order and
  read in one fixed order ((value desc, id asc)): the k-th value ``t`` of a row and the smallest id
  ``j`` holding it are those of the whole vocabulary, exactly, so the boundary ``(t, j)`` (vLLM
  keeps every value tied with the k-th) is the same bits whatever the number of shards;
- ``min_p`` compares each token's probability with the largest one: the whole row's softmax max
  and normaliser come from a round of plain tile statistics (gathered and merged as always), after
  which min_p is an elementwise test every shard applies to its own tokens
  (:func:`.processing.min_p_kept`); top_k over min_p's survivors is the intersection of the two;
- ``top_p`` (a probability mass summed in sorted order): the merged lists, read down in a fixed
  order, with the survivors' normaliser (from the lists when they hold every survivor, else one
  more round of statistics within the boundary so far); the lists double until every row's mass is
  reached (:func:`top_p_boundary`, :func:`sglang_boundary`).

Then the shards' statistics are taken over the kept tokens (the boundary, an option of the shard ops).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import torch

from .. import processing
from . import core
from .group import Group
from .merge import max_and_total


def sampler_used(call) -> bool:
    """Whether ``call`` needs the shard ops' ``shard_sampler`` feature (a per-row temperature too: the
    plain shard ops divide by a number)."""
    o = call.options
    used = any(o.get(n) is not None for n in ("softcap", "keep", "top_k", "min_p", "top_p", "logits_dtype"))
    used = used or isinstance(o.get("temperature"), torch.Tensor)
    return bool(call.op == "topk_logprobs" or call.candidates or used)


def local_keep(keep: Optional[torch.Tensor], lead: tuple, start: int, width: int) -> Optional[torch.Tensor]:
    """This shard's columns of the keep mask (bool (N, width)), from a mask shard (..., width) or
    global ids (..., K) (-1: none; ids of other shards are dropped here). Ids out of range are
    checked by :func:`check_keep_ids` once the whole vocabulary is known."""
    if keep is None:
        return None
    n = 1
    for size in lead:
        n *= size
    if keep.dtype == torch.bool:
        if tuple(keep.shape) != tuple(lead) + (width,):
            raise ValueError(f"keep is a bool mask of shape {tuple(keep.shape)}, but this rank's logits shard has "
                             f"shape {tuple(lead) + (width,)}: with process_group= a mask is the shard's columns "
                             "(..., V_local) of the whole mask; or pass the kept ids (..., K), the same on every rank")
        return keep.reshape(n, width)
    if keep.dim() != len(lead) + 1 or tuple(keep.shape[:-1]) != tuple(lead):
        raise ValueError(f"keep holds ids of shape {tuple(keep.shape)}, but the positions have shape {tuple(lead)}: "
                         f"ids must have shape {tuple(lead) + ('K',)}")
    ids = keep.reshape(n, -1).long()
    mine = (ids >= start) & (ids < start + width)
    column = torch.where(mine, ids - start, torch.full_like(ids, width))  # others go to a spare column
    mask = torch.zeros(n, width + 1, dtype=torch.bool, device=keep.device)
    mask.scatter_(1, column, True)
    return mask[:, :width]


def check_keep_ids(keep: Optional[torch.Tensor], vocab: int) -> None:
    """Keep ids out of ``[-1, vocab)``: the same verdict on every rank (the ids' checksum was
    compared in the header), raised before the statistics gather."""
    if keep is None or keep.dtype == torch.bool or not keep.numel():
        return
    bad = (keep < -1) | (keep >= vocab)
    if bool(bad.any()):
        flat = keep.reshape(-1)
        first = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(f"keep id {int(flat[first])} at flat position {first} is out of range for a vocabulary of "
                         f"{vocab} (the sum of the shards' widths; ids are 0..{vocab - 1}, or -1 for none); pass "
                         "global ids, the same on every rank")


def top_k_of(top_k) -> int:
    """The most tokens a row keeps by ``top_k`` (a number, or per row: the largest), >= 1."""
    if isinstance(top_k, torch.Tensor):
        return max(1, int(top_k.max())) if top_k.numel() else 1
    return int(top_k)


_ID_BITS = 32
_PAD_PACKED = (1 << _ID_BITS) - 1   # PAD_ID in a packed entry (a vocabulary is far below 2**32 - 1 ids)


def gather_lists(group: Group, lists: Optional[Tuple[torch.Tensor, torch.Tensor]], order: tuple, rows: int,
                 device: torch.device, k: int, failure: Optional[BaseException] = None):
    """Every shard's list ``(values (rows, k_r), ids (rows, k_r))``, ``k_r = min(k, its width)``,
    padded to ``k`` and gathered, concatenated in vocabulary order: ``(values (rows, W k) float32,
    ids)``. One all-gather of ``k + 1`` int64 per row: each entry packs the float32 value's bits
    (high half) and the id (low half), so bytes are moved, never rounded. ``failure``: this rank
    could not compute its list (after the header); it still joins with its flag set (the last
    column), and every rank raises."""
    packet = torch.zeros(rows, k + 1, dtype=torch.int64, device=device)
    if failure is not None or lists is None:
        packet[:, -1] = 1
    else:
        values, ids = (x.reshape(rows, -1).to(device) for x in lists)
        if values.shape[1] < k:
            values = torch.cat([values, values.new_full((rows, k - values.shape[1]), float("-inf"))], 1)
            ids = torch.cat([ids, ids.new_full((rows, k - ids.shape[1]), processing.PAD_ID)], 1)
        bits = values[:, :k].to(torch.float32).view(torch.int32).to(torch.int64)
        ids = ids[:, :k].to(torch.int64)
        ids = torch.where(ids == processing.PAD_ID, torch.full_like(ids, _PAD_PACKED), ids)
        packet[:, :k] = (bits << _ID_BITS) | ids
    table = group.all_gather(packet, device)   # (W, rows, k + 1)
    if rows:
        failed = [r for r in range(table.shape[0]) if int(table[r, 0, -1])]
        if failed:
            raise RuntimeError(f"the top-k lists of the truncation decision failed on rank(s) {failed} (this "
                               "rank's own error, if any, is chained as its cause); no rank has a result") from failure
    packed = torch.cat([table[r, :, :k] for r in order], 1)
    vals = (packed >> _ID_BITS).to(torch.int32).view(torch.float32)   # arithmetic shift: the sign comes back
    gids = packed & _PAD_PACKED
    gids = torch.where(gids == _PAD_PACKED, torch.full_like(gids, processing.PAD_ID), gids)
    return vals, gids


def top_k_boundary(vals: torch.Tensor, gids: torch.Tensor, top_k, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(t, j)`` per row of ``top_k`` from the gathered lists (:func:`gather_lists`): the k-th value of
    the merged order and the smallest id holding it (vLLM keeps every value tied with the k-th). A row
    whose ``top_k`` is 0 (per-row tensors: off) gets ``(-inf, 0)``: every finite token is kept."""
    rows, device = vals.shape[0], vals.device
    merged, _ = processing.merge_lists(vals, gids, k)
    if isinstance(top_k, torch.Tensor):
        kk = top_k.reshape(-1).to(device=device, dtype=torch.int64).clamp(max=k)  # >= V: every token
    else:
        kk = torch.full((rows,), min(int(top_k), k), dtype=torch.int64, device=device)
    off = kk <= 0
    t = merged.gather(1, (kk - 1).clamp(0, k - 1).unsqueeze(1)).squeeze(1)
    first = (vals == t.unsqueeze(1)).to(torch.uint8).argmax(1)   # equal values lie in id order
    j = gids.gather(1, first.unsqueeze(1)).squeeze(1)
    t = torch.where(off, torch.full_like(t, float("-inf")), t)
    j = torch.where(off, torch.zeros_like(j), j)
    return t, j


def top_p_boundary(vals: torch.Tensor, gids: torch.Tensor, length: int, top_p, big: Optional[torch.Tensor],
                   total: Optional[torch.Tensor], survives, hf: bool = False) -> Tuple[torch.Tensor, ...]:
    """vLLM's top_p on the survivors of min_p and top_k, from the gathered lists of ``length`` per
    shard, whose merged first ``length`` are the global top-L (the rest of the union has holes):
    ``(t, j, dropped, decided)`` per row.

    The list is read in descending order with ties by *descending* id (the reverse of vLLM's stable
    ascending sort); ``q = exp(v - big) / total`` over the survivors (``survives(v, ids)``; ``total``
    their normaliser, relative to ``big``, the row's max; None: summed from the list, which the
    caller knows holds every survivor); walking down, ``c = 1 - (mass strictly
    above)`` in float32, in this fixed order, and a token is dropped once ``c <= 1 - top_p`` (never
    the first). Where something is ``dropped`` the boundary ``(t, j)`` is the last kept entry. A row
    is ``decided`` when its first dropped entry's value is above the list's last value (every token
    of those values is listed), or the list's last entry is no survivor (every survivor is listed:
    they lead the descending order); otherwise the caller asks for a longer list. ``hf``:
    transformers' cut, ``1 - top_p`` in float64 rounded to float32, instead of vLLM's float32
    ``1 - p`` (:func:`logprob_registry.reference._top_p_cut`)."""
    rows, device = vals.shape[0], vals.device
    width = min(length, vals.shape[1])
    pos = ref_topk_ids(vals, width)                    # the global top-L: value desc, id asc
    v, i = vals.gather(1, pos), gids.gather(1, pos)
    order = torch.sort(i, dim=1, descending=True, stable=True).indices
    v, i = v.gather(1, order), i.gather(1, order)
    order = torch.sort(v, dim=1, descending=True, stable=True).indices
    v, i = v.gather(1, order), i.gather(1, order)      # value desc, id desc
    alive = survives(v, i) & torch.isfinite(v)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if total is None:  # every survivor is listed (the caller checked): the normaliser from the list
        big = v[:, 0]
        total = torch.where(alive, torch.exp(v - big.unsqueeze(1)), zero).sum(1)
    q = torch.where(alive, torch.exp(v - big.unsqueeze(1)), zero) / total.unsqueeze(1)
    above = torch.cumsum(q, 1) - q                     # mass strictly above each entry, in list order
    c = torch.ones((), dtype=torch.float32, device=device) - above
    if isinstance(top_p, torch.Tensor):
        p = top_p.reshape(-1).to(device=device, dtype=torch.float32)
    else:
        p = torch.full((rows,), float(top_p), dtype=torch.float32, device=device)
    if hf:
        given = top_p.reshape(-1).to(device=device, dtype=torch.float64) if isinstance(top_p, torch.Tensor) \
            else torch.full((rows,), float(top_p), dtype=torch.float64, device=device)
        limit = (1.0 - given).to(torch.float32)
    else:
        limit = torch.ones((), dtype=torch.float32, device=device) - p
    drop = alive & (c <= limit.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    dropped = drop.any(1)
    cut = drop.to(torch.uint8).argmax(1)
    last = (cut - 1).clamp(min=0)
    t = v.gather(1, last.unsqueeze(1)).squeeze(1)
    j = i.gather(1, last.unsqueeze(1)).squeeze(1)
    complete = v > v[:, -1:]                           # every token of these values is listed
    decided = (dropped & complete.gather(1, cut.unsqueeze(1)).squeeze(1)) | ~alive[:, -1] | (p >= 1.0)
    return t, j, dropped, decided


def sglang_boundary(vals: torch.Tensor, gids: torch.Tensor, length: int, vocab: int, top_k, top_p,
                    big: Optional[torch.Tensor], total: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """SGLang's top_k and top_p (:func:`logprob_registry.reference._sglang_boundary`) from the
    gathered lists of ``length`` per shard: ``(t, j, decided)`` per row, the last kept entry of the
    global order (value desc, id asc: SGLang's stable descending sort), kept iff ``v > t`` or ``v == t``
    and ``id <= j``.

    The merged first ``length`` entries are the global top-L, in that order, so their positions are
    the sorted row's: a position ``>= k`` is dropped, and one whose mass before it (``cumsum - p`` of
    ``p = exp(v - big) / total``, the whole row's softmax from the plain statistics) exceeds
    ``top_p``. Both tests only grow along the order, so the kept tokens are those before the first
    dropped position; a row is ``decided`` once that position is listed (or is ``k``, within the
    list), or the list is the whole vocabulary (nothing dropped: the last entry keeps every token). min_p is elementwise
    (:func:`.processing.min_p_kept`) and applied by the shard ops."""
    rows, device = vals.shape[0], vals.device
    width = min(length, vals.shape[1])
    v, i = processing.merge_lists(vals, gids, width)
    first = torch.full((rows,), width, dtype=torch.int64, device=device)   # the first dropped position
    if top_p is not None:
        p = torch.exp(v - big.unsqueeze(1)) / total.unsqueeze(1)
        before = torch.cumsum(p, 1) - p
        if isinstance(top_p, torch.Tensor):
            limit = top_p.reshape(-1, 1).to(device=device, dtype=torch.float32)
            drop = (before > limit) & (limit != 1.0)
        else:
            drop = before > torch.tensor(float(top_p), dtype=torch.float32, device=device)
        first = torch.where(drop.any(1), drop.to(torch.uint8).argmax(1), first)
    decided = (first < width) | (width >= vocab)
    if top_k is not None:
        if isinstance(top_k, torch.Tensor):
            k = top_k.reshape(-1).to(device=device, dtype=torch.int64)
            k = torch.where((k <= 0) | (k >= vocab), vocab, k)
        else:
            k = torch.full((rows,), min(int(top_k), vocab), dtype=torch.int64, device=device)
        decided |= k <= width        # top_p's first drop, if any, lies at or after the listed ones
        first = torch.minimum(first, k)
    last = (first.clamp(max=width) - 1).clamp(min=0).unsqueeze(1)
    return v.gather(1, last).squeeze(1), i.gather(1, last).squeeze(1), decided


def every_survivor_listed(vals: torch.Tensor, length: int, survives) -> bool:
    """Whether the global top-``length`` of the gathered lists ends with a non-survivor in every row
    (survivors lead the descending order, so all of them are then listed)."""
    width = min(length, vals.shape[1])
    top = torch.topk(torch.nan_to_num(vals, nan=float("inf")), width, dim=1).values  # the values; ids irrelevant
    last = top[:, -1:]
    # the last value's survival does not depend on the id when no top_k tie straddles it: test both ids
    low = survives(last, torch.full_like(last, -1, dtype=torch.int64))
    high = survives(last, torch.full_like(last, processing.PAD_ID, dtype=torch.int64))
    return not bool((low | high).any())


def ref_topk_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    from .. import truncation as ref

    return ref.topk_ids(values, k)


def header_values(call) -> tuple:
    """The header's sampler columns of this rank's call (:data:`.header.SAMPLER_COLUMNS`), so that
    ranks disagreeing on a sampler parameter all raise before any data collective."""
    from .header import _float_bits, checksums

    o = call.options
    softcap = _float_bits(o["softcap"]) if o.get("softcap") is not None else 0
    top_k = o.get("top_k")
    if isinstance(top_k, torch.Tensor):
        top_k = int(checksums(top_k.contiguous())[0]) + (1 << 40)
    top_k = int(top_k or 0)
    keep = o.get("keep")
    if keep is None:
        keep_code = 0
    elif keep.dtype == torch.bool:
        keep_code = -1
    else:
        sums = checksums(keep)
        keep_code = 1 + int(sums[0]) * 2147483647 + int(sums[1])
    dtype = o.get("logits_dtype")
    code = {None: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)
    if call.candidates:
        code += 4 * int(call.input("labels").shape[-1])
    if call.op == "topk_logprobs":
        code += 4 * int(call.options["k"])
    code = 3 * code + ("vllm", "hf", "sglang").index(o.get("sampler") or "vllm")  # the engine's order
    probabilities = []
    for name in ("min_p", "top_p"):
        value = o.get(name)
        if isinstance(value, torch.Tensor):
            value = int(checksums(value.to(torch.float32).contiguous().view(torch.int32))[0]) + (1 << 40)
        else:
            value = _float_bits(value) if value is not None else 0
        probabilities.append(value)
    return (softcap, top_k, keep_code, code) + tuple(probabilities)


#: The first length of each shard's top list for top_p without a top_k for every row (doubled while a
#: row's mass is not reached).
TOP_P_LIST = 256


class Truncation:
    """The truncation decision of one call: ``top_k``, ``min_p`` and ``top_p`` (numbers or per row)
    in the order of the engine replayed (``sampler``), decided in rounds of gathered lists and
    statistics, the same bits on every rank (every rank reads the same gathered numbers, so every
    rank runs the same rounds). :meth:`decide` returns the boundary the shard ops keep tokens by.

    ``shard`` is this rank's side of the call (:class:`.sharded.Logits`): its ``group``;
    ``lists(length)``, this shard's top-``length`` (values, global ids) of the float32 processed
    logits; ``stats(acc, plain=True, boundary=...)``, its tile statistics over every token (or those
    within a boundary), without ``keep`` and the entropy; ``columns()``, the per-row columns of its
    statistics gather."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.top_k, self.min_p, self.top_p = options.get("top_k"), options.get("min_p"), options.get("top_p")
        self.order = options.get("sampler") or "vllm"   # the engine whose truncation is replayed

    @property
    def active(self) -> bool:
        """Whether anything is decided (top_k, min_p or top_p given)."""
        return self.top_k is not None or self.min_p is not None or self.top_p is not None

    def needs_plain(self) -> bool:
        """Whether the decision needs the whole row's softmax (max and normaliser) first: vLLM's min_p,
        and SGLang's min_p and top_p (every filter on the full distribution); transformers' min_p
        reads the survivors' softmax instead, a round of its own."""
        if self.order == "hf":
            return False
        return self.min_p is not None or (self.order == "sglang" and self.top_p is not None)

    def list_length(self) -> int:
        """The first top-L lists' length: top_k's largest value, or with top_p at least
        :data:`TOP_P_LIST` (doubled while a row's mass is not reached); 0 without either."""
        length = top_k_of(self.top_k) if self.top_k is not None else 0
        if self.top_p is not None and (self.top_k is None or isinstance(self.top_k, torch.Tensor)):
            length = max(length, TOP_P_LIST)  # (a number top_k: its k largest hold every survivor)
        return length

    def decide(self, shard, layout, lists, plain, device, acc) -> tuple:
        """The boundary, the same bits on every rank (vLLM's order: min_p, top_k, top_p): with min_p
        the whole row's softmax max, normaliser and threshold from the gathered ``plain`` statistics;
        top_k's boundary ``(t, j)`` from every shard's list (``lists``: this shard's first; or
        ``(-inf, 0)``: none); top_p's from the merged lists and the survivors' normaliser (one more
        round of statistics), lists doubled until every row's mass is reached."""
        rows = layout.rows
        vals = gids = None
        length = min(self.list_length(), layout.vocab)
        if length:
            vals, gids = gather_lists(shard.group, lists, layout.order, rows, device, length)
        if self.order == "sglang":
            return self._decide_sglang(shard, layout, vals, gids, plain, length, device, acc)
        if self.top_k is not None:
            t, j = top_k_boundary(vals, gids, self.top_k, min(top_k_of(self.top_k), layout.vocab))
        else:
            t = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
            j = torch.zeros(rows, dtype=torch.int64, device=device)
        extra = ()
        if self.order == "hf":  # top_k, top_p over its survivors, then min_p over what is left
            if self.top_p is not None:
                t, j = self._decide_top_p(shard, layout, vals, gids, (t, j), length, device, acc)
            if self.min_p is None:
                return t, j
            return (t, j) + self._min_p_over(shard, layout, (t, j), device, acc)
        if self.min_p is not None:
            big, total = self._max_and_total(shard, layout, plain, device, acc)
            extra = (big, total, processing.min_p_threshold(total, self.min_p))
        if self.top_p is None:
            return (t, j) + extra
        return self._decide_top_p(shard, layout, vals, gids, (t, j) + extra, length, device, acc)

    def _max_and_total(self, shard, layout, stats, device, acc, failure=None):
        """The row's max and ``sum exp(z - max)`` (float32) from every shard's tile statistics."""
        gathered, width = shard.gathered(layout, stats, 2, device, acc, failure)
        m, s = (core.in_order(gathered, width, layout, i, 2) for i in range(2))
        return tuple(x.to(torch.float32) for x in max_and_total(m, s))

    def _min_p_over(self, shard, layout, before, device, acc) -> tuple:
        """transformers' min_p after top_k and top_p: ``(big, total, threshold)`` of the softmax over
        the survivors of ``before`` (one more round of statistics within that boundary), so that the
        shard ops drop ``exp(y - big) / total < threshold`` (the survivors' largest probability times
        min_p)."""
        big, total = self._survivors_total(shard, layout, before, device, acc)
        return big, total, processing.min_p_threshold(total, self.min_p)

    def _survivors_total(self, shard, layout, before, device, acc):
        """The max and ``sum exp(z - max)`` of the survivors of ``before`` (one more round of
        statistics within that boundary); this rank's failure goes through the gather, so that every
        rank raises it."""
        failure = survivors = None
        try:
            survivors = shard.stats(acc, plain=True, boundary=before)
        except Exception as exc:
            failure = exc
        return self._max_and_total(shard, layout, survivors, device, acc, failure)

    def _decide_sglang(self, shard, layout, vals, gids, plain, length, device, acc):
        """SGLang's truncation (:func:`sglang_boundary`): every filter on the whole row's softmax
        (``plain``: the first round's statistics), top_k and top_p as the last kept entry of the
        global order, lists doubled until each row's first dropped position is listed; min_p
        elementwise. The boundary's sixth element marks SGLang's tie rule (ids ``<= j``)."""
        rows = layout.rows
        big = total = None
        if self.needs_plain():
            big, total = self._max_and_total(shard, layout, plain, device, acc)
        if self.top_k is None and self.top_p is None:
            t = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
            j = torch.full((rows,), processing.PAD_ID, dtype=torch.int64, device=device)
        else:
            t, j, _ = self._until_decided(
                lambda v, i, n: sglang_boundary(v, i, n, layout.vocab, self.top_k, self.top_p, big, total),
                shard, layout, vals, gids, length, device)
        if self.min_p is not None:
            threshold = processing.min_p_threshold(total, self.min_p)
        else:  # no min_p: a threshold of 0 drops nothing
            big = torch.zeros(rows, dtype=torch.float32, device=device)
            total = torch.ones(rows, dtype=torch.float32, device=device)
            threshold = torch.zeros(rows, dtype=torch.float32, device=device)
        lower = torch.ones(rows, dtype=torch.bool, device=device)
        return t, j, big, total, threshold, lower

    def _decide_top_p(self, shard, layout, vals, gids, before, length, device, acc):
        """top_p over the survivors of ``before`` (min_p and top_k's boundary), see
        :func:`top_p_boundary`."""
        t_k, j_k = before[0], before[1]

        def survives(v, i):
            ok = (v > t_k.unsqueeze(1)) | ((v == t_k.unsqueeze(1)) & (i >= j_k.unsqueeze(1)))
            if len(before) == 5:
                ok &= processing.min_p_kept(v, *before[2:])
            return ok

        big = total = None
        if self.top_k is None or isinstance(self.top_k, torch.Tensor) \
                or not every_survivor_listed(vals, length, survives):
            # the survivors' normaliser from one more round of statistics (with a number top_k every
            # survivor is usually listed, and the list gives it; the same verdict on every rank)
            big, total = self._survivors_total(shard, layout, before, device, acc)

        t, j, dropped, _ = self._until_decided(
            lambda v, i, n: top_p_boundary(v, i, n, self.top_p, big, total, survives, hf=self.order == "hf"),
            shard, layout, vals, gids, length, device)
        t = torch.where(dropped, t, t_k)
        j = torch.where(dropped, j, j_k)
        return (t, j) + tuple(before[2:])

    @staticmethod
    def _until_decided(decide, shard, layout, vals, gids, length: int, device):
        """``decide(values, ids, length)`` on the merged lists (its last output: the rows it could
        decide), the lists doubling until every row is decided or they hold the whole vocabulary.
        Every rank reads the same lists, so every rank runs the same number of rounds."""
        while True:
            out = decide(vals, gids, length)
            if bool(out[-1].all()) or length >= layout.vocab:
                return out
            length = min(2 * length, layout.vocab)
            failure = mine = None
            try:
                mine = shard.lists(length)
            except Exception as exc:  # carried to every rank by the gather
                failure = exc
            vals, gids = gather_lists(shard.group, mine, layout.order, layout.rows, device, length, failure)
