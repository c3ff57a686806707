"""The peak memory one call adds on top of what is already allocated, in this process: how ``bench``
measures memory, and how the conformance suite checks a backend's memory promises.

On CUDA (and other devices whose torch module keeps allocator statistics) this is the caching
allocator's peak. On a Linux CPU it is the peak resident set size: glibc's mmap threshold is pinned
at 64 KiB (so that every large buffer is mapped, and unmapped when freed; best done before the
process allocates much, see :func:`pin_mmap_threshold`), free heap pages are returned to the
system, the kernel's high-water mark is reset (``/proc/self/clear_refs``, 5) and
read back from ``VmHWM``. Every byte a backend writes during the call is counted, however it
allocates it. Other processes can disturb a reading (the kernel reclaiming and faulting back pages
under memory pressure), always upwards: callers that compare with a bound retry before failing.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any, Callable, Optional, Tuple

import torch

_M_MMAP_THRESHOLD = -3
_PINNED_THRESHOLD = 64 * 1024


class MemoryMeasurementUnavailable(RuntimeError):
    """This process cannot measure a call's peak memory on this device (the reason says why)."""


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        raise MemoryMeasurementUnavailable("measuring CPU peak memory needs Linux (/proc/self/clear_refs)")
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        raise MemoryMeasurementUnavailable("measuring CPU peak memory needs glibc (mallopt, malloc_trim)") from None
    return libc


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise MemoryMeasurementUnavailable(f"/proc/self/status has no {key}")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise MemoryMeasurementUnavailable(f"cannot reset the peak RSS (/proc/self/clear_refs: {exc})") from None


def pin_mmap_threshold() -> bool:
    """Make glibc map every allocation of 64 KiB or more and unmap it when freed, for the rest of
    the process (as ``MALLOC_MMAP_THRESHOLD_=65536`` would). Done before the first test, it keeps
    large freed blocks out of the heap, where a later call could reuse resident pages unseen or
    fault in pages it does not hold at once; the conformance plugin does it when the suite runs,
    ``bench`` through ``MALLOC_MMAP_THRESHOLD_`` in its measuring processes.
    Returns False where this is not glibc."""
    try:
        libc = _libc()
    except MemoryMeasurementUnavailable:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _PINNED_THRESHOLD))


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device, retained: bool = False) -> Tuple[Any, int]:
    """Run ``fn()`` once; return its result and the peak bytes it allocated beyond the baseline
    (``retained=True``: the bytes still allocated when it returns, its result alive)."""
    device = torch.device(device)
    if device.type != "cpu":
        return _device_peak(fn, device, retained)
    libc = _libc()
    libc.mallopt(_M_MMAP_THRESHOLD, _PINNED_THRESHOLD)
    gc.collect()
    gc.disable()
    libc.malloc_trim(0)
    _reset_peak_rss()
    base, file_base = _status("VmRSS:"), _file_pages()
    try:
        result = fn()
    finally:
        gc.enable()
    peak = _status("VmRSS:" if retained else "VmHWM:") - base
    # Pages of files (libraries) read back in during the call are not memory the call allocated.
    return result, max(peak - max(_file_pages() - file_base, 0), 0)


def _file_pages() -> int:
    return _status("RssFile:") + _status("RssShmem:")


def _device_peak(fn: Callable[[], Any], device: torch.device, retained: bool) -> Tuple[Any, int]:
    module: Optional[Any] = getattr(torch, device.type, None)
    needed = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated")
    if module is None or not all(hasattr(module, n) for n in needed):
        raise MemoryMeasurementUnavailable(f"torch.{device.type} keeps no allocator statistics")
    gc.collect()
    module.synchronize(device)
    module.reset_peak_memory_stats(device)
    base = module.memory_allocated(device)
    result = fn()
    module.synchronize(device)
    after = module.memory_allocated(device) if retained else module.max_memory_allocated(device)
    return result, max(after - base, 0)


def describe(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


__all__ = ["MemoryMeasurementUnavailable", "describe", "peak_extra_bytes", "pin_mmap_threshold"]

