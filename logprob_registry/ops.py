"""The public functions: validate the inputs, pick the backend, run it, return its result."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import validation as v
from .backend import DEVICE_TYPES, Backend
from .eligibility import Key
from .environment import get_environment
from .registry import get_registry
from .report import Explanation


def _logits_and_labels(logits, labels, temperature, ignore_index):
    logits = v.check_logits(logits)
    labels = v.check_labels(labels, logits, "logits")
    temperature = v.check_temperature(temperature)
    ignore_index = v.check_ignore_index(ignore_index)
    v.check_label_range(labels, logits.shape[-1], ignore_index)
    return logits, labels, temperature, ignore_index


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[..., labels]``, accumulated in at least fp32.

    ``logits`` has shape ``(..., V)`` and any strides; ``labels`` has shape ``(...)``. The result is
    float32 (float64 for float64 logits). Positions whose label equals ``ignore_index`` give 0 and
    a zero gradient. With ``inplace_backward=True`` the backward pass may overwrite the logits'
    storage with their gradient (use it only when the logits are not needed afterwards).
    ``backend`` forces a backend by name.
    """
    logits, labels, temperature, ignore_index = _logits_and_labels(logits, labels, temperature, ignore_index)
    inplace_backward = v.check_flag(inplace_backward, "inplace_backward")
    key = Key("logprobs", logits.device.type, logits.dtype, v.needs_grad(logits))
    return get_registry().call(
        key, backend, (logits, labels),
        dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward),
    )


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, backend: Optional[str] = None
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension, in at least fp32."""
    logits = v.check_logits(logits)
    temperature = v.check_temperature(temperature)
    key = Key("entropy", logits.device.type, logits.dtype, v.needs_grad(logits))
    return get_registry().call(key, backend, (logits,), dict(temperature=temperature))


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` in one call; see :func:`logprobs_from_logits`.

    The entropy of an ignored position is computed as usual (it does not depend on the label).
    """
    logits, labels, temperature, ignore_index = _logits_and_labels(logits, labels, temperature, ignore_index)
    inplace_backward = v.check_flag(inplace_backward, "inplace_backward")
    key = Key("logprobs_and_entropy", logits.device.type, logits.dtype, v.needs_grad(logits))
    return get_registry().call(
        key, backend, (logits, labels),
        dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward),
    )


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    return_entropy: bool = False,
    backend: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities of ``labels`` under ``hidden @ weight.T + bias``, without requiring the
    backend to materialise the ``(..., V)`` logits.

    ``hidden`` is ``(..., H)``, ``weight`` is ``(V, H)`` (the lm_head), ``bias`` is ``(V,)``. Hidden,
    weight and bias must share one dtype. Returns ``logprobs`` or ``(logprobs, entropy)``.
    """
    hidden = v.check_float(hidden, "hidden")
    weight = v.check_float(weight, "weight")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not fit hidden shape {tuple(hidden.shape)}: "
            "expected hidden (..., H) and weight (V, H)"
        )
    tensors = {"weight": weight} if bias is None else {"weight": weight, "bias": v.check_float(bias, "bias")}
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight shape {tuple(weight.shape)}: expected ({weight.shape[0]},)")
    for name, t in tensors.items():
        v.check_same_device(t, hidden.device, name, "hidden")
        if t.dtype != hidden.dtype:
            raise TypeError(
                f"hidden is {hidden.dtype} but {name} is {t.dtype}; give them one dtype, "
                f"for example {name}.to(hidden.dtype)"
            )
    labels = v.check_labels(labels, hidden, "hidden")
    temperature = v.check_temperature(temperature)
    ignore_index = v.check_ignore_index(ignore_index)
    return_entropy = v.check_flag(return_entropy, "return_entropy")
    v.check_label_range(labels, weight.shape[0], ignore_index)
    key = Key("logprobs_from_hidden", hidden.device.type, hidden.dtype, v.needs_grad(hidden, weight, bias))
    return get_registry().call(
        key, backend, (hidden, weight, labels),
        dict(bias=bias, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy),
    )


def _key(op: str, device, dtype, requires_grad: bool) -> Key:
    if op not in ("logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden"):
        raise ValueError(
            f"unknown op {op!r}; ops: logprobs, entropy, logprobs_and_entropy, logprobs_from_hidden"
        )
    if device is None:
        device_type = get_environment().main_device
    elif isinstance(device, torch.device):
        device_type = device.type
    elif isinstance(device, str) and device.split(":")[0] in DEVICE_TYPES:
        # Parsed here: torch.device("npu") fails unless torch_npu is imported, and explain() must
        # answer for devices this machine lacks.
        device_type = device.split(":")[0]
    else:
        device_type = torch.device(device).type
    return Key(op, device_type, dtype or torch.float32, bool(requires_grad))


def select(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
) -> Backend:
    """The backend a call would use for ``op`` on tensors of this device (default: the machine's
    main device) and dtype (default float32), honouring any explicit choice in force."""
    return get_registry().select(_key(op, device, dtype, requires_grad))


def explain(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
) -> Explanation:
    """Every backend's verdict for ``op`` on such tensors, with reasons; ``str()`` is a table."""
    return get_registry().explain(_key(op, device, dtype, requires_grad))


def backends() -> list:
    """Every registered backend, eligible or not, highest priority first."""
    return get_registry().backends()
