"""Input checks that run before any dispatch: a user's bad input never reaches a kernel, never
triggers a fallback, and always gets an error that says what is wrong and how to fix it."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import torch

LABEL_DTYPES = (torch.int32, torch.int64)
INT64 = torch.iinfo(torch.int64)


def inside_functorch_transform() -> bool:
    """Whether the call runs inside a ``torch.func`` transform (grad, vmap, jacrev, ...)."""
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:  # a torch without functorch's C API
        return False


def _never() -> bool:  # pragma: no cover - a torch without torch.compiler.is_dynamo_compiling
    return False


#: ``traced()``: whether dynamo (``torch.compile``) is tracing this call. ``torch.compiler.is_compiling()``
#: will not do: it is one flag for the whole process, so it is also True in every other thread
#: while one thread compiles (the ``compiled`` backend's kernels, say), where the call runs
#: eagerly. ``is_dynamo_compiling()`` is False when it runs and True where dynamo traces it; it is
#: ``traced`` itself, not wrapped (every call asks it, twice: issue #36).
traced = getattr(torch.compiler, "is_dynamo_compiling", None) or _never


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream while ``t`` lives on CUDA: then
    nothing may read device values on the host (``.item()``, ``nonzero()``, ``.cpu()``, a shape that
    depends on values), since the capture would fail; checks are skipped and kernels take their
    fixed-shape path. Exported as ``kit.capturing``."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def values_visible(t: torch.Tensor) -> bool:
    """Whether checks may read ``t``'s values on the host: not while torch.compile traces (the
    check would break the graph; the call's eager body checks them at run time, see
    :mod:`logprob_registry.traced`), not while a CUDA graph is captured (:func:`capturing`), not
    for a vmap-batched tensor (data-dependent control flow)."""
    if traced() or capturing(t):
        return False
    try:
        return not torch._C._functorch.is_batchedtensor(t)
    except AttributeError:
        return True


def check_float(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{what} is on the meta device, which holds no values to compute with; "
                         "materialise it on a real device first (for shapes alone, the result has the "
                         "labels' shape)")
    if not t.is_floating_point():
        raise TypeError(
            f"{what} must be a floating-point tensor (float16, bfloat16, float32 or float64), got {t.dtype}; "
            f"convert with {what}.float()"
        )
    return t


def check_logits(logits: object) -> torch.Tensor:
    logits = check_float(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension: shape (..., V), got a 0-d tensor")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits of shape {tuple(logits.shape)} have an empty vocabulary (V = 0): no token "
                         "has a probability; give logits of at least one column")
    return logits


def check_labels(labels: object, of: torch.Tensor, against: str, candidates: bool = False) -> torch.Tensor:
    """``labels`` fit ``of`` (the logits or hidden states): shape ``of.shape[:-1]`` (or, where
    ``candidates`` are allowed, ``of.shape[:-1] + (K,)``), same device."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels must be int64 or int32, got {labels.dtype}; convert with labels.long()")
    lead = of.shape[:-1]
    if labels.shape != lead and not (candidates and labels.dim() == len(lead) + 1 and labels.shape[:-1] == lead):
        also = f" or {tuple(lead) + ('K',)} for K candidates" if candidates else ""
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match {against} shape {tuple(of.shape)}: "
            f"expected labels of shape {tuple(lead)}{also}"
        )
    check_same_device(labels, of.device, "labels", against)
    return labels


def has_candidates(labels: torch.Tensor, of: torch.Tensor) -> bool:
    return labels.dim() == of.dim()


def check_same_device(t: torch.Tensor, device: torch.device, what: str, against: str) -> None:
    if t.device != device:
        raise ValueError(
            f"{against} are on {device} but {what} on {t.device}; move them with {what}.to({against}.device)"
        )


def check_no_grad(value: object, name: str) -> None:
    """A tensor argument whose gradient the op does not compute must not ask for one (it would be
    silently dropped)."""
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} is a tensor that requires grad, but this library computes no gradient "
                         f"with respect to {name} (it would be silently dropped): pass {name}.detach()")


def check_temperature(temperature: object) -> float:
    check_no_grad(temperature, "temperature")
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1:
        temperature = float(temperature)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a positive number, got {type(temperature).__name__}")
    value = float(temperature)
    if not 0 < value < math.inf:  # NaN too (comparisons, not math.isfinite: traceable by dynamo)
        raise ValueError(f"temperature must be finite and > 0, got {value}")
    return value


def check_ignore_index(ignore_index: object) -> Optional[int]:
    if ignore_index is None:
        return None
    if isinstance(ignore_index, bool):
        raise TypeError("ignore_index must be an int or None, got a bool")
    try:
        value = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}") from None
    if not INT64.min <= value <= INT64.max:
        raise ValueError(f"ignore_index={value} does not fit in int64, so no label can equal it; "
                         "use the value your labels hold at padded positions, such as -100")
    return value


