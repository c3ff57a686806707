"""``logprobs_from_hidden`` with ``process_group=``: each rank holds a shard ``(V_local, H)`` of the
lm_head weight (and ``(V_local,)`` of the bias) and the same hidden states and labels.

Forward as the logits ops (:mod:`.logits`), with the tile statistics of ``hidden @ weight.T + bias``
from the registry's ``hidden_shard_stats``, which never forms the ``(N, V_local)`` logits at once.
Backward: the registry's ``hidden_shard_grad`` gives the weight shard's and bias shard's gradients
and this shard's share of the hidden gradient, which one all-reduce (sum) over the group completes,
so every rank gets the complete hidden gradient. The all-reduce carries one more number, a failure
flag: a rank whose backward failed still joins it (with zeros), so that every rank raises instead of
the others hanging.
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


class BackwardFailedError(RuntimeError):
    """The backward of a process_group= call failed on some rank(s); raised on every rank."""


class _Call:
    """Everything of one call except the tensors with gradients, and what backward needs."""

    def __init__(self, labels: Any, options: Dict[str, Any], group: Group, vocab_start: Any,
                 backend: Optional[str], needs: tuple) -> None:
        self.labels, self.options, self.group = labels, options, group
        self.vocab_start, self.backend = vocab_start, backend
        self.needs = needs  # gradients of (hidden, weight, bias), known before autograd's forward disables them
        self.forced: Optional[str] = None
        self.start = 0
        self.temperature = 1.0
        self.return_entropy = False

    def forward(self, hidden: Any, weight: Any, bias: Any):
        """``(outputs, lse, entropy)``; outputs as the public function returns them."""
        local = header.Local("logprobs_from_hidden", tile=TILE)
        labels = acc = stats = None
        ignore_index = None
        try:
            config.check()
            check_context()
            check_supported("logprobs_from_hidden", dict(self.options, bias=bias))
            hidden, weight, bias = v.check_hidden(hidden, weight, bias)
            lead = tuple(hidden.shape[:-1])
            local.dtype, local.shape, local.rows = hidden.dtype, lead, math.prod(lead)
            local.width, local.hidden = weight.shape[0], weight.shape[1]
            check_not_candidates(self.labels, hidden)
            labels = local.labels = v.check_labels(self.labels, hidden, "hidden")
            self.temperature = local.temperature = v.check_temperature(self.options.get("temperature", 1.0))
            ignore_index = v.check_ignore_index(self.options.get("ignore_index"))
            self.return_entropy = v.check_flag(self.options.get("return_entropy", False), "return_entropy")
            start = v.check_vocab_start(self.vocab_start)
            self.start = local.start = start if start is not None else self.group.rank * local.width
            local.flags = _flags(self.return_entropy, start, ignore_index, bias is not None, self.needs)
            local.ignore_index = ignore_index if ignore_index is not None else 0
            acc = result_dtype(hidden.dtype)
            registry = get_registry()
            self.forced = registry.forced(self.backend)[0]
            if any(self.needs):  # the backward's backend must exist before any collective
                registry.select(Key("hidden_shard_grad", hidden.device.type, hidden.dtype, False), self.forced)
            if local.rows:
                options = dict(bias=bias, vocab_start=self.start, tile=TILE, temperature=self.temperature,
                               ignore_index=ignore_index, with_entropy=self.return_entropy)
                stats = core.local_stats("hidden_shard_stats", self.backend,
                                         Key("hidden_shard_stats", hidden.device.type, hidden.dtype, any(self.needs)),
                                         (hidden, weight, labels), options, local.rows, local.width, TILE, acc,
                                         self.return_entropy, True)
        except Exception as exc:  # carried to every rank by the header
            local.error = exc
        device = self.group.device_for(hidden)
        layout = core.exchange(self.group, local, device)
        v.check_label_range(labels, layout.vocab, ignore_index)
        lead = local.shape
        if not layout.rows:
            empty = torch.zeros(lead, dtype=acc, device=hidden.device)
            outs = (empty.clone(), empty.clone()) if self.return_entropy else (empty.clone(),)
            return outs, empty, empty
        gathered, width = core.gather(self.group, layout, stats, device, acc)
        merged = core.combine(gathered, width, layout, labels, ignore_index, self.return_entropy)
        outs = [merged.logprobs.view(lead).to(hidden.device)]
        if self.return_entropy:
            outs.append(merged.entropy.view(lead).to(hidden.device))
        entropy = None if merged.entropy is None else merged.entropy.to(hidden.device)
        return tuple(outs), merged.lse.to(hidden.device), entropy

    def backward(self, hidden, weight, bias, labels, lse, entropy, g_lp, g_ent, needs):
        """``(grad_hidden, grad_weight, grad_bias)``: the shard's own, the hidden one summed over the group."""
        lead = hidden.shape[:-1]
        acc = lse.dtype
        g_lp, g_ent = core.per_row_grads(g_lp, g_ent, lead, acc, labels, self.options.get("ignore_index"))
        failure: Optional[BaseException] = None
        gh = gw = gb = None
        if lse.numel() and (g_lp is not None or g_ent is not None):
            try:
                key = Key("hidden_shard_grad", hidden.device.type, hidden.dtype, False)
                options = dict(bias=bias, vocab_start=self.start, tile=TILE, temperature=self.temperature,
                               needs_grad=needs)
                inputs = (hidden, weight, labels, lse.view(lead), None if entropy is None else entropy.view(lead),
                          g_lp, g_ent)
                gh, gw, gb = get_registry().call(key, self.forced, inputs, options)
            except Exception as exc:
                failure = exc
        if self.needs[0]:  # agreed by every rank in the header: every rank joins this all-reduce
            gh = self._sum_over_group(hidden, gh, acc, failure)
        elif failure is not None:
            raise failure
        return gh, gw, gb

    def _sum_over_group(self, hidden, partial, acc, failure) -> torch.Tensor:
        device = self.group.device_for(hidden)
        size = hidden.numel()
        buffer = torch.zeros(size + 1, dtype=acc, device=device)
        if failure is not None:
            buffer[size] = 1.0  # zeros and the flag: the others must not wait for a rank that failed
        elif partial is not None:
            buffer[:size] = partial.reshape(-1).to(device=device, dtype=acc)
        self.group.all_reduce_sum_(buffer)
        failed = int(buffer[size].item())
        if failed:
            raise BackwardFailedError(
                f"the backward of logprobs_from_hidden(..., process_group=...) failed on {failed} rank(s) of the "
                "group (each failing rank's own error is chained as its cause); no rank has a hidden gradient"
            ) from failure
        return buffer[:size].view(hidden.shape).to(device=hidden.device, dtype=hidden.dtype)


