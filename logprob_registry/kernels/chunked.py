"""``chunked``: fp32-accurate log-probabilities and entropy in bounded memory, on every device.

Rows of the logits are processed a chunk at a time, each chunk upcast to fp32 (fp64 for fp64
input) in a workspace of a few MiB that stays in cache: the forward never makes a copy of the
logits, whatever their dtype or strides (``logits[:, :-1]`` included), and never computes in
bf16/fp16. The backward keeps only the logits and one to three numbers per row, recomputes the
softmax chunk by chunk and writes ``(onehot - softmax) * grad / temperature`` (plus the entropy
term when asked) into the gradient. Pure PyTorch, so it runs wherever torch runs.

Workspace: the two chunk buffers together take at most :func:`workspace_bytes` bytes (default
``DEFAULT_WORKSPACE_BYTES``, 8 MiB; at least two rows whatever the budget). Set it with
:func:`set_workspace_bytes` or the environment variable ``LOGPROB_REGISTRY_CHUNKED_WORKSPACE``
(bytes, or a number with a ``K``/``KiB``/``M``/``MiB``/``G``/``GiB`` suffix). The budget changes
speed only: a row's result is the same bits whatever the budget, on the CPU.

In-place backward (``inplace_backward=True``): the gradient is written into the logits' own
storage and returned as their gradient, so the backward allocates nothing of the logits' size.
The logits are overwritten by the backward: use it only when nothing reads them afterwards and no
other autograd node saved them for its own backward (for instance when the logits are a leaf, or
the output of a matmul whose backward needs only its inputs). Non-contiguous logits are written in
place through their strides.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

import logprob_registry as lr
from logprob_registry import reference as ref

from . import _chunked_loops as loops
from . import chunked_hidden

DEFAULT_WORKSPACE_BYTES = 8 << 20
WORKSPACE_ENV = "LOGPROB_REGISTRY_CHUNKED_WORKSPACE"
# Devices whose row kernels work row by row whatever the shape; elsewhere chunks get a fixed shape.
ROW_WISE_DEVICES = frozenset({"cpu"})

_workspace_override: Optional[int] = None
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def set_workspace_bytes(nbytes: Optional[int]) -> None:
    """Set the workspace budget of the ``chunked`` backend for this process; ``None`` restores the
    environment variable or the default. Larger budgets mean fewer, larger chunks."""
    global _workspace_override
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"the workspace budget must be a positive number of bytes, got {nbytes!r}")
    _workspace_override = nbytes


def workspace_bytes() -> int:
    """The workspace budget in force: :func:`set_workspace_bytes`, else the environment variable
    ``LOGPROB_REGISTRY_CHUNKED_WORKSPACE``, else ``DEFAULT_WORKSPACE_BYTES``."""
    if _workspace_override is not None:
        return _workspace_override
    text = os.environ.get(WORKSPACE_ENV, "").strip()
    if not text:
        return DEFAULT_WORKSPACE_BYTES
    match = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit or int(match.group(1)) <= 0:
        raise ValueError(
            f"{WORKSPACE_ENV}={text!r} is not a workspace size; give a positive number of bytes "
            "such as 4194304 or 4MiB"
        )
    return int(match.group(1)) * unit


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


class _ChunkedFunction(torch.autograd.Function):
    """Forward saves the logits and per-row statistics; backward recomputes softmax by chunks."""

    @staticmethod
    def forward(ctx, logits, index, valid, plan, inplace):
        outs, stats = _results(logits, index, valid, plan)
        ctx.save_for_backward(logits)
        ctx.plan, ctx.stats, ctx.index, ctx.valid, ctx.inplace = plan, stats, index, valid, inplace
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        plan = ctx.plan
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
        return ref.outputs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                           want_logprobs=want_logprobs, want_entropy=want_entropy)
    plan = _plan(logits, temperature, want_logprobs, want_entropy)
    if labels is not None:
        index, valid = _labels(labels, ignore_index)
    else:
        index, valid = None, None
    if torch.is_grad_enabled() and logits.requires_grad:
        outs = _ChunkedFunction.apply(logits, index, valid, plan, inplace_backward)
    else:
        outs = _results(logits, index, valid, plan)[0]
    return outs if len(outs) > 1 else outs[0]


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return _run(logits, labels, temperature, ignore_index, inplace_backward, True, False)


def entropy(logits, *, temperature):
    return _run(logits, None, temperature, None, False, False, True)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward):
    return _run(logits, labels, temperature, ignore_index, inplace_backward, True, True)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="chunked",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "logprobs_from_hidden": chunked_hidden.logprobs_from_hidden,
        },
        devices={"cpu", "cuda", "npu", "xpu", "mps"},
        dtypes={torch.float16, torch.bfloat16, torch.float32, torch.float64},
        priority=10,
        autograd=True,
        inplace_backward=True,
        batch_invariant=True,
        deterministic=True,
        memory="two fp32 chunk buffers within the workspace budget (8 MiB by default) and a few "
               "floats per row; backward: the gradient, none with inplace_backward",
        description="rows in cache-sized fp32 chunks; no copy of the logits; backward recomputes softmax",
    ))
