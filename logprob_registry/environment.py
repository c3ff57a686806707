"""What this process runs on: torch and triton versions, device types present, their capabilities,
and the installed distributions that backends require.

Detection happens once, cheaply (no kernel launch, no compilation); :func:`get_environment` returns
the cached result. Tests and tools pass a fake one to a :class:`~logprob_registry.registry.Registry`
or install it process-wide with :func:`set_environment`, for example
``Environment.fake(torch="2.1.0", devices={"npu": 8})``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import threading
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

import torch
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

# Order in which a device type is taken as the machine's main device (others come before cpu).
MAIN_DEVICE_ORDER = ("cuda", "npu", "xpu", "hpu", "mps", "cpu")
DEVICE_LABELS = {"cpu": "CPU", "cuda": "CUDA", "npu": "NPU", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}
#: Oldest CUDA compute capability triton compiles for (Volta).
TRITON_MIN_CAPABILITY = (7, 0)
#: Distributions that provide a module under another name (ROCm, nightly and XPU builds of triton).
DISTRIBUTION_ALIASES = {
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu"),
    "torch_npu": ("torch_npu", "torch-npu"),
}


@dataclass(frozen=True)
class DeviceInfo:
    """The devices of one type: how many and their names; capability for CUDA devices."""

    type: str
    count: int
    names: tuple = ()
    capability: Optional[tuple] = None


def device_label(device_type: str) -> str:
    return DEVICE_LABELS.get(device_type, device_type.upper())


@dataclass(frozen=True)
class Environment:
    """One detected (or faked) environment.

    ``modules`` overrides whether a module imports; ``distributions`` overrides installed
    distribution versions (``None``: not installed). A fake environment answers only from them.
    """

    torch_version: Version
    python_version: str
    devices: Mapping[str, DeviceInfo]
    triton_version: Optional[Version] = None
    torch_npu_version: Optional[Version] = None
    hip_version: Optional[str] = None
    cuda_version: Optional[str] = None
    modules: Mapping[str, bool] = field(default_factory=dict)
    distributions: Mapping[str, Optional[Version]] = field(default_factory=dict)
    is_fake: bool = False

    def has_device(self, device_type: str) -> bool:
        return device_type == "cpu" or self.device_count(device_type) > 0

    def device_count(self, device_type: str) -> int:
        info = self.devices.get(device_type)
        return info.count if info else 0

    @property
    def main_device(self) -> str:
        present = [d for d in self.devices if d != "cpu" and self.has_device(d)]
        ordered = sorted(present, key=lambda d: MAIN_DEVICE_ORDER.index(d) if d in MAIN_DEVICE_ORDER else 3)
        return ordered[0] if ordered else "cpu"

    @property
    def cuda_capability(self) -> Optional[tuple]:
        info = self.devices.get("cuda")
        return info.capability if info else None

    @property
    def is_rocm(self) -> bool:
        return self.hip_version is not None

    def triton_capability_problem(self) -> Optional[str]:
        """Why triton cannot compile for this machine's CUDA GPU (too old), or None."""
        capability = self.cuda_capability
        if self.is_rocm or capability is None or tuple(capability) >= TRITON_MIN_CAPABILITY:
            return None
        need = ".".join(map(str, TRITON_MIN_CAPABILITY))
        return f"needs CUDA compute capability {need} or newer (triton), found {capability[0]}.{capability[1]}"

    def module_problem(self, name: str) -> Optional[str]:
        """None when module ``name`` imports, else a sentence saying why it does not."""
        if name in self.modules:
            return None if self.modules[name] else f"{name} is not installed"
        if self.is_fake:
            return f"{name} is not installed"
        return _module_problem(name)

    def distribution_version(self, name: str) -> Optional[Version]:
        """The installed version of distribution ``name`` (or of one providing it), or None."""
        key = _normalise(name)
        if key in self.distributions:
            return self.distributions[key]
        if self.is_fake:
            return None
        return _installed_version(key)

    def requirement_problem(self, requirement: str) -> Optional[str]:
        """None when PEP 508 ``requirement`` is met here, else the sentence saying what is missing.

        A requirement whose name is no installed distribution is taken as a module that must
        import (so that ``requires=("my_kernel_lib",)`` keeps working); a version then cannot be
        checked and the requirement is unmet."""
        req = Requirement(requirement)
        if req.marker is not None and not req.marker.evaluate():
            return None
        found = self.distribution_version(req.name)
        if found is None:
            if not req.specifier:
                return self.module_problem(req.name.replace("-", "_"))
            return f"needs {requirement}, {req.name} is not installed"
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            return f"needs {requirement}, found {found}"
        return None

    @classmethod
    def fake(
        cls,
        *,
        torch: str = "2.4.0",
        devices: Optional[Mapping[str, int]] = None,
        triton: Optional[str] = None,
        torch_npu: Optional[str] = None,
        modules: Optional[Mapping[str, bool]] = None,
        distributions: Optional[Mapping[str, Optional[str]]] = None,
        hip: Optional[str] = None,
        capability: tuple = (9, 0),
    ) -> "Environment":
        """A made-up environment for tests: ``devices`` maps device type to count.

        Only what is named exists: modules not in ``modules`` are missing, except ``triton`` and
        ``torch_npu``, which follow the versions given; distributions not in ``distributions``
        are not installed, except those two.
        """
        infos = {"cpu": DeviceInfo("cpu", 1, ("fake CPU",))}
        for kind, count in (devices or {}).items():
            infos[kind] = DeviceInfo(
                kind, count, tuple(f"fake {kind} {i}" for i in range(count)),
                capability if kind == "cuda" else None,
            )
        mods = {"triton": triton is not None, "torch_npu": torch_npu is not None}
        mods.update(modules or {})
        dists: Dict[str, Optional[Version]] = {
            "triton": Version(triton) if triton else None,
            "torch_npu": Version(torch_npu) if torch_npu else None,
        }
        dists.update({_normalise(k): Version(v) if v else None for k, v in (distributions or {}).items()})
        return cls(
            torch_version=Version(torch),
            python_version=platform.python_version(),
            devices=infos,
            triton_version=dists["triton"],
            torch_npu_version=dists["torch_npu"],
            hip_version=hip,
            modules=mods,
            distributions=dists,
            is_fake=True,
        )


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


