"""The sampler's processing of one block of a vocabulary shard, for the backends' shard ops
(``shard_stats``, ``shard_grad``, ``shard_topk`` and their ``hidden_`` twins, feature
``shard_sampler``) and for the ``process_group=`` core (:mod:`logprob_registry.distributed`),
which merges the shards' top-k lists (:func:`merge_lists`) and min_p's thresholds. Backends reach
it through :mod:`logprob_registry.kit` (``kit.shard_processed``, ``kit.shard_kept``, ...), as a
third-party plugin would; the names of this module are not stable API.

Everything here is elementwise on the block's columns (or on one row's own numbers, which the
core decided the same way on every rank), so a block's results do not depend on where the shard
boundaries lie: with tiles of :data:`~logprob_registry.distributed.tiles.TILE` columns, every
rank's results stay bitwise independent of the group size.

- :func:`processed`: ``z`` (the compute dtype) and ``y`` (the float32 logits the truncation
  decision reads) of raw logits, as :func:`logprob_registry.truncation.processed_logits` computes
  them (the softcap in float64, or as an engine's three rounded ops with ``logits_dtype``);
- :func:`kept`: the tokens of the block that the sampler keeps: ``keep`` (this shard's columns of
  the mask) and the boundary ``(t, j)`` the core merged from every shard's top-k (with
  SGLang's order, ``(t, j, big, total, threshold, lower)``: at a tie the ids ``<= j`` are kept);
- :func:`label_values`: ``z`` at each label the block owns: ``-inf`` where it is not kept;
- :func:`grad_z` / :func:`chain`: the gradient with respect to ``z`` over the kept tokens, then
  back through the temperature, the softcap (its derivative ``1 - tanh(u)**2``, taken in float64
  as the reference's autograd takes it) and ``logits_dtype``'s rounding (straight through);
- :func:`top_list` / :func:`merge_lists`: a block's top-k list, and the merge of such lists.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import truncation

NEG_INF = float("-inf")
#: The id of a padding entry of a shard's top-k list (a shard narrower than k): after every real id.
PAD_ID = torch.iinfo(torch.int64).max


def rounded(x: torch.Tensor, logits_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``x`` rounded to ``logits_dtype`` (an engine's lm_head dtype) and back; ``x`` itself without it."""
    return x if logits_dtype is None else x.to(logits_dtype).to(x.dtype)


