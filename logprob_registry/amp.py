"""Autocast never reaches a backend: results and gradients stay float32-exact under ``torch.autocast``.

``torch.autocast`` runs matmuls in bf16/fp16, which would turn the fused op's float32 products into
bf16 ones (an error of 1e-2 nats, which the contract forbids) and make a backward that meets its
forward's float32 statistics crash on mixed dtypes. A backward runs in whatever autocast context
``.backward()`` is called from, so disabling autocast around the forward is not enough. Hence:

- a call made under autocast (``ops.dispatch``) runs the backend with autocast disabled for the
  inputs' device type; when it needs gradients, through :func:`call_isolated`, whose backward also
  runs the backend's own backward graph with autocast disabled, whatever the backend (a pure torch
  one such as ``naive`` included);
- every built-in autograd Function runs its backward with autocast disabled
  (:func:`backward_without_autocast`), for a backward under autocast of a forward made outside it.

Inputs are taken as they come: a bf16 tensor produced under autocast is bf16 logits.

Backends reach :func:`enabled`, :func:`off` and :func:`backward_without_autocast` through
:mod:`logprob_registry.kit` (``kit.autocast_enabled``, ``kit.autocast_off``,
``kit.backward_without_autocast``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Optional

import torch

from .autograd import second_order_gradient


def enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` tensors in this thread."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (TypeError, RuntimeError):  # a torch before 2.4, or a device type it does not know
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return device_type == "cuda" and bool(torch.is_autocast_enabled())


def off(device_type: str) -> ContextManager[Any]:
    """A context with autocast disabled for ``device_type`` (nothing to do when it is off)."""
    if not enabled(device_type):
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
        with off(device.device.type):
            return backward(ctx, *grads)

    return run


class _Isolated(torch.autograd.Function):
    """``run(*tensors)`` with autocast off, its own autograd graph kept inside and run by backward
    with autocast off too."""

    @staticmethod
    def forward(ctx, run, device_type, shape, *tensors):
        with torch.enable_grad(), off(device_type):
            leaves = [t.detach().requires_grad_(t.requires_grad) if _differentiable(t) else t for t in tensors]
            result = run(*leaves)
        outs = result if isinstance(result, tuple) else (result,)
        shape["tuple"] = type(result) if isinstance(result, tuple) else None  # a NamedTuple (TokenStats) kept
        ctx.run, ctx.device_type, ctx.leaves, ctx.outs = run, device_type, leaves, outs
        ctx.save_for_backward(*tensors)
        # copies (one number per token): the caller may modify an output in place, which must not
        # reach the graph kept inside; None stays None (a statistic not asked for)
        return tuple(None if o is None else o.detach().clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        with off(ctx.device_type):
            if torch.is_grad_enabled():  # create_graph=True: differentiate the call on the saved inputs
                wanted = tuple(t if need else None for t, need in zip(tensors, ctx.needs_input_grad[3:]))
                return (None, None, None) + second_order_gradient(lambda: _tuple(ctx.run(*tensors)), wanted, grads)
            pairs = [(o, g) for o, g in zip(ctx.outs, grads) if g is not None and o is not None and o.requires_grad]
            wanted = [leaf for leaf, need in zip(ctx.leaves, ctx.needs_input_grad[3:]) if need]
            found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                             retain_graph=True, allow_unused=True) if pairs and wanted else ())
            return (None, None, None) + tuple(next(found, None) if need else None for need in ctx.needs_input_grad[3:])


def _differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _tuple(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def call_isolated(call: Callable[[tuple, dict], Any], inputs: tuple, options: dict, device_type: str) -> Any:
    """``call(inputs, options)`` with autocast disabled for ``device_type`` tensors, forward and
    backward: the backend's autograd graph is built inside and run by the backward of an autograd
    Function that disables autocast first (``retain_graph``: the caller may run backward twice)."""
    names = [k for k, value in options.items() if isinstance(value, torch.Tensor)]

    def run(*tensors):
        given = dict(options)
        given.update(zip(names, tensors[len(inputs):]))
        return call(tuple(tensors[:len(inputs)]), given)

    shape: dict = {}
    outs = _Isolated.apply(run, device_type, shape, *inputs, *(options[k] for k in names))
    kind = shape["tuple"]
    return outs[0] if kind is None else kind._make(outs) if hasattr(kind, "_make") else outs


__all__ = ["backward_without_autocast", "call_isolated", "enabled", "off"]
