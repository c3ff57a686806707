"""Choosing the backend of a call and running it: explicit choice, the cached automatic choice,
and the run-time fallback when an automatically chosen backend fails.

When does a failure mark a backend broken? Only when the backend itself is at fault. These are
never its fault, so they reach the caller unchanged and mark nothing:

- running out of memory (``torch.OutOfMemoryError``, or an allocator's ``RuntimeError`` on any
  device): another backend would need at least as much;
- a ``ConfigError`` (a bad environment variable) and the caller's bad input (validation raises
  before dispatch, so it never gets here);
- a call made inside a ``torch.func`` transform (``grad``, ``vmap``, ...), whose failure comes from
  the caller's context.

Anything else raised by an automatically chosen backend marks it broken for that kind of call
(the key) for the rest of the process, with one ``BackendFallbackWarning``, and the call is retried
with the next eligible backend; when no other backend is eligible, the error reaches the caller
and nothing is marked. ``Registry.reset()`` (``lr.get_registry().reset()``) forgets every
mark. A failure inside a backward pass cannot be retried: it reaches the caller.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .. import config
from ..backend import Backend
from ..environment import Environment
from ..opspec import OPS
from ..validation import inside_functorch_transform
from .errors import BackendFallbackWarning, NoEligibleBackendError
from .explanation import Explanation
from .key import Key
from .plugins import PluginSet, error_line
from .ranking import Verdict, automatic, rank, why_not

ENV_VAR = config.BACKEND.name
UNTESTED = config.declare(config.Variable(
    "LOGPROB_REGISTRY_UNTESTED_VERSIONS",
    lambda text: frozenset(filter(None, (s.strip() for s in text.split(",")))),
    frozenset(),
    "backend names (comma-separated) allowed to run outside the torch and requirement versions "
    "they declare, to test them there",
))

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("logprob_registry_forced", default=None)

_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate")


def caller_fault(exc: BaseException) -> Optional[str]:
    """Why ``exc`` is not the backend's fault (see the module docstring), or None when it is."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory"
    if isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES):
        return "out of memory"
    if isinstance(exc, config.ConfigError):
        return "configuration"
    if inside_functorch_transform():
        return "inside a torch.func transform"
    return None


