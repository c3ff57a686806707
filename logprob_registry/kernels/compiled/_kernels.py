"""The compilation of the ``compiled`` backend's kernels by ``torch.compile`` (inductor), and running them.

Each kernel is a plain function of a 2-D (or 3-D) block of logits (:mod:`._math`, re-exported
here); :func:`_run` runs its prebuilt package when one fits (:mod:`._aot`), else compiles it on
first use, with dynamic shapes, and turns any failure to compile or run into a
:class:`CompileError`, which the registry answers by falling back.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Callable, Dict, Optional

import torch

from . import _aot
from ._math import INDUCTOR_OPTIONS, KERNELS, LN2, LOG2E, _fwd_logprobs, _grad_math  # noqa: F401 - re-exported

TORCH_SPEC = ">=2.6"
# Compiles allowed per kernel (dtypes x layout classes x devices) before it counts as a storm.
RECOMPILE_LIMIT = 64


# The tile kernels' bits must not depend on the number of rows, nor on an autotuning run (which
# could pick another reduction order in another process): inductor's deterministic and
# batch-invariant modes, where this torch has them (torch >= 2.10).
EXTRA_OPTIONS: Dict[str, dict] = {
    name: {"deterministic": True, "batch_invariant": True}
    for name in ("tile_stats", "tile_stats_entropy", "tile_stats_ref", "tile_stats_entropy_ref")
}
_compiled: Dict[str, Callable] = {}
_lock = threading.RLock()


def _kernel(name: str) -> Callable:
    """The compiled form of kernel ``name``, created on first use (compiling happens at its call)."""
    with _lock:
        if name not in _compiled:
            options = dict(INDUCTOR_OPTIONS)
            options.update(_known_options(EXTRA_OPTIONS.get(name, {})))
            kwargs = dict(dynamic=True, fullgraph=True, options=options)
            if "recompile_limit" in inspect.signature(torch.compile).parameters:
                kwargs["recompile_limit"] = RECOMPILE_LIMIT
            _compiled[name] = torch.compile(KERNELS[name], **kwargs)
        return _compiled[name]


def _known_options(options: dict) -> dict:
    """The inductor options of ``options`` that this torch's inductor has."""
    if not options:
        return {}
    from torch._inductor import config as inductor_config

    return {k: v for k, v in options.items() if hasattr(inductor_config, k)}


def compile_counts() -> Dict[str, Optional[int]]:
    """How many compiled variants each kernel holds in this process (None where torch can't say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # a torch without the debug hook
        return {name: None for name in KERNELS}
    return {name: len(_debug_get_cache_entry_list(f.__code__)) for name, f in KERNELS.items()}


def reset() -> None:
    """Forget every compiled kernel and loaded package (tests use it to compile afresh)."""
    _aot.forget()
    with _lock:
        _compiled.clear()
        _noticed.clear()
        for f in KERNELS.values():
            torch._dynamo.reset_code(f.__code__)


class CompileError(RuntimeError):
    """torch.compile failed for one of this backend's kernels."""


log = logging.getLogger("logprob_registry")
_noticed: set = set()
#: What a first compile costs, by device type (measured on this project's 2-core CPU, torch 2.13).
EXPECTED_WAIT = {"cpu": "15-25 s on a small CPU with an empty inductor cache, a few seconds when an earlier "
                        "process left it in inductor's on-disk cache"}


def _notice(name: str, x: torch.Tensor) -> None:
    """Say once per process and kind of kernel (name, device type, dtype) that a call is about to
    wait for torch.compile: a WARNING on logger "logprob_registry"."""
    kind = (name, x.device.type, x.dtype)
    if kind in _noticed:
        return
    with _lock:
        if kind in _noticed:
            return
        _noticed.add(kind)
    wait = EXPECTED_WAIT.get(x.device.type, "tens of seconds with an empty inductor cache")
    dtype = str(x.dtype).replace("torch.", "")
    ahead = (f"`logprob-registry warmup --dtype {dtype}` builds it ahead, once per machine, and a later "
             "process then loads it in well under a second (docs/backends/compiled.md, \"First call\")"
             if x.device.type == "cpu" and name in _aot.FORWARD + _aot.BACKWARD + ("fwd_logprobs_rows", "bwd_rows") else
             "make one small call at start-up to pay it before the first training step")
    log.warning("logprob_registry: backend 'compiled' is compiling its %s kernel for %s %s logits with "
                "torch.compile (inductor), once per process: this call waits %s; %s.",
                name, x.device.type, dtype, wait, ahead)


def _run(name: str, *args):
    """Run kernel ``name``: through its prebuilt package when one fits the call (:mod:`._aot`), else
    compiled by torch.compile; a failure to compile or run becomes a :class:`CompileError`."""
    done = _aot.run(name, args)
    if done is not _aot.MISSING:
        return done
    _notice(name, args[0])
    try:
        with torch.no_grad():  # one grad mode for every call: the kernels specialise on it
            return _kernel(name)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise compile_error(f"its {name} kernel", args[0], "logits", exc) from exc


def compile_error(what: str, x: torch.Tensor, of: str, exc: Exception) -> CompileError:
    """The :class:`CompileError` for a kernel (``what``) that failed on ``x`` (``of``: what x is),
    naming the first line of what the compiler backend itself raised."""
    cause = exc
    while getattr(cause, "inner_exception", None) is not None:  # what the compiler backend raised
        cause = cause.inner_exception
    first = (str(cause).strip().splitlines() or [""])[0]
    return CompileError(f"torch.compile of {what} failed for {x.device.type} "
                        f"{str(x.dtype).replace('torch.', '')} {of} ({type(cause).__name__}: {first})")
