"""What a selection depends on besides the environment."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Tuple

import torch

from ..dtypes import dtype_name
from ..opspec import OPS

#: Upper edges of the vocabulary-size buckets. A selection may depend on the bucket of the
#: vocabulary, never on the number of rows (so a row's result never depends on its batch).
VOCAB_BUCKETS: Tuple[int, ...] = (256, 2048, 16384, 65536, 262144)


def vocab_bucket(vocab: Optional[int]) -> int:
    """The bucket of a vocabulary size: the upper edge of its range (``VOCAB_BUCKETS``), -1 above
    the last one, 0 when the size is not known."""
    if not vocab:
        return 0
    for edge in VOCAB_BUCKETS:  # a plain loop, not bisect: torch.compile traces it without a graph break
        if vocab <= edge:
            return edge
    return -1


#: Upper edges of the hidden-size buckets, for ops that take hidden states and a weight ``(V, H)``
#: (``logprobs_from_hidden``, ``kl_divergence``'s hidden sides): their work per row grows with
#: V x H, so a backend worth choosing for one hidden size may not be for another. Never the rows.
HIDDEN_BUCKETS: Tuple[int, ...] = (256, 1024, 4096, 16384)


def hidden_bucket(hidden_size: Optional[int]) -> int:
    """The bucket of a hidden size: the upper edge of its range (``HIDDEN_BUCKETS``), -1 above the
    last one, 0 when the size is not known or the op takes no hidden states."""
    if not hidden_size:
        return 0
    for edge in HIDDEN_BUCKETS:  # a plain loop, as vocab_bucket
        if hidden_size <= edge:
            return edge
    return -1


def hidden_range(bucket: int) -> Tuple[int, Optional[int]]:
    """``(lowest, highest)`` hidden size of a hidden bucket (highest None: unbounded)."""
    if bucket == -1:
        return HIDDEN_BUCKETS[-1] + 1, None
    i = HIDDEN_BUCKETS.index(bucket)
    return (HIDDEN_BUCKETS[i - 1] + 1 if i else 1), bucket


def bucket_range(bucket: int) -> Tuple[int, Optional[int]]:
    """``(lowest, highest)`` vocabulary size of a bucket (highest None: unbounded)."""
    if bucket == -1:
        return VOCAB_BUCKETS[-1] + 1, None
    i = VOCAB_BUCKETS.index(bucket)
    return (VOCAB_BUCKETS[i - 1] + 1 if i else 1), bucket


def describe_bucket(bucket: int) -> str:
    if bucket == 0:
        return "any vocabulary size"
    low, high = bucket_range(bucket)
    return f"vocabularies of {low} to {high}" if high else f"vocabularies above {low - 1}"


def describe_hidden(bucket: int) -> str:
    if bucket == 0:
        return "any hidden size"
    low, high = hidden_range(bucket)
    return f"hidden sizes of {low} to {high}" if high else f"hidden sizes above {low - 1}"


class _OpsWhere:
    """The ops of the op table for which ``OpSpec.<attribute>`` holds (``op in HIDDEN_KEYED``), read
    from the table at each test, so an op added to it is seen."""

    def __init__(self, attribute: str) -> None:
        self.attribute = attribute

    def __contains__(self, op: object) -> bool:
        spec = OPS.get(op) if isinstance(op, str) else None
        return spec is not None and bool(getattr(spec, self.attribute))

    def __iter__(self) -> Iterator[str]:
        return iter([op for op in OPS if op in self])

    def __repr__(self) -> str:
        return "{" + ", ".join(map(repr, self)) + "}"


#: The ops whose key holds a hidden-size bucket (their inputs may be hidden states and a weight),
#: and among them those whose inputs are always hidden states (``OpSpec.keyed_by_hidden``,
#: ``OpSpec.always_hidden``).
HIDDEN_KEYED = _OpsWhere("keyed_by_hidden")
ALWAYS_HIDDEN = _OpsWhere("always_hidden")


def key_size(op: str, vocab: int, hidden: int) -> Optional[float]:
    """The largest work per row a key's buckets allow: the vocabulary bucket's upper edge, times
    the hidden bucket's upper edge when the key has one (V x H: a hidden op computes V x H
    multiply-adds per row); infinity for an unbounded bucket; None when it is not known (no
    vocabulary, or an op always given hidden states without its hidden size). What
    ``Backend(min_size=...)`` is compared with: buckets only, never rows."""
    if not vocab or (op in ALWAYS_HIDDEN and not hidden):
        return None
    size = float("inf") if vocab == -1 else float(vocab)
    if hidden:
        size *= float("inf") if hidden == -1 else float(hidden)
    return size


class Key(NamedTuple):
    """One kind of call: the op, the tensors' device type and dtype, whether a backward is needed,
    the optional features (see ``opspec.FEATURES``) its options use, the bucket of its
    vocabulary size (``vocab_bucket``; 0: not known) and, for an op given hidden states and a
    weight, the bucket of its hidden size (``hidden_bucket``; 0 for every other op, or not known).
    Neither bucket ever depends on the number of rows."""

    op: str
    device: str
    dtype: torch.dtype
    requires_grad: bool
    features: frozenset = frozenset()
    vocab: int = 0
    hidden: int = 0

    def describe(self) -> str:
        grad = ", with gradients" if self.requires_grad else ""
        used = f", using {', '.join(sorted(self.features))}" if self.features else ""
        size = f", {describe_bucket(self.vocab)}" if self.vocab else ""
        size += f", {describe_hidden(self.hidden)}" if self.hidden else ""
        return f"{self.op} on {self.device} {dtype_name(self.dtype)} tensors{grad}{size}{used}"
