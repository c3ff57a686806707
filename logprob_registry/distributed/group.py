"""The process group of a call: this rank's place in it, the device its collectives run on, and the
two collectives the vocabulary-parallel path uses (an all-gather and a sum all-reduce).

Collectives run on the group's device: the tensors' own device when the group's backend serves
that device type (NCCL for CUDA tensors, HCCL for Ascend NPU tensors, gloo for CPU tensors), else
the group's first device type (gloo: the CPU), with a copy there and back. Nothing here depends on
the backend's name, so any torch.distributed backend works the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


def _dist():
    import torch.distributed as dist

    return dist


@dataclass(frozen=True)
class Group:
    """One call's process group, resolved."""

    handle: Any           # the torch.distributed ProcessGroup
    rank: int             # this process's rank in it
    size: int
    device_types: tuple   # the device types its backends serve, e.g. ("cpu",) for gloo

    def device_for(self, tensor: Optional[torch.Tensor]) -> torch.device:
        """Where this group's collectives run for data living on ``tensor``'s device."""
        if tensor is not None and isinstance(tensor, torch.Tensor) and tensor.device.type in self.device_types:
            return tensor.device
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
        return out.view((self.size,) + tuple(local.shape))

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, on the group's device) over the group, in place."""
        _dist().all_reduce(tensor, group=self.handle)
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
    try:
        types = tuple(d.type for d in process_group._device_types)
    except AttributeError:  # an older torch: the backend's name says it
        name = str(dist.get_backend(process_group)).lower()
        types = tuple(kind for backend, kind in (("gloo", "cpu"), ("nccl", "cuda"), ("hccl", "npu"))
                      if backend in name) or ("cpu",)
    return Group(process_group, rank, size, types)


def _not_member(dist) -> str:
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return (f"this process (global rank {rank}) is not a member of process_group: call the op only on the "
            "group's ranks (torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER to the others), "
            "or pass a group that contains this rank")
