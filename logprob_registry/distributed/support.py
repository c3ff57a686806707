"""What the vocabulary-parallel path supports: one place to say which options a ``process_group=``
call may use, checked before any collective.

An option of an op (:mod:`logprob_registry.opspec`) that is not listed in :data:`SUPPORTED` may
still be passed at its default value; any other value raises a clear error on every rank (the core
carries it through the header). An option added to the op table later (such as the sampler's
``softcap``, ``top_k``, ``top_p``, ``min_p``, ``keep``) is therefore refused with a sentence until
the distributed path implements it and lists it here.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from ..opspec import OPS

#: Public op -> the options a process_group= call supports with any value.
SUPPORTED: Mapping[str, frozenset] = {
    "logprobs": frozenset({"temperature", "ignore_index", "inplace_backward"}),
    "entropy": frozenset({"temperature"}),
    "logprobs_and_entropy": frozenset({"temperature", "ignore_index", "inplace_backward"}),
    "logprobs_from_hidden": frozenset({"bias", "temperature", "ignore_index", "return_entropy"}),
}


def _neutral(name: str, value: Any) -> Any:
    """``value`` as the call without a group reads it: the sampler's "keep everything" values (top_k 0
    or -1, top_p 1, min_p 0) and logits_dtype float32 become None (the default); a bad value raises
    the same error as without a group."""
    from .. import validation as v

    normalise = {"top_k": lambda k: v.check_top_k(k, sys.maxsize), "top_p": v.check_top_p, "min_p": v.check_min_p,
                 "logits_dtype": v.check_logits_dtype, "softcap": v.check_softcap}.get(name)
    return value if normalise is None else normalise(value)


def check_supported(op: str, options: Mapping[str, Any]) -> None:
    """Raise ``NotImplementedError`` naming an option of ``op`` that a process_group= call uses with a
    value the distributed path does not support (anything but a value that means its default)."""
    spec = OPS[op]
    allowed = SUPPORTED.get(op, frozenset())
    for name, value in options.items():
        option = spec.option_index.get(name)
        if name in allowed or option is None or not option.used(_neutral(name, value)):
            continue
        raise NotImplementedError(
            f"{spec.function}(..., process_group=...) does not support {name}={value!r} yet; the distributed path "
            f"supports {', '.join(sorted(allowed))}. Gather the logits to one rank and call without process_group, "
            "or leave the option at its default")


def check_not_candidates(labels: Any, against: Any) -> None:
    """Raise ``NotImplementedError`` for candidate labels ``(..., K)`` (one more dim than the leading
    dims of ``against``, the logits or hidden states): not built for process_group= calls yet."""
    dim = getattr(labels, "dim", None)
    if callable(dim) and getattr(against, "dim", None) is not None and labels.dim() == against.dim() >= 1:
        raise NotImplementedError(
            f"candidate labels {tuple(labels.shape)} (..., K) are not supported with process_group= yet; pass one "
            "label per position (labels[..., k] for each k), or gather the logits and call without process_group")


def check_context() -> None:
    """Raise ``NotImplementedError`` where a process_group= call cannot run: inside a ``torch.func``
    transform (``vmap``/``grad`` would batch or trace the collectives)."""
    from ..validation import inside_functorch_transform

    if inside_functorch_transform():
        raise NotImplementedError("process_group= calls are not supported inside torch.func transforms (vmap, grad, "
                                  "...); call the op outside the transform")


def unsupported_reason(op: str, options: Mapping[str, Any]) -> str:
    """:func:`check_supported` as a sentence ("" when the call is supported), for ``explain``-like tools."""
    try:
        check_supported(op, options)
    except NotImplementedError as exc:
        return str(exc)
    return ""
