"""What a selection depends on besides the environment."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from ..dtypes import dtype_name

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


class Key(NamedTuple):
    """One kind of call: the op, the tensors' device type and dtype, whether a backward is needed,
    the optional features (see ``opspec.FEATURES``) its options use, and the bucket of its
    vocabulary size (``vocab_bucket``; 0: not known)."""

    op: str
    device: str
    dtype: torch.dtype
    requires_grad: bool
    features: frozenset = frozenset()
    vocab: int = 0

    def describe(self) -> str:
        grad = ", with gradients" if self.requires_grad else ""
        used = f", using {', '.join(sorted(self.features))}" if self.features else ""
        size = f", {describe_bucket(self.vocab)}" if self.vocab else ""
        return f"{self.op} on {self.device} {dtype_name(self.dtype)} tensors{grad}{size}{used}"
