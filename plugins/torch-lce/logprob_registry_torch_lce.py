"""``torch-lce`` and ``torch-lce-chunked``: ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13)
as ``logprobs_from_hidden`` backends, on its reference path (``options=None``) and on its chunked
path (``options=torch.nn.LinearCrossEntropyOptions()``, which never forms the ``(N, V)`` logits).

The log-probability is ``-loss`` with ``reduction="none"``; ``ignore_index`` is torch's own. What the
adapter adds: hidden states flattened to ``(N, H)``; a temperature applied as ``hidden / T`` and
``bias / T`` in float32 or float64 (one rounding of the input, within the float32 contract; torch's
function has none); results in float32 (float64 for float64).

What they cannot do, declared or raised:

* no entropy: ``return_entropy=True`` raises NotImplementedError (cross-entropy gives only the
  label's term), so the suite's entropy cases fail for these backends;
* float32 and float64 only: torch returns a bf16/fp16 loss for bf16/fp16 inputs (3e-2 nats of error
  measured by the suite);
* the chunked path computes its gradient in the forward pass, so it refuses double backward.
"""

import torch

import logprob_registry as lr
from logprob_registry import kit


def _make(chunked: bool):
    name = "torch-lce-chunked" if chunked else "torch-lce"

    def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
        if return_entropy:
            raise NotImplementedError(f"backend {name!r}: torch.nn.functional.linear_cross_entropy gives no "
                                      "entropy; use backend='chunked' for return_entropy=True")
        h = hidden.reshape(-1, hidden.shape[-1])
        b = bias
        if temperature != 1.0:
            h, b = h / temperature, (None if bias is None else bias / temperature)
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        if chunked:
            kw["options"] = torch.nn.LinearCrossEntropyOptions()
        loss = torch.nn.functional.linear_cross_entropy(h, weight, labels.reshape(-1).long(), linear_bias=b,
                                                        reduction="none", **kw)
        return (-loss).to(kit.result_dtype(hidden.dtype)).reshape(labels.shape)

    return logprobs_from_hidden


def _available(environment, device_type):
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch >= 2.13)"
    return None


@lr.hookimpl
def register_backends(register):
    for chunked in (False, True):
        register(lr.Backend(
            name="torch-lce-chunked" if chunked else "torch-lce",
            ops={"logprobs_from_hidden": _make(chunked)},
            devices={"cpu", "cuda"},
            dtypes={torch.float32, torch.float64},
            priority=kit.Priority.EXPLICIT_ONLY,  # chosen by name: no entropy, so never the automatic choice
            torch=">=2.13",
            available=_available,
            autograd=True,
            batch_invariant=False,
            copies_logits=not chunked,
            description="torch.nn.functional.linear_cross_entropy, reduction='none'"
                        + (", chunked (LinearCrossEntropyOptions)" if chunked else ", reference path"),
        ))
