"""Whether a backend may run one op for one kind of tensor, and if not, the sentence saying why."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from packaging.specifiers import SpecifierSet

from .backend import Backend
from .environment import DEVICE_LABELS, Environment


class Key(NamedTuple):
    """What a selection depends on besides the environment."""

    op: str
    device: str
    dtype: torch.dtype
    requires_grad: bool

    def describe(self) -> str:
        grad = ", with gradients" if self.requires_grad else ""
        return f"{self.op} on {self.device} {dtype_name(self.dtype)} tensors{grad}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _version_problem(what: str, spec: str, found: object) -> Optional[str]:
    if not spec:
        return None
    if found is None:
        return f"needs {what}{spec}, {what} is not installed"
    if not SpecifierSet(spec).contains(found, prereleases=True):
        return f"needs {what}{spec}, found {found}"
    return None


def why_not(backend: Backend, key: Key, env: Environment) -> Optional[str]:
    """None if ``backend`` can run ``key`` in ``env``; otherwise the first reason it cannot.

    Cheap checks come first, so that a module is imported only for backends that could run.
    """
    if key.op not in backend.ops:
        return f"does not implement {key.op}"
    if key.device not in backend.devices:
        return f"runs on {', '.join(sorted(backend.devices))}, not {key.device}"
    if not env.has_device(key.device):
        return f"no {DEVICE_LABELS.get(key.device, key.device.upper())} device"
    if key.dtype not in backend.dtypes:
        accepted = ", ".join(sorted(dtype_name(d) for d in backend.dtypes))
        return f"does not accept {dtype_name(key.dtype)} input (accepts {accepted})"
    if key.requires_grad and not backend.autograd:
        return "has no backward, and gradients are needed"
    problem = _version_problem("torch", backend.torch, env.torch_version)
    problem = problem or _version_problem("triton", backend.triton, env.triton_version)
    if problem:
        return problem
    for module in backend.requires:
        problem = env.module_problem(module)
        if problem:
            return problem
    for check, args in ((backend.available, (env,)), (backend.available_on, (env, key.device))):
        if check is None:
            continue
        try:
            problem = check(*args)
        except Exception as exc:
            return f"its availability check raised {type(exc).__name__}: {exc}"
        if problem:
            return str(problem)
    return None
