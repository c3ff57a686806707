"""``liger``: Liger-Kernel's fused cross-entropy (``reduction="none"``) as a logprobs backend.

Liger computes ``lse - x_y`` per row in one Triton kernel, and when the input needs gradients it
writes them into the input during the forward pass (saving the N x V gradient buffer). This adapter
maps the registry's contract onto that:

* log-probabilities are ``-loss``; ``ignore_index`` is applied here (Liger would zero the ignored
  rows of the caller's logits in place), by giving Liger label 0 there and zeroing the result;
* Liger has no temperature: ``logits / temperature`` is formed first (a copy);
* Liger overwrites its input with the gradient in forward: the caller's logits are handed over only
  with ``inplace_backward=True``; otherwise a copy is;
* Liger stores its per-row result in the logits' dtype (a bf16 loss keeps 3 significant digits:
  errors of 0.1 nats measured), so only float32 and float64 logits are accepted (float64 is
  computed in float32, as the contract allows).

Hence ``copies_logits=True``. Runs on CUDA; on the CPU only under ``TRITON_INTERPRET=1`` (the
Triton interpreter), which is how its conformance is checked without a GPU.
"""

import os

import torch

import logprob_registry as lr
from logprob_registry import kit


def _cpu_allowed() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses ``create_graph=True``: Liger forms the gradient during
    the forward pass, so it cannot be differentiated again, and a double backward must say so
    rather than drop the second-order term."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @kit.first_order_only("backend 'liger'", "Liger computes the gradient during the forward pass; use "
                          "backend='naive' for second-order gradients.")
    def backward(ctx, grad):
        return grad


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    vocab = logits.shape[-1]
    if logits.numel() == 0:
        return logits.sum(-1).to(kit.result_dtype(logits.dtype)) * 0
    grad = torch.is_grad_enabled() and logits.requires_grad
    x = logits if temperature == 1.0 else logits / temperature
    if not grad:
        x = x.detach()  # Liger writes gradients into any input that requires them
    elif x is logits and not inplace_backward:
        x = logits.clone()  # not the caller's storage: Liger overwrites it with the gradient
    rows = x.reshape(-1, vocab)  # a view where the strides allow, else a copy
    target = labels.reshape(-1).long()
    keep = None if ignore_index is None else target != ignore_index
    if keep is not None:
        target = target.masked_fill(~keep, 0)
    loss = LigerCrossEntropyFunction.apply(rows, target, None, -1, 0.0, 0.0, "none", None, False, False, False)[0]
    out = -loss.to(kit.result_dtype(logits.dtype))
    if keep is not None:
        out = out.masked_fill(~keep, 0.0)
    if grad:
        out = _FirstOrderOnly.apply(out)
    return out.reshape(labels.shape)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="liger",
        ops={"logprobs": logprobs},
        devices={"cuda", "cpu"} if _cpu_allowed() else {"cuda"},
        dtypes={torch.float32, torch.float64},
        priority=kit.Priority.KERNEL - 5,  # a fused kernel, below triton's: it copies the logits
        torch=">=2.1.2",
        requires=("liger_kernel.ops.cross_entropy",),
        autograd=True,
        batch_invariant=True,
        copies_logits=True,
        description="Liger-Kernel cross_entropy (Triton), reduction='none', float32/float64 logits",
    ))
