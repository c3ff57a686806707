"""The op table: every op a backend can implement, exactly as the backend receives it.

One :class:`OpSpec` per op names its positional inputs, the keyword options that come with them
(with their defaults), and what it returns. Everything that knows about ops reads this table: the
``Backend`` record (which ops exist), the public functions (what a backend is called with), the
conformance suite's harness, ``bench``, ``tune`` and ``info``. Adding an op or a keyword is one entry
here plus its kernels and its conformance tests.

Each public op also says what it *means*: its ``reference`` (the function of
:mod:`logprob_registry.reference` computing the float64 ground truth, :meth:`OpSpec.ground_truth`)
and how to make example inputs for a shape, dtype and device (:meth:`OpSpec.example`, each input
made by name from :data:`INPUTS`). The suite's harness, ``bench`` and ``tune`` read both.

An option with a ``feature`` is optional for backends: only backends that declare the feature in
``Backend(features=...)`` receive it, and a call that uses it (a value other than the default)
goes only to them. Options without a feature reach every backend of the op.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import sampler as sampler_fields
from . import validation as v
from .dtypes import result_dtype

_UNSET: Any = object()
_NO_FEATURES: frozenset = frozenset()


class TokenStats(NamedTuple):
    """Every statistic of a position from one pass over the vocabulary (:func:`logprob_registry.token_stats`);
    a field not asked for is None. Float fields are float32 (float64 for float64 inputs) of the
    positions' shape (the labels' for the label fields); ``is_argmax`` is bool."""

    logprobs: Any = None      # log p(label) of the processed distribution
    entropy: Any = None       # entropy of the processed distribution
    raw_logprobs: Any = None  # log p(label) before truncation (logit_scale, softcap, temperature applied)
    raw_entropy: Any = None   # entropy before truncation
    log_sum_p2: Any = None    # log sum_v p_v ** 2 of the processed distribution
    mean_logit: Any = None    # mean over the vocabulary of z = softcap(logit_scale * x) / temperature
    max_logit: Any = None     # max over the vocabulary of z
    is_argmax: Any = None     # the label is torch.argmax of the processed logits (first maximum wins)


#: The statistics that need labels.
LABEL_STATS = frozenset({"logprobs", "raw_logprobs", "is_argmax"})
#: The statistics with a gradient (the op table's differentiable outputs of ``token_stats``).
DIFFERENTIABLE_STATS = frozenset({"logprobs", "entropy", "raw_logprobs", "raw_entropy"})


def stats_asked(want: Iterable[str]) -> Tuple[bool, bool]:
    """Whether a ``token_stats`` call asking the fields ``want`` needs the log-probabilities and
    the entropy (the field or its raw twin)."""
    want = frozenset(want)
    return bool(want & {"logprobs", "raw_logprobs"}), bool(want & {"entropy", "raw_entropy"})


def stats_gradients(grads: Union[Sequence[Any], Mapping[str, Any]]) -> Tuple[Any, Any]:
    """``token_stats``' upstream gradients, one per field in :class:`TokenStats`' order or by field
    name (None where none), as the gradients of the log-probabilities and of the entropy of a call
    without truncation, whose raw fields are the processed ones: each field's and its raw twin's added."""
    named = grads if isinstance(grads, Mapping) else dict(zip(TokenStats._fields, grads))

    def total(a, b):
        return b if a is None else a if b is None else a + b

    return total(named.get("logprobs"), named.get("raw_logprobs")), total(named.get("entropy"),
                                                                          named.get("raw_entropy"))


def asked_stats(fields: Mapping[str, Any], want: Iterable[str]) -> Dict[str, Any]:
    """The fields of ``want`` from ``fields`` (the processed ones, and any others computed), a raw
    twin asked for being a copy of its processed field (without truncation they are the same)."""
    want = frozenset(want)
    out = {k: v for k, v in fields.items() if k in want and v is not None}
    for raw, twin in (("raw_logprobs", "logprobs"), ("raw_entropy", "entropy")):
        if raw in want and fields.get(twin) is not None and fields.get(raw) is None:
            out[raw] = fields[twin] if twin not in want else fields[twin].clone()
    return out


def fixed_stats(outs: Sequence[Any]) -> list:
    """The fields given (``outs`` in :class:`TokenStats`' order) that have no gradient, for an
    autograd Function's ``ctx.mark_non_differentiable``."""
    return [o for name, o in zip(TokenStats._fields, outs) if o is not None and name not in DIFFERENTIABLE_STATS]


_REFERENCES: Dict[str, Callable[..., Any]] = {}  # a reference= name -> its function in reference.py


def check_stat_names(value: Any, context: "Context") -> Tuple[str, ...]:
    """``outputs`` of ``token_stats``: names of :class:`TokenStats` fields, at least one; returned in
    the fields' order, without repeats. Those that need labels need labels."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list, set, frozenset)) or not names or \
            not all(isinstance(n, str) for n in names):
        raise TypeError(f"outputs must be a non-empty tuple of names among {', '.join(TokenStats._fields)}, "
                        f"got {value!r}")
    unknown = [n for n in names if n not in TokenStats._fields]
    if unknown:
        raise ValueError(f"outputs names {', '.join(map(repr, unknown))}, which token_stats does not compute; "
                         f"the outputs are {', '.join(TokenStats._fields)}")
    chosen = tuple(n for n in TokenStats._fields if n in names)
    needing = [n for n in chosen if n in LABEL_STATS]
    if needing and not context.labels:
        raise ValueError(f"outputs {', '.join(map(repr, needing))} need labels: pass labels (the token ids of the "
                         "positions), or leave those outputs out")
    return chosen


class Context(NamedTuple):
    """What an option's check sees of the call (:func:`logprob_registry.call.validate`): the logits'
    shape ``(..., V)`` (formed from hidden states and a weight where the op takes them), the
    vocabulary size (None with ``process_group=``: a shard's, checked once the whole is known), the
    inputs' device and whether the call is vocabulary-parallel."""

    shape: Tuple[int, ...]
    vocab: Optional[int]
    device: Any
    sharded: bool
    labels: bool = False  # whether the call has labels
    options: Mapping[str, Any] = {}  # the call's options, those before this one in the table already checked


@dataclass(frozen=True)
class Option:
    """One keyword option of an op, as a backend receives it.

    ``check(value, context) -> value`` validates the caller's value (raising the error that says
    what is wrong) and returns what backends receive; None: passed as given. ``placed`` says how a
    DTensor argument of this name is placed: ``"rows"`` like the positions (``mask``), ``"vocab"``
    like the vocabulary (a ``bias`` or an lm_head weight); ``""``: it may not be a DTensor."""

    name: str
    default: Any
    doc: str
    feature: Optional[str] = None  # None: every backend receives it
    check: Optional[Callable[[Any, Context], Any]] = field(default=None, compare=False, repr=False)
    placed: str = ""

    def used(self, value: Any) -> bool:
        """Whether ``value`` differs from the default (so the call needs the feature)."""
        return not (value is self.default or (self.default is not None and value == self.default))


class Output(NamedTuple):
    """One output of a public op: its name; its shape (``"labels"``: the labels' shape, the
    positions' for an op without labels; ``"positions"``: the logits' leading dims ``(...)``;
    ``"k"``: ``(..., k)`` for the option ``k``); its dtype (``"result"``: float32, float64 for
    float64 inputs; ``"int64"``; ``"bool"``); whether it is differentiable; and which accuracy
    rule of :mod:`logprob_registry.numerics` judges it (``"logprobs"``, ``"entropy"``; ``""``: compared
    exactly)."""

    name: str
    shape: str = "labels"
    dtype: str = "result"
    differentiable: bool = True
    judged_as: str = "logprobs"

    def shape_for(self, on: Any, labels: Any, options: Mapping[str, Any]) -> Tuple[int, ...]:
        """Its shape for the input ``on`` (``(..., V)`` or ``(..., H)``), ``labels`` (or None) and the options."""
        lead = tuple(on.shape[:-1])
        if self.shape == "labels" and labels is not None:
            return tuple(labels.shape)
        if self.shape == "k":
            return lead + (int(options["k"]),)
        return lead

    def dtype_for(self, on_dtype: torch.dtype) -> torch.dtype:
        return {"int64": torch.int64, "bool": torch.bool}.get(self.dtype) or result_dtype(on_dtype)


#: How an op's inputs are given, and so validated (:data:`logprob_registry.call.FORMS`): ``logits``
#: (..., V); ``hidden`` states (..., H) with an lm_head ``weight`` (V, H) (and ``bias``), whose logits
#: are never formed; ``sides``: a student and a teacher, each logits or hidden states with its weight;
#: ``either``: logits, or hidden states when the option ``weight`` is given.
FORMS = ("logits", "hidden", "sides", "either")


class InputKind(NamedTuple):
    """How an example of one input (by its name in the op table) is made (:meth:`OpSpec.example`)."""

    dims: str      # its shape: "..." the positions (the logits' leading dims), V the vocabulary, H the hidden size
    integer: bool  # int64 ids in [0, V), not a float tensor of the example's dtype
    doc: str

    @property
    def per_token(self) -> bool:
        """Whether it has one entry per position (its leading dims are the logits')."""
        return self.dims.startswith("...")

    def shape(self, lead: Sequence[int], vocab: int, hidden_size: int = 0) -> Tuple[int, ...]:
        """Its shape for positions ``lead`` (the logits' leading dims), a vocabulary of ``vocab`` and a
        hidden size ``hidden_size``."""
        rest = self.dims[3:] if self.per_token else self.dims
        size = dict(V=vocab, H=hidden_size)
        return (tuple(lead) if self.per_token else ()) + tuple(size[d] for d in rest)


#: The inputs an example can be made of. Logits are standard normal times :data:`LOGITS_SCALE` (a
#: peaked softmax, as a trained model's); the weight is scaled so that ``hidden @ weight.T`` is too.
INPUTS: Mapping[str, InputKind] = {
    "logits": InputKind("...V", False, "standard normal, scaled by 3 so that the softmax is peaked as a model's is"),
    "labels": InputKind("...", True, "uniform over the vocabulary"),
    "hidden": InputKind("...H", False, "standard normal"),
    "weight": InputKind("VH", False, "normal, scaled by 3/sqrt(H) so that the logits are like the logits ops' inputs"),
    "student": InputKind("...V", False, "as logits (kl_divergence's student)"),
    "teacher": InputKind("...V", False, "as logits (kl_divergence's teacher), drawn after the student"),
}
LOGITS_SCALE = 3.0
DEFAULT_HIDDEN_SIZE = 64


def input_scale(name: str, shape: Sequence[int]) -> float:
    """The factor of input ``name``'s standard normal values (see :data:`INPUTS`)."""
    if name in ("logits", "student", "teacher"):
        return LOGITS_SCALE
    if name == "weight":
        return LOGITS_SCALE / math.sqrt(max(shape[-1], 1))
    return 1.0


def make_input(name: str, shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator, vocab: int = 0,
               scale: Optional[float] = None) -> torch.Tensor:
    """One example input ``name`` of ``shape``, on the CPU, from ``generator``: ids uniform in
    ``[0, vocab)`` (int64; ``dtype`` is ignored), or float values drawn in ``dtype``'s result dtype
    (float32, float64 for float64), times ``scale`` (default: :func:`input_scale`), then rounded to
    ``dtype``; so every device sees the same numbers, and every half-precision dtype the same ones
    rounded."""
    shape = tuple(shape)
    if INPUTS[name].integer:
        return torch.randint(0, max(vocab, 1), shape, generator=generator)
    factor = input_scale(name, shape) if scale is None else scale
    work, n = result_dtype(dtype), math.prod(shape)
    if work == dtype or n <= _DRAW_BLOCK:
        x = torch.randn(shape, generator=generator, dtype=work)
        return (x.mul_(factor) if factor != 1.0 else x).to(dtype)
    # A large half-precision input (bench's presets): drawn block by block, so that no float32 copy
    # of the whole exists.
    out = torch.empty(n, dtype=dtype)
    for start in range(0, n, _DRAW_BLOCK):
        block = torch.randn(min(_DRAW_BLOCK, n - start), generator=generator, dtype=work)
        out[start:start + block.numel()] = block.mul_(factor) if factor != 1.0 else block
    return out.view(shape)


_DRAW_BLOCK = 1 << 24


class Example(NamedTuple):
    """Example inputs of an op (:meth:`OpSpec.example`): ``spec.public()(*example.args,
    **example.options)`` calls it, ``spec.ground_truth(*example.args, **example.options)`` is its
    float64 reference."""

    inputs: Dict[str, torch.Tensor]  # by name, in the op's order
    options: Dict[str, Any]          # keyword options: those asked for, and any the public function requires

    @property
    def args(self) -> Tuple[torch.Tensor, ...]:
        return tuple(self.inputs.values())


def examples_by_name(spec: "OpSpec", shape: Sequence[int], dtype: torch.dtype, device: Any, requires_grad: bool,
                     seed: int, hidden_size: Optional[int], options: Mapping[str, Any]) -> Example:
    """The example maker of an op whose every input is in :data:`INPUTS`: each made by
    :func:`make_input` from one generator seeded with ``seed``, in the op's input order, on the CPU,
    then moved to ``device``; with ``requires_grad``, the float inputs among ``spec.grad_inputs``
    require gradients (leaves on ``device``). The options are those given, and the op table's default
    of each option the public function requires (``topk_logprobs``' ``k``)."""
    lead, vocab = tuple(shape[:-1]), int(shape[-1])
    h = DEFAULT_HIDDEN_SIZE if hidden_size is None else int(hidden_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs = {}
    for name in spec.inputs:
        kind = INPUTS[name]
        x = make_input(name, kind.shape(lead, vocab, h), dtype, gen, vocab).to(device)
        if requires_grad and not kind.integer and name in spec.grad_inputs:
            x.requires_grad_(True)
        inputs[name] = x
    given = dict(options)
    if spec.function is not None:  # options the public function requires (topk_logprobs' k): their defaults
        for name, p in inspect.signature(spec.public()).parameters.items():
            if p.default is p.empty and name in spec.option_index and name not in given:
                given[name] = spec.option_index[name].default
    return Example(inputs, given)


def kl_examples(spec: "OpSpec", shape: Sequence[int], dtype: torch.dtype, device: Any, requires_grad: bool,
                seed: int, hidden_size: Optional[int], options: Mapping[str, Any]) -> Example:
    """The example maker of ``kl_divergence``: without ``hidden_size``, student and teacher logits
    (:func:`examples_by_name`); with it, both sides as hidden states ``(..., H)`` with their own
    weights ``(V, H)`` (the options ``student_weight`` and ``teacher_weight``), drawn in the order
    student, student_weight, teacher, teacher_weight from one generator seeded with ``seed``, as
    :data:`INPUTS`' ``hidden`` and ``weight`` are; with ``requires_grad`` the student and its weight
    require gradients (the teacher is a detached target)."""
    if hidden_size is None:
        return examples_by_name(spec, shape, dtype, device, requires_grad, seed, hidden_size, options)
    lead, vocab, h = tuple(shape[:-1]), int(shape[-1]), int(hidden_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    made = {}
    for side in ("student", "teacher"):
        made[side] = make_input("hidden", INPUTS["hidden"].shape(lead, vocab, h), dtype, gen).to(device)
        made[f"{side}_weight"] = make_input("weight", INPUTS["weight"].shape(lead, vocab, h), dtype, gen).to(device)
    if requires_grad:
        for name in ("student", "student_weight"):
            made[name].requires_grad_(True)
    given = dict(options, student_weight=made.pop("student_weight"), teacher_weight=made.pop("teacher_weight"))
    return Example(made, given)


def stats_examples(spec: "OpSpec", shape: Sequence[int], dtype: torch.dtype, device: Any, requires_grad: bool,
                   seed: int, hidden_size: Optional[int], options: Mapping[str, Any]) -> Example:
    """The example maker of ``token_stats``: logits and labels as the logits ops' (every output asked
    for unless ``outputs`` is given); with ``hidden_size``, hidden states and labels with the options
    ``weight`` (and no bias), drawn as ``logprobs_from_hidden``'s."""
    given = dict(options)
    given.setdefault("outputs", TokenStats._fields)
    lead, vocab = tuple(shape[:-1]), int(shape[-1])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if hidden_size is None:
        x = make_input("logits", INPUTS["logits"].shape(lead, vocab), dtype, gen).to(device)
    else:
        x = make_input("hidden", INPUTS["hidden"].shape(lead, vocab, hidden_size), dtype, gen).to(device)
        given["weight"] = make_input("weight", INPUTS["weight"].shape(lead, vocab, hidden_size), dtype, gen).to(device)
    labels = make_input("labels", lead, dtype, gen, vocab).to(device)
    if requires_grad:
        x.requires_grad_(True)
        if given.get("weight") is not None:
            given["weight"].requires_grad_(True)
    return Example({"inputs": x, "labels": labels}, given)


class MemoryPromise(NamedTuple):
    """What an op promises of the memory a call adds (:attr:`OpSpec.memory`), by which selection
    passes a backend over (docs/tuning.md, "Memory is part of best"): as the rows grow, the call's
    extra peak memory beyond the gradients it returns grows by at most ``share`` times the float32
    ``(N, V)`` logits (a fixed workspace, however large, is allowed: only what grows with the rows
    counts). A backend declaring ``copies_logits`` breaks it; ``logprob-registry tune`` measures it."""

    name: str     # in a sentence: "never the (N, V) logits"
    share: float  # the growth allowed, as a fraction of the float32 logits' growth
    doc: str
    from_vocab: int = 0  # it holds for vocabulary buckets from this size (buckets, never rows)

    def judge(self, memory: Mapping[str, float], vocab: int) -> Tuple[Optional[bool], float, str]:
        """Whether extra peaks measured beyond the gradients (``{rows: bytes}``, at least two row
        counts; :data:`MEMORY_NOISE` forgiven) keep it at a vocabulary of ``vocab``: ``(keeps, the
        growth as a fraction of the float32 logits' growth, the sentence saying what was measured)``;
        ``(None, nan, ...)`` when fewer than two row counts were measured."""
        points = sorted((int(r), float(b)) for r, b in memory.items())
        if len(points) < 2 or not vocab or points[0][0] == points[-1][0]:
            return None, math.nan, "not measured at two row counts"
        (r0, m0), (r1, m1) = points[0], points[-1]
        ratio = max(m1 - m0 - MEMORY_NOISE, 0.0) / ((r1 - r0) * vocab * 4.0)
        return ratio <= self.share, ratio, (
            f"measured from {r0} to {r1} rows at V={vocab}, its extra peak beyond the gradients grew by "
            f"{ratio:.2f}x the float32 logits' growth (the promise allows {self.share:g}x)")


#: Growth of a measured extra peak forgiven before :meth:`MemoryPromise.judge` compares it: a
#: workspace that grows with the rows up to a cap (compiled's tile of the fused op: 16 MiB on the
#: CPU, 32 MiB on a GPU), and the granularity of a reading.
MEMORY_NOISE = 32 << 20

#: The promise of an op given hidden states and a weight: its point is never forming the logits.
NO_LOGITS = MemoryPromise(
    "never the (N, V) logits", 0.1,
    "never forms the (N, V) logits: its extra peak memory beyond the gradients it returns grows by at most "
    "0.1x the float32 logits as the rows grow")
#: The promises of an op that takes logits, or hidden states with a weight, by the inputs given: given
#: logits (which the caller holds), none; a backend copying them says so (``copies_logits``, in
#: ``explain``) and runs where it is the best.
BOTH_PROMISES = {"hidden": NO_LOGITS}


@dataclass(frozen=True)
class OpSpec:
    """One op: ``backend.ops[name](*inputs, **options)`` returns ``outputs``."""

    name: str
    function: Optional[str]    # the public function that dispatches to it (None: an op the core calls itself)
    inputs: Tuple[str, ...]    # positional tensors, in order
    options: Tuple[Option, ...]
    outputs: Tuple[Union[str, Output], ...]  # what it returns: one tensor, or a tuple of these (names once made)
    doc: str
    dtype_input: str           # the input whose device and dtype select the backend
    grad_inputs: Tuple[str, ...]  # inputs (or tensor options) whose requires_grad asks for a backward
    tuple_when: Optional[str] = None  # a boolean option that makes it return all of ``outputs``
    selected_by: Optional[str] = None  # an option naming the outputs a call returns (token_stats' outputs)
    returns: Optional[type] = None  # a NamedTuple of every output, returned instead of a tuple (TokenStats)
    optional_inputs: Tuple[str, ...] = ()  # inputs that may be None (token_stats' labels)
    # The float64 ground truth: the name of a function of logprob_registry.reference, called
    # ``(*inputs, dtype=..., **options)`` (named, so that this table imports no formulas); None: none.
    reference: Union[str, Callable[..., Any], None] = None
    # How to make example inputs (see :meth:`example`); None: the op has none (the shard ops).
    examples: Optional[Callable[..., Example]] = None
    # How its inputs are given (one of FORMS); None: "hidden" with a hidden input, "sides" with a
    # student, else "logits".
    form: Optional[str] = None
    # Its memory promise by the inputs given: "logits" for calls given logits, "hidden" for calls
    # given hidden states (MemoryPromise; selection keeps it, see promise()); empty: none.
    memory: Mapping[str, MemoryPromise] = field(default_factory=dict, compare=False)
    results: Tuple[Output, ...] = field(init=False, repr=False, compare=False)
    option_index: Dict[str, Option] = field(init=False, repr=False, compare=False)
    _featured: Tuple[Option, ...] = field(init=False, repr=False, compare=False)
    _names: Dict[frozenset, Tuple[Tuple[str, ...], Optional[frozenset]]] = field(init=False, repr=False,
                                                                                compare=False)

    def __post_init__(self) -> None:
        results = tuple(o if isinstance(o, Output) else Output(o) for o in self.outputs)
        object.__setattr__(self, "results", results)
        object.__setattr__(self, "outputs", tuple(o.name for o in results))
        if self.form is None:
            form = "hidden" if "hidden" in self.inputs else "sides" if "student" in self.inputs else "logits"
            object.__setattr__(self, "form", form)
        if self.form not in FORMS:
            raise ValueError(f"op {self.name!r}: form must be one of {', '.join(FORMS)}, got {self.form!r}")
        object.__setattr__(self, "option_index", {o.name: o for o in self.options})
        object.__setattr__(self, "_featured", tuple(o for o in self.options if o.feature is not None))
        object.__setattr__(self, "_names", {})  # backend features -> (the option names it receives, as a set if all)

    def output_names(self, options: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
        """The outputs a call returns (``logprobs_from_hidden`` returns the entropy only when
        ``return_entropy=True``; ``token_stats`` those its ``outputs`` option names)."""
        if self.tuple_when is not None and not (options or {}).get(self.tuple_when, False):
            return self.outputs[:1]
        if self.selected_by is not None:
            chosen = (options or {}).get(self.selected_by, self.option_index[self.selected_by].default)
            return tuple(n for n in self.outputs if n in chosen)
        return self.outputs

    def pack(self, named: Mapping[str, Any]) -> Any:
        """What the public function returns, from its outputs by name: one tensor, a tuple, or the
        op's ``returns`` record (a NamedTuple whose fields not computed are None)."""
        if self.returns is not None:
            return self.returns(**{n: named.get(n) for n in self.returns._fields})
        values = tuple(named.values())
        return values if len(values) > 1 else values[0]

    def unpack(self, result: Any, options: Optional[Mapping[str, Any]] = None) -> Tuple[Any, ...]:
        """The outputs of a result the public function returns (or of a dict of them by name, as a
        reference may return them), in :meth:`output_names` order."""
        if isinstance(result, Mapping):
            return tuple(result[n] for n in self.output_names(options))
        if self.returns is not None:
            return tuple(getattr(result, n) for n in self.output_names(options))
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    def result(self, name: str) -> Output:
        """The output called ``name``."""
        return self.results[self.outputs.index(name)]

    @property
    def keyed_by_hidden(self) -> bool:
        """Whether its selection key holds a hidden-size bucket (a public op that may take hidden
        states: its work per row grows with V x H)."""
        return self.function is not None and self.form != "logits"

    @property
    def always_hidden(self) -> bool:
        """Whether its inputs are always hidden states with a weight (then a key without a hidden
        size does not bound its work)."""
        return self.function is not None and self.form == "hidden"

    def given(self, hidden: int = 0, features: frozenset = _NO_FEATURES) -> str:
        """``"hidden"`` for a call of a key's ``hidden`` bucket and ``features`` given hidden states
        (an op always given them, a hidden bucket, ``stats_hidden`` or ``kl_hidden`` among the
        features), else ``"logits"``: the kinds of inputs that ``memory`` and a backend's
        ``min_size`` may tell apart."""
        hidden_given = self.form == "hidden" or hidden or "stats_hidden" in features or "kl_hidden" in features
        return "hidden" if hidden_given else "logits"

    def promise(self, hidden: int = 0, features: frozenset = _NO_FEATURES,
                lowest_vocab: Optional[int] = None) -> Optional[MemoryPromise]:
        """The memory promise of a call of a key's ``hidden`` bucket and ``features`` whose
        vocabulary bucket starts at ``lowest_vocab`` (None: not known): the promise for hidden states
        for an op always given them, or given them here (a hidden bucket, or ``kl_hidden`` among the
        features); else the one for logits; None if the op makes none there (``from_vocab``)."""
        promise = self.memory.get(self.given(hidden, features))
        if promise is not None and lowest_vocab is not None and lowest_vocab < promise.from_vocab:
            return None
        return promise

    @functools.cached_property
    def placed(self) -> Tuple[str, ...]:
        """The arguments that may be DTensors: its inputs and the options with a placement (asked
        on every call once DTensor is imported: made once)."""
        return self.inputs + tuple(o.name for o in self.options if o.placed)

    @property
    def row_args(self) -> Tuple[str, ...]:
        """The arguments that hold one entry per position (then perhaps K ids): placed like the rows."""
        return tuple(n for n in self.inputs if n in INPUTS and INPUTS[n].dims == "...") + \
            tuple(o.name for o in self.options if o.placed == "rows")

    def options_of(self, given: Mapping[str, Any]) -> Dict[str, Any]:
        """The entries of ``given`` that are options of this op (``ignore_index`` is not the entropy's)."""
        return {k: v for k, v in given.items() if k in self.option_index}

    def reference_function(self) -> Callable[..., Any]:
        """The function of :mod:`logprob_registry.reference` computing this op's ground truth (or
        the function itself, for an op registered at run time)."""
        if self.reference is None:
            raise ValueError(f"op {self.name!r} has no reference in the op table")
        if callable(self.reference):
            return self.reference
        found = _REFERENCES.get(self.reference)
        if found is None:  # imported here, once: the reference module imports the op table's neighbours
            from . import reference

            found = _REFERENCES[self.reference] = getattr(reference, self.reference)
        return found

    def ground_truth(self, *inputs: Any, dtype: torch.dtype = torch.float64, **options: Any) -> Tuple[Any, ...]:
        """What the op returns for ``inputs`` and ``options``, by the textbook formulas in ``dtype``
        (float64: the ground truth the suite, ``bench`` and ``tune`` compare with), computed where the
        inputs are (autograd flows through them); always a tuple, one entry per output the call
        returns (:meth:`output_names`). Options not given take their defaults; those that say how, not
        what (``inplace_backward``) are ignored; one the op does not take raises TypeError."""
        unknown = [k for k in options if k not in self.option_index]
        if unknown:
            raise TypeError(f"op {self.name!r} takes no option {', '.join(map(repr, unknown))}")
        if len(inputs) != len(self.inputs):
            raise TypeError(f"op {self.name!r} takes {len(self.inputs)} inputs ({', '.join(self.inputs)}), "
                            f"got {len(inputs)}")
        function = self.reference_function()
        accepted = _parameters(function)
        kwargs = {o.name: options.get(o.name, o.default) for o in self.options if o.name in accepted}
        out = self.unpack(function(*inputs, dtype=dtype, **kwargs), options)
        assert len(out) == len(self.output_names(options)), (self.name, len(out))
        return out

    def example(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
                device: Union[str, torch.device] = "cpu", requires_grad: bool = False, seed: int = 0,
                hidden_size: Optional[int] = None, **options: Any) -> Example:
        """Example inputs of this op: ``shape`` is that of the logits it reduces ``(..., V)`` (given,
        or formed from hidden states ``(..., H)`` of ``hidden_size`` and a weight ``(V, H)``), inputs
        of ``dtype`` on ``device`` (labels int64), the same numbers for a ``seed`` everywhere; with
        ``requires_grad`` the differentiable inputs require gradients. ``options`` are checked and
        passed along. A ValueError for an op without an example maker (the shard ops)."""
        if self.examples is None:
            raise ValueError(f"op {self.name!r} has no example inputs in the op table")
        unknown = [k for k in options if k not in self.option_index]
        if unknown:
            raise TypeError(f"op {self.name!r} takes no option {', '.join(map(repr, unknown))}")
        return self.examples(self, tuple(shape), dtype, device, requires_grad, seed, hidden_size, options)

    def features_used(self, options: Mapping[str, Any]) -> frozenset:
        """The backend features a call with these option values needs (validation has already
        made every option that changes nothing equal to its default)."""
        used = [o.feature for o in self._featured if o.used(options.get(o.name, o.default))]
        return frozenset(used) if used else _NO_FEATURES

    def backend_options(self, features: frozenset, options: Mapping[str, Any]) -> Mapping[str, Any]:
        """The keyword options a backend declaring ``features`` receives (to pass as ``**``; not to
        modify: a backend that receives every option gets ``options`` itself, a validated call's
        dict holding exactly the op's options, with no copy)."""
        found = self._names.get(features)
        if found is None:
            names = tuple(o.name for o in self.options if o.feature is None or o.feature in features)
            found = self._names[features] = (names, frozenset(names) if len(names) == len(self.options) else None)
        names, every = found
        if every is not None and options.keys() == every:
            return options  # type: ignore[return-value]
        return {name: options.get(name, self.option_index[name].default) for name in names}

    def signature(self) -> str:
        """The call as a backend receives it without optional features, e.g.
        ``logprobs(logits, labels, *, temperature, ignore_index, inplace_backward) -> logprobs``;
        each feature a backend declares adds its option(s) as keywords."""
        opts = ", ".join(o.name for o in self.options if o.feature is None)
        outs = self.outputs[0] if len(self.outputs) == 1 else "(" + ", ".join(self.outputs) + ")"
        if self.tuple_when:
            outs = f"{self.outputs[0]}, or ({', '.join(self.outputs)}) when {self.tuple_when}=True"
        if self.returns is not None:
            outs = f"{self.returns.__name__}({', '.join(self.outputs)}), those named in {self.selected_by}"
        return f"{self.name}({', '.join(self.inputs)}, *, {opts}) -> {outs}"

    def public(self) -> Callable[..., Any]:
        """The public function of :mod:`logprob_registry` for this op (:data:`FUNCTIONS`)."""
        if self.function is None:
            raise ValueError(f"op {self.name!r} has no public function: the distributed core calls it for "
                             "calls with process_group= (see logprob_registry.distributed)")
        try:
            return FUNCTIONS[self.name]
        except KeyError:
            raise ValueError(f"op {self.name!r} names the public function {self.function!r}, which is not "
                             "defined: logprob_registry.ops defines the built-in ones; register(spec, function) "
                             "gives an added op its own") from None


_PARAMETERS: Dict[Callable[..., Any], frozenset] = {}


def _parameters(function: Callable[..., Any]) -> frozenset:
    names = _PARAMETERS.get(function)
    if names is None:
        names = _PARAMETERS[function] = frozenset(inspect.signature(function).parameters)
    return names


def _flag(name: str) -> Callable[[Any, Context], bool]:
    return lambda value, context: v.check_flag(value, name)


_TEMPERATURE = Option("temperature", 1.0, "float > 0: the (softcapped) logits are divided by it")
_IGNORE_INDEX = Option("ignore_index", None,
                       "int or None: positions whose label equals it give 0 and a zero gradient",
                       check=lambda value, context: v.check_ignore_index(value))
_INPLACE = Option("inplace_backward", False, "bool: backward may write the logits' gradient over the logits' storage",
                  check=_flag("inplace_backward"))
# The sampler's keywords (logprob_registry.sampler.FIELDS, in the sampler's order), each an option
# that only backends declaring the feature of the same name receive.
_SAMPLER = tuple(Option(f.name, None, f.doc, feature=f.name) for f in sampler_fields.FIELDS) + (
    Option("sampler", None, 'None (vLLM V1\'s order, the public "vllm"), "hf" (transformers\' generate warpers) or '
           '"sglang": whose processing order and tie/threshold rules top_k, top_p and min_p follow (docs/sampler.md)',
           feature="sampler"),)
#: The public ops' temperature: a number, or per row (a tensor needs the feature "per_row").
_TEMPERATURE_ROWS = Option("temperature", 1.0, "float > 0, or per row a float32 tensor expanded to the positions' "
                           "shape (...) (feature per_row): the (softcapped) logits are divided by it",
                           check=lambda value, c: sampler_fields.check_temperature(value, c.shape, c.device))
_LABELS = ("labels (...) int32/int64 give (...); labels (..., K) give the K candidates' logprobs "
           "(..., K) in one pass (feature 'candidates')")
# The vocabulary-parallel ops' options (see logprob_registry.distributed).
_VOCAB_START = Option("vocab_start", 0, "int: global id of the shard's first column (labels are global ids)")
_TILE = Option("tile", 4096, "int: columns per tile of the global grid: tiles start at global multiples of "
                    "tile, so a shard's first tile holds its first tile - vocab_start % tile columns (or all of "
                    "them) and its last may be shorter (n_tiles = ceil((vocab_start % tile + V_local) / tile))")
_REFERENCE = Option("reference", None, "(...) float or None: measure every tile against max(tile_max, reference) "
                    "(the core's recompute of a piece of a grid tile two shards share, against the whole tile's "
                    "max; tile_max is then that)")
_ENTROPY = Option("with_entropy", False, "bool: also return tile_elog (for the entropy)")
_STATS = ("tile_max", "tile_sumexp", "tile_elog", "label_logits")
_STATS_DOC = ("per row and grid tile of z = logits / temperature (in float32, float64 for float64 input): "
              "tile_max = max z, tile_sumexp = sum e, tile_elog = sum e * log e (0 where z is -inf; None "
              "unless with_entropy=True) with e = exp(z - tile_max), all of shape (..., n_tiles), the sums "
              "float64 and exact (logprob_registry.kit.exact_sum: each term rounded to a multiple of 2**-36, "
              "added without rounding); label_logits "
              "(...) = z at column labels - vocab_start where the shard holds the label and it is not "
              "ignore_index, else 0 (None when labels is None). A tile's statistics must depend on its own "
              "columns only (bitwise, for backends declaring group_invariant: then the pieces of a tile "
              "two shards share add up to the whole tile's)")
#: shard_token_stats: shard_stats' outputs, two more exact sums per tile and the shard's first maximum.
_TOKEN_STATS = _STATS[:3] + ("tile_sumsq", "tile_zsum") + _STATS[3:] + ("row_max", "row_argmax")
_TOKEN_STATS_DOC = ("per row and grid tile tile_sumsq = sum e**2 (exact, as tile_sumexp; against the reference "
                    "too) and tile_zsum = sum z (exact at multiples of 2**-kit.CROSS_BITS; -inf with a -inf z), "
                    "(..., n_tiles) float64 each; and per row of the shard row_max = max z (...) and row_argmax "
                    "(...) int64, the global id of its first maximum (NaN counts as the largest, as torch.argmax "
                    "has it); with shard_sampler, over the kept tokens")
_KL_SIDES = (Option("student_weight", None, "(V_local, H_s) or None: the student is hidden states (..., H_s)"),
             Option("teacher_weight", None, "(V_local, H_t) or None: the teacher is hidden states (..., H_t)"))
_KL_DIRECTION = Option("direction", "forward", '"forward": KL(teacher || student); "reverse": KL(student || teacher)')
# The sampler's processing on a shard (feature "shard_sampler"; see logprob_registry.processing).
_SHARD_SAMPLER = (
    Option("softcap", None, "float or None: z = softcap * tanh(logits / softcap) / temperature",
           feature="shard_sampler"),
    Option("keep", None, "bool (..., V_local) or None: this shard's columns of the sampler's keep mask",
           feature="shard_sampler"),
    Option("boundary", None, "(t float32 (...), j int64 (...)) or None: keep a token iff (y, id) >= (t, j), y the "
           "float32 processed logits (the boundary the core merged from every shard's top-k); with min_p, "
           "(t, j, big, total, threshold) (float32 (...) each): also drop exp(y - big) / total < threshold; "
           "sampler=\"sglang\": (t, j, big, total, threshold, lower) with lower bool (...): where set, a tie at t "
           "keeps the ids <= j instead",
           feature="shard_sampler"),
)
_SHARD_LOGITS_DTYPE = Option("logits_dtype", None, "torch.bfloat16, torch.float16 or None: each logit rounded to it "
                             "before the softcap (straight-through gradient)", feature="shard_sampler")
_SHARD_SAMPLER_DOC = ("; with feature shard_sampler: labels may be candidates (..., K) (label_logits (..., K), -inf "
                      "where the shard holds a label outside the kept set), z = the processed logits over the kept "
                      "tokens (softcap, keep, boundary; -inf elsewhere)")
_GRADS_DOC = ("lse, entropy: the merged log-sum-exp and entropy of z per row (...); grad_logprobs, "
              "grad_entropy: upstream gradients (...) or None, grad_logprobs already 0 at ignored positions")

_LOGPROBS = Output("logprobs")
_ENTROPY_OUT = Output("entropy", shape="positions", judged_as="entropy")

OPS: Dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec(
        name="logprobs", function="logprobs_from_logits",
        inputs=("logits", "labels"),
        options=(_TEMPERATURE_ROWS, _IGNORE_INDEX, _INPLACE) + _SAMPLER,
        outputs=(_LOGPROBS,),
        doc="log_softmax(processed logits)[..., labels]: logits (..., V); " + _LABELS
            + "; float32 (float64 for float64 logits)",
        dtype_input="logits", grad_inputs=("logits",),
        reference="logprobs", examples=examples_by_name,
    ),
    OpSpec(
        name="entropy", function="entropy_from_logits",
        inputs=("logits",),
        options=(_TEMPERATURE_ROWS,) + _SAMPLER,
        outputs=(_ENTROPY_OUT,),
        doc="entropy of softmax(processed logits) over the last dim: logits (..., V); "
            "float32 (float64 for float64 logits) of shape (...)",
        dtype_input="logits", grad_inputs=("logits",),
        reference="entropy", examples=examples_by_name,
    ),
    OpSpec(
        name="logprobs_and_entropy", function="logprobs_and_entropy",
        inputs=("logits", "labels"),
        options=(_TEMPERATURE_ROWS, _IGNORE_INDEX, _INPLACE) + _SAMPLER,
        outputs=(_LOGPROBS, _ENTROPY_OUT),
        doc="both of the above in one pass; the entropy of an ignored position is computed as usual",
        dtype_input="logits", grad_inputs=("logits",),
        reference="logprobs_and_entropy", examples=examples_by_name,
    ),
    OpSpec(
        name="logprobs_from_hidden", function="logprobs_from_hidden",
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V,) or None, added to hidden @ weight.T", placed="vocab"),
                 _TEMPERATURE_ROWS, _IGNORE_INDEX,
                 Option("return_entropy", False, "bool: also return the entropy", check=_flag("return_entropy")))
                + _SAMPLER + (
                 Option("logits_dtype", None, "torch.bfloat16, torch.float16 or None: round each logit "
                        "to it before the softmax, as an engine whose lm_head runs in it (straight-"
                        "through gradient); None keeps exact fp32 products", feature="logits_dtype",
                        check=lambda value, context: v.check_logits_dtype(value)),),
        outputs=(_LOGPROBS, _ENTROPY_OUT),
        tuple_when="return_entropy",
        doc="logprobs of labels under hidden @ weight.T + bias without forming the (N, V) logits: "
            "hidden (..., H), weight (V, H), one dtype for hidden, weight and bias",
        dtype_input="hidden", grad_inputs=("hidden", "weight", "bias"),
        reference="logprobs_from_hidden", examples=examples_by_name,
        memory={"hidden": NO_LOGITS},
    ),
    OpSpec(
        name="topk_logprobs", function="topk_logprobs",
        inputs=("logits",),
        options=(Option("k", 1, "int >= 1, at most V: how many",
                        check=lambda value, c: v.check_k(value, c.vocab if c.vocab is not None else 1 << 62)),
                 _TEMPERATURE_ROWS) + _SAMPLER,
        outputs=(Output("values", shape="k"), Output("ids", shape="k", dtype="int64", differentiable=False,
                                                      judged_as="")),
        doc="the k largest processed logprobs (float32, (..., k)) and their ids (int64), largest first, "
            "ties by smaller id; -inf (and the smallest ids left) where fewer than k tokens are kept",
        dtype_input="logits", grad_inputs=("logits",),
        reference="topk_logprobs", examples=examples_by_name,
    ),
    OpSpec(
        name="kl_divergence", function="kl_divergence",
        inputs=("student", "teacher"),
        options=(
            Option("direction", "forward", '"forward": KL(teacher || student); "reverse": KL(student || teacher); '
                   '"jsd": the generalized Jensen-Shannon divergence (feature kl_jsd, with beta)',
                   check=lambda value, context: v.check_direction(value)),
            Option("beta", None, "float in (0, 1) with direction=\"jsd\" (else None): beta KL(T || M) + (1 - beta) "
                   "KL(S || M), M = beta T + (1 - beta) S", feature="kl_jsd",
                   check=lambda value, c: v.check_beta(value, c.options["direction"])),
            Option("temperature", 1.0, "float > 0: divides both sides' logits",
                   check=lambda value, context: v.check_one_temperature(value, "kl_divergence")),
            Option("mask", None, "bool (...) or None: positions where it is False give 0 and a zero gradient",
                   check=lambda value, c: v.check_mask(value, c.shape[:-1], c.device), placed="rows"),
            Option("student_weight", None, "(V, H_s) or None: the student is hidden states (..., H_s) whose logits "
                   "student @ student_weight.T are never formed", feature="kl_hidden", placed="vocab"),
            Option("teacher_weight", None, "(V, H_t) or None: the teacher is hidden states (..., H_t), likewise",
                   feature="kl_hidden", placed="vocab"),
            Option("support", None, "int64 ids (..., K), distinct per position, or None: both distributions "
                   "restricted to these K tokens (see tail)", feature="kl_support",
                   check=lambda value, c: v.check_support(value, c.shape[:-1], c.vocab, c.device), placed="rows"),
            Option("tail", True, "bool: with support, one more bucket holding the mass outside the K (its log a "
                   "log-sum-exp over the complement, never log(1 - sum p)); False: renormalised over the K",
                   check=_flag("tail")),
        ),
        outputs=(Output("kl", shape="positions"),),
        doc="KL divergence of the tempered distributions per position: student, teacher logits (..., V) (or "
            "hidden states with their *_weight); float32 (...) (float64 for float64); the gradient reaches the "
            "student (and student_weight) only: the teacher is a detached target",
        dtype_input="student", grad_inputs=("student", "student_weight"),
        reference="kl_divergence", examples=kl_examples,
        memory=BOTH_PROMISES,
    ),
    OpSpec(
        name="token_stats", function="token_stats",
        inputs=("inputs", "labels"), optional_inputs=("labels",), form="either",
        options=(Option("weight", None, "(V, H) or None: inputs are hidden states (..., H) whose logits inputs @ "
                        "weight.T + bias are never formed", placed="vocab"),
                 Option("bias", None, "(V,) or None, with weight", placed="vocab"),
                 Option("outputs", ("logprobs", "entropy"), "tuple of TokenStats field names, in the fields' order",
                        check=check_stat_names),
                 _TEMPERATURE_ROWS, _IGNORE_INDEX) + _SAMPLER,
        outputs=(_LOGPROBS, _ENTROPY_OUT, Output("raw_logprobs"),
                 Output("raw_entropy", shape="positions", judged_as="entropy"),
                 Output("log_sum_p2", shape="positions", differentiable=False),
                 Output("mean_logit", shape="positions", differentiable=False),
                 Output("max_logit", shape="positions", differentiable=False),
                 Output("is_argmax", dtype="bool", differentiable=False, judged_as="")),
        selected_by="outputs", returns=TokenStats,
        doc="every statistic of a position in one pass (TokenStats, the fields not asked None): inputs logits (..., V),"
            " "
            "or hidden states (..., H) with weight (V, H) (and bias); labels (...) or None (needed by logprobs, "
            "raw_logprobs and is_argmax; ignore_index positions give 0 / False there)",
        dtype_input="inputs", grad_inputs=("inputs", "weight", "bias"),
        reference="token_stats", examples=stats_examples,
        memory=BOTH_PROMISES,
    ),
    OpSpec(
        name="shard_stats", function=None,
        inputs=("logits", "labels"),
        options=(_VOCAB_START, _TILE, _TEMPERATURE, _IGNORE_INDEX, _ENTROPY, _REFERENCE) + _SHARD_SAMPLER,
        outputs=_STATS,
        doc="vocabulary-parallel forward on one shard: logits (..., V_local), labels (...) global ids or None; "
            + _STATS_DOC + _SHARD_SAMPLER_DOC,
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="shard_token_stats", function=None,
        inputs=("logits", "labels"),
        options=(_VOCAB_START, _TILE, _TEMPERATURE, _IGNORE_INDEX, _ENTROPY, _REFERENCE) + _SHARD_SAMPLER,
        outputs=_TOKEN_STATS,
        doc="shard_stats (token_stats with process_group=) with, in the same pass, " + _TOKEN_STATS_DOC,
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="shard_grad", function=None,
        inputs=("logits", "labels", "lse", "entropy", "grad_logprobs", "grad_entropy"),
        options=(_VOCAB_START, _TEMPERATURE, _INPLACE) + _SHARD_SAMPLER,
        outputs=("grad_logits",),
        doc="vocabulary-parallel backward on one shard: the gradient of the shard (its shape and dtype), "
            "out of place or, with inplace_backward, over its storage; " + _GRADS_DOC,
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_stats", function=None,
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TILE, _TEMPERATURE,
                 _IGNORE_INDEX, _ENTROPY, _REFERENCE) + _SHARD_SAMPLER + (_SHARD_LOGITS_DTYPE,),
        outputs=_STATS,
        doc="shard_stats of the logits hidden @ weight.T + bias of a weight shard (V_local, H), without "
            "forming them; hidden (..., H)",
        dtype_input="hidden", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_token_stats", function=None,
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TILE, _TEMPERATURE,
                 _IGNORE_INDEX, _ENTROPY, _REFERENCE) + _SHARD_SAMPLER + (_SHARD_LOGITS_DTYPE,),
        outputs=_TOKEN_STATS,
        doc="shard_token_stats of the logits hidden @ weight.T + bias of a weight shard, without forming them",
        dtype_input="hidden", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_grad", function=None,
        inputs=("hidden", "weight", "labels", "lse", "entropy", "grad_logprobs", "grad_entropy"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TILE, _TEMPERATURE,
                 Option("needs_grad", (True, True, False), "(hidden, weight, bias): which gradients to form"))
                + _SHARD_SAMPLER + (_SHARD_LOGITS_DTYPE,),
        outputs=("grad_hidden", "grad_weight", "grad_bias"),
        doc="backward of hidden_shard_stats: this shard's share of the hidden gradient (float32, float64 for "
            "float64; the core sums it over the group), the weight shard's and bias shard's gradients (their "
            "dtypes), None where not needed; " + _GRADS_DOC,
        dtype_input="hidden", grad_inputs=(),
    ),
    OpSpec(
        name="shard_topk", function=None,
        inputs=("logits",),
        options=(_VOCAB_START, _TEMPERATURE, Option("k", 1, "int >= 1: how many (a shard narrower than k pads "
                                                    "with -inf at id 2**63 - 1)"),
                 Option("decision", False, "bool: rank the float32 processed logits y without any mask (the "
                        "truncation decision); False: z over the kept tokens (-inf elsewhere)")) + _SHARD_SAMPLER,
        outputs=("values", "ids"),
        doc="one shard's k largest (values (..., k), global ids int64 (..., k)), largest first, ties by smaller "
            "id: the core merges every shard's list in vocabulary order (feature shard_sampler)",
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_topk", function=None,
        inputs=("hidden", "weight"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TEMPERATURE,
                 Option("k", 1, "int >= 1: how many"), Option("decision", False, "bool: as shard_topk's"))
                + _SHARD_SAMPLER + (_SHARD_LOGITS_DTYPE,),
        outputs=("values", "ids"),
        doc="shard_topk of the logits hidden @ weight.T + bias of a weight shard (V_local, H)",
        dtype_input="hidden", grad_inputs=(),
    ),
    # kl_divergence with process_group= (see logprob_registry.distributed.kl)
    OpSpec(
        name="kl_shard_stats", function=None,
        inputs=("student", "teacher"),
        options=_KL_SIDES + (_VOCAB_START, _TILE, _TEMPERATURE, _KL_DIRECTION,
                             Option("student_reference", None, "(...) or None: as shard_stats' reference, for "
                                    "student_max"),
                             Option("teacher_reference", None, "(...) or None: as shard_stats' reference, for "
                                    "teacher_max")),
        outputs=("student_max", "student_sumexp", "teacher_max", "teacher_sumexp", "cross"),
        doc="kl_divergence's forward on one vocabulary shard of both sides (logits (..., V_local), or hidden "
            "states with their weight shard (V_local, H)): per row and grid tile of zs = student / temperature "
            "and zt = teacher / temperature (float32, float64 for float64), each (..., n_tiles): the max and "
            "sum exp(z - max) of each side, and cross = sum et * (zt - zs) with et = exp(zt - teacher_max) for "
            '"forward", sum es * (zs - zt) with es = exp(zs - student_max) for "reverse" (0 where the weight '
            "is 0); the sums float64 and exact (kit.exact_sum; the cross term's terms at multiples of "
            "2**-kit.CROSS_BITS). A tile's statistics must depend on its own columns only (bitwise, for "
            "backends declaring group_invariant)",
        dtype_input="student", grad_inputs=(),
    ),
    OpSpec(
        name="kl_shard_grad", function=None,
        inputs=("student", "teacher", "lse_student", "lse_teacher", "kl", "grad_kl", "mask"),
        options=_KL_SIDES + (_VOCAB_START, _TILE, _TEMPERATURE, _KL_DIRECTION,
                             Option("needs_grad", (True, False), "(student, student_weight): which gradients")),
        outputs=("grad_student", "grad_student_weight"),
        doc="backward of kl_shard_stats: lse_student, lse_teacher, kl: the merged per-row values (...); "
            "grad_kl (...) the upstream gradient; mask bool (...) or None (False rows: exact zeros). For student "
            "logits, their gradient (shape and dtype of the shard); for student hidden states, this shard's "
            "share of the hidden gradient (float32, float64 for float64; the core sums it over the group) and "
            "the weight shard's gradient (its dtype); None where not needed",
        dtype_input="student", grad_inputs=(),
    ),
)}

