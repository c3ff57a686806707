"""``naive``: the textbook ``log_softmax`` + gather in float32, on every device type it lists (pure
torch: add one by registering a copy of it for your device type), autograd by torch.

The portable fallback of last resort: it materialises a float32 copy of the logits (and its
log-softmax), so it has the lowest priority. It implements every feature of the op table (the
sampler's processing, candidate labels, ``topk_logprobs``, ``logits_dtype``) as
:mod:`logprob_registry.reference` defines it, in float32: the reference implementation of them.
"""

from __future__ import annotations

import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.dtypes import FLOAT_DTYPES, result_dtype

from ._common import pad_rows


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                        dtype=result_dtype(logits.dtype), **sampler)


def entropy(logits, *, temperature, **sampler):
    return ref.entropy(logits, temperature=temperature, dtype=result_dtype(logits.dtype), **sampler)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    return ref.logprobs_and_entropy(
        logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=result_dtype(logits.dtype),
        **sampler,
    )


def topk_logprobs(logits, *, k, temperature, **sampler):
    return ref.topk_logprobs(logits, k, temperature=temperature, dtype=result_dtype(logits.dtype), **sampler)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         keep=None, **sampler):
    lead = hidden.shape[:-1]
    n = lead.numel()
    candidates = labels.dim() == hidden.dim()
    # a few rows are padded so that the matmul takes the path it takes for a batch (batch invariance)
    flat = pad_rows(hidden.reshape(n, hidden.shape[-1]))
    pad = flat.shape[0] - n
    flat_labels = labels.reshape((n, labels.shape[-1]) if candidates else (n,))
    padded_labels = torch.cat([flat_labels, flat_labels.new_zeros((pad,) + flat_labels.shape[1:])])
    if keep is not None:  # padded rows keep every token
        flat_keep = ref.keep_mask(keep, weight.shape[0]).reshape(n, weight.shape[0])
        keep = torch.cat([flat_keep, flat_keep.new_ones(pad, weight.shape[0])])
    out = ref.logprobs_from_hidden(
        flat, weight, padded_labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=result_dtype(hidden.dtype), keep=keep, **sampler,
    )
    shape = labels.shape
    if return_entropy:
        return out[0][:n].reshape(shape), out[1][:n].reshape(lead)
    return out[:n].reshape(shape)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="naive",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "logprobs_from_hidden": logprobs_from_hidden,
            "topk_logprobs": topk_logprobs,
        },
        devices={"cpu", "cuda", "npu", "xpu", "mps", "hpu"},
        dtypes=set(FLOAT_DTYPES),
        priority=0,
        autograd=True,
        batch_invariant=True,
        copies_logits=True,
        features={"functorch", "candidates", "softcap", "top_k", "top_p", "min_p", "keep", "logits_dtype"},
        description="log_softmax + gather in float32; materialises the logits in float32; every feature, "
                    "as the reference defines it",
    ))
