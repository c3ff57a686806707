"""Ground truth: the textbook formulas, computed in float64 (or a dtype the caller names).

This is what the conformance suite compares every backend against: the functions the op table's
``reference=`` fields name (:func:`logprobs`, :func:`entropy`, :func:`logprobs_and_entropy`,
:func:`topk_logprobs`, :func:`logprobs_from_hidden`, :func:`kl_divergence`, :func:`token_stats`) and their
helpers. It
is not a backend; the ``naive`` backend runs the same formulas in float32
(``kit.reference_function``).

The sampler's processing (``softcap``, ``top_k``, ``top_p``, ``min_p``, ``keep``; docs/sampler.md)
is split in two, as an inference engine's sampler computes it and as a trainer needs it:

* **which tokens are kept** is decided exactly as the engine decides it, on the float32 processed
  logits, by :mod:`logprob_registry.truncation` (runtime code, which the backends run too), so
  that a replay keeps the tokens the engine kept;
* **the log-probabilities over the kept tokens** are computed here accurately, in ``dtype``
  (float64 by default), from the same processed logits.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .dtypes import result_dtype  # noqa: F401 - public here too (reference.result_dtype)
from .sampler import Sampler
from .truncation import NEG_INF, divided, kept_tokens, normalise, processed_logits, topk_ids


def _prepare(logits: torch.Tensor, temperature, dtype: torch.dtype) -> torch.Tensor:
    return divided(logits if logits.dtype == dtype else logits.to(dtype), temperature)


def _unprocessed(softcap, top_k, top_p, min_p, keep) -> bool:
    """Whether no sampler keyword is given (``not Sampler(...).used``, without building one: the
    ``naive`` backend runs these functions on every small call)."""
    return softcap is None and top_k is None and top_p is None and min_p is None and keep is None


def _gather(logp: torch.Tensor, labels: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """``logp[..., labels]``: labels ``(...)``, or ``(..., K)`` candidates (one more dim than ``(...)``)."""
    index = labels if labels.dtype == torch.int64 else labels.long()
    ignored = None
    if ignore_index is not None:
        ignored = index == ignore_index
        index = index.masked_fill(ignored, 0)
    if index.dim() == logp.dim():
        out = logp.gather(-1, index)
    else:
        out = logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return out if ignored is None else out.masked_fill(ignored, 0.0)


def _entropy(x: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    # -sum p log p, with 0 log 0 = 0 for masked (-inf) entries, and no NaN in the gradient there.
    safe = torch.where(torch.isneginf(x), torch.zeros_like(logp), logp)
    return -(logp.exp() * safe).sum(-1)


# ------------------------------------------------------------------------ over the kept tokens
def _truncated(z: torch.Tensor, kept: torch.Tensor):
    """``(logp, kept, outside)``: the log-softmax of ``z`` over the kept tokens (finite at kept
    tokens; never NaN elsewhere, and no NaN in its gradient), and the value of a token outside the
    kept set: -inf, or NaN in a row whose kept tokens hold a NaN."""
    empty = ~kept.any(-1, keepdim=True)
    # A row with nothing kept gets zeros (a finite, constant log-softmax) instead of -inf everywhere.
    zm = z.masked_fill(~kept, NEG_INF).masked_fill(empty, 0.0)
    logp = zm.log_softmax(-1)
    with torch.no_grad():
        nan_row = torch.isnan(zm).any(-1, keepdim=True)
        outside = torch.where(nan_row, torch.full((), math.nan, dtype=z.dtype, device=z.device),
                              torch.full((), NEG_INF, dtype=z.dtype, device=z.device))
    return logp, outside


def _truncated_entropy(logp: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    safe = logp.masked_fill(~kept, 0.0)
    return -(torch.where(kept, safe.exp(), torch.zeros_like(safe)) * safe).sum(-1)


def _truncated_gather(logp, kept, outside, labels, ignore_index):
    value = torch.where(kept, logp, outside)
    return _gather(value, labels, ignore_index)


class _Processed:
    """The processed distribution of one call: ``logp`` ``(..., V)`` and, with truncation, the
    kept mask and the value outside it. ``logits_dtype``: the softcap as an engine whose lm_head
    runs in that dtype computes it (:func:`softcapped`)."""

    def __init__(self, logits, temperature, dtype, softcap, top_k, top_p, min_p, keep, logits_dtype=None,
                 sampler=None):
        top_k, top_p, min_p = normalise(logits.shape[-1], top_k, top_p, min_p)
        self.z = processed_logits(logits, temperature=temperature, softcap=softcap, dtype=dtype,
                                  logits_dtype=logits_dtype)
        self.kept = None
        if Sampler(top_k=top_k, top_p=top_p, min_p=min_p, keep=keep).truncates:
            self.kept = kept_tokens(logits, temperature=temperature, softcap=softcap, top_k=top_k,
                                    top_p=top_p, min_p=min_p, keep=keep, logits_dtype=logits_dtype, sampler=sampler)
            self.logp, self.outside = _truncated(self.z, self.kept)
        else:
            self.logp = self.z.log_softmax(-1)

    def full(self) -> torch.Tensor:
        """Every token's processed log-probability, ``-inf`` outside the kept set."""
        return self.logp if self.kept is None else torch.where(self.kept, self.logp, self.outside)

    def gather(self, labels, ignore_index):
        if self.kept is None:
            return _gather(self.logp, labels, ignore_index)
        return _truncated_gather(self.logp, self.kept, self.outside, labels, ignore_index)

    def entropy(self):
        if self.kept is None:
            return _entropy(self.z, self.logp)
        return _truncated_entropy(self.logp, self.kept)


