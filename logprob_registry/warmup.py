"""Build the ``compiled`` backend's kernels ahead of time (``logprob-registry warmup``).

Without this, the first call of each kind in every process waits for torch.compile: 15-25 s on a
small CPU with an empty inductor cache, about 5 s with a warm one (importing dynamo and inductor
alone costs 2-3 s). :func:`warmup` builds AOTInductor packages of the kernels a user names, once
per machine and torch version, into ``LOGPROB_REGISTRY_KERNEL_CACHE`` (default
``~/.cache/logprob_registry/kernels``); a later process loads them with torch's C++ loader, without
dynamo or inductor, in milliseconds. How they are keyed and when they are used:
:mod:`logprob_registry.kernels.compiled._aot` and docs/backends/compiled.md ("First call").
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, List, Optional

from .dtypes import parse_dtype
from .kernels.compiled import _aot
from .kernels.compiled._aot import WANT, BuildError, Built, Spec

__all__ = ["OPS", "BuildError", "Built", "Spec", "plan", "summary", "warmup"]

#: The ops whose kernels can be built ahead.
OPS = tuple(WANT)


def plan(ops: Iterable[str] = ("logprobs",), dtypes: Iterable = ("float32",), *, backward: bool = True,
         inplace: bool = False, device: str = "cpu", vocab: Iterable[int] = (32768,)) -> List[Spec]:
    """The packages :func:`warmup` builds for these arguments, each once, in build order."""
    ops = [ops] if isinstance(ops, str) else list(ops)
    bad = [op for op in ops if op not in WANT]
    if bad or not ops:
        raise ValueError(f"warmup builds the kernels of {', '.join(OPS)}; got {ops!r}")
    dtypes = [parse_dtype(d) if isinstance(d, str) else d for d in ([dtypes] if isinstance(dtypes, str) else dtypes)]
    if not dtypes:
        raise ValueError("warmup needs at least one dtype, such as float32 or bfloat16")
    for d in dtypes:
        parse_dtype(str(d))  # a ValueError naming the float dtypes for anything else
    if device.split(":")[0] != "cpu":
        raise ValueError(f"prebuilt kernels exist for the CPU only; on {device}, the compiled backend's first "
                         "call uses torch.compile and its caches (docs/backends/compiled.md)")
    sizes = list(vocab)
    if not sizes or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in sizes):
        raise ValueError(f"vocab takes vocabulary sizes of 2 or more, got {sizes!r}")
    classes = sorted({v > _aot.SMALL_VOCAB for v in sizes}, reverse=True)
    found: List[Spec] = []
    for dtype in dtypes:
        for large in classes:
            for op in ops:
                found += [s for s in _aot.specs(op, dtype, large, backward, inplace) if s not in found]
    return found


def warmup(ops: Iterable[str] = ("logprobs",), dtypes: Iterable = ("float32",), *, backward: bool = True,
           inplace: bool = False, device: str = "cpu", vocab: Iterable[int] = (32768,), force: bool = False,
           folder: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> List[Built]:
    """Build the compiled backend's kernels for ``ops`` (``logprobs``, ``entropy``,
    ``logprobs_and_entropy``) and ``dtypes``: the forward, with ``backward`` the out-of-place
    backward, with ``inplace`` the in-place one (``inplace_backward=True``), for the vocabulary
    classes of the sizes in ``vocab`` (V <= 4096 and V > 4096 are separate kernels, as in inductor).

    Into ``folder`` (default ``LOGPROB_REGISTRY_KERNEL_CACHE``). A package already there is kept
    (``status == "present"``, no time spent) unless ``force``. Safe to run from several threads or
    processes at once. ``progress`` receives a line before each build (tens of seconds each on a
    small CPU). Returns what was done, one
    :class:`Built` per package. Raises :class:`BuildError` when a package cannot be built (no C++
    compiler, for one), ValueError for arguments it cannot take.
    """
    specs = plan(ops, dtypes, backward=backward, inplace=inplace, device=device, vocab=vocab)
    where = folder or _aot.folder()
    if where is None:
        raise BuildError("LOGPROB_REGISTRY_KERNEL_CACHE is off, so no prebuilt kernel would be loaded: unset "
                         "it, or set it to a folder, to build them")
    done = []
    for spec in specs:
        if progress is not None and (force or not os.path.exists(_aot.path(spec, where))):
            progress(f"building {spec.label()} ...")
        done.append(_aot.build(spec, where, force=force))
    return done


def summary(done: List[Built], seconds: Optional[float] = None) -> str:
    """One line: how many were built and how many were already there."""
    built = sum(b.status == "built" for b in done)
    text = f"{built} built, {len(done) - built} already there"
    return text if seconds is None else f"{text}, in {seconds:.1f} s"
