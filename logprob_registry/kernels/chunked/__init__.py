"""``chunked``: fp32-accurate log-probabilities and entropy in bounded memory, on every device.

Rows of the logits go through torch's softmax a chunk at a time, each chunk upcast to fp32 (fp64
for fp64 input) in a small workspace, so the forward never copies the logits (strided
``logits[:, :-1]`` included) and never computes in bf16/fp16; the backward keeps one to three
numbers per row and recomputes the softmax chunk by chunk, out of place or over the logits
(``inplace_backward=True``). ``logprobs_from_hidden`` forms the logits one tile at a time
(:mod:`._hidden`); ``kl_divergence`` streams both sides tile by tile (:mod:`._kl`; the
generalized JSD in two passes). Pure PyTorch: it runs wherever torch runs. How it works, its
settings and its measured numbers: docs/backends/chunked.md.

The sampler's processing (softcap, top_k, top_p, min_p, keep), candidate labels, ``topk_logprobs``
and the fused op's ``logits_dtype`` go through :mod:`._sampler`, a chunk of rows at a time; a call
without them runs the code above, unchanged.

Modules: :mod:`._rows` (the row loops), :mod:`._hidden` (the fused linear op), :mod:`._sampler`
(the sampler's processing), :mod:`._stats` (``token_stats``: every statistic in the same pass),
:mod:`._shards` (the vocabulary-parallel ops behind ``process_group=``, group invariant).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import FLOAT_DTYPES, backward_without_autocast, overlapping, second_order_gradient

from . import _hidden, _kl, _kl_shards, _sampler, _shards, _stats
from . import _rows as loops

DEFAULT_WORKSPACE_BYTES = 8 << 20
WORKSPACE = kit.declare_variable(kit.Variable(
    "LOGPROB_REGISTRY_CHUNKED_WORKSPACE", kit.parse_bytes, DEFAULT_WORKSPACE_BYTES,
    "bytes of the chunked backend's two fp32 chunk buffers (default 8MiB)"))
WORKSPACE_ENV = WORKSPACE.name
# Devices whose row kernels work row by row whatever the shape; elsewhere chunks get a fixed shape.
ROW_WISE_DEVICES = frozenset({"cpu"})

_workspace_override: Optional[int] = None


def set_workspace_bytes(nbytes: Optional[int]) -> None:
    """Set the workspace budget of the ``chunked`` backend for this process; ``None`` restores the
    environment variable or the default. Larger budgets mean fewer, larger chunks."""
    global _workspace_override
    _workspace_override = None if nbytes is None else kit.positive_bytes(nbytes, "the workspace budget")


def workspace_bytes() -> int:
    """The workspace budget in force: :func:`set_workspace_bytes`, else the environment variable
    ``LOGPROB_REGISTRY_CHUNKED_WORKSPACE``, else ``DEFAULT_WORKSPACE_BYTES``."""
    if _workspace_override is not None:
        return _workspace_override
    return kit.variable_value(WORKSPACE.name)


def _plan(logits: torch.Tensor, temperature: float, want_logprobs: bool, want_entropy: bool) -> loops.Plan:
    return loops.Plan(
        temperature=temperature,
        want_logprobs=want_logprobs,
        want_entropy=want_entropy,
        rows_per_chunk=loops.rows_per_chunk(logits.shape[-1], logits.dtype, workspace_bytes()),
        fixed_shape=logits.device.type not in ROW_WISE_DEVICES,
    )


def _labels(labels: torch.Tensor, ignore_index: Optional[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Flat int64 labels safe to index with (0 at ignored positions), and the mask of kept ones."""
    index = labels.reshape(-1).long()
    if ignore_index is None:
        return index, None
    valid = index != ignore_index
    return index.masked_fill(~valid, 0), valid


def _results(logits, index, valid, plan: loops.Plan) -> Tuple[Tuple[torch.Tensor, ...], loops.Stats]:
    stats = loops.forward(logits, plan, index if plan.want_logprobs else None)
    lead = logits.shape[:-1]
    outs = []
    if plan.want_logprobs:
        outs.append(loops.logprobs(logits, plan, index, valid, stats).view(lead))
    if plan.want_entropy:
        outs.append((stats.logz - stats.mean_z).view(lead))
    return tuple(outs), stats


