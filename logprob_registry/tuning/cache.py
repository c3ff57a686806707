"""The tuning cache: a JSON file of measured rankings, keyed by machine, device, torch version and
the versions of the backends measured.

Location: ``LOGPROB_REGISTRY_TUNING`` (a path, or ``off`` to ignore any ranking), else
``$XDG_CACHE_HOME/logprob_registry/tuning.json`` (``~/.cache/...`` when XDG_CACHE_HOME is unset).
A ranking measured on another machine, device or torch version, or with another version of a
backend it ranks, is ignored, with one warning saying why and how to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from .. import config
from ..dtypes import dtype_name

FORMAT = 1
TUNING = config.declare(config.Variable(
    "LOGPROB_REGISTRY_TUNING", str, "",
    "path of the tuning ranking written by `logprob-registry tune` (default "
    "~/.cache/logprob_registry/tuning.json), or off to ignore it"))


class TuningWarning(UserWarning):
    """A tuning ranking exists but does not apply to this process (it says why)."""


def default_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "logprob_registry", "tuning.json")


def path_in_force() -> Optional[str]:
    """The ranking file selection reads, or None when tuning is off."""
    text = config.get(TUNING.name).strip()
    if text.lower() == "off":
        return None
    return text or default_path()


def key_string(op: str, device: str, dtype, requires_grad: bool, bucket: int, hidden: int = 0) -> str:
    """An entry's name in the file: op, device, dtype, gradients, vocabulary bucket and, for a key
    with one (an op given hidden states), ``h`` and its hidden-size bucket."""
    text = f"{op}|{device}|{dtype_name(dtype)}|{'grad' if requires_grad else 'nograd'}|{bucket}"
    return f"{text}|h{hidden}" if hidden else text


def string_of(key) -> str:
    """:func:`key_string` of a selection key."""
    return key_string(key.op, key.device, key.dtype, key.requires_grad, key.vocab, key.hidden)


def machine(device: str, device_names: Tuple[str, ...]) -> Dict[str, object]:
    """What a ranking was measured on: the fields that must match for it to apply."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.machine(),
            "device": device, "device_names": list(device_names)}


@dataclass
class Entry:
    """One key's measurements: seconds per backend (the geometric mean over the row counts
    measured), per row count, and the backends that failed the smoke check, with the reason;
    ``vocab`` and ``hidden`` (0: none) are the sizes measured for the key's buckets; ``memory``:
    per backend, the extra peak bytes of a call beyond the gradients it returns, per row count (what
    the op's memory promise is judged by, ``opspec.MemoryPromise.judge``)."""

    times: Dict[str, float]
    rows: Dict[str, Dict[str, float]] = field(default_factory=dict)
    failed: Dict[str, str] = field(default_factory=dict)
    vocab: int = 0
    hidden: int = 0
    memory: Dict[str, Dict[str, float]] = field(default_factory=dict)

    def order(self) -> List[str]:
        return sorted(self.times, key=lambda name: (self.times[name], name))


@dataclass
class Ranking:
    """A ranking file's content."""

    torch: str
    machines: Dict[str, Dict[str, object]]           # device type -> machine() at measurement
    versions: Dict[str, str]                          # backend -> "distribution version"
    entries: Dict[str, Entry]                         # key_string -> Entry
    created: str = ""

    def to_json(self) -> dict:
        return {"format": FORMAT, "created": self.created, "torch": self.torch, "machines": self.machines,
                "versions": self.versions,
                "entries": {k: _entry_json(e) for k, e in sorted(self.entries.items())}}

    @classmethod
    def from_json(cls, doc: Mapping) -> "Ranking":
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        entries = {k: Entry(dict(v["times"]), dict(v.get("rows", {})), dict(v.get("failed", {})),
                            int(v.get("vocab", 0)), int(v.get("hidden", 0)), dict(v.get("memory", {})))
                   for k, v in doc["entries"].items()}
        return cls(str(doc["torch"]), dict(doc["machines"]), dict(doc["versions"]), entries,
                   str(doc.get("created", "")))

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    def merged(self, other: "Ranking") -> "Ranking":
        """This ranking with ``other``'s measurements added, backend by backend (``other`` wins).

        What ``other`` would make stale is dropped rather than relabelled: with another torch,
        everything of this ranking; for a device measured on another machine, that device's
        entries; for a backend of another version, that backend's measurements. Within a key
        measured by both, ``other``'s backends replace this ranking's, and the others are kept if
        they were measured at the same row counts (else the key is ``other``'s alone), so that a
        ``tune --backend X`` adds X to a ranking without removing its peers."""
        if other.torch != self.torch:
            return other
        changed = {name for name, version in other.versions.items() if self.versions.get(name, version) != version}
        moved = {d for d, m in other.machines.items() if d in self.machines and self.machines[d] != m}
        entries: Dict[str, Entry] = {}
        for k, e in self.entries.items():
            if _device_of(k) in moved:
                continue
            keep = [n for n in set(e.times) | set(e.failed) if n not in changed]
            entries[k] = Entry({n: t for n, t in e.times.items() if n in keep},
                               {n: r for n, r in e.rows.items() if n in keep},
                               {n: f for n, f in e.failed.items() if n in keep}, e.vocab, e.hidden,
                               {n: m for n, m in e.memory.items() if n in keep})
        for k, new in other.entries.items():
            old = entries.get(k)
            if old is None or (old.vocab, old.hidden) != (new.vocab, new.hidden) \
                    or any(set(r) != _row_counts(new) for r in old.rows.values()):
                entries[k] = new
                continue
            ours = set(new.times) | set(new.failed)
            entries[k] = Entry({**{n: t for n, t in old.times.items() if n not in ours}, **new.times},
                               {**{n: r for n, r in old.rows.items() if n not in ours}, **new.rows},
                               {**{n: f for n, f in old.failed.items() if n not in ours}, **new.failed}, new.vocab,
                               new.hidden, {**{n: m for n, m in old.memory.items() if n not in ours}, **new.memory})
        machines = {d: m for d, m in self.machines.items() if d not in moved}
        versions = {n: v for n, v in self.versions.items() if n not in changed}
        return Ranking(other.torch, {**machines, **other.machines}, {**versions, **other.versions}, entries,
                       other.created)


