"""The public functions: validate the inputs, build the key, dispatch through the registry with the
options the op table (:mod:`.opspec`) says a backend receives, return its result."""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple, Union

import torch

from . import amp, config
from . import validation as v
from .backend import Backend
from .opspec import OPS
from .opspec import get as get_spec
from .registry import Key, get_registry, vocab_bucket
from .report import Explanation

if hasattr(torch.library, "custom_op"):  # torch >= 2.4: calls inside torch.compile become a custom op
    from . import traced
else:  # pragma: no cover - an older torch traces through the registry, with graph breaks
    traced = None

_DEVICE_TYPE = re.compile(r"^([a-z][a-z0-9_]*)(:\d+)?$")
_FUNCTORCH = frozenset({"functorch"})
_CANDIDATES = frozenset({"candidates"})


def _dispatch(op: str, backend: Optional[str], inputs: Tuple[Any, ...], options: Dict[str, Any],
              on: torch.Tensor, grad: bool, candidates: bool = False) -> Any:
    if traced is not None and v.traced():  # the backend is chosen at run time, in the op's eager body
        return traced.call(op, backend, inputs, options)
    features = OPS[op].features_used(options)
    if candidates:
        features = features | _CANDIDATES
    if v.inside_functorch_transform():
        features = features | _FUNCTORCH
    vocab = vocab_bucket(inputs[1].shape[0] if op == "logprobs_from_hidden" else on.shape[-1])
    key = Key(op, on.device.type, on.dtype, grad, features, vocab)
    if amp.enabled(key.device):  # backends compute as the contract says, forward and backward
        call = lambda given, opts: get_registry().call(key, backend, given, opts)
        if grad and _FUNCTORCH.isdisjoint(features):
            return amp.call_isolated(call, inputs, options, key.device)
        with amp.off(key.device):
            return call(inputs, options)
    return get_registry().call(key, backend, inputs, options)


def _sharded(op: str, tensors: Tuple[Any, ...], options: Dict[str, Any], process_group: Any, vocab_start: Any,
             backend: Optional[str]) -> Any:
    """A call with ``process_group=``: the vocabulary-parallel path (:mod:`.distributed`), which
    validates on every rank and raises the same error on every rank."""
    if process_group is None:
        raise ValueError(f"vocab_start={vocab_start!r} was given without process_group; vocab_start places this "
                         "rank's vocabulary shard within a process group: pass process_group= too, or neither")
    if op == "logprobs_from_hidden":
        from .distributed import hidden

        return hidden.run(*tensors, options, process_group, vocab_start, backend)
    from .distributed import logits

    return logits.run(op, tensors[0], tensors[1] if len(tensors) > 1 else None, options, process_group,
                      vocab_start, backend)