def check_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def check_label_range(labels: torch.Tensor, vocab: int, ignore_index: Optional[int], what: str = "") -> None:
    """Every label is in [0, vocab) or equal to ignore_index. One reduction over the labels (and a
    device sync); skipped where the values cannot be read (see :func:`values_visible`). ``what``
    names ids that are not labels (``"support"``): the error then names it, without the
    ``ignore_index`` hint."""
    if labels.numel() == 0 or not values_visible(labels):
        return
    flat = labels.reshape(-1)
    if _in_range(flat, vocab):
        return
    if ignore_index is not None and _in_range(flat.masked_fill(flat == ignore_index, 0), vocab):
        return  # the out-of-range values were all the ignored one
    bad = (flat < 0) | (flat >= vocab)
    if ignore_index is not None:
        bad &= flat != ignore_index
    first = int(bad.nonzero()[0, 0])
    value = int(flat[first])
    position = tuple(int(i) for i in unravel(first, labels.shape))
    allowed = f"0..{vocab - 1}" if vocab else "none (the vocabulary is empty)"
    if what:
        raise ValueError(f"{what} id {value} at position {position} is out of range for a vocabulary of {vocab} "
                         f"(valid ids: {allowed})")
    hint = f" or ignore_index={ignore_index}" if ignore_index is not None else "; pass ignore_index= for padding"
    raise ValueError(
        f"label {value} at position {position} is out of range for a vocabulary of {vocab} "
        f"(valid labels: {allowed}{hint})"
    )


#: Up to this many labels on the CPU, their range is read with Python's min and max of ``tolist()``
#: (a fraction of a microsecond) rather than a reduction kernel and two reads of its results.
SMALL_LABELS = 64


def _in_range(flat: torch.Tensor, vocab: int) -> bool:
    if flat.device.type == "cpu" and flat.numel() <= SMALL_LABELS:
        values = flat.tolist()
        return min(values) >= 0 and max(values) < vocab
    low, high = torch.aminmax(flat)
    return int(low) >= 0 and int(high) < vocab


def unravel(index: int, shape: torch.Size) -> tuple:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def check_hidden(hidden: object, weight: object, bias: object):
    """``hidden (..., H)``, ``weight (V, H)``, ``bias (V,)`` or None: float tensors of one dtype on
    one device."""
    hidden = check_float(hidden, "hidden")
    weight = check_float(weight, "weight")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not fit hidden shape {tuple(hidden.shape)}: "
            "expected hidden (..., H) and weight (V, H)"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight of shape {tuple(weight.shape)} has an empty vocabulary (V = 0): no token "
                         "has a probability")
    if weight.shape[1] == 0:
        raise ValueError(f"hidden size is 0 (hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}): "
                         "every logit would be the bias alone; call logprobs_from_logits on the logits instead")
    tensors = {"weight": weight}
    if bias is not None:
        bias = check_float(bias, "bias")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match weight shape "
                             f"{tuple(weight.shape)}: expected ({weight.shape[0]},)")
        tensors["bias"] = bias
    for name, t in tensors.items():
        check_same_device(t, hidden.device, name, "hidden")
        if t.dtype != hidden.dtype:
            raise TypeError(
                f"hidden is {hidden.dtype} but {name} is {t.dtype}; give them one dtype, "
                f"for example {name}.to(hidden.dtype)"
            )
    return hidden, weight, bias


def check_side(name: str, x: object, weight: object):
    """One side of ``kl_divergence``: ``(x, weight, V)`` for logits ``(..., V)`` (``weight`` None) or
    hidden states ``(..., H)`` with a weight ``(V, H)`` of their dtype and device."""
    x = check_float(x, name)
    if weight is None:
        if x.dim() < 1 or x.shape[-1] == 0:
            raise ValueError(f"{name} of shape {tuple(x.shape)} has no vocabulary: give logits (..., V) with V >= 1, "
                             f"or hidden states (..., H) with {name}_weight (V, H)")
        return x, None, x.shape[-1]
    weight = check_float(weight, f"{name}_weight")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or 0 in weight.shape:
        raise ValueError(f"{name}_weight shape {tuple(weight.shape)} does not fit {name} shape {tuple(x.shape)}: "
                         f"expected {name} hidden states (..., H) and {name}_weight (V, H), both non-empty")
    check_same_device(weight, x.device, f"{name}_weight", name)
    if weight.dtype != x.dtype:
        raise TypeError(f"{name} is {x.dtype} but {name}_weight is {weight.dtype}; give them one dtype, for example "
                        f"{name}_weight.to({name}.dtype)")
    return x, weight, weight.shape[0]


