"""The sampler's truncation decision, replayed: which tokens an inference engine's sampler keeps.

Runtime code, not a reference: the built-in backends (``naive``, ``chunked``), the
``process_group=`` path (:mod:`logprob_registry.distributed`, through the block processing of
:mod:`logprob_registry.processing`), :mod:`logprob_registry.parity` and the float64 ground truth
(:mod:`logprob_registry.reference`) all decide the kept set with these functions. A replay keeps
the tokens the engine kept only if it decides as the engine decides, so each engine's order and
tie rules (``sampler=``: :data:`ORDERS`) are replayed op for op, in float32, as its source runs
them (docs/sampler.md):

* ``"vllm"``: vLLM's V1 sampler (v0.33.0, ``vllm/v1/sample/ops/topk_topp_sampler.py``
  ``apply_top_k_top_p_pytorch`` and ``vllm/v1/sample/logits_processor/builtin.py``
  ``MinPLogitsProcessor``): min_p, top_k, then top_p, with float32 softmaxes, an ascending stable
  sort and a float32 cumulative sum;
* ``"hf"``: transformers' ``generate`` warpers: top_k, top_p (against the float64 ``1 - top_p``),
  then min_p on what is left;
* ``"sglang"``: every filter on the full distribution sorted descending, ties by lower id.

What is here:

- the processed logits the decision reads: :func:`processed_logits` / :func:`decision_logits`
  (softcap, then the temperature, :func:`divided`); the softcap computed in float64 and rounded
  once, or with ``logits_dtype`` (an engine whose lm_head runs in bf16/fp16) as that engine
  computes it, three ops each rounded to ``logits_dtype`` (:func:`softcapped`,
  :func:`engine_round`, :func:`float32_value`);
- the decision: per row a boundary ``(t, j)`` (:func:`truncation_boundary`), the tokens it keeps
  in a block of columns (:func:`kept_from_boundary`), ``keep=`` as a mask (:func:`keep_mask`), all
  at once as a bool mask (:func:`kept_tokens`);
- the ``k`` largest values, ties by smaller id (:func:`topk_ids`), as ``topk_logprobs`` lists them.

Every function is row-wise: ``chunked`` runs them on its chunks of rows and the ground truth on
whole tensors, so the two decide bit for bit alike. Backends reach them through
:mod:`logprob_registry.kit` (``kit.truncation_boundary``, ``kit.kept_from_boundary``,
``kit.keep_mask``, ``kit.topk_ids``, ``kit.float32_value``), as a third-party plugin would; the
names of this module are not stable API.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

NEG_INF = float("-inf")


# ------------------------------------------------------------------------ the processed logits
def divided(s: torch.Tensor, temperature) -> torch.Tensor:
    """``s / temperature``: a number (1.0: ``s`` itself), or per row (a tensor broadcastable to the
    positions ``s.shape[:-1]``). Always a true division by a tensor in ``s``'s dtype, so that a row
    of a per-row call and the call with that row's value as a number divide alike (torch multiplies
    by the reciprocal of a Python-number divisor on CUDA, and for bf16/fp16 on the CPU)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=s.device, dtype=s.dtype)
        return s / torch.broadcast_to(t, s.shape[:-1]).unsqueeze(-1)
    if temperature == 1.0:
        return s
    return s / torch.tensor(temperature, dtype=s.dtype, device=s.device)


