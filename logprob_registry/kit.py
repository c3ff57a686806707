"""The stable helpers a backend author may use: ``from logprob_registry import kit``.

The built-in backends import them from here exactly as a third-party plugin would, so a plugin
that uses them gets the same rules as the built-ins (docs/plugins.md has one line and an example
for each). Everything listed in ``__all__`` is public and kept stable; the modules they come from
are not. Importing this module is cheap: it needs torch only (never Triton, never a compiler).

- the Backend record's companions: :class:`Priority` (the named priority bands),
  :class:`Degradation` (what a ``degradations=`` report returns), :class:`Preparation`,
  :class:`Prepared` and :class:`PrepareError` (a ``prepare=`` callable's request, records, failure);
- the result dtype rule: :func:`result_dtype`, :data:`FLOAT_DTYPES`, :func:`dtype_name`;
- autograd: :func:`first_order_only` (a backward that refuses ``create_graph=True``),
  :func:`second_order_gradient` (a backward that supports it), :func:`backward_without_autocast`,
  :func:`autocast_enabled`, :func:`autocast_off`;
- inputs: :func:`overlapping` (logits whose gradient cannot be written in place), :class:`Sampler`
  (``kit.Sampler.of(keywords).used`` / ``.truncates`` for the sampler keywords a backend received);
- degenerate inputs (nothing to chunk or compile for): :func:`reference_outputs`, the op's
  ground truth in its result dtype;
- batch-invariant matmuls: :data:`MIN_GEMM_ROWS`, :func:`pad_rows`, :func:`add_matmul`;
- ignored rows: :func:`on_active_rows` (a per-row op run on the rows whose label is not ignored);
- a frozen lm_head: :func:`label_minus_mean` (the hidden gradient from an accumulated ``softmax @ W``);
- CUDA graphs: :func:`capturing` (no host reads of device values while a graph is captured);
- the tile protocol of the shard ops (``shard_stats``, ``shard_grad``, ...): :data:`TILE`,
  :func:`n_tiles`, :func:`tiled`, :func:`tile_stats_`, :func:`tree_sum`, :func:`tree_sum_`,
  :func:`label_columns`, :func:`next_power_of_two`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import torch

from .backend import Degradation, Preparation, Prepared, PrepareError, Priority
from .distributed.tiles import (
    NEG_INF,
    TILE,
    label_columns,
    n_tiles,
    next_power_of_two,
    tile_stats_,
    tiled,
    tree_sum,
    tree_sum_,
)
from .dtypes import FLOAT_DTYPES, dtype_name, result_dtype
from .opspec import logits_op
from .sampler import Sampler
from .validation import capturing

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
    None, while a CUDA graph is captured (:func:`capturing`)."""
    if ignore_index is None or capturing(labels):
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


# ------------------------------------------------------------------------------ autocast
def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` tensors in this thread."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (TypeError, RuntimeError):  # a torch before 2.4, or a device type it does not know
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return device_type == "cuda" and bool(torch.is_autocast_enabled())


def autocast_off(device_type: str) -> ContextManager[Any]:
    """A context with autocast disabled for ``device_type`` (nothing to do when it is off)."""
    if not autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def backward_without_autocast(backward: Callable) -> Callable:
    """Decorate an autograd Function's ``backward(ctx, *grads)`` to run with autocast disabled for
    the device of its incoming gradients."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        device: Optional[torch.Tensor] = next((g for g in grads if isinstance(g, torch.Tensor)), None)
        if device is None:
            return backward(ctx, *grads)
        with autocast_off(device.device.type):
            return backward(ctx, *grads)

    return run


# ------------------------------------------------------------------------------ reference
def reference_outputs(logits: torch.Tensor, labels: Optional[torch.Tensor], *, temperature: float,
                      ignore_index: Optional[int], want_logprobs: bool, want_entropy: bool, **sampler):
    """What the logits op returning ``want_logprobs``/``want_entropy`` returns (the op table's
    ground truth of that op, :meth:`~logprob_registry.opspec.OpSpec.ground_truth`), in the ops'
    result dtype: for backends' degenerate inputs (nothing to chunk or compile for)."""
    spec = logits_op(want_logprobs, want_entropy)
    given = dict(temperature=temperature, ignore_index=ignore_index, **sampler)
    out = spec.ground_truth(*(logits, labels)[: len(spec.inputs)], dtype=result_dtype(logits.dtype),
                            **spec.options_of(given))
    return out if len(out) > 1 else out[0]


__all__ = [
    "FLOAT_DTYPES",
    "MIN_GEMM_ROWS",
    "NEG_INF",
    "TILE",
    "Degradation",
    "PrepareError",
    "Prepared",
    "Preparation",
    "Priority",
    "Sampler",
    "add_matmul",
    "autocast_enabled",
    "autocast_off",
    "backward_without_autocast",
    "capturing",
    "dtype_name",
    "first_order_only",
    "label_columns",
    "label_minus_mean",
    "n_tiles",
    "next_power_of_two",
    "on_active_rows",
    "overlapping",
    "pad_rows",
    "reference_outputs",
    "result_dtype",
    "second_order_gradient",
    "tile_stats_",
    "tiled",
    "tree_sum",
    "tree_sum_",
]