def _flags(return_entropy: bool, start, ignore_index, has_bias: bool, needs: tuple) -> int:
    flags = header.WANT_LOGPROBS | header.HAS_LABELS
    if return_entropy:
        flags |= header.WANT_ENTROPY
    if start is not None:
        flags |= header.START_GIVEN
    if ignore_index is not None:
        flags |= header.HAS_IGNORE
    if has_bias:
        flags |= header.HAS_BIAS
    if any(needs):
        flags |= header.GRAD
    if needs[0]:
        flags |= header.GRAD_HIDDEN
    return flags


class _ShardedHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _Call):
        outs, lse, entropy = call.forward(hidden, weight, bias)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, call.labels, lse, entropy)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @backward_without_autocast
    @first_order_only("process_group= (logprobs_from_hidden)",
                      "For second-order gradients, gather the weight shards and call without process_group.")
    @once_differentiable
    def backward(ctx, g_lp, g_ent=None):
        call: _Call = ctx.call
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        if g_lp is None and g_ent is None and not call.needs[0]:
            return None, None, None, None
        gh, gw, gb = call.backward(hidden, weight, bias, labels, lse, entropy if g_ent is not None else None,
                                   g_lp, g_ent, needs)
        return gh, gw, gb, None


def run(hidden: Any, weight: Any, labels: Any, options: Dict[str, Any], process_group: Any, vocab_start: Any,
        backend: Optional[str]):
    """The public ``logprobs_from_hidden`` over a weight shard; returns what it returns, on every rank."""
    bias = options.get("bias")
    opts = {k: val for k, val in options.items() if k != "bias"}
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight, bias))
    call = _Call(labels, opts, resolve(process_group), vocab_start, backend, needs)
    if any(needs) and not v.inside_functorch_transform():  # inside one, forward raises on every rank
        return _ShardedHidden.apply(hidden, weight, bias, call)
    outs = call.forward(hidden, weight, bias)[0]
    return outs if len(outs) > 1 else outs[0]