def _entry_json(e: Entry) -> dict:
    doc = {"times": e.times, "rows": e.rows, "failed": e.failed, "vocab": e.vocab}
    if e.hidden:
        doc["hidden"] = e.hidden
    if e.memory:
        doc["memory"] = e.memory
    return doc


def _device_of(key: str) -> str:
    return key.split("|")[1]


def _row_counts(entry: Entry) -> set:
    """The row counts an entry's backends were measured at (one set: they share a plan)."""
    return next((set(r) for r in entry.rows.values()), set())


def load(path: str) -> Optional[Ranking]:
    """The ranking at ``path``, None if there is no file; a ValueError saying what is wrong with it."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        return Ranking.from_json(doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a tuning ranking ({type(exc).__name__}: {exc})") from None


class Tuning:
    """A ranking source (``Registry(ranking=...)``) that reads a ranking file: ``path``, or by
    default the file in force (:func:`path_in_force`: ``LOGPROB_REGISTRY_TUNING``, else the user's
    cache), loaded once per file (and per change of the file), checked against the process's
    machine, torch and backend versions."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._lock = threading.Lock()
        self._loaded: Tuple[Optional[str], float] = (None, -1.0)
        self._ranking: Optional[Ranking] = None
        self._problem: Optional[str] = None
        self._warned: set = set()

    def _current(self) -> Tuple[Optional[str], Optional[Ranking], Optional[str]]:
        path = self.path or path_in_force()
        if path is None:
            return None, None, None
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = -1.0
        if self._loaded != (path, mtime):
            with self._lock:
                try:
                    self._ranking, self._problem = load(path), None
                except ValueError as exc:
                    self._ranking, self._problem = None, str(exc)
                self._loaded = (path, mtime)
        return path, self._ranking, self._problem

    def status(self, env, versions: Mapping[str, str]) -> str:
        """One line for ``info``: whether a ranking is in use, and why not."""
        path, ranking, problem = self._current()
        if path is None:
            return "tuning: off (LOGPROB_REGISTRY_TUNING=off); priority decides"
        if problem:
            return f"tuning: {problem}; priority decides"
        if ranking is None:
            return f"tuning: no ranking at {path} (run `logprob-registry tune`); priority decides"
        devices = sorted(ranking.machines)
        stale = [f"{d}: {why}" for d in devices if (why := self.mismatch(ranking, env, d, versions))]
        used = [d for d in devices if not self.mismatch(ranking, env, d, versions)]
        line = f"tuning: {path}, {len(ranking.entries)} keys measured"
        if used:
            line += f", in use for {', '.join(used)}"
        if stale:
            line += f"; ignored for {'; '.join(stale)}"
        return line

    @staticmethod
    def mismatch(ranking: Ranking, env, device: str, versions: Mapping[str, str]) -> Optional[str]:
        """Why ``ranking`` does not apply to ``device`` in this process, or None."""
        if str(env.torch_version) != ranking.torch:
            return f"it was measured with torch {ranking.torch}, this is torch {env.torch_version}"
        measured = ranking.machines.get(device)
        if measured is None:
            return f"it has no measurements for {device}"
        info = env.devices.get(device)
        now = machine(device, tuple(info.names) if info else ())
        for field_ in ("cpu", "cpu_count", "platform", "device_names"):
            if measured.get(field_) != now.get(field_):
                return (f"it was measured on another machine ({field_}: {measured.get(field_)!r}, "
                        f"now {now.get(field_)!r})")
        for name, version in ranking.versions.items():
            if name in versions and versions[name] != version:
                return f"backend {name} was {version} when measured, now {versions[name]}"
        return None

    def entry(self, key, env, versions: Mapping[str, str]) -> Optional[Entry]:
        """The measured entry for ``key`` if a valid ranking covers it; warns once per reason when
        a ranking exists but does not apply."""
        if key.features or not key.vocab:
            return None
        path, ranking, problem = self._current()
        if ranking is None:
            if problem and problem not in self._warned:
                self._warned.add(problem)
                warnings.warn(f"logprob_registry: {problem}; selection uses priorities. Run "
                              "`logprob-registry tune` to measure again.", TuningWarning, stacklevel=2)
            return None
        why = self.mismatch(ranking, env, key.device, versions)
        if why is not None:
            if (path, why) not in self._warned:
                self._warned.add((path, why))
                warnings.warn(f"logprob_registry: the tuning ranking at {path} does not apply: {why}; selection "
                              "uses priorities until `logprob-registry tune` measures again.", TuningWarning,
                              stacklevel=2)
            return None
        return ranking.entries.get(string_of(key))
