"""The public ops with ``process_group=``: each call's :class:`~.skeleton.Plan`, run by the one
skeleton (:mod:`.skeleton`), and the side of the logits ops, ``logprobs_from_hidden`` and
``topk_logprobs`` (:class:`Logits`), and token_stats' (:class:`Stats`, a Logits with more statistics;
kl_divergence's is :mod:`.kl`'s).

Each rank holds a vocabulary shard: of the logits ``(..., V_local)`` (``logprobs``, ``entropy``,
``logprobs_and_entropy``, ``topk_logprobs``), or of the lm_head weight ``(V_local, H)`` and bias
``(V_local,)`` (``logprobs_from_hidden``, whose shard ops never form the ``(N, V_local)`` logits at
once). Forward: the shard's tile statistics (``shard_stats`` / ``hidden_shard_stats``), over the
tokens the sampler keeps (the truncation decision's rounds: :class:`.sampled.Truncation`), merged
into the log-sum-exp, the entropy and the labels' logprobs; ``topk_logprobs`` merges every shard's
top-k list (``shard_topk``). Every rank returns the complete result.

Backward of the logits ops needs no communication: the shard's gradient comes from the merged
log-sum-exp and entropy through the registry (``shard_grad``), out of place or over the shard's
storage (``inplace_backward``). Backward of ``logprobs_from_hidden``: ``hidden_shard_grad`` gives
the weight shard's and bias shard's gradients and this shard's share of the hidden gradient, which
one all-reduce (sum, with a failure flag) completes, so every rank gets the complete hidden gradient.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .. import processing
from ..call import Call
from ..opspec import DIFFERENTIABLE_STATS, OPS, stats_gradients
from ..registry import Expected, Registry, get_registry
from ..validation import check_label_range
from . import core, header, kl, sampled
from .core import BackwardFailedError  # noqa: F401 - raised by the hidden backward (core.sum_over_group)
from .group import Group, resolve
from .merge import _tree_over_tiles, merge_squares
from .skeleton import Plan, Sharded, function
from .tiles import NEG_INF, TILE, grid

_HIDDEN = "logprobs_from_hidden"


class Logits(Sharded):
    """The side of the logits ops (``logprobs``, ``entropy``, ``logprobs_and_entropy``),
    ``logprobs_from_hidden`` and ``topk_logprobs``: tile statistics (``shard_stats`` /
    ``hidden_shard_stats``) merged into the log-sum-exp, the entropy and the labels' logprobs, over
    the tokens the sampler keeps (:mod:`.sampled`); backward through ``shard_grad`` (the logits'
    shard, no communication) or ``hidden_shard_grad`` (the hidden gradient summed over the group)."""

    def __init__(self, plan: Plan, op: str, call: Union[Call, BaseException], group: Group,
                 registry: Registry) -> None:
        super().__init__(plan, op, call, group, registry)
        options = self.options
        self.hidden = op == _HIDDEN
        self.want_logprobs = op != "entropy"
        self.topk = op == "topk_logprobs"  # its values' gradient is that of candidate labels: its ids
        self.want_entropy = op in ("entropy", "logprobs_and_entropy") or bool(options.get("return_entropy"))
        self.labels = self.call.input("labels") if self.call is not None else None
        # the sampler's keywords (sampled.py): the shard ops' shard_sampler options
        self.sampled = self.call is not None and sampled.sampler_used(self.call)
        self.features = ("shard_sampler",) if self.sampled else ()
        self.truncation = sampled.Truncation(options)
        self.truncating = self.sampled and (self.truncation.active or options.get("keep") is not None)
        self.keep = self.boundary = self.dropped = None
        self.first_lists = self.plain = None  # the decision's first round, before the header

    @property
    def outputs(self) -> int:
        return self.want_logprobs + self.want_entropy

    # ---------------------------------------------------------------- forward
    def differentiable(self) -> tuple:
        if self.hidden:
            hidden, weight, _ = self.call.inputs
            return hidden, weight, self.call.options["bias"]
        return (self.call.inputs[0],)

    def checked(self) -> Optional[torch.Tensor]:
        return self.labels

    def describe(self, local: header.Local) -> None:
        call = self.call
        ignore_index = call.options.get("ignore_index")
        local.flags = self._flags(call.vocab_start is not None, ignore_index is not None)
        local.ignore_index = ignore_index if ignore_index is not None else 0
        if self.sampled:
            local.sampler = sampled.header_values(call)
            self.keep = sampled.local_keep(call.options.get("keep"), local.shape, self.start, call.vocab)

    def local_stats(self, local: header.Local, acc: torch.dtype) -> Optional[core.Stats]:
        if not local.rows:
            return None
        truncation = self.truncation
        if truncation.needs_plain():  # min_p's / sglang's first round: the plain statistics
            self.plain = self.stats(acc, plain=True)
        if truncation.list_length():  # top_k's / top_p's first round: this shard's top-L
            self.first_lists = self.lists(truncation.list_length())
        return None if truncation.active else self.stats(acc)

    def check_layout(self, layout: header.Layout) -> None:
        if self.labels is not None:  # the same labels everywhere: the same verdict
            check_label_range(self.labels, layout.vocab, self.options.get("ignore_index"))
        if self.sampled:  # the same ids everywhere (their checksum was compared): the same verdict
            sampled.check_keep_ids(self.options.get("keep"), layout.vocab)

    def rounds(self, layout, stats, device, acc) -> tuple:
        if not self.truncation.active:
            return stats, None
        self.boundary = self.truncation.decide(self, layout, self.first_lists, self.plain, device, acc)
        try:
            return self.stats(acc), None
        except Exception as exc:  # carried by the statistics gather's failure column
            return None, exc

    def packed(self) -> Tuple[int, int]:
        return 3 if self.want_entropy else 2, max(1, self.label_count())

    def columns(self) -> int:
        """The per-row columns of a statistics gather (for :class:`.sampled.Truncation`'s rounds)."""
        return self.packed()[1]

    def results(self, layout, gathered, width, lead, device, acc, on) -> Tuple[tuple, tuple]:
        merged = core.combine(gathered, width, layout, self.labels, self.options.get("ignore_index"),
                              self.want_entropy)
        if self.truncating:
            merged = _nothing_kept(merged)
        if self.topk:
            outs = self._topk_outputs(layout, merged.lse, device, acc, on)
            return outs, (self.labels, merged.lse.to(on.device), None)
        outs = []
        if self.want_logprobs:
            if self.truncating:  # a label outside the kept set: -inf, a constant (no gradient)
                self.dropped = torch.isneginf(merged.logprobs).view(self.labels.shape)
            outs.append(merged.logprobs.view(self.labels.shape).to(on.device))
        if self.want_entropy:
            outs.append(merged.entropy.view(lead).to(on.device))
        entropy = None if merged.entropy is None else merged.entropy.to(on.device)
        return tuple(outs), (self.labels, merged.lse.to(on.device), entropy)

    def empty(self, lead, acc, on) -> Tuple[tuple, tuple]:
        empty = torch.zeros(lead, dtype=acc, device=on.device)
        return tuple(empty.clone() for _ in range(self.outputs)), (self.labels, empty, empty)

    def non_differentiable(self, outputs: tuple) -> tuple:
        return (outputs[1],) if self.topk else ()

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
            mine = self.lists(k, decision=False)
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

    def label_count(self) -> int:
        """Label logits per row: 0 without labels, K for candidate labels (..., K), else 1."""
        if self.labels is None or not self.want_logprobs:
            return 0
        return int(self.labels.shape[-1]) if self.call.candidates else 1

    def stats(self, acc, plain: bool = False, boundary=None) -> core.Stats:
        """This shard's tile statistics over the kept tokens; ``plain``: over every token (or those
        within ``boundary``), without ``keep`` and the entropy (the decision's rounds: the whole row's
        softmax, or the survivors' normaliser)."""
        options = self._stats_options()
        if plain:
            options.update(keep=None, boundary=boundary, with_entropy=False)
        present = (True, True, self.want_entropy and not plain)
        key = self.key(self.plain_op if plain else self.plan.stats_op, self.call.grad)
        out = self.tile_stats(key, self._stats_inputs(), options, present, self.label_count(), acc)

        def recompute(slot: int, references: tuple, rows: torch.Tensor) -> tuple:
            return self._slot_stats(key, options, present, slot, references[0], rows, acc)

        return out._replace(recompute=recompute)

    @property
    def plain_op(self) -> str:
        """The statistics op of the decision's plain rounds (:meth:`stats` with ``plain``)."""
        return self.plan.stats_op

    def _slot_stats(self, key, options: dict, present: tuple, slot: int, reference: torch.Tensor,
                    rows: torch.Tensor, acc) -> tuple:
        """One grid tile's statistics of the flat rows ``rows`` against ``reference`` (the whole
        tile's max there): the same shard op over the shard's columns in that tile, ``(m, s, t)``
        each (R, 1). Over those rows alone for logits without the sampler's keywords or per-row
        options (a row's statistics do not depend on the other rows: the shard ops' contract); else
        over every row, the others measured against their own max, and those rows taken."""
        piece = grid(self.start, self.call.vocab, TILE)[slot]
        c0, c1 = piece.c0, piece.c1
        inputs = list(self._stats_inputs())
        if not (self.hidden or self.sampled) and not any(isinstance(v, torch.Tensor) for v in options.values()):
            logits, labels = inputs[0][..., c0:c1].reshape(self.rows, c1 - c0), inputs[-1]
            inputs[0] = logits.index_select(0, rows.to(logits.device))
            if labels is not None:
                per = labels.reshape(self.rows, -1).index_select(0, rows.to(labels.device))
                inputs[-1] = per if self.call.candidates else per.reshape(-1)
            narrowed = dict(options, vocab_start=self.start + c0, reference=reference)
            return self.tile_stats(key, tuple(inputs), narrowed, present, self.label_count(), acc,
                                   start=self.start + c0, width=c1 - c0, rows=rows.numel()).tiles
        whole = torch.full((self.rows,), NEG_INF, dtype=reference.dtype, device=reference.device)
        reference = whole.index_copy_(0, rows, reference)
        narrowed = dict(options, vocab_start=self.start + c0, reference=reference.view(self.call.inputs[0].shape[:-1]))
        if self.hidden:
            inputs[1] = inputs[1][c0:c1]
            if options["bias"] is not None:
                narrowed["bias"] = options["bias"][c0:c1]
        else:
            inputs[0] = inputs[0][..., c0:c1]
        if options.get("keep") is not None:
            narrowed["keep"] = options["keep"][:, c0:c1]
        stats = self.tile_stats(key, tuple(inputs), narrowed, present, self.label_count(), acc,
                                start=self.start + c0, width=c1 - c0)
        return tuple(None if t is None else t[rows.to(t.device)] for t in stats.tiles)

    def lists(self, length: int, decision: bool = True):
        """This shard's top-``length`` (values, global ids) of the float32 processed logits (at most its
        width; ``decision=False``: of the processed logits over the kept tokens), through the registry
        (``shard_topk`` / ``hidden_shard_topk``)."""
        op = "hidden_shard_topk" if self.hidden else "shard_topk"
        options = dict(self._sampler_options(), vocab_start=self.start, temperature=self.options["temperature"],
                       k=min(length, self.call.vocab), decision=decision)
        if decision:
            options.pop("boundary")
        if self.hidden:
            options["bias"] = self.options["bias"]
        inputs = self._shard_inputs()
        k, rows = options["k"], self.rows
        per_row = Expected((rows, k), flat=True, words=f"{rows} rows x k={k} (the leading dims, then k)")
        return self.shard(self.key(op), inputs, options, (per_row, per_row), self.call.backend)

    def _sampler_options(self) -> dict:
        """The shard ops' shard_sampler options of this call."""
        if not self.sampled:
            return {}
        out = dict(softcap=self.options.get("softcap"), keep=self.keep, boundary=self.boundary)
        if self.hidden:
            out["logits_dtype"] = self.options.get("logits_dtype")
        return out

    def _shard_inputs(self) -> tuple:
        """The shard ops' tensors before the labels: (hidden, weight), or (logits,)."""
        return self.call.inputs[:2] if self.hidden else self.call.inputs[:1]

    def _stats_inputs(self) -> tuple:
        return self._shard_inputs() + (self.labels,)

    def _stats_options(self) -> dict:
        options = self.options
        out = dict(vocab_start=self.start, tile=TILE, temperature=options["temperature"],
                   ignore_index=options.get("ignore_index"), with_entropy=self.want_entropy)
        if self.hidden:
            out["bias"] = options["bias"]
        out.update(self._sampler_options())
        return out

    # --------------------------------------------------------------- backward
    def release(self) -> None:
        self.label_shape = None if self.labels is None else self.labels.shape
        self.labels = None
        super().release()

    def backward(self, tensors: tuple, saved: tuple, grads: tuple, needs: tuple) -> tuple:
        labels, lse, entropy = saved
        grads = list(grads)
        g_lp = grads.pop(0) if self.want_logprobs else None
        g_ent = grads.pop(0) if self.want_entropy and grads else None
        if g_lp is None and g_ent is None and not (self.hidden and self.needs[0]):
            return (None,) * len(tensors)
        on = tensors[0]
        lead = on.shape[:-1]
        options = self.options
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
            shape = tuple(logits.shape)
            expected = (Expected(shape, logits.dtype, words=f"the shard's shape {shape} and dtype {logits.dtype}"),)
            grad = self.shard(self.grad_key, (logits, labels, lse.view(lead), entropy, g_lp, g_ent),
                              dict(vocab_start=self.start, temperature=options["temperature"],
                                   inplace_backward=options.get("inplace_backward", False), **extra),
                              expected, self.forced)
            return (grad,)
        hidden, weight, bias = tensors
        inputs = None
        if lse.numel() and (g_lp is not None or g_ent is not None):
            inputs = (hidden, weight, labels, lse.view(lead), entropy, g_lp, g_ent)
        return self.reduced_gradient(inputs, dict(bias=bias, vocab_start=self.start, tile=TILE,
                                                  temperature=options["temperature"], needs_grad=needs, **extra),
                                     hidden, lse.dtype, "logprobs_from_hidden(..., process_group=...)")


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


# ------------------------------------------------------------------ token_stats
COUNT = 5  # tile_max, tile_sumexp, tile_elog, tile_sumsq, tile_zsum
ROWS = 2   # row_max, row_argmax: the per-row columns before the label logits


class Stats(Logits):
    """token_stats' side: :class:`Logits` with the entropy always computed, the token statistics'
    extra columns, the raw fields and their merge: every field of :class:`~logprob_registry.TokenStats`
    over vocabulary shards, for ``token_stats(..., process_group=...)`` (its plans: ``_STATS_PLANS``).

    The shard op ``shard_token_stats`` (``hidden_shard_token_stats``) is ``shard_stats`` with, in the
    same pass, two more exact sums per grid tile (``sum e**2``, ``sum z``) and, per row, the shard's max
    and the global id of its first maximum. They travel in the same gather (two more numbers per tile
    and per row; a tile two ranks share is completed as the others are, :func:`.core.complete`) and are
    merged in global tile order:

    * ``logprobs``, ``entropy``: as the logits ops' (:func:`.core.combine`);
    * ``log_sum_p2 = log sum q w**2 - 2 log sum s w`` (:func:`~.merge.merge_squares`);
    * ``mean_logit``: the tiles' exact ``sum z`` added by the fixed tree, over the vocabulary;
      ``max_logit``: the max of the tiles' maxima;
    * ``is_argmax``: the label is the first maximum of the first rank (in vocabulary order) whose max
      is the row's.

    With the sampler's truncation the processed fields come from the kept tokens (the truncation
    decision's rounds, :class:`.sampled.Truncation`), and the raw ones (``raw_*``, ``mean_logit``,
    ``max_logit``) from one more statistics call and gather without it; without truncation the raw
    fields are the processed ones. Backward: the logits ops' (``shard_grad``, ``hidden_shard_grad``) with
    the upstream gradients of a field and its raw twin added, or, with truncation, once with it and
    once without, summed. Every result is the same bits for every group size and split (:mod:`.tiles`).
    """

    def __init__(self, plan: Plan, op: str, call: Union[Call, BaseException], group: Group,
                 registry: Registry) -> None:
        super().__init__(plan, op, call, group, registry)
        options = self.options
        self.hidden = options.get("weight") is not None
        self.fields = OPS[op].output_names(options) if self.call is not None else ()
        self.want_logprobs = self.labels is not None
        self.want_entropy = True
        self.raw_local = None

    def differentiable(self) -> tuple:
        if self.hidden:
            return self.call.inputs[0], self.options["weight"], self.options["bias"]
        return (self.call.inputs[0],)

    def _shard_inputs(self) -> tuple:
        if self.hidden:
            return self.call.inputs[0], self.options["weight"]
        return (self.call.inputs[0],)

    def packed(self) -> Tuple[int, int]:
        return COUNT, ROWS + self.label_count()

    def stats(self, acc, plain: bool = False, boundary=None, raw: bool = False) -> core.Stats:
        """This shard's token statistics over the kept tokens (``raw``: over every token, the
        sampler's truncation left out); ``plain``: as :meth:`Logits.stats` (the decision's
        rounds: ``shard_stats``)."""
        if plain:
            return super().stats(acc, plain=True, boundary=boundary)
        options = self._stats_options()
        if raw:
            options.update(keep=None, boundary=None)
        present = (True,) * COUNT
        key = self.key(self.plan.stats_op, self.call.grad)
        out = self.tile_stats(key, self._stats_inputs(), options, present, self.label_count(), acc, after=ROWS)

        def recompute(slot: int, references: tuple, rows: torch.Tensor) -> tuple:
            return self._slot_stats(key, options, present, slot, references[0], rows, acc)

        return out._replace(recompute=recompute)

    @property
    def plain_op(self) -> str:
        return "hidden_shard_stats" if self.hidden else "shard_stats"

    def rounds(self, layout, stats, device, acc) -> tuple:
        stats, failure = super().rounds(layout, stats, device, acc)
        if self.truncating and failure is None:
            try:
                self.raw_local = self.stats(acc, raw=True)
            except Exception as exc:  # carried by the statistics gather's failure column
                return None, exc
        return stats, failure

    def _merged(self, layout, gathered, width) -> tuple:
        """``(Merged, m, s, q, zs)`` of a gather: the logits ops' merge and the per-tile statistics in
        global order."""
        merged = core.combine(gathered, width, layout, self.labels, self.options.get("ignore_index"), True,
                              count=COUNT)
        parts = tuple(core.in_order(gathered, width, layout, i, COUNT) for i in (0, 1, 3, 4))
        return (merged,) + parts

    def _first_max(self, layout, gathered) -> torch.Tensor:
        """The global id of the row's first maximum: that of the first rank (in vocabulary order)
        whose own max is the row's (or NaN)."""
        base = gathered.shape[-1] - self.label_count() - ROWS
        order = torch.tensor(layout.order, dtype=torch.int64, device=gathered.device)
        values = gathered[order, :, base]  # (W, N), in vocabulary order
        top = values.amax(0)
        hit = (values == top.unsqueeze(0)) | torch.isnan(values)
        rank = hit.to(torch.uint8).argmax(0)
        rows = torch.arange(values.shape[1], device=gathered.device)
        return gathered[order[rank], rows, base + 1].to(torch.int64)

    def results(self, layout, gathered, width, lead, device, acc, on) -> Tuple[tuple, tuple]:
        merged, m, s, q, zs = self._merged(layout, gathered, width)
        if self.truncating:
            merged = _nothing_kept(merged)
            raw_gathered, raw_width = self.gathered(layout, self.raw_local, COUNT, device, acc)
            raw, m_raw, _, _, zs = self._merged(layout, raw_gathered, raw_width)
        else:
            raw, m_raw = merged, m
        values = {}
        ignore_index = self.options.get("ignore_index")
        if self.labels is not None:
            shape = self.labels.shape
            valid = torch.ones(shape, dtype=torch.bool, device=device) if ignore_index is None else \
                self.labels.to(device) != ignore_index
            if self.truncating:  # a label outside the kept set: -inf, a constant (no gradient)
                self.dropped = torch.isneginf(merged.logprobs).view(shape)
            values["logprobs"] = merged.logprobs.view(shape)
            values["raw_logprobs"] = raw.logprobs.view(shape)
            first = self._first_max(layout, gathered).view(shape[:len(lead)] + (1,) * (len(shape) - len(lead)))
            values["is_argmax"] = (self.labels.to(device) == first) & valid
        values["entropy"] = merged.entropy.view(lead)
        values["raw_entropy"] = raw.entropy.view(lead)
        values["log_sum_p2"] = merge_squares(m, s, q).view(lead)
        values["mean_logit"] = (_tree_over_tiles(zs) / layout.vocab).view(lead)
        values["max_logit"] = m_raw.amax(-1).view(lead)
        outs = tuple(values[f].to(on.device) if f in values else None for f in self.fields)
        if any(o is None for o in outs):  # a label field asked without labels: validation refuses it first
            raise ValueError(f"token_stats: {', '.join(f for f, o in zip(self.fields, outs) if o is None)} "
                             "need labels")
        saved = (self.labels, merged.lse.to(on.device), merged.entropy.to(on.device),
                 raw.lse.to(on.device), raw.entropy.to(on.device))
        return outs, saved

    def empty(self, lead, acc, on) -> Tuple[tuple, tuple]:
        shape = lead if self.labels is None else tuple(self.labels.shape)
        outs = tuple(torch.zeros(shape if f in ("logprobs", "raw_logprobs", "is_argmax") else lead,
                                 dtype=torch.bool if f == "is_argmax" else acc, device=on.device)
                     for f in self.fields)
        empty = torch.zeros(lead, dtype=acc, device=on.device)
        return outs, (self.labels, empty, empty, empty, empty)

    def non_differentiable(self, outputs: tuple) -> tuple:
        return tuple(o for f, o in zip(self.fields, outputs) if f not in DIFFERENTIABLE_STATS)

    def backward(self, tensors: tuple, saved: tuple, grads: tuple, needs: tuple) -> tuple:
        labels, lse, entropy, raw_lse, raw_entropy = saved
        given = dict(zip(self.fields, grads))
        g = {f: given.get(f) for f in DIFFERENTIABLE_STATS}
        if not self.truncating:  # the raw fields are the processed ones: one backward with both
            return super().backward(tensors, (labels, lse, entropy), stats_gradients(g), needs)
        out = super().backward(tensors, (labels, lse, entropy), (g["logprobs"], g["entropy"]), needs)
        if g["raw_logprobs"] is None and g["raw_entropy"] is None and not (self.hidden and self.needs[0]):
            return out
        kept = (self.keep, self.boundary, self.dropped)
        self.keep = self.boundary = self.dropped = None  # the same backward without the truncation
        try:
            raw = super().backward(tensors, (labels, raw_lse, raw_entropy), (g["raw_logprobs"], g["raw_entropy"]),
                                   needs)
        finally:
            self.keep, self.boundary, self.dropped = kept
        return tuple(_add(a, b) for a, b in zip(out, raw))


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


_StatsFunction = function("process_group= (token_stats)", "For second-order gradients, gather the shards to one rank "
                     "and call without process_group.")
#: token_stats' plans: of logits shards, and of hidden states with a weight shard.
_STATS_PLANS = {False: Plan("shard_token_stats", "shard_grad", Stats, _StatsFunction),
                True: Plan("hidden_shard_token_stats", "hidden_shard_grad", Stats, _StatsFunction)}


_ShardedFunction = function("process_group= (the logits ops)", "For second-order gradients, gather the logits to "
                            "one rank and call without process_group.")
_ShardedHiddenFunction = function("process_group= (logprobs_from_hidden)", "For second-order gradients, gather the "
                                  "weight shards and call without process_group.")
_LOGITS = Plan("shard_stats", "shard_grad", Logits, _ShardedFunction)
_HIDDEN_PLAN = Plan("hidden_shard_stats", "hidden_shard_grad", Logits, _ShardedHiddenFunction)


#: The plan of each public op that runs with process_group= (an op without one is refused).
PLANS = {"logprobs": _LOGITS, "entropy": _LOGITS, "logprobs_and_entropy": _LOGITS, "topk_logprobs": _LOGITS,
         _HIDDEN: _HIDDEN_PLAN, "kl_divergence": kl.PLAN}


def plan(op: str, call: Union[Call, BaseException, None] = None) -> Plan:
    """The plan of public op ``op`` with process_group= (``token_stats``: of logits or of hidden
    states, from its validated ``call``), or NotImplementedError saying so (every rank of the group
    makes the same call, so every rank raises it, before any collective)."""
    if op == "token_stats":
        return _STATS_PLANS[isinstance(call, Call) and call.options.get("weight") is not None]
    try:
        return PLANS[op]
    except KeyError:
        function = OPS[op].function if op in OPS else op
        raise NotImplementedError(
            f"{function}(..., process_group=...) is not supported: op {op!r} has no vocabulary-parallel plan "
            "(logprob_registry.distributed.sharded.PLANS); gather the logits to one rank and call without "
            "process_group") from None


def run(op: str, call: Union[Call, BaseException], process_group: Any):
    """The public op ``op`` over this rank's vocabulary shard, given its validated ``call`` or the
    error validation raised (raised on every rank, after the header exchange); returns what the
    public function returns, on every rank."""
    group = resolve(process_group)
    chosen = plan(op, call)
    shard = chosen.side(chosen, op, call, group, get_registry())
    if shard.call is not None and shard.call.grad and "functorch" not in shard.call.features:
        # inside a torch.func transform the forward raises on every rank (support.check)
        outs = chosen.function.apply(shard, *shard.differentiable())
        outs = outs if isinstance(outs, tuple) else (outs,)
    else:
        outs = shard.forward()[0]
    spec = OPS[op]
    if spec.returns is not None:  # token_stats: its record, the fields not asked None
        return spec.pack(dict(zip(spec.output_names(shard.options), outs)))
    return outs if len(outs) > 1 else outs[0]
