"""The kernels of the ``compiled`` backend, and their compilation by ``torch.compile`` (inductor).

Each kernel is a plain function of a 2-D (or 3-D) block of logits; :func:`_run` compiles it on
first use, with dynamic shapes, and turns any failure to compile or run into a
:class:`CompileError`, which the registry answers by falling back.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Callable, Dict, Optional

import torch

from . import _aot  # imports this module back, for the kernels, at call time

TORCH_SPEC = ">=2.6"
# split_reductions off: a row is reduced inside one program, so that its result never depends on
# the batch around it, on CUDA as on CPU. cpp.dynamic_threads on: a CPU kernel always has a parallel
# loop and lets OpenMP size it at run time; otherwise a kernel first compiled for a few rows (in this
# process or, through inductor's on-disk cache, in another) stays single-threaded for any size.
INDUCTOR_OPTIONS = {"split_reductions": False, "cpp.dynamic_threads": True}
# Compiles allowed per kernel (dtypes x layout classes x devices) before it counts as a storm.
RECOMPILE_LIMIT = 64


# --------------------------------------------------------------------------- kernels (compiled)
# A row is scaled as a = (x - max(x)) * k with k = log2(e) / t, and exponentiated with exp2, which
# inductor's CPU code computes faster than exp (docs/backends/compiled.md has the numbers). max(x / t) is
# max(x) / t, so the max pass reads the logits unscaled; subtracting the max before scaling keeps
# a row of large logits (1e4) accurate, and a log-probability (x[label] - max) / t - log(sum) never
# subtracts two large numbers.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _fwd_logprobs(x, idx, k: float):
    """Row max of x, sum of exp2(a), and the label's logit."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    s = torch.exp2((xf - m) * k).sum(-1, keepdim=True)
    return m, s, x.gather(-1, idx)


def _fwd_entropy(x, idx, k: float):
    """As :func:`_fwd_logprobs`, plus the sum of -a * exp2(a) (0 where x is -inf)."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    a = (xf - m) * k
    e = torch.exp2(a)
    s = e.sum(-1, keepdim=True)
    u = torch.where(torch.isneginf(xf), 0.0, -e * a).sum(-1, keepdim=True)
    return m, s, u, x.gather(-1, idx)


def _softcap(xf, cap: float):
    """``cap * tanh(xf / cap)``; -inf stays -inf (a masked token stays masked)."""
    return torch.where(torch.isneginf(xf), xf, torch.tanh(xf / cap) * cap)


def _fwd_logprobs_softcap(x, idx, k: float, cap: float):
    """:func:`_fwd_logprobs` of the softcapped logits (the label's logit softcapped, in fp32)."""
    xf = _softcap(_upcast(x), cap)
    m = xf.amax(-1, keepdim=True)
    s = torch.exp2((xf - m) * k).sum(-1, keepdim=True)
    return m, s, _softcap(_upcast(x.gather(-1, idx)), cap)


def _fwd_entropy_softcap(x, idx, k: float, cap: float):
    xf = _softcap(_upcast(x), cap)
    m = xf.amax(-1, keepdim=True)
    a = (xf - m) * k
    e = torch.exp2(a)
    s = e.sum(-1, keepdim=True)
    u = torch.where(torch.isneginf(xf), 0.0, -e * a).sum(-1, keepdim=True)
    return m, s, u, _softcap(_upcast(x.gather(-1, idx)), cap)


def _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: Optional[float] = None):
    """d/dx of g_lp * logp[idx] + g_ent * entropy, in x's dtype (g_lp is 0 where ignored). The terms
    of an op's missing output are skipped (``g_lp`` or ``g_ent`` None): lean for ``logprobs``. With
    ``cap``, of the softcapped logits: the gradient of z = cap * tanh(x / cap) times 1 - tanh**2."""
    xf = _upcast(x)
    if cap is not None:
        t = torch.tanh(xf / cap)
        dz = torch.where(torch.isneginf(xf), 0.0, 1.0 - t * t)
        xf = torch.where(torch.isneginf(xf), xf, t * cap)
    log2p = (xf - m) * k - log2_s
    p = torch.exp2(log2p)
    grad = 0.0
    if g_lp is not None:
        hit = torch.arange(x.shape[-1], device=x.device) == idx
        grad = torch.where(hit, g_lp, 0.0) - g_lp * p
    if g_ent is not None:
        grad = grad - g_ent * torch.where(torch.isneginf(xf), 0.0, p * (log2p * LN2 + h))
    if cap is not None:
        grad = grad * dz
    return (grad * inv_t).to(x.dtype)


def _tile_stats(x, k: float):
    """Per row of a (rows, TILE) block of one vocabulary tile: the raw max, and the sum of exp2(a)
    with a = (x - max) * k (0 for a tile of nothing but -inf)."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    a = (xf - torch.where(m == float("-inf"), 0.0, m)) * k
    return m, torch.exp2(a).sum(-1, keepdim=True)


def _tile_stats_entropy(x, k: float):
    """As :func:`_tile_stats`, plus the sum of exp2(a) * a (0 where x is -inf)."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    a = (xf - torch.where(m == float("-inf"), 0.0, m)) * k
    e = torch.exp2(a)
    return m, e.sum(-1, keepdim=True), torch.where(e == 0, 0.0, e * a).sum(-1, keepdim=True)


def _bwd(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float):
    return _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t)


def _bwd_inplace(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float):
    x.copy_(_grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t))


def _bwd_softcap(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: float):
    return _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t, cap)


def _bwd_inplace_softcap(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: float):
    x.copy_(_grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t, cap))


KERNELS: Dict[str, Callable] = {
    f.__name__.lstrip("_"): f for f in (_fwd_logprobs, _fwd_entropy, _bwd, _bwd_inplace, _fwd_logprobs_softcap,
                                        _fwd_entropy_softcap, _bwd_softcap, _bwd_inplace_softcap, _tile_stats,
                                        _tile_stats_entropy)
}
# The tile kernels' bits must not depend on the number of rows, nor on an autotuning run (which
# could pick another reduction order in another process): inductor's deterministic and
# batch-invariant modes, where this torch has them (torch >= 2.10).
EXTRA_OPTIONS: Dict[str, dict] = {
    name: {"deterministic": True, "batch_invariant": True} for name in ("tile_stats", "tile_stats_entropy")
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
             if x.device.type == "cpu" and name in _aot.FORWARD + _aot.BACKWARD else
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
