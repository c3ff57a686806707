"""The answer of ``explain``: every backend's verdict for one kind of call, as a table.

It lives in the registry, which makes it, and :mod:`logprob_registry.report` (the ``info`` report)
renders with it: the registry never imports the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Sequence

from .plugins import PluginFailure
from .ranking import Verdict

if TYPE_CHECKING:
    from ..backend import Degradation
    from .key import Key

#: What explain and info write before each degradation line.
DEGRADED = "degraded:"


@dataclass(frozen=True)
class Explanation:
    """The answer of :func:`logprob_registry.explain`; ``str()`` renders it as a table.

    ``degradations``: what the backends in the table report running below their best in this
    process for calls like this one (``Backend.degradations``). ``strict``: where strict mode
    comes from when it is in force (``"lr.strict()"``), its verdicts then in the table."""

    key: "Key"
    candidates: Sequence[Verdict]
    chosen: Optional[str]
    forced: Optional[str] = None  # "name (source)" when an explicit choice is in force
    failures: Sequence[PluginFailure] = field(default_factory=tuple)
    degradations: Sequence["Degradation"] = field(default_factory=tuple)
    strict: Optional[str] = None
    notes: Sequence[str] = field(default_factory=tuple)  # what the choice depends on beyond the table
    memory: Sequence[str] = field(default_factory=tuple)  # the op's memory promise, and how it decided

    @property
    def eligible(self) -> List[str]:
        return [c.name for c in self.candidates if c.eligible]

    def __getitem__(self, name: str) -> Verdict:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(c.name for c in self.candidates)}")

    def __str__(self) -> str:
        head = f"{self.key.describe()}: "
        head += f"using {self.chosen}" if self.chosen else "no eligible backend"
        if self.forced:
            head += f" (forced: {self.forced})"
        if self.strict:
            head += f" (strict mode: {self.strict})"
        timed = any(c.measured is not None for c in self.candidates)
        memory = any(c.memory for c in self.candidates)
        rows = [
            (c.status, c.name, str(c.priority))
            + ((_ms(c.measured),) if timed else ())
            + ((c.memory or "-",) if memory else ())
            + (c.origin, c.why)
            for c in self.candidates
        ]
        header = ("", "backend", "priority") + (("measured",) if timed else ()) + (("memory",) if memory else ()) \
            + ("from", "why not")
        lines = [head, table(header, rows)]
        if timed:
            lines.append("measured: seconds per call in the tuning ranking (logprob-registry tune); "
                         "it orders the backends it measured, priority the rest")
        lines += list(self.notes) + list(self.memory)
        for d in self.degradations:
            lines.append(f"{DEGRADED} {d.describe()}")
        for f in self.failures:
            lines.append(f"plugin {f.plugin} ({f.distribution}) not loaded: {f.error}")
        return "\n".join(lines)


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*map(str, r)).rstrip() for r in rows]
    return "\n".join(out)