# ------------------------------------------------------------------------------------------- ops
def logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature=1.0,
    ignore_index: Optional[int] = None, dtype: torch.dtype = torch.float64,
    softcap: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
    min_p: Optional[float] = None, keep: Optional[torch.Tensor] = None, logits_dtype: Optional[torch.dtype] = None,
    sampler: Optional[str] = None,
) -> torch.Tensor:
    """``log_softmax(processed logits)[..., labels]``; labels ``(...)`` or candidates ``(..., K)``.

    ``logits_dtype`` (not a keyword of the public logits ops: ``logprobs_from_hidden`` passes its
    own): the dtype of the engine's lm_head, in which the softcap then runs (:func:`softcapped`);
    without a softcap it changes nothing here."""
    if _unprocessed(softcap, top_k, top_p, min_p, keep):
        return _gather(_prepare(logits, temperature, dtype).log_softmax(-1), labels, ignore_index)
    d = _Processed(logits, temperature, dtype, softcap, top_k, top_p, min_p, keep, logits_dtype, sampler)
    return d.gather(labels, ignore_index)


def entropy(logits: torch.Tensor, *, temperature=1.0, dtype: torch.dtype = torch.float64,
            softcap: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
            min_p: Optional[float] = None, keep: Optional[torch.Tensor] = None,
            logits_dtype: Optional[torch.dtype] = None, sampler: Optional[str] = None) -> torch.Tensor:
    """Entropy of the processed distribution (over the kept tokens); ``logits_dtype`` as in :func:`logprobs`."""
    if _unprocessed(softcap, top_k, top_p, min_p, keep):
        x = _prepare(logits, temperature, dtype)
        return _entropy(x, x.log_softmax(-1))
    return _Processed(logits, temperature, dtype, softcap, top_k, top_p, min_p, keep, logits_dtype, sampler).entropy()


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature=1.0,
    ignore_index: Optional[int] = None, dtype: torch.dtype = torch.float64,
    softcap: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
    min_p: Optional[float] = None, keep: Optional[torch.Tensor] = None, logits_dtype: Optional[torch.dtype] = None,
    sampler: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if _unprocessed(softcap, top_k, top_p, min_p, keep):
        x = _prepare(logits, temperature, dtype)
        logp = x.log_softmax(-1)
        return _gather(logp, labels, ignore_index), _entropy(x, logp)
    d = _Processed(logits, temperature, dtype, softcap, top_k, top_p, min_p, keep, logits_dtype, sampler)
    return d.gather(labels, ignore_index), d.entropy()


