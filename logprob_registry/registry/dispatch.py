"""The :class:`Registry`: the backends (a :class:`~.plugins.PluginSet`), choosing the backend of a
call and running it: explicit choice, the cached automatic choice, and the run-time fallback when
an automatically chosen backend fails; :meth:`Registry.run` says which backend ran and checks a
shard op's outputs against the op table (:mod:`.outputs`).

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

Strict mode (``lr.strict()``, or ``LOGPROB_REGISTRY_STRICT=1`` for the process) trades that
resilience for reproducibility: the automatic choice takes only backends that promise batch
invariance and determinism (and group invariance for the shard ops of a ``process_group=`` call),
ignores broken marks, and never falls back: the backend's error reaches the caller as raised and
marks nothing. So a strict call runs the backend a fresh process would choose, or fails; it never
silently continues on another backend whose numbers differ. An explicit choice of a backend
without those promises raises, naming the promise it lacks.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import config
from ..backend import Backend
from ..environment import Environment, get_environment
from ..opspec import OPS
from ..validation import inside_functorch_transform
from .errors import BackendFallbackWarning, NoEligibleBackendError
from .explanation import Explanation
from .key import ALWAYS_HIDDEN, Key, key_size
from .outputs import Expected
from .outputs import check as check_outputs
from .plugins import BUILTIN_PLUGINS, PluginSet, error_line
from .ranking import Verdict, automatic, declared_min_size, memory_verdicts, promise_of, rank, why_not

ENV_VAR = config.BACKEND.name
_backend_text = config.reader(ENV_VAR)  # asked on every call without an explicit choice
UNTESTED = config.declare(config.Variable(
    "LOGPROB_REGISTRY_UNTESTED_VERSIONS",
    lambda text: frozenset(filter(None, (s.strip() for s in text.split(",")))),
    frozenset(),
    "backend names (comma-separated) allowed to run outside the torch and requirement versions "
    "they declare, to test them there",
))

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("logprob_registry_forced", default=None)
STRICT_VAR = config.STRICT.name
_strict_text = config.reader(STRICT_VAR)
MEMORY_VAR = config.MEMORY.name
_memory_text = config.reader(MEMORY_VAR)  # the speed-over-memory setting: cached choices follow its text
# lr.strict(): True/False in this thread or task, None where no lr.strict() block is open (then the variable decides)
_strict: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("logprob_registry_strict", default=None)

#: What strict mode asks of a backend: (Backend field, the promise in words), for every op; the shard
#: ops (those a ``process_group=`` call runs, which no public function dispatches to directly) ask
#: :data:`GROUP_PROMISE` too.
STRICT_PROMISES: Tuple[Tuple[str, str], ...] = (
    ("batch_invariant", "batch invariance"), ("deterministic", "determinism"))
GROUP_PROMISE: Tuple[str, str] = ("group_invariant", "group invariance")

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


def strict_in_force() -> bool:
    """Whether strict mode holds here: the innermost open ``lr.strict()`` block of this thread or
    task decides, else ``LOGPROB_REGISTRY_STRICT``. Cheap (a context variable and one environment
    lookup): every call asks it."""
    on = _strict.get()
    if on is not None:
        return on
    if not _strict_text():  # unset or empty: off, without parsing
        return False
    return config.get(STRICT_VAR)


def strict_source() -> str:
    """Where strict mode comes from, for messages (call it when :func:`strict_in_force`)."""
    if _strict.get() is not None:
        return "lr.strict()"
    text = _strict_text() or b""
    return f"{STRICT_VAR}={(text.decode() if isinstance(text, bytes) else text).strip()}"


def missing_promises(backend: Backend, key: Key) -> List[str]:
    """The promises strict mode needs for ``key`` that ``backend`` does not make, in words."""
    wanted = STRICT_PROMISES + ((GROUP_PROMISE,) if OPS[key.op].function is None else ())
    return [words for flag, words in wanted if not getattr(backend, flag)]


def strict_verdicts(verdicts: List[Verdict], backends: List[Backend], key: Key) -> List[Verdict]:
    """``verdicts`` with every backend that could run ``key`` but lacks a promise strict mode needs
    passed over (``skipped``), saying which: ``explain`` then shows strict mode's verdicts."""
    by_name = {b.name: b for b in backends}
    out = []
    for v in verdicts:
        missing = missing_promises(by_name[v.name], key) if v.reason is None and v.name in by_name else []
        if missing:
            v = dataclasses.replace(v, skipped=f"strict mode: does not promise {' or '.join(missing)}")
        out.append(v)
    return out


