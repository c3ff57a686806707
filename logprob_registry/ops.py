"""The public functions: each validates its call once (:func:`.call.validate`), then dispatches it
through the registry (or, with ``process_group=``, hands it to the vocabulary-parallel path), and
returns what the backend returned. Their signatures are the public API; their bodies are one line."""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import amp
from . import validation as v
from .backend import Backend
from .call import Call, key_for, shape_vocab, validate
from .opspec import FUNCTIONS, OPS, TokenStats
from .registry import get_registry
from .report import Explanation

if hasattr(torch.library, "custom_op"):  # torch >= 2.4: calls inside torch.compile become a custom op
    from . import traced
else:  # pragma: no cover - an older torch traces through the registry, with graph breaks
    traced = None

def _dtensor_imported() -> bool:
    """Whether DTensor exists in this process (imported by someone; torch < 2.5's
    torch.distributed.tensor holds only ``parallel``, no DTensor). Asked of ``sys.modules``: an
    attribute torch.distributed lacks costs a microsecond (its module ``__getattr__`` raises)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and getattr(module, "DTensor", None) is not None


def run(op: str, given: Mapping[str, Any]) -> Any:
    """Validate the public function's arguments ``given`` and run the call (DTensor arguments: the
    plain call on their local tensors, :mod:`.distributed.dtensor`): the body of every public
    function, ``run(op, locals())``."""
    if _dtensor_imported() and _dtensor().involved(op, given):
        return _dtensor().run(op, given, run)
    if given.get("process_group") is None:
        return dispatch(validate(op, given))
    from .distributed import sharded

    try:
        call: Union[Call, BaseException] = validate(op, given)
    except Exception as exc:  # raised on every rank, after the header exchange
        call = exc
    return sharded.run(op, call, given["process_group"])


def _dtensor():
    module = sys.modules.get("logprob_registry.distributed.dtensor")
    if module is None:  # imported once, when a process first has DTensor
        from .distributed import dtensor as module
    return module


def dispatch(call: Call) -> Any:
    """Run a validated call through the registry's choice, with the options its backend receives."""
    key, backend = call.key, call.backend
    if traced is not None and v.traced():  # the backend is chosen at run time, in the op's eager body
        return traced.call(call.op, backend, call.inputs, dict(call.options))
    if amp.enabled(key.device):  # backends compute as the contract says, forward and backward
        run = lambda given, opts: get_registry().call(key, backend, given, opts)
        if call.grad and "functorch" not in call.features:
            return amp.call_isolated(run, call.inputs, call.options, key.device)
        with amp.off(key.device):
            return run(call.inputs, call.options)
    return get_registry().call(key, backend, call.inputs, call.options)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    sampler: str = "vllm",
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``log_softmax(processed logits)[..., labels]``, accumulated in at least fp32.

    ``logits`` has shape ``(..., V)`` and any strides; ``labels`` has shape ``(...)``, or
    ``(..., K)`` for K candidate tokens per position. The result is float32 (float64 for float64
    logits) of the labels' shape. Positions whose label equals ``ignore_index`` give 0 and a zero
    gradient. The logits are processed as a sampler does (vLLM's order): ``logit_scale`` multiplies
    them (a scaled head's constant), then ``softcap``, division by
    ``temperature``, then ``min_p``, ``top_k``, ``top_p`` and ``keep`` truncate the distribution,
    renormalised over the kept tokens; a label outside them gives ``-inf`` and a zero gradient.
    ``temperature``, ``top_k``, ``top_p`` and ``min_p`` each take a number, or one value per position:
    a tensor broadcastable to the positions' shape ``(...)`` (e.g. ``(B, 1)`` for one value per
    sequence of ``(B, T)`` positions); in a row, ``top_k=0`` (or -1), ``top_p=1.0`` and ``min_p=0.0`` switch that
    truncation off. Each row's result is bitwise that of the call with the row's values as numbers.
    ``sampler`` names the engine whose order and tie rules ``top_k``, ``top_p`` and ``min_p`` follow:
    ``"vllm"`` (V1: min_p on the full distribution, then top_k, then top_p), ``"hf"``
    (transformers' ``generate``: top_k, top_p, then min_p on what is left) or ``"sglang"``
    (docs/sampler.md).
    With ``inplace_backward=True`` the backward pass may overwrite the logits' storage with their
    gradient (use it only when the logits are not needed afterwards). ``backend`` forces a backend.

    With ``process_group`` (a ``torch.distributed`` group) ``logits`` is this rank's vocabulary shard
    ``(..., V_local)`` whose first column has the global id ``vocab_start`` (default ``rank *
    V_local``, then every shard must have the same width), and ``labels`` are global ids, the same on
    every rank; every rank gets the complete result (docs/distributed.md).
    """
    return run("logprobs", locals())


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    sampler: str = "vllm",
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Entropy of the processed distribution (see :func:`logprobs_from_logits`) over the last
    dimension, in at least fp32. ``process_group``, ``vocab_start``: a vocabulary shard, as in
    :func:`logprobs_from_logits`."""
    return run("entropy", locals())


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: Optional[int] = None,
    inplace_backward: bool = False,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    sampler: str = "vllm",
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` in one call, both of the same processed distribution; see
    :func:`logprobs_from_logits` (``process_group`` and ``vocab_start`` included). The entropy of
    an ignored position is computed as usual."""
    return run("logprobs_and_entropy", locals())


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: Optional[int] = None,
    return_entropy: bool = False,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    logits_dtype: Optional[torch.dtype] = None,
    sampler: str = "vllm",
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
    return run("logprobs_from_hidden", locals())


def topk_logprobs(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    sampler: str = "vllm",
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest processed log-probabilities of each position and their token ids:
    ``(values float32 (..., k), ids int64 (..., k))``, largest first, ties by smaller id. Where the
    sampler keywords keep fewer than ``k`` tokens, the rest are ``-inf``. For distillation and
    KL-to-teacher losses; differentiable through ``values``. ``process_group``, ``vocab_start``: a
    vocabulary shard, as in :func:`logprobs_from_logits`; every rank gets the complete values and
    global ids (``k`` up to the whole vocabulary)."""
    return run("topk_logprobs", locals())


def kl_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    direction: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    logit_scale: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    student_weight: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    support: Optional[torch.Tensor] = None,
    tail: bool = True,
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """The KL divergence between the student's and the teacher's distributions at each position:
    float32 of the positions' shape ``(...)`` (float64 for float64 input), accumulated in fp32.

    ``direction="forward"`` is ``KL(teacher || student)``, ``"reverse"`` ``KL(student || teacher)``,
    ``"jsd"`` the generalized Jensen-Shannon divergence ``beta KL(T || M) + (1 - beta) KL(S || M)`` with
    ``M = beta T + (1 - beta) S`` (TRL's; ``beta`` in (0, 1), ignored by the other directions);
    ``temperature`` (a number: per-row temperatures are the logprob ops') divides both sides' logits
    (no ``T**2`` factor); ``logit_scale`` multiplies both sides' logits first. Each side is logits ``(..., V)``,
    or hidden states ``(..., H)`` with its lm_head ``*_weight`` ``(V, H)`` (its logits are then never
    materialised). ``mask`` (bool, ``(...)``): False positions give 0 and a zero gradient.
    ``support`` (int ids ``(..., K)``, distinct per position): both distributions restricted to those
    K tokens plus, with ``tail=True``, one bucket for the mass outside them (its log a log-sum-exp over
    the complement); with ``tail=False`` renormalised over the K. The gradient reaches the student
    (and ``student_weight``) only: the teacher is a detached target. ``process_group``,
    ``vocab_start``: both sides are this rank's vocabulary shards, as in
    :func:`logprobs_from_logits` (docs/distillation.md)."""
    return run("kl_divergence", locals())


def token_stats(
    inputs: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    outputs: Sequence[str] = ("logprobs", "entropy"),
    temperature: Union[float, torch.Tensor] = 1.0,
    ignore_index: Optional[int] = None,
    logit_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    min_p: Union[float, torch.Tensor, None] = None,
    keep: Optional[torch.Tensor] = None,
    sampler: str = "vllm",
    process_group: Any = None,
    vocab_start: Optional[int] = None,
    backend: Optional[str] = None,
) -> TokenStats:
    """Every statistic of a position in one pass over the vocabulary: an :class:`TokenStats` whose
    fields named in ``outputs`` are computed (the others None).

    ``inputs`` are logits ``(..., V)``, or hidden states ``(..., H)`` when ``weight`` ``(V, H)`` (and
    ``bias`` ``(V,)``) is given, whose logits are then never formed. The fields: ``logprobs`` and
    ``entropy`` of the processed distribution (as :func:`logprobs_and_entropy`, bitwise where a backend
    has both); ``raw_logprobs`` and ``raw_entropy`` before truncation (``logit_scale``, ``softcap`` and
    ``temperature`` applied; no ``top_k``/``top_p``/``min_p``/``keep``); ``log_sum_p2``, log of the sum
    of the squared probabilities of the processed distribution; ``mean_logit`` and ``max_logit`` of
    ``z = softcap(logit_scale * x) / temperature`` over the vocabulary; ``is_argmax`` (bool), whether
    the label is the processed logits' argmax (the first maximum wins). ``labels`` ``(...)`` are needed
    by ``logprobs``, ``raw_logprobs`` and ``is_argmax``; at ``ignore_index`` those give 0 (False). The
    first four are differentiable (to ``inputs``, ``weight`` and ``bias``), the other four are not.
    Every other keyword as in :func:`logprobs_from_logits`."""
    return run("token_stats", locals())


def _key(op: str, device, dtype, requires_grad: bool, shape=None, hidden_size=None):
    return key_for(op, device=device, dtype=dtype, requires_grad=requires_grad, vocab=shape_vocab(shape),
                   hidden_size=hidden_size)


def select(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
    shape=None,
    hidden_size: Optional[int] = None,
) -> Backend:
    """The backend a call would use for ``op`` on tensors of this device (default: the machine's
    main device) and dtype (default float32), honouring any explicit choice in force. ``shape``
    (the logits' shape, or a tensor) gives the vocabulary size, whose bucket may matter; the
    number of rows never does. ``hidden_size``: for an op given hidden states
    (``logprobs_from_hidden``), their size H, whose bucket may matter too."""
    return get_registry().select(_key(op, device, dtype, requires_grad, shape, hidden_size))


def explain(
    op: str = "logprobs",
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = False,
    shape=None,
    hidden_size: Optional[int] = None,
) -> Explanation:
    """Every backend's verdict for ``op`` on such tensors, with reasons; ``str()`` is a table.
    ``shape`` (the logits' shape) adds the vocabulary's bucket: backends not worth choosing for it
    and a tuning ranking's measured times then show. ``hidden_size``: for an op given hidden
    states (``logprobs_from_hidden``: ``shape`` is then that of the logits it forms, ``(..., V)``),
    their size H; its bucket completes the key (without it, no size rule or measurement applies)."""
    return get_registry().explain(_key(op, device, dtype, requires_grad, shape, hidden_size))


def backends() -> list:
    """Every registered backend, eligible or not, highest priority first."""
    return get_registry().backends()


# Each op's public function, by the name the op table gives it (opspec.FUNCTIONS).
FUNCTIONS.update({name: globals()[spec.function] for name, spec in OPS.items()
                  if spec.function is not None and spec.function in globals()})
