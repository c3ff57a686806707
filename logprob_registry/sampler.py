"""The sampler's processing as one value: the keywords that replay what an inference engine's
sampler did to the logits before it drew a token (``softcap``, ``top_k``, ``top_p``, ``min_p``,
``keep``), validated once.

:data:`FIELDS` is the one list of those keywords: its name, what it means (the op table's option
doc), and how a value is checked. Everything else reads it: the op table declares one option per
field (each the backend feature of the same name), :meth:`Sampler.validate` checks a call's values,
and :attr:`Sampler.used`, :attr:`Sampler.truncates` and :meth:`Sampler.features` answer what a call
needs. Backends keep receiving plain keywords (:meth:`Sampler.keywords`): the plugin ABI is the op
table's, not this class.

Adding a sampler keyword: one :class:`Field` here (and its option in the public functions'
signatures), its meaning in :mod:`logprob_registry.reference`, and the kernels that implement it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from . import validation as _v
from .validation import LABEL_DTYPES, check_same_device, unravel, values_visible

# ------------------------------------------------------------------------------- checks
Shape = Sequence[int]   # the logits' shape (..., V): V is a shard's width with process_group=
Vocab = Optional[int]   # the whole vocabulary's size (None: not known yet, on a shard)

# ------------------------------------------------------------------------------- per-row values
#: The engines whose processing order and tie rules ``sampler=`` replays (docs/sampler.md).
ORDERS: Tuple[str, ...] = ("vllm", "hf", "sglang")
#: The backend feature a per-row (tensor) ``temperature``, ``top_k``, ``top_p`` or ``min_p`` needs.
PER_ROW = "per_row"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_sampler(sampler: object) -> Optional[str]:
    """``sampler=``: None for ``"vllm"`` (the default, and what backends receive for it), else the
    engine's name."""
    if sampler is None or sampler == "vllm":
        return None
    if not isinstance(sampler, str) or sampler not in ORDERS:
        raise ValueError(f"sampler must be one of {', '.join(map(repr, ORDERS))} (whose processing order and "
                         f"tie rules are replayed; docs/sampler.md), got {sampler!r}")
    return sampler


def per_row(name: str, value: torch.Tensor, shape: Shape, device: Any, integer: bool) -> torch.Tensor:
    """A per-row ``name`` (``temperature``, ``top_k``, ``top_p``, ``min_p``): a tensor broadcastable
    to the positions ``shape[:-1]`` (the logits' leading dims), on the logits' device, of a float
    dtype (int for ``top_k``); returned converted (float32 or int64) and expanded (no copy) to the
    positions' shape."""
    lead = tuple(shape[:-1])
    kind = "an int32/int64" if integer else "a floating-point"
    ok = value.dtype in LABEL_DTYPES if integer else value.dtype in _FLOATS
    if not ok:
        cast = "long" if integer else "float"
        raise TypeError(f"{name} is a tensor of dtype {value.dtype}; a per-row {name} must be {kind} tensor "
                        f"broadcastable to the positions' shape {lead} (e.g. {name}.{cast}())")
    if device is not None:
        check_same_device(value, device, name, "logits")
    try:
        fits = tuple(torch.broadcast_shapes(tuple(value.shape), lead)) == lead
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, which does not broadcast to the positions' shape "
                         f"{lead}: give one value per position {lead}, or a shape that broadcasts to it, such as "
                         f"{lead[:1] + (1,) * (len(lead) - 1) if lead else ()} for one value per sequence")
    converted = value.detach().to(torch.int64 if integer else torch.float32)
    return converted.expand(lead) if tuple(converted.shape) != lead else converted


def check_rows(name: str, value: torch.Tensor, bad: torch.Tensor, rule: str) -> None:
    """A ValueError naming the first position where ``bad`` (the mask of out-of-range values of the
    per-row tensor ``value``) holds; skipped where values cannot be read (``values_visible``)."""
    if value.numel() == 0 or not values_visible(value):
        return
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0, 0])
        where = tuple(unravel(first, bad.shape))
        raise ValueError(f"{name} = {value.reshape(-1)[first].item()!r} at position {where} (of the positions' shape "
                         f"{tuple(bad.shape)}) is out of range: {rule}")


