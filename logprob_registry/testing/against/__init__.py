"""The conformance suite as the judge of a foreign kernel: ``logprob-registry check --against``.

``check --against MODULE:FUNCTION --signature NAME`` imports the function, wraps it by its calling
convention (:data:`CONVENTIONS`) into ops of the op table, registers them as a temporary backend
``against-<function>`` (through a plugin object, as any plugin registers), runs every case of the
suite the convention can express against it, and lists the rest as not expressible, with the
reason. A departure from the contract is a failed case: its worst error and the input that shows it.

Add a convention with :func:`register_convention` (a plugin or a ``conftest.py`` imports it; see
docs/conformance.md), or pass ``--convention MODULE:ATTR`` naming a :class:`Convention`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ...hookspecs import hookimpl
from .conventions import CONVENTIONS, DEFAULT_CAPABILITIES, Convention, NotExpressible, register_convention

__all__ = ["CONVENTIONS", "Convention", "Departure", "AgainstResult", "NotExpressible", "backend_for",
           "check_against", "import_target", "plugin_for", "register_convention", "format_result"]

#: The environment variable that hands the target to the suite's pytest process (JSON).
ENV = "LOGPROB_REGISTRY_AGAINST"
PLUGIN_NAME = "against"
PYTEST_PLUGIN = "logprob_registry.testing.against.pytest_plugin"


def import_target(target: str) -> Callable:
    """``MODULE:ATTR[.ATTR...]`` -> the object (``trl.kernels:ChunkedLogProbFunction.apply``)."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--against {target!r}: give MODULE:FUNCTION, such as trl.trainer.utils:selective_log_softmax")
    cwd_added = os.getcwd() not in __import__("sys").path
    if cwd_added:
        __import__("sys").path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise ValueError(f"--against {target}: cannot import it ({type(exc).__name__}: {exc})") from exc
    finally:
        if cwd_added:
            __import__("sys").path.remove(os.getcwd())
    if not callable(obj):
        raise ValueError(f"--against {target}: {obj!r} is not callable")
    return obj


def convention_named(name: str) -> Convention:
    """The registered convention ``name``, or one named ``MODULE:ATTR`` (a :class:`Convention`)."""
    if name in CONVENTIONS:
        return CONVENTIONS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, Convention):
            return obj
    raise ValueError(f"--signature {name!r}: unknown calling convention; known: {', '.join(sorted(CONVENTIONS))} "
                     "(or MODULE:ATTR naming a logprob_registry.testing.against.Convention)")


def backend_name(target: str) -> str:
    """``against-<function>``: the function's last name, lowercase, dashes for anything else."""
    last = target.rpartition(":")[2].split(".")
    last = [p for p in last if p not in ("apply", "forward", "__call__")] or last
    slug = re.sub(r"[^a-z0-9]+", "-", last[-1].lower()).strip("-") or "function"
    return f"against-{slug}"


def backend_for(function: Callable, convention: Convention, name: str, devices: Sequence[str] = ("cpu", "cuda"),
                declare: Optional[Mapping[str, bool]] = None, description: str = ""):
    """The temporary :class:`~logprob_registry.Backend` that calls ``function`` by ``convention``."""
    from ...backend import Backend, Priority
    from ...dtypes import FLOAT_DTYPES

    capabilities = dict(DEFAULT_CAPABILITIES)
    capabilities.update(convention.capabilities)
    capabilities.update(declare or {})
    return Backend(
        name=name, ops=convention.adapt(function), devices=frozenset(devices), dtypes=frozenset(FLOAT_DTYPES),
        priority=Priority.EXPLICIT_ONLY, requires=tuple(convention.requires),
        description=description or f"{convention.name}: {convention.doc}", **capabilities)