def processed_logprobs(logits: torch.Tensor, *, temperature=1.0, dtype: torch.dtype = torch.float64,
                       softcap: Optional[float] = None, top_k: Optional[int] = None,
                       top_p: Optional[float] = None, min_p: Optional[float] = None,
                       keep: Optional[torch.Tensor] = None, logits_dtype: Optional[torch.dtype] = None,
                       sampler: Optional[str] = None) -> torch.Tensor:
    """Every token's processed log-probability ``(..., V)`` (vLLM's ``processed_logprobs``):
    ``-inf`` outside the kept set; ``logits_dtype`` as in :func:`logprobs`."""
    return _Processed(logits, temperature, dtype, softcap, top_k, top_p, min_p, keep, logits_dtype, sampler).full()


def topk_logprobs(logits: torch.Tensor, k: int, *, temperature=1.0, dtype: torch.dtype = torch.float64,
                  softcap: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                  min_p: Optional[float] = None, keep: Optional[torch.Tensor] = None,
                  sampler: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)``: the ``k`` largest processed log-probabilities, largest first, ties by
    smaller id; ``-inf`` (at the smallest ids not yet listed) where fewer than ``k`` are kept."""
    full = processed_logprobs(logits, temperature=temperature, dtype=dtype, softcap=softcap, top_k=top_k,
                              top_p=top_p, min_p=min_p, keep=keep, sampler=sampler)
    ids = topk_ids(full, k)
    return full.gather(-1, ids), ids


def hidden_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype = torch.float64,
    logits_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``hidden @ weight.T + bias`` in ``dtype``; with ``logits_dtype`` each logit rounded to it
    (its value; the gradient passes straight through the rounding). The softcap, if any, comes
    after, in ``logits_dtype`` too (:func:`logprobs_from_hidden`)."""
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if logits_dtype is not None:
        logits = straight_through_round(logits, logits_dtype)
    return logits


def straight_through_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (and back to ``x``'s dtype), with the identity as gradient."""
    rounded = x.detach().to(dtype).to(x.dtype)
    return x + (rounded - x.detach())


def logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature=1.0, ignore_index: Optional[int] = None, return_entropy: bool = False,
    dtype: torch.dtype = torch.float64, softcap: Optional[float] = None, top_k: Optional[int] = None,
    top_p: Optional[float] = None, min_p: Optional[float] = None, keep: Optional[torch.Tensor] = None,
    logits_dtype: Optional[torch.dtype] = None, sampler: Optional[str] = None,
):
    """The logits ``hidden @ weight.T + bias`` (:func:`hidden_logits`), then :func:`logprobs` (and
    :func:`entropy`). With ``logits_dtype``, as an engine whose lm_head runs in it: each logit
    rounded to it, then the softcap in it (three ops, each rounded); the temperature, the truncation
    and the log-softmax as without it (the decision on the float32 processed logits, as the engine's)."""
    logits = hidden_logits(hidden, weight, bias, dtype, logits_dtype)
    kw = dict(temperature=temperature, dtype=dtype, softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p,
              keep=keep, logits_dtype=logits_dtype, sampler=sampler)
    if return_entropy:
        return logprobs_and_entropy(logits, labels, ignore_index=ignore_index, **kw)
    return logprobs(logits, labels, ignore_index=ignore_index, **kw)