def _scalar(value: object) -> object:
    """A one-element tensor whose value can be read is that number (as ``temperature`` always took it)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and values_visible(value):
        return value.item()
    return value


def check_temperature(temperature: object, shape: Shape = (), device: Any = None, vocab: Vocab = None):
    """A positive number, or a per-row float tensor (float32, expanded to the positions' shape)."""
    _v.check_no_grad(temperature, "temperature")
    temperature = _scalar(temperature)
    if not isinstance(temperature, torch.Tensor):
        return _v.check_temperature(temperature)
    rows = per_row("temperature", temperature, shape, device, integer=False)
    check_rows("temperature", rows, ~((rows > 0) & (rows < math.inf)), "every temperature must be finite and > 0")
    return rows


def check_softcap(softcap: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be finite and > 0 (or None for no softcap), got {value}")
    return value


def check_top_k(top_k: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[int]:
    """None when it keeps everything: None, 0 and -1 (vLLM's "disabled") or at least ``vocab`` (the
    whole vocabulary's size, when known)."""
    if top_k is None:
        return None
    top_k = _scalar(top_k)
    if isinstance(top_k, torch.Tensor):
        rows = per_row("top_k", top_k, shape, device, integer=True)
        check_rows("top_k", rows, rows < -1, "top_k must be >= 1, or 0 or -1 (off for that row)")
        off = rows == -1
        if vocab is not None:
            off = off | (rows >= vocab)
        return torch.where(off, 0, rows)  # 0: off for that row
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}; a number, or a "
                        "per-row int tensor of the positions' shape")
    value = int(top_k)
    if value < -1:
        raise ValueError(f"top_k must be >= 1, or 0 or -1 (disabled, as in vLLM), got {value}")
    return None if value <= 0 or (vocab is not None and value >= vocab) else value


def check_top_p(top_p: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[float]:
    """None when it keeps everything (None or 1)."""
    if top_p is None:
        return None
    top_p = _scalar(top_p)
    if isinstance(top_p, torch.Tensor):
        rows = per_row("top_p", top_p, shape, device, integer=False)
        check_rows("top_p", rows, ~((rows > 0) & (rows <= 1)), "top_p must be in (0, 1] (1.0: off for that row)")
        return rows
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a number in (0, 1] or None, got {type(top_p).__name__}")
    value = float(top_p)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {value}")
    return None if value == 1.0 else value


def check_min_p(min_p: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[float]:
    """None when it keeps everything (None or 0)."""
    if min_p is None:
        return None
    min_p = _scalar(min_p)
    if isinstance(min_p, torch.Tensor):
        rows = per_row("min_p", min_p, shape, device, integer=False)
        check_rows("min_p", rows, ~((rows >= 0) & (rows <= 1)), "min_p must be in [0, 1] (0.0: off for that row)")
        return rows
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real):
        raise TypeError(f"min_p must be a number in [0, 1] or None, got {type(min_p).__name__}")
    value = float(min_p)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 keeps every token), got {value}")
    return None if value == 0.0 else value


def check_keep(keep: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[torch.Tensor]:
    """``keep``: None, a bool mask of the logits' shape, or int ids ``(..., K)`` in ``[0, V)`` or -1
    (no token: padding)."""
    if keep is None:
        return None
    if not isinstance(keep, torch.Tensor):
        raise TypeError(f"keep must be a torch.Tensor (bool mask or int ids) or None, got {type(keep).__name__}")
    if device is not None:
        check_same_device(keep, device, "keep", "logits")
    if vocab is None:  # a vocabulary shard's call: its shape and ids concern the whole vocabulary (not known here)
        return keep
    shape = tuple(shape)
    lead, width = shape[:-1], shape[-1]
    if keep.dtype == torch.bool:
        if tuple(keep.shape) != shape:
            raise ValueError(f"keep is a bool mask of shape {tuple(keep.shape)}, but the logits have shape "
                             f"{shape}: a mask must have the logits' shape")
        return keep
    if keep.dtype not in LABEL_DTYPES:
        raise TypeError(f"keep must be a bool mask or int64/int32 ids, got {keep.dtype}")
    if keep.dim() != len(lead) + 1 or tuple(keep.shape[:-1]) != lead:
        raise ValueError(f"keep holds ids of shape {tuple(keep.shape)}, but the logits have shape "
                         f"{shape}: ids must have shape {lead + ('K',)}")
    if keep.numel() and values_visible(keep):
        bad = (keep < -1) | (keep >= width)
        if bool(bad.any()):
            first = int(bad.reshape(-1).nonzero()[0, 0])
            raise ValueError(f"keep id {int(keep.reshape(-1)[first])} at position "
                             f"{tuple(unravel(first, keep.shape))} is out of range for a vocabulary of "
                             f"{width} (ids are 0..{width - 1}, or -1 for none)")
    return keep


# ------------------------------------------------------------------------------- fields
@dataclasses.dataclass(frozen=True)
class Field:
    """One sampler keyword: its name (also the backend feature a call using it needs), the op
    table's doc, whether it can drop tokens, and its check ``(value, logits shape, device, vocab)
    -> validated value`` (None when it changes nothing; ``vocab``: the whole vocabulary's size, None
    for a shard of it)."""

    name: str
    doc: str
    truncates: bool
    check: Callable[[object, Sequence[int], Any, Optional[int]], Any]


#: The sampler's keywords, in the order the sampler applies them (vLLM V1's order: softcap, then the
#: temperature, then min_p, top_k, top_p and keep truncate; then the log-softmax over the kept tokens).
FIELDS: Tuple[Field, ...] = (
    Field("softcap", "float > 0 or None: z -> softcap * tanh(z / softcap), before the temperature",
          False, check_softcap),
    Field("top_k", "int >= 1 or None, or per row an int64 tensor of the positions' shape (0: off for that row): "
                   "keep the top_k largest logits (ties as the sampler= engine keeps them)", True, check_top_k),
    Field("top_p", "float in (0, 1) or None, or per row a float32 tensor (1.0: off for that row): keep the most "
                   "probable tokens whose mass reaches top_p (at least one token)", True, check_top_p),
    Field("min_p", "float in (0, 1] or None, or per row a float32 tensor (0.0: off for that row): drop tokens "
                   "less probable than min_p times the most probable one", True, check_min_p),
    Field("keep", "bool (..., V) or int64 ids (..., K) (-1 for none), or None: only these tokens (the sampler's "
                  "own mask)", True, check_keep),
)
NAMES: Tuple[str, ...] = tuple(f.name for f in FIELDS)
_ROW_NAMES = ("top_k", "top_p", "min_p")  # the fields that may be per-row tensors
_NO_FEATURES: frozenset = frozenset()
#: The features that truncate the distribution (a label outside the kept set gives -inf).
TRUNCATION = frozenset(f.name for f in FIELDS if f.truncates)


@dataclasses.dataclass(frozen=True, eq=False)
class Sampler:
    """A call's validated sampler keywords; a field that keeps every token is None.

    Build one with :meth:`validate` (a public function's keywords) or :meth:`of` (keywords a
    backend received, already validated)."""

    softcap: Optional[float] = None
    top_k: Any = None   # a number, or per row: int64 of the positions' shape (0: off)
    top_p: Any = None   # a number, or per row: float32 (1.0: off)
    min_p: Any = None   # a number, or per row: float32 (0.0: off)
    keep: Optional[torch.Tensor] = None

    @classmethod
    def validate(cls, given: Mapping[str, Any], shape: Sequence[int], device: Any = None,
                 vocab: Optional[int] = None) -> "Sampler":
        """The sampler of a call whose keywords are ``given`` (names absent: None), for logits of
        ``shape`` on ``device`` over a vocabulary of ``vocab`` (None: ``shape`` is a shard of an
        unknown whole); a bad value raises the error that says how to fix it."""
        values = [given.get(name) for name in NAMES]
        if all(value is None for value in values):
            return OFF
        return cls(**{f.name: f.check(value, shape, device, vocab) for f, value in zip(FIELDS, values)})

    @classmethod
    def of(cls, keywords: Mapping[str, Any]) -> "Sampler":
        """The sampler of keywords a backend received (validated already; other keys ignored)."""
        values = [keywords.get(name) for name in NAMES]
        return OFF if all(value is None for value in values) else cls(**dict(zip(NAMES, values)))

    @staticmethod
    def in_use(keywords: Mapping[str, Any]) -> bool:
        """Whether any sampler keyword among ``keywords`` (validated: None when it changes nothing)
        is in use: :attr:`used` of the keywords a backend received, without building the value."""
        return any(keywords.get(name) is not None for name in NAMES)

    @property
    def used(self) -> bool:
        """Whether any keyword changes anything."""
        return self is not OFF and any(getattr(self, name) is not None for name in NAMES)

    @property
    def truncates(self) -> bool:
        """Whether the keywords can drop tokens (a label outside the kept set then gives -inf)."""
        return any(getattr(self, name) is not None for name in TRUNCATION)

    @property
    def per_row(self) -> bool:
        """Whether ``top_k``, ``top_p`` or ``min_p`` is a per-row tensor (feature ``per_row``)."""
        return any(isinstance(getattr(self, name), torch.Tensor) for name in _ROW_NAMES)

    def features(self) -> frozenset:
        """The backend features a call with this sampler needs (one per keyword in use, and
        ``per_row`` for a per-row tensor)."""
        if self is OFF:
            return _NO_FEATURES
        used = frozenset(name for name in NAMES if getattr(self, name) is not None)
        return used | {PER_ROW} if self.per_row else used

    def keywords(self) -> Dict[str, Any]:
        """The keywords as a backend receives them."""
        return {name: getattr(self, name) for name in NAMES}

    def __repr__(self) -> str:
        used = ", ".join(f"{n}={'<tensor>' if isinstance(getattr(self, n), torch.Tensor) else getattr(self, n)!r}"
                         for n in NAMES
                         if getattr(self, n) is not None)
        return f"Sampler({used})"


#: The sampler that keeps every token, unchanged.
OFF = Sampler()
