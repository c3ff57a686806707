"""What one benchmark table measures (op, device, dtype, shapes, mode), the presets, and how the
op's inputs are shaped.

The ops and their inputs come from the op table (:data:`logprob_registry.opspec.OPS`): each input is
made by name (:data:`logprob_registry.opspec.INPUTS`, through the op's example maker), not by op,
so an op whose inputs are all in :data:`INPUTS` is benchmarked with no change here. An op whose
inputs may also be hidden states, each with its own weight (``kl_divergence``: ``student`` with the
option ``student_weight``, ``teacher`` with ``teacher_weight``; :func:`hidden_weights`), is benched on
hidden states when a hidden size is given, on logits otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch

from ..dtypes import DTYPE_NAMES, dtype_name
from ..opspec import INPUTS, OPS, InputKind, OpSpec

DEFAULT_HIDDEN_SIZE = 2048


#: The outputs the textbook baseline computes (:data:`logprob_registry.benchmark.workload.TEXTBOOK`):
#: log-probabilities, entropies, a KL divergence, and the statistics of ``token_stats``.
BASELINE_OUTPUTS = frozenset({"logprobs", "entropy", "kl", "raw_logprobs", "raw_entropy", "log_sum_p2",
                              "mean_logit", "max_logit", "is_argmax"})


def bench_ops() -> Tuple[str, ...]:
    """The public ops of the op table that give log-probabilities, entropies, a KL divergence or
    token statistics and whose every input the bench can make (topk_logprobs, which returns ids, has
    no baseline to compare with). An op whose first input is logits or hidden states (form
    ``either``: ``token_stats``'s ``inputs``) is made as logits, or as hidden states with the option
    ``weight`` when a hidden size is given."""
    return tuple(name for name, spec in OPS.items()
                 if spec.function is not None and spec.examples is not None
                 and set(spec.outputs) <= BASELINE_OUTPUTS
                 and set(spec.inputs) - ({spec.inputs[0]} if spec.form == "either" else set()) <= set(INPUTS))


def output_choices(op: str) -> Tuple[str, ...]:
    """The outputs a call of ``op`` may be asked for (``--outputs``): those of an op with a
    ``selected_by`` option (``token_stats``), none for the others."""
    spec = OPS[op]
    return spec.outputs if spec.selected_by is not None else ()


def uses_hidden_size(op: str) -> bool:
    """Whether one of ``op``'s inputs always has the hidden size H in its shape (``logprobs_from_hidden``)."""
    return any("H" in INPUTS[i].dims for i in OPS[op].inputs if i in INPUTS)


def hidden_weights(op: str) -> Mapping[str, str]:
    """The options of ``op`` that turn an input into hidden states, by option: ``{"student_weight":
    "student", "teacher_weight": "teacher"}`` for ``kl_divergence`` (an option ``<input>_weight``),
    empty for the other ops."""
    spec = OPS[op]
    if spec.form == "either" and "weight" in spec.option_index:  # token_stats: inputs, with the option weight
        return {"weight": spec.inputs[0]}
    return {f"{i}_weight": i for i in spec.inputs if f"{i}_weight" in spec.option_index}


def takes_hidden_size(op: str) -> bool:
    """Whether ``--hidden-size`` applies to ``op``: always hidden states, or optionally (:func:`hidden_weights`)."""
    return uses_hidden_size(op) or bool(hidden_weights(op))


class Preset(NamedTuple):
    shape: Tuple[int, int, int]
    dtype: str
    sliced: bool
    what: str
    hidden_size: int = DEFAULT_HIDDEN_SIZE  # for ops taking hidden states


PRESETS: Dict[str, Preset] = {
    "small": Preset((2, 512, 32000), "float32", False, "the default: a laptop CPU runs it in seconds"),
    "verl": Preset((16, 1024, 32768), "float32", False, "verl's seed benchmark: 16x1024x32768 fp32", 4096),
    "trlx": Preset((32, 2048, 64000), "float16", True,
                   "trlx's seed benchmark: 32x2048x64000 fp16, logits[:, :-1] against labels[:, 1:]", 4096),
}
DEFAULT_PRESET = "small"

# The float64 reference is computed over chunks of rows of at most this many elements (64 MiB).
REFERENCE_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class Setting:
    """One table of the benchmark: every method run on the same inputs.

    ``shape`` is the (B, T, V) of the logits the op reduces (given, or formed from hidden states of
    size ``hidden_size``); with ``sliced`` the methods get ``x[:, :-1]`` of every per-token input
    and ``labels[:, 1:]`` (non-contiguous views, as trainers pass them). For an op that optionally
    takes hidden states (:func:`hidden_weights`), ``hidden_size`` set means every such input is hidden
    states ``(B, T, H)`` with its weight ``(V, H)`` (passed as the op's ``*_weight`` option).
    """

    op: str
    device: str
    dtype: str
    shape: Tuple[int, int, int]
    hidden_size: Optional[int] = None  # set for ops with a hidden input, None otherwise
    sliced: bool = False
    backward: bool = False
    inplace_backward: bool = False
    repeat: int = 5
    warmup: int = 2
    threads: Optional[int] = None  # torch threads in each child; None: torch's default
    preset: Optional[str] = None
    seed: int = 0
    outputs_asked: Optional[Tuple[str, ...]] = None  # token_stats' outputs (--outputs); None: the op's default

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.outputs_asked is not None:
            object.__setattr__(self, "outputs_asked", tuple(self.outputs_asked))

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def options(self) -> Dict[str, object]:
        """The keyword options of every call (the op's defaults otherwise); an op whose outputs an
        option names (``token_stats``) always gets that option, the op's default unless asked."""
        options: Dict[str, object] = {"inplace_backward": True} if self.inplace_backward else {}
        chooser = self.spec.selected_by
        if chooser is not None:
            options[chooser] = self.outputs_asked or tuple(self.spec.option_index[chooser].default)
        return options

    @property
    def outputs(self) -> Tuple[str, ...]:
        return self.spec.output_names(self.options)

    @property
    def hidden_weights(self) -> Mapping[str, str]:
        """The weight options this setting passes, by option: the input each turns into hidden
        states (:func:`hidden_weights`; none without a hidden size, or for ops that have none)."""
        return hidden_weights(self.op) if self.hidden_size else {}

    @property
    def tensors(self) -> Tuple[str, ...]:
        """The tensors of every call: the op's inputs, then the weight options it passes."""
        return tuple(self.spec.inputs) + tuple(self.hidden_weights)

    @property
    def grad_inputs(self) -> Tuple[str, ...]:
        """The tensors whose gradients the backward computes (none forward only)."""
        if not self.backward:
            return ()
        return tuple(n for n in self.spec.grad_inputs if n in self.tensors)

    def kind(self, name: str) -> InputKind:
        """How tensor ``name`` is shaped (:data:`INPUTS`): a weight option as ``weight``, an input
        it turns into hidden states as ``hidden``."""
        weights = self.hidden_weights
        if name in weights:
            return INPUTS["weight"]
        if name in weights.values():
            return INPUTS["hidden"]
        if name not in INPUTS and self.spec.form == "either" and name == self.spec.inputs[0]:
            return INPUTS["logits"]  # token_stats' inputs without a hidden size: logits
        return INPUTS[name]

    def per_token(self, name: str) -> bool:
        """Whether tensor ``name`` has one entry per position (its leading dims are the positions')."""
        return self.kind(name).per_token

    def input_shape(self, name: str, seen: bool = True) -> Tuple[int, ...]:
        """The shape of tensor ``name`` as allocated (``seen=False``) or as the methods see it."""
        b, t, v = self.shape
        kind = self.kind(name)
        shape = kind.shape((b, t), v, self.hidden_size or 0)
        if seen and self.sliced and kind.per_token:
            shape = (shape[0], shape[1] - 1) + shape[2:]
        return shape

    def input_bytes(self, name: str) -> int:
        n = 1
        for d in self.input_shape(name, seen=False):
            n *= d
        return n * (8 if self.kind(name).integer else self.itemsize)

    @property
    def forms_logits(self) -> bool:
        """Whether the op forms its logits from hidden states (so no bound on the bytes it moves)."""
        return any("H" in self.kind(n).dims for n in self.tensors)

    @property
    def logits_shape(self) -> Tuple[int, int, int]:
        """The shape of the logits the op reduces, as the methods see them."""
        b, t, v = self.shape
        return (b, t - 1, v) if self.sliced else (b, t, v)

    @property
    def logits_traffic_bytes(self) -> Optional[int]:
        """The bytes an op given logits must move at least: each logits-shaped input (the logits;
        the student's and the teacher's) read once forward; those that get a gradient read again
        and their gradient written backward. None for ops that form their logits."""
        if self.forms_logits:
            return None
        b, t, v = self.logits_shape
        vocab_inputs = [n for n in self.tensors if self.kind(n).dims == "...V"]
        reads = len(vocab_inputs) + 2 * len([n for n in vocab_inputs if n in self.grad_inputs])
        return b * t * v * self.itemsize * reads

    @property
    def mode(self) -> str:
        if not self.backward:
            return "forward"
        return "forward+backward (in place)" if self.inplace_backward else "forward+backward"

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape))
        hidden = f" H={self.hidden_size}" if self.hidden_size else ""
        where = " sliced [:, :-1]" if self.sliced else ""
        preset = f" (preset {self.preset})" if self.preset else ""
        outputs = f" outputs={','.join(self.outputs)}" if self.spec.selected_by is not None else ""
        return f"{self.op}{outputs} on {self.device} {self.dtype} {shape}{hidden}{where}{preset}, {self.mode}"

    def to_args(self) -> dict:
        """The fields, as JSON: ``Setting(**s.to_args())`` gives ``s`` back (in a child)."""
        d = dict(dataclasses.asdict(self), shape=list(self.shape))
        if self.outputs_asked is not None:
            d["outputs_asked"] = list(self.outputs_asked)
        return d

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(shape=list(self.shape), logits_shape=list(self.logits_shape), mode=self.mode,
                 device_type=self.device_type,
                 inputs={n: list(self.input_shape(n)) for n in self.tensors})
        return d


def parse_shape(text: str) -> Tuple[int, int, int]:
    """``"B,T,V"`` (also ``BxTxV``) to a tuple of three positive ints, or a ValueError saying why."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape {text!r} is not three positive integers B,T,V such as 2,512,32000")
    return shape  # type: ignore[return-value]


def parse_list(values: List[str], known, what: str) -> List[str]:
    """Comma-separated or repeated option values, checked against ``known``, deduplicated."""
    out: List[str] = []
    for value in values:
        for item in filter(None, (s.strip() for s in value.split(","))):
            if item not in known:
                raise ValueError(f"unknown {what} {item!r}; choose from {', '.join(known)}")
            out.append(item)
    return list(dict.fromkeys(out))


def canonical_dtype(name: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; a ValueError listing the names for an unknown one."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_NAMES)}")
    return dtype_name(DTYPE_NAMES[name])
