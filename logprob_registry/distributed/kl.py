"""``kl_divergence(..., process_group=...)``: both sides' vocabulary shards on each rank; its plan
(:data:`PLAN`) and its side of the skeleton of :mod:`.skeleton` (:class:`KL`).

Each rank holds the same columns ``[start, start + V_local)`` of the student and of the teacher:
logits ``(..., V_local)``, or hidden states with a weight shard ``(V_local, H)`` (either side).

Forward: the shard's tile statistics come from the registry (``kl_shard_stats``): per row and grid
tile of ``zs = student / T`` and ``zt = teacher / T``, each side's max and exact sum of
exponentials, and the tile's exact cross term (``"forward"``: ``sum et (zt - zs)`` with
``et = exp(zt - mt)``; ``"reverse"``: ``sum es (zs - zt)``), each depending on the tile's own columns
only. After the header, the tiles two ranks share are completed against both sides' maxima
(:func:`.core.complete`), and the five statistics are gathered in one all-gather
(:func:`.core.gather`) and merged in global tile order
(:func:`~.merge.merge_cross`): ``KL = cross / S - lse_t + lse_s`` (forward, the cross rescaled to the
teacher's maximum; reverse the other way round). Every rank returns the complete result; ``mask``
False rows give 0.

Backward: the student's logits shard gets ``(ps - pt) / T`` (forward) or ``ps (log ps - log pt -
KL) / T`` (reverse) times the upstream gradient, with no communication (``kl_shard_grad``, from the
merged log-sum-exps and KL). A hidden-state student: ``kl_shard_grad`` gives the weight shard's
gradient and this shard's share of the hidden gradient, which one all-reduce (sum, with a failure
flag) completes on every rank. The teacher gets no gradient.

Not supported yet: ``support=`` (refused by :mod:`.support` with NotImplementedError, on every rank).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..call import Call
from ..registry import Expected, Registry
from . import core, header
from .group import Group
from .merge import merge_cross
from .skeleton import Plan, Sharded, function
from .tiles import NEG_INF, TILE, grid

STATS_OP, GRAD_OP = "kl_shard_stats", "kl_shard_grad"
_STATS = ("student_max", "student_sumexp", "teacher_max", "teacher_sumexp", "cross")


class KL(Sharded):
    """kl_divergence's side of the skeleton (:class:`.sharded.Sharded`): its flags, its five tile
    statistics, their merge into the KL, and the student's gradient."""

    labels_name = "mask"  # the header compares the mask's checksums
    maxima = (0, 2)  # student_max, teacher_max: each side's sums are measured against its own

    def __init__(self, plan: Plan, op: str, call: Union[Call, BaseException], group: Group,
                 registry: Registry) -> None:
        super().__init__(plan, op, call, group, registry)
        self.mask = self.options.get("mask")
        self.student_weight = self.options.get("student_weight")
        self.hidden = self.student_weight is not None

    def differentiable(self) -> tuple:
        return self.call.inputs[0], self.student_weight

    def checked(self) -> Optional[torch.Tensor]:
        return self.mask

    def _options(self) -> dict:
        options = self.options
        return dict(student_weight=options["student_weight"], teacher_weight=options["teacher_weight"],
                    vocab_start=self.start, tile=TILE, temperature=options["temperature"],
                    direction=options["direction"])

    def describe(self, local: header.Local) -> None:
        options = self.options
        flags = 0
        if self.mask is not None:
            flags |= header.HAS_LABELS
        if self.call.vocab_start is not None:
            flags |= header.START_GIVEN
        if options["direction"] == "reverse":
            flags |= header.KL_REVERSE
        if options["teacher_weight"] is not None:
            flags |= header.TEACHER_HIDDEN
        if any(self.needs):
            flags |= header.GRAD
        if self.hidden and self.needs[0]:  # the hidden gradient's all-reduce: every rank must agree to join it
            flags |= header.GRAD_HIDDEN
        local.flags = flags

    def local_stats(self, local: header.Local, acc: torch.dtype) -> Optional[core.Stats]:
        if not local.rows:
            return None
        key = self.key(self.plan.stats_op)
        out = self.tile_stats(key, self.call.inputs, self._options(), (True,) * len(_STATS), None, acc)
        return out._replace(recompute=lambda slot, references, rows: self._slot_stats(key, slot, references, rows,
                                                                                     acc))

    def _slot_stats(self, key, slot: int, references: tuple, rows: torch.Tensor, acc) -> tuple:
        """One grid tile's statistics of the flat rows ``rows`` against ``references`` (the whole
        tile's student and teacher maxima there): the same shard op over both sides' columns in that
        tile, on every row (the two sides' options are per row), those rows taken from it."""
        piece = grid(self.start, self.call.vocab, TILE)[slot]
        c0, c1 = piece.c0, piece.c1
        lead = self.call.inputs[0].shape[:-1]
        full = []
        for ref in references:  # every row: the others' references do not matter, their values are dropped
            whole = torch.full((self.rows,), NEG_INF, dtype=ref.dtype, device=ref.device)
            full.append(whole.index_copy_(0, rows, ref).view(lead))
        options = dict(self._options(), vocab_start=self.start + c0, student_reference=full[0],
                       teacher_reference=full[1])
        sides = list(self.call.inputs)
        for i, name in enumerate(("student_weight", "teacher_weight")):
            if options[name] is not None:
                options[name] = options[name][c0:c1]
            else:
                sides[i] = sides[i][..., c0:c1]
        tiles = self.tile_stats(key, tuple(sides), options, (True,) * len(_STATS), None, acc,
                                start=self.start + c0, width=c1 - c0).tiles
        return tuple(None if t is None else t[rows.to(t.device)] for t in tiles)

    def packed(self) -> Tuple[int, int]:
        return len(_STATS), 0

    def results(self, layout, gathered, width, lead, device, acc, on) -> Tuple[tuple, tuple]:
        """``((kl,), (kl, lse_student, lse_teacher))``, each of the positions' shape (kl masked)."""
        ms, ss, mt, st, cross = (core.in_order(gathered, width, layout, i, len(_STATS), self.maxima)
                                 for i in range(len(_STATS)))
        if self.options["direction"] == "forward":
            lse_t, mean = merge_cross(mt, st, cross)
            lse_s, _ = merge_cross(ms, ss, torch.zeros_like(ss))
            kl = mean - lse_t + lse_s
        else:
            lse_s, mean = merge_cross(ms, ss, cross)
            lse_t, _ = merge_cross(mt, st, torch.zeros_like(st))
            kl = mean - lse_s + lse_t
        if self.mask is not None:
            kl = torch.where(self.mask.reshape(-1).to(kl.device), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
        kl = kl.view(lead).to(on.device)
        return (kl,), (kl, lse_s.view(lead).to(on.device), lse_t.view(lead).to(on.device))

    def empty(self, lead, acc, on) -> Tuple[tuple, tuple]:
        empty = torch.zeros(lead, dtype=acc, device=on.device)
        return (empty,), (empty, empty.clone(), empty.clone())

    def release(self) -> None:
        self.teacher = self.call.inputs[1]  # a detached target, not an input of the Function
        super().release()

    def backward(self, tensors: tuple, saved: tuple, grads: tuple, needs: tuple) -> tuple:
        """The gradients of the student (logits shard; or hidden and weight shard)."""
        student, _ = tensors
        kl, lse_s, lse_t = saved
        (grad_kl,) = grads
        if grad_kl is None:  # as a materialized gradient: zeros
            grad_kl = torch.zeros_like(kl)
        lead = kl.shape
        g = grad_kl.reshape(lead).to(kl.dtype).contiguous()
        mask = None if self.mask is None else self.mask.reshape(lead)
        if mask is not None:
            g = g.masked_fill(~mask, 0.0)
        options = self._options()
        inputs = (student, self.teacher, lse_s, lse_t, kl, g, mask)
        if not self.hidden:
            if not kl.numel():
                return torch.zeros_like(student), None
            options["needs_grad"] = (True, False)
            shape = tuple(student.shape)
            expected = (Expected(shape, student.dtype, words=f"the shard's shape {shape} and dtype {student.dtype}"),
                        None)
            grad, _ = self.shard(self.grad_key, inputs, options, expected, self.forced)
            return (grad if needs[0] else None), None
        options["needs_grad"] = needs
        gs, gw = self.reduced_gradient(inputs if kl.numel() else None, options, student, kl.dtype,
                                       "kl_divergence(..., student_weight=..., process_group=...)")
        return (gs if needs[0] else None), (gw if needs[1] else None)


PLAN = Plan(STATS_OP, GRAD_OP, KL, function("process_group= (kl_divergence)",
                                            "For second-order gradients, gather the shards and call without "
                                            "process_group."))
