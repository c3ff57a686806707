"""``logprob-registry info``: the environment, the plugins, and the candidate table of every op."""

from __future__ import annotations

import argparse
import platform

import torch

from .backend import OPS
from .eligibility import dtype_name
from .environment import get_environment
from .registry import ENV_VAR, get_registry
from .report import table
from .ops import explain


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", help="input dtype of the tables (default float32)")
    parser.add_argument("--grad", action="store_true", help="tables for inputs that need gradients")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SystemExit(f"unknown dtype {name!r}; use float16, bfloat16, float32 or float64")
    return dtype


def render(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> str:
    env = get_environment()
    registry = get_registry()
    v = lambda x: str(x) if x is not None else "not installed"
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
    lines += ["  " + l for l in table(("type", "count", "names", "capability"), rows).splitlines()]
    lines += ["", "plugins"]
    rows = [(name, dist, ", ".join(names) or "-") for name, dist, names in registry.plugins()]
    lines += ["  " + l for l in table(("plugin", "distribution", "backends"), rows).splitlines()]
    for f in registry.failures():
        lines.append(f"  FAILED {f.plugin} ({f.distribution}): {f.error}")
    forced, source = registry.forced()
    if forced:
        lines += ["", f"explicit choice in force: {forced} ({source})"]
    devices = [env.main_device] + (["cpu"] if env.main_device != "cpu" else [])
    for device in devices:
        for op in OPS:
            lines += ["", _plain(explain(op, device=device, dtype=dtype, requires_grad=requires_grad))]
    lines += ["", f"Force a backend with {ENV_VAR}=NAME, lr.use_backend(NAME) or backend=NAME."]
    return "\n".join(lines)


def _plain(explanation) -> str:
    # The plugin failures are listed once above, not under every table.
    return "\n".join(l for l in str(explanation).splitlines() if not l.startswith("plugin "))


def run(args: argparse.Namespace) -> int:
    print(render(parse_dtype(getattr(args, "dtype", "float32")), getattr(args, "grad", False)))
    return 0
