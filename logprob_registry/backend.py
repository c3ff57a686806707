"""The Backend record: what a backend computes, where, what it needs, and what it promises."""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Tuple

import torch
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .dtypes import FLOAT_DTYPES
from .opspec import FEATURES, OPS

if TYPE_CHECKING:
    from .environment import Environment

_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_DEVICE = re.compile(r"^[a-z][a-z0-9_]*$")

#: Promises a backend may make beyond its ops; the conformance suite checks each one it makes.
CAPABILITIES: Mapping[str, str] = {
    "autograd": "its ops support backward",
    "inplace_backward": "with inplace_backward=True its backward writes the logits' gradient into the logits' storage",
    "batch_invariant": "a row's result is bitwise independent of the other rows in the call",
    "deterministic": "the same inputs give bitwise the same results",
    "copies_logits": "it materialises a copy of the logits (the suite's no-copy checks do not apply)",
    "group_invariant": "its shard_stats (and hidden_shard_stats) give each grid tile's statistics bitwise from "
                       "that tile's own columns, its sums exact, so process_group= results do not depend on "
                       "the group size or the split",
}

Availability = Callable[["Environment", str], Optional[str]]


@dataclass(frozen=True)
class Preparation:
    """What ``logprob-registry warmup`` (:func:`logprob_registry.warmup.warmup`) asks a backend's
    ``prepare`` to build ahead of time: the kernels of ``ops`` for logits of ``dtypes`` on ``device``
    tensors, for vocabularies of the sizes in ``vocab``; with ``backward`` their out-of-place
    backward, with ``inplace`` their in-place one (``inplace_backward=True``).

    ``folder``: where to write (None: the backend's own default location). ``force``: build again
    what is already there. ``dry_run``: build nothing, only say what would be built (each record's
    status ``"planned"``), which also checks that the request can be taken. ``progress``, when
    given, receives a line before each lengthy step (:meth:`say`)."""

    ops: Tuple[str, ...] = ("logprobs",)
    dtypes: Tuple[torch.dtype, ...] = (torch.float32,)
    device: str = "cpu"
    vocab: Tuple[int, ...] = (32768,)
    backward: bool = True
    inplace: bool = False
    force: bool = False
    folder: Optional[str] = None
    dry_run: bool = False
    progress: Optional[Callable[[str], None]] = field(default=None, compare=False)

    def say(self, line: str) -> None:
        """Report progress (a line before each build, say)."""
        if self.progress is not None:
            self.progress(line)

    def record(self, what: str, path: str, status: str, seconds: float = 0.0, detail: Any = None) -> "Prepared":
        """The record of one thing built (``status`` ``"built"``), found already built
        (``"present"``) or, in a dry run, to be built (``"planned"``)."""
        return Prepared(what, path, status, seconds, detail)


@dataclass(frozen=True)
class Prepared:
    """One thing a backend's ``prepare`` built, found or (dry run) would build: ``what`` it is in
    words, the file it is in, ``status`` (``"built"``, ``"present"`` or ``"planned"``), the seconds
    building took, the backend's own record of it (``detail``) and the backend's name (set by the
    registry)."""

    what: str
    path: str
    status: str
    seconds: float = 0.0
    detail: Any = field(default=None, compare=False)
    backend: str = ""


class PrepareError(RuntimeError):
    """A backend could not build what it was asked to build ahead (the message says why and what to do)."""


@dataclass(frozen=True)
class Degradation:
    """A way a backend runs below its best in this process, reported by its ``degradations``
    (``compiled`` running a backward eagerly after its kernel failed to compile, say): ``what``
    runs degraded and ``reason``, why. ``device`` and ``dtype`` narrow it to calls on those tensors
    (None: any); ``backend`` is set by the registry. ``explain`` and ``info`` show it."""

    what: str
    reason: str
    device: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    backend: str = ""

    def concerns(self, device: str, dtype: torch.dtype) -> bool:
        """Whether it applies to calls on ``device`` tensors of ``dtype``."""
        return self.device in (None, device) and self.dtype in (None, dtype)

    def describe(self) -> str:
        return f"{self.backend}: {self.what}: {self.reason}" if self.backend else f"{self.what}: {self.reason}"


