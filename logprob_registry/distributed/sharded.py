"""The public ops with ``process_group=``: one skeleton for the logits ops and ``logprobs_from_hidden``.

Each rank holds a vocabulary shard: of the logits ``(..., V_local)`` (``logprobs``, ``entropy``,
``logprobs_and_entropy``), or of the lm_head weight ``(V_local, H)`` and bias ``(V_local,)``
(``logprobs_from_hidden``, whose shard ops never form the ``(N, V_local)`` logits at once).

Forward: the call arrives validated (:class:`~logprob_registry.call.Call`), or as the validation
error to raise; what the path does not support raises here (:mod:`.support`). Either way nothing
is raised yet: the shard's tile statistics come from the registry (``shard_stats`` or
``hidden_shard_stats``), the headers are exchanged (every rank raises the same error, or none),
the statistics gathered and merged (:mod:`.core`). Every rank returns the complete result.

Backward of the logits ops needs no communication: the shard's gradient comes from the merged
log-sum-exp and entropy through the registry (``shard_grad``), out of place or over the shard's
storage (``inplace_backward``). Backward of ``logprobs_from_hidden``: ``hidden_shard_grad`` gives
the weight shard's and bias shard's gradients and this shard's share of the hidden gradient, which
one all-reduce (sum) completes, so every rank gets the complete hidden gradient. That all-reduce
carries one more number, a failure flag: a rank whose backward failed still joins it (with zeros),
so that every rank raises instead of the others hanging.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from ..call import Call
from ..kit import backward_without_autocast, first_order_only, result_dtype
from ..registry import get_registry
from ..validation import check_label_range
from . import core, header, support
from .core import BackwardFailedError  # noqa: F401 - raised by the hidden backward (core.sum_over_group)
from .group import Group, resolve
from .tiles import TILE

_HIDDEN = "logprobs_from_hidden"


class _Sharded:
    """One process_group= call on this rank: the validated call (or the error every rank raises),
    its group, and what forward keeps for backward (attributes: autograd saves tensors only
    through ``ctx``)."""

    def __init__(self, op: str, call: Union[Call, BaseException], group: Group) -> None:
        self.op, self.group = op, group
        self.call = call if isinstance(call, Call) else None
        self.error = call if isinstance(call, BaseException) else None
        self.hidden = op == _HIDDEN
        self.stats_op = "hidden_shard_stats" if self.hidden else "shard_stats"
        self.grad_op = "hidden_shard_grad" if self.hidden else "shard_grad"
        options = self.call.options if self.call is not None else {}
        self.want_logprobs = op != "entropy"
        self.want_entropy = op in ("entropy", "logprobs_and_entropy") or bool(options.get("return_entropy"))
        self.labels = self.call.input("labels") if self.call is not None else None
        self.needs = self.call.needs_grad if self.call is not None else (False,)
        self.forced: Optional[str] = None  # the explicit backend in force at forward, for backward
        self.start = 0

    @property
    def outputs(self) -> int:
        return self.want_logprobs + self.want_entropy

    # ---------------------------------------------------------------- forward
    def forward(self):
        """``(outputs, lse, entropy)``; outputs as the public function returns them."""
        call = self.call
        local = header.Local(self.op, tile=TILE, error=self.error)
        stats = acc = None
        on = call.inputs[0] if call is not None else None
        if call is not None:
            try:
                support.check(call)
                start = call.vocab_start
                self.start = core.describe(local, on, call.vocab, call.options["temperature"], self.group, start,
                                           self.labels, self.hidden)
                ignore_index = call.options.get("ignore_index")
                local.flags = self._flags(start is not None, ignore_index is not None)
                local.ignore_index = ignore_index if ignore_index is not None else 0
                acc = result_dtype(on.dtype)
                registry = get_registry()
                self.forced = registry.forced(call.backend)[0]
                if call.grad:  # the backward's backend must exist before any collective: fail now, on every rank
                    registry.select(call.shard_key(self.grad_op), self.forced)
                if local.rows:
                    stats = core.local_stats(self.stats_op, call.backend, call.shard_key(self.stats_op, call.grad),
                                             self._stats_inputs(), self._stats_options(), local.rows, call.vocab,
                                             TILE, acc, self.want_entropy, self.want_logprobs)
            except Exception as exc:  # carried to every rank by the header
                local.error = exc
        layout = core.exchange(self.group, local, self.group.device_for(on))
        ignore_index = call.options.get("ignore_index")
        if self.labels is not None:  # the same labels everywhere: the same verdict
            check_label_range(self.labels, layout.vocab, ignore_index)
        lead = local.shape
        if not layout.rows:
            empty = torch.zeros(lead, dtype=acc, device=on.device)
            return tuple(empty.clone() for _ in range(self.outputs)), empty, empty
        gathered, width = core.gather(self.group, layout, stats, self.group.device_for(on), acc)
        merged = core.combine(gathered, width, layout, self.labels, ignore_index, self.want_entropy)
        outs = []
        if self.want_logprobs:
            outs.append(merged.logprobs.view(lead).to(on.device))
        if self.want_entropy:
            outs.append(merged.entropy.view(lead).to(on.device))
        entropy = None if merged.entropy is None else merged.entropy.to(on.device)
        return tuple(outs), merged.lse.to(on.device), entropy

    def _flags(self, start_given: bool, has_ignore: bool) -> int:
        flags = 0
        if self.want_logprobs:
            flags |= header.WANT_LOGPROBS
        if self.want_entropy:
            flags |= header.WANT_ENTROPY
        if self.labels is not None:
            flags |= header.HAS_LABELS
        if start_given:
            flags |= header.START_GIVEN
        if has_ignore:
            flags |= header.HAS_IGNORE
        if self.hidden:  # the hidden gradient's all-reduce: every rank must agree to join it
            if self.call.options["bias"] is not None:
                flags |= header.HAS_BIAS
            if any(self.needs):
                flags |= header.GRAD
            if self.needs[0]:
                flags |= header.GRAD_HIDDEN
        return flags

    def _stats_inputs(self) -> tuple:
        if self.hidden:
            return self.call.inputs  # hidden, weight, labels
        return self.call.inputs[0], self.labels

    def _stats_options(self) -> dict:
        options = self.call.options
        out = dict(vocab_start=self.start, tile=TILE, temperature=options["temperature"],
                   ignore_index=options.get("ignore_index"), with_entropy=self.want_entropy)
        if self.hidden:
            out["bias"] = options["bias"]
        return out

    # --------------------------------------------------------------- backward
    def release(self) -> None:
        """After forward, under autograd: keep what backward needs (the options, the gradient op's
        key) and drop the call's inputs, which the Function saves through ``ctx`` (so saved-tensor
        hooks, offloading and checkpointing see them, and nothing keeps the shard alive)."""
        self.options = self.call.options
        self.grad_key = self.call.shard_key(self.grad_op)
        self.call = self.labels = None

    def backward(self, tensors: Tuple[Any, ...], labels, lse, entropy, g_lp, g_ent, needs: tuple) -> tuple:
        """The gradients of ``tensors`` (the shard's logits; or hidden, weight, bias)."""
        on = tensors[0]
        lead = on.shape[:-1]
        options, key = self.options, self.grad_key
        g_lp, g_ent = core.per_row_grads(g_lp, g_ent, lead, lse.dtype, labels, options.get("ignore_index"))
        entropy = None if entropy is None or g_ent is None else entropy.view(lead)
        if not self.hidden:
            logits = on
            if not lse.numel():
                return (torch.zeros_like(logits),)
            grad = get_registry().call(key, self.forced, (logits, labels, lse.view(lead), entropy, g_lp, g_ent),
                                       dict(vocab_start=self.start, temperature=options["temperature"],
                                            inplace_backward=options.get("inplace_backward", False)))
            if not isinstance(grad, torch.Tensor) or grad.shape != logits.shape or grad.dtype != logits.dtype:
                name = get_registry().select(key, self.forced).name
                got = f"{tuple(grad.shape)} {grad.dtype}" if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise RuntimeError(f"backend {name!r}: shard_grad returned {got}, expected the shard's shape "
                                   f"{tuple(logits.shape)} and dtype {logits.dtype}")
            return (grad,)
        hidden, weight, bias = tensors
        failure: Optional[BaseException] = None
        gh = gw = gb = None
        if lse.numel() and (g_lp is not None or g_ent is not None):
            try:
                gh, gw, gb = get_registry().call(
                    key, self.forced, (hidden, weight, labels, lse.view(lead), entropy, g_lp, g_ent),
                    dict(bias=bias, vocab_start=self.start, tile=TILE, temperature=options["temperature"],
                         needs_grad=needs))
            except Exception as exc:
                failure = exc
        if self.needs[0]:  # agreed by every rank in the header: every rank joins this all-reduce
            gh = core.sum_over_group(self.group, hidden, gh, lse.dtype, failure,
                                     "logprobs_from_hidden(..., process_group=...)")
        elif failure is not None:
            raise failure
        return gh, gw, gb



_REMEDY = {False: "For second-order gradients, gather the logits to one rank and call without process_group.",
           True: "For second-order gradients, gather the weight shards and call without process_group."}


def _double_backward_refused(hidden: bool):
    return first_order_only(f"process_group= ({'logprobs_from_hidden' if hidden else 'the logits ops'})",
                            _REMEDY[hidden])


def _backward(ctx, *grads):
    run: _Sharded = ctx.run
    *tensors, labels, lse, entropy = ctx.saved_tensors
    grads = list(grads)
    g_lp = grads.pop(0) if run.want_logprobs else None
    g_ent = grads.pop(0) if run.want_entropy and grads else None
    count = len(tensors)
    if g_lp is None and g_ent is None and not (run.hidden and run.needs[0]):
        return (None,) * (count + 1)
    needs = tuple(bool(n) for n in ctx.needs_input_grad[1:count + 1])
    return (None, *run.backward(tuple(tensors), labels, lse, entropy, g_lp, g_ent, needs))


class _ShardedFunction(torch.autograd.Function):
    """A sharded op with a backward: forward as :meth:`_Sharded.forward`, backward through the
    registry's shard-gradient op (and, for the hidden gradient, one all-reduce)."""

    @staticmethod
    def forward(ctx, run: _Sharded, *tensors):
        outs, lse, entropy = run.forward()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, run.labels, lse, entropy)
        run.release()
        ctx.run = run
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @backward_without_autocast
    @_double_backward_refused(False)
    @once_differentiable
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


class _ShardedHiddenFunction(_ShardedFunction):
    @staticmethod
    @backward_without_autocast
    @_double_backward_refused(True)
    @once_differentiable
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def run(op: str, call: Union[Call, BaseException], process_group: Any):
    """The public op ``op`` over this rank's vocabulary shard, given its validated ``call`` or the
    error validation raised (raised on every rank, after the header exchange); returns what the
    public function returns, on every rank."""
    if op == "kl_divergence":
        from . import kl

        return kl.run(call, resolve(process_group))
    run = _Sharded(op, call, resolve(process_group))
    if run.call is not None and run.call.grad and "functorch" not in run.call.features:
        # inside a torch.func transform the forward raises on every rank (support.check)
        if run.hidden:
            hidden, weight, _ = run.call.inputs
            return _ShardedHiddenFunction.apply(run, hidden, weight, run.call.options["bias"])
        return _ShardedFunction.apply(run, run.call.inputs[0])
    outs = run.forward()[0]
    return outs if len(outs) > 1 else outs[0]
