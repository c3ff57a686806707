"""What the registry tells people: the verdict table of ``explain`` and the ``info`` report."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .registry.plugins import PluginFailure
from .registry.ranking import Verdict

if TYPE_CHECKING:
    from .registry import Key, Registry

Candidate = Verdict  # the name of round 1


@dataclass(frozen=True)
class Explanation:
    """The answer of :func:`logprob_registry.explain`; ``str()`` renders it as a table."""

    key: "Key"
    candidates: Sequence[Verdict]
    chosen: Optional[str]
    forced: Optional[str] = None  # "name (source)" when an explicit choice is in force
    failures: Sequence[PluginFailure] = field(default_factory=tuple)

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
        timed = any(c.measured is not None for c in self.candidates)
        rows = [
            (c.status, c.name, str(c.priority))
            + ((_ms(c.measured),) if timed else ())
            + (c.origin, c.why)
            for c in self.candidates
        ]
        header = ("", "backend", "priority") + (("measured",) if timed else ()) + ("from", "why not")
        lines = [head, table(header, rows)]
        if timed:
            lines.append("measured: seconds per call in the tuning ranking (logprob-registry tune); "
                         "it orders the backends it measured, priority the rest")
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


def info(registry: "Registry", dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> str:
    """The ``info`` report: versions, devices, plugins, configuration, and every op's verdicts for
    the main device and the CPU."""
    from . import config
    from .opspec import OPS
    from .registry import ENV_VAR, Key

    env = registry.environment()

    def v(x: object) -> str:
        return str(x) if x is not None else "not installed"

    lines = [
        f"python     {platform.python_version()}",
        f"torch      {env.torch_version}" + (f" (ROCm {env.hip_version})" if env.hip_version else "")
        + (f" (CUDA {env.cuda_version})" if env.cuda_version else ""),
        f"triton     {v(env.triton_version)}",
        f"torch_npu  {v(env.torch_npu_version)}",
        "",
        "devices",
    ]
    rows = [(d.type, str(d.count), ", ".join(d.names) or "-",
             ".".join(map(str, d.capability)) if d.capability else "")
            for d in env.devices.values()]
    lines += ["  " + line for line in table(("type", "count", "names", "capability"), rows).splitlines()]
    lines += ["", "plugins"]
    rows = [(name, dist, ", ".join(names) or "-") for name, dist, names in registry.plugins()]
    lines += ["  " + line for line in table(("plugin", "distribution", "backends"), rows).splitlines()]
    for f in registry.failures():
        lines.append(f"  FAILED {f.plugin} ({f.distribution}): {f.error}")
    lines += ["", "backends"]
    rows = [(b.name, str(b.priority), ", ".join(sorted(b.devices)), b.description or "-")
            for b in registry.backends()]
    lines += ["  " + line for line in table(("backend", "priority", "devices", "what it is"), rows).splitlines()]
    for b in registry.backends():
        if b.memory:
            lines.append(f"  {b.name} memory: {b.memory}")
    lines += ["", "configuration"]
    rows = [(name, value, doc) for name, value, doc in config.describe()]
    lines += ["  " + line for line in table(("variable", "value", "what it does"), rows).splitlines()]
    for problem in config.problems():
        lines.append(f"  INVALID: {problem}; every call raises until it is fixed or unset")
    lines += ["", registry.tuning_status()]
    forced, source = registry.forced()
    if forced:
        lines += ["", f"explicit choice in force: {forced} ({source})"]
    devices = [env.main_device] + (["cpu"] if env.main_device != "cpu" else [])
    for device in devices:
        for op in OPS:
            explanation = registry.explain(Key(op, device, dtype, requires_grad))
            # plugin failures are listed once above, not under every table
            text = "\n".join(line for line in str(explanation).splitlines() if not line.startswith("plugin "))
            lines += ["", text]
    lines += ["", f"Force a backend with {ENV_VAR}=NAME, lr.use_backend(NAME) or backend=NAME."]
    return "\n".join(lines)
