"""Helpers the sections share: the memory checks' skip and measurement, random upstream gradients."""

from __future__ import annotations

from typing import Callable, List, Sequence

import pytest
import torch

from ..harness import Harness
from ..memory import MemoryMeasurementUnavailable, peak_extra_bytes

# The no-copy checks allow a call this much extra memory, as a fraction of the logits' own size.
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