def processed(x: torch.Tensor, *, temperature, softcap: Optional[float], acc: torch.dtype,
              logits_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(z, y)`` of raw logits ``x`` (rows, columns), already rounded to ``logits_dtype`` when it
    is given: ``z = softcap(x) / T`` in ``acc`` and ``y`` the same in float32 (``z`` itself when
    ``acc`` is float32). ``temperature``: a number, or per row (rows,)."""
    s = x if softcap is None else truncation.softcapped(x, softcap, logits_dtype)
    z = _divide(s.to(acc), temperature)
    y = z if acc == torch.float32 else _divide(s.to(torch.float32), temperature)
    return z, y


def _divide(s: torch.Tensor, temperature) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return s / temperature.to(device=s.device, dtype=s.dtype).reshape(-1, 1)
    if temperature == 1.0:
        return s
    return s / torch.tensor(temperature, dtype=s.dtype, device=s.device)


def kept(y: torch.Tensor, first_id: int, keep: Optional[torch.Tensor],
         boundary: Optional[Tuple[torch.Tensor, torch.Tensor]], min_p_rows=None) -> Optional[torch.Tensor]:
    """The kept tokens of a block (rows, columns) whose column 0 is the global id ``first_id``:
    within ``keep`` (bool, the block's columns), at or above the row's boundary ``(t, j)``
    (``(value, id) >= (t, j)``) and, with ``min_p_rows``, not below min_p (:func:`min_p_kept`);
    never ``-inf``; None when none is given (every token). A boundary of six ``(t, j, big, total,
    threshold, lower)`` is SGLang's (``sampler="sglang"``): where ``lower`` (bool per row) a tie at
    ``t`` keeps the ids ``<= j`` (its stable descending sort keeps the lower ids first)."""
    lower = None
    if boundary is not None and len(boundary) == 6:
        boundary, lower = tuple(boundary[:5]), boundary[5]
    if boundary is not None and len(boundary) == 5:  # (t, j, big, total, threshold): min_p too
        boundary, min_p_rows = tuple(boundary[:2]), tuple(boundary[2:])
    if keep is None and boundary is None and min_p_rows is None:
        return None
    out = _kept_from_boundary(y, boundary, keep, first_id, lower)
    if min_p_rows is not None:
        out &= min_p_kept(y, *min_p_rows)
    return out


def _kept_from_boundary(y, boundary, keep, first_id, lower=None):
    """:func:`logprob_registry.truncation.kept_from_boundary`, the same set, with the id comparison
    only where a value equals the row's boundary value (rare) and the NaN test only where there is
    one: a few elementwise passes over the block instead of eight."""
    if boundary is None:
        out = y != NEG_INF
    else:
        t, j = boundary[0].unsqueeze(-1), boundary[1].unsqueeze(-1)
        out = y > t   # never -inf, NaN comes below
        tied = y == t
        if bool(tied.any()):
            ids = torch.arange(first_id, first_id + y.shape[-1], device=y.device)
            side = ids >= j if lower is None else torch.where(lower.unsqueeze(-1), ids <= j, ids >= j)
            out |= tied & side & (y != NEG_INF)
        nan = torch.isnan(y)
        if bool(nan.any()):
            out |= nan
    if keep is not None:
        out &= keep
    return out


def min_p_kept(y: torch.Tensor, big: torch.Tensor, total: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p on a block of float32 processed logits ``y``, given the whole row's softmax as
    ``big`` (its max) and ``total`` (``sum exp(y - big)``) and ``threshold`` (``max(probs) * min_p``,
    :func:`min_p_threshold`), all (rows,) float32: drop ``probs < threshold`` with ``probs = exp(y -
    big) / total``. Elementwise: the same verdict for a token whatever shard holds it."""
    probs = torch.exp(y - big.unsqueeze(1)) / total.unsqueeze(1)
    return ~(probs < threshold.unsqueeze(1))


def min_p_threshold(total: torch.Tensor, min_p) -> torch.Tensor:
    """``max(probs) * min_p`` per row in float32: the largest probability is ``exp(0) / total``.
    ``min_p``: a number, or per row (rows,) (0: off for that row)."""
    pmax = torch.ones_like(total) / total
    if isinstance(min_p, torch.Tensor):
        return pmax * min_p.reshape(-1).to(device=total.device, dtype=torch.float32)
    return pmax * torch.tensor(min_p, dtype=torch.float32, device=total.device)


def masked(z: torch.Tensor, keep_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``z`` with ``-inf`` outside the kept tokens (in place)."""
    return z if keep_mask is None else z.masked_fill_(~keep_mask, NEG_INF)


def label_values(z: torch.Tensor, keep_mask: Optional[torch.Tensor], labels: torch.Tensor, first_id: int,
                 ignore_index: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owned, value)`` for labels (rows, K): whether the block holds the label (and it is not
    ``ignore_index``), and ``z`` there (``-inf`` where the block holds it but does not keep it)."""
    width = z.shape[1]
    lab = labels.long()
    owned = (lab >= first_id) & (lab < first_id + width)
    if ignore_index is not None:
        owned &= lab != ignore_index
    column = torch.where(owned, lab - first_id, torch.zeros_like(lab))
    value = z.gather(1, column)
    if keep_mask is not None:
        value = torch.where(keep_mask.gather(1, column), value, torch.full((), NEG_INF, dtype=z.dtype,
                                                                          device=z.device))
    return owned, value


def grad_z(z: torch.Tensor, keep_mask: Optional[torch.Tensor], labels: Optional[torch.Tensor], first_id: int,
           lse: torch.Tensor, entropy: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
           g_ent: Optional[torch.Tensor]) -> torch.Tensor:
    """d(loss)/dz of a block (rows, columns) over the kept tokens (0 elsewhere). ``labels`` and
    ``g_lp`` (rows, K): the core has already zeroed ``g_lp`` where the label is ignored or outside
    the kept set (its log-probability is then a constant -inf)."""
    logp = z - lse.reshape(-1, 1)
    p = logp.exp()
    if keep_mask is not None:
        p = p.masked_fill(~keep_mask, 0.0)
    grad = torch.zeros_like(z)
    if g_lp is not None:
        grad -= p * g_lp.sum(-1, keepdim=True)
        width = z.shape[1]
        lab = labels.long()
        owned = (lab >= first_id) & (lab < first_id + width) & (g_lp != 0)
        rows, k = owned.nonzero(as_tuple=True)  # only there: adding 0 elsewhere would turn -0.0 into +0.0
        grad.index_put_((rows, lab[rows, k] - first_id), g_lp[rows, k], accumulate=True)
    if g_ent is not None:
        term = torch.where(p == 0, 0.0, p * (logp + entropy.reshape(-1, 1)))
        grad -= g_ent.reshape(-1, 1) * term
    return grad


def chain(grad: torch.Tensor, x: torch.Tensor, *, temperature, softcap: Optional[float],
          logits_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The gradient with respect to the raw logits ``x`` (rounded to ``logits_dtype`` when given)
    from ``grad`` with respect to ``z = softcap(x) / T``; in ``grad``'s dtype. The rounding to
    ``logits_dtype`` passes the gradient straight through; a ``-inf`` logit gets none."""
    grad = _divide(grad, temperature)
    if softcap is None:
        return grad
    xd = x.double()
    if logits_dtype is None:
        u = xd / softcap
    else:
        cap = truncation.float32_value(softcap)
        u = truncation.engine_round(xd.clamp(-truncation.F32_MAX, truncation.F32_MAX) / cap, logits_dtype)
    slope = 1.0 - torch.tanh(u) ** 2
    out = (grad.double() * slope).to(grad.dtype)
    return out.masked_fill_(torch.isneginf(x), 0.0)


def top_list(values: torch.Tensor, first_id: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block's ``k`` largest ``values`` (rows, columns) and their global ids, largest first, ties
    by smaller id (:func:`logprob_registry.truncation.topk_ids`); a block narrower than ``k`` is
    padded with ``-inf`` at :data:`PAD_ID` (after every real id)."""
    rows, width = values.shape
    take = min(k, width)
    ids = truncation.topk_ids(values, take) if take else values.new_zeros((rows, 0), dtype=torch.int64)
    top = values.gather(1, ids)
    ids = ids + first_id
    if take < k:
        top = torch.cat([top, top.new_full((rows, k - take), NEG_INF)], 1)
        ids = torch.cat([ids, ids.new_full((rows, k - take), PAD_ID)], 1)
    return top, ids


def merge_lists(values: torch.Tensor, ids: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of lists ``values``/``ids`` (rows, L) concatenated in vocabulary order
    (each list sorted by value, ties by id): largest first, ties by smaller id. Among equal values
    the position order is the id order, so :func:`~logprob_registry.truncation.topk_ids`' tie rule
    (smaller position) is the id rule: the same answer whatever the lists' number or lengths."""
    pos = truncation.topk_ids(values, k)
    return values.gather(1, pos), ids.gather(1, pos)
