"""The public functions inside ``torch.compile``: one custom op, so that user code compiles with
``fullgraph=True`` and no graph break.

The registry (a lock, a context variable, plugins that may raise) is not something dynamo can
trace, and should not be: which backend runs is decided at run time. So while dynamo traces
(``validation.traced()``), a public function checks what it can see (types, shapes, dtypes,
devices; not the values of the labels, which would need a device sync) and calls the custom op
``logprob_registry::call`` instead of dispatching. That op is opaque to the compiler:

- its eager body, run at run time outside tracing, is the public function itself with the same
  arguments: configuration check, full validation (the label range included), backend selection
  and fallback, exactly as without ``torch.compile``;
- its fake implementation gives the outputs' shapes and dtypes from the op table (``Output``);
- its autograd formula calls ``logprob_registry::call_backward``, whose eager body recomputes the
  call with gradients through the same dispatch and differentiates it. A training step under
  ``torch.compile`` therefore runs the forward twice; ``inplace_backward=True`` is honoured out of
  place.

The options of a call cross the op boundary in typed lists (``custom_op`` schemas take no dict):
``spec`` names the op, the backend and each option with its kind (None, a bool, a dtype and a
string are spelled in it; ints, floats and tensors go in their own lists, in order), so an option
added to the op table needs nothing here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .opspec import OPS

_SEP, _KIND = ";", "="
_CONSTANTS = {"N": None, "T": True, "F": False}


# ------------------------------------------------------------------------------ encoding
def _encode(op: str, backend: Optional[str], inputs: Tuple[Any, ...], options: Dict[str, Any]):
    """``(spec, tensors, ints, floats)`` for one call (traceable by dynamo: no repr of a float)."""
    parts = [op, backend or ""]
    tensors: List[Optional[torch.Tensor]] = list(inputs)
    ints: List[int] = []
    floats: List[float] = []
    for name, value in options.items():
        if value is None:
            parts.append(name + _KIND + "N")
        elif isinstance(value, bool):
            parts.append(name + _KIND + ("T" if value else "F"))
        elif isinstance(value, torch.Tensor):
            parts.append(name + _KIND + "t")
            tensors.append(value)
        elif isinstance(value, int):
            parts.append(name + _KIND + "i")
            ints.append(value)
        elif isinstance(value, float):
            parts.append(name + _KIND + "f")
            floats.append(value)
        elif isinstance(value, torch.dtype):
            parts.append(name + _KIND + "d" + str(value).replace("torch.", ""))
        elif isinstance(value, str):
            parts.append(name + _KIND + "s" + value)
        elif isinstance(value, tuple) and all(isinstance(v, str) and "," not in v for v in value):
            parts.append(name + _KIND + "l" + ",".join(value))
        else:
            raise TypeError(f"{op}: option {name}={value!r} cannot be passed through torch.compile "
                            "(options are None, bool, int, float, str, a tuple of str, torch.dtype or tensors)")
    return _SEP.join(parts), tensors, ints, floats


def _decode(spec: str, tensors: Sequence[Optional[torch.Tensor]], ints: Sequence[int], floats: Sequence[float]):
    """``(op, backend, inputs, options)`` back from :func:`_encode`'s output."""
    op, backend, *items = spec.split(_SEP)
    count = len(OPS[op].inputs)
    inputs, rest = tuple(tensors[:count]), iter(tensors[count:])
    ints_, floats_ = iter(ints), iter(floats)
    options: Dict[str, Any] = {}
    for item in items:
        name, kind = item.split(_KIND, 1)
        code, text = kind[:1], kind[1:]
        if code in _CONSTANTS:
            options[name] = _CONSTANTS[code]
        elif code == "t":
            options[name] = next(rest)
        elif code == "i":
            options[name] = int(next(ints_))
        elif code == "f":
            options[name] = float(next(floats_))
        elif code == "d":
            options[name] = getattr(torch, text)
        elif code == "l":
            options[name] = tuple(text.split(",")) if text else ()
        else:
            options[name] = text
    return op, backend or None, inputs, options


