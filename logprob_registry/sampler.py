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

from .validation import LABEL_DTYPES, check_same_device, unravel, values_visible

# ------------------------------------------------------------------------------- checks
Shape = Sequence[int]   # the logits' shape (..., V): V is a shard's width with process_group=
Vocab = Optional[int]   # the whole vocabulary's size (None: not known yet, on a shard)


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
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}; one value for the "
                        "whole call (split a batch with per-row values by their value)")
    value = int(top_k)
    if value < -1:
        raise ValueError(f"top_k must be >= 1, or 0 or -1 (disabled, as in vLLM), got {value}")
    return None if value <= 0 or (vocab is not None and value >= vocab) else value


def check_top_p(top_p: object, shape: Shape = (), device: Any = None, vocab: Vocab = None) -> Optional[float]:
    """None when it keeps everything (None or 1)."""
    if top_p is None:
        return None
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
    Field("top_k", "int >= 1 or None: keep the top_k largest logits (every logit equal to the k-th largest "
                   "is kept)", True, check_top_k),
    Field("top_p", "float in (0, 1) or None: keep the most probable tokens whose mass reaches top_p (computed "
                   "after top_k; at least one token)", True, check_top_p),
    Field("min_p", "float in (0, 1] or None: drop tokens less probable than min_p times the most probable one",
          True, check_min_p),
    Field("keep", "bool (..., V) or int64 ids (..., K) (-1 for none), or None: only these tokens (the sampler's "
                  "own mask)", True, check_keep),
)
NAMES: Tuple[str, ...] = tuple(f.name for f in FIELDS)
_NO_FEATURES: frozenset = frozenset()
#: The features that truncate the distribution (a label outside the kept set gives -inf).
TRUNCATION = frozenset(f.name for f in FIELDS if f.truncates)


@dataclasses.dataclass(frozen=True, eq=False)
class Sampler:
    """A call's validated sampler keywords; a field that keeps every token is None.

    Build one with :meth:`validate` (a public function's keywords) or :meth:`of` (keywords a
    backend received, already validated)."""

    softcap: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
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

    def features(self) -> frozenset:
        """The backend features a call with this sampler needs (one per keyword in use)."""
        if self is OFF:
            return _NO_FEATURES
        return frozenset(name for name in NAMES if getattr(self, name) is not None)

    def keywords(self) -> Dict[str, Any]:
        """The keywords as a backend receives them."""
        return {name: getattr(self, name) for name in NAMES}

    def __repr__(self) -> str:
        used = ", ".join(f"{n}={'<tensor>' if n == 'keep' else getattr(self, n)!r}" for n in NAMES
                         if getattr(self, n) is not None)
        return f"Sampler({used})"


#: The sampler that keeps every token, unchanged.
OFF = Sampler()
