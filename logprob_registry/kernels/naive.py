"""``naive``: the textbook ``log_softmax`` + gather in float32, on every device, autograd by torch.

The portable fallback of last resort: it materialises a float32 copy of the logits (and its
log-softmax), so it has the lowest priority.
"""

from __future__ import annotations

import torch

import logprob_registry as lr
from logprob_registry import reference as ref


def _dtype(t: torch.Tensor) -> torch.dtype:
    return ref.result_dtype(t.dtype)


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=_dtype(logits))


def entropy(logits, *, temperature):
    return ref.entropy(logits, temperature=temperature, dtype=_dtype(logits))


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward):
    return ref.logprobs_and_entropy(
        logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=_dtype(logits)
    )


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    return ref.logprobs_from_hidden(
        hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=_dtype(hidden),
    )


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
        devices={"cpu", "cuda", "npu", "xpu", "mps"},
        dtypes={torch.float16, torch.bfloat16, torch.float32, torch.float64},
        priority=0,
        autograd=True,
        batch_invariant=True,
        copies_logits=True,
        description="log_softmax + gather in float32; materialises the logits in float32",
    ))
