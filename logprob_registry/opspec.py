"""The op table: every op a backend can implement, exactly as the backend receives it.

One :class:`OpSpec` per op names its positional inputs, the keyword options that come with them
(with their defaults), and what it returns. Everything that knows about ops reads this table: the
``Backend`` record (which ops exist), the public functions (what a backend is called with), the
conformance suite's harness, ``bench`` and ``info``. Adding an op or a keyword is one entry here
plus its kernels and its conformance tests.

An option with a ``feature`` is optional for backends: only backends that declare the feature in
``Backend(features=...)`` receive it, and a call that uses it (a value other than the default)
goes only to them. Options without a feature reach every backend of the op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

_UNSET: Any = object()
_NO_FEATURES: frozenset = frozenset()


@dataclass(frozen=True)
class Option:
    """One keyword option of an op, as a backend receives it."""

    name: str
    default: Any
    doc: str
    feature: Optional[str] = None  # None: every backend receives it

    def used(self, value: Any) -> bool:
        """Whether ``value`` differs from the default (so the call needs the feature)."""
        return not (value is self.default or (self.default is not None and value == self.default))


@dataclass(frozen=True)
class OpSpec:
    """One op: ``backend.ops[name](*inputs, **options)`` returns ``outputs``."""

    name: str
    function: Optional[str]    # the public function that dispatches to it (None: an op the core calls itself)
    inputs: Tuple[str, ...]    # positional tensors, in order
    options: Tuple[Option, ...]
    outputs: Tuple[str, ...]   # what it returns: one tensor, or a tuple of these
    doc: str
    dtype_input: str           # the input whose device and dtype select the backend
    grad_inputs: Tuple[str, ...]  # inputs (or tensor options) whose requires_grad asks for a backward
    tuple_when: Optional[str] = None  # a boolean option that makes it return all of ``outputs``
    option_index: Dict[str, Option] = field(init=False, repr=False, compare=False)
    _featured: Tuple[Option, ...] = field(init=False, repr=False, compare=False)
    _names: Dict[frozenset, Tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_index", {o.name: o for o in self.options})
        object.__setattr__(self, "_featured", tuple(o for o in self.options if o.feature is not None))
        object.__setattr__(self, "_names", {})  # backend features -> the option names it receives

    def output_names(self, options: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
        """The outputs a call returns (``logprobs_from_hidden`` returns the entropy only when
        ``return_entropy=True``)."""
        if self.tuple_when is not None and not (options or {}).get(self.tuple_when, False):
            return self.outputs[:1]
        return self.outputs

    def features_used(self, options: Mapping[str, Any]) -> frozenset:
        """The backend features a call with these option values needs (validation has already
        made every option that changes nothing equal to its default)."""
        used = [o.feature for o in self._featured if o.used(options.get(o.name, o.default))]
        return frozenset(used) if used else _NO_FEATURES

    def backend_options(self, features: frozenset, options: Mapping[str, Any]) -> Dict[str, Any]:
        """The keyword options a backend declaring ``features`` receives."""
        names = self._names.get(features)
        if names is None:
            names = tuple(o.name for o in self.options if o.feature is None or o.feature in features)
            self._names[features] = names
        return {name: options.get(name, self.option_index[name].default) for name in names}

    def signature(self) -> str:
        """The call as a backend receives it without optional features, e.g.
        ``logprobs(logits, labels, *, temperature, ignore_index, inplace_backward) -> logprobs``;
        each feature a backend declares adds its option(s) as keywords."""
        opts = ", ".join(o.name for o in self.options if o.feature is None)
        outs = self.outputs[0] if len(self.outputs) == 1 else "(" + ", ".join(self.outputs) + ")"
        if self.tuple_when:
            outs = f"{self.outputs[0]}, or ({', '.join(self.outputs)}) when {self.tuple_when}=True"
        return f"{self.name}({', '.join(self.inputs)}, *, {opts}) -> {outs}"

    def public(self) -> Callable[..., Any]:
        """The public function of :mod:`logprob_registry` for this op."""
        import logprob_registry

        if self.function is None:
            raise ValueError(f"op {self.name!r} has no public function: the distributed core calls it for "
                             "calls with process_group= (see logprob_registry.distributed)")

        return getattr(logprob_registry, self.function)


_TEMPERATURE = Option("temperature", 1.0, "float > 0: the (softcapped) logits are divided by it")
_IGNORE_INDEX = Option("ignore_index", None,
                       "int or None: positions whose label equals it give 0 and a zero gradient")
_INPLACE = Option("inplace_backward", False,
                  "bool: backward may write the logits' gradient over the logits' storage")
# The sampler's processing, in its order: softcap, temperature, min_p, top_k, top_p, keep; then the
# log-softmax over the kept tokens (a label outside them gives -inf and a zero gradient).
_SAMPLER = (
    Option("softcap", None, "float > 0 or None: z -> softcap * tanh(z / softcap), before the temperature",
           feature="softcap"),
    Option("top_k", None, "int >= 1 or None: keep the top_k largest logits (every logit equal to the "
                          "k-th largest is kept)", feature="top_k"),
    Option("top_p", None, "float in (0, 1) or None: keep the most probable tokens whose mass reaches "
                          "top_p (computed after top_k; at least one token)", feature="top_p"),
    Option("min_p", None, "float in (0, 1] or None: drop tokens less probable than min_p times the "
                          "most probable one", feature="min_p"),
    Option("keep", None, "bool (..., V) or int64 ids (..., K) (-1 for none), or None: only these tokens "
                         "(the sampler's own mask)", feature="keep"),
)
_LABELS = ("labels (...) int32/int64 give (...); labels (..., K) give the K candidates' logprobs "
           "(..., K) in one pass (feature 'candidates')")
# The vocabulary-parallel ops' options (see logprob_registry.distributed).
_VOCAB_START = Option("vocab_start", 0, "int: global id of the shard's first column (labels are global ids)")
_TILE = Option("tile", 4096, "int: columns per tile; tiles start at the shard's first column, the last "
                             "one may be shorter")
_ENTROPY = Option("with_entropy", False, "bool: also return tile_elog (for the entropy)")
_STATS = ("tile_max", "tile_sumexp", "tile_elog", "label_logits")
_STATS_DOC = ("per row and tile of z = logits / temperature (in float32, float64 for float64 input): "
              "tile_max = max z, tile_sumexp = sum e, tile_elog = sum e * log e (0 where z is -inf; None "
              "unless with_entropy=True) with e = exp(z - tile_max), all of shape (..., n_tiles); label_logits "
              "(...) = z at column labels - vocab_start where the shard holds the label and it is not "
              "ignore_index, else 0 (None when labels is None). A tile's statistics must depend on its own "
              "columns only (bitwise, for backends declaring group_invariant)")
_GRADS_DOC = ("lse, entropy: the merged log-sum-exp and entropy of z per row (...); grad_logprobs, "
              "grad_entropy: upstream gradients (...) or None, grad_logprobs already 0 at ignored positions")

OPS: Mapping[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec(
        name="logprobs", function="logprobs_from_logits",
        inputs=("logits", "labels"),
        options=(_TEMPERATURE, _IGNORE_INDEX, _INPLACE) + _SAMPLER,
        outputs=("logprobs",),
        doc="log_softmax(processed logits)[..., labels]: logits (..., V); " + _LABELS
            + "; float32 (float64 for float64 logits)",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="entropy", function="entropy_from_logits",
        inputs=("logits",),
        options=(_TEMPERATURE,) + _SAMPLER,
        outputs=("entropy",),
        doc="entropy of softmax(processed logits) over the last dim: logits (..., V); "
            "float32 (float64 for float64 logits) of shape (...)",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="logprobs_and_entropy", function="logprobs_and_entropy",
        inputs=("logits", "labels"),
        options=(_TEMPERATURE, _IGNORE_INDEX, _INPLACE) + _SAMPLER,
        outputs=("logprobs", "entropy"),
        doc="both of the above in one pass; the entropy of an ignored position is computed as usual",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="logprobs_from_hidden", function="logprobs_from_hidden",
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V,) or None, added to hidden @ weight.T"),
                 _TEMPERATURE, _IGNORE_INDEX,
                 Option("return_entropy", False, "bool: also return the entropy")) + _SAMPLER + (
                 Option("logits_dtype", None, "torch.bfloat16, torch.float16 or None: round each logit "
                        "to it before the softmax, as an engine whose lm_head runs in it (straight-"
                        "through gradient); None keeps exact fp32 products", feature="logits_dtype"),),
        outputs=("logprobs", "entropy"),
        tuple_when="return_entropy",
        doc="logprobs of labels under hidden @ weight.T + bias without forming the (N, V) logits: "
            "hidden (..., H), weight (V, H), one dtype for hidden, weight and bias",
        dtype_input="hidden", grad_inputs=("hidden", "weight", "bias"),
    ),
    OpSpec(
        name="topk_logprobs", function="topk_logprobs",
        inputs=("logits",),
        options=(Option("k", 1, "int >= 1, at most V: how many"), _TEMPERATURE) + _SAMPLER,
        outputs=("values", "ids"),
        doc="the k largest processed logprobs (float32, (..., k)) and their ids (int64), largest first, "
            "ties by smaller id; -inf (and the smallest ids left) where fewer than k tokens are kept",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="shard_stats", function=None,
        inputs=("logits", "labels"),
        options=(_VOCAB_START, _TILE, _TEMPERATURE, _IGNORE_INDEX, _ENTROPY),
        outputs=_STATS,
        doc="vocabulary-parallel forward on one shard: logits (..., V_local), labels (...) global ids or None; "
            + _STATS_DOC,
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="shard_grad", function=None,
        inputs=("logits", "labels", "lse", "entropy", "grad_logprobs", "grad_entropy"),
        options=(_VOCAB_START, _TEMPERATURE, _INPLACE),
        outputs=("grad_logits",),
        doc="vocabulary-parallel backward on one shard: the gradient of the shard (its shape and dtype), "
            "out of place or, with inplace_backward, over its storage; " + _GRADS_DOC,
        dtype_input="logits", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_stats", function=None,
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TILE, _TEMPERATURE,
                 _IGNORE_INDEX, _ENTROPY),
        outputs=_STATS,
        doc="shard_stats of the logits hidden @ weight.T + bias of a weight shard (V_local, H), without "
            "forming them; hidden (..., H)",
        dtype_input="hidden", grad_inputs=(),
    ),
    OpSpec(
        name="hidden_shard_grad", function=None,
        inputs=("hidden", "weight", "labels", "lse", "entropy", "grad_logprobs", "grad_entropy"),
        options=(Option("bias", None, "tensor (V_local,) or None"), _VOCAB_START, _TILE, _TEMPERATURE,
                 Option("needs_grad", (True, True, False), "(hidden, weight, bias): which gradients to form")),
        outputs=("grad_hidden", "grad_weight", "grad_bias"),
        doc="backward of hidden_shard_stats: this shard's share of the hidden gradient (float32, float64 for "
            "float64; the core sums it over the group), the weight shard's and bias shard's gradients (their "
            "dtypes), None where not needed; " + _GRADS_DOC,
        dtype_input="hidden", grad_inputs=(),
    ),
)}

#: The ops of the vocabulary-parallel path, called by the core (:mod:`logprob_registry.distributed`).
SHARD_OPS = tuple(name for name, spec in OPS.items() if spec.function is None)

#: Features a backend may declare (``Backend(features=...)``): options it implements, and kinds of
#: call it supports. A call that needs a feature goes only to backends that declare it.
FEATURES: Mapping[str, str] = {
    "functorch": "its ops work inside torch.func transforms (grad, vmap, jacrev, ...): pure "
                 "differentiable torch ops, or autograd Functions with setup_context and vmap rules",
    "candidates": "labels of shape (..., K): the logprobs of K candidate tokens per position in one pass",
    **{o.feature: f"the {o.name} option: {o.doc}" for o in _SAMPLER},
    "logits_dtype": "logprobs_from_hidden's logits_dtype option: logits rounded to bf16/fp16 before the softmax",
}
#: The features that truncate the distribution (a label outside the kept set gives -inf).
TRUNCATION = frozenset({"top_k", "top_p", "min_p", "keep"})


def get(op: str) -> OpSpec:
    """The spec of ``op``, or a ValueError listing the ops."""
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}") from None


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