def _reference_outputs(logits, index, valid, plan: loops.Plan) -> tuple:
    """The op's outputs by the reference formulas in the result dtype, differentiable (for a
    double backward): ``index`` and ``valid`` as the forward made them."""
    labels = None if index is None else index.view(logits.shape[:-1])
    outs = kit.reference_outputs(logits, labels, temperature=plan.temperature, ignore_index=None,
                       want_logprobs=plan.want_logprobs, want_entropy=plan.want_entropy)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if plan.want_logprobs and valid is not None:
        outs[0] = outs[0].masked_fill(~valid.view(logits.shape[:-1]), 0.0)
    return tuple(outs)


class _ChunkedFunction(torch.autograd.Function):
    """Forward saves the logits and per-row statistics; backward recomputes softmax by chunks
    (under ``create_graph=True``, by differentiable torch ops instead, so that it can be
    differentiated again)."""

    @staticmethod
    def forward(ctx, logits, index, valid, plan, inplace):
        outs, stats = _results(logits, index, valid, plan)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.index, ctx.valid, ctx.inplace = plan, stats, index, valid, inplace
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        plan = ctx.plan
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            outputs = lambda: _reference_outputs(logits, ctx.index, ctx.valid, plan)
            return second_order_gradient(outputs, (logits,), grads) + (None,) * 4
        grads = list(grads)
        g_lp = grads.pop(0) if plan.want_logprobs else None
        g_ent = grads.pop(0) if plan.want_entropy else None
        if g_lp is not None:
            g_lp = g_lp.reshape(-1)
            if ctx.valid is not None:
                g_lp = g_lp.masked_fill(~ctx.valid, 0.0)
        if g_ent is not None:
            g_ent = g_ent.reshape(-1)
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        if ctx.inplace:
            out = logits.detach()  # a fresh alias of the logits' storage, so autograd can keep it
        else:
            out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        loops.backward(logits, plan, ctx.stats, ctx.index, g_lp, g_ent, out, inplace=ctx.inplace)
        return out, None, None, None, None


def _run(logits, labels, temperature, ignore_index, inplace_backward, want_logprobs, want_entropy):
    if logits.shape[-1] == 0:  # nothing to chunk; the textbook formulas give the textbook answer
        return kit.reference_outputs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                           want_logprobs=want_logprobs, want_entropy=want_entropy)
    plan = _plan(logits, temperature, want_logprobs, want_entropy)
    if labels is not None:
        index, valid = _labels(labels, ignore_index)
    else:
        index, valid = None, None
    if torch.is_grad_enabled() and logits.requires_grad:
        inplace_backward = inplace_backward and not overlapping(logits)  # then honoured out of place
        outs = _ChunkedFunction.apply(logits, index, valid, plan, inplace_backward)
    else:
        outs = _results(logits, index, valid, plan)[0]
    return outs if len(outs) > 1 else outs[0]


def _sampler_run(logits, labels, **options):
    return _sampler.run(logits, labels, budget=workspace_bytes(),
                        fixed_shape=logits.device.type not in ROW_WISE_DEVICES, **options)


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    if _sampler.used(sampler, temperature) or labels.dim() == logits.dim():
        return _sampler_run(logits, labels, temperature=temperature, ignore_index=ignore_index,
                            inplace_backward=inplace_backward, **sampler)
    return _run(logits, labels, temperature, ignore_index, inplace_backward, True, False)


def entropy(logits, *, temperature, **sampler):
    if _sampler.used(sampler, temperature):
        return _sampler_run(logits, None, temperature=temperature, want_logprobs=False, want_entropy=True,
                            **sampler)
    return _run(logits, None, temperature, None, False, False, True)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    if _sampler.used(sampler, temperature) or labels.dim() == logits.dim():
        return _sampler_run(logits, labels, temperature=temperature, ignore_index=ignore_index,
                            inplace_backward=inplace_backward, want_entropy=True, **sampler)
    return _run(logits, labels, temperature, ignore_index, inplace_backward, True, True)


