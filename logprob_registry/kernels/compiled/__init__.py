"""``compiled``: the log-softmax statistics fused by ``torch.compile`` (inductor), forward and backward.

The forward kernel reads each row of the logits where it lies (any strides and float dtype) and
returns a few numbers per row; the backward kernel writes the gradient in one pass, out of place
or over the logits (``inplace_backward=True``). Nothing of size N x V is allocated. One compile
per kind of call and process covers every batch size, sequence length, vocabulary and
temperature. How it works, what it costs the first time, and its measured numbers:
docs/backends/compiled.md.

Modules: :mod:`._math` (the kernels as plain functions), :mod:`._kernels` (their compilation),
:mod:`._ops` (layout, forward, autograd), :mod:`._aot` (prebuilt kernels: the backend's ``prepare``,
which ``logprob-registry warmup`` calls), :mod:`._shards` (the vocabulary-parallel ops behind
``process_group=``), :mod:`._hidden` (the fused op, and token_stats given hidden states). A backward
whose kernel fails to compile after its forward ran goes on eagerly; :func:`degradations` reports it
to the registry.
"""

from __future__ import annotations

import os
import shutil
import sys
from functools import lru_cache
from typing import Optional

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import FLOAT_DTYPES

from . import _aot, _hidden, _kernels, _ops, _shards
from ._kernels import INDUCTOR_OPTIONS, KERNELS, RECOMPILE_LIMIT, TORCH_SPEC, CompileError, compile_counts

__all__ = ["INDUCTOR_OPTIONS", "KERNELS", "RECOMPILE_LIMIT", "TORCH_SPEC", "CompileError", "available",
           "compile_counts", "degradations", "entropy", "logprobs", "logprobs_and_entropy", "reset",
           "token_stats"]


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None):
    return _ops.apply(logits, labels, temperature, ignore_index, True, False, inplace_backward, softcap)


def entropy(logits, *, temperature, softcap=None):
    return _ops.apply(logits, None, temperature, None, False, True, False, softcap)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None):
    return _ops.apply(logits, labels, temperature, ignore_index, True, True, inplace_backward, softcap)


def token_stats(inputs, labels, *, weight, bias, outputs, temperature, ignore_index, softcap=None):
    if weight is not None:  # hidden states (feature stats_hidden): the fused op's tiles
        return _hidden.token_stats(inputs, weight, labels, bias=bias, outputs=outputs, temperature=temperature,
                                   ignore_index=ignore_index, softcap=softcap)
    return _ops.token_stats(inputs, labels, outputs, temperature, ignore_index, softcap)


def reset() -> None:
    """Forget every compiled kernel and warm-up of this backend (tests use it to compile afresh),
    and the backwards run eagerly (:func:`degradations`)."""
    _kernels.reset()
    _ops.reset()
    _hidden.reset()


_WANT_OPS = {(True, False): "logprobs", (False, True): "entropy", (True, True): "logprobs_and_entropy"}


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


def degradations() -> list:
    """The backend's ``degradations``: the kinds of backward whose kernel failed to compile after
    their forward ran, which run the same math eagerly for the rest of the process (until
    :func:`reset`), one record per op, device and dtype."""
    found = {}
    for kind, reason in list(_ops._eager_backward.items()):  # (kernel, want, layout..., device, dtype)
        name, want, device, dtype = kind[0], kind[1], kind[-2], kind[-1]
        what = (f"the backward of {_WANT_OPS.get(want, 'its ops')} on {device} {_dtype(dtype)} logits runs eagerly, "
                f"a block of rows at a time, instead of its {name} kernel")
        found.setdefault((what, device, dtype), reason)
    for kind, reason in list(_hidden._eager.items()):  # (compute dtype, device, ...)
        what = (f"the backward of logprobs_from_hidden on {kind[1]} tensors (computed in {_dtype(kind[0])}) runs "
                "its tile function eagerly")
        found.setdefault((what, kind[1], None), reason)
    return [kit.Degradation(what, f"{reason}; compiled.reset() or a new process tries to compile again",
                           device, dtype)
            for (what, device, dtype), reason in found.items()]


# --------------------------------------------------------------------------- eligibility
def _compiler_candidates() -> tuple:
    """The C++ compilers inductor would try, in its order, without importing inductor."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:  # already imported: honour what the process configured
        cxx = config.cpp.cxx
        found = cxx if isinstance(cxx, (list, tuple)) else (cxx,)
    elif sys.platform == "win32":
        found = (os.environ.get("CXX", "cl"),)
    else:
        found = (os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++"),)
    return tuple(c for c in found if c)  # None stands for a conda download that is off by default


@lru_cache(maxsize=None)
def _found(candidates: tuple) -> bool:
    return any(shutil.which(c) for c in candidates)


def _disabled() -> bool:
    """Whether torch.compile is turned off in this process. Imports nothing: torch._dynamo is
    consulted only when something else already imported it."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"):
        return True
    dynamo_config = sys.modules.get("torch._dynamo.config")
    return bool(dynamo_config is not None and getattr(dynamo_config, "disable", False))


def available(env, device: str) -> Optional[str]:
    """Why torch.compile cannot compile for ``device`` tensors in this process, or None. (A Python
    that torch.compile does not support shows up at the first call, as a run-time fallback.)"""
    if _disabled():
        return "torch.compile is disabled in this process (TORCHDYNAMO_DISABLE=1 or torch._dynamo.config.disable)"
    if device == "cpu":
        candidates = _compiler_candidates()
        if _found(candidates):
            return None
        names = " or ".join(repr(c) for c in candidates) or "none configured"
        return (f"torch.compile on CPU needs a C++ compiler and none was found ({names}); "
                "install g++ or set CXX to a compiler")
    if device == "cuda":
        problem = env.requirement_problem("triton")
        if problem:
            return f"torch.compile on CUDA needs triton, and {problem}"
        problem = env.triton_capability_problem()
        return f"torch.compile on CUDA {problem}" if problem else None
    return f"torch.compile is not enabled for {device} tensors in this backend"


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="compiled",
        ops={"logprobs": logprobs, "entropy": entropy, "logprobs_and_entropy": logprobs_and_entropy,
             "logprobs_from_hidden": _hidden.logprobs_from_hidden, "token_stats": token_stats,
             "shard_stats": _shards.shard_stats, "shard_grad": _shards.shard_grad,
             "hidden_shard_stats": _shards.hidden_shard_stats, "hidden_shard_grad": _shards.hidden_shard_grad},
        devices={"cpu", "cuda"},
        dtypes=set(FLOAT_DTYPES),
        priority=kit.Priority.COMPILED,
        # tiny vocabularies (up to 256): its fixed cost per call outweighs the work; naive wins there
        min_vocab=257,
        # the fused op: on this project's 2-core CPU chunked's was as fast or faster at every
        # measured bucket with 4096 rows (and within 7% at 256 rows), so compiled's is an explicit or
        # a tuned choice: no bounded bucket reaches this size (docs/tuning.md, "Measured: the fused op");
        # the same for token_stats given hidden states, which runs the same tiles (not for its logits calls).
        min_size={"logprobs_from_hidden": 1 << 33, "token_stats": {"hidden": 1 << 33}},
        torch=TORCH_SPEC,
        autograd=True,
        available=available,
        inplace_backward=True,
        batch_invariant=True,
        deterministic=True,
        features={"softcap", "logits_dtype", "stats_hidden"},
        group_invariant=True,
        prepare=_aot.prepare,
        degradations=degradations,
        description="torch.compile (inductor) of the row statistics and of the one-pass gradient; "
                    "no N x V temporary; compiles once per kind of call and process",
    ))