def _logits_options(logits, labels, temperature, ignore_index, softcap, top_k, top_p, min_p, keep):
    """Validated (logits, labels, options) of a logits op; ``labels`` may be None (entropy)."""
    config.check()
    logits = v.check_logits(logits)
    options: Dict[str, Any] = dict(temperature=v.check_temperature(temperature))
    if labels is not None:
        labels = v.check_labels(labels, logits, "logits", candidates=True)
        options["ignore_index"] = v.check_ignore_index(ignore_index)
        v.check_label_range(labels, logits.shape[-1], options["ignore_index"])
    options.update(v.sampler_options(softcap, top_k, top_p, min_p, keep, logits.shape, logits.device))
    return logits, labels, options


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``log_softmax(processed logits)[..., labels]``, accumulated in at least fp32.

    ``logits`` has shape ``(..., V)`` and any strides; ``labels`` has shape ``(...)``, or
    ``(..., K)`` for K candidate tokens per position. The result is float32 (float64 for float64
    logits) of the labels' shape. Positions whose label equals ``ignore_index`` give 0 and a zero
    gradient. The logits are processed as a sampler does (vLLM's order): ``softcap``, division by
    ``temperature``, then ``min_p``, ``top_k``, ``top_p`` and ``keep`` truncate the distribution,
    renormalised over the kept tokens; a label outside them gives ``-inf`` and a zero gradient.
    With ``inplace_backward=True`` the backward pass may overwrite the logits' storage with their
    gradient (use it only when the logits are not needed afterwards). ``backend`` forces a backend.

    With ``process_group`` (a ``torch.distributed`` group) ``logits`` is this rank's vocabulary shard
    ``(..., V_local)`` whose first column has the global id ``vocab_start`` (default ``rank *
    V_local``, then every shard must have the same width), and ``labels`` are global ids, the same on
    every rank; every rank gets the complete result (docs/distributed.md).
    """
    if process_group is not None or vocab_start is not None:
        options = dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward,
                       softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep)
        return _sharded("logprobs", (logits, labels), options, process_group, vocab_start, backend)
    logits, labels, options = _logits_options(logits, labels, temperature, ignore_index,
                                              softcap, top_k, top_p, min_p, keep)
    options["inplace_backward"] = v.check_flag(inplace_backward, "inplace_backward")
    return _dispatch("logprobs", backend, (logits, labels), options, logits, v.needs_grad(logits),
                     v.has_candidates(labels, logits))


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Entropy of the processed distribution (see :func:`logprobs_from_logits`) over the last
    dimension, in at least fp32. ``process_group``, ``vocab_start``: a vocabulary shard, as in
    :func:`logprobs_from_logits`."""
    if process_group is not None or vocab_start is not None:
        options = dict(temperature=temperature, softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep)
        return _sharded("entropy", (logits,), options, process_group, vocab_start, backend)
    logits, _, options = _logits_options(logits, None, temperature, None, softcap, top_k, top_p, min_p, keep)
    return _dispatch("entropy", backend, (logits,), options, logits, v.needs_grad(logits))


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` in one call, both of the same processed distribution; see
    :func:`logprobs_from_logits` (``process_group`` and ``vocab_start`` included). The entropy of
    an ignored position is computed as usual."""
    if process_group is not None or vocab_start is not None:
        options = dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward,
                       softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep)
        return _sharded("logprobs_and_entropy", (logits, labels), options, process_group, vocab_start, backend)
    logits, labels, options = _logits_options(logits, labels, temperature, ignore_index,
                                              softcap, top_k, top_p, min_p, keep)
    options["inplace_backward"] = v.check_flag(inplace_backward, "inplace_backward")
    return _dispatch("logprobs_and_entropy", backend, (logits, labels), options, logits, v.needs_grad(logits),
                     v.has_candidates(labels, logits))


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    logits_dtype: Optional[torch.dtype] = None,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities of ``labels`` under ``hidden @ weight.T + bias``, without requiring the
    backend to materialise the ``(..., V)`` logits.

    ``hidden`` is ``(..., H)``, ``weight`` is ``(V, H)`` (the lm_head), ``bias`` is ``(V,)``. Hidden,
    weight and bias must share one dtype. The logits are exact fp32 products unless
    ``logits_dtype`` (torch.bfloat16 or torch.float16) rounds each to that dtype first, as an
    inference engine whose lm_head runs in it. The sampler keywords work as in
    :func:`logprobs_from_logits`. Returns ``logprobs`` or ``(logprobs, entropy)``.

    With ``process_group``, ``weight`` (and ``bias``) is this rank's vocabulary shard ``(V_local, H)``
    placed at ``vocab_start`` (see :func:`logprobs_from_logits`); every rank gets the complete result
    and, in backward, the complete hidden gradient (every rank must run the backward).
    """
    if process_group is not None or vocab_start is not None:
        options = dict(bias=bias, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
                       softcap=softcap, top_k=top_k, top_p=top_p, min_p=min_p, keep=keep, logits_dtype=logits_dtype)
        return _sharded("logprobs_from_hidden", (hidden, weight, labels), options, process_group, vocab_start,
                        backend)
    config.check()
    hidden, weight, bias = v.check_hidden(hidden, weight, bias)
    labels = v.check_labels(labels, hidden, "hidden", candidates=True)
    ignore_index = v.check_ignore_index(ignore_index)
    v.check_label_range(labels, weight.shape[0], ignore_index)
    logits_shape = hidden.shape[:-1] + (weight.shape[0],)
    options = dict(bias=bias, temperature=v.check_temperature(temperature), ignore_index=ignore_index,
                   return_entropy=v.check_flag(return_entropy, "return_entropy"),
                   **v.sampler_options(softcap, top_k, top_p, min_p, keep, logits_shape, hidden.device),
                   logits_dtype=v.check_logits_dtype(logits_dtype))
    return _dispatch("logprobs_from_hidden", backend, (hidden, weight, labels), options, hidden,
                     v.needs_grad(hidden, weight, bias), v.has_candidates(labels, hidden))


def topk_logprobs(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest processed log-probabilities of each position and their token ids:
    ``(values float32 (..., k), ids int64 (..., k))``, largest first, ties by smaller id. Where the
    sampler keywords keep fewer than ``k`` tokens, the rest are ``-inf``. For distillation and
    KL-to-teacher losses; differentiable through ``values``. ``process_group`` is not supported yet
    (an error says so, on every rank, before any collective)."""
    if process_group is not None or vocab_start is not None:
        raise NotImplementedError("topk_logprobs(..., process_group=...) is not supported yet: gather the "
                                  "logits (or each rank's own topk_logprobs of its shard) to one rank, or call "
                                  "without process_group")
    logits, _, options = _logits_options(logits, None, temperature, None, softcap, top_k, top_p, min_p, keep)
    options["k"] = v.check_k(k, logits.shape[-1])
    return _dispatch("topk_logprobs", backend, (logits,), options, logits, v.needs_grad(logits))


def _key(op: str, device, dtype, requires_grad: bool, shape=None) -> Key:
    get_spec(op)
    if shape is not None:
        shape = tuple(shape.shape if isinstance(shape, torch.Tensor) else shape)
        if not shape or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"shape must be the logits' shape (..., V), such as (8, 512, 32000), got {shape!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if device is None:
        device_type = get_registry().environment().main_device
    elif isinstance(device, torch.device):
        device_type = device.type
    elif isinstance(device, str) and _DEVICE_TYPE.match(device.strip()):
        # Parsed here: torch.device("npu") fails unless torch_npu is imported, and explain() must
        # answer for devices this machine lacks.
        device_type = _DEVICE_TYPE.match(device.strip()).group(1)
    else:
        raise ValueError(f"device must be a device type such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    vocab = vocab_bucket(shape[-1]) if shape is not None else 0
    return Key(op, device_type, dtype or torch.float32, bool(requires_grad), vocab=vocab)


def select(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
    shape=None,
) -> Backend:
    """The backend a call would use for ``op`` on tensors of this device (default: the machine's
    main device) and dtype (default float32), honouring any explicit choice in force. ``shape``
    (the logits' shape, or a tensor) gives the vocabulary size, whose bucket may matter; the
    number of rows never does."""
    return get_registry().select(_key(op, device, dtype, requires_grad, shape))


def explain(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
    shape=None,
) -> Explanation:
    """Every backend's verdict for ``op`` on such tensors, with reasons; ``str()`` is a table.
    ``shape`` (the logits' shape) adds the vocabulary's bucket: backends not worth choosing for it
    and a tuning ranking's measured times then show."""
    return get_registry().explain(_key(op, device, dtype, requires_grad, shape))


def backends() -> list:
    """Every registered backend, eligible or not, highest priority first."""
    return get_registry().backends()
