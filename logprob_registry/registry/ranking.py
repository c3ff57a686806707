"""Whether each backend may run a kind of call, and in which order: a pure function of the
backends, the key, the environment and the backends marked broken. ``explain`` and selection both
read its answer, so the table always says what a call does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Collection, Iterable, List, Mapping, Optional, Protocol, Tuple

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ..backend import Backend
from ..dtypes import dtype_name
from ..environment import Environment, device_label
from ..opspec import OPS, MemoryPromise
from .key import Key, bucket_range, describe_bucket, describe_hidden, key_size


class Measured(Protocol):
    """A measured ranking of one key, from the registry's ranking source (``tuning.cache.Entry`` is
    one): seconds per call by backend, the backends that failed the smoke check, with why, and
    (optionally, ``memory``) each backend's extra peak bytes beyond the gradients by row count, with
    ``vocab`` the vocabulary size measured."""

    times: Mapping[str, float]
    failed: Mapping[str, str]


@dataclass(frozen=True)
class Verdict:
    """One backend's verdict for one key."""

    name: str
    priority: int
    origin: str
    reason: Optional[str] = None  # why it cannot run the key; None when it can
    broken: Optional[str] = None  # the run-time error that marked it broken for this key
    chosen: bool = False
    transient: bool = False  # its availability check raised: ask again next time, never cache
    skipped: Optional[str] = None  # it can run the key, but the automatic choice passes it over: why
    measured: Optional[float] = None  # seconds per call in the tuning ranking, when measured
    keeps: Optional[bool] = None  # whether it keeps the op's memory promise for the key (None: no promise applies)
    memory: str = ""  # its memory verdict in words: "keeps (declared)", "breaks (measured: 2.10x)"

    @property
    def eligible(self) -> bool:
        """Whether the automatic choice may take it."""
        return self.reason is None and self.broken is None and self.skipped is None

    @property
    def status(self) -> str:
        if self.chosen:
            return "chosen"
        if self.broken is not None:
            return "broken"
        if self.reason is None and self.skipped is not None:
            return "skipped"
        return "eligible" if self.reason is None else "no"

    @property
    def why(self) -> str:
        """The sentence for the table's "why not" column."""
        if self.broken is not None:
            return f"failed at run time: {self.broken}"
        return self.reason or self.skipped or ""


def order(backends: Iterable[Backend]) -> List[Backend]:
    """Highest priority first, ties broken by name: never by registration order."""
    return sorted(backends, key=lambda b: (-b.priority, b.name))


def why_not(backend: Backend, key: Key, env: Environment, untested: Collection[str] = ()) -> Tuple[Optional[str], bool]:
    """``(None, False)`` if ``backend`` can run ``key`` in ``env``; otherwise the first reason it
    cannot, and whether that reason is transient (its availability check raised).

    Cheap checks come first. Backends named in ``untested`` may run outside the versions they
    declare (``LOGPROB_REGISTRY_UNTESTED_VERSIONS``); what they require must still be installed.
    """
    if key.op not in backend.ops:
        return f"does not implement {key.op}", False
    if key.device not in backend.devices:
        return f"runs on {', '.join(sorted(backend.devices))}, not {key.device}", False
    if not env.has_device(key.device):
        return f"no {device_label(key.device)} device", False
    if key.dtype not in backend.dtypes:
        accepted = ", ".join(sorted(dtype_name(d) for d in backend.dtypes))
        return f"does not accept {dtype_name(key.dtype)} input (accepts {accepted})", False
    if key.requires_grad and not backend.autograd:
        return "has no backward, and gradients are needed", False
    missing = sorted(key.features - backend.features)
    if missing:
        return f"does not support {', '.join(missing)}", False
    waived = backend.name in untested
    if backend.torch and not waived and not SpecifierSet(backend.torch).contains(env.torch_version, prereleases=True):
        return f"needs torch{backend.torch}, found {env.torch_version}", False
    for requirement in backend.requires:
        problem = env.requirement_problem(Requirement(requirement).name if waived else requirement)
        if problem:
            return problem, False
    if backend.available is not None:
        try:
            problem = backend.available(env, key.device)
        except Exception as exc:
            return f"its availability check raised {type(exc).__name__}: {exc}", True
        if problem:
            return str(problem), False
    return None, False


def rank(backends: Iterable[Backend], key: Key, env: Environment, broken: Optional[Mapping[str, str]] = None,
         untested: Collection[str] = (), measured: Optional[Measured] = None) -> List[Verdict]:
    """Every backend's verdict for ``key``, best first; the first eligible one is the automatic
    choice (``chosen`` is left for the caller to mark).

    Without a ``measured`` ranking (a tuning ranking for the key), priority orders them; with one,
    the backends measured come first, fastest first, then the others by priority, and a backend
    that failed the tuning smoke check is passed over. A backend whose ``min_vocab`` lies above the
    key's vocabulary bucket, or whose ``min_size`` for the op lies above the key's size
    (``key.key_size``: V, or V x H for hidden states), is passed over too unless measured for the
    key (explicit choice is unaffected by either)."""
    verdicts = []
    low = bucket_range(key.vocab)[0] if key.vocab else None
    for b in order(backends):
        reason, transient = why_not(b, key, env, untested)
        skipped = None
        timed = measured is not None and b.name in measured.times  # a measurement beats a declaration
        if reason is None and low is not None and low < b.min_vocab and not timed:
            skipped = (f"not worth it for {describe_bucket(key.vocab)} (declares min_vocab={b.min_vocab}); "
                       "choose it explicitly to use it anyway")
        sized = b.least_size(key.op, key.hidden, key.features) is not None
        if reason is None and skipped is None and not timed and sized:
            skipped = _below_min_size(b, key)
        if reason is None and measured is not None and b.name in measured.failed:
            skipped = f"failed the tuning smoke check: {measured.failed[b.name]}"
        seconds = measured.times.get(b.name) if measured is not None else None
        verdicts.append(Verdict(b.name, b.priority, b.origin, reason, (broken or {}).get(b.name), False, transient,
                                skipped, seconds))
    if measured is not None:
        verdicts.sort(key=lambda v: (v.measured is None, v.measured or 0.0))  # stable: priority among the rest
    return verdicts