def topk_logprobs(logits, *, k, temperature, **sampler):
    return _sampler_run(logits, None, temperature=temperature, want_logprobs=False, topk=k, **sampler)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         chunk_bytes=None, **sampler):
    if _sampler.used(sampler, temperature) or labels.dim() == hidden.dim():
        return _sampler.logprobs_from_hidden(
            hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy, budget=workspace_bytes(), chunk_bytes=chunk_bytes, **sampler)
    return _hidden.logprobs_from_hidden(hidden, weight, labels, bias=bias, temperature=temperature,
                                        ignore_index=ignore_index, return_entropy=return_entropy,
                                        chunk_bytes=chunk_bytes)


def token_stats(inputs, labels, *, weight, bias, outputs, temperature, ignore_index, chunk_bytes=None, **sampler):
    return _stats.token_stats(inputs, labels, weight=weight, bias=bias, outputs=outputs, temperature=temperature,
                              ignore_index=ignore_index, budget=workspace_bytes(),
                              fixed_shape=inputs.device.type not in ROW_WISE_DEVICES, chunk_bytes=chunk_bytes,
                              **sampler)


def kl_divergence(student, teacher, *, direction, temperature, mask, tail, student_weight=None,
                  teacher_weight=None, support=None, beta=None):
    hidden = student_weight is not None or teacher_weight is not None
    budget = _hidden.resolve_chunk_bytes(student.device) if hidden else workspace_bytes()
    return _kl.kl_divergence(student, teacher, direction=direction, temperature=temperature, mask=mask, tail=tail,
                             student_weight=student_weight, teacher_weight=teacher_weight, support=support,
                             beta=beta, budget=budget, fixed=student.device.type not in ROW_WISE_DEVICES)


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, **sampler):
    return _shards.shard_stats(logits, labels, vocab_start=vocab_start, tile=tile, temperature=temperature,
                               ignore_index=ignore_index, with_entropy=with_entropy, budget=workspace_bytes(),
                               **sampler)


def shard_token_stats(logits, labels, **options):
    return _shards.shard_token_stats(logits, labels, budget=workspace_bytes(), **options)


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward, **sampler):
    return _shards.shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, vocab_start=vocab_start,
                              temperature=temperature, inplace_backward=inplace_backward, budget=workspace_bytes(),
                              **sampler)


def shard_topk(logits, **options):
    return _shards.shard_topk(logits, budget=workspace_bytes(), **options)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="chunked",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "logprobs_from_hidden": logprobs_from_hidden,
            "token_stats": token_stats,
            "topk_logprobs": topk_logprobs,
            "kl_divergence": kl_divergence,
            "shard_stats": shard_stats,
            "shard_grad": shard_grad,
            "hidden_shard_stats": _shards.hidden_shard_stats,
            "shard_token_stats": shard_token_stats,
            "hidden_shard_token_stats": _shards.hidden_shard_token_stats,
            "hidden_shard_grad": _shards.hidden_shard_grad,
            "shard_topk": shard_topk,
            "hidden_shard_topk": _shards.hidden_shard_topk,
            "kl_shard_stats": _kl_shards.kl_shard_stats,
            "kl_shard_grad": _kl_shards.kl_shard_grad,
        },
        devices={"cpu", "cuda", "npu", "xpu", "mps", "hpu"},
        dtypes=set(FLOAT_DTYPES),
        priority=kit.Priority.PORTABLE,
        # tiny vocabularies (up to 256): its fixed cost per call outweighs the work; naive wins there
        min_vocab=257,
        autograd=True,
        inplace_backward=True,
        batch_invariant=True,
        deterministic=True,
        features={"candidates", "softcap", "top_k", "top_p", "min_p", "keep", "logits_dtype", "kl_hidden",
                  "kl_support", "kl_jsd", "stats_hidden", "shard_sampler", "per_row", "sampler"},
        group_invariant=True,
        memory="two fp32 chunk buffers within the workspace budget (8 MiB by default) and a few "
               "floats per row; backward: the gradient, none with inplace_backward",
        description="rows in cache-sized fp32 chunks; no copy of the logits; backward recomputes softmax",
    ))
