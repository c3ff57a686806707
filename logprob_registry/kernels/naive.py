"""``naive``: the textbook ``log_softmax`` + gather in float32, on every device type it lists (pure
torch: add one by registering a copy of it for your device type), autograd by torch.

The portable fallback of last resort: it materialises a float32 copy of the logits (and its
log-softmax), so it has the lowest priority.
"""

from __future__ import annotations

import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.dtypes import FLOAT_DTYPES, result_dtype

from ._common import pad_rows


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                        dtype=result_dtype(logits.dtype))


def entropy(logits, *, temperature):
    return ref.entropy(logits, temperature=temperature, dtype=result_dtype(logits.dtype))


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward):
    return ref.logprobs_and_entropy(
        logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=result_dtype(logits.dtype)
    )


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    lead, n = labels.shape, labels.numel()
    # a few rows are padded so that the matmul takes the path it takes for a batch (batch invariance)
    flat = pad_rows(hidden.reshape(n, hidden.shape[-1]))
    padded_labels = torch.cat([labels.reshape(-1), labels.new_zeros(flat.shape[0] - n)])
    out = ref.logprobs_from_hidden(
        flat, weight, padded_labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=result_dtype(hidden.dtype),
    )
    if return_entropy:
        return out[0][:n].view(lead), out[1][:n].view(lead)
    return out[:n].view(lead)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="naive",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "logprobs_from_hidden": logprobs_from_hidden,
        },
        devices={"cpu", "cuda", "npu", "xpu", "mps", "hpu"},
        dtypes=set(FLOAT_DTYPES),
        priority=0,
        autograd=True,
        batch_invariant=True,
        copies_logits=True,
        features={"functorch"},
        description="log_softmax + gather in float32; materialises the logits in float32",
    ))
