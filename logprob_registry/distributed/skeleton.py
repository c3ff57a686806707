"""The one skeleton every public op runs with ``process_group=``: :class:`Sharded` (forward, and
the backward's pieces) and its autograd :func:`function`, driven by the op's :class:`Plan`.

A plan names the op's shard ops (statistics, gradient), its side of the skeleton (a subclass of
:class:`Sharded` filling in its hooks: the header's flags, the statistics before and after the
header, their merge into the outputs, the gradient op's inputs; :class:`.sharded.Logits` (and
its subclass :class:`.sharded.Stats`, token_stats'), :class:`.kl.KL`) and its autograd Function.
:mod:`.sharded` chooses the plan of a call and runs it.

Forward (:meth:`Sharded.forward`): the call arrives validated, or as the validation error to
raise; what the path does not support raises here (:mod:`.support`). Either way nothing is raised
yet: the header is described, the backward's backend pre-selected (an explicit choice in force now
holds for the backward too: ``Registry.preselect``), the shard's statistics come from the registry
(which checks every shard op's outputs against the op table: ``Registry.run``), the headers are
exchanged (every rank raises the same error, or none), and after the side's own rounds (the
sampler's truncation decision) the statistics are gathered and merged (:mod:`.core`). Every rank
returns the complete result.

Backward: the side's gradient op through the registry with the pre-selected backend; for a
replicated input (hidden states), :meth:`Sharded.reduced_gradient`: this shard's share summed by one
all-reduce that carries a failure flag, so that a rank whose backward failed still joins it (with
zeros) and every rank raises instead of the others hanging.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from ..amp import backward_without_autocast
from ..autograd import first_order_only
from ..call import Call, key_for
from ..dtypes import result_dtype
from ..opspec import OPS
from ..registry import Expected, Registry
from . import core, header, support
from .group import Group
from .tiles import TILE, grid_slots


class Plan(NamedTuple):
    """What a public op runs with ``process_group=``: its shard ops (statistics, gradient), the side of
    the skeleton that merges its statistics into its outputs and differentiates them (a subclass of
    :class:`Sharded`), and its autograd Function (whose backward refuses double backward with a
    remedy that works with a group)."""

    stats_op: str
    grad_op: str
    side: type
    function: type


class Sharded:
    """One process_group= call on this rank, as every op runs it: :meth:`forward` (the support check,
    the header described and exchanged, the backward's backend pre-selected, the statistics gathered
    and merged) and the backward's pieces (:meth:`shard`, :meth:`reduced_gradient`). What differs
    between the ops is its plan's side, a subclass filling in the hooks below. Attributes keep what
    forward leaves for backward: autograd saves tensors only through ``ctx``."""

    #: What the header's checksum covers (``labels``, or kl_divergence's mask), for its message.
    labels_name = "labels"
    #: The indices of the per-tile statistics that are maxima (the others are sums against them).
    maxima: Tuple[int, ...] = (0,)

    def __init__(self, plan: Plan, op: str, call: Union[Call, BaseException], group: Group,
                 registry: Registry) -> None:
        self.plan, self.op, self.group, self.registry = plan, op, group, registry
        self.call = call if isinstance(call, Call) else None
        self.error = call if isinstance(call, BaseException) else None
        self.options = self.call.options if self.call is not None else {}
        self.needs = self.call.needs_grad if self.call is not None else (False,)
        self.hidden = False     # inputs[0] is hidden states: the header compares their size; its gradient is summed
        self.features: tuple = ()  # the shard ops' features this call needs
        self.forced: Optional[str] = None  # the explicit backend in force at forward, for backward
        self.grad_key = None
        self.start = self.rows = 0

    # ---------------------------------------------------- the op's side (the plan's hooks)
    def differentiable(self) -> tuple:
        """The tensors the autograd Function takes (and whose gradients backward returns)."""
        raise NotImplementedError

    def checked(self) -> Optional[torch.Tensor]:
        """The tensor whose checksums the header compares (the labels, or the mask)."""
        return None

    def describe(self, local: header.Local) -> None:
        """This op's part of the header row (its flags, ...); may raise (carried by the header)."""

    def local_stats(self, local: header.Local, acc: torch.dtype) -> Optional[core.Stats]:
        """This shard's statistics before the header exchange (or None: after :meth:`rounds`)."""
        return None

    def check_layout(self, layout: header.Layout) -> None:
        """Checks once the whole vocabulary is known: the same verdict on every rank."""

    def rounds(self, layout: header.Layout, stats: Optional[core.Stats], device, acc) -> tuple:
        """``(stats, failure)``: the statistics to gather, after any rounds of their own (the
        truncation decision); ``failure``: this rank's error since the header, carried by the gather."""
        return stats, None

    def packed(self) -> Tuple[int, int]:
        """The gather's per-tile statistics and per-row columns (:func:`.core.gather`)."""
        raise NotImplementedError

    def results(self, layout, gathered, width, lead, device, acc, on) -> Tuple[tuple, tuple]:
        """``(outputs, saved)`` from the gathered statistics: what the public function returns (a
        tuple), what backward reads."""
        raise NotImplementedError

    def empty(self, lead, acc, on) -> Tuple[tuple, tuple]:
        """:meth:`results` of a call without rows."""
        raise NotImplementedError

    def non_differentiable(self, outputs: tuple) -> tuple:
        return ()

    def backward(self, tensors: tuple, saved: tuple, grads: tuple, needs: tuple) -> tuple:
        """The gradients of :meth:`differentiable`'s tensors (``needs``: which are asked for)."""
        raise NotImplementedError

    # ------------------------------------------------------------------- the skeleton
    def key(self, op: str, requires_grad: bool = False):
        """The key of the shard op ``op`` for this call (with the features it needs)."""
        on = self.call.inputs[0]
        return key_for(op, device=on.device, dtype=on.dtype, requires_grad=requires_grad, features=self.features)

    def shard(self, key, inputs: tuple, options: dict, expected: Optional[tuple], backend: Optional[str]) -> Any:
        """A shard op through the registry, its outputs checked against the op table and ``expected``."""
        return self.registry.run(key, backend, inputs, options, expected)[1]

    def tile_stats(self, key, inputs: tuple, options: dict, present: tuple, labels: Optional[int],
                   acc: torch.dtype, start: Optional[int] = None, width: Optional[int] = None,
                   after: int = 0, rows: Optional[int] = None) -> core.Stats:
        """A statistics shard op's per-tile statistics (those ``present``), ``(rows, n_tiles)`` each
        (the maxima in ``acc``, the sums in float64), and with ``labels`` (not None: the
        op's output after them) the label logits per row, after the ``after`` per-row outputs that
        follow them (``shard_token_stats``' row max and first maximum, in ``acc``: ids below 2**24
        are exact); ``start``, ``width``: of the columns the call covers (default: the shard's);
        ``rows``: the inputs' rows, flat (default: the call's)."""
        start = self.start if start is None else start
        width = self.call.vocab if width is None else width
        rows = self.rows if rows is None else rows
        nt = grid_slots(start, width, TILE)
        tile = Expected((rows, nt), flat=True, words=f"{rows} rows x {nt} grid tiles of {TILE} columns")
        expected = tuple(tile if wanted else None for wanted in present)
        if labels is not None:
            expected += (Expected((rows, labels), flat=True, words=f"{rows} rows x {labels} label logits")
                         if labels else None,)
        expected += (Expected((rows,), flat=True, words=f"{rows} rows (the leading dims)"),) * after
        out = self.shard(key, inputs, options, expected, self.call.backend)
        parts = tuple(value.reshape(rows, nt).to(acc if i in self.maxima else torch.float64) if wanted else None
                      for i, (wanted, value) in enumerate(zip(present, out)))
        per_row = out[len(present)].reshape(rows, labels).to(acc) if labels else None
        if after:  # the per-row outputs first, the label logits last (core.combine reads them from the end)
            more = torch.stack([v.reshape(rows).to(acc) for v in out[len(present) + 1:len(present) + 1 + after]], 1)
            per_row = more if per_row is None else torch.cat([more, per_row], 1)
        return core.Stats(parts, per_row)

    def gathered(self, layout, stats: Optional[core.Stats], count: int, device, acc,
                 failure: Optional[BaseException] = None):
        """:func:`.core.gather` of ``count`` statistics, the shared grid tiles completed first
        (:func:`.core.complete`)."""
        stats, failure = core.complete(self.group, layout, stats, device, acc, failure, self.maxima)
        return core.gather(self.group, layout, stats, count, self.packed()[1], device, acc, failure, self.maxima)

    def forward(self) -> Tuple[tuple, tuple]:
        """``(outputs, saved)`` on every rank (see :meth:`results`), or every rank raises the same error."""
        call = self.call
        local = header.Local(self.op, tile=TILE, error=self.error, labels_name=self.labels_name)
        stats = None
        on = call.inputs[0] if call is not None else None
        acc = torch.float32
        if call is not None:
            try:
                support.check(call)
                self.start = core.describe(local, on, call.vocab, call.options["temperature"], self.group,
                                           call.vocab_start, self.checked(), self.hidden)
                self.rows = local.rows
                self.describe(local)
                acc = result_dtype(on.dtype)
                if call.grad:  # the backward's backend must exist before any collective: fail now, on every rank
                    self.forced = self.registry.preselect(self.key(self.plan.grad_op), call.backend)
                stats = self.local_stats(local, acc)
            except Exception as exc:  # carried to every rank by the header
                local.error = exc
        device = self.group.device_for(on)
        layout = core.exchange(self.group, local, device)
        self.check_layout(layout)
        if not layout.rows:
            return self.empty(local.shape, acc, on)
        stats, failure = self.rounds(layout, stats, device, acc)
        gathered, width = self.gathered(layout, stats, self.packed()[0], device, acc, failure)
        return self.results(layout, gathered, width, local.shape, device, acc, on)

    def release(self) -> None:
        """After forward, under autograd: keep what backward needs (the options, the gradient op's
        key) and drop the call's inputs, which the Function saves through ``ctx`` (so saved-tensor
        hooks, offloading and checkpointing see them, and nothing keeps the shard alive)."""
        self.grad_key = self.key(self.plan.grad_op)
        self.call = None

    def reduced_gradient(self, inputs: Optional[tuple], options: dict, like: torch.Tensor, acc: torch.dtype,
                         what: str) -> tuple:
        """The gradient op's outputs (None each without ``inputs``: nothing to compute here), its first
        (this shard's share of the gradient of ``like``, replicated on every rank: hidden states)
        summed over the group when it is needed. That all-reduce carries a failure flag: a rank whose
        gradient op failed still joins it (with zeros), so that every rank raises (naming ``what``)
        instead of the others hanging; every rank agreed in the header to join it."""
        failure: Optional[BaseException] = None
        out: tuple = (None,) * len(OPS[self.plan.grad_op].outputs)
        if inputs is not None:
            try:
                out = tuple(self.shard(self.grad_key, inputs, options, None, self.forced))
            except Exception as exc:
                failure = exc
        if self.needs[0]:
            return (core.sum_over_group(self.group, like, out[0], acc, failure, what),) + out[1:]
        if failure is not None:
            raise failure
        return out


# ------------------------------------------------------------------ the autograd Function
def _forward(ctx, run: Sharded, *tensors):
    outs, saved = run.forward()
    fixed = run.non_differentiable(outs)
    if fixed:
        ctx.mark_non_differentiable(*fixed)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, *saved)
    ctx.count = len(tensors)
    run.release()
    ctx.run = run
    return outs if len(outs) > 1 else outs[0]


def _backward(ctx, *grads):
    saved = ctx.saved_tensors
    count = ctx.count
    needs = tuple(bool(n) for n in ctx.needs_input_grad[1:count + 1])
    return (None, *ctx.run.backward(tuple(saved[:count]), tuple(saved[count:]), grads, needs))


def function(what: str, remedy: str) -> type:
    """The autograd Function of a plan: forward as :meth:`Sharded.forward`, backward as its side's
    :meth:`Sharded.backward` (under no autocast); double backward refused, naming ``what`` and
    ``remedy``."""

    class ShardedFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, run: Sharded, *tensors):
            return _forward(ctx, run, *tensors)

        @staticmethod
        @backward_without_autocast
        @first_order_only(what, remedy)
        @once_differentiable
        def backward(ctx, *grads):
            return _backward(ctx, *grads)

    return ShardedFunction
