"""The Backend record: what a backend computes, where, and what it promises."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet

if TYPE_CHECKING:
    from .environment import Environment

OPS = ("logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden")
DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu", "mps")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Backend:
    """One implementation of some of the ops, and the conditions under which it may run.

    The keyword names are the plugin API and never change meaning. ``available`` is called with the
    detected :class:`~logprob_registry.environment.Environment` and returns ``None`` when the
    backend can run, or a sentence saying why it cannot.
    """

    name: str
    ops: Mapping[str, Callable[..., object]]
    devices: frozenset = frozenset({"cpu"})
    dtypes: frozenset = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    priority: int = 0
    torch: str = ""
    requires: tuple = ()
    autograd: bool = True
    available: Optional[Callable[["Environment"], Optional[str]]] = None
    # Capabilities beyond the fixed plugin API, all with conservative defaults. The conformance
    # suite (logprob_registry.testing) checks each promise a backend makes:
    #   inplace_backward: with inplace_backward=True its backward writes the logits' gradient into
    #     the logits' storage (False: it honours the flag out of place);
    #   batch_invariant: a row's result is bitwise independent of the other rows in the batch;
    #   deterministic: the same inputs give bitwise the same results;
    #   copies_logits: it materialises a copy of the (strided) logits, so the suite's no-copy
    #     memory checks are skipped for it, with that reason (only ``naive`` should need it).
    triton: str = ""
    inplace_backward: bool = False
    batch_invariant: bool = False
    deterministic: bool = True
    copies_logits: bool = False
    memory: str = ""  # extra memory beyond inputs and results, in words, e.g. "full-vocab buffer: ..."
    description: str = ""
    # Like ``available``, for a backend whose needs differ by device type: called with the
    # environment and the device type of the call ("cpu", "cuda", ...).
    available_on: Optional[Callable[["Environment", str], Optional[str]]] = None
    origin: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"backend name {self.name!r} must be lowercase letters and digits joined by dashes, "
                "such as 'my-kernel'"
            )
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(
                f"backend {self.name!r} declares unknown ops {sorted(unknown)}; known ops: {', '.join(OPS)}"
            )
        if not self.ops:
            raise ValueError(f"backend {self.name!r} implements no op; give ops={{'logprobs': fn, ...}}")
        for op, fn in self.ops.items():
            if not callable(fn):
                raise TypeError(f"backend {self.name!r}: ops[{op!r}] is {fn!r}, not a callable")
        devices = frozenset({self.devices} if isinstance(self.devices, str) else self.devices)
        bad = devices - set(DEVICE_TYPES)
        if bad:
            raise ValueError(
                f"backend {self.name!r} names unknown device types {sorted(bad)}; "
                f"known: {', '.join(DEVICE_TYPES)}"
            )
        dtypes = frozenset(self.dtypes)
        if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
            raise TypeError(f"backend {self.name!r}: dtypes must be floating torch dtypes, got {sorted(map(str, dtypes))}")
        for what in ("torch", "triton"):
            spec = getattr(self, what)
            try:
                SpecifierSet(spec)
            except InvalidSpecifier as exc:
                raise ValueError(
                    f"backend {self.name!r}: {what}={spec!r} is not a version specifier such as '>=2.4'"
                ) from exc
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "dtypes", dtypes)
        object.__setattr__(self, "requires", requires)
        object.__setattr__(self, "ops", dict(self.ops))

    def supports(self, op: str) -> bool:
        return op in self.ops
