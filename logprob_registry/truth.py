"""The op table's ground truth, for backends: its functions, and a logits op's outputs by them.

- :func:`reference_outputs`: a logits op's outputs by the op table's reference formulas, in the
  ops' result dtype, for a backend's degenerate inputs (nothing to chunk or compile for);
- :func:`reference_function`: the function computing an op's ground truth (the op table's
  ``reference=``, :mod:`logprob_registry.reference`), which takes a ``dtype=``: ``naive`` runs it
  in the result dtype, the fused kernels' double backward recomputes through it.

Backends reach these through :mod:`logprob_registry.kit`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .dtypes import result_dtype
from .opspec import OPS, logits_op


def reference_outputs(logits: torch.Tensor, labels: Optional[torch.Tensor], *, temperature: float,
                      ignore_index: Optional[int], want_logprobs: bool, want_entropy: bool, **sampler):
    """What the logits op returning ``want_logprobs``/``want_entropy`` returns (the op table's
    ground truth of that op, :meth:`~logprob_registry.opspec.OpSpec.ground_truth`), in the ops'
    result dtype: for backends' degenerate inputs (nothing to chunk or compile for)."""
    spec = logits_op(want_logprobs, want_entropy)
    given = dict(temperature=temperature, ignore_index=ignore_index, **sampler)
    out = spec.ground_truth(*(logits, labels)[: len(spec.inputs)], dtype=result_dtype(logits.dtype),
                            **spec.options_of(given))
    return out if len(out) > 1 else out[0]


def reference_function(op: str) -> Callable[..., Any]:
    """The function of :mod:`logprob_registry.reference` computing ``op``'s ground truth (the op
    table's ``reference=``): the op's inputs and options, and ``dtype=`` (float64 by default) to
    compute in."""
    return OPS[op].reference_function()
