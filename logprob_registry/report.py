"""What the registry tells people: per-backend verdicts, plugin failures, and their tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .eligibility import Key


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not contribute, and why. It never breaks the import of the package."""

    plugin: str
    distribution: str
    error: str


@dataclass(frozen=True)
class Candidate:
    """One backend's verdict for one key."""

    name: str
    priority: int
    origin: str
    reason: Optional[str] = None  # why it is not eligible; None when eligible
    broken: Optional[str] = None  # the run-time error that marked it broken for this key
    chosen: bool = False

    @property
    def eligible(self) -> bool:
        return self.reason is None and self.broken is None

    @property
    def status(self) -> str:
        if self.chosen:
            return "chosen"
        if self.broken is not None:
            return "broken"
        return "eligible" if self.reason is None else "no"


@dataclass(frozen=True)
class Explanation:
    """The answer of :func:`logprob_registry.explain`; ``str()`` renders it as a table."""

    key: Key
    candidates: Sequence[Candidate]
    chosen: Optional[str]
    forced: Optional[str] = None  # "name (source)" when an explicit choice is in force
    failures: Sequence[PluginFailure] = field(default_factory=tuple)

    @property
    def eligible(self) -> List[str]:
        return [c.name for c in self.candidates if c.eligible]

    def __getitem__(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(c.name for c in self.candidates)}")

    def __str__(self) -> str:
        head = f"{self.key.describe()}: "
        head += f"using {self.chosen}" if self.chosen else "no eligible backend"
        if self.forced:
            head += f" (forced: {self.forced})"
        rows = [
            (c.status, c.name, str(c.priority), c.origin,
             c.broken and f"failed at run time: {c.broken}" or c.reason or "")
            for c in self.candidates
        ]
        lines = [head, table(("", "backend", "priority", "from", "why not"), rows)]
        for f in self.failures:
            lines.append(f"plugin {f.plugin} ({f.distribution}) not loaded: {f.error}")
        return "\n".join(lines)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*map(str, r)).rstrip() for r in rows]
    return "\n".join(out)