#: The ops of the vocabulary-parallel path, called by the core (:mod:`logprob_registry.distributed`).
SHARD_OPS = tuple(name for name, spec in OPS.items() if spec.function is None)


#: The public function of each op, by op name: :mod:`logprob_registry.ops` enters the built-in
#: ones as it defines them (each one line: ``run(op, locals())``), :func:`register` an added op's.
FUNCTIONS: Dict[str, Callable[..., Any]] = {}


def register(spec: OpSpec, function: Optional[Callable[..., Any]] = None) -> None:
    """Add ``spec`` to the op table at run time (an extension's op, or a test's), with its public
    ``function`` (whose body is ``logprob_registry.ops.run(spec.name, locals())``): everything that
    reads the table (validation, selection keys, ``explain``, the custom op under
    ``torch.compile``, the wire codes of ``process_group=``, the suite's generic sections) takes it
    from there. A ValueError if an op of that name exists."""
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} is already in the op table")
    OPS[spec.name] = spec
    if function is not None:
        FUNCTIONS[spec.name] = function


def unregister(name: str) -> None:
    """Remove an op :func:`register` added (the built-in ops stay)."""
    if name in _BUILTIN_OPS:
        raise ValueError(f"op {name!r} is a built-in op of the table; only ops added by register() can go")
    OPS.pop(name, None)
    FUNCTIONS.pop(name, None)


