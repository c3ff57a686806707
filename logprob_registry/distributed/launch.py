"""Run a function on a local process group: ``world`` spawned processes joined by gloo, for the
tests, the conformance suite's distributed section and ``bench --process-group``.

Two layers keep a hang from hanging the caller: the group has a collective timeout (a rank whose
peer died or never comes fails with gloo's error), and the parent waits until a deadline, then
kills the processes it started and raises :class:`GroupTimeout`. Each rank's return value, or its
exception (type, message, traceback), comes back to the parent, so a test sees every rank's error,
not only the first.

``fn`` must be importable by name (a module-level function): "spawn" starts fresh interpreters.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch


class GroupTimeout(TimeoutError):
    """The group did not finish in time (a hang); its processes were killed."""


@dataclass
class RankResult:
    """What one rank returned, or the exception it raised."""

    rank: int
    value: Any = None
    error_type: Optional[str] = None   # qualified name of the exception's class
    error: Optional[str] = None        # its message
    traceback: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error_type is None

    def unwrap(self) -> Any:
        """The value, or a RuntimeError carrying the rank's traceback."""
        if not self.ok:
            raise RuntimeError(f"rank {self.rank} raised {self.error_type}: {self.error}\n{self.traceback}")
        return self.value


def _entry(rank: int, world: int, init_file: str, outdir: str, fn: Callable, args: tuple, threads: int,
           collective_timeout: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    result = RankResult(rank)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout))
        result.value = fn(rank, world, *args)
    except BaseException as exc:  # recorded, so that the parent sees every rank's error
        result.error_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
        result.error, result.traceback = str(exc), traceback.format_exc()
    finally:
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the result is saved; a teardown error changes nothing
                pass


def run(world: int, fn: Callable, *args: Any, timeout: float = 300.0, threads: int = 1,
        collective_timeout: float = 60.0) -> List[RankResult]:
    """``fn(rank, world, *args)`` on each rank of a fresh gloo group of ``world`` spawned processes;
    their :class:`RankResult`, in rank order.

    ``timeout``: seconds until the group counts as hung (its processes are then killed and
    :class:`GroupTimeout` raised). ``collective_timeout``: gloo's timeout for one collective.
    ``threads``: torch threads per rank (keep ``world * threads`` at most the cores).
    """
    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    tmp = tempfile.mkdtemp(prefix="logprob-group-")
    init_file = os.path.join(tmp, "rendezvous")  # must not exist yet: a fresh file per group
    try:
        context = mp.start_processes(_entry, args=(world, init_file, tmp, fn, args, threads, collective_timeout),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GroupTimeout(f"{getattr(fn, '__name__', fn)} on a group of {world} did not finish in "
                                       f"{timeout:.0f} s (a hang?); its processes were killed")
                try:
                    if context.join(timeout=min(left, 1.0)):
                        break
                except mp.ProcessExitedException as exc:  # a rank died without saving (a crash)
                    missing = [r for r in range(world) if not os.path.exists(os.path.join(tmp, f"rank{r}.pt"))]
                    if missing:
                        raise RuntimeError(f"rank(s) {missing} of a group of {world} died: {exc}") from None
                    break
        finally:
            for process in context.processes:  # only the processes started here
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
