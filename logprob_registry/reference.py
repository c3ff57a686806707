"""Ground truth: the textbook formulas, computed in float64 (or a dtype the caller names).

This is what the conformance suite compares every backend against; it is not a backend. The
``naive`` backend runs the same formulas in float32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .dtypes import result_dtype


def _prepare(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    x = logits.to(dtype)
    return x / temperature if temperature != 1.0 else x


def _gather(logp: torch.Tensor, labels: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    index = labels.long()
    ignored = None
    if ignore_index is not None:
        ignored = index == ignore_index
        index = index.masked_fill(ignored, 0)
    out = logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return out if ignored is None else out.masked_fill(ignored, 0.0)


def _entropy(x: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    # -sum p log p, with 0 log 0 = 0 for masked (-inf) entries, and no NaN in the gradient there.
    safe = torch.where(torch.isneginf(x), torch.zeros_like(logp), logp)
    return -(logp.exp() * safe).sum(-1)


def logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
    ignore_index: Optional[int] = None, dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    return _gather(_prepare(logits, temperature, dtype).log_softmax(-1), labels, ignore_index)


def entropy(logits: torch.Tensor, *, temperature: float = 1.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    x = _prepare(logits, temperature, dtype)
    return _entropy(x, x.log_softmax(-1))


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
    ignore_index: Optional[int] = None, dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _prepare(logits, temperature, dtype)
    logp = x.log_softmax(-1)
    return _gather(logp, labels, ignore_index), _entropy(x, logp)


def hidden_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    return F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0, ignore_index: Optional[int] = None, return_entropy: bool = False,
    dtype: torch.dtype = torch.float64,
):
    logits = hidden_logits(hidden, weight, bias, dtype)
    if return_entropy:
        return logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=dtype)
    return logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=dtype)


def outputs(logits: torch.Tensor, labels: Optional[torch.Tensor], *, temperature: float,
            ignore_index: Optional[int], want_logprobs: bool, want_entropy: bool):
    """What the op wanting ``want_logprobs``/``want_entropy`` returns, by these formulas in the
    ops' result dtype: for backends' degenerate inputs (nothing to chunk or compile for)."""
    dtype = result_dtype(logits.dtype)
    if want_logprobs and want_entropy:
        return logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=dtype)
    if want_logprobs:
        return logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=dtype)
    return entropy(logits, temperature=temperature, dtype=dtype)
