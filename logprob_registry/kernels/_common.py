"""Helpers the built-in backends share (any plugin may use them too)."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple

import torch

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


def overlapping(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` share memory (an expanded, stride-0 tensor, say): such logits
    cannot take their gradient in place, so ``inplace_backward=True`` is honoured out of place."""
    dims = sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def second_order_gradient(outputs: Callable[[], Sequence[Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor],
                          grads: Sequence[Optional[torch.Tensor]]) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients of ``sum(output * grad)`` with respect to ``inputs``, recomputed by
    differentiable torch ops: what a custom backward returns when autograd runs it with
    ``create_graph=True`` (grad mode on), so that the gradient can be differentiated again.

    ``outputs()`` recomputes the op's outputs from ``inputs`` (as the saved tensors, connected to
    the caller's graph) by the reference formulas in the result dtype: it materialises what the
    op avoids (the float32 logits), which a double backward, rare and small, can afford."""
    with torch.enable_grad():
        pairs = [(o, g) for o, g in zip(outputs(), grads) if o is not None and g is not None]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         create_graph=True, allow_unused=True) if pairs and wanted else ())
    return tuple(next(found) if t is not None and t.requires_grad else None for t in inputs)


def first_order_only(what: str, remedy: str = "Use backend='naive' for second-order gradients.",
                     ) -> Callable[[Callable], Callable]:
    """Decorate an autograd Function's backward (above ``once_differentiable``, which runs it under
    ``no_grad`` and so cannot tell) to raise under ``create_graph=True``, where the gradient would
    otherwise silently lack its second-order term: ``what`` names the path and ``remedy`` says what
    to do instead, for the message."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{what} does not support double backward (create_graph=True): its gradient "
                                   f"is not differentiable again. {remedy}")
            return backward(ctx, *grads)

        return run

    return decorate
