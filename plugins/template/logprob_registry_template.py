"""``template``: the smallest backend that passes the conformance suite; copy it to start a plugin.

It computes ``logprobs`` a block of rows at a time (a few MiB), reading the logits through their
strides, so it never copies them; backward recomputes each block's softmax from the saved
log-sum-exp. Replace the two loops with calls to your kernel.

The rules every backend shares come from :mod:`logprob_registry.kit` (the public helpers for
backend authors): ``kit.result_dtype`` (what a result is computed and returned in) and
``kit.first_order_only`` (a backward that refuses ``create_graph=True`` rather than silently
dropping the second-order term).
"""

import itertools

import torch

import logprob_registry as lr
from logprob_registry import kit

BLOCK_ELEMENTS = 1 << 20  # logits read per step: 4 MiB in float32


def _blocks(logits, *rows):
    """2-D views (rows, V) of ``logits`` and the matching 1-D views of each of ``rows``."""
    if logits.dim() == 1:
        logits, rows = logits.unsqueeze(0), [r.unsqueeze(0) for r in rows]
    step = max(1, BLOCK_ELEMENTS // max(logits.shape[-1], 1))
    for index in itertools.product(*map(range, logits.shape[:-2])):
        x, rs = logits[index], [r[index] for r in rows]
        for start in range(0, x.shape[0], step):
            yield (x[start:start + step], *[r[start:start + step] for r in rs])


def _log_softmax(x, temperature):
    return (x.to(kit.result_dtype(x.dtype)) / temperature).log_softmax(-1)


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index):
        out = torch.zeros(labels.shape, dtype=kit.result_dtype(logits.dtype), device=logits.device)
        keep = torch.ones_like(labels, dtype=torch.bool) if ignore_index is None else labels != ignore_index
        index = labels.masked_fill(~keep, 0).long()  # an ignored label is never used as an index
        for x, o, i, k in _blocks(logits, out, index, keep):
            o.copy_(_log_softmax(x, temperature).gather(-1, i.unsqueeze(-1)).squeeze(-1) * k)
        ctx.save_for_backward(logits, index, keep)
        ctx.temperature = temperature
        return out

    @staticmethod
    @kit.first_order_only("backend 'template'")  # the loops below are not differentiable: refuse create_graph=True
    def backward(ctx, grad_out):
        logits, index, keep = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g_all = grad_out * keep
        for x, gx, i, g in _blocks(logits, grad, index, g_all):
            # d logp_y / dx = (onehot(y) - softmax(x / T)) / T
            d = _log_softmax(x, ctx.temperature).exp_()
            d.mul_(-g.unsqueeze(-1).to(d.dtype))
            d.scatter_add_(-1, i.unsqueeze(-1), g.unsqueeze(-1).to(d.dtype))
            gx.copy_(d.div_(ctx.temperature))
        return grad, None, None, None


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return _LogProbs.apply(logits, labels, temperature, ignore_index)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="template",
        ops={"logprobs": logprobs},
        devices={"cpu", "cuda"},
        dtypes=set(kit.FLOAT_DTYPES),
        priority=kit.Priority.PORTABLE - 5,  # pure PyTorch, but below chunked: pick your band (Priority)
        torch=">=2.1",
        autograd=True,
        batch_invariant=True,
        description="plugins/template: log_softmax a block of rows at a time, no copy of the logits",
    ))
