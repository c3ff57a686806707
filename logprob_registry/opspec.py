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
    function: Optional[str]    # the public function that dispatches to it; None: the distributed core
    inputs: Tuple[str, ...]    # positional tensors, in order
    options: Tuple[Option, ...]
    outputs: Tuple[str, ...]   # what it returns: one tensor, or a tuple of these
    doc: str
    dtype_input: str           # the input whose device and dtype select the backend
    grad_inputs: Tuple[str, ...]  # inputs (or tensor options) whose requires_grad asks for a backward
    tuple_when: Optional[str] = None  # a boolean option that makes it return all of ``outputs``
    option_index: Dict[str, Option] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_index", {o.name: o for o in self.options})

    def output_names(self, options: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
        """The outputs a call returns (``logprobs_from_hidden`` returns the entropy only when
        ``return_entropy=True``)."""
        if self.tuple_when is not None and not (options or {}).get(self.tuple_when, False):
            return self.outputs[:1]
        return self.outputs

    def features_used(self, options: Mapping[str, Any]) -> frozenset:
        """The backend features a call with these option values needs."""
        return frozenset(o.feature for o in self.options
                         if o.feature is not None and o.name in options and o.used(options[o.name]))

    def backend_options(self, features: frozenset, options: Mapping[str, Any]) -> Dict[str, Any]:
        """The keyword options a backend declaring ``features`` receives."""
        return {o.name: options.get(o.name, o.default) for o in self.options
                if o.feature is None or o.feature in features}

    def signature(self) -> str:
        """The call as a backend receives it, e.g. ``logprobs(logits, labels, *, temperature, ...)``."""
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


_TEMPERATURE = Option("temperature", 1.0, "float > 0: the logits are divided by it")
_IGNORE_INDEX = Option("ignore_index", None,
                       "int or None: positions whose label equals it give 0 and a zero gradient")
_INPLACE = Option("inplace_backward", False,
                  "bool: backward may write the logits' gradient over the logits' storage")
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
        options=(_TEMPERATURE, _IGNORE_INDEX, _INPLACE),
        outputs=("logprobs",),
        doc="log_softmax(logits / temperature)[..., labels]: logits (..., V), labels (...) int32/int64; "
            "returns float32 (float64 for float64 logits) of the labels' shape",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="entropy", function="entropy_from_logits",
        inputs=("logits",),
        options=(_TEMPERATURE,),
        outputs=("entropy",),
        doc="entropy of softmax(logits / temperature) over the last dim: logits (..., V); "
            "returns float32 (float64 for float64 logits) of shape (...)",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="logprobs_and_entropy", function="logprobs_and_entropy",
        inputs=("logits", "labels"),
        options=(_TEMPERATURE, _IGNORE_INDEX, _INPLACE),
        outputs=("logprobs", "entropy"),
        doc="both of the above in one pass; the entropy of an ignored position is computed as usual",
        dtype_input="logits", grad_inputs=("logits",),
    ),
    OpSpec(
        name="logprobs_from_hidden", function="logprobs_from_hidden",
        inputs=("hidden", "weight", "labels"),
        options=(Option("bias", None, "tensor (V,) or None, added to hidden @ weight.T"),
                 _TEMPERATURE, _IGNORE_INDEX,
                 Option("return_entropy", False, "bool: also return the entropy")),
        outputs=("logprobs", "entropy"),
        tuple_when="return_entropy",
        doc="logprobs of labels under hidden @ weight.T + bias without forming the (N, V) logits: "
            "hidden (..., H), weight (V, H), one dtype for hidden, weight and bias",
        dtype_input="hidden", grad_inputs=("hidden", "weight", "bias"),
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
}


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
        lines.append(spec.signature())
        lines.append(f"    {spec.doc}")
        for o in spec.options:
            only = f" (only to backends declaring feature {o.feature!r})" if o.feature else ""
            lines.append(f"    {o.name}={o.default!r}: {o.doc}{only}")
    return "\n".join(lines)
