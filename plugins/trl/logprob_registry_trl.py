"""``trl`` and ``trl-chunked``: TRL's log-probability kernels as logprob-registry backends.

* ``trl``: ``trl.trainer.utils.selective_log_softmax_and_entropy`` for ``logprobs``, ``entropy`` and
  ``logprobs_and_entropy`` (on CUDA it runs TRL's fused Triton kernel; elsewhere TRL's torch loop);
* ``trl-chunked``: ``trl.kernels.ChunkedLogProbFunction`` (the chunked lm_head) for
  ``logprobs_from_hidden``.

What the adapter does around TRL, and only this: int64 labels; ``ignore_index`` as TRL's callers
apply it (label 0 passed, the result zeroed); 1-D logits as one row and empty batches answered
without a call (TRL's torch path stacks over the first dimension); results in float32 (float64 for
float64).

What they declare, from what the suite measured with trl 1.16.0 on the CPU:

* float32 and float64 only: TRL's torch path takes ``log_softmax`` (and divides by the
  temperature) in bf16/fp16 for bf16/fp16 logits (errors of 5e-2 nats), and its chunked head
  multiplies in the inputs' dtype off CUDA;
* ``copies_logits=True`` (``logits / temperature`` and the per-row loop form copies);
* ``trl-chunked`` is not batch invariant (a row's bits depend on the other rows) and its backward
  cannot run twice on one graph; ``trl`` is.
"""

import torch

import logprob_registry as lr
from logprob_registry import kit

TRL_CHUNK = 4096  # the vocabulary chunk of the chunked head (TRL's trainers' default)


def _labels(labels, ignore_index):
    if ignore_index is None:
        return labels.long(), None
    keep = labels != ignore_index
    return labels.masked_fill(~keep, 0).long(), keep


def _finish(out, keep, dtype, shape):
    out = out.to(kit.result_dtype(dtype)).reshape(shape)
    return out if keep is None else out.masked_fill(~keep.reshape(shape), 0.0)


def _selective(logits, index, temperature):
    from trl.trainer.utils import selective_log_softmax_and_entropy

    if logits.numel() == 0 or logits.shape[:-1].numel() == 0:
        empty = logits.sum(-1) * 0  # connected to the logits, of the positions' shape
        return empty, empty
    if logits.dim() == 1:
        logp, ent = selective_log_softmax_and_entropy(logits.unsqueeze(0), index.unsqueeze(0),
                                                      temperature=temperature)
        return logp[0], ent[0]
    return selective_log_softmax_and_entropy(logits, index, temperature=temperature)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward):
    index, keep = _labels(labels, ignore_index)
    logp, ent = _selective(logits, index, temperature)
    return _finish(logp, keep, logits.dtype, labels.shape), _finish(ent, None, logits.dtype, labels.shape)


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index,
                                inplace_backward=inplace_backward)[0]


def entropy(logits, *, temperature):
    index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return _finish(_selective(logits, index, temperature)[1], None, logits.dtype, index.shape)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    from trl.kernels import ChunkedLogProbFunction

    index, keep = _labels(labels.reshape(-1), ignore_index)
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.shape[0] == 0:
        empty = (h.sum(-1) * 0 + (weight.sum() * 0)).reshape(labels.shape)
        empty = empty.to(kit.result_dtype(hidden.dtype))
        return (empty, empty) if return_entropy else empty
    outs = ChunkedLogProbFunction.apply(h, weight, bias, index, temperature, TRL_CHUNK, None, 1.0,
                                        ("entropy",) if return_entropy else ())
    logp = _finish(outs[0], keep, hidden.dtype, labels.shape)
    return (logp, _finish(outs[1], None, hidden.dtype, labels.shape)) if return_entropy else logp


@lr.hookimpl
def register_backends(register):
    common = dict(
        devices={"cpu", "cuda"},
        dtypes={torch.float32, torch.float64},
        priority=kit.Priority.EXPLICIT_ONLY,  # chosen by name: a peer measured, never the automatic choice
        torch=">=2.6",
        requires=("trl>=1.16,<1.17",),
        autograd=True,
        copies_logits=True,
    )
    register(lr.Backend(
        name="trl",
        ops={"logprobs": logprobs, "entropy": entropy, "logprobs_and_entropy": logprobs_and_entropy},
        batch_invariant=True,
        description="TRL selective_log_softmax_and_entropy (fused Triton kernel on CUDA, torch loop elsewhere)",
        **common,
    ))
    register(lr.Backend(
        name="trl-chunked",
        ops={"logprobs_from_hidden": logprobs_from_hidden},
        batch_invariant=False,
        description=f"TRL ChunkedLogProbFunction (chunked lm_head, {TRL_CHUNK} columns a chunk)",
        **common,
    ))