def softcapped(logits: torch.Tensor, softcap: float, logits_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in float64 (differentiable): -inf stays -inf (a masked
    token stays masked), NaN stays NaN.

    Without ``logits_dtype``: computed in float64 and rounded once by the caller, so that every
    backend gets the same correctly rounded float32 value wherever an element sits in a tensor
    (torch's float32 tanh differs by an ulp between its vectorised body and its scalar tail).

    With ``logits_dtype`` (bf16/fp16, the dtype of an engine's lm_head): the softcap as the engine
    computes it on its head's logits (Hugging Face's Gemma-2, vLLM's ``LogitsProcessor``): three
    elementwise ops, ``x / softcap``, ``tanh``, ``* softcap``, each rounded to ``logits_dtype``
    (see :func:`engine_round`). Gradients go straight through each rounding; the softcap's own
    derivative ``1 - tanh(u)**2`` is taken accurately, in float64, at the rounded ``u = x / softcap``.
    """
    x = logits.double()
    if logits_dtype is None:
        capped = torch.tanh(x / softcap) * softcap
        return torch.where(torch.isneginf(x), x, capped)
    cap = float32_value(softcap)  # the engine's opmath: a Python-number operand becomes a float32
    # +-inf to the largest finite float32 (tanh saturates there: the engine's +inf gives softcap; -inf
    # is put back below), so that no inf - inf of the straight-through rounding makes a NaN.
    finite = x.clamp(-F32_MAX, F32_MAX)
    u = engine_round(finite / cap, logits_dtype)
    t = engine_round(torch.tanh(u), logits_dtype)
    capped = engine_round(t * cap, logits_dtype)
    return torch.where(torch.isneginf(x), x.detach(), capped)  # -inf: no gradient, as chunked's


#: The largest finite float32: where an engine's softcap clamps +-inf (:func:`softcapped`).
F32_MAX = torch.finfo(torch.float32).max


def float32_value(value: float) -> float:
    """``value`` rounded to float32 (as a Python float): what a float32 kernel computes with."""
    return float(torch.tensor(value, dtype=torch.float32))


def engine_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64, one elementwise op's exact or float64 result) rounded as a bf16/fp16 kernel
    rounds it: to float32 (its compute dtype), then to ``dtype``; back in ``x``'s dtype, with the
    identity as gradient. For a division or a product the float64 step changes nothing (53 >= 2 x 24
    + 2 bits: rounding twice is rounding once), so this is bitwise the engine's op; a float32 tanh
    differs from the float64 one by an ulp or so of float32, 2**-16 of a bf16 ulp (on every bf16 and
    fp16 value, tests/test_sampler.py finds torch's bf16/fp16 softcap bitwise equal to this)."""
    rounded = x.detach().to(torch.float32).to(dtype).to(x.dtype)
    return x + (rounded - x.detach())


def processed_logits(logits: torch.Tensor, *, temperature=1.0, softcap: Optional[float] = None,
                     dtype: torch.dtype = torch.float64, logits_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``softcap(logits) / temperature`` in ``dtype`` (the softcap computed in float64, or with
    ``logits_dtype`` as the engine's three rounded ops, see :func:`softcapped`, rounded to
    ``dtype``; then the division in ``dtype``). In float32 these are, bit for bit, the logits the
    truncation decision sees (vLLM casts to float32 and divides by a float32 temperature)."""
    s = logits.to(dtype) if softcap is None else softcapped(logits, softcap, logits_dtype).to(dtype)
    # A tensor divisor on the logits' device, as vLLM's per-row temperature: a true division on
    # every device (CUDA multiplies by the reciprocal of a Python-number divisor).
    return divided(s, temperature)


def decision_logits(logits: torch.Tensor, temperature=1.0, softcap: Optional[float] = None,
                    logits_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float32 processed logits that the truncation decision reads (no gradient)."""
    with torch.no_grad():
        return processed_logits(logits.detach(), temperature=temperature, softcap=softcap, dtype=torch.float32,
                                logits_dtype=logits_dtype)


# ------------------------------------------------------------------------------- the decision
def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


#: The engines whose order and tie rules :func:`truncation_boundary` replays (``sampler=``).
ORDERS = ("vllm", "hf", "sglang")


def _order(order: Optional[str]) -> str:
    if order is None:
        return "vllm"
    if order not in ORDERS:
        raise ValueError(f"order (sampler=) must be one of {', '.join(map(repr, ORDERS))}, got {order!r}")
    return order


def _column(value, y: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A parameter as the rows of ``y`` (R, V) see it: a number as a 0-d tensor of ``dtype``, a
    per-row tensor (R,) as a column (R, 1). Elementwise ops with either give each row the same bits."""
    if isinstance(value, torch.Tensor):
        return value.to(device=y.device, dtype=dtype).reshape(-1, 1)
    return torch.tensor(value, dtype=dtype, device=y.device)


def _row_on(value, off, y: torch.Tensor) -> Optional[torch.Tensor]:
    """For a per-row parameter, the bool column (R, 1) of the rows where it is on (not ``off``,
    its "off" value); None for a number (on in every row)."""
    if not isinstance(value, torch.Tensor):
        return None
    return (value.to(y.device).reshape(-1, 1) != off)


def _k_column(top_k, vocab: int, y: torch.Tensor) -> torch.Tensor:
    """Per-row top_k (R,) as int64 (R, 1), with 0, -1 and >= V (off) as V (keeps every position)."""
    k = top_k.to(device=y.device, dtype=torch.int64).reshape(-1, 1)
    return torch.where((k <= 0) | (k >= vocab), vocab, k)


def _min_p_(y: torch.Tensor, min_p) -> None:
    """Drop (to -inf, in place) the tokens of ``y`` less probable than ``min_p`` times the most
    probable one, on the float32 softmax of ``y`` (strict: a token at the threshold is kept; a row
    with min_p 0 keeps all)."""
    probs = torch.softmax(y, -1)
    threshold = probs.amax(-1, keepdim=True) * _column(min_p, y)
    y.masked_fill_(probs < threshold, NEG_INF)


def _top_k_(y: torch.Tensor, top_k) -> None:
    """Drop (in place) the values strictly below the k-th largest (every copy of it is kept): vLLM's
    and transformers' rule. Per row (R,): the k-th largest read from the sorted row (the same value
    ``torch.topk`` gives), off rows untouched."""
    vocab = y.shape[-1]
    if not isinstance(top_k, torch.Tensor):
        if top_k < vocab:
            kth = torch.topk(y, top_k, -1).values[:, -1:]
            y.masked_fill_(y < kth, NEG_INF)
        return
    k = _k_column(top_k, vocab, y)
    kth = sorted_values(y).gather(1, (vocab - k).clamp(max=vocab - 1))
    kth = torch.where(k < vocab, kth, torch.full((), NEG_INF, device=y.device))
    y.masked_fill_(y < kth, NEG_INF)


def _top_p_cut(top_p, y: torch.Tensor, order: str) -> torch.Tensor:
    """The float32 cumulative mass at or under which top_p drops a sorted position: vLLM computes
    ``1 - p`` in float32 (``p`` a float32 tensor); transformers compares with the Python float
    ``1 - top_p`` (float64), which torch rounds to float32."""
    if order == "hf":
        if isinstance(top_p, torch.Tensor):
            return (1.0 - top_p.to(device=y.device, dtype=torch.float64).reshape(-1, 1)).to(torch.float32)
        return _f32(1.0 - top_p, y)
    return _f32(1.0, y) - _column(top_p, y)


def _first_kept(y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(t, j)`` of rows ``y`` whose dropped tokens are -inf: the smallest kept finite value and
    the lowest id holding it (``t = +inf``, ``j = V`` where nothing finite is kept)."""
    vocab = y.shape[-1]
    kept = (y != NEG_INF) & ~torch.isnan(y)
    t = torch.where(kept, y, torch.full((), math.inf, device=y.device)).amin(-1)
    first = kept & (y == t.unsqueeze(-1))
    j = torch.where(first.any(-1), first.to(torch.uint8).argmax(-1), vocab)  # argmax: the first maximum
    return t, j


def _merge_top_p(t, j, boundary, on: Optional[torch.Tensor]):
    """Where top_p's boundary is a real token (not -inf, as in a row of NaN) and top_p is on in the
    row, it is the answer."""
    real = torch.isfinite(boundary[0])
    if on is not None:
        real &= on.reshape(-1)
    return torch.where(real, boundary[0], t), torch.where(real, boundary[1], j)


def truncation_boundary(y: torch.Tensor, *, top_k=None, top_p=None, min_p=None, inplace: bool = False,
                        order: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Which tokens an engine's sampler keeps after ``min_p``, ``top_k`` and ``top_p``, per row of
    the float32 processed logits ``y`` ``(R, V)``, as a boundary ``(t, j)`` (float32 ``(R,)``, int64
    ``(R,)``): a token of value ``v`` and id ``i`` is kept iff ``(v, i) >= (t, j)``
    lexicographically (``order="sglang"``: iff ``v > t`` or ``v == t`` and ``i <= j``; NaN is
    always kept, -inf never; see :func:`kept_from_boundary`).

    Each parameter is a number, None (off), or per row a tensor ``(R,)`` (top_k int: 0, -1 or
    ``>= V`` off for that row; top_p float: 1.0 off; min_p float: 0.0 off); a row's boundary is
    bitwise that of the call with the row's values as numbers.

    ``order`` (the public ``sampler=``; None is ``"vllm"``) is the engine whose procedure is
    replayed, op for op, in float32 (docs/sampler.md):

    * ``"vllm"`` (V1): 1. ``min_p`` on the full distribution: ``probs = softmax(y)``; drop
      ``probs < max(probs) * min_p`` (strict); 2. ``top_k``: drop values strictly below the k-th
      largest (every value tied with it is kept); 3. ``top_p``, on the survivors: sort ascending
      (stable), ``softmax`` of the sorted row, cumulative sum, drop positions with ``cumsum <= 1 - p``
      (``1 - p`` in float32), never the last. Among equal values the stable sort puts the lower id
      first, so the lower id is dropped first when a tie straddles the boundary.
    * ``"hf"`` (transformers' ``generate`` warpers): ``top_k`` as vLLM's, then ``top_p`` as vLLM's
      but against the float64 ``1 - top_p`` rounded to float32, then ``min_p`` on the softmax of
      what is left.
    * ``"sglang"``: every filter on the full distribution ``probs = softmax(y)`` sorted descending
      (stable: ties by lower id first): positions ``>= top_k`` dropped (exactly k tokens: a tie at
      the k-th value keeps the lower ids), positions whose cumulative sum before them exceeds
      ``top_p`` (``cumsum - p > top_p``), and ``p < p_max * min_p``; the kept tokens are the
      positions before the first dropped one.

    Each step drops a prefix of the ascending ``(value, id)`` order (for sglang: of ``(value,
    -id)``), so the kept tokens are summed up by the first kept element ``(t, j)``. A row where
    nothing finite is kept gives ``t = +inf``. ``inplace=True`` lets it overwrite ``y``.
    """
    order = _order(order)
    if not inplace:
        y = y.clone()
    if order == "sglang":
        return _sglang_boundary(y, top_k, top_p, min_p)
    top_p_on = _row_on(top_p, 1.0, y)
    boundary = None
    if order == "vllm":
        if min_p is not None:
            _min_p_(y, min_p)
        if top_k is not None:
            _top_k_(y, top_k)
        if top_p is not None and (top_p_on is not None or top_p < 1.0):
            boundary = _top_p_boundary_at(y, _top_p_cut(top_p, y, order))
    else:  # hf: top_k, top_p, then min_p on what is left
        if top_k is not None:
            _top_k_(y, top_k)
        if top_p is not None and (top_p_on is not None or top_p < 1.0):
            b = _top_p_boundary_at(y, _top_p_cut(top_p, y, order))
            t, j = _merge_top_p(torch.full_like(b[0], NEG_INF), torch.zeros_like(b[1]), b, top_p_on)
            y.masked_fill_(~kept_from_boundary(y, (t, j)), NEG_INF)  # NaN stays (always kept)
        if min_p is not None:
            _min_p_(y, min_p)
    t, j = _first_kept(y)
    if boundary is not None:
        t, j = _merge_top_p(t, j, boundary, top_p_on)
    return t, j


def _sglang_boundary(y: torch.Tensor, top_k, top_p, min_p) -> Tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` on rows ``y``: the last kept token
    ``(t, j)`` in descending ``(value, -id)`` order (see :func:`truncation_boundary`)."""
    rows, vocab = y.shape
    probs = torch.softmax(y, -1)
    order = torch.sort(y, dim=-1, descending=True, stable=True).indices  # probs' order, ties by lower id
    p = probs.gather(1, order)
    del probs
    drop = torch.zeros(rows, vocab, dtype=torch.bool, device=y.device)
    position = torch.arange(vocab, device=y.device)
    if top_k is not None:
        k = _k_column(top_k, vocab, y) if isinstance(top_k, torch.Tensor) else top_k
        drop |= position >= k
    if top_p is not None:
        before = torch.cumsum(p, -1).sub_(p)
        cut = before > _column(top_p, y)
        on = _row_on(top_p, 1.0, y)
        drop |= cut if on is None else cut & on
    if min_p is not None:
        drop |= p < p[:, :1] * _column(min_p, y)
    b = torch.where(drop.any(-1), drop.to(torch.uint8).argmax(-1), vocab)  # the first dropped position
    last = (b - 1).clamp(min=0).unsqueeze(-1)
    j = order.gather(1, last)
    t = y.gather(1, j)
    return t.squeeze(-1), j.squeeze(-1)


def sorted_values(y: torch.Tensor) -> torch.Tensor:
    """``torch.sort(y, dim=-1).values``. The sorted values of a row do not depend on the algorithm
    (only the order of equal values' ids does, which is not asked here), so on the CPU numpy's sort,
    several times faster than torch's, is used when numpy is installed."""
    if y.device.type == "cpu" and not y.requires_grad:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            return torch.from_numpy(np.sort(y.numpy(), axis=-1))
    return torch.sort(y, dim=-1).values


def _top_p_boundary_at(y: torch.Tensor, cut: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top_p on rows ``y`` (min_p and top_k already applied as -inf) dropping the sorted positions
    whose cumulative mass is ``<= cut`` (:func:`_top_p_cut`): the first kept token
    ``(t, j)`` in ascending ``(value, id)`` order, the order of vLLM's sort made stable.

    vLLM sorts ascending, takes the softmax of the sorted row and its cumulative sum, and drops the
    positions with ``cumsum <= 1 - p`` except the last. The sorted values (and so the softmax and the
    sums, bit for bit) are those of any sort; the first kept position ``b`` holds value ``t``, and
    the stable order puts equal values by ascending id, so ``j`` is the id of the ``(b - #{y < t})``-th
    token equal to ``t``."""
    values = sorted_values(y)
    cumulative = torch.softmax(values, -1)
    torch.cumsum(cumulative, -1, out=cumulative)
    drop = cumulative <= cut  # cut: 1 - top_p in float32 (0-d, or a column (R, 1) per row)
    del cumulative
    drop[:, -1] = False
    b = (~drop).to(torch.uint8).argmax(-1)  # the first kept position
    del drop
    t = values.gather(1, b.unsqueeze(-1))
    rank = b - (values < t).sum(-1)  # copies of t dropped before it
    del values
    equal = y == t
    j = equal.to(torch.uint8).argmax(-1)
    tied = (rank > 0).nonzero().squeeze(-1)
    if tied.numel():  # a tie straddles the boundary: the rank-th copy by ascending id
        counts = equal[tied].to(torch.int32).cumsum(-1)
        j[tied] = (equal[tied] & (counts == rank[tied].unsqueeze(-1) + 1)).to(torch.uint8).argmax(-1)
    return t.squeeze(-1), j


def kept_from_boundary(y: torch.Tensor, boundary: Optional[Tuple[torch.Tensor, torch.Tensor]],
                       keep: Optional[torch.Tensor] = None, first_id: int = 0,
                       order: Optional[str] = None) -> torch.Tensor:
    """The kept tokens of rows ``y`` (float32 processed logits, ``(R, V)``): ``(value, id) >=
    (t, j)`` for ``boundary`` (None: no min_p/top_k/top_p), or NaN; never -inf (a token the
    sampler gives no probability, so a label there gets -inf and a zero gradient); and within
    ``keep`` (a bool mask ``(R, V)``) when given. ``first_id`` is the id of column 0. ``order``:
    the boundary's (:func:`truncation_boundary`): for ``"sglang"`` a tie at ``t`` keeps the ids
    ``<= j`` (its descending sort keeps the lower ids), else those ``>= j``."""
    kept = y != NEG_INF
    if boundary is not None:
        t, j = (b.unsqueeze(-1) for b in boundary)
        ids = torch.arange(first_id, first_id + y.shape[-1], device=y.device)
        tie = ids <= j if order == "sglang" else ids >= j
        kept &= (y > t) | ((y == t) & tie) | torch.isnan(y)
    if keep is not None:
        kept &= keep
    return kept


def keep_mask(keep: torch.Tensor, vocab: int) -> torch.Tensor:
    """``keep`` as a bool mask ``(..., V)``: a mask as is, ids ``(..., K)`` (-1: none) scattered."""
    if keep.dtype == torch.bool:
        return keep
    ids = keep.long()
    index = torch.where(ids >= 0, ids, vocab)  # -1 goes to a spare column, dropped below
    mask = torch.zeros(ids.shape[:-1] + (vocab + 1,), dtype=torch.bool, device=keep.device)
    mask.scatter_(-1, index, True)
    return mask[..., :vocab]


def kept_tokens(logits: torch.Tensor, *, temperature=1.0, softcap: Optional[float] = None,
                top_k=None, top_p=None, min_p=None, keep: Optional[torch.Tensor] = None,
                logits_dtype: Optional[torch.dtype] = None, sampler: Optional[str] = None) -> torch.Tensor:
    """The bool mask ``(..., V)`` of the tokens the sampler keeps (see :func:`truncation_boundary`);
    ``temperature``, ``top_k``, ``top_p``, ``min_p``: numbers, or per row tensors broadcastable to
    the positions ``logits.shape[:-1]``; ``sampler``: the engine's order (None: vLLM's)."""
    top_k, top_p, min_p = normalise(logits.shape[-1], top_k, top_p, min_p)
    vocab = logits.shape[-1]
    y = decision_logits(logits, temperature, softcap, logits_dtype).reshape(-1, vocab)
    boundary = None
    if top_k is not None or top_p is not None or min_p is not None:
        lead = logits.shape[:-1]
        top_k, top_p, min_p = (rows_of(value, lead) for value in (top_k, top_p, min_p))
        boundary = truncation_boundary(y, top_k=top_k, top_p=top_p, min_p=min_p, order=sampler)
    mask = None if keep is None else keep_mask(keep, vocab).reshape(-1, vocab)
    return kept_from_boundary(y, boundary, mask, order=sampler).view(logits.shape)


def rows_of(value, lead):
    """A per-row parameter (a tensor broadcastable to the positions ``lead``) as one value per flat
    row ``(R,)``; a number or None as is."""
    if isinstance(value, torch.Tensor):
        return torch.broadcast_to(value, tuple(lead)).reshape(-1)
    return value


def normalise(vocab: int, top_k, top_p, min_p):
    """vLLM's "disabled" values (top_k 0, -1 or >= V; top_p 1; min_p 0) as None; per-row tensors
    as they are (their rows' "off" values are read per row)."""
    if not isinstance(top_k, torch.Tensor):
        top_k = None if top_k is None or top_k <= 0 or top_k >= vocab else int(top_k)
    if not isinstance(top_p, torch.Tensor):
        top_p = None if top_p is None or top_p >= 1.0 else float(top_p)
    if not isinstance(min_p, torch.Tensor):
        min_p = None if min_p is None or min_p <= 0.0 else float(min_p)
    return top_k, top_p, min_p


def topk_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest ``values`` along the last dim, largest first, ties by smaller
    id (NaN counts as the largest, as in ``torch.topk``): ``torch.topk``, then, in the rows where a
    tie at the k-th value has more copies than places, the smallest ids among them."""
    values = values.detach()
    lead, vocab = values.shape[:-1], values.shape[-1]
    if values.numel() == 0:
        return torch.zeros(lead + (k,), dtype=torch.int64, device=values.device)
    inf = torch.full((), math.inf, dtype=values.dtype, device=values.device)
    key = torch.where(torch.isnan(values), inf, values).reshape(-1, vocab)
    top, ids = torch.topk(key, k, -1)
    kth = top[:, -1:]
    short = ((key == kth).sum(-1) > (top == kth).sum(-1)).nonzero().squeeze(-1)
    if short.numel():  # torch.topk chose among the tied copies freely: take the smallest ids
        rows = key[short]
        above, tied = rows > kth[short], rows == kth[short]
        room = k - above.sum(-1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))
        ids[short] = chosen.nonzero()[:, 1].view(-1, k)
        top[short] = rows.gather(-1, ids[short])
    ids, order = ids.sort(-1)  # ascending ids, then a stable sort by value: ties by smaller id
    order = torch.sort(top.gather(-1, order), dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order).view(lead + (k,))
