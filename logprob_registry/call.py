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

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from . import config
from . import validation as v
from .opspec import OPS, Context, OpSpec, Option
from .opspec import get as get_spec
from .registry.key import Key, hidden_bucket, vocab_bucket
from .sampler import NAMES as SAMPLER_NAMES
from .sampler import OFF, PER_ROW, Sampler, check_sampler

_DEVICE_TYPE = re.compile(r"^([a-z][a-z0-9_]*)(:\d+)?$")
_FUNCTORCH = frozenset({"functorch"})
_CANDIDATES = frozenset({"candidates"})
_PER_ROW = frozenset({PER_ROW})
#: The feature of an op of the form "either" given hidden states with their weight (token_stats').
_HIDDEN_INPUTS = frozenset({"stats_hidden"})
#: what a hidden size in :func:`key_for` means, by the op's form: the feature of hidden-state inputs
_HIDDEN_SIZE_MEANS = {"either": _HIDDEN_INPUTS, "sides": frozenset({"kl_hidden"})}


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
    known; only its bucket matters, and only for those ops: other ops' keys never hold one). For an
    op given logits or hidden states, a ``hidden_size`` means hidden states: the key needs their
    feature (``token_stats``: ``stats_hidden``; ``kl_divergence``: ``kl_hidden``)."""
    spec = get_spec(op)  # an unknown op: ValueError naming the known ones
    if hidden_size is not None:
        features = frozenset(features) | _HIDDEN_SIZE_MEANS.get(spec.form, frozenset())
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
               vocab_bucket(vocab), hidden_bucket(hidden_size) if spec.keyed_by_hidden else 0)


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


class Inputs(NamedTuple):
    """What an op's form (:data:`FORMS`) makes of its inputs: the tensor whose device and dtype
    select the backend (``on``), the vocabulary size, the validated inputs in the op's order, the
    labels (or None), and the hidden size that keys the selection (0: none)."""

    on: torch.Tensor
    vocab: int
    tensors: Tuple[torch.Tensor, ...]
    labels: Optional[torch.Tensor]
    hidden: int


def _labels(spec: OpSpec, given: Mapping[str, Any], on: torch.Tensor, against: str) -> Optional[torch.Tensor]:
    if "labels" not in spec.inputs or (given.get("labels") is None and "labels" in spec.optional_inputs):
        return None
    return v.check_labels(given.get("labels"), on, against, candidates=True)


def _tensors(spec: OpSpec, first: Tuple[torch.Tensor, ...], labels: Optional[torch.Tensor]) -> Tuple[Any, ...]:
    """The validated inputs in the op's order: ``first``, then the labels where the op takes them
    (None where they are optional and not given)."""
    return first + (labels,) if "labels" in spec.inputs and (labels is not None or spec.optional_inputs) else first


def _logits_form(spec: OpSpec, given: Mapping[str, Any], options: dict) -> Inputs:
    """Logits ``(..., V)`` (and labels)."""
    logits = v.check_logits(given.get(spec.inputs[0]))
    labels = _labels(spec, given, logits, "logits")
    return Inputs(logits, logits.shape[-1], _tensors(spec, (logits,), labels), labels, 0)


def _hidden_form(spec: OpSpec, given: Mapping[str, Any], options: dict) -> Inputs:
    """Hidden states ``(..., H)``, an lm_head ``weight (V, H)`` and the option ``bias`` (and labels)."""
    hidden, weight, options["bias"] = v.check_hidden(given.get("hidden"), given.get("weight"), options.get("bias"))
    labels = _labels(spec, given, hidden, "hidden")
    return Inputs(hidden, weight.shape[0], _tensors(spec, (hidden, weight), labels), labels, hidden.shape[-1])


def _either_form(spec: OpSpec, given: Mapping[str, Any], options: dict) -> Inputs:
    """Logits ``(..., V)`` (the input ``inputs``), or hidden states ``(..., H)`` when the option
    ``weight`` ``(V, H)`` is given (with the option ``bias``); and labels, or None."""
    first = spec.inputs[0]
    if options.get("weight") is None:
        if options.get("bias") is not None:
            raise ValueError("bias was given without weight: bias is added to inputs @ weight.T, so pass the lm_head "
                             "weight (V, H) with it, or add the bias to the logits yourself")
        logits = v.check_logits(given.get(first))
        labels = _labels(spec, given, logits, first)
        return Inputs(logits, logits.shape[-1], _tensors(spec, (logits,), labels), labels, 0)
    hidden, weight, options["bias"] = v.check_hidden(given.get(first), options["weight"], options.get("bias"))
    options["weight"] = weight
    labels = _labels(spec, given, hidden, first)
    return Inputs(hidden, weight.shape[0], _tensors(spec, (hidden,), labels), labels, hidden.shape[-1])


def _sides_form(spec: OpSpec, given: Mapping[str, Any], options: dict) -> Inputs:
    """A student and a teacher, each logits ``(..., V)`` or hidden states with its weight ``(V, H)``
    (the options ``student_weight`` and ``teacher_weight``), the same positions and vocabulary; the
    teacher (and its weight) detached: a target."""
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
    options["student_weight"] = student_weight
    options["teacher_weight"] = None if teacher_weight is None else teacher_weight.detach()
    hidden = max((x.shape[-1] for x, w in ((student, student_weight), (teacher, teacher_weight)) if w is not None),
                 default=0)  # the larger hidden side's bucket: it bounds the work per row
    return Inputs(student, vocab, (student, teacher.detach()), None, hidden)


#: How each form of inputs (``OpSpec.form``) is validated: ``(spec, given, options) -> Inputs``,
#: completing the options that are inputs of the form (``bias``, ``*_weight``) in place.
FORMS = {"logits": _logits_form, "hidden": _hidden_form, "sides": _sides_form, "either": _either_form}


def validate(op: str, given: Mapping[str, Any]) -> Call:
    """Check the arguments ``given`` to ``op``'s public function (its parameter names, as
    ``locals()`` gives them; absent ones take their defaults) and return the :class:`Call`; a bad
    argument raises the error that says what is wrong and how to fix it. The inputs first (by the
    op's form), then each option by its check, in the op table's order, then the sampler's keywords
    as one value."""
    spec = get_spec(op)
    config.check()
    plain = _plain(spec, given)
    if plain is not None:
        return plain
    group = given.get("process_group")
    vocab_start = given.get("vocab_start")
    if group is None and vocab_start is not None:
        raise ValueError(f"vocab_start={vocab_start!r} was given without process_group; vocab_start places this "
                         "rank's vocabulary shard within a process group: pass process_group= too, or neither")
    sharded = group is not None
    options = {o.name: given.get(o.name, o.default) for o in spec.options}
    inputs = FORMS[spec.form](spec, given, options)
    on, vocab = inputs.on, inputs.vocab
    context = Context(tuple(on.shape[:-1]) + (vocab,), None if sharded else vocab, on.device, sharded,
                      inputs.labels is not None, options)
    checked, featured = _option_rules(spec)
    for option in checked:
        options[option.name] = option.check(options[option.name], context)
    if inputs.labels is not None and not sharded:  # a shard's labels are checked once the whole vocabulary is known
        v.check_label_range(inputs.labels, vocab, options.get("ignore_index"))
    if Sampler.in_use(given):  # else every sampler option is already None (OFF)
        sampler = Sampler.validate(given, context.shape, on.device, vocab=None if sharded else vocab)
        options.update(sampler.keywords())
    else:
        sampler = OFF
    if "sampler" in options:  # the engine's order matters only where top_k, top_p or min_p truncate
        order = check_sampler(options["sampler"])
        options["sampler"] = order if _ordered(sampler) else None
    scale = v.check_logit_scale(given.get("logit_scale"))
    if scale is not None:  # z = softcap(s x) / T = softcap_{c/s}(x) / (T / s): every backend and path has it
        options["temperature"] = options["temperature"] / scale
        if options.get("softcap") is not None:
            options["softcap"] = options["softcap"] / scale
            sampler = dataclasses.replace(sampler, softcap=options["softcap"])
    if sharded:
        vocab_start = v.check_vocab_start(vocab_start)
    features = sampler.features()
    if isinstance(options.get("temperature"), torch.Tensor):
        features = features | _PER_ROW
    for option in featured:
        if option.used(options[option.name]):
            features = features | {option.feature}
    if inputs.labels is not None and v.has_candidates(inputs.labels, on):
        features = features | _CANDIDATES
    if spec.form == "either" and options.get("weight") is not None:  # hidden states, the logits never formed
        features = features | _HIDDEN_INPUTS
    if v.inside_functorch_transform():
        features = features | _FUNCTORCH
    grad_on = torch.is_grad_enabled()
    named = dict(zip(spec.inputs, inputs.tensors))
    needs = tuple(bool(grad_on and t is not None and t.requires_grad)
                  for t in (named[n] if n in named else options.get(n) for n in spec.grad_inputs))
    key = Key(op, on.device.type, on.dtype, any(needs), features, vocab_bucket(vocab),
              hidden_bucket(inputs.hidden) if spec.keyed_by_hidden else 0)
    return Call(op, inputs.tensors, options, sampler, features, needs, key, vocab, given.get("backend"), group,
                vocab_start)


# ------------------------------------------------------------------------------- the plain call
_PLAIN_RULES: dict = {}
_PLAIN_KEYS: dict = {}
_new_call = tuple.__new__  # Call(...) without NamedTuple's Python-level __new__ (every field given)


def _plain_rules(spec: OpSpec) -> Optional[Tuple[bool, dict]]:
    """For an op given logits whose options are the sampler's and temperature (and with labels,
    ignore_index and inplace_backward): whether it takes labels, and the options of a plain call
    (their defaults, the sampler's order None); None for any other op."""
    found = _PLAIN_RULES.get(spec.name)
    if found is None or found[0] is not spec:
        names = {o.name for o in spec.options}
        labels = spec.inputs == ("logits", "labels")
        simple = {"temperature", "ignore_index", "inplace_backward"} if labels else {"temperature"}
        fits = (spec.form == "logits" and spec.inputs in (("logits",), ("logits", "labels"))
                and spec.grad_inputs == ("logits",) and names == simple | set(SAMPLER_NAMES) | {"sampler"}
                and all(o.default is None for o in spec.options if o.name not in simple))
        found = _PLAIN_RULES[spec.name] = (spec, (labels, {o.name: o.default for o in spec.options}) if fits else None)
    return found[1]


def _plain_key(lookup: Tuple[str, torch.device, torch.dtype, bool, int]) -> Optional[Key]:
    """The Key of a plain call ``(op, device, dtype, grad, vocab)``, kept in ``_PLAIN_KEYS``; None
    where the call is not plain (logits not floating point, an empty vocabulary, the meta device)."""
    name, device, dtype, grad, vocab = lookup
    if not dtype.is_floating_point or vocab == 0 or device.type == "meta":
        return None
    if len(_PLAIN_KEYS) > 4096:  # a bound for a process that sees many devices and vocabularies
        _PLAIN_KEYS.clear()
    key = _PLAIN_KEYS[lookup] = Key(name, device.type, dtype, grad, frozenset(), vocab_bucket(vocab), 0)
    return key


# Bound once: each is asked on every plain call (issue #36, a small call near torch).
_is_grad_enabled = torch.is_grad_enabled
_traced = v.traced
_in_transform = v.inside_functorch_transform


def _plain(spec: OpSpec, given: Mapping[str, Any]) -> Optional[Call]:
    """The :class:`Call` of a plain call (logits, and labels of the positions' shape; temperature a
    float, ignore_index an int or None, inplace_backward a bool; no sampler keyword, logit_scale,
    process_group or vocab_start; not traced, not in a torch.func transform), made with checks of
    types and shapes and the labels' range; None for any other call, and for one that a check of
    :func:`validate` would refuse (which then raises the error that says why). It is the Call the
    full validation makes (tests/test_call.py compares them): issue #36, a small call near torch.
    Its Key is cached by ``(op, device, dtype, grad, vocab)``: one lookup stands for the checks of
    the logits' dtype, vocabulary and device (``device.type`` alone costs 0.3 us)."""
    rules = _PLAIN_RULES.get(spec.name)
    rules = rules[1] if rules is not None and rules[0] is spec else _plain_rules(spec)
    get = given.get
    if rules is None or not (get("softcap") is None and get("top_k") is None and get("top_p") is None
                             and get("min_p") is None and get("keep") is None and get("logit_scale") is None
                             and get("process_group") is None and get("vocab_start") is None):
        return None
    order = get("sampler")
    if order is not None and not (order.__class__ is str and order == "vllm"):
        return None
    t = get("temperature", 1.0)
    logits = get("logits")
    if (t.__class__ is not float or not 0.0 < t < math.inf or logits.__class__ is not torch.Tensor
            or _traced() or _in_transform()):
        return None
    shape = logits.shape
    if not shape:
        return None
    vocab = shape[-1]
    device = logits.device
    grad = logits.requires_grad and _is_grad_enabled()
    lookup = (spec.name, device, logits.dtype, grad, vocab)
    key = _PLAIN_KEYS.get(lookup) or _plain_key(lookup)
    if key is None:
        return None
    with_labels, options = rules
    options = options.copy()
    options["temperature"] = t
    if with_labels:
        ignore = options["ignore_index"] = get("ignore_index")
        inplace = options["inplace_backward"] = get("inplace_backward", False)
        if ignore is not None and not (ignore.__class__ is int and v.INT64.min <= ignore <= v.INT64.max):
            return None
        labels = get("labels")
        if (not (inplace is False or inplace is True) or labels.__class__ is not torch.Tensor
                or labels.dtype not in v.LABEL_DTYPES or labels.device != device or labels.shape != shape[:-1]):
            return None
        values: Any = ()
        if key.device == "cpu" and labels.numel() <= v.SMALL_LABELS:  # in range: accepted at once (Python's min, max)
            values = (labels if labels.dim() == 1 else labels.reshape(-1)).tolist()
            if not values or (min(values) >= 0 and max(values) < vocab):
                values = None
        if values is not None:  # the full check: it names a label out of range, and sees ignore_index
            v.check_label_range(labels, vocab, ignore)
        inputs: Tuple[Any, ...] = (logits, labels)
    else:
        inputs = (logits,)
    return _new_call(Call, (spec.name, inputs, options, OFF, key.features, (grad,), key, vocab, get("backend"), None,
                            None))


def _option_rules(spec: OpSpec) -> Tuple[Tuple[Option, ...], Tuple[Option, ...]]:
    """The options of ``spec`` that have a check (the sampler's keywords are checked together), and
    those besides the sampler's that need a feature when used (``logits_dtype``, ``kl_hidden``'s)."""
    found = _RULES.get(spec.name)
    if found is None or found[0] is not spec:  # made once per op (an op registered again: anew)
        checked = tuple(o for o in spec.options if o.check is not None)
        featured = tuple(o for o in spec.options if o.feature is not None and o.name not in SAMPLER_NAMES)
        found = _RULES[spec.name] = (spec, checked, featured)
    return found[1], found[2]


_RULES: dict = {}


__all__ = ["OFF", "Call", "key_for", "shape_vocab", "validate"]
