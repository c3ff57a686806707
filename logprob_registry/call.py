"""The validated call: what every path (dispatch, ``process_group=``, ``parity``, the suite) works on.

:func:`validate` checks a public function's arguments once, in one order, and returns a frozen
:class:`Call`: the op, its inputs and options exactly as a backend receives them, the sampler as one
value (:class:`~logprob_registry.sampler.Sampler`), the backend features the call needs, and its
selection :class:`~logprob_registry.registry.key.Key`. A user's bad input raises here, before any
dispatch (so it never triggers a fallback) and before any collective.

This module is the only one that makes a ``Key``: :func:`key_for` describes a kind of call without
tensors (``select``, ``explain``, ``tune``, the suite, the distributed shard ops).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from . import config
from . import validation as v
from .opspec import OPS, OpSpec
from .opspec import get as get_spec
from .registry.key import HIDDEN_KEYED, Key, hidden_bucket, vocab_bucket
from .sampler import NAMES as SAMPLER_NAMES
from .sampler import OFF, PER_ROW, Sampler, check_sampler, check_temperature

_DEVICE_TYPE = re.compile(r"^([a-z][a-z0-9_]*)(:\d+)?$")
_FUNCTORCH = frozenset({"functorch"})
_CANDIDATES = frozenset({"candidates"})
_PER_ROW = frozenset({PER_ROW})
_OTHER_FEATURED = {name: tuple(o for o in spec.options if o.feature is not None and o.name not in SAMPLER_NAMES)
                   for name, spec in OPS.items()}


def _ordered(sampler: Sampler) -> bool:
    """Whether the call uses top_k, top_p or min_p: the keywords whose order and ties differ between engines."""
    return sampler.top_k is not None or sampler.top_p is not None or sampler.min_p is not None


def key_for(op: str, *, device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None,
            requires_grad: bool = False, features: Iterable[str] = (), vocab: Optional[int] = None,
            hidden_size: Optional[int] = None) -> Key:
    """The selection key of a kind of call: ``op`` on tensors of ``device`` (a device, a device type
    such as ``"cuda"`` or ``"cuda:1"``; default: the machine's main device) and ``dtype`` (default
    float32), with or without a backward, using ``features``, over a vocabulary of ``vocab`` columns
    (None: not known; only its bucket matters) and, for an op given hidden states
    (``logprobs_from_hidden``, ``kl_divergence`` with a ``*_weight``), of ``hidden_size`` (None: not
    known; only its bucket matters, and only for those ops: other ops' keys never hold one)."""
    get_spec(op)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if device is None:
        from .registry import get_registry

        device_type = get_registry().environment().main_device
    elif isinstance(device, torch.device):
        device_type = device.type
    elif isinstance(device, str) and _DEVICE_TYPE.match(device.strip()):
        # Parsed here: torch.device("npu") fails unless torch_npu is imported, and explain() must
        # answer for devices this machine lacks.
        device_type = _DEVICE_TYPE.match(device.strip()).group(1)
    else:
        raise ValueError(f"device must be a device type such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    return Key(op, device_type, dtype or torch.float32, bool(requires_grad), frozenset(features),
               vocab_bucket(vocab), hidden_bucket(hidden_size) if op in HIDDEN_KEYED else 0)


def shape_vocab(shape: Any) -> Optional[int]:
    """The vocabulary size of a logits ``shape`` (a tuple, a ``torch.Size`` or a tensor; None: not
    given), or a ValueError saying what a shape must be."""
    if shape is None:
        return None
    shape = tuple(shape.shape if isinstance(shape, torch.Tensor) else shape)
    if not shape or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"shape must be the logits' shape (..., V), such as (8, 512, 32000), got {shape!r}")
    return shape[-1]