_cache_lock = threading.Lock()
_MODULE_PROBLEMS: Dict[str, Optional[str]] = {}
_VERSIONS: Dict[str, Optional[Version]] = {}


def _module_problem(name: str) -> Optional[str]:
    if name not in _MODULE_PROBLEMS:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            problem: Optional[str] = f"{name} is not installed"
        else:
            try:
                importlib.import_module(name)
                problem = None
            except Exception as exc:  # a broken install must not break selection
                problem = f"{name} is installed but fails to import ({type(exc).__name__}: {exc})"
        with _cache_lock:
            _MODULE_PROBLEMS[name] = problem
    return _MODULE_PROBLEMS[name]


def _installed_version(key: str) -> Optional[Version]:
    if key not in _VERSIONS:
        version = _dist_version(*DISTRIBUTION_ALIASES.get(key, (key,)))
        with _cache_lock:
            _VERSIONS[key] = version
    return _VERSIONS[key]


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
    version = _dist_version(*DISTRIBUTION_ALIASES["torch_npu"])
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


def _detect_module_devices(devices: Dict[str, DeviceInfo]) -> None:
    """XPU, HPU and a renamed PrivateUse1 backend: whatever ``torch.<type>`` says is available."""
    kinds = ["xpu", "hpu"]
    try:
        private = torch._C._get_privateuse1_backend_name()
        if private and private != "privateuseone":
            kinds.append(private)
    except Exception:
        pass
    for kind in kinds:
        if kind in devices:
            continue
        module = getattr(torch, kind, None)
        try:
            if module is None or not module.is_available():
                continue
            count = int(module.device_count())
            names = tuple(str(module.get_device_name(i)) if hasattr(module, "get_device_name") else f"{kind}:{i}"
                          for i in range(count))
        except Exception:  # a half-installed device module is no device
            continue
        devices[kind] = DeviceInfo(kind, count, names)


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
    _detect_module_devices(devices)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices["mps"] = DeviceInfo("mps", 1, ("Apple MPS",))
    return Environment(
        torch_version=Version(torch.__version__),
        python_version=platform.python_version(),
        devices=devices,
        triton_version=_dist_version(*DISTRIBUTION_ALIASES["triton"]),
        torch_npu_version=npu_version,
        hip_version=getattr(torch.version, "hip", None),
        cuda_version=getattr(torch.version, "cuda", None),
    )


_current: Optional[Environment] = None


def get_environment() -> Environment:
    """The environment in force: detected once per process unless replaced."""
    global _current
    env = _current
    if env is None:
        with _cache_lock:
            if _current is None:
                _current = detect()
            env = _current
    return env


def set_environment(env: Optional[Environment]) -> None:
    """Replace the process-wide environment (None: detect again). Selections made for another one
    are dropped."""
    global _current
    _current = env
