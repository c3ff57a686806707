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


#: Fewer token rows than this are padded with zero rows before the matmul: the CPU matmul takes
#: another path for a handful of rows, which would make a row's result depend on its batch.
MIN_GEMM_ROWS = 16


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    lead, short = labels.shape, MIN_GEMM_ROWS - labels.numel()
    if short > 0:
        hidden = torch.cat([hidden.reshape(-1, hidden.shape[-1]), hidden.new_zeros(short, hidden.shape[-1])])
        labels = torch.cat([labels.reshape(-1), labels.new_zeros(short)])
    out = ref.logprobs_from_hidden(
        hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, dtype=_dtype(hidden),
    )
    if short <= 0:
        return out
    if return_entropy:
        return out[0][: labels.numel() - short].view(lead), out[1][: labels.numel() - short].view(lead)
    return out[: labels.numel() - short].view(lead)


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
