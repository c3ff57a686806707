"""``kl_divergence(..., process_group=...)``: both sides' vocabulary shards on each rank.

Each rank holds the same columns ``[start, start + V_local)`` of the student and of the teacher:
logits ``(..., V_local)``, or hidden states with a weight shard ``(V_local, H)`` (either side). The
call follows the skeleton of :mod:`.sharded`:

Forward: the shard's tile statistics come from the registry (``kl_shard_stats``): per row and tile
of ``zs = student / T`` and ``zt = teacher / T``, each side's max and sum of exponentials, and the
tile's cross term (``"forward"``: ``sum et (zt - zs)`` with ``et = exp(zt - mt)``; ``"reverse"``:
``sum es (zs - zt)``), each depending on the tile's own columns only. The headers are exchanged
(every rank raises the same error, or none), the five statistics gathered in one all-gather and
merged in global tile order (:func:`~.merge.merge_cross`): ``KL = cross / S - lse_t + lse_s``
(forward, the cross rescaled to the teacher's maximum; reverse the other way round). Every rank
returns the complete result; ``mask`` False rows give 0.

Backward: the student's logits shard gets ``(ps - pt) / T`` (forward) or ``ps (log ps - log pt -
KL) / T`` (reverse) times the upstream gradient, with no communication (``kl_shard_grad``, from the
merged log-sum-exps and KL). A hidden-state student: ``kl_shard_grad`` gives the weight shard's
gradient and this shard's share of the hidden gradient, which one all-reduce (sum, with a failure
flag, as :mod:`.sharded`) completes on every rank. The teacher gets no gradient.

Not supported yet: ``support=`` (refused by :mod:`.support` with NotImplementedError, on every rank).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.autograd.function import once_differentiable

from ..call import Call
from ..kit import backward_without_autocast, first_order_only, result_dtype
from ..registry import get_registry
from . import core, header, support
from .group import Group
from .merge import merge_cross
from .tiles import TILE

STATS_OP, GRAD_OP = "kl_shard_stats", "kl_shard_grad"
_STATS = ("student_max", "student_sumexp", "teacher_max", "teacher_sumexp", "cross")


class _KL:
    """One ``kl_divergence(..., process_group=...)`` call on this rank (see :class:`.sharded._Sharded`)."""

    def __init__(self, call: Union[Call, BaseException], group: Group) -> None:
        self.group = group
        self.call = call if isinstance(call, Call) else None
        self.error = call if isinstance(call, BaseException) else None
        options = self.call.options if self.call is not None else {}
        self.mask = options.get("mask")
        self.student_weight = options.get("student_weight")
        self.hidden = self.student_weight is not None
        self.needs = self.call.needs_grad if self.call is not None else (False, False)
        self.forced: Optional[str] = None
        self.start = 0

    def _options(self) -> dict:
        options = self.call.options
        return dict(student_weight=options["student_weight"], teacher_weight=options["teacher_weight"],
                    vocab_start=self.start, tile=TILE, temperature=options["temperature"],
                    direction=options["direction"])

    def _flags(self, start_given: bool) -> int:
        options = self.call.options
        flags = 0
        if self.mask is not None:
            flags |= header.HAS_LABELS
        if start_given:
            flags |= header.START_GIVEN
        if options["direction"] == "reverse":
            flags |= header.KL_REVERSE
        if options["teacher_weight"] is not None:
            flags |= header.TEACHER_HIDDEN
        if any(self.needs):
            flags |= header.GRAD
        if self.hidden and self.needs[0]:  # the hidden gradient's all-reduce: every rank must agree to join it
            flags |= header.GRAD_HIDDEN
        return flags

    # ---------------------------------------------------------------- forward
    def forward(self):
        """``(kl, lse_student, lse_teacher)``, each of the positions' shape (kl masked)."""
        call = self.call
        local = header.Local("kl_divergence", tile=TILE, error=self.error, labels_name="mask")
        stats = None
        on = call.inputs[0] if call is not None else None
        acc = torch.float32
        if call is not None:
            try:
                support.check(call)
                start = call.vocab_start
                self.start = core.describe(local, on, call.vocab, call.options["temperature"], self.group, start,
                                           self.mask, self.hidden)
                local.flags = self._flags(start is not None)
                acc = result_dtype(on.dtype)
                registry = get_registry()
                self.forced = registry.forced(call.backend)[0]
                if call.grad:  # the backward's backend must exist before any collective
                    registry.select(call.shard_key(GRAD_OP), self.forced)
                if local.rows:
                    stats = self._local_stats(local.rows, acc)
            except Exception as exc:  # carried to every rank by the header
                local.error = exc
        device = self.group.device_for(on)
        layout = core.exchange(self.group, local, device)
        lead = local.shape
        if not layout.rows:
            empty = torch.zeros(lead, dtype=acc, device=on.device)
            return empty, empty.clone(), empty.clone()
        nts = layout.tiles
        width = max(nts)
        packet = torch.zeros(layout.rows, len(_STATS) * width, dtype=acc, device=device)
        nt = stats[0].shape[1]
        for i, part in enumerate(stats):
            packet[:, i * width:i * width + nt] = part.to(device)
        gathered = self.group.all_gather(packet, device)

        def part(i: int) -> torch.Tensor:
            return torch.cat([gathered[r, :, i * width:i * width + nts[r]] for r in layout.order], dim=1)

        ms, ss, mt, st, cross = (part(i) for i in range(len(_STATS)))
        if call.options["direction"] == "forward":
            lse_t, mean = merge_cross(mt, st, cross)
            lse_s, _ = merge_cross(ms, ss, torch.zeros_like(ss))
            kl = mean - lse_t + lse_s
        else:
            lse_s, mean = merge_cross(ms, ss, cross)
            lse_t, _ = merge_cross(mt, st, torch.zeros_like(st))
            kl = mean - lse_s + lse_t
        if self.mask is not None:
            kl = torch.where(self.mask.reshape(-1).to(kl.device), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
        return (kl.view(lead).to(on.device), lse_s.view(lead).to(on.device), lse_t.view(lead).to(on.device))

    def _local_stats(self, rows: int, acc: torch.dtype) -> tuple:
        call = self.call
        key = call.shard_key(STATS_OP)
        out = get_registry().call(key, call.backend, call.inputs, self._options())
        nt = -(-call.vocab // TILE)

        def name() -> str:
            return get_registry().select(key, call.backend).name

        if not isinstance(out, (tuple, list)) or len(out) != len(_STATS):
            raise RuntimeError(f"backend {name()!r}: {STATS_OP} returned {type(out).__name__}, not the 5-tuple "
                               f"({', '.join(_STATS)}) the op table specifies")
        flat = []
        for what, value in zip(_STATS, out):
            if not isinstance(value, torch.Tensor) or value.numel() != rows * nt:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise RuntimeError(f"backend {name()!r}: {STATS_OP} returned {what} of shape {got}, expected {rows} "
                                   f"rows x {nt} tiles of {TILE} columns")
            flat.append(value.reshape(rows, nt).to(acc))
        return tuple(flat)

    # --------------------------------------------------------------- backward
    def backward(self, student, weight, kl, lse_s, lse_t, grad_kl, needs: tuple) -> tuple:
        """The gradients of the student (logits shard; or hidden and weight shard)."""
        lead = kl.shape
        g = grad_kl.reshape(lead).to(kl.dtype).contiguous()
        mask = None if self.mask is None else self.mask.reshape(lead)
        if mask is not None:
            g = g.masked_fill(~mask, 0.0)
        key = self.call.shard_key(GRAD_OP)
        options = self._options()
        teacher = self.call.inputs[1]
        if not self.hidden:
            if not kl.numel():
                return torch.zeros_like(student), None
            options["needs_grad"] = (True, False)
            grad, _ = get_registry().call(key, self.forced, (student, teacher, lse_s, lse_t, kl, g, mask), options)
            if not isinstance(grad, torch.Tensor) or grad.shape != student.shape or grad.dtype != student.dtype:
                name = get_registry().select(key, self.forced).name
                got = f"{tuple(grad.shape)} {grad.dtype}" if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise RuntimeError(f"backend {name!r}: {GRAD_OP} returned {got}, expected the shard's shape "
                                   f"{tuple(student.shape)} and dtype {student.dtype}")
            return grad, None
        failure: Optional[BaseException] = None
        gh = gw = None
        if kl.numel():
            try:
                options["needs_grad"] = needs
                gh, gw = get_registry().call(key, self.forced, (student, teacher, lse_s, lse_t, kl, g, mask), options)
            except Exception as exc:
                failure = exc
        if self.needs[0]:  # agreed by every rank in the header: every rank joins this all-reduce
            gh = core.sum_over_group(self.group, student, gh, kl.dtype, failure,
                                     "kl_divergence(..., student_weight=..., process_group=...)")
        elif failure is not None:
            raise failure
        return gh, gw


class _KLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _KL, student, weight):
        kl, lse_s, lse_t = run.forward()
        ctx.run = run
        ctx.save_for_backward(student, weight, kl, lse_s, lse_t)
        return kl

    @staticmethod
    @backward_without_autocast
    @first_order_only("process_group= (kl_divergence)",
                      "For second-order gradients, gather the shards and call without process_group.")
    @once_differentiable
    def backward(ctx, grad_kl):
        run: _KL = ctx.run
        student, weight, kl, lse_s, lse_t = ctx.saved_tensors
        needs = tuple(bool(n) for n in ctx.needs_input_grad[1:3])
        gs, gw = run.backward(student, weight, kl, lse_s, lse_t, grad_kl, needs)
        return None, (gs if needs[0] else None), (gw if needs[1] else None)


def run(call: Union[Call, BaseException], group: Group) -> Any:
    """``kl_divergence`` over this rank's vocabulary shards; the complete result on every rank."""
    run = _KL(call, group)
    if run.call is not None and run.call.grad and "functorch" not in run.call.features:
        return _KLFunction.apply(run, run.call.inputs[0], run.student_weight)
    return run.forward()[0]
