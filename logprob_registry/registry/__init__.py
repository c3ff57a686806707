"""The registry: :mod:`.plugins` (the backends: loading, pluggy, ``prepare``), :mod:`.ranking` (a
pure function from backends, key and environment to verdicts) and :mod:`.dispatch`, whose
:class:`Registry` (a :class:`~.plugins.PluginSet` that also chooses: explicit choice, the cached
automatic choice, fallback, calls that say who ran) serves one environment and one source of
measured rankings; :func:`get_registry` is the process-wide one, whose ranking source the package
wires (:func:`set_process_ranking`: the user's tuning file; the registry knows nothing of tuning)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

from ..backend import Backend
from .dispatch import ENV_VAR, STRICT_VAR, Registry, _forced, _strict, caller_fault, strict_in_force
from .errors import BackendFallbackWarning, NoEligibleBackendError
from .explanation import Explanation
from .key import VOCAB_BUCKETS, Key, vocab_bucket
from .outputs import Expected
from .plugins import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, PluginFailure
from .ranking import Verdict, rank, why_not

__all__ = [
    "BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "ENV_VAR", "BackendFallbackWarning", "Expected", "Explanation", "Key",
    "NoEligibleBackendError", "PluginFailure", "Registry", "STRICT_VAR", "VOCAB_BUCKETS", "Verdict", "caller_fault",
    "get_registry", "rank", "set_process_ranking", "strict", "strict_in_force", "use_backend", "vocab_bucket",
    "why_not",
]


_registry: Optional[Registry] = None
_registry_lock = threading.Lock()
_process_ranking: Callable[[], Any] = lambda: None  # set_process_ranking's source; until then none


def get_registry() -> Registry:
    """The process-wide registry, created and loaded on first use; its ranking source is the one
    :func:`set_process_ranking` wired (``import logprob_registry`` wires the user's tuning file)."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = Registry(ranking=_process_ranking())
    _registry.load()
    return _registry


def set_process_ranking(source: Callable[[], Any]) -> None:
    """Make ``source()`` the process-wide registry's ranking source (see :class:`Registry`), now if it
    exists and whenever it is made. The package calls it at import with ``tuning.cache.Tuning`` (the
    user's tuning file, written by ``logprob-registry tune``; ``LOGPROB_REGISTRY_TUNING`` names
    another file, or ``off``): the registry sits below tuning and never imports it."""
    global _process_ranking
    with _registry_lock:
        _process_ranking = source
        if _registry is not None:
            _registry.ranking = source()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Force backend ``name`` inside the block (a ``backend=`` argument still overrides it).

    The choice is a context variable: it holds in this thread (and asyncio task) and in code it
    calls, not in threads started inside the block; for a process-wide choice set
    ``LOGPROB_REGISTRY_BACKEND``."""
    backend = get_registry().get(name)
    token = _forced.set(name)
    try:
        yield backend
    finally:
        _forced.reset(token)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Strict mode inside the block: no run-time fallback (the backend's error is raised as it is,
    nothing is marked broken), and the automatic choice only among backends that promise batch
    invariance and determinism (and group invariance for a ``process_group=`` call's shard ops); an
    explicit choice of a backend without them raises, naming the promise. For code that needs the
    same numbers or an error, never another backend's numbers after a failure.

    ``strict(False)`` switches it off inside an outer block or under ``LOGPROB_REGISTRY_STRICT=1``
    (blocks nest: the innermost decides). Like :func:`use_backend` it is a context variable: it
    holds in this thread (and asyncio task) and in code it calls, not in threads started inside
    the block; for the whole process set ``LOGPROB_REGISTRY_STRICT=1``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"strict(enabled) takes True or False, got {enabled!r}")
    token = _strict.set(enabled)
    try:
        yield
    finally:
        _strict.reset(token)