def _outputs(op: str, result: Any, options: Dict[str, Any]) -> List[torch.Tensor]:
    return list(OPS[op].unpack(result, options))


# ------------------------------------------------------------------------------ the ops
def _public(op: str, backend: Optional[str], inputs: tuple, options: Dict[str, Any]) -> Any:
    return OPS[op].public()(*inputs, backend=backend, **options)


@torch.library.custom_op("logprob_registry::call", mutates_args=())
def _call(spec: str, tensors: List[Optional[torch.Tensor]], ints: Sequence[int],
          floats: Sequence[float]) -> List[torch.Tensor]:
    op, backend, inputs, options = _decode(spec, tensors, ints, floats)
    with torch.no_grad():  # the gradient comes from call_backward
        outs = _outputs(op, _public(op, backend, inputs, options), options)
        return [o.clone() if _aliases(o, tensors) else o for o in outs]


def _aliases(out: torch.Tensor, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether ``out`` shares memory with an input (a custom op's outputs must not)."""
    ptr = out.untyped_storage().data_ptr()
    return any(t is not None and t.untyped_storage().data_ptr() == ptr for t in tensors)


@_call.register_fake
def _call_fake(spec, tensors, ints, floats):
    """The outputs' shapes and dtypes, as the op table's ``Output`` records say."""
    op, _, inputs, options = _decode(spec, tensors, ints, floats)
    opspec = OPS[op]
    on = inputs[opspec.inputs.index(opspec.dtype_input)]
    labels = inputs[opspec.inputs.index("labels")] if "labels" in opspec.inputs else None
    names = opspec.output_names(options)
    return [on.new_empty(o.shape_for(on, labels, options), dtype=o.dtype_for(on.dtype))
            for o in opspec.results if o.name in names]


@torch.library.custom_op("logprob_registry::call_backward", mutates_args=())
def _call_backward(spec: str, needs: Sequence[bool], tensors: List[Optional[torch.Tensor]], ints: Sequence[int],
                   floats: Sequence[float], grads: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    with _autograd_on(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) if need else t for t, need in zip(tensors, needs)]
        op, backend, inputs, options = _decode(spec, leaves, ints, floats)
        if "inplace_backward" in options:
            options["inplace_backward"] = False  # the logits are the caller's: honoured out of place
        outs = _outputs(op, _public(op, backend, inputs, options), options)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs else (None,) * len(wanted)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(wanted, found)]


@_call_backward.register_fake
def _call_backward_fake(spec, needs, tensors, ints, floats, grads):
    return [torch.empty_like(t) for t, need in zip(tensors, needs) if need]


def _setup(ctx, inputs, output) -> None:
    spec, tensors, ints, floats = inputs
    ctx.spec, ctx.ints, ctx.floats = spec, list(ints), list(floats)
    ctx.present = [t is not None for t in tensors]
    ctx.save_for_backward(*(t for t in tensors if t is not None))


def _backward(ctx, grads):
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if present else None for present in ctx.present]
    needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[1], tensors)]
    found = iter(torch.ops.logprob_registry.call_backward(ctx.spec, needs, tensors, ctx.ints, ctx.floats, list(grads)))
    # (an empty list is taken for a list of tensors, whose gradient is a list too)
    return None, [next(found) if need else None for need in needs], [] if not ctx.ints else None, \
        [] if not ctx.floats else None


_call.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------------------ autograd inside an op
def _autograd_keys():
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    return keys


def _autograd_on():
    """A context in which autograd records again: a custom op's body runs below autograd (the
    dispatcher excludes its keys), and call_backward differentiates a call."""
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - _autograd_keys())


# ------------------------------------------------------------------------------ the entry point
def call(op: str, backend: Optional[str], inputs: Tuple[Any, ...], options: Dict[str, Any]) -> Any:
    """What a public function returns while dynamo traces it: the custom op's outputs, shaped as
    the public function returns them."""
    spec, tensors, ints, floats = _encode(op, backend, inputs, options)
    outs = torch.ops.logprob_registry.call(spec, tensors, ints, floats)
    opspec = OPS[op]
    return opspec.pack(dict(zip(opspec.output_names(options), outs)))


__all__ = ["call"]
