"""``logprobs_from_logits``, ``entropy_from_logits`` and ``logprobs_and_entropy`` with
``process_group=``: each rank holds a vocabulary shard ``(..., V_local)`` of the logits.

Forward: validate, compute the shard's tile statistics through the registry (op ``shard_stats``),
exchange the headers, gather the statistics, merge (:mod:`.core`). Every rank returns the complete
result. Backward needs no communication: the shard's gradient comes from the merged log-sum-exp
and entropy through the registry (op ``shard_grad``), out of place or over the shard's storage
(``inplace_backward``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from torch.autograd.function import once_differentiable

from .. import config
from .. import validation as v
from ..amp import backward_without_autocast
from ..dtypes import result_dtype
from ..kernels._common import first_order_only
from ..registry import Key, get_registry
from . import core, header
from .group import Group, resolve
from .support import check_context, check_not_candidates, check_supported
from .tiles import TILE


class _Call:
    """Everything of one call except the logits: the options, the group, and what forward keeps
    for backward (as attributes, since autograd saves tensors only through ``ctx``)."""

    def __init__(self, op: str, labels: Any, options: Dict[str, Any], group: Group, vocab_start: Any,
                 backend: Optional[str], grad: bool) -> None:
        self.op, self.labels, self.options, self.group = op, labels, options, group
        self.vocab_start, self.backend = vocab_start, backend
        self.grad = grad  # known before autograd's forward, which runs with gradients disabled
        self.want_logprobs = op != "entropy"
        self.want_entropy = op != "logprobs"
        self.forced: Optional[str] = None   # the explicit backend in force at forward, for backward
        self.start = 0
        self.temperature = 1.0
        self.inplace = False

    # ---------------------------------------------------------------- forward
    def forward(self, logits: Any):
        """``(outputs, lse, entropy)``; outputs as the public function returns them."""
        local = header.Local(self.op, tile=TILE)
        labels = acc = stats = None
        ignore_index = None
        try:
            config.check()
            check_context()
            check_supported(self.op, self.options)
            logits = v.check_logits(logits)
            lead = tuple(logits.shape[:-1])
            local.dtype, local.shape, local.rows, local.width = logits.dtype, lead, math.prod(lead), logits.shape[-1]
            self.temperature = local.temperature = v.check_temperature(self.options.get("temperature", 1.0))
            ignore_index = v.check_ignore_index(self.options.get("ignore_index"))
            self.inplace = v.check_flag(self.options.get("inplace_backward", False), "inplace_backward")
            if self.want_logprobs:
                check_not_candidates(self.labels, logits)
                labels = local.labels = v.check_labels(self.labels, logits, "logits")
            start = v.check_vocab_start(self.vocab_start)
            self.start = local.start = start if start is not None else self.group.rank * local.width
            local.flags = _flags(self, labels, start, ignore_index)
            local.ignore_index = ignore_index if ignore_index is not None else 0
            acc = result_dtype(logits.dtype)
            registry = get_registry()
            self.forced = registry.forced(self.backend)[0]
            grad = self.grad
            if grad:  # the backward's backend must exist before any collective: fail now, on every rank
                registry.select(Key("shard_grad", logits.device.type, logits.dtype, False), self.forced)
            if local.rows:
                options = dict(vocab_start=self.start, tile=TILE, temperature=self.temperature,
                               ignore_index=ignore_index, with_entropy=self.want_entropy)
                stats = core.local_stats("shard_stats", self.backend,
                                         Key("shard_stats", logits.device.type, logits.dtype, grad),
                                         (logits, labels), options, local.rows, local.width, TILE, acc,
                                         self.want_entropy, self.want_logprobs)
        except Exception as exc:  # carried to every rank by the header
            local.error = exc
        device = self.group.device_for(logits)
        layout = core.exchange(self.group, local, device)
        if labels is not None:
            v.check_label_range(labels, layout.vocab, ignore_index)  # the same labels everywhere: same verdict
        lead = local.shape
        if not layout.rows:
            empty = torch.zeros(lead, dtype=acc, device=logits.device)
            outs = tuple(empty.clone() for _ in range(self.want_logprobs + self.want_entropy))
            return outs, empty, empty
        gathered, width = core.gather(self.group, layout, stats, device, acc)
        merged = core.combine(gathered, width, layout, labels, ignore_index, self.want_entropy)
        outs = []
        if self.want_logprobs:
            outs.append(merged.logprobs.view(lead).to(logits.device))
        if self.want_entropy:
            outs.append(merged.entropy.view(lead).to(logits.device))
        entropy = None if merged.entropy is None else merged.entropy.to(logits.device)
        return tuple(outs), merged.lse.to(logits.device), entropy

    # --------------------------------------------------------------- backward
    def backward(self, logits, labels, lse, entropy, g_lp, g_ent) -> torch.Tensor:
        """The shard's gradient, through the registry's ``shard_grad``."""
        lead = logits.shape[:-1]
        if not lse.numel():
            return torch.zeros_like(logits)
        acc = lse.dtype
        g_lp, g_ent = core.per_row_grads(g_lp, g_ent, lead, acc, labels, self.options.get("ignore_index"))
        options = dict(vocab_start=self.start, temperature=self.temperature, inplace_backward=self.inplace)
        key = Key("shard_grad", logits.device.type, logits.dtype, False)
        inputs = (logits, labels, lse.view(lead), None if entropy is None else entropy.view(lead), g_lp, g_ent)
        grad = get_registry().call(key, self.forced, inputs, options)
        if not isinstance(grad, torch.Tensor) or grad.shape != logits.shape or grad.dtype != logits.dtype:
            name = get_registry().select(key, self.forced).name
            got = f"{tuple(grad.shape)} {grad.dtype}" if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise RuntimeError(f"backend {name!r}: shard_grad returned {got}, expected the shard's shape "
                               f"{tuple(logits.shape)} and dtype {logits.dtype}")
        return grad


def _flags(call: _Call, labels, start, ignore_index) -> int:
    flags = 0
    if call.want_logprobs:
        flags |= header.WANT_LOGPROBS
    if call.want_entropy:
        flags |= header.WANT_ENTROPY
    if labels is not None:
        flags |= header.HAS_LABELS
    if start is not None:
        flags |= header.START_GIVEN
    if ignore_index is not None:
        flags |= header.HAS_IGNORE
    return flags


class _ShardedLogits(torch.autograd.Function):
    """The logits ops with a backward: forward as :meth:`_Call.forward`, backward through ``shard_grad``."""

    @staticmethod
    def forward(ctx, logits, call: _Call):
        outs, lse, entropy = call.forward(logits)
        ctx.call = call
        ctx.set_materialize_grads(False)
        labels = call.labels if call.want_logprobs else None
        ctx.save_for_backward(logits, labels, lse, entropy)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @backward_without_autocast
    @first_order_only("process_group= (the logits ops)",
                      "For second-order gradients, gather the logits to one rank and call without process_group.")
    @once_differentiable
    def backward(ctx, *grads):
        call: _Call = ctx.call
        logits, labels, lse, entropy = ctx.saved_tensors
        grads = list(grads)
        g_lp = grads.pop(0) if call.want_logprobs else None
        g_ent = grads.pop(0) if call.want_entropy else None
        if g_lp is None and g_ent is None:
            return None, None
        return call.backward(logits, labels, lse, entropy if g_ent is not None else None, g_lp, g_ent), None


def run(op: str, logits: Any, labels: Any, options: Dict[str, Any], process_group: Any, vocab_start: Any,
        backend: Optional[str]):
    """The public logits op ``op`` (``logprobs``, ``entropy``, ``logprobs_and_entropy``) over a
    vocabulary shard; returns what the public function returns, on every rank."""
    grad = isinstance(logits, torch.Tensor) and v.needs_grad(logits)
    call = _Call(op, labels, options, resolve(process_group), vocab_start, backend, grad)
    if grad and not v.inside_functorch_transform():  # inside one, forward raises on every rank (support.py)
        return _ShardedLogits.apply(logits, call)
    outs = call.forward(logits)[0]
    return outs if len(outs) > 1 else outs[0]
