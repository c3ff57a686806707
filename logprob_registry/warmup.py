"""Build backends' kernels ahead of time (``logprob-registry warmup``), through the registry.

A backend that can build its kernels ahead declares ``Backend(prepare=...)``
(:class:`~logprob_registry.backend.Preparation` says what it is asked); :func:`warmup` asks every
such backend, or those named, through :meth:`Registry.prepare
<logprob_registry.registry.Registry.prepare>`. Today that is ``compiled``: without prebuilt
kernels, the first call of each kind in every process waits for torch.compile (15-25 s on a small
CPU with an empty inductor cache, about 5 s with a warm one); with them, a later process loads
AOTInductor packages in milliseconds, without dynamo or inductor. Its packages go to
``LOGPROB_REGISTRY_KERNEL_CACHE`` (default ``~/.cache/logprob_registry/kernels``), once per machine
and torch version: docs/backends/compiled.md ("First call").
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Union

from .backend import Preparation, Prepared, PrepareError
from .dtypes import parse_dtype
from .opspec import OPS as _ALL_OPS
from .registry import get_registry

__all__ = ["BuildError", "PrepareError", "Prepared", "plan", "request", "summary", "warmup"]

#: The name of round 2 for a failed build.
BuildError = PrepareError


def request(ops: Iterable[str] = ("logprobs",), dtypes: Iterable = ("float32",), *, backward: bool = True,
            inplace: bool = False, device: str = "cpu", vocab: Iterable[int] = (32768,), force: bool = False,
            folder: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
            dry_run: bool = False) -> Preparation:
    """The :class:`Preparation` for these arguments (dtype names parsed), or a ValueError saying
    what an argument must be."""
    ops = [ops] if isinstance(ops, str) else list(ops)
    unknown = [op for op in ops if op not in _ALL_OPS]
    if unknown or not ops:
        raise ValueError(f"warmup builds the kernels of ops such as logprobs, entropy, logprobs_and_entropy; "
                         f"got {ops!r}")
    dtypes = [parse_dtype(d) if isinstance(d, str) else d for d in ([dtypes] if isinstance(dtypes, str) else dtypes)]
    if not dtypes:
        raise ValueError("warmup needs at least one dtype, such as float32 or bfloat16")
    for d in dtypes:
        parse_dtype(str(d))  # a ValueError naming the float dtypes for anything else
    sizes = list(vocab)
    if not sizes or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in sizes):
        raise ValueError(f"vocab takes vocabulary sizes of 2 or more, got {sizes!r}")
    return Preparation(tuple(ops), tuple(dtypes), device, tuple(sizes), bool(backward), bool(inplace), bool(force),
                       folder, bool(dry_run), progress)


def _names(backend: Union[str, Sequence[str], None]) -> Optional[List[str]]:
    return [backend] if isinstance(backend, str) else (None if backend is None else list(backend))


def plan(ops: Iterable[str] = ("logprobs",), dtypes: Iterable = ("float32",), *, backward: bool = True,
         inplace: bool = False, device: str = "cpu", vocab: Iterable[int] = (32768,), folder: Optional[str] = None,
         backend: Union[str, Sequence[str], None] = None, registry=None) -> List[Prepared]:
    """What :func:`warmup` would build for these arguments, each once, in build order (status
    ``"planned"``; ``detail``: the backend's own record): a dry run, which checks the arguments
    with every backend (ValueError) and builds nothing."""
    req = request(ops, dtypes, backward=backward, inplace=inplace, device=device, vocab=vocab, folder=folder,
                  dry_run=True)
    return _registry(registry).prepare(req, _names(backend))


def warmup(ops: Iterable[str] = ("logprobs",), dtypes: Iterable = ("float32",), *, backward: bool = True,
           inplace: bool = False, device: str = "cpu", vocab: Iterable[int] = (32768,), force: bool = False,
           folder: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
           backend: Union[str, Sequence[str], None] = None, registry=None) -> List[Prepared]:
    """Build the kernels of ``ops`` (``logprobs``, ``entropy``, ``logprobs_and_entropy``) for
    ``dtypes`` ahead of time, with every backend that can (``backend``: only those named): the
    forward, with ``backward`` the out-of-place backward, with ``inplace`` the in-place one
    (``inplace_backward=True``), for the vocabulary sizes in ``vocab`` (``compiled``: V <= 4096 and
    V > 4096 are separate kernels, as in inductor).

    Into ``folder`` (default: each backend's own; ``compiled``: ``LOGPROB_REGISTRY_KERNEL_CACHE``).
    What is already there is kept (``status == "present"``, no time spent) unless ``force``. Safe
    to run from several threads or processes at once. ``progress`` receives a line before each
    build (tens of seconds each on a small CPU). Returns one :class:`Prepared` per thing built or
    found, naming its backend. Raises :class:`PrepareError` when something cannot be built (no C++
    compiler, for one), ValueError for arguments a backend cannot take.
    """
    req = request(ops, dtypes, backward=backward, inplace=inplace, device=device, vocab=vocab, force=force,
                  folder=folder, progress=progress)
    return _registry(registry).prepare(req, _names(backend))


def _registry(registry):
    return get_registry() if registry is None else registry


def summary(done: List[Prepared], seconds: Optional[float] = None) -> str:
    """One line: how many were built and how many were already there."""
    built = sum(b.status == "built" for b in done)
    text = f"{built} built, {len(done) - built} already there"
    return text if seconds is None else f"{text}, in {seconds:.1f} s"
