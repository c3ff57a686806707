"""Loading plugins: the built-in ones and every entry point of the group ``logprob_registry``.
pluggy lives here and nowhere else. A plugin that fails to import, raises while registering, or
registers a name already taken is recorded with the reason and never breaks the others.
:class:`PluginSet` is the registry's half that knows backends (and builds their kernels ahead of
time); :class:`~.dispatch.Registry` adds the choice among them."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pluggy

from .. import hookspecs
from ..backend import Backend, Degradation, Preparation, Prepared, PrepareError
from .errors import NoEligibleBackendError

ENTRY_POINT_GROUP = "logprob_registry"
BUILTIN_PLUGINS = (
    "logprob_registry.kernels.naive",
    "logprob_registry.kernels.chunked",
    "logprob_registry.kernels.npu",
    "logprob_registry.kernels.triton",
    "logprob_registry.kernels.compiled",
)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not contribute, and why. It never breaks the import of the package."""

    plugin: str
    distribution: str
    error: str


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _builtin_dist() -> str:
    try:
        return f"logprob-registry {importlib.metadata.version('logprob-registry')} (built-in)"
    except importlib.metadata.PackageNotFoundError:
        return "logprob-registry (built-in, not installed)"


class PluginSet:
    """The registered backends, the plugins they came from, and the plugins that failed."""

    def __init__(self, builtins: Sequence[str] = BUILTIN_PLUGINS, entry_points: bool = True) -> None:
        self._lock = threading.RLock()
        self._builtins = tuple(builtins)
        self._load_entry_points = entry_points
        self._loaded = False
        self._done = False
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._backends: Dict[str, Backend] = {}
        self._sorted: List[Backend] = []
        self._failures: List[PluginFailure] = []
        self._dists: Dict[str, str] = {}  # plugin name -> "distribution version"
        self.generation = 0  # bumped whenever the set of backends changes

    def load(self) -> None:
        """Register the built-ins, then every entry point of the group. Runs once."""
        if self._done:
            return
        with self._lock:  # other threads wait here until loading is done
            if self._loaded:  # done, or this thread is loading (a plugin that imports the registry)
                return
            self._loaded = True
            try:
                self._load_all()
            finally:  # whatever happened, loading is over: never half-loaded for good
                self._done = True

    def _load_all(self) -> None:
        builtin_dist = _builtin_dist()
        for path in self._builtins:
            name = "builtin:" + path.rsplit(".", 1)[-1]
            try:
                module = importlib.import_module(path)
            except Exception as exc:
                self._failures.append(PluginFailure(name, builtin_dist, f"failed to import: {error_line(exc)}"))
                continue
            self.add_plugin(module, name=name, distribution=builtin_dist)
        if self._load_entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
                try:
                    obj = ep.load()
                except Exception as exc:
                    self._failures.append(PluginFailure(ep.name, dist, f"failed to import: {error_line(exc)}"))
                    continue
                self.add_plugin(obj, name=ep.name, distribution=dist)

    def add_plugin(self, plugin: object, name: str, distribution: str = "registered at run time") -> List[str]:
        """Register a plugin object and collect its backends; returns their names. A plugin that
        raises while registering, or registers a name already taken, is recorded as a failure."""
        with self._lock:
            try:
                self.pm.register(plugin, name=name)
            except Exception as exc:
                self._failures.append(PluginFailure(name, distribution, f"cannot be registered: {error_line(exc)}"))
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
                self._failures.append(PluginFailure(name, distribution, f"raised while registering: {error_line(exc)}"))
                return []
            added: Dict[str, Backend] = {}
            for backend in collected:
                if backend.name in self._backends or backend.name in added:
                    owner = self._backends[backend.name].origin if backend.name in self._backends else name
                    self._failures.append(PluginFailure(
                        name, distribution,
                        f"backend name {backend.name!r} is already registered by {owner}; this one is ignored"))
                    continue
                added[backend.name] = dataclasses.replace(backend, origin=name)
            self._backends.update(added)
            self._changed()
            return list(added)

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin and drop its backends and failures (tests and ``bench --plugin``)."""
        with self._lock:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self._backends = {k: b for k, b in self._backends.items() if b.origin != name}
            self._failures = [f for f in self._failures if f.plugin != name]
            self._dists.pop(name, None)
            self._changed()

    def _changed(self) -> None:
        self._sorted = sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))
        self.generation += 1

    def backends(self) -> List[Backend]:
        """Every registered backend, highest priority first (ties by name)."""
        self.load()
        return list(self._sorted)

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

    def degradations(self) -> List[Degradation]:
        """What every backend that declares ``degradations`` reports running below its best, in
        backend order, each named after its backend. A report that raises is itself a degradation."""
        found: List[Degradation] = []
        for b in self.backends():
            if b.degradations is None:
                continue
            try:
                reported = list(b.degradations())
                if not all(isinstance(d, Degradation) for d in reported):
                    raise TypeError("it must return Degradation records")
            except Exception as exc:
                reported = [Degradation("its degradations() report", f"raised {error_line(exc)}")]
            found += [dataclasses.replace(d, backend=b.name) for d in reported]
        return found

    def versions(self) -> Dict[str, str]:
        """Each backend's plugin distribution and version (``"logprob-registry 0.2.0.dev0 (built-in)"``)."""
        self.load()
        return {b.name: self._dists.get(b.origin, "") for b in self._sorted}

    def plugins(self) -> List[Tuple[str, str, List[str]]]:
        """(plugin name, distribution, backend names) for every plugin loaded."""
        self.load()
        return [
            (name, dist, sorted(b.name for b in self._backends.values() if b.origin == name))
            for name, dist in self._dists.items()
        ]

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