def _below_min_size(backend: Backend, key: Key) -> Optional[str]:
    """Why ``backend`` is passed over for ``key`` by its declared ``min_size`` for the op, or None
    (also when the key's size is not known: without buckets no size rule applies)."""
    size = key_size(key.op, key.vocab, key.hidden)
    least = backend.least_size(key.op, key.hidden, key.features)
    kind = OPS[key.op].given(key.hidden, key.features)
    if kind == "hidden" and not key.hidden:  # hidden states of a size not known: no bound on the work
        size = None
    if size is None or size >= least:
        return None
    where = describe_bucket(key.vocab) + (f" and {describe_hidden(key.hidden)}" if key.hidden else "")
    per_row = "V x H" if key.hidden else "V"
    return (f"not worth it for {where} ({per_row} at most {int(size)}; declares min_size[{key.op!r}]="
            f"{declared_min_size(backend.min_size[key.op], kind)}); choose it explicitly to use it anyway")


def declared_min_size(size, kind: str) -> str:
    """A ``min_size`` entry as ``explain`` names it: the number, or for a mapping by kind of inputs
    the kind's entry (``{'hidden': 8589934592}``)."""
    return f"{{{kind!r}: {size[kind]}}}" if isinstance(size, Mapping) else str(size)


def automatic(verdicts: List[Verdict]) -> Optional[str]:
    """The name of the automatic choice: the first eligible verdict."""
    return next((v.name for v in verdicts if v.eligible), None)


def memory_verdicts(verdicts: List[Verdict], backends: Iterable[Backend], key: Key,
                    measured: Optional[Measured] = None, speed: bool = False) -> List[Verdict]:
    """``verdicts`` with each runnable backend's memory verdict for the op's promise at ``key``
    (``OpSpec.promise``: never the (N, V) logits for hidden states, no (N, V) temporary for logits):
    measured by ``tune`` (``measured.memory``, two row counts or more) where it was, else declared
    (``copies_logits`` breaks it). Unless ``speed`` (``LOGPROB_REGISTRY_MEMORY=speed``), a backend
    that breaks it is passed over whenever one that keeps it is eligible; when none is, nothing
    changes (the promise cannot be kept here, and the call still runs)."""
    promise = promise_of(key)
    if promise is None:
        return verdicts
    by_name = {b.name: b for b in backends}
    memory = getattr(measured, "memory", None) or {}
    vocab = getattr(measured, "vocab", 0)
    out = []
    for v in verdicts:
        if v.reason is None and v.name in by_name:
            keeps, label, words = _memory_of(by_name[v.name], promise, memory.get(v.name), vocab)
            v = dataclasses.replace(v, keeps=keeps, memory=label)
            if not speed and keeps is False:
                v = dataclasses.replace(v, skipped=v.skipped or _MEMORY_SKIP.format(op=key.op, promise=promise.name,
                                                                                 words=words))
        out.append(v)
    if not speed and not any(v.eligible for v in out):  # nothing keeps it: as without the promise
        out = [dataclasses.replace(v, skipped=None) if v.skipped and v.skipped.startswith(_MEMORY_HEAD) else v
               for v in out]
    return out


_MEMORY_HEAD = "breaks the memory promise"
_MEMORY_SKIP = (_MEMORY_HEAD + " of {op} ({promise}): {words}; LOGPROB_REGISTRY_MEMORY=speed, or choose it "
                "explicitly, to use it anyway")


def promise_of(key: Key) -> Optional[MemoryPromise]:
    """The op table's memory promise for ``key`` (``OpSpec.promise``), or None."""
    spec = OPS.get(key.op)
    if spec is None:
        return None
    return spec.promise(key.hidden, key.features, bucket_range(key.vocab)[0] if key.vocab else None)


def _memory_of(backend: Backend, promise: MemoryPromise, measured: Optional[Mapping[str, float]],
               vocab: int) -> Tuple[bool, str, str]:
    """``(keeps, label for explain's table, the reason in words)`` of ``backend`` for ``promise``."""
    if measured:
        keeps, ratio, words = promise.judge(measured, vocab)
        if keeps is not None:
            return keeps, f"{'keeps' if keeps else 'breaks'} (measured: {ratio:.2f}x)", words
    if backend.copies_logits:
        return False, "breaks (declared)", "it declares copies_logits (it forms the logits, or a copy of them)"
    return True, "keeps (declared)", "it does not declare copies_logits (the conformance suite checks its memory)"
