"""The one timing engine of ``bench`` and ``tune``: wall and process-CPU seconds of calls, the device
synchronised around each, everything that is not the call's work (fresh inputs, gradients reset)
outside the clock.

``bench`` runs it in a child process per method (:mod:`.child`, so that a method's caches, allocator
state or crash never touch the next); ``tune`` runs :func:`time_calls` in its own process, on
each op's example inputs from the op table, and ranks by the median (:mod:`logprob_registry.tuning.measure`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Tuple, TypeVar, Union

import torch

T = TypeVar("T")


def synchronizer(device: Union[str, torch.device]) -> Callable[[], None]:
    """A function waiting for the work queued on ``device`` (a device or device type); on the CPU,
    or a device whose torch module has no ``synchronize``, one that does nothing."""
    device_type = torch.device(device).type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    module = getattr(torch, device_type, None) if device_type != "cpu" else None
    synchronize = getattr(module, "synchronize", None)
    return synchronize if synchronize is not None else (lambda: None)


def time_calls(call: Callable[[T], Any], prepare: Callable[[], T], *, repeat: int, warmup: int,
               sync: Callable[[], None] = lambda: None, release: Optional[Callable[[], None]] = None,
               ) -> Tuple[List[float], List[float]]:
    """``(wall seconds, process CPU seconds)`` of ``repeat`` calls ``call(prepare())`` after
    ``warmup`` untimed ones. ``prepare`` and ``release`` (after each call) run outside the clock;
    ``sync`` is called before the clock starts and before it stops."""
    times: List[float] = []
    cpu_times: List[float] = []
    for i in range(warmup + repeat):
        x = prepare()
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        call(x)
        sync()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if i >= warmup:
            times.append(wall)
            cpu_times.append(cpu)
        if release is not None:
            release()
    return times, cpu_times


def time_workload(w: Any) -> Tuple[List[float], List[float]]:
    """:func:`time_calls` of a :class:`~.workload.Workload`: its setting's ``repeat`` calls after
    ``warmup``, each on freshly prepared inputs, on its device."""
    s = w.s
    return time_calls(w.run, w.prepare, repeat=s.repeat, warmup=s.warmup, sync=synchronizer(s.device),
                      release=w.release)
