"""What this process runs on: torch and triton versions, device types present, their capabilities.

Detection happens once, cheaply (no kernel launch, no compilation); :func:`get_environment` returns
the cached result. Tests and tools replace it with :func:`set_environment`, for example with
``Environment.fake(torch="2.1.0", devices={"npu": 8})``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
from packaging.version import InvalidVersion, Version

# Order in which a device type is taken as the machine's main device.
MAIN_DEVICE_ORDER = ("cuda", "npu", "xpu", "mps", "cpu")
DEVICE_LABELS = {"cpu": "CPU", "cuda": "CUDA", "npu": "NPU", "xpu": "XPU", "mps": "MPS"}


@dataclass(frozen=True)
class DeviceInfo:
    """The devices of one type: how many and their names; capability for CUDA devices."""

    type: str
    count: int
    names: tuple = ()
    capability: Optional[tuple] = None


@dataclass(frozen=True)
class Environment:
    """One detected (or faked) environment. ``modules`` overrides whether a module imports."""

    torch_version: Version
    python_version: str
    devices: Mapping[str, DeviceInfo]
    triton_version: Optional[Version] = None
    torch_npu_version: Optional[Version] = None
    hip_version: Optional[str] = None
    cuda_version: Optional[str] = None
    modules: Mapping[str, bool] = field(default_factory=dict)
    is_fake: bool = False

    def has_device(self, device_type: str) -> bool:
        return device_type == "cpu" or self.device_count(device_type) > 0

    def device_count(self, device_type: str) -> int:
        info = self.devices.get(device_type)
        return info.count if info else 0

    @property
    def main_device(self) -> str:
        return next(d for d in MAIN_DEVICE_ORDER if self.has_device(d))

    @property
    def cuda_capability(self) -> Optional[tuple]:
        info = self.devices.get("cuda")
        return info.capability if info else None

    @property
    def is_rocm(self) -> bool:
        return self.hip_version is not None

    def module_problem(self, name: str) -> Optional[str]:
        """None when module ``name`` imports, else a sentence saying why it does not."""
        if name in self.modules:
            return None if self.modules[name] else f"{name} is not installed"
        return _module_problem(name)

    @classmethod
    def fake(
        cls,
        *,
        torch: str = "2.4.0",
        devices: Optional[Mapping[str, int]] = None,
        triton: Optional[str] = None,
        torch_npu: Optional[str] = None,
        modules: Optional[Mapping[str, bool]] = None,
        hip: Optional[str] = None,
        capability: tuple = (9, 0),
    ) -> "Environment":
        """A made-up environment for tests: ``devices`` maps device type to count.

        Modules not named in ``modules`` are taken as missing, except ``triton`` and ``torch_npu``,
        which follow the ``triton`` and ``torch_npu`` versions given.
        """
        infos = {"cpu": DeviceInfo("cpu", 1, ("fake CPU",))}
        for kind, count in (devices or {}).items():
            infos[kind] = DeviceInfo(
                kind, count, tuple(f"fake {kind} {i}" for i in range(count)),
                capability if kind == "cuda" else None,
            )
        mods = {"triton": triton is not None, "torch_npu": torch_npu is not None}
        mods.update(modules or {})
        return cls(
            torch_version=Version(torch),
            python_version=platform.python_version(),
            devices=infos,
            triton_version=Version(triton) if triton else None,
            torch_npu_version=Version(torch_npu) if torch_npu else None,
            hip_version=hip,
            modules=_AllOthersMissing(mods),
            is_fake=True,
        )


class _AllOthersMissing(dict):
    """Module overrides of a fake environment: a module not named is missing."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> bool:
        return dict.get(self, key, False)


_MODULE_PROBLEMS: dict = {}


def _module_problem(name: str) -> Optional[str]:
    if name not in _MODULE_PROBLEMS:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            problem = f"{name} is not installed"
        else:
            try:
                importlib.import_module(name)
                problem = None
            except Exception as exc:  # a broken install must not break selection
                problem = f"{name} is installed but fails to import ({type(exc).__name__}: {exc})"
        _MODULE_PROBLEMS[name] = problem
    return _MODULE_PROBLEMS[name]


def _dist_version(*names: str) -> Optional[Version]:
    for name in names:
        try:
            return Version(importlib.metadata.version(name))
        except (importlib.metadata.PackageNotFoundError, InvalidVersion):
            continue
    return None


def _detect_npu() -> tuple:
    """(DeviceInfo or None, torch_npu version or None). Imports torch_npu only if installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, None
    version = _dist_version("torch_npu", "torch-npu")
    try:
        importlib.import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return DeviceInfo("npu", 0), version
        count = int(npu.device_count())
        names = tuple(str(npu.get_device_name(i)) for i in range(count))
        return DeviceInfo("npu", count, names), version
    except Exception:  # torch_npu present but unusable: no NPU for us
        return DeviceInfo("npu", 0), version


def detect() -> Environment:
    """Detect the real environment of this process."""
    devices = {"cpu": DeviceInfo("cpu", 1, (platform.processor() or platform.machine(),))}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        devices["cuda"] = DeviceInfo(
            "cuda",
            count,
            tuple(torch.cuda.get_device_name(i) for i in range(count)),
            tuple(torch.cuda.get_device_capability(0)) if count else None,
        )
    npu, npu_version = _detect_npu()
    if npu is not None:
        devices["npu"] = npu
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        count = xpu.device_count()
        devices["xpu"] = DeviceInfo("xpu", count, tuple(xpu.get_device_name(i) for i in range(count)))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices["mps"] = DeviceInfo("mps", 1, ("Apple MPS",))
    return Environment(
        torch_version=Version(torch.__version__),
        python_version=platform.python_version(),
        devices=devices,
        triton_version=_dist_version("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"),
        torch_npu_version=npu_version,
        hip_version=getattr(torch.version, "hip", None),
        cuda_version=getattr(torch.version, "cuda", None),
    )


_current: Optional[Environment] = None


def get_environment() -> Environment:
    """The environment in force: detected once per process unless replaced."""
    global _current
    if _current is None:
        _current = detect()
    return _current


def set_environment(env: Optional[Environment]) -> None:
    """Replace the environment (None: detect again). Selections made for another one are dropped."""
    global _current
    _current = env