def check_mask(mask: object, lead: tuple, device: torch.device) -> Optional[torch.Tensor]:
    """``mask``: None or a bool tensor of the positions' shape ``lead``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor of the positions' shape {lead} or None, got "
                        f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if tuple(mask.shape) != tuple(lead):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the positions {tuple(lead)} (the logits' "
                         "leading dims)")
    check_same_device(mask, device, "mask", "student")
    return mask


def check_support(support: object, lead: tuple, vocab: Optional[int], device: torch.device) -> Optional[torch.Tensor]:
    """``support``: None or int ids ``lead + (K,)``, K >= 1, distinct within a position, in ``[0,
    vocab)`` (``vocab`` None: a shard's, checked once the whole vocabulary is known)."""
    if support is None:
        return None
    if not isinstance(support, torch.Tensor) or support.dtype not in LABEL_DTYPES:
        raise TypeError(f"support must be int64 or int32 ids of shape {tuple(lead) + ('K',)} or None, got "
                        f"{support.dtype if isinstance(support, torch.Tensor) else type(support).__name__}")
    if support.dim() != len(lead) + 1 or tuple(support.shape[:-1]) != tuple(lead) or support.shape[-1] == 0:
        raise ValueError(f"support shape {tuple(support.shape)} does not fit the positions {tuple(lead)}: expected "
                         f"{tuple(lead) + ('K',)} with K >= 1")
    check_same_device(support, device, "support", "student")
    if support.numel() and values_visible(support):
        if vocab is not None:
            check_label_range(support, vocab, None, "support")
        ordered = support.reshape(-1, support.shape[-1]).sort(-1).values
        same = (ordered[:, 1:] == ordered[:, :-1]).any(-1)
        if bool(same.any()):
            row = int(same.nonzero()[0, 0])
            raise ValueError(f"support ids repeat within position {tuple(unravel(row, torch.Size(lead)))}: each "
                             "position's K ids must be distinct")
    return support


def check_logit_scale(scale: object) -> Optional[float]:
    """``logit_scale``: None (or 1.0) for none, else a finite number > 0."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        check_no_grad(scale, "logit_scale")
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"logit_scale must be a positive number or None, got {type(scale).__name__}")
    value = float(scale)
    if not 0 < value < math.inf:
        raise ValueError(f"logit_scale must be finite and > 0 (the constant a scaled head multiplies its logits by; "
                         f"pass 1 / scale for a head that divides), got {value}")
    return None if value == 1.0 else value


def check_direction(direction: object) -> str:
    if direction not in ("forward", "reverse", "jsd"):
        raise ValueError(f'direction must be "forward" (KL(teacher || student)), "reverse" (KL(student || '
                         f'teacher)) or "jsd" (the generalized Jensen-Shannon divergence, with beta), got '
                         f'{direction!r}')
    return direction  # type: ignore[return-value]


def check_beta(beta: object, direction: str) -> Optional[float]:
    """``beta`` of ``direction="jsd"``: a number in (0, 1); None for the other directions (ignored)."""
    if direction != "jsd":
        return None
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise TypeError(f"beta must be a number in (0, 1) (the teacher's weight in the mixture), got "
                        f"{type(beta).__name__}")
    value = float(beta)
    if not 0 < value < 1:
        raise ValueError(f"beta must be in (0, 1) (M = beta * teacher + (1 - beta) * student; 0 and 1 are the two "
                         f"KL directions: use direction='reverse' or 'forward'), got {value}")
    return value


def check_one_temperature(temperature: object, op: str) -> float:
    """One positive number (an op that takes no per-row temperatures)."""
    if isinstance(temperature, torch.Tensor) and temperature.numel() != 1:
        raise TypeError(f"{op}'s temperature must be one positive number, got a tensor of shape "
                        f"{tuple(temperature.shape)}: per-row temperatures are taken by the logprob ops, not by "
                        f"{op} (divide each side's logits by its temperatures before the call)")
    return check_temperature(temperature)


def check_k(k: object, vocab: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= int(k) <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {int(k)}")
    return int(k)


def check_logits_dtype(dtype: object) -> Optional[torch.dtype]:
    if dtype is None or dtype == torch.float32:
        return None
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"logits_dtype must be torch.bfloat16, torch.float16 or None (exact fp32 "
                         f"products), got {dtype!r}")
    return dtype


def check_vocab_start(vocab_start: object) -> Optional[int]:
    """``vocab_start``: None (then ``rank * V_local``) or the global id of the shard's first column."""
    if vocab_start is None:
        return None
    if isinstance(vocab_start, bool):
        raise TypeError("vocab_start must be an int (the global id of this shard's first column) or None, got a bool")
    try:
        value = operator.index(vocab_start)
    except TypeError:
        raise TypeError(f"vocab_start must be an int (the global id of this shard's first column) or None, "
                        f"got {type(vocab_start).__name__}") from None
    if value < 0:
        raise ValueError(f"vocab_start={value} is negative; give the global id of this shard's first column "
                         "(0 on the rank holding the start of the vocabulary)")
    return value
