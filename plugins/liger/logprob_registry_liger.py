"""``liger``: Liger-Kernel's cross-entropy kernels (``reduction="none"``) as a backend.

``logprobs`` is Liger's fused cross-entropy, which computes ``lse - x_y`` per row in one Triton
kernel and, when the input needs gradients, writes them into the input during the forward pass
(saving the N x V gradient buffer). This adapter maps the registry's contract onto that:

* log-probabilities are ``-loss``; ``ignore_index`` is applied here (Liger would zero the ignored
  rows of the caller's logits in place), by giving Liger label 0 there and zeroing the result;
* Liger has no temperature: ``logits / temperature`` is formed first (a copy); a softcap is given
  to Liger as ``softcap / temperature``, which applies it before the temperature;
* Liger overwrites its input with the gradient in forward: the caller's logits are handed over only
  with ``inplace_backward=True``; otherwise a copy is;
* Liger stores its per-row result in the logits' dtype (a bf16 loss keeps 3 significant digits:
  errors of 0.1 nats measured), so only float32 and float64 logits are accepted (float64 is
  computed in float32, as the contract allows).

Hence ``copies_logits=True``. ``logprobs_from_hidden`` is Liger's fused linear cross-entropy (FLCE,
Triton, logits formed in chunks of rows, with bias and softcap) without ``return_entropy``, and its
fused linear *scaled* cross-entropy (FLSCE: its own temperature and the entropy; no bias, no softcap)
with it; see :func:`_flce` and :func:`_flsce` for the mappings. Both form the logits in the hidden
states' dtype, 0.02 to 0.04 nats off in bf16 (the suite, test_hidden_values), so float32 and float64
only here too. Neither is bitwise batch-invariant (their matmuls depend on the rows given), so the
backend does not declare ``batch_invariant``. Runs on CUDA; on the CPU only under
``TRITON_INTERPRET=1`` (the Triton interpreter), which is how its conformance is checked without a
GPU.
"""

import os

import torch

import logprob_registry as lr
from logprob_registry import kit


def _cpu_allowed() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses ``create_graph=True``: Liger's gradients (formed in the
    forward pass, or by its own backward for the fused ops) cannot be differentiated again, and a
    double backward must say so rather than drop the second-order term."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @kit.first_order_only("backend 'liger'", "Liger's gradients are not differentiable; use "
                          "backend='naive' for second-order gradients.")
    def backward(ctx, grad):
        return grad


_NEVER = -(2 ** 62)  # an ignore_index no label equals (labels are in [0, V))


def _scaled_softcap(softcap, temperature):
    """Liger applies ``softcap * tanh(x / softcap)`` and has no temperature; given ``x / T`` the
    softcap ``softcap / T`` gives ``softcap * tanh(x / softcap) / T``, the registry's order."""
    return None if softcap is None else softcap / temperature


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None):
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
    loss = LigerCrossEntropyFunction.apply(rows, target, None, -1, 0.0, 0.0, "none",
                                     _scaled_softcap(softcap, temperature), False, False, False)[0]
    out = -loss.to(kit.result_dtype(logits.dtype))
    if keep is not None:
        out = out.masked_fill(~keep, 0.0)
    if grad:
        out = _FirstOrderOnly.apply(out)
    return out.reshape(labels.shape)