# ------------------------------------------------------------------------------- token_stats
def token_stats(
    inputs: torch.Tensor, labels: Optional[torch.Tensor] = None, *, weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None, outputs=("logprobs", "entropy"), temperature=1.0,
    ignore_index: Optional[int] = None, dtype: torch.dtype = torch.float64, softcap: Optional[float] = None,
    top_k=None, top_p=None, min_p=None, keep: Optional[torch.Tensor] = None, sampler: Optional[str] = None,
) -> dict:
    """Every statistic of ``lr.token_stats`` (by field name) from one processed distribution (the logits
    ``inputs @ weight.T + bias`` where ``weight`` is given): the processed fields as
    :func:`logprobs_and_entropy` computes them (the same operations, so the same bits), the raw
    ones from the same ``z`` before truncation; only the fields in ``outputs``."""
    x = inputs if weight is None else hidden_logits(inputs, weight, bias, dtype)
    d = _Processed(x, temperature, dtype, softcap, top_k, top_p, min_p, keep, None, sampler)
    z, want, out = d.z, set(outputs), {}
    if "logprobs" in want:
        out["logprobs"] = d.gather(labels, ignore_index)
    if "entropy" in want:
        out["entropy"] = d.entropy()
    if want & {"raw_logprobs", "raw_entropy"}:
        raw = d.logp if d.kept is None else z.log_softmax(-1)
        if "raw_logprobs" in want:
            out["raw_logprobs"] = _gather(raw, labels, ignore_index)
        if "raw_entropy" in want:
            out["raw_entropy"] = _entropy(z, raw)
    with torch.no_grad():
        if "log_sum_p2" in want:
            out["log_sum_p2"] = torch.logsumexp(2 * d.full(), -1)
        if "mean_logit" in want:
            out["mean_logit"] = z.mean(-1)
        if "max_logit" in want:
            out["max_logit"] = z.amax(-1)
        if "is_argmax" in want:
            top = (z if d.kept is None else z.masked_fill(~d.kept, NEG_INF)).argmax(-1)
            index = labels.long()
            hit = (index == top.unsqueeze(-1)) if index.dim() == z.dim() else (index == top)
            out["is_argmax"] = hit if ignore_index is None else hit & (index != ignore_index)
    return out


# ------------------------------------------------------------------------------- distillation
def kl_side_logits(x: torch.Tensor, weight: Optional[torch.Tensor], dtype: torch.dtype = torch.float64,
                   temperature: float = 1.0) -> torch.Tensor:
    """One side of :func:`kl_divergence` as tempered logits ``(..., V)`` in ``dtype``: ``x`` itself
    (logits), or ``x @ weight.T`` (hidden states ``(..., H)`` and an lm_head ``(V, H)``)."""
    z = x.to(dtype) if weight is None else F.linear(x.to(dtype), weight.to(dtype))
    return z / temperature if temperature != 1.0 else z


def support_logprobs(z: torch.Tensor, support: Optional[torch.Tensor], tail: bool = True) -> torch.Tensor:
    """The log-probabilities of the buckets :func:`kl_divergence` compares, from tempered logits
    ``z`` ``(..., V)``: every token (``support`` None); the ``K`` ids of ``support`` ``(..., K)`` and,
    with ``tail``, one last bucket ``(..., K + 1)`` holding the mass outside them; without ``tail``
    the log-softmax over the ``K`` gathered logits.

    The tail's log mass is ``logsumexp(z over the complement) - logsumexp(z)``, never ``log(1 -
    sum p)``: where the support holds ``1 - 1e-9`` of the mass, float32 rounds ``sum p`` to 1 (or
    to ``1 - 6e-8``), and the subtraction returns ``-inf`` or a value off by orders of magnitude; a
    log-sum-exp over the complement is as accurate as any other log-probability. An empty
    complement (``K = V``, or only ``-inf`` outside) gives ``-inf`` (no NaN in the gradient)."""
    if support is None:
        return z.log_softmax(-1)
    index = support.long()
    if not tail:
        return z.gather(-1, index).log_softmax(-1)
    lse = torch.logsumexp(z, -1, keepdim=True)
    inside = z.gather(-1, index) - lse
    rest = z.scatter(-1, index, NEG_INF)  # the complement: the support's columns at -inf
    empty = torch.isneginf(rest).all(-1, keepdim=True)
    safe = torch.where(empty, torch.zeros_like(rest), rest)  # logsumexp of all -inf has a NaN gradient
    outside = torch.where(empty, torch.full_like(lse, NEG_INF), torch.logsumexp(safe, -1, keepdim=True)) - lse
    return torch.cat([inside, outside], -1)


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``p * (log p - log q)`` elementwise, 0 where ``p = 0`` (``0 log 0 = 0``, whatever ``q``);
    ``+inf`` where ``p > 0`` and ``q = 0``. Neither kind of entry passes a gradient on (so there is
    no NaN in the gradient, even under a zero upstream gradient: a masked or skipped position)."""
    zero = log_p.exp() == 0
    infinite = ~zero & torch.isneginf(log_q)
    lp = torch.where(zero, torch.zeros_like(log_p), log_p)
    lq = torch.where(zero | infinite, torch.zeros_like(log_q), log_q)
    terms = torch.where(zero, torch.zeros_like(lp), lp.exp() * (lp - lq))
    return torch.where(infinite, torch.full_like(terms, math.inf), terms)


def kl_distributions(
    student: torch.Tensor, teacher: torch.Tensor, *, dtype: torch.dtype = torch.float64,
    direction: str = "forward", temperature: float = 1.0, student_weight: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None, support: Optional[torch.Tensor] = None, tail: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(log p, log q)`` over the buckets (:func:`support_logprobs`) such that :func:`kl_divergence`
    is ``KL(p || q) = sum p (log p - log q)``: ``p`` the teacher and ``q`` the student for
    ``direction="forward"``, the other way round for ``"reverse"``. The teacher's side carries no
    gradient."""
    if direction not in ("forward", "reverse", "jsd"):
        raise ValueError(f'direction must be "forward", "reverse" or "jsd", got {direction!r}')
    log_s = support_logprobs(kl_side_logits(student, student_weight, dtype, temperature), support, tail)
    with torch.no_grad():
        t_weight = None if teacher_weight is None else teacher_weight.detach()
        log_t = support_logprobs(kl_side_logits(teacher.detach(), t_weight, dtype, temperature), support, tail)
    return (log_s, log_t) if direction == "reverse" else (log_t, log_s)