class _Plugin:
    """A plugin object registering one backend (the registry takes any object with the hook)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    @hookimpl
    def register_backends(self, register) -> None:
        register(self.backend)


def plugin_for(backend) -> Any:
    """A plugin object whose ``register_backends`` hook registers ``backend``."""
    return _Plugin(backend)


def register_target(spec: Mapping[str, Any]) -> str:
    """Register the backend of ``spec`` (target, signature, name, device, declare) in this process."""
    from ...registry import get_registry

    convention = convention_named(spec["signature"])
    backend = backend_for(import_target(spec["target"]), convention, spec["name"],
                          devices=sorted({spec.get("device") or "cpu", "cpu"}), declare=spec.get("declare"),
                          description=f"{spec['target']} called as {convention.name}")
    registry = get_registry()
    added = registry.add_plugin(plugin_for(backend), name=f"{PLUGIN_NAME}:{spec['target']}",
                                distribution=f"check --against {spec['target']}")
    if not added:
        errors = [f.error for f in registry.failures() if f.plugin == f"{PLUGIN_NAME}:{spec['target']}"]
        raise ValueError(f"--against {spec['target']}: {errors[0] if errors else 'registered nothing'}")
    return added[0]


# ---------------------------------------------------------------------------- results
@dataclass
class Departure:
    """One case that departs from the contract."""

    case: str          # the suite's test id, such as test_peer_vocab_not_multiple_of_1024[129920-logprobs]
    error: str         # the worst error, or the kind of failure
    shows: str         # the input that shows it (the case's own words: shape, dtype, position)
    issue: str = ""    # the peer issue a test_peer_* case comes from
    message: str = ""  # the first line of the failure


@dataclass
class AgainstResult:
    target: str
    signature: str
    backend: str
    device: str
    verdict: str = "pass"
    passed: int = 0
    departures: List[Departure] = field(default_factory=list)
    not_expressible: Dict[str, List[str]] = field(default_factory=dict)  # reason -> cases
    skipped: Dict[str, int] = field(default_factory=dict)  # other skips: reason -> count
    seconds: float = 0.0
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "pass" and not self.departures


_WORST = re.compile(r"max error (\S+) exceeds the tolerance (\S+) "
                    r"\(worst at (\([^)]*\)): got ([^,]+), expected ([^)]+)\)")


def describe_failure(message: str) -> tuple:
    """(worst error, the input that shows it) from a failure message of the suite."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = first[len("AssertionError: "):] if first.startswith("AssertionError: ") else first
    m = _WORST.search(first)
    if m:
        what = first[:m.start()].rstrip(": ")
        return (f"{m.group(1)} (tolerance {m.group(2)})",
                f"{what}; worst at {m.group(3)}: got {m.group(4)}, expected {m.group(5)}")
    if first.startswith("raised "):
        return (first.split(":")[0], first[len("raised "):])
    for kind in ("NaN mismatch", "infinity mismatch", "positive log-probability", "differs"):
        if kind in first:
            return (kind if kind != "differs" else "not bitwise equal", first)
    if ": shape " in first:
        return ("wrong shape", first)
    return ("failed", first)


def _summary(reason: str) -> str:
    """A reason for the short listing: the sampler-like features in one line."""
    if " does not declare feature " in reason:
        return reason.split(" does not declare feature ")[0] + " takes none of the optional features " \
            "(sampler keywords, candidates, per-row values, functorch)"
    if reason.endswith("declares copies_logits=True"):
        return reason.split(" declares ")[0] + " is not held to the no-copy memory bound " \
            "(--declare copies_logits=false holds it)"
    return reason