def _flce(h, w, b, y, temperature, ignore_index, softcap):
    """-loss of Liger's fused linear cross-entropy (Triton; reduction="none", the logits formed in
    chunks of rows): Liger has no temperature, so ``hidden / T`` and ``bias / T`` are formed (a copy of
    hidden, N x H, not of the N x V logits)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if temperature != 1.0:
        h = h / temperature
        b = None if b is None else b / temperature
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        h, w, y, b, None, ignore_index, 0.0, 0.0, "none",
        _scaled_softcap(softcap, temperature))[0]
    return -loss


def _flsce(h, w, b, y, keep, temperature):
    """-nll and the entropy of Liger's fused linear *scaled* cross-entropy (its own temperature, and
    the entropy). Three mappings onto the contract: Liger has no bias, so a bias is folded in as a
    column of ones of hidden and a column of the weight (copies of both); Liger zeroes the entropy of
    ignored rows, so it is given label 0 there and no ignore_index, and the logprobs are zeroed here;
    Liger's entropy is NaN where a logit is -inf (0 * -inf), so a -inf bias entry is given as a
    negative float that stays finite in float32 after the temperature (its probability is 0 either way),
    and a label whose bias is -inf gets the logprob -inf."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as flsce

    def function(*args):
        return flsce.LigerFusedLinearScaledCrossEntropyFunction.apply(*args, return_entropy=True)

    if h.is_cuda and torch.cuda.get_device_capability(h.device) == (9, 0):
        # Liger 0.8.5 sends every call on a Hopper GPU to its CuTe kernel, which refuses all but bf16;
        # its PyTorch path (the one every other device gets) takes the float32 and float64 accepted here.
        def function(*args):
            return flsce._FusedLinearPPOFallbackFunction.apply(*args, True)

    y = y if keep is None else y.masked_fill(~keep, 0)
    masked = None
    if b is not None:
        masked = torch.isneginf(b)[y]
        b = b.to(w.dtype).clamp(min=torch.finfo(torch.float32).min / 4 * min(float(temperature), 1.0))
        h = torch.cat([h, h.new_ones(h.shape[0], 1)], dim=1)
        w = torch.cat([w, b.unsqueeze(1)], dim=1)
    nll, ent = function(h, w, y, float(temperature), _NEVER)
    logp = -nll if masked is None else (-nll).masked_fill(masked, float("-inf"))
    return (logp, ent) if keep is None else (logp.masked_fill(~keep, 0.0), ent)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         softcap=None):
    if softcap is not None and return_entropy:
        raise NotImplementedError(
            "backend 'liger': Liger's only entropy (fused linear scaled cross-entropy) has no softcap; "
            "use backend='chunked' for softcap with return_entropy=True.")
    rows = hidden.reshape(-1, hidden.shape[-1])
    target = labels.reshape(-1).long()
    dtype = kit.result_dtype(hidden.dtype)
    if rows.shape[0] == 0:  # Liger refuses empty inputs; a zero still connected to every input
        zero = hidden.sum(-1) * 0 + weight.sum() * 0 + (0 if bias is None else bias.sum() * 0)
        zero = zero.to(dtype)
        return (zero, zero.clone()) if return_entropy else zero
    if return_entropy:
        keep = None if ignore_index is None else target != ignore_index
        logp, ent = _flsce(rows, weight, bias, target, keep, temperature)
        ent = ent.to(dtype)
    else:
        logp = _flce(rows, weight, bias, target, temperature, _NEVER if ignore_index is None else ignore_index,
                     softcap)
    logp = logp.to(dtype)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if grad:
        logp = _FirstOrderOnly.apply(logp)
        if return_entropy:
            ent = _FirstOrderOnly.apply(ent)
    if return_entropy:
        return logp.reshape(labels.shape), ent.reshape(labels.shape)
    return logp.reshape(labels.shape)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="liger",
        ops={"logprobs": logprobs, "logprobs_from_hidden": logprobs_from_hidden},
        devices={"cuda", "cpu"} if _cpu_allowed() else {"cuda"},
        dtypes={torch.float32, torch.float64},
        priority=kit.Priority.KERNEL - 5,  # a fused kernel, below triton's: it copies the logits
        torch=">=2.1.2",
        requires=("liger_kernel.ops.cross_entropy", "liger_kernel.ops.fused_linear_cross_entropy",
                  "liger_kernel.ops.fused_linear_scaled_cross_entropy"),
        autograd=True,
        batch_invariant=False,  # logprobs is; logprobs_from_hidden's matmuls depend on the rows given
        copies_logits=True,
        # Triton's interpreter passes a float argument to the kernel as a Python float, which Liger's
        # `softcap.to(tl.float32)` rejects: softcap is declared only where the kernel is compiled.
        features=frozenset() if _cpu_allowed() else {"softcap"},
        description="Liger-Kernel cross_entropy and fused linear (scaled) cross-entropy, reduction='none', "
                    "float32/float64",
    ))
