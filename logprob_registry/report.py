"""What the registry tells people: the ``info`` report, and the verdict table of ``explain``
(:class:`~logprob_registry.registry.explanation.Explanation`, kept importable from here)."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

import torch

from .registry.explanation import DEGRADED, Explanation, table
from .registry.ranking import Verdict

if TYPE_CHECKING:
    from .registry import Registry

__all__ = ["Candidate", "Explanation", "info", "table"]

Candidate = Verdict  # the name of round 1


def info(registry: "Registry", dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> str:
    """The ``info`` report: versions, devices, plugins, configuration, degradations, and every op's
    verdicts for the main device and the CPU."""
    from . import config
    from .call import key_for
    from .opspec import OPS
    from .registry import ENV_VAR

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
    degraded = registry.degradations()
    lines += ["", "degradations: backends running below their best in this process"
              if degraded else "degradations: none (no backend reports running below its best)"]
    lines += [f"  {d.describe()}" for d in degraded]
    forced, source = registry.forced()
    if forced:
        lines += ["", f"explicit choice in force: {forced} ({source})"]
    devices = [env.main_device] + (["cpu"] if env.main_device != "cpu" else [])
    for device in devices:
        for op in OPS:
            explanation = registry.explain(key_for(op, device=device, dtype=dtype, requires_grad=requires_grad))
            # plugin failures and degradations are listed once above, not under every table
            text = "\n".join(line for line in str(explanation).splitlines()
                             if not line.startswith(("plugin ", DEGRADED)))
            lines += ["", text]
    lines += ["", f"Force a backend with {ENV_VAR}=NAME, lr.use_backend(NAME) or backend=NAME."]
    return "\n".join(lines)
