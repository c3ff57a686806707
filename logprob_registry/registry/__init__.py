"""The registry in three parts: :mod:`.plugins` (loading, pluggy), :mod:`.ranking` (a pure
function from backends, key and environment to verdicts) and :mod:`.dispatch` (explicit choice,
the cached automatic choice, fallback). :class:`Registry` puts them together for one environment."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..backend import Backend
from ..environment import Environment, get_environment
from .dispatch import ENV_VAR, Dispatcher, _forced, caller_fault
from .errors import BackendFallbackWarning, NoEligibleBackendError
from .key import VOCAB_BUCKETS, Key, vocab_bucket
from .plugins import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, PluginFailure, PluginSet
from .ranking import Verdict, rank, why_not

__all__ = [
    "BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "ENV_VAR", "BackendFallbackWarning", "Key", "NoEligibleBackendError",
    "PluginFailure", "Registry", "VOCAB_BUCKETS", "Verdict", "caller_fault", "get_registry", "rank", "use_backend",
    "vocab_bucket", "why_not",
]


class Registry:
    """Every registered backend, and the selections made for one environment.

    ``environment`` is an :class:`Environment` (tests pass ``Environment.fake(...)``) or a function
    returning the one in force (the default: the detected environment, which
    ``environment.set_environment`` replaces process-wide).
    """

    def __init__(
        self,
        builtins: Sequence[str] = BUILTIN_PLUGINS,
        entry_points: bool = True,
        environment: Union[Environment, Callable[[], Environment], None] = None,
    ) -> None:
        self.plugins_set = PluginSet(builtins, entry_points)
        if environment is None:
            provider: Callable[[], Environment] = get_environment
        elif isinstance(environment, Environment):
            provider = lambda: environment  # noqa: E731
        else:
            provider = environment
        self._dispatcher = Dispatcher(self.plugins_set, provider)
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

    def explain(self, key: Key):
        return self._dispatcher.explain(key)

    def verdicts(self, key: Key) -> List[Verdict]:
        return self._dispatcher.verdicts(key)

    def broken(self) -> Dict[Key, Dict[str, str]]:
        return self._dispatcher.broken()

    def tuning_status(self) -> str:
        """Whether a tuning ranking is in use, for ``info``."""
        return self._dispatcher.tuning.status(self.environment(), self.plugins_set.versions())

    def reset(self) -> None:
        """Forget cached selections and broken marks (see :mod:`.dispatch` for when a backend is
        marked broken)."""
        self._dispatcher.reset()

    clear_cache = reset

    def resolve_default(self) -> Optional[Backend]:
        """The automatic choice for logprobs on the main device (float32, no gradients), or None.
        Cheap and never raising: ``import logprob_registry`` calls it."""
        key = Key("logprobs", self.environment().main_device, torch.float32, False)
        try:
            self.default = self._dispatcher._automatic(key)
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
                _registry = Registry()
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
