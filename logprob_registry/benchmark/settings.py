"""What one benchmark run measures (op, device, dtype, shape, mode), the presets, and whether it
fits in the device's memory. No torch import here: the parent decides before any tensor exists."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

# The ops the bench measures: each takes (logits[, labels]).
BENCH_OPS = ("logprobs", "entropy", "logprobs_and_entropy")

DTYPES: Dict[str, Tuple[str, int]] = {  # accepted spelling -> (torch name, bytes per element)
    "float16": ("float16", 2), "fp16": ("float16", 2), "half": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "float32": ("float32", 4), "fp32": ("float32", 4), "float": ("float32", 4),
    "float64": ("float64", 8), "fp64": ("float64", 8), "double": ("float64", 8),
}


class Preset(NamedTuple):
    shape: Tuple[int, int, int]
    dtype: str
    sliced: bool
    what: str


PRESETS: Dict[str, Preset] = {
    "small": Preset((2, 512, 32000), "float32", False, "the default: a laptop CPU runs it in seconds"),
    "verl": Preset((16, 1024, 32768), "float32", False, "verl's seed benchmark: 16x1024x32768 fp32"),
    "trlx": Preset((32, 2048, 64000), "float16", True,
                   "trlx's seed benchmark: 32x2048x64000 fp16, logits[:, :-1] against labels[:, 1:]"),
}
DEFAULT_PRESET = "small"

# The float64 reference is computed over chunks of rows of at most this many elements (64 MiB).
REFERENCE_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class Setting:
    """One table of the benchmark: every method run on the same inputs.

    ``shape`` is the logits tensor allocated; with ``sliced`` the methods get ``logits[:, :-1]``
    and ``labels[:, 1:]`` (a non-contiguous view, as trainers pass it).
    """

    op: str
    device: str
    dtype: str
    shape: Tuple[int, int, int]
    sliced: bool = False
    backward: bool = False
    inplace_backward: bool = False
    repeat: int = 5
    warmup: int = 2
    preset: Optional[str] = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def logits_shape(self) -> Tuple[int, int, int]:
        """The shape the methods see."""
        b, t, v = self.shape
        return (b, t - 1, v) if self.sliced else (b, t, v)

    @property
    def mode(self) -> str:
        if not self.backward:
            return "forward"
        return "forward+backward (in place)" if self.inplace_backward else "forward+backward"

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape))
        where = " sliced [:, :-1]" if self.sliced else ""
        preset = f" (preset {self.preset})" if self.preset else ""
        return f"{self.op} on {self.device} {self.dtype} {shape}{where}{preset}, {self.mode}"

    def to_args(self) -> dict:
        """The fields, as JSON: ``Setting(**s.to_args())`` gives ``s`` back (in a child)."""
        return dict(dataclasses.asdict(self), shape=list(self.shape))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(shape=list(self.shape), logits_shape=list(self.logits_shape), mode=self.mode,
                 device_type=self.device_type)
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


# ------------------------------------------------------------------------------------ memory
def estimate_bytes(s: Setting) -> Dict[str, int]:
    """A generous estimate of the memory one child needs, by part.

    The workspace is that of the hungriest likely method, the float32 textbook one (``naive``), as
    measured: a float32 copy of the logits and their log-softmax; in backward, one more float32
    tensor of that size; for the entropy, one more again.
    """
    b, t, v = s.shape
    n = b * t * v
    m = s.logits_shape[0] * s.logits_shape[1] * v
    work_item = max(4, s.itemsize)
    parts = {
        "logits": n * s.itemsize,
        "labels": b * t * 8,
        "gradient": n * s.itemsize if s.backward else 0,
        "in-place copy": n * s.itemsize if s.backward and s.inplace_backward else 0,
        "workspace": m * work_item * ((3 if s.backward else 2) + (s.op != "logprobs")),
        "float64 reference": min(m, max(v, REFERENCE_CHUNK_ELEMENTS)) * 8 * 6,
    }
    return parts


def refusal(s: Setting, available: int, source: str) -> Optional[str]:
    """None when ``s`` fits in ``available`` bytes; else the message that refuses it."""
    parts = estimate_bytes(s)
    need = sum(parts.values())
    if need <= available:
        return None
    detail = ", ".join(f"{k} {fmt_gib(x)}" for k, x in parts.items() if x >= 2**20)
    hint = suggest(s, available)
    hint = (f" Try --shape {','.join(map(str, hint))}." if hint else
            " Even one row of this vocabulary does not fit; try a smaller vocabulary.")
    return (f"{s.describe()} needs about {fmt_gib(need)} ({detail}), but only {fmt_gib(available)} "
            f"is available on {s.device} ({source}).{hint}")


def suggest(s: Setting, available: int) -> Optional[Tuple[int, int, int]]:
    """The largest shape that fits, halving the batch first and then the sequence length."""
    b, t, v = s.shape
    while True:
        trial = dataclasses.replace(s, shape=(b, t, v))
        if sum(estimate_bytes(trial).values()) <= available:
            return (b, t, v)
        if b > 1:
            b = max(1, b // 2)
        elif t > (2 if s.sliced else 1):
            t = max(2 if s.sliced else 1, t // 2)
        else:
            return None


def cpu_available_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo, or None where there is no /proc (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