def _stacklevel() -> int:
    """The stack level of the first frame outside this package (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("logprob_registry"):
        frame, level = frame.f_back, level + 1
    return level


class Dispatcher:
    """The selections of one registry: cached per key and environment, broken marks, calls."""

    def __init__(self, plugins: PluginSet, environment: Callable[[], Environment], ranking: Any = None) -> None:
        self._plugins = plugins
        self._environment = environment
        self.ranking = ranking  # the measured ranking source (see Registry), or None: priority decides
        self._lock = threading.RLock()
        self._cache: Dict[Key, Backend] = {}
        self._explicit_ok: Dict[Tuple[str, Key], Backend] = {}
        self._broken: Dict[Key, Dict[str, str]] = {}
        self._state: Tuple[Any, int] = (None, -1)  # (environment, plugins.generation) the caches are for

    # --------------------------------------------------------------- state
    def env(self) -> Environment:
        env = self._environment()
        if self._state[0] is not env or self._state[1] != self._plugins.generation:
            with self._lock:
                self._cache.clear()
                self._explicit_ok.clear()
                names = {b.name for b in self._plugins.backends()}
                for marks in self._broken.values():  # a removed backend's marks go with it
                    for name in [n for n in marks if n not in names]:
                        del marks[name]
                self._state = (env, self._plugins.generation)
        return env

    def reset(self) -> None:
        """Forget every cached selection and every broken mark."""
        with self._lock:
            self._cache.clear()
            self._explicit_ok.clear()
            self._broken.clear()

    def broken(self) -> Dict[Key, Dict[str, str]]:
        """Backends marked broken, per key, with the error that marked them."""
        self.env()
        with self._lock:
            return {k: dict(v) for k, v in self._broken.items() if v}

    # ----------------------------------------------------------- selection
    @staticmethod
    def forced(backend: Optional[str] = None) -> Tuple[Optional[str], str]:
        """The explicit choice in force, and where it comes from."""
        if backend is not None:
            return backend, "backend= argument"
        name = _forced.get()
        if name is not None:
            return name, "use_backend()"
        text = config.raw(ENV_VAR)
        if not text:
            return None, ""
        name = (text.decode() if isinstance(text, bytes) else text).strip()
        if name:
            return name, f"{ENV_VAR}={name}"
        return None, ""

    def verdicts(self, key: Key) -> List[Verdict]:
        env = self.env()
        ranking = self.ranking
        measured = ranking.entry(key, env, self._plugins.versions()) if ranking is not None and key.vocab else None
        return rank(self._plugins.backends(), key, env, self._broken.get(key), config.get(UNTESTED.name), measured)

    def select(self, key: Key, backend: Optional[str] = None) -> Backend:
        """The backend that runs ``key``: the explicit choice if any, else the automatic one."""
        name, source = self.forced(backend)
        if name is not None:
            return self._explicit(name, source, key)
        return self._automatic(key)

    def _explicit(self, name: str, source: str, key: Key) -> Backend:
        env = self.env()
        found = self._explicit_ok.get((name, key))
        if found is not None:
            return found
        chosen = self._plugins.get(name)
        reason, transient = why_not(chosen, key, env, config.get(UNTESTED.name))
        if reason is not None:
            eligible = [v.name for v in self.verdicts(key) if v.reason is None]
            raise NoEligibleBackendError(
                f"backend {name!r} (chosen by {source}) cannot run {key.describe()}: {reason}. "
                f"Eligible here: {', '.join(eligible) or 'none'}; choose one of them, or drop the "
                "explicit choice to let the registry pick."
            )
        if not transient:
            with self._lock:
                self._explicit_ok[(name, key)] = chosen
        return chosen

    def _automatic(self, key: Key) -> Backend:
        self.env()
        found = self._cache.get(key)
        if found is not None:
            return found
        state = self._state
        verdicts = self.verdicts(key)
        name = automatic(verdicts)
        if name is None:
            raise NoEligibleBackendError(f"no registered backend can run {key.describe()}.\n{self.explain(key)}")
        found = self._plugins.get(name)
        ahead = verdicts[: [v.name for v in verdicts].index(name)]
        if not any(v.transient for v in ahead):  # a transient "no" above it: ask again next time
            with self._lock:
                # not if, meanwhile, another thread marked it broken or the plugins changed: the
                # verdicts read before that would cache a stale choice for good
                if self._state is state and found.name not in self._broken.get(key, {}):
                    self._cache[key] = found
        return found

    def explain(self, key: Key) -> Explanation:
        verdicts = self.verdicts(key)
        forced, source = self.forced()
        if forced is not None:
            chosen = forced if any(v.name == forced and v.reason is None for v in verdicts) else None
        else:
            chosen = automatic(verdicts)
        marked = [dataclasses.replace(v, chosen=v.name == chosen) for v in verdicts]
        listed = {v.name for v in verdicts}
        degraded = tuple(d for d in self._plugins.degradations()
                         if d.backend in listed and d.concerns(key.device, key.dtype))
        return Explanation(key, marked, chosen, f"{forced} ({source})" if forced else None,
                           tuple(self._plugins.failures()), degraded)

    # ------------------------------------------------------------ dispatch
    def call(self, key: Key, backend: Optional[str], args: tuple, options: Mapping[str, Any]) -> Any:
        """Run ``key.op`` through the selected backend, falling back if an automatic choice fails."""
        spec = OPS[key.op]
        name, source = self.forced(backend)
        if name is not None:
            chosen = self._explicit(name, source, key)
            return chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
        while True:
            chosen = self._automatic(key)
            try:
                return chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
            except Exception as exc:
                if caller_fault(exc) is not None:
                    raise
                with self._lock:
                    self._broken.setdefault(key, {})[chosen.name] = error_line(exc)
                    self._cache.pop(key, None)
                try:
                    replacement = self._automatic(key)
                except NoEligibleBackendError:
                    with self._lock:  # the last resort stays: its own error is more useful than "none left"
                        self._broken.get(key, {}).pop(chosen.name, None)
                    raise exc from None
                warnings.warn(
                    f"logprob_registry: backend {chosen.name!r} failed for {key.describe()} "
                    f"({error_line(exc)}); using {replacement.name!r} instead for the rest of this process. "
                    f"Force a backend with {ENV_VAR} or use_backend() to make such failures raise; "
                    "lr.get_registry().reset() forgets the failure.",
                    BackendFallbackWarning,
                    stacklevel=_stacklevel(),
                )
