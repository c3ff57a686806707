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

from ..call import Call, key_for
from ..kit import backward_without_autocast, first_order_only, result_dtype
from ..registry import get_registry
from ..validation import check_label_range
from . import core, header, processing, sampled, support
from .core import BackwardFailedError  # noqa: F401 - raised by the hidden backward (core.sum_over_group)
from .group import Group, resolve
from .merge import max_and_total as merge_max_and_total
from .tiles import TILE

_HIDDEN = "logprobs_from_hidden"
#: The first length of each shard's top list for top_p without a top_k for every row (doubled while a
#: row's mass is not reached).
TOP_P_LIST = 256


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
        self.topk = op == "topk_logprobs"  # its values' gradient is that of candidate labels: its ids
        self.want_entropy = op in ("entropy", "logprobs_and_entropy") or bool(options.get("return_entropy"))
        self.labels = self.call.input("labels") if self.call is not None else None
        self.needs = self.call.needs_grad if self.call is not None else (False,)
        self.forced: Optional[str] = None  # the explicit backend in force at forward, for backward
        self.start = 0
        # the sampler's keywords (sampled.py): the shard ops' shard_sampler options
        self.sampled = self.call is not None and sampled.sampler_used(self.call)
        self.top_k = options.get("top_k") if self.sampled else None
        self.min_p = options.get("min_p") if self.sampled else None
        self.top_p = options.get("top_p") if self.sampled else None
        self.order = options.get("sampler") or "vllm"   # the engine whose truncation is replayed
        self.truncating = self.sampled and (self.top_k is not None or self.min_p is not None
                                            or self.top_p is not None or options.get("keep") is not None)
        self.keep = self.boundary = self.dropped = None

    @property
    def outputs(self) -> int:
        return self.want_logprobs + self.want_entropy

    # ---------------------------------------------------------------- forward
    def forward(self):
        """``(outputs, lse, entropy)``; outputs as the public function returns them."""
        call = self.call
        local = header.Local(self.op, tile=TILE, error=self.error)
        stats = acc = lists = plain = None
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
                if self.sampled:
                    local.sampler = sampled.header_values(call)
                    self.keep = sampled.local_keep(call.options.get("keep"), local.shape, self.start, call.vocab)
                if call.grad:  # the backward's backend must exist before any collective: fail now, on every rank
                    registry.select(self._key(self.grad_op), self.forced)
                if local.rows and self._needs_plain():  # min_p's / sglang's first round: the plain statistics
                    plain = self._stats(acc, plain=True)
                if local.rows and self._list_length():  # top_k's / top_p's first round: this shard's top-L
                    lists = self._lists(self._list_length())
                if local.rows and self.top_k is None and self.min_p is None and self.top_p is None:
                    stats = self._stats(acc)
            except Exception as exc:  # carried to every rank by the header
                local.error = exc
        device = self.group.device_for(on)
        layout = core.exchange(self.group, local, device)
        ignore_index = call.options.get("ignore_index")
        if self.labels is not None:  # the same labels everywhere: the same verdict
            check_label_range(self.labels, layout.vocab, ignore_index)
        if self.sampled:  # the same ids everywhere (their checksum was compared): the same verdict
            sampled.check_keep_ids(call.options.get("keep"), layout.vocab)
        lead = local.shape
        if not layout.rows:
            empty = torch.zeros(lead, dtype=acc, device=on.device)
            return tuple(empty.clone() for _ in range(self.outputs)), empty, empty
        failure = None
        if self.top_k is not None or self.min_p is not None or self.top_p is not None:
            self.boundary = self._decide(layout, lists, plain, device, acc)
            try:
                stats = self._stats(acc)
            except Exception as exc:  # carried by the statistics gather's failure column
                failure = exc
        gathered, width = core.gather(self.group, layout, stats, device, acc, failure,
                                      self._label_count(), self.want_entropy)
        merged = core.combine(gathered, width, layout, self.labels, ignore_index, self.want_entropy)
        if self.truncating:
            merged = _nothing_kept(merged)
        outs = []
        if self.topk:
            return self._topk_outputs(layout, merged.lse, device, acc, on), merged.lse.to(on.device), None
        if self.want_logprobs:
            if self.truncating:  # a label outside the kept set: -inf, a constant (no gradient)
                self.dropped = torch.isneginf(merged.logprobs).view(self.labels.shape)
            outs.append(merged.logprobs.view(self.labels.shape).to(on.device))
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

    def _topk_outputs(self, layout, lse, device, acc, on):
        """topk_logprobs' ``(values, ids)``: every shard's ``k`` largest processed logits over the kept
        tokens (``shard_topk``), merged in vocabulary order (ties by smaller id), minus the merged
        log-sum-exp; ``-inf`` where fewer than ``k`` are kept. The ids become the candidate labels of
        the backward (the gradient of a value is that of its token's log-probability)."""
        k = self.call.options["k"]
        if k > layout.vocab:  # the same k and vocabulary everywhere: the same verdict
            raise ValueError(f"k must be between 1 and the vocabulary size {layout.vocab}, got {k}")
        failure = mine = None
        try:
            mine = self._lists(k, decision=False)
        except Exception as exc:
            failure = exc
        vals, gids = sampled.gather_lists(self.group, mine, layout.order, layout.rows, device, k, failure)
        top, ids = processing.merge_lists(vals, gids, k)
        values = torch.where(torch.isneginf(top), top, top.to(acc) - lse.unsqueeze(1).to(acc))
        values = torch.where(torch.isneginf(lse).unsqueeze(1), torch.full_like(values, float("-inf")), values)
        ids = torch.where(ids == processing.PAD_ID, torch.zeros_like(ids), ids)  # never: k <= V
        shape = tuple(self.call.inputs[0].shape[:-1]) + (k,)
        self.labels = ids.view(shape).to(on.device)
        self.dropped = torch.isneginf(values).view(shape)
        return values.view(shape).to(on.device), self.labels

    def _label_count(self) -> int:
        """Label logits per row: 0 without labels, K for candidate labels (..., K), else 1."""
        if self.labels is None or not self.want_logprobs:
            return 0
        return int(self.labels.shape[-1]) if self.call.candidates else 1

    def _key(self, op: str, requires_grad: bool = False):
        """The key of shard op ``op``: with the feature ``shard_sampler`` when the call uses the
        sampler's keywords or candidate labels."""
        on = self.call.inputs[0]
        features = ("shard_sampler",) if self.sampled else ()
        return key_for(op, device=on.device, dtype=on.dtype, requires_grad=requires_grad, features=features)

    def _stats(self, acc, plain: bool = False, boundary=None):
        """This shard's tile statistics over the kept tokens; ``plain``: over every token (or those
        within ``boundary``), without ``keep`` and the entropy (the decision's rounds: the whole row's
        softmax, or the survivors' normaliser)."""
        call = self.call
        options = self._stats_options()
        if plain:
            options.update(keep=None, boundary=boundary, with_entropy=False)
        return core.local_stats(self.stats_op, call.backend, self._key(self.stats_op, call.grad),
                                self._stats_inputs(), options, int(self.call.inputs[0].numel()
                                                                   // self.call.inputs[0].shape[-1]),
                                call.vocab, TILE, acc, self.want_entropy and not plain, self._label_count())

    def _needs_plain(self) -> bool:
        """Whether the decision needs the whole row's softmax (max and normaliser) first: vLLM's min_p,
        and SGLang's min_p and top_p (every filter on the full distribution); transformers' min_p
        reads the survivors' softmax instead, a round of its own."""
        if self.order == "hf":
            return False
        return self.min_p is not None or (self.order == "sglang" and self.top_p is not None)

    def _list_length(self) -> int:
        """The first top-L lists' length: top_k's largest value, or with top_p at least
        :data:`TOP_P_LIST` (doubled while a row's mass is not reached); 0 without either."""
        length = sampled.top_k_of(self.top_k) if self.top_k is not None else 0
        if self.top_p is not None and (self.top_k is None or isinstance(self.top_k, torch.Tensor)):
            length = max(length, TOP_P_LIST)  # (a number top_k: its k largest hold every survivor)
        return length

    def _max_and_total(self, layout, stats, device, acc, failure=None):
        """The row's max and ``sum exp(z - max)`` (float32) from every shard's tile statistics."""
        gathered, width = core.gather(self.group, layout, stats, device, acc, failure, self._label_count(), False)
        nts = layout.tiles
        m = torch.cat([gathered[r, :, :nts[r]] for r in layout.order], 1)
        s = torch.cat([gathered[r, :, width:width + nts[r]] for r in layout.order], 1)
        return tuple(x.to(torch.float32) for x in merge_max_and_total(m, s))

    def _decide(self, layout, lists, plain, device, acc):
        """The truncation decision, the same bits on every rank (vLLM's order: min_p, top_k, top_p):
        with min_p the whole row's softmax max, normaliser and threshold from the gathered plain
        statistics; top_k's boundary ``(t, j)`` from every shard's list (or ``(-inf, 0)``: none);
        top_p's from the merged lists and the survivors' normaliser (one more round of statistics),
        lists doubled until every row's mass is reached."""
        rows = layout.rows
        vals = gids = None
        length = min(self._list_length(), layout.vocab)
        if length:
            vals, gids = sampled.gather_lists(self.group, lists, layout.order, rows, device, length)
        if self.order == "sglang":
            return self._decide_sglang(layout, vals, gids, plain, length, device, acc)
        if self.top_k is not None:
            t, j = sampled.top_k_boundary(vals, gids, self.top_k, min(sampled.top_k_of(self.top_k), layout.vocab))
        else:
            t = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
            j = torch.zeros(rows, dtype=torch.int64, device=device)
        extra = ()
        if self.order == "hf":  # top_k, top_p over its survivors, then min_p over what is left
            if self.top_p is not None:
                t, j = self._decide_top_p(layout, vals, gids, (t, j), length, device, acc)
            if self.min_p is None:
                return t, j
            return (t, j) + self._min_p_over(layout, (t, j), device, acc)
        if self.min_p is not None:
            big, total = self._max_and_total(layout, plain, device, acc)
            extra = (big, total, processing.min_p_threshold(total, self.min_p))
        if self.top_p is None:
            return (t, j) + extra
        return self._decide_top_p(layout, vals, gids, (t, j) + extra, length, device, acc)

    def _min_p_over(self, layout, before, device, acc) -> tuple:
        """transformers' min_p after top_k and top_p: ``(big, total, threshold)`` of the softmax over
        the survivors of ``before`` (one more round of statistics within that boundary), so that the
        shard ops drop ``exp(y - big) / total < threshold`` (the survivors' largest probability times
        min_p)."""
        big, total = self._survivors_total(layout, before, device, acc)
        return big, total, processing.min_p_threshold(total, self.min_p)

    def _survivors_total(self, layout, before, device, acc):
        """The max and ``sum exp(z - max)`` of the survivors of ``before`` (one more round of
        statistics within that boundary); this rank's failure goes through the gather, so that every
        rank raises it."""
        failure = survivors = None
        try:
            survivors = self._stats(acc, plain=True, boundary=before)
        except Exception as exc:
            failure = exc
        return self._max_and_total(layout, survivors, device, acc, failure)

    def _decide_sglang(self, layout, vals, gids, plain, length, device, acc):
        """SGLang's truncation (:func:`.sampled.sglang_boundary`): every filter on the whole row's
        softmax (``plain``: the first round's statistics), top_k and top_p as the last kept entry of
        the global order, lists doubled until each row's first dropped position is listed; min_p
        elementwise. The boundary's sixth element marks SGLang's tie rule (ids ``<= j``)."""
        rows = layout.rows
        big = total = None
        if self._needs_plain():
            big, total = self._max_and_total(layout, plain, device, acc)
        if self.top_k is None and self.top_p is None:
            t = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
            j = torch.full((rows,), processing.PAD_ID, dtype=torch.int64, device=device)
        else:
            t, j, _ = self._until_decided(
                lambda v, i, n: sampled.sglang_boundary(v, i, n, layout.vocab, self.top_k, self.top_p, big, total),
                layout, vals, gids, length, device)
        if self.min_p is not None:
            threshold = processing.min_p_threshold(total, self.min_p)
        else:  # no min_p: a threshold of 0 drops nothing
            big = torch.zeros(rows, dtype=torch.float32, device=device)
            total = torch.ones(rows, dtype=torch.float32, device=device)
            threshold = torch.zeros(rows, dtype=torch.float32, device=device)
        lower = torch.ones(rows, dtype=torch.bool, device=device)
        return t, j, big, total, threshold, lower

    def _decide_top_p(self, layout, vals, gids, before, length, device, acc):
        """top_p over the survivors of ``before`` (min_p and top_k's boundary), see
        :func:`.sampled.top_p_boundary`."""
        self.boundary = before
        t_k, j_k = before[0], before[1]

        def survives(v, i):
            ok = (v > t_k.unsqueeze(1)) | ((v == t_k.unsqueeze(1)) & (i >= j_k.unsqueeze(1)))
            if len(before) == 5:
                ok &= processing.min_p_kept(v, *before[2:])
            return ok

        big = total = None
        if self.top_k is None or isinstance(self.top_k, torch.Tensor) \
                or not sampled.every_survivor_listed(vals, length, survives):
            # the survivors' normaliser from one more round of statistics (with a number top_k every
            # survivor is usually listed, and the list gives it; the same verdict on every rank)
            big, total = self._survivors_total(layout, before, device, acc)

        t, j, dropped, _ = self._until_decided(
            lambda v, i, n: sampled.top_p_boundary(v, i, n, self.top_p, big, total, survives, hf=self.order == "hf"),
            layout, vals, gids, length, device)
        t = torch.where(dropped, t, t_k)
        j = torch.where(dropped, j, j_k)
        return (t, j) + tuple(before[2:])

    def _until_decided(self, decide, layout, vals, gids, length: int, device):
        """``decide(values, ids, length)`` on the merged lists (its last output: the rows it could
        decide), the lists doubling until every row is decided or they hold the whole vocabulary.
        Every rank reads the same lists, so every rank runs the same number of rounds."""
        while True:
            out = decide(vals, gids, length)
            if bool(out[-1].all()) or length >= layout.vocab:
                return out
            length = min(2 * length, layout.vocab)
            failure = mine = None
            try:
                mine = self._lists(length)
            except Exception as exc:  # carried to every rank by the gather
                failure = exc
            vals, gids = sampled.gather_lists(self.group, mine, layout.order, layout.rows, device, length, failure)

    def _lists(self, length: int, decision: bool = True):
        """This shard's top-``length`` (values, global ids) of the float32 processed logits (at most its
        width; ``decision=False``: of the processed logits over the kept tokens), through the registry
        (``shard_topk`` / ``hidden_shard_topk``)."""
        op = "hidden_shard_topk" if self.hidden else "shard_topk"
        options = dict(self._sampler_options(), vocab_start=self.start, temperature=self.call.options["temperature"],
                       k=min(length, self.call.vocab), decision=decision)
        if decision:
            options.pop("boundary")
        if self.hidden:
            options["bias"] = self.call.options["bias"]
        inputs = self.call.inputs[:2] if self.hidden else self.call.inputs[:1]
        out = get_registry().call(self._key(op), self.call.backend, inputs, options)
        k = options["k"]
        if not isinstance(out, (tuple, list)) or len(out) != 2 or tuple(out[0].shape[-1:]) != (k,):
            name = get_registry().select(self._key(op), self.call.backend).name
            raise RuntimeError(f"backend {name!r}: {op} returned {type(out).__name__}, not (values, ids) of k={k} "
                               "per row as the op table specifies")
        return out

    def _sampler_options(self) -> dict:
        """The shard ops' shard_sampler options of this call."""
        if not self.sampled:
            return {}
        options = self.call.options if self.call is not None else self.options
        out = dict(softcap=options.get("softcap"), keep=self.keep, boundary=self.boundary)
        if self.hidden:
            out["logits_dtype"] = options.get("logits_dtype")
        return out

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
        out.update(self._sampler_options())
        return out

    # --------------------------------------------------------------- backward
    def release(self) -> None:
        """After forward, under autograd: keep what backward needs (the options, the gradient op's
        key) and drop the call's inputs, which the Function saves through ``ctx`` (so saved-tensor
        hooks, offloading and checkpointing see them, and nothing keeps the shard alive)."""
        self.options = self.call.options
        self.grad_key = self._key(self.grad_op)
        self.label_shape = None if self.labels is None else self.labels.shape
        self.call = self.labels = None

    def backward(self, tensors: Tuple[Any, ...], labels, lse, entropy, g_lp, g_ent, needs: tuple) -> tuple:
        """The gradients of ``tensors`` (the shard's logits; or hidden, weight, bias)."""
        on = tensors[0]
        lead = on.shape[:-1]
        options, key = self.options, self.grad_key
        if self.sampled and g_lp is not None:  # per label (candidates (..., K)); 0 where the label is dropped
            if self.dropped is not None:
                g_lp = torch.where(self.dropped.to(g_lp.device), torch.zeros((), dtype=g_lp.dtype,
                                                                             device=g_lp.device), g_lp)
            g_lp, g_ent = core.per_row_grads(g_lp, g_ent, lead, lse.dtype, labels, options.get("ignore_index"),
                                             self.label_shape)
        else:
            g_lp, g_ent = core.per_row_grads(g_lp, g_ent, lead, lse.dtype, labels, options.get("ignore_index"))
        extra = self._sampler_options()
        entropy = None if entropy is None or g_ent is None else entropy.view(lead)
        if not self.hidden:
            logits = on
            if not lse.numel():
                return (torch.zeros_like(logits),)
            grad = get_registry().call(key, self.forced, (logits, labels, lse.view(lead), entropy, g_lp, g_ent),
                                       dict(vocab_start=self.start, temperature=options["temperature"],
                                            inplace_backward=options.get("inplace_backward", False), **extra))
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
                         needs_grad=needs, **extra))
            except Exception as exc:
                failure = exc
        if self.needs[0]:  # agreed by every rank in the header: every rank joins this all-reduce
            gh = core.sum_over_group(self.group, hidden, gh, lse.dtype, failure,
                                     "logprobs_from_hidden(..., process_group=...)")
        elif failure is not None:
            raise failure
        return gh, gw, gb



def _nothing_kept(merged: core.Merged) -> core.Merged:
    """Rows whose kept set is empty (lse = -inf): as the reference has them, every label -inf (a
    constant: no gradient) and the entropy 0, instead of the textbook formula's NaN."""
    empty = torch.isneginf(merged.lse)
    if not bool(empty.any()):
        return merged
    logprobs, entropy = merged.logprobs, merged.entropy
    if logprobs is not None:
        flat = logprobs.reshape(empty.shape[0], -1).masked_fill(empty.unsqueeze(1), float("-inf"))
        logprobs = flat.reshape(logprobs.shape)
    if entropy is not None:
        entropy = entropy.masked_fill(empty, 0.0)
    return core.Merged(merged.lse, entropy, logprobs)


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
        if run.topk:
            ctx.mark_non_differentiable(outs[1])
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