def kl_divergence(
    student: torch.Tensor, teacher: torch.Tensor, *, dtype: torch.dtype = torch.float64,
    direction: str = "forward", temperature: float = 1.0, mask: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None, teacher_weight: Optional[torch.Tensor] = None,
    support: Optional[torch.Tensor] = None, tail: bool = True, beta: Optional[float] = None,
) -> torch.Tensor:
    """``KL(teacher || student)`` (``direction="forward"``), ``KL(student || teacher)``
    (``"reverse"``) or the generalized Jensen-Shannon divergence (``"jsd"``: ``beta KL(T || M) + (1 -
    beta) KL(S || M)`` with ``M = beta T + (1 - beta) S``, ``log M`` a log-sum-exp of the two) per
    position ``(...)``, in ``dtype``, of the distributions of the logits divided
    by ``temperature`` (no ``T**2`` factor): each side logits ``(..., V)``, or hidden states with its
    ``*_weight`` ``(V, H)`` (logits ``x @ weight.T`` in ``dtype``). Over the full vocabulary, or the
    buckets of ``support`` (:func:`support_logprobs`). ``0 log 0 = 0``; a bucket with ``p > 0`` and
    ``q = 0`` gives ``+inf``. ``mask`` False: 0 and a zero gradient. Differentiable through the
    student (and ``student_weight``) only."""
    log_p, log_q = kl_distributions(student, teacher, dtype=dtype, direction=direction, temperature=temperature,
                                    student_weight=student_weight, teacher_weight=teacher_weight, support=support,
                                    tail=tail)
    if direction == "jsd":
        b = 0.5 if beta is None else float(beta)
        log_t, log_s = log_p, log_q
        # log m; where neither side has mass it is -inf, its inputs replaced (logsumexp's gradient
        # is NaN at -inf, -inf, and would reach the student through a zero upstream gradient)
        both = torch.isneginf(log_t) & torch.isneginf(log_s)
        zero = torch.zeros((), dtype=log_t.dtype, device=log_t.device)
        log_m = torch.logsumexp(torch.stack([torch.where(both, zero, log_t) + math.log(b),
                                             torch.where(both, zero, log_s) + math.log1p(-b)]), 0)
        log_m = torch.where(both, torch.full_like(log_m, -math.inf), log_m)
        kl = b * kl_terms(log_t, log_m).sum(-1) + (1 - b) * kl_terms(log_s, log_m).sum(-1)
    else:
        kl = kl_terms(log_p, log_q).sum(-1)
    if mask is not None:
        kl = torch.where(mask.to(kl.device), kl, torch.zeros_like(kl))
    return kl
