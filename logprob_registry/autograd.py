"""Helpers for a backend's autograd Functions: double backward, and gradients written in place.

A backward that autograd runs with ``create_graph=True`` (grad mode on) must either return a
gradient that can be differentiated again (:func:`second_order_gradient`: recomputed by
differentiable torch ops) or refuse (:func:`first_order_only`), never drop the second-order term
silently (docs/architecture.md, "Double backward"). :func:`overlapping` says when logits cannot
take their gradient in place (``inplace_backward=True`` honoured out of place).

Backends reach these through :mod:`logprob_registry.kit`; the core (``amp``, ``distributed``)
imports them from here.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple

import torch


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
