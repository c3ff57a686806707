"""The process group of a call: this rank's place in it, the device its collectives run on, and the
two collectives the vocabulary-parallel path uses (an all-gather and a sum all-reduce).

Collectives run on the group's device: the tensors' own device when the group has a backend of
that device's own for it (NCCL for CUDA tensors, HCCL for Ascend NPU tensors, XCCL ...), else the
CPU when the group serves it (gloo: CUDA tensors' statistics are copied to the CPU and back, a few
numbers per row), else the group's first device type. Only "gloo" is singled out, as the CPU
backend that also registers itself for CUDA; any other torch.distributed backend is taken as the
native one of the device types it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

_traffic = [0]  # bytes this process received through the collectives below (see traffic())


def traffic(reset: bool = False) -> int:
    """Bytes this process has received through the vocabulary-parallel collectives: every other
    rank's part of an all-gather, and ``2 (W - 1) / W`` of an all-reduce's buffer (what a ring
    all-reduce moves per rank). ``bench --process-group`` reads it; ``reset`` sets it back to 0."""
    value = _traffic[0]
    if reset:
        _traffic[0] = 0
    return value


def _dist():
    import torch.distributed as dist

    return dist


@dataclass(frozen=True)
class Group:
    """One call's process group, resolved."""

    handle: Any           # the torch.distributed ProcessGroup
    rank: int             # this process's rank in it
    size: int
    device_types: tuple   # the device types its backends serve, e.g. ("cuda", "cpu") for gloo
    backends: tuple = ()  # (device type, backend name) pairs, e.g. (("cuda", "nccl"), ("cpu", "gloo"))

    def device_for(self, tensor: Optional[torch.Tensor]) -> torch.device:
        """Where this group's collectives run for data living on ``tensor``'s device."""
        names = dict(self.backends)
        if isinstance(tensor, torch.Tensor) and tensor.device.type in self.device_types:
            if tensor.device.type == "cpu" or names.get(tensor.device.type, "") != "gloo":
                return tensor.device
        if "cpu" in self.device_types:
            return torch.device("cpu")
        kind = self.device_types[0] if self.device_types else "cpu"
        if kind == "cpu":
            return torch.device("cpu")
        module = getattr(torch, kind, None)  # torch.cuda, torch.npu (torch_npu), torch.xpu ...
        index = module.current_device() if module is not None and hasattr(module, "current_device") else None
        return torch.device(kind, index) if index is not None else torch.device(kind)

    def all_gather(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``(size, *tensor.shape)``: every rank's ``tensor`` in rank order, on ``device`` (one
        collective; bytes are moved, never rounded)."""
        dist = _dist()
        local = tensor.to(device).contiguous()
        # gloo wants the output as the inputs concatenated on dim 0, not stacked; NCCL takes both.
        out = torch.empty((self.size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
        gather(out, local, group=self.handle)
        _traffic[0] += (self.size - 1) * local.numel() * local.element_size()
        return out.view((self.size,) + tuple(local.shape))

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, on the group's device) over the group, in place."""
        _dist().all_reduce(tensor, group=self.handle)
        _traffic[0] += 2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        return tensor


def resolve(process_group: object) -> Group:
    """The :class:`Group` of ``process_group``, or an error saying why it cannot be used.

    These errors are raised at once, on this rank only, and hang no other rank: a process that is
    not a member of the group takes part in none of its collectives.
    """
    try:
        dist = _dist()
    except ImportError:  # pragma: no cover - torch built without distributed support
        raise RuntimeError("process_group= needs torch.distributed, which this torch build lacks") from None
    if not dist.is_available():
        raise RuntimeError("process_group= needs torch.distributed, which this torch build lacks "
                           "(torch.distributed.is_available() is False)")
    if isinstance(process_group, int) and not isinstance(process_group, bool) \
            and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(_not_member(dist))
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup (torch.distributed.group.WORLD or one from "
            f"torch.distributed.new_group), got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("process_group= was given but torch.distributed is not initialized in this process; "
                           "call torch.distributed.init_process_group first")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(_not_member(dist))
    size = dist.get_world_size(process_group)
    name = str(dist.get_backend(process_group)).lower()
    try:
        types = tuple(d.type for d in process_group._device_types)
    except AttributeError:  # an older torch: the backend's name says it
        types = tuple(kind for backend, kind in (("gloo", "cpu"), ("nccl", "cuda"), ("hccl", "npu"))
                      if backend in name) or ("cpu",)
    if ":" in name:  # "cpu:gloo,cuda:nccl"
        backends = tuple(tuple(pair.split(":", 1)) for pair in name.split(","))
    else:
        backends = tuple((kind, name) for kind in types)
    return Group(process_group, rank, size, types, backends)


def _not_member(dist) -> str:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return (f"this process (global rank {rank}) is not a member of process_group: call the op only on the "
            "group's ranks (torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER to the others), "
            "or pass a group that contains this rank")