def public_ops() -> Tuple[str, ...]:
    """The ops a public function dispatches to, in table order."""
    return tuple(name for name, spec in OPS.items() if spec.function is not None)


def wire_code(op: str) -> int:
    """The number that stands for a public op in the header of a ``process_group=`` call (every
    rank runs the same table, so the same numbers)."""
    return public_ops().index(op)


def op_of_code(code: int) -> str:
    """The public op of a wire code (``"op #7"`` for a code this table lacks)."""
    ops = public_ops()
    return ops[code] if 0 <= code < len(ops) else f"op #{code}"

_BUILTIN_OPS = frozenset(OPS)

#: Features a backend may declare (``Backend(features=...)``): options it implements, and kinds of
#: call it supports. A call that needs a feature goes only to backends that declare it.
FEATURES: Mapping[str, str] = {
    "functorch": "its ops work inside torch.func transforms (grad, vmap, jacrev, ...): pure "
                 "differentiable torch ops, or autograd Functions with setup_context and vmap rules",
    "candidates": "labels of shape (..., K): the logprobs of K candidate tokens per position in one pass",
    **{o.feature: f"the {o.name} option: {o.doc}" for o in _SAMPLER},
    "per_row": "temperature, top_k, top_p and min_p given per row: tensors expanded to the positions' shape (...) "
               "(temperature, top_p, min_p float32; top_k int64; 0, 1.0 and 0.0 mean off for that row); each row's "
               "result bitwise that of the call with the row's values as numbers",
    "logits_dtype": "logprobs_from_hidden's logits_dtype option: logits rounded to bf16/fp16 before the softmax",
    "stats_hidden": "token_stats given hidden states with their lm_head (the options weight and bias, which every "
                    "backend of the op receives): the logits inputs @ weight.T + bias are never formed",
    "kl_hidden": "kl_divergence with student_weight / teacher_weight: either side as hidden states whose logits "
                 "are never formed",
    "shard_sampler": "the vocabulary-parallel shard ops with the sampler's processing (softcap, keep, boundary, "
                     "logits_dtype, candidate labels) and shard_topk / hidden_shard_topk",
    "kl_jsd": "kl_divergence's direction=\"jsd\" with its beta: the generalized Jensen-Shannon divergence",
    "kl_support": "kl_divergence's support option: both distributions restricted to K ids per position (plus the "
                  "tail bucket with tail=True)",
}
#: The features that truncate the distribution (a label outside the kept set gives -inf).
TRUNCATION = sampler_fields.TRUNCATION


def get(op: str) -> OpSpec:
    """The spec of ``op``, or a ValueError listing the ops."""
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}") from None


def logits_op(logprobs: bool, entropy: bool) -> OpSpec:
    """The public op over logits returning the log-probabilities of labels and/or the entropy, as asked."""
    wanted = tuple(name for name, want in (("logprobs", logprobs), ("entropy", entropy)) if want)
    for spec in OPS.values():
        if spec.function is not None and spec.dtype_input == "logits" and spec.outputs == wanted:
            return spec
    raise ValueError(f"no op over logits returns {wanted or 'nothing'}")


def describe() -> str:
    """Every op's call as a backend receives it, with its options: for docs and ``info``."""
    lines = []
    for spec in OPS.values():
        if spec.function is None:
            continue
        lines.append(spec.signature())
        lines.append(f"    {spec.doc}")
        for o in spec.options:
            only = f" (only to backends declaring feature {o.feature!r})" if o.feature else ""
            lines.append(f"    {o.name}={o.default!r}: {o.doc}{only}")
    return "\n".join(lines)
