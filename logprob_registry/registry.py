"""The plugin manager, backend selection with reasons, explicit choice, and run-time fallback."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.metadata
import os
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pluggy
import torch

from . import hookspecs
from .backend import Backend
from .eligibility import Key, why_not
from .environment import Environment, get_environment
from .report import Candidate, Explanation, PluginFailure

ENTRY_POINT_GROUP = "logprob_registry"
ENV_VAR = "LOGPROB_REGISTRY_BACKEND"
BUILTIN_PLUGINS = (
    "logprob_registry.kernels.naive",
    "logprob_registry.kernels.chunked",
    "logprob_registry.kernels.npu",
    "logprob_registry.kernels.triton",
    "logprob_registry.kernels.compiled",
)


def _builtin_dist() -> str:
    try:
        return f"logprob-registry {importlib.metadata.version('logprob-registry')} (built-in)"
    except importlib.metadata.PackageNotFoundError:
        return "logprob-registry (built-in, not installed)"


_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("logprob_registry_forced", default=None)


class NoEligibleBackendError(RuntimeError):
    """No backend, or not the one explicitly asked for, can run an op for the given tensors."""


class BackendFallbackWarning(RuntimeWarning):
    """An automatically chosen backend failed at run time and another one took over."""


class Registry:
    """Every registered backend, the plugins they came from, and the cached selections."""

    def __init__(self, builtins: Sequence[str] = BUILTIN_PLUGINS, entry_points: bool = True) -> None:
        self._lock = threading.RLock()
        self._builtins = tuple(builtins)
        self._load_entry_points = entry_points
        self._loaded = False
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._backends: Dict[str, Backend] = {}
        self._failures: List[PluginFailure] = []
        self._dists: Dict[str, str] = {}  # plugin name -> "distribution version"
        self._cache: Dict[Key, Optional[Backend]] = {}
        self._cache_env: Optional[Environment] = None
        self._broken: Dict[Tuple[str, Key], str] = {}

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        """Register the built-ins, then every entry point of the group. Runs once."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            builtin_dist = _builtin_dist()
            for path in self._builtins:
                name = "builtin:" + path.rsplit(".", 1)[-1]
                try:
                    module = importlib.import_module(path)
                except Exception as exc:
                    self._failures.append(PluginFailure(name, builtin_dist, f"failed to import: {_err(exc)}"))
                    continue
                self.add_plugin(module, name=name, distribution=builtin_dist)
            if self._load_entry_points:
                for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
                    try:
                        obj = ep.load()
                    except Exception as exc:
                        self._failures.append(PluginFailure(ep.name, dist, f"failed to import: {_err(exc)}"))
                        continue
                    self.add_plugin(obj, name=ep.name, distribution=dist)

    def add_plugin(self, plugin: object, name: str, distribution: str = "registered at run time") -> List[str]:
        """Register a plugin object and collect its backends; returns their names.

        A plugin that raises while registering, or registers a name already taken, is recorded as a
        failure (see :meth:`failures`) rather than raising: one bad plugin never breaks the others.
        """
        with self._lock:
            try:
                self.pm.register(plugin, name=name)
            except Exception as exc:
                self._failures.append(PluginFailure(name, distribution, f"cannot be registered: {_err(exc)}"))
                return []
            self._dists[name] = distribution
            collected: List[Backend] = []

            def register(backend: Backend) -> None:
                if not isinstance(backend, Backend):
                    raise TypeError(f"register() takes a logprob_registry.Backend, got {type(backend).__name__}")
                collected.append(backend)

            impls = [i for i in self.pm.hook.register_backends.get_hookimpls() if i.plugin_name == name]
            try:
                for impl in impls:
                    impl.function(register=register)
            except Exception as exc:
                self._failures.append(PluginFailure(name, distribution, f"raised while registering: {_err(exc)}"))
                return []
            added = []
            for backend in collected:
                if backend.name in self._backends or backend.name in added:
                    owner = self._backends[backend.name].origin if backend.name in self._backends else name
                    self._failures.append(PluginFailure(
                        name, distribution,
                        f"backend name {backend.name!r} is already registered by {owner}; this one is ignored"))
                    continue
                self._backends[backend.name] = _with_origin(backend, name)
                added.append(backend.name)
            self.clear_cache()
            return added

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin and drop its backends and failures (used by tests)."""
        with self._lock:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self._backends = {k: b for k, b in self._backends.items() if b.origin != name}
            self._failures = [f for f in self._failures if f.plugin != name]
            self._dists.pop(name, None)
            self.clear_cache()

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._broken.clear()

    # ------------------------------------------------------------ introspection
    def backends(self) -> List[Backend]:
        self.load()
        return sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))

    def get(self, name: str) -> Backend:
        self.load()
        try:
            return self._backends[name]
        except KeyError:
            known = ", ".join(sorted(self._backends)) or "none"
            raise NoEligibleBackendError(f"no backend named {name!r} is registered; registered: {known}") from None

    def failures(self) -> List[PluginFailure]:
        self.load()
        return list(self._failures)

    def plugins(self) -> List[Tuple[str, str, List[str]]]:
        """(plugin name, distribution, backend names) for every plugin loaded."""
        self.load()
        return [
            (name, dist, sorted(b.name for b in self._backends.values() if b.origin == name))
            for name, dist in self._dists.items()
        ]

    def _env(self) -> Environment:
        env = get_environment()
        if env is not self._cache_env:
            self.clear_cache()
            self._cache_env = env
        return env

    def explain(self, key: Key) -> Explanation:
        self.load()
        env = self._env()
        forced, source = self.forced()
        chosen = None
        candidates = []
        for b in self.backends():
            reason = why_not(b, key, env)
            broken = self._broken.get((b.name, key))
            candidates.append(Candidate(b.name, b.priority, b.origin, reason, broken))
        if forced is not None:
            chosen = forced if any(c.name == forced and c.reason is None for c in candidates) else None
        else:
            chosen = next((c.name for c in candidates if c.eligible), None)
        candidates = [Candidate(c.name, c.priority, c.origin, c.reason, c.broken, c.name == chosen) for c in candidates]
        return Explanation(key, candidates, chosen, f"{forced} ({source})" if forced else None, tuple(self._failures))

    # ---------------------------------------------------------------- selection
    def forced(self, backend: Optional[str] = None) -> Tuple[Optional[str], str]:
        """The explicit choice in force, and where it comes from."""
        if backend is not None:
            return backend, "backend= argument"
        if _forced.get() is not None:
            return _forced.get(), "use_backend()"
        name = os.environ.get(ENV_VAR, "").strip()
        if name:
            return name, f"{ENV_VAR}={name}"
        return None, ""

    def select(self, key: Key, backend: Optional[str] = None) -> Backend:
        """The backend that runs ``key``: the explicit choice if any, else the automatic one."""
        self.load()
        name, source = self.forced(backend)
        if name is not None:
            return self._explicit(name, source, key)
        return self._automatic(key)

    def _explicit(self, name: str, source: str, key: Key) -> Backend:
        chosen = self.get(name)
        reason = why_not(chosen, key, self._env())
        if reason is not None:
            eligible = [b.name for b in self.backends() if why_not(b, key, self._env()) is None]
            raise NoEligibleBackendError(
                f"backend {name!r} (chosen by {source}) cannot run {key.describe()}: {reason}. "
                f"Eligible here: {', '.join(eligible) or 'none'}; choose one of them, or drop the "
                "explicit choice to let the registry pick."
            )
        return chosen

    def _automatic(self, key: Key) -> Backend:
        env = self._env()
        if key in self._cache:
            found = self._cache[key]
        else:
            found = next(
                (b for b in self.backends() if (b.name, key) not in self._broken and why_not(b, key, env) is None),
                None,
            )
            self._cache[key] = found
        if found is None:
            raise NoEligibleBackendError(
                f"no registered backend can run {key.describe()}.\n{self.explain(key)}"
            )
        return found

    def resolve_default(self) -> Optional[Backend]:
        """The automatic choice for logprobs on the main device (float32, no gradients), or None."""
        key = Key("logprobs", self._env().main_device, torch.float32, False)
        try:
            self.default: Optional[Backend] = self._automatic(key)
        except NoEligibleBackendError:
            self.default = None
        return self.default

    # ----------------------------------------------------------------- dispatch
    def call(self, key: Key, backend: Optional[str], args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Run ``key.op`` through the selected backend, falling back if an automatic choice fails."""
        self.load()
        name, source = self.forced(backend)
        if name is not None:
            return self._explicit(name, source, key).ops[key.op](*args, **kwargs)
        while True:
            chosen = self._automatic(key)
            try:
                return chosen.ops[key.op](*args, **kwargs)
            except torch.OutOfMemoryError:
                raise  # another backend would need at least as much memory: not a backend fault
            except Exception as exc:
                with self._lock:
                    self._broken[(chosen.name, key)] = _err(exc)
                    self._cache.pop(key, None)
                try:
                    replacement = self._automatic(key)
                except NoEligibleBackendError:
                    raise exc
                warnings.warn(
                    f"logprob_registry: backend {chosen.name!r} failed for {key.describe()} "
                    f"({_err(exc)}); using {replacement.name!r} instead for the rest of this process. "
                    f"Force a backend with {ENV_VAR} or use_backend() to make such failures raise.",
                    BackendFallbackWarning,
                    stacklevel=4,
                )


def _err(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _with_origin(backend: Backend, origin: str) -> Backend:
    return dataclasses.replace(backend, origin=origin)


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
    """Force backend ``name`` inside the block (a ``backend=`` argument still overrides it)."""
    backend = get_registry().get(name)
    token = _forced.set(name)
    try:
        yield backend
    finally:
        _forced.reset(token)
