"""Helpers the sections share: the memory checks' skip and measurement, random upstream gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

import pytest
import torch

from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, describe, peak_extra_bytes

from ..harness import Harness

# The no-copy checks: the extra memory of a call may grow by this fraction of the growth of the
# logits' size, between a call on few rows and one on many (a fixed workspace does not grow at all;
# a copy of the logits grows as much as they do).
MEMORY_LIMIT = 0.5


def require_no_copy(lp: Harness) -> None:
    """Skip a memory check that does not apply to a backend that declares its copy."""
    if lp.backend.copies_logits:
        pytest.skip(f"{lp.name} declares copies_logits=True (it materialises a copy of the logits), "
                    "so the no-copy memory bound does not apply to it")


def peak(fn: Callable, lp: Harness, limit: float, retained: bool = False):
    """(result, bytes) of ``fn()``; a reading over ``limit`` is taken again and the lesser
    kept, since other processes can only make a reading larger than the call's own."""
    best = None
    try:
        for attempt in range(2):
            if attempt:
                del result  # noqa: F821 - its memory would otherwise count in the next baseline
            result, extra = peak_extra_bytes(fn, lp.device, retained=retained)
            best = extra if best is None else min(best, extra)
            if best < limit:
                break
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure peak memory here: {exc}")
    return result, best


@dataclass
class Growth:
    """The extra memory of one kind of call at two sizes, and that of what it must not copy."""

    rows: Tuple[int, int]
    extra: Tuple[int, int]   # the call's extra peak (or retained) bytes at each size
    size: Tuple[int, int]    # the bytes of the tensor it must not copy (or form) at each size

    @property
    def ratio(self) -> float:
        """How much the extra memory grew, as a fraction of how much the tensor grew."""
        return (self.extra[1] - self.extra[0]) / (self.size[1] - self.size[0])

    def describe(self, what: str) -> str:
        return (f"from {self.rows[0]} to {self.rows[1]} rows, {what} grew by {describe(self.size[1] - self.size[0])} "
                f"({describe(self.size[0])} to {describe(self.size[1])}) and the call's extra memory by "
                f"{describe(self.extra[1] - self.extra[0])} ({describe(self.extra[0])} to {describe(self.extra[1])}): "
                f"{self.ratio:.2f}x, above the {MEMORY_LIMIT}x allowed")


def growth(case: Callable[[int], Tuple[Callable[[], Any], int]], rows: Tuple[int, int], lp: Harness,
           retained: bool = False) -> Growth:
    """The :class:`Growth` of the call ``case(n)`` gives for ``n`` rows (``case`` returns the call
    and the size in bytes of what it must not copy), each call made once first (warm-up: lazy
    initialisation, compilation). A fixed cost (a workspace, a block of rows in float32, a
    compiled kernel) is the same at both sizes and cancels out; what grows with the rows stays.
    Readings can only be disturbed upwards: the small size keeps the lesser of two, and the large
    one is read again when the growth is over the limit."""
    extra, sizes = [], []
    try:
        for i, n in enumerate(rows):
            call, size = case(n)
            sizes.append(size)
            call()  # warm-up
            readings = []
            for _ in range(2):
                result, reading = peak_extra_bytes(call, lp.device, retained=retained)
                del result  # its memory would otherwise count in the next baseline
                readings.append(reading)
                if i == 1 and (reading - extra[0]) < MEMORY_LIMIT * (size - sizes[0]):
                    break
            extra.append(min(readings))
            del call
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure peak memory here: {exc}")
    return Growth(tuple(rows), tuple(extra), tuple(sizes))


def autocast(lp: Harness):
    """``torch.autocast`` on the backend's device, in bf16 (fp16 on a CUDA device without bf16);
    the test skips, naming the device, where this torch has no autocast for it."""
    device = lp.device.type
    dtype = torch.bfloat16
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        dtype = torch.float16
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device):
        pytest.skip(f"this torch has no autocast for {device} tensors")
    return torch.autocast(device, dtype=dtype)


def upstream(outputs: Sequence[torch.Tensor], seed: int) -> List[torch.Tensor]:
    """Random float64 upstream gradients (on the CPU), one per output, from their own generator
    (the same case in any test order)."""
    return [torch.randn(tuple(o.shape), generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
            for i, o in enumerate(outputs)]


def weighted_sum(outputs: Sequence[torch.Tensor], ups: Sequence[torch.Tensor],
                 skip: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``sum(output * upstream)``; where ``skip[i]`` is True (infinite reference outputs) the
    output is left out, so that ``-inf * 0`` makes no NaN."""
    total = 0
    for i, (o, u) in enumerate(zip(outputs, ups)):
        if i < len(skip):
            o = o.masked_fill(skip[i].to(o.device), 0.0)
        total = total + (o * u.to(o.device, o.dtype)).sum()
    return total


def same_strides_leaf(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """A leaf copy of ``t`` with the same strides, gaps included (``clone`` would close them)."""
    out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(requires_grad)