class Call(NamedTuple):
    """One validated call of a public function (a named tuple, cheap to make on the hot path;
    ``options`` is a plain dict that nothing modifies after validation).

    ``inputs`` and ``options`` are what a backend of ``op`` receives (``OpSpec.backend_options``
    narrows ``options`` to the features it declares); ``sampler`` is the same sampler keywords as
    one value; ``needs_grad`` follows ``spec.grad_inputs``. With ``process_group`` the inputs are
    this rank's shard: ``vocab`` is the shard's width, the label range is checked once the whole
    vocabulary is known (:mod:`logprob_registry.distributed`), and ``vocab_start`` is the validated
    keyword (None: ``rank * vocab``)."""

    op: str
    inputs: Tuple[Any, ...]
    options: Mapping[str, Any]
    sampler: Sampler
    features: frozenset
    needs_grad: Tuple[bool, ...]
    key: Key
    vocab: int
    backend: Optional[str] = None
    process_group: Any = None
    vocab_start: Optional[int] = None

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]

    @property
    def grad(self) -> bool:
        """Whether a backward is needed."""
        return any(self.needs_grad)

    @property
    def sharded(self) -> bool:
        return self.process_group is not None

    @property
    def candidates(self) -> bool:
        return "candidates" in self.features

    def input(self, name: str) -> Any:
        """The input (or tensor option) called ``name`` in the op table."""
        spec = self.spec
        if name in spec.inputs:
            return self.inputs[spec.inputs.index(name)]
        return self.options.get(name)

    def shard_key(self, op: str, requires_grad: bool = False) -> Key:
        """The key of the shard op ``op`` (``shard_stats``, ...) that the distributed path runs for this call."""
        on = self.inputs[0]
        return key_for(op, device=on.device, dtype=on.dtype, requires_grad=requires_grad)


def validate(op: str, given: Mapping[str, Any]) -> Call:
    """Check the arguments ``given`` to ``op``'s public function (its parameter names, as
    ``locals()`` gives them; absent ones take their defaults) and return the :class:`Call`; a bad
    argument raises the error that says what is wrong and how to fix it."""
    spec = get_spec(op)
    config.check()
    group = given.get("process_group")
    vocab_start = given.get("vocab_start")
    if group is None and vocab_start is not None:
        raise ValueError(f"vocab_start={vocab_start!r} was given without process_group; vocab_start places this "
                         "rank's vocabulary shard within a process group: pass process_group= too, or neither")
    sharded = group is not None
    options = {o.name: given.get(o.name, o.default) for o in spec.options}
    if op == "kl_divergence":
        return _validate_kl(spec, given, options, group, vocab_start)
    # inputs first, then the options, in the op table's order
    if op == "logprobs_from_hidden":
        hidden, weight, bias = v.check_hidden(given.get("hidden"), given.get("weight"), options["bias"])
        options["bias"] = bias
        on, vocab, tensors, grad_tensors = hidden, weight.shape[0], [hidden, weight], (hidden, weight, bias)
        against = "hidden"
    else:
        on = v.check_logits(given.get("logits"))
        vocab, tensors, grad_tensors, against = on.shape[-1], [on], (on,), "logits"
    logits_shape = tuple(on.shape[:-1]) + (vocab,)
    labels = None
    if "labels" in spec.inputs:
        labels = v.check_labels(given.get("labels"), on, against, candidates=True)
        tensors.append(labels)
    if "ignore_index" in options:
        options["ignore_index"] = v.check_ignore_index(options["ignore_index"])
        if not sharded:  # a shard's labels are checked once the whole vocabulary is known
            v.check_label_range(labels, vocab, options["ignore_index"])
    options["temperature"] = check_temperature(options["temperature"], logits_shape, on.device)
    if "inplace_backward" in options:
        options["inplace_backward"] = v.check_flag(options["inplace_backward"], "inplace_backward")
    elif op == "logprobs_from_hidden":
        options["return_entropy"] = v.check_flag(options["return_entropy"], "return_entropy")
        options["logits_dtype"] = v.check_logits_dtype(options["logits_dtype"])
    elif op == "topk_logprobs":
        options["k"] = v.check_k(options["k"], vocab if not sharded else 1 << 62)  # a shard: against V later
    if Sampler.in_use(given):  # else every sampler option is already None (OFF)
        sampler = Sampler.validate(given, logits_shape, on.device, vocab=None if sharded else vocab)
        options.update(sampler.keywords())
    else:
        sampler = OFF
    if "sampler" in options:  # the engine's order matters only where top_k, top_p or min_p truncate
        order = check_sampler(options["sampler"])
        options["sampler"] = order if _ordered(sampler) else None
    if sharded:
        vocab_start = v.check_vocab_start(vocab_start)
    features = sampler.features()
    if isinstance(options["temperature"], torch.Tensor):
        features = features | _PER_ROW
    for option in _OTHER_FEATURED[op]:  # options besides the sampler's that need a feature (logits_dtype)
        if option.used(options[option.name]):
            features = features | {option.feature}
    if labels is not None and v.has_candidates(labels, on):
        features = features | _CANDIDATES
    if v.inside_functorch_transform():
        features = features | _FUNCTORCH
    grad_on = torch.is_grad_enabled()
    needs = tuple(bool(grad_on and t is not None and t.requires_grad) for t in grad_tensors)
    key = Key(op, on.device.type, on.dtype, any(needs), features, vocab_bucket(vocab),
              hidden_bucket(on.shape[-1]) if against == "hidden" else 0)
    return Call(op, tuple(tensors), options, sampler, features, needs, key, vocab, given.get("backend"), group,
                vocab_start)


