"""What a selection depends on besides the environment."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dtypes import dtype_name


class Key(NamedTuple):
    """One kind of call: the op, the tensors' device type and dtype, whether a backward is needed,
    and the optional features (see ``opspec.FEATURES``) its options use."""

    op: str
    device: str
    dtype: torch.dtype
    requires_grad: bool
    features: frozenset = frozenset()

    def describe(self) -> str:
        grad = ", with gradients" if self.requires_grad else ""
        used = f", using {', '.join(sorted(self.features))}" if self.features else ""
        return f"{self.op} on {self.device} {dtype_name(self.dtype)} tensors{grad}{used}"