def _memory_notes(key: Key, verdicts: List[Verdict]) -> tuple:
    """explain's lines on the op's memory promise for ``key``: what it is, and how it decided."""
    promise = promise_of(key)
    if promise is None:
        return ()
    lines = [f"memory promise of {key.op}: {promise.doc}; memory: each backend's verdict, from "
             "logprob-registry tune's reading where it has one, else declared (copies_logits breaks it)"]
    runnable = [v for v in verdicts if v.reason is None and v.broken is None]
    if config.get(MEMORY_VAR) == "speed":
        lines.append(f"{MEMORY_VAR}=speed: a backend breaking it is not passed over (speed over memory)")
    elif runnable and not any(v.keeps for v in runnable):
        lines.append("no backend that can run this keeps it: the choice is made as without it")
    elif any(v.keeps is False and v.eligible for v in runnable):
        lines.append("the backends keeping it are passed over here (why not): the choice is made as without it")
    return tuple(lines)


def _stacklevel() -> int:
    """The stack level of the first frame outside this package (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("logprob_registry"):
        frame, level = frame.f_back, level + 1
    return level


class Registry(PluginSet):
    """Every registered backend (:class:`~.plugins.PluginSet`: loading, plugins, ``prepare``) and the
    choices made among them for one environment and one source of measured rankings: explicit
    choice, the cached automatic choice, broken marks, calls with their fallback.

    ``environment`` is an :class:`Environment` (tests pass ``Environment.fake(...)``) or a function
    returning the one in force (the default: the detected environment, which
    ``environment.set_environment`` replaces process-wide).

    ``ranking`` is where measured rankings come from, or None (the default) for none: priority
    alone orders the backends. The process-wide registry (``get_registry``) takes the one the
    package wires (``registry.set_process_ranking``: the user's tuning file). A ranking source has
    two methods: ``entry(key, environment, versions)`` -> the measured ``tuning.cache.Entry`` for a
    key, or None (``versions``: backend name -> "distribution version", to tell a stale
    measurement), and ``status(environment, versions)`` -> one line for ``info``;
    ``tuning.cache.Tuning`` is one.
    """

    def __init__(
        self,
        builtins: Sequence[str] = BUILTIN_PLUGINS,
        entry_points: bool = True,
        environment: Union[Environment, Callable[[], Environment], None] = None,
        ranking: Any = None,
    ) -> None:
        super().__init__(builtins, entry_points)
        if environment is None:
            provider: Callable[[], Environment] = get_environment
        elif isinstance(environment, Environment):
            provider = lambda: environment  # noqa: E731
        else:
            provider = environment
        self._environment = provider
        self.ranking = ranking  # the measured ranking source, or None: priority decides
        self.default: Optional[Backend] = None  # the automatic choice resolve_default found
        self._choices_lock = threading.RLock()
        self._cache: Dict[Key, Backend] = {}
        self._strict_cache: Dict[Key, Backend] = {}  # the automatic choices under strict mode
        self._explicit_ok: Dict[Tuple[str, Key], Backend] = {}
        self._broken: Dict[Key, Dict[str, str]] = {}
        # (environment, plugins.generation, LOGPROB_REGISTRY_MEMORY's text) the caches are for
        self._state: Tuple[Any, int, Any] = (None, -1, None)

    # --------------------------------------------------------------- state
    def environment(self) -> Environment:
        """The environment in force (the caches follow it: a new one, or a change of the backends, clears them)."""
        env = self._environment()
        state = self._state
        if state[0] is not env or state[1] != self.generation or state[2] != _memory_text():
            with self._choices_lock:
                self._cache.clear()
                self._strict_cache.clear()
                self._explicit_ok.clear()
                names = {b.name for b in self.backends()}
                for marks in self._broken.values():  # a removed backend's marks go with it
                    for name in [n for n in marks if n not in names]:
                        del marks[name]
                self._state = (env, self.generation, _memory_text())
        return env

    def reset(self) -> None:
        """Forget every cached selection and every broken mark."""
        with self._choices_lock:
            self._cache.clear()
            self._strict_cache.clear()
            self._explicit_ok.clear()
            self._broken.clear()

    def tuning_status(self) -> str:
        """Whether a tuning ranking is in use, for ``info``."""
        if self.ranking is None:
            return "tuning: none (this registry was made without a ranking source); priority decides"
        return self.ranking.status(self.environment(), self.versions())

    def resolve_default(self, key: Key) -> Optional[Backend]:
        """The automatic choice for ``key`` (``import logprob_registry`` passes logprobs on the main
        device, float32, no gradients), kept as ``default``, or None. Cheap and never raising."""
        try:
            self.default = self._automatic(key, strict_in_force())
        except Exception:  # nothing eligible, or a plugin's check failing: explain() says why
            self.default = None
        return self.default

    def broken(self) -> Dict[Key, Dict[str, str]]:
        """Backends marked broken, per key, with the error that marked them."""
        self.environment()
        with self._choices_lock:
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
        text = _backend_text()
        if not text:
            return None, ""
        name = (text.decode() if isinstance(text, bytes) else text).strip()
        if name:
            return name, f"{ENV_VAR}={name}"
        return None, ""

    def verdicts(self, key: Key, strict: Optional[bool] = None) -> List[Verdict]:
        """Every backend's verdict for ``key``, best first; under strict mode (``strict``, None: the
        mode in force) with its verdicts and without broken marks (see the module docstring); then
        with each one's memory verdict for the op's promise, those breaking it passed over unless
        ``LOGPROB_REGISTRY_MEMORY=speed`` (:func:`.ranking.memory_verdicts`)."""
        if strict is None:
            strict = strict_in_force()
        env = self.environment()
        ranking = self.ranking
        measured = ranking.entry(key, env, self.versions()) if ranking is not None and key.vocab else None
        backends = self.backends()
        verdicts = rank(backends, key, env, None if strict else self._broken.get(key), config.get(UNTESTED.name),
                        measured)
        if strict:
            verdicts = strict_verdicts(verdicts, backends, key)
        return memory_verdicts(verdicts, backends, key, measured, config.get(MEMORY_VAR) == "speed")

    def select(self, key: Key, backend: Optional[str] = None) -> Backend:
        """The backend that runs ``key``: the explicit choice if any, else the automatic one."""
        strict = strict_in_force()
        name, source = self.forced(backend)
        if name is not None:
            return self._explicit(name, source, key, strict)
        return self._automatic(key, strict)

    def _explicit(self, name: str, source: str, key: Key, strict: bool = False) -> Backend:
        found = self._check_explicit(name, source, key)
        if strict:
            missing = missing_promises(found, key)
            if missing:
                self._refuse_strict(name, source, key, missing)
        return found

    def _refuse_strict(self, name: str, source: str, key: Key, missing: List[str]) -> None:
        """Raise: the explicit choice ``name`` lacks promises strict mode needs for ``key``."""
        promising = [v.name for v in self.verdicts(key, strict=True)
                     if v.reason is None and not (v.skipped or "").startswith("strict mode")]
        raise NoEligibleBackendError(
            f"backend {name!r} (chosen by {source}) cannot run {key.describe()} in strict mode "
            f"({strict_source()}): it does not promise {' or '.join(missing)}. Backends that can run it and "
            f"make strict mode's promises here: {', '.join(promising) or 'none'}; choose one of them, or leave "
            f"strict mode (lr.strict(False), or unset {STRICT_VAR}) to run {name!r}."
        )

    def _check_explicit(self, name: str, source: str, key: Key) -> Backend:
        env = self.environment()
        found = self._explicit_ok.get((name, key))
        if found is not None:
            return found
        chosen = self.get(name)
        reason, transient = why_not(chosen, key, env, config.get(UNTESTED.name))
        if reason is not None:
            eligible = [v.name for v in self.verdicts(key, strict=False) if v.reason is None]
            raise NoEligibleBackendError(
                f"backend {name!r} (chosen by {source}) cannot run {key.describe()}: {reason}. "
                f"Eligible here: {', '.join(eligible) or 'none'}; choose one of them, or drop the "
                "explicit choice to let the registry pick."
            )
        if not transient:
            with self._choices_lock:
                self._explicit_ok[(name, key)] = chosen
        return chosen

    def _automatic(self, key: Key, strict: bool = False) -> Backend:
        self.environment()
        cache = self._strict_cache if strict else self._cache
        found = cache.get(key)
        if found is not None:
            return found
        state = self._state
        verdicts = self.verdicts(key, strict)
        name = automatic(verdicts)
        if name is None:
            if strict:
                raise NoEligibleBackendError(
                    f"no registered backend can run {key.describe()} in strict mode ({strict_source()}): none "
                    "that can run it promises batch invariance and determinism"
                    + (" and group invariance" if OPS[key.op].function is None else "")
                    + f"; register one that does, or leave strict mode (lr.strict(False), or unset {STRICT_VAR})."
                    f"\n{self.explain(key, strict)}")
            raise NoEligibleBackendError(f"no registered backend can run {key.describe()}.\n{self.explain(key)}")
        found = self.get(name)
        ahead = verdicts[: [v.name for v in verdicts].index(name)]
        if not any(v.transient for v in ahead):  # a transient "no" above it: ask again next time
            with self._choices_lock:
                # not if, meanwhile, another thread marked it broken or the plugins changed: the
                # verdicts read before that would cache a stale choice for good
                if self._state is state and (strict or found.name not in self._broken.get(key, {})):
                    cache[key] = found
        return found

    def explain(self, key: Key, strict: Optional[bool] = None) -> Explanation:
        if strict is None:
            strict = strict_in_force()
        verdicts = self.verdicts(key, strict)
        forced, source = self.forced()
        if forced is not None:
            able = any(v.name == forced and v.reason is None for v in verdicts)
            # under strict mode an explicit choice lacking a promise raises: then nothing is chosen
            chosen = forced if able and not (strict and missing_promises(self.get(forced), key)) else None
        else:
            chosen = automatic(verdicts)
        marked = [dataclasses.replace(v, chosen=v.name == chosen) for v in verdicts]
        listed = {v.name for v in verdicts}
        degraded = tuple(d for d in self.degradations()
                         if d.backend in listed and d.concerns(key.device, key.dtype))
        return Explanation(key, marked, chosen, f"{forced} ({source})" if forced else None,
                           tuple(self.failures()), degraded, strict_source() if strict else None,
                           self._size_notes(key, verdicts, chosen if forced is None else None),
                           _memory_notes(key, verdicts))

    def _size_notes(self, key: Key, verdicts: List[Verdict], chosen: Optional[str]) -> tuple:
        """When the key's size is not known (explain or info without a shape), the automatic choice's
        ``min_size`` for the op decides every real call (which has a size): say which backend a
        smaller call runs on."""
        hidden_unknown = OPS[key.op].given(key.hidden, key.features) == "hidden" and not key.hidden
        if chosen is None or (key_size(key.op, key.vocab, key.hidden) is not None and not hidden_unknown):
            return ()
        least = self.get(chosen).least_size(key.op, key.hidden, key.features)
        if least is None:
            return ()
        after = [v.name for v in verdicts[[v.name for v in verdicts].index(chosen) + 1:] if v.eligible]
        below = next((n for n in after if self.get(n).least_size(key.op, key.hidden, key.features) is None), None)
        per_row = "V x H" if key.op in ALWAYS_HIDDEN or hidden_unknown else "V (V x H for hidden states)"
        declared = declared_min_size(self.get(chosen).min_size[key.op], OPS[key.op].given(key.hidden, key.features))
        return (f"size rule: {chosen} declares min_size[{key.op!r}]={declared}: a call whose {per_row} is smaller "
                f"runs on {below or 'the next eligible backend'}; explain(..., shape=..., hidden_size=...) shows "
                "the choice for a size",)

    # ------------------------------------------------------------ dispatch
    def call(self, key: Key, backend: Optional[str], args: tuple, options: Mapping[str, Any]) -> Any:
        """Run ``key.op`` through the selected backend, falling back if an automatic choice fails;
        what the backend returned (:meth:`run` also says which backend it was, and checks outputs
        as it describes)."""
        spec = OPS[key.op]
        chosen, out = self._dispatch(spec, key, backend, args, options)
        if spec.function is None:  # a shard op: checked against the op table
            check_outputs(chosen.name, key.op, out)
        return out

    def run(self, key: Key, backend: Optional[str], args: tuple, options: Mapping[str, Any],
            expected: Optional[Sequence[Optional[Expected]]] = None) -> Tuple[Backend, Any]:
        """:meth:`call`, and who ran: ``(backend, result)``, the backend that returned the result
        (after any fallback). A shard op's result (an op no public function dispatches to: the
        distributed core's) is checked against the op table (:func:`.outputs.check`: its count of
        outputs, and each against ``expected``, one :class:`~.outputs.Expected` or None per
        output), so that a backend returning something else is named with its op in one error."""
        spec = OPS[key.op]
        chosen, out = self._dispatch(spec, key, backend, args, options)
        if spec.function is None:
            check_outputs(chosen.name, key.op, out, expected)
        return chosen, out

    def preselect(self, key: Key, backend: Optional[str] = None) -> Optional[str]:
        """For a call of ``key`` made later, out of this context (a backward): raise now, as
        :meth:`select` would, if nothing can run it, and return what to pass it as ``backend``
        then: the explicit choice in force now (``backend``, ``use_backend``, the environment
        variable), or None for the automatic choice at that time."""
        self.select(key, backend)
        return self.forced(backend)[0]

    def _dispatch(self, spec, key: Key, backend: Optional[str], args: tuple,
                  options: Mapping[str, Any]) -> Tuple[Backend, Any]:
        if backend is None and _forced.get() is None and _strict.get() is None and not _backend_text() \
                and not _strict_text():
            # The common call (no explicit choice, strict mode not asked for: what forced() and
            # strict_in_force() say, asked inline), its cached automatic choice (issue #36: a small call).
            chosen = self._cache.get(key)
            state = self._state
            if chosen is None or state[0] is not self._environment() or state[1] != self.generation \
                    or state[2] != _memory_text():
                chosen = None
        else:
            chosen = None
        if chosen is None:
            strict = strict_in_force()
            name, source = self.forced(backend)
            if name is not None:
                chosen = self._explicit(name, source, key, strict)
                return chosen, chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
            if strict:  # no fallback: the backend's error reaches the caller as raised, and marks nothing
                chosen = self._automatic(key, True)
                return chosen, chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
            chosen = self._automatic(key)
        try:
            return chosen, chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
        except Exception as exc:
            if caller_fault(exc) is not None:
                raise
            return self._fall_back(spec, key, args, options, chosen, exc)

    def _fall_back(self, spec, key: Key, args: tuple, options: Mapping[str, Any], chosen: Backend,
                   exc: Exception) -> Tuple[Backend, Any]:
        """After the automatic choice ``chosen`` failed with ``exc`` (its own fault): mark it broken
        for ``key``, warn, and run the call on the next automatic choice, and so on; when none is
        left, the last error reaches the caller (and its backend stays unmarked)."""
        while True:
            with self._choices_lock:
                self._broken.setdefault(key, {})[chosen.name] = error_line(exc)
                self._cache.pop(key, None)
            try:
                replacement = self._automatic(key)
            except NoEligibleBackendError:
                with self._choices_lock:  # the last resort stays: its own error is more useful than "none left"
                    self._broken.get(key, {}).pop(chosen.name, None)
                raise exc from None
            warnings.warn(
                f"logprob_registry: backend {chosen.name!r} failed for {key.describe()} "
                f"({error_line(exc)}); using {replacement.name!r} instead for the rest of this process. "
                f"Force a backend with {ENV_VAR} or use_backend(), or use lr.strict(), to make such "
                "failures raise; lr.get_registry().reset() forgets the failure.",
                BackendFallbackWarning,
                stacklevel=_stacklevel(),
            )
            chosen = replacement
            try:
                return chosen, chosen.ops[key.op](*args, **spec.backend_options(chosen.features, options))
            except Exception as again:
                if caller_fault(again) is not None:
                    raise
                exc = again