def _validate_kl(spec: OpSpec, given: Mapping[str, Any], options: dict, group: Any, vocab_start: Any) -> Call:
    """:func:`validate` of ``kl_divergence``: each side logits ``(..., V)`` or hidden states with its
    weight ``(V, H)``, the same positions and vocabulary; the teacher (and its weight) detached."""
    sharded = group is not None
    student, student_weight, vocab = v.check_side("student", given.get("student"), options["student_weight"])
    teacher, teacher_weight, teacher_vocab = v.check_side("teacher", given.get("teacher"), options["teacher_weight"])
    if tuple(student.shape[:-1]) != tuple(teacher.shape[:-1]):
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} have different positions "
                         f"({tuple(student.shape[:-1])} against {tuple(teacher.shape[:-1])}): give both the same "
                         "leading dims, one distribution per position")
    if vocab != teacher_vocab:
        raise ValueError(f"the student's vocabulary ({vocab}) and the teacher's ({teacher_vocab}) differ: both must "
                         "score the same tokens (pad the smaller lm_head, or slice the larger)")
    v.check_same_device(teacher, student.device, "teacher", "student")
    options["student_weight"], options["teacher_weight"] = student_weight, teacher_weight
    if teacher_weight is not None:
        options["teacher_weight"] = teacher_weight.detach()  # a target: no gradient reaches it
    teacher = teacher.detach()
    direction = options["direction"]
    if direction not in ("forward", "reverse"):
        raise ValueError(f'direction must be "forward" (KL(teacher || student)) or "reverse" (KL(student || '
                         f'teacher)), got {direction!r}')
    temperature = options["temperature"]
    if isinstance(temperature, torch.Tensor) and temperature.numel() != 1:
        raise TypeError(f"kl_divergence's temperature must be one positive number, got a tensor of shape "
                        f"{tuple(temperature.shape)}: per-row temperatures are taken by the logprob ops, not by "
                        "kl_divergence (divide each side's logits by its temperatures before the call)")
    options["temperature"] = v.check_temperature(temperature)
    lead = tuple(student.shape[:-1])
    options["mask"] = v.check_mask(options["mask"], lead, student.device)
    options["support"] = v.check_support(options["support"], lead, None if sharded else vocab, student.device)
    options["tail"] = v.check_flag(options["tail"], "tail")
    if sharded:
        vocab_start = v.check_vocab_start(vocab_start)
    features = spec.features_used(options)
    if v.inside_functorch_transform():
        features = features | _FUNCTORCH
    grad_on = torch.is_grad_enabled()
    needs = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (student, student_weight))
    hidden = max((s.shape[-1] for s, w in ((student, student_weight), (teacher, teacher_weight)) if w is not None),
                 default=0)  # the larger hidden side's bucket: it bounds the work per row
    key = Key("kl_divergence", student.device.type, student.dtype, any(needs), features, vocab_bucket(vocab),
              hidden_bucket(hidden))
    return Call("kl_divergence", (student, teacher), options, OFF, features, needs, key, vocab, given.get("backend"),
                group, vocab_start)


__all__ = ["OFF", "Call", "key_for", "shape_vocab", "validate"]
