"""``npu``: Ascend NPU through ``torch_npu.npu_cross_entropy_loss(..., reduction="none")``.

verl computes log-probabilities on Ascend the same way (``-loss`` of the fused cross-entropy).
The fused op alone does not honour this library's contract, so its gaps are covered here:

- fp32 results: the op returns the loss in the input's dtype, so the logits are cast to float32
  first (bf16 arithmetic would cost ~1e-2 nats);
- temperature: the op has none, so the float32 logits are divided by it;
- strided input: the op takes a 2-D ``[N, V]`` tensor, so the leading dims are flattened (a copy
  when they cannot be viewed as one);
- ignore_index: the op ignores only a label in ``[0, V)`` and treats a negative one as "none", so
  ignored positions get label 0 for the op and their result is zeroed here (zero gradient too);
- int32 labels (the op takes int64) and more than 200000 rows (the op's documented limit: the rows
  go through in slices).

Memory: the op keeps a full ``[N, V]`` log-prob buffer for its backward, and the cast makes a
float32 copy of the logits unless they already are contiguous float32 at temperature 1. That is
what ``memory`` declares. Its priority (15) is above ``chunked`` (10): on an NPU it is the default;
a caller short of memory forces ``chunked`` with ``use_backend("chunked")`` or
``LOGPROB_REGISTRY_BACKEND=chunked``.

Not run on Ascend hardware here (docs/hardware.md): its eligibility is tested with a stand-in
``torch_npu`` and its gap-covering with a test double of the op's documented semantics.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

import logprob_registry as lr
from logprob_registry import kit

MAX_ROWS = 200_000  # torch_npu documents N in (0, 200000] for npu_cross_entropy_loss
OP = "npu_cross_entropy_loss"


def logprobs_with(
    cross_entropy: Callable, logits: torch.Tensor, labels: torch.Tensor, *,
    temperature: float, ignore_index: Optional[int],
) -> torch.Tensor:
    """Log-probabilities through ``cross_entropy`` (``torch_npu.npu_cross_entropy_loss`` or a test
    double with its documented semantics), with this library's contract on top."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    x = flat.to(torch.float32).contiguous()
    if temperature != 1.0:
        owned = x.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
        x = x.div_(temperature) if owned else x / temperature  # the caller's logits stay untouched
    target = labels.reshape(-1).to(torch.int64)
    ignored = None
    if ignore_index is not None:
        ignored = target == ignore_index
        target = target.masked_fill(ignored, 0)  # never handed to the op as an index
    if x.shape[0] == 0:
        return x.new_zeros(lead)
    pieces = []
    for start in range(0, x.shape[0], MAX_ROWS):
        loss = cross_entropy(x[start:start + MAX_ROWS], target[start:start + MAX_ROWS], reduction="none")[0]
        pieces.append(loss)
    out = -(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    if ignored is not None:
        out = out.masked_fill(ignored, 0.0)
    return out.reshape(lead)


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    import torch_npu

    return logprobs_with(
        getattr(torch_npu, OP), logits, labels, temperature=temperature, ignore_index=ignore_index
    )


def available(env, device_type: str) -> Optional[str]:
    """A torch_npu too old to have the fused op is refused (checked only once torch_npu is loaded)."""
    module = sys.modules.get("torch_npu")
    if module is not None and not hasattr(module, OP):
        version = getattr(env, "torch_npu_version", None) or "installed"
        return f"torch_npu {version} has no {OP}; upgrade torch_npu"
    return None


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(
        name="npu",
        ops={"logprobs": logprobs},
        devices={"npu"},
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        priority=kit.Priority.VENDOR_OP,
        requires=("torch_npu",),
        autograd=True,
        available=available,
        inplace_backward=False,
        batch_invariant=False,  # not verified on hardware
        deterministic=False,  # not verified on hardware
        copies_logits=True,
        memory="full-vocab buffer: keeps a float32 [N, V] log-prob buffer for backward, plus a float32 "
               "copy of the logits unless they are contiguous float32 at temperature 1",
        description="torch_npu.npu_cross_entropy_loss(reduction='none') on float32 logits, with "
                    "temperature, ignore_index and strides handled around it; not run on Ascend here",
    ))
