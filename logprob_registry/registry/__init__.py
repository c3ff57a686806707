"""The registry in three parts: :mod:`.plugins` (loading, pluggy), :mod:`.ranking` (a pure
function from backends, key and environment to verdicts) and :mod:`.dispatch` (explicit choice,
the cached automatic choice, fallback). :class:`Registry` puts them together for one environment
and one source of measured rankings; :func:`get_registry` is the process-wide one."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ..backend import Backend, Degradation, Preparation, Prepared, PrepareError
from ..environment import Environment, get_environment
from .dispatch import ENV_VAR, STRICT_VAR, Dispatcher, _forced, _strict, caller_fault, strict_in_force
from .errors import BackendFallbackWarning, NoEligibleBackendError
from .explanation import Explanation
from .key import VOCAB_BUCKETS, Key, vocab_bucket
from .plugins import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, PluginFailure, PluginSet
from .ranking import Verdict, rank, why_not

__all__ = [
    "BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "ENV_VAR", "BackendFallbackWarning", "Explanation", "Key",
    "NoEligibleBackendError", "PluginFailure", "Registry", "STRICT_VAR", "VOCAB_BUCKETS", "Verdict", "caller_fault",
    "default_ranking", "get_registry", "rank", "strict", "strict_in_force", "use_backend", "vocab_bucket", "why_not",
]


def default_ranking() -> Any:
    """The ranking source of the process-wide registry: the user's tuning file, written by
    ``logprob-registry tune`` (``LOGPROB_REGISTRY_TUNING`` names another file, or ``off``)."""
    from ..tuning.cache import Tuning

    return Tuning()


class Registry:
    """Every registered backend, and the selections made for one environment.

    ``environment`` is an :class:`Environment` (tests pass ``Environment.fake(...)``) or a function
    returning the one in force (the default: the detected environment, which
    ``environment.set_environment`` replaces process-wide).

    ``ranking`` is where measured rankings come from, or None (the default) for none: priority
    alone orders the backends. The process-wide registry (:func:`get_registry`) takes
    :func:`default_ranking`, the user's tuning file. A ranking source has two methods:
    ``entry(key, environment, versions)`` -> the measured ``tuning.cache.Entry`` for a key, or
    None (``versions``: backend name -> "distribution version", to tell a stale measurement), and
    ``status(environment, versions)`` -> one line for ``info``; ``tuning.cache.Tuning`` is one.
    """

    def __init__(
        self,
        builtins: Sequence[str] = BUILTIN_PLUGINS,
        entry_points: bool = True,
        environment: Union[Environment, Callable[[], Environment], None] = None,
        ranking: Any = None,
    ) -> None:
        self.plugins_set = PluginSet(builtins, entry_points)
        if environment is None:
            provider: Callable[[], Environment] = get_environment
        elif isinstance(environment, Environment):
            provider = lambda: environment  # noqa: E731
        else:
            provider = environment
        self._dispatcher = Dispatcher(self.plugins_set, provider, ranking)
        self.default: Optional[Backend] = None
        self.call = self._dispatcher.call  # the hot path: no extra frame
        self.select = self._dispatcher.select
        self.forced = self._dispatcher.forced

    # plugins
    def load(self) -> None:
        self.plugins_set.load()

    def add_plugin(self, plugin: object, name: str, distribution: str = "registered at run time") -> List[str]:
        """Register a plugin object and collect its backends; returns their names. A plugin that
        raises while registering, or registers a name already taken, is recorded as a failure."""
        return self.plugins_set.add(plugin, name, distribution)

    def remove_plugin(self, name: str) -> None:
        self.plugins_set.remove(name)

    def backends(self) -> List[Backend]:
        return self.plugins_set.backends()

    def get(self, name: str) -> Backend:
        return self.plugins_set.get(name)

    def failures(self) -> List[PluginFailure]:
        return self.plugins_set.failures()

    def plugins(self) -> List[Tuple[str, str, List[str]]]:
        return self.plugins_set.plugins()

    # selection
    def environment(self) -> Environment:
        return self._dispatcher.env()

    def explain(self, key: Key) -> Explanation:
        return self._dispatcher.explain(key)

    def verdicts(self, key: Key) -> List[Verdict]:
        return self._dispatcher.verdicts(key)

    def broken(self) -> Dict[Key, Dict[str, str]]:
        return self._dispatcher.broken()

    @property
    def ranking(self) -> Any:
        """The source of measured rankings this registry follows (None: priority alone)."""
        return self._dispatcher.ranking

    def tuning_status(self) -> str:
        """Whether a tuning ranking is in use, for ``info``."""
        if self.ranking is None:
            return "tuning: none (this registry was made without a ranking source); priority decides"
        return self.ranking.status(self.environment(), self.plugins_set.versions())

    # what backends report
    def degradations(self) -> List[Degradation]:
        """How the backends run below their best in this process right now, as each reports it
        through its ``Backend(degradations=...)`` (``compiled`` running a backward eagerly after its
        kernel failed to compile, say); ``explain`` shows those that concern its key, ``info`` all.
        A backend's own state is the record: what it stops doing (its ``reset()``) leaves the list."""
        return self.plugins_set.degradations()

    def preparers(self) -> List[Backend]:
        """The backends that can build their kernels ahead of time (they declare ``prepare``)."""
        return [b for b in self.backends() if b.prepare is not None]

    def prepare(self, request: Preparation, backends: Optional[Sequence[str]] = None) -> List[Prepared]:
        """Build ahead of time what ``request`` asks (``logprob-registry warmup``), with every backend
        that declares ``prepare``, or with those named in ``backends``; returns their records,
        each naming its backend. A request a backend cannot take raises ValueError naming it (with
        ``request.dry_run`` nothing is built, so a dry run first checks every backend); a failure
        to build raises :class:`PrepareError`; NoEligibleBackendError for an unknown name."""
        chosen = self.preparers() if backends is None else [self.get(name) for name in backends]
        lacking = [b.name for b in chosen if b.prepare is None]
        if lacking:
            able = ", ".join(b.name for b in self.preparers()) or "none"
            raise ValueError(f"backend {', '.join(map(repr, lacking))} builds nothing ahead (it declares no "
                             f"prepare); the backends that do: {able}")
        done: List[Prepared] = []
        for b in chosen:
            try:
                records = list(b.prepare(request))
            except ValueError as exc:
                raise ValueError(f"{b.name}: {exc}") from exc
            except PrepareError:
                raise
            except Exception as exc:
                raise PrepareError(f"{b.name}: {exc}") from exc
            done += [dataclasses.replace(r, backend=b.name) for r in records]
        return done

    def reset(self) -> None:
        """Forget cached selections and broken marks (see :mod:`.dispatch` for when a backend is
        marked broken)."""
        self._dispatcher.reset()

    clear_cache = reset

    def resolve_default(self, key: Key) -> Optional[Backend]:
        """The automatic choice for ``key`` (``import logprob_registry`` passes logprobs on the main
        device, float32, no gradients), kept as ``default``, or None. Cheap and never raising."""
        try:
            self.default = self._dispatcher._automatic(key, strict_in_force())
        except Exception:  # nothing eligible, or a plugin's check failing: explain() says why
            self.default = None
        return self.default


_registry: Optional[Registry] = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, created and loaded on first use."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = Registry(ranking=default_ranking())
    _registry.load()
    return _registry


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