def check_against(target: str, signature: str, device: str = "cpu", keyword: Optional[str] = None,
                  declare: Optional[Mapping[str, bool]] = None, name: Optional[str] = None,
                  path: Sequence[str] = (), progress: Callable[[str], None] = lambda text: None) -> AgainstResult:
    """Run the suite against ``target`` called by ``signature``, in a pytest subprocess (``keyword``:
    a pytest ``-k`` expression; ``declare``: capability flags overriding the convention's;
    ``path``: folders to import the target from, besides the working directory)."""
    import sys
    import tempfile

    from ..runner import run_suite

    convention = convention_named(signature)
    for requirement in convention.requires:
        from ...environment import get_environment

        problem = get_environment().requirement_problem(requirement)
        if problem:
            raise ValueError(f"--signature {convention.name}: {problem} (pip install '{requirement}')")
    sys.path[:0] = list(path)
    try:
        import_target(target)  # a bad target is a usage error here, not a failed run
    finally:
        del sys.path[:len(path)]
    name = name or backend_name(target)
    with tempfile.TemporaryDirectory(prefix="logprob-against-") as tmp:
        report = os.path.join(tmp, "against.json")
        spec = {"target": target, "signature": signature, "name": name, "device": device,
                "declare": dict(declare or {}), "report": report}
        progress(f"checking {target} as {convention.name} ({name}) on {device} ...")
        # the child runs in a scratch folder: it imports the target from where this process would
        path = os.pathsep.join([*path, os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
        result = run_suite(name, device, keyword, plugins=(PYTEST_PLUGIN,),
                           env={ENV: json.dumps(spec), "PYTHONPATH": path})
        data: Dict[str, Any] = {}
        if os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
    out = AgainstResult(target, signature, name, device, seconds=result.seconds, output=result.output,
                        passed=result.passed)
    from ..sections.peers import PEER_ISSUES

    for case, message in data.get("failed", {}).items():
        error, shows = describe_failure(message)
        test = case.split("[")[0]
        out.departures.append(Departure(case, error, shows, PEER_ISSUES.get(test, ""), message.splitlines()[0]
                                        if message else ""))
    for case, reason in data.get("not_expressible", {}).items():
        out.not_expressible.setdefault(reason, []).append(case)
    for reason, count in result.skips.items():
        if reason.startswith("not expressible: "):
            continue
        out.skipped[reason] = count
    if result.verdict.startswith("error") and not (result.passed or out.departures):
        out.verdict = result.verdict
    elif out.departures or result.failed:
        out.verdict = "FAIL"
        if result.failed and not out.departures:  # failures the plugin did not see (collection errors)
            out.departures = [Departure(f.split(":")[0], "failed", f) for f in result.failures]
    return out


def format_result(r: AgainstResult, verbose: bool = False) -> str:
    """The report ``check --against`` prints."""
    from ...report import table

    lines = [f"{r.target} called as {r.signature} (backend {r.backend}) on {r.device}: {r.verdict}, "
             f"{r.passed} cases conform, {len(r.departures)} depart, "
             f"{sum(len(v) for v in r.not_expressible.values())} not expressible, "
             f"{sum(r.skipped.values())} skipped ({r.seconds:.1f} s)"]
    if r.departures:
        lines.append("")
        lines.append("departures from the contract:")
        rows = [(d.case + (f" ({d.issue})" if d.issue else ""), d.error, _clip(d.shows, 110))
                for d in sorted(r.departures, key=lambda d: d.case)]
        lines.append(table(("case", "worst error", "the input that shows it"), rows))
    if r.not_expressible:
        lines.append("")
        lines.append("not expressible by the convention:")
        grouped = dict(r.not_expressible)
        if not verbose:
            grouped = {}
            for reason, cases in r.not_expressible.items():
                grouped.setdefault(_summary(reason), []).extend(cases)
        for reason, cases in sorted(grouped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            shown = ", ".join(sorted(cases)[:4]) + (", ..." if len(cases) > 4 else "")
            lines.append(f"  {len(cases):4d}  {reason}: {shown}" if verbose else f"  {len(cases):4d}  {reason}")
    if r.skipped:
        lines.append("")
        lines.append("skipped:")
        for reason, count in sorted(r.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:4d}  {reason}")
    if r.verdict.startswith("error"):
        lines.append(r.output.strip()[-2000:])
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
