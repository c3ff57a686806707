"""Row helpers of the built-in backends: a row's result must not depend on the rest of its batch.

- batch-invariant matmuls: :data:`MIN_GEMM_ROWS`, :func:`pad_rows`, :func:`add_matmul` (the CPU
  matmul takes another path for a handful of rows, so fewer rows are padded);
- ignored rows: :func:`on_active_rows` (a per-row op run on the rows whose label is not ignored);
- a frozen lm_head: :func:`label_minus_mean` (the hidden gradient from an accumulated
  ``softmax @ W``, a block of rows at a time).

Backends reach these through :mod:`logprob_registry.kit`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import validation

#: Fewer token rows than this are padded with zero rows before a matmul: the CPU matmul takes
#: another path for a handful of rows, which would make a row's result depend on its batch.
MIN_GEMM_ROWS = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_GEMM_ROWS) -> torch.Tensor:
    """``x`` (2-D) with zero rows appended up to ``rows`` rows (``x`` itself if it has them)."""
    short = rows - x.shape[0]
    if short <= 0:
        return x
    return torch.cat([x, x.new_zeros(short, x.shape[1])])


def add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, through the same matmul path whatever the number of rows (fewer
    than MIN_GEMM_ROWS rows are padded), so that a row's result does not depend on its batch."""
    if a.shape[0] >= MIN_GEMM_ROWS:
        acc.addmm_(a, b)
    else:
        tmp = pad_rows(acc)
        tmp.addmm_(pad_rows(a), b)
        acc.copy_(tmp[: acc.shape[0]])


def on_active_rows(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                   labels: torch.Tensor, ignore_index: Optional[int]) -> Optional[torch.Tensor]:
    """A per-row op run on the active rows only: ``run(hidden[a], labels[a])`` (an ``(A,)`` result)
    for the rows ``a`` whose label is not ``ignore_index``, scattered into ``(N,)`` zeros (an ignored
    row's log-probability); None when no row is ignored (call the op as usual).

    In RL steps most rows are often prompt tokens with ignored labels: here they cost neither
    matmul nor softmax, forward or backward, and their gradient is zero (autograd of the row
    selection). A row's result is bitwise what it is among all rows wherever the backend's results
    are batch invariant. Costs one device synchronisation (the number of active rows); none, and
    None, while a CUDA graph is captured
    (:func:`~logprob_registry.validation.capturing`)."""
    if ignore_index is None or validation.capturing(labels):
        return None
    active = (labels != ignore_index).nonzero().squeeze(1)
    if active.numel() == labels.shape[0]:
        return None
    out = run(hidden.index_select(0, active), labels.index_select(0, active))
    return out.new_zeros(labels.shape[0]).index_copy(0, active, out)


def label_minus_mean(mean: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, inv_t: float,
                     rows: int = 1024) -> torch.Tensor:
    """``(weight[labels] - mean) * inv_t``, written over ``mean`` (``softmax @ weight``, ``(N, H)``,
    in the compute dtype) a block of ``rows`` rows at a time, so that no second ``(N, H)`` buffer
    exists: the hidden gradient of ``logprobs_from_hidden`` with a frozen weight, once the forward
    has accumulated ``softmax @ weight`` (online rescaling)."""
    mean.neg_()
    for r0 in range(0, mean.shape[0], rows):
        mean[r0:r0 + rows].add_(weight.index_select(0, labels[r0:r0 + rows]).to(mean.dtype))
    return mean if inv_t == 1.0 else mean.mul_(inv_t)


def first_max(picked: torch.Tensor, m: torch.Tensor, before: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Whether the label is ``torch.argmax`` of its row (the first maximum; NaN counts as the
    largest, as there): its value ``picked`` is the row maximum ``m`` and every value before it
    (``before``: their maximum, anything for ``label == 0``) is smaller. Exact: no rounding is
    involved. An argmax reduction with indices is 30 times slower than a max on the CPU; this needs
    only the max of the columns before the label (a running max as the vocabulary goes by)."""
    nan = torch.isnan(picked)
    at_max = (picked == m) | (nan & torch.isnan(m))
    first = (label == 0) | (picked > before) | (nan & ~torch.isnan(before))
    return at_max & first
