"""What a backend returned, checked against the op table: the registry's one check of a shard op's
outputs (``Registry.run``), so that a backend returning the wrong number of outputs, or a tensor of
the wrong shape or dtype, is named with its op in one clear error instead of failing somewhere in
the distributed core.

The count comes from the op's ``OpSpec.outputs`` (one name: a tensor; more: a tuple of that many);
shapes and dtypes depend on the call (rows, tiles, the shard's width), so its caller says them:
one :class:`Expected` (or None: not checked, may be None) per output."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from ..opspec import OPS


class Expected(NamedTuple):
    """One output of a call: a tensor of ``shape`` (``flat``: of that many elements in any shape,
    which the caller reshapes) and, when given, of ``dtype``; ``words`` says it in the error."""

    shape: Tuple[int, ...]
    dtype: Optional[torch.dtype] = None
    flat: bool = False
    words: str = ""

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with ``value`` (``"of shape (2, 1)"``), or None."""
        if not isinstance(value, torch.Tensor):
            return f"of type {type(value).__name__}"
        fits = value.numel() == math.prod(self.shape) if self.flat else tuple(value.shape) == tuple(self.shape)
        if fits and (self.dtype is None or value.dtype == self.dtype):
            return None
        return f"of shape {tuple(value.shape)}" + (f" and dtype {value.dtype}" if self.dtype is not None else "")

    def describe(self) -> str:
        if self.words:
            return self.words
        return f"shape {tuple(self.shape)}" + (f" and dtype {self.dtype}" if self.dtype is not None else "")


def check(backend: str, op: str, out: Any, expected: Optional[Sequence[Optional[Expected]]] = None) -> None:
    """Raise RuntimeError naming ``backend`` and ``op`` when ``out`` is not what the op table says
    ``op`` returns (its count of outputs) or an output departs from ``expected`` (one entry per
    output; None: not checked)."""
    names = OPS[op].outputs
    if len(names) == 1:
        values: Sequence[Any] = (out,)
        if isinstance(out, (tuple, list)):
            raise RuntimeError(f"backend {backend!r}: {op} returned a {type(out).__name__} of {len(out)}, not one "
                               f"tensor ({names[0]}) as the op table specifies")
    else:
        if not isinstance(out, (tuple, list)) or len(out) != len(names):
            got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
            raise RuntimeError(f"backend {backend!r}: {op} returned {got}, not the {len(names)}-tuple "
                               f"({', '.join(names)}) the op table specifies")
        values = out
    for name, want, value in zip(names, expected or (), values):
        if want is None:
            continue
        problem = want.problem(value)
        if problem is not None:
            raise RuntimeError(f"backend {backend!r}: {op} returned {name} {problem}, expected {want.describe()}")