Preparer = Callable[[Preparation], Iterable[Prepared]]


class Priority:
    """Named bands for ``Backend(priority=...)``: higher wins among the backends eligible for a call.

    Each built-in sits on the band that says why it ranks where it does; a plugin picks the band
    that describes it, or a value between two bands (``Priority.KERNEL - 5``: a fused kernel that
    should yield to the built-in one). The values are plain ints.
    """

    #: below every built-in: never the automatic choice where ``naive`` can run, only chosen by name
    #: (the triton interpreter on the CPU, a debugging tool)
    EXPLICIT_ONLY = -10
    #: the last resort, correct everywhere but copying the logits (``naive``); ``Backend``'s default
    LAST_RESORT = 0
    #: pure PyTorch on every device, no copy of the logits (``chunked``)
    PORTABLE = 10
    #: one fused op from a device vendor's library, its gaps covered around it (``npu``)
    VENDOR_OP = 15
    #: kernels generated by ``torch.compile`` (``compiled``)
    COMPILED = 20
    #: hand-written fused kernels, one pass over the vocabulary (``triton``)
    KERNEL = 30
    #: every built-in stays below this: a backend at or above it wins wherever it is eligible
    ABOVE_BUILTINS = 50


@dataclass(frozen=True, repr=False)
class Backend:
    """One implementation of some of the ops, and the conditions under which it may run.

    The keyword names are the plugin API and never change meaning:

    - ``ops``: op name -> function, called as the op table (:mod:`logprob_registry.opspec`) says;
    - ``devices``: device types it runs on (any type torch can name: ``cpu``, ``cuda``, ``npu``,
      ``xpu``, ``mps``, ``hpu``, a PrivateUse1 backend's name, ...);
    - ``dtypes``: floating dtypes of the logits (hidden states) it accepts;
    - ``priority``: higher wins among eligible backends; :class:`Priority` names the bands (built-ins
      stay below ``Priority.ABOVE_BUILTINS``, 50);
    - ``torch``: a version specifier such as ``">=2.4"`` ("" for any);
    - ``requires``: PEP 508 requirements such as ``"triton>=3.6"`` or ``"torch_npu"``, checked
      against the installed distributions (a bare name that is no distribution must be an
      importable module);
    - ``available``: optional ``f(environment, device_type) -> None or a sentence saying why not``;
    - ``features``: optional options of the op table it implements (see ``opspec.FEATURES``);
    - ``min_vocab``: the automatic choice passes it over for calls whose vocabulary bucket lies
      below this size (a backend whose fixed cost is not worth paying on small rows); an
      explicit choice is unaffected. Buckets, not exact sizes, so that the choice never depends
      on anything but the vocabulary's bucket (``registry.key.VOCAB_BUCKETS``);
    - ``min_size``: optional ``{op: size}``: the automatic choice passes it over for calls of that
      op whose buckets allow less than ``size`` of work per row: the vocabulary bucket's upper edge,
      times the hidden-size bucket's upper edge for an op given hidden states (V x H,
      ``registry.key.key_size``); ``{"logprobs_from_hidden": 1 << 23}`` leaves the fused op's
      small shapes to the others. For an op given logits or hidden states (``token_stats``) a
      size may be given per kind of inputs, ``{"token_stats": {"hidden": 1 << 23}}`` (a kind not
      named: no rule). Buckets only, never rows; an explicit choice is unaffected;
    - capabilities (:data:`CAPABILITIES`): what it promises, each checked by the suite;
    - ``prepare``: optional ``f(request) -> [Prepared, ...]`` that builds the backend's kernels
      ahead of time, so that a later process's first call need not (``logprob-registry warmup``
      calls it, through ``Registry.prepare``, for every backend that declares it). ``request`` is
      a :class:`Preparation` (ops, dtypes, device, vocabulary sizes, backward, folder, force,
      dry run, progress); it returns a :class:`Prepared` per thing built or found (made with
      ``request.record(...)``), raises ValueError for a request it cannot take (an op or device it
      has nothing to build for), and any other exception when building fails;
    - ``degradations``: optional ``f() -> [Degradation, ...]``: how the backend runs below its
      best in this process right now (a kernel that failed to compile, run eagerly instead), so
      that ``explain`` and ``info`` say so (``Registry.degradations()`` collects them);
    - ``memory``, ``description``: words for ``explain`` and ``info``.

    Deprecated (working for one more release, with a DeprecationWarning): ``triton=SPEC`` (use
    ``requires=("triton" + SPEC,)``) and ``available_on=f(environment, device_type)`` (use
    ``available``, which now takes the device type too; a one-argument ``available`` still works).
    """

    name: str
    ops: Mapping[str, Callable[..., object]]
    devices: frozenset = frozenset({"cpu"})
    dtypes: frozenset = frozenset(FLOAT_DTYPES)
    priority: int = Priority.LAST_RESORT
    torch: str = ""
    requires: tuple = ()
    autograd: bool = True
    available: Optional[Availability] = None
    features: frozenset = frozenset()
    min_vocab: int = 0
    min_size: Mapping[str, int] = field(default_factory=dict)
    inplace_backward: bool = False
    batch_invariant: bool = False
    deterministic: bool = True
    copies_logits: bool = False
    group_invariant: bool = False
    prepare: Optional[Preparer] = field(default=None, compare=False)
    degradations: Optional[Callable[[], Iterable[Degradation]]] = field(default=None, compare=False)
    memory: str = ""
    description: str = ""
    triton: str = ""  # deprecated
    available_on: Optional[Availability] = None  # deprecated
    origin: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"backend name {self.name!r} must be lowercase letters and digits joined by dashes, "
                "such as 'my-kernel'"
            )
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(
                f"backend {self.name!r} declares unknown ops {sorted(unknown)}; known ops: {', '.join(OPS)}"
            )
        if not self.ops:
            raise ValueError(f"backend {self.name!r} implements no op; give ops={{'logprobs': fn, ...}}")
        for op, fn in self.ops.items():
            if not callable(fn):
                raise TypeError(f"backend {self.name!r}: ops[{op!r}] is {fn!r}, not a callable")
        devices = frozenset({self.devices} if isinstance(self.devices, str) else self.devices)
        bad = sorted(d for d in devices if not isinstance(d, str) or not _DEVICE.match(d))
        if bad or not devices:
            raise ValueError(
                f"backend {self.name!r}: devices must be device types such as 'cpu', 'cuda' or 'npu' "
                f"(lowercase, as torch.device names them), got {sorted(map(repr, devices))}"
            )
        dtypes = frozenset(self.dtypes)
        if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
            raise TypeError(
                f"backend {self.name!r}: dtypes must be floating torch dtypes, got {sorted(map(str, dtypes))}")
        try:
            SpecifierSet(self.torch)
        except InvalidSpecifier as exc:
            raise ValueError(
                f"backend {self.name!r}: torch={self.torch!r} is not a version specifier such as '>=2.4'"
            ) from exc
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        for req in requires:
            try:
                Requirement(req)
            except (InvalidRequirement, TypeError) as exc:
                raise ValueError(
                    f"backend {self.name!r}: requires entry {req!r} is not a requirement such as "
                    "'triton>=3.6' or 'torch_npu'"
                ) from exc
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"backend {self.name!r}: priority must be an int such as Priority.KERNEL (30; built-ins "
                            f"use -10 to 30, 50 or more wins wherever eligible), got {self.priority!r}")
        if isinstance(self.min_vocab, bool) or not isinstance(self.min_vocab, int) or self.min_vocab < 0:
            raise ValueError(f"backend {self.name!r}: min_vocab must be an int >= 0, got {self.min_vocab!r}")
        min_size = dict(self.min_size or {})
        for op, size in min_size.items():
            if op not in OPS or op not in self.ops:
                raise ValueError(f"backend {self.name!r}: min_size names {op!r}, which it does not implement; "
                                 f"give sizes for its own ops ({', '.join(sorted(self.ops))})")
            by_kind = isinstance(size, Mapping)
            unknown = sorted(set(size) - {"logits", "hidden"}) if by_kind else []
            if unknown:
                raise ValueError(f"backend {self.name!r}: min_size[{op!r}] maps the kinds of inputs 'logits' and "
                                 f"'hidden' to sizes, got {', '.join(map(repr, unknown))}")
            for n in size.values() if by_kind else (size,):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"backend {self.name!r}: min_size[{op!r}] must be an int >= 0 (V, or V x H for "
                                     "an op given hidden states), or a mapping of 'logits' and/or 'hidden' to such "
                                     f"ints, got {size!r}")
            if by_kind:
                min_size[op] = dict(size)
        features = frozenset({self.features} if isinstance(self.features, str) else self.features)
        unknown = sorted(features - set(FEATURES))
        if unknown:
            known = ", ".join(FEATURES) or "none yet"
            raise ValueError(f"backend {self.name!r} declares unknown features {unknown}; known: {known}")
        available = self.available
        if self.triton:
            _deprecated(self.name, "triton=SPEC", f'requires=("triton{self.triton}",)')
            try:
                SpecifierSet(self.triton)
            except InvalidSpecifier as exc:
                raise ValueError(
                    f"backend {self.name!r}: triton={self.triton!r} is not a version specifier such as '>=3.0'"
                ) from exc
            requires = tuple(r for r in requires if Requirement(r).name != "triton") + (f"triton{self.triton}",)
        if available is not None and _positional_arity(available) == 1:
            _deprecated(self.name, "available=f(environment)", "available=f(environment, device_type)")
            one = available
            available = lambda env, device_type: one(env)  # noqa: E731
        if self.available_on is not None:
            _deprecated(self.name, "available_on=f(environment, device_type)",
                        "available=f(environment, device_type)")
            available = _both(available, self.available_on)
        for hook in ("prepare", "degradations"):
            fn = getattr(self, hook)
            if fn is not None and not callable(fn):
                raise TypeError(f"backend {self.name!r}: {hook} must be a callable or None, got {fn!r}")
        set_ = object.__setattr__
        set_(self, "devices", devices)
        set_(self, "dtypes", dtypes)
        set_(self, "requires", requires)
        set_(self, "features", features)
        set_(self, "min_size", min_size)
        set_(self, "available", available)
        set_(self, "available_on", None)
        set_(self, "triton", "")
        set_(self, "ops", dict(self.ops))

    def supports(self, op: str) -> bool:
        return op in self.ops

    def least_size(self, op: str, hidden: int = 0, features: frozenset = frozenset()) -> Optional[int]:
        """The declared ``min_size`` for a call of ``op`` of a key's ``hidden`` bucket and
        ``features`` (for a mapping, its entry for the kind of inputs, ``OpSpec.given``), or None."""
        size = self.min_size.get(op)
        return size.get(OPS[op].given(hidden, features)) if isinstance(size, Mapping) else size

    def __repr__(self) -> str:
        origin = f" from {self.origin}" if self.origin else ""
        features = f", features={len(self.features)}" if self.features else ""
        return (f"<Backend {self.name!r} priority={self.priority}, {len(self.ops)} ops, "
                f"devices {','.join(sorted(self.devices))}{features}{origin}>")


def _deprecated(name: str, old: str, new: str) -> None:
    warnings.warn(
        f"backend {name!r}: Backend({old}) is deprecated and will be removed in the next release; "
        f"use {new}",
        DeprecationWarning,
        stacklevel=4,
    )


def _positional_arity(fn: Callable) -> Optional[int]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _both(first: Optional[Availability], second: Availability) -> Availability:
    def available(env, device_type):
        return (first(env, device_type) if first is not None else None) or second(env, device_type)

    return available
