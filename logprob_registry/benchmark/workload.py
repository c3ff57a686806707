"""The measured work, as a child process sees it: the inputs, one call of a method (a backend or the
textbook baseline), and the largest difference from a float64 reference.

Everything here is driven by the op table: the inputs are the op's example inputs
(:meth:`~logprob_registry.opspec.OpSpec.example`), a backend is called through the op's public
function, the reference is the op's ground truth (:meth:`~logprob_registry.opspec.OpSpec.ground_truth`),
and the baseline reduces the op's logits (given, or ``hidden @ weight.T``) to each of its outputs.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from ..opspec import INPUTS, OpSpec
from .settings import REFERENCE_CHUNK_ELEMENTS, Setting

BASELINE = "baseline"


def baseline_description(spec: OpSpec, short: bool = False) -> str:
    """What the baseline does for ``spec``'s op (``short``: for a table's heading)."""
    form = "hidden @ weight.T, then " if "logits" not in spec.inputs else ""
    if short:
        return f"{form}the textbook formula in the input dtype"
    return (f"the textbook formula in the input dtype: {form}log_softmax + gather, and -sum(p * log p) "
            "for the entropy (the seeds' starting point)")


def op_logits(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The logits an op reduces: its ``logits`` input, or ``hidden @ weight.T`` formed in the
    inputs' dtype (what a trainer does without the fused op)."""
    if "logits" in inputs:
        return inputs["logits"]
    return inputs["hidden"] @ inputs["weight"].T


#: Each output an op may return, from the log-softmax of its logits: the textbook formulas.
TEXTBOOK: Dict[str, Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = {
    "logprobs": lambda logp, labels: logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
    "entropy": lambda logp, labels: -(logp.exp() * logp).sum(-1),
}


def baseline(inputs: Mapping[str, torch.Tensor], outputs: Tuple[str, ...]) -> Tuple[torch.Tensor, ...]:
    logp = op_logits(inputs).log_softmax(-1)
    return tuple(TEXTBOOK[o](logp, inputs.get("labels")) for o in outputs)


def reference(s: Setting, inputs: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The outputs of ``s``'s call in float64: the op table's ground truth (inputs already float64)."""
    return s.spec.ground_truth(*(inputs[n] for n in s.spec.inputs), **s.options)


def method(s: Setting, name: str) -> Callable[[Mapping[str, torch.Tensor]], Tuple[torch.Tensor, ...]]:
    """``f(inputs)`` running ``s.op`` through backend ``name`` (its public function, with
    ``backend=name``), or the baseline; the outputs as a tuple."""
    spec, outputs = s.spec, s.outputs
    if name == BASELINE:
        return lambda inputs: baseline(inputs, outputs)
    public, options = spec.public(), s.options

    def call(inputs: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        result = public(*(inputs[n] for n in spec.inputs), backend=name, **options)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    return call


class Workload:
    """The inputs of one setting and how to run a method on them once.

    The inputs are the op's example inputs for the setting's shape, dtype, device and seed (made on
    the CPU from one seeded generator, so every device sees the same numbers, then moved). In
    backward mode each call gets fresh gradients (and, for in-place backward, fresh copies of the
    inputs made before the clock starts); the loss is the sum of every output.
    """

    def __init__(self, s: Setting, name: str) -> None:
        self.s = s
        self.fn = method(s, name)
        example = s.spec.example(s.shape, s.torch_dtype, s.device, seed=s.seed, hidden_size=s.hidden_size)
        self.base: Dict[str, torch.Tensor] = dict(example.inputs)
        self.leaves: Dict[str, torch.Tensor] = {}
        if not s.inplace_backward:
            for n in s.grad_inputs:
                self.base[n].requires_grad_(True)

    def view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What the methods see of input ``name``: with ``--slice``, ``[:, :-1]`` (labels ``[:, 1:]``)."""
        if not (self.s.sliced and INPUTS[name].per_token):
            return t
        return t[:, 1:] if name == "labels" else t[:, :-1]

    @property
    def inputs(self) -> Dict[str, torch.Tensor]:
        """The inputs the methods see (no autograd history)."""
        return {n: self.view(n, t.detach()) for n, t in self.base.items()}

    def prepare(self) -> Dict[str, torch.Tensor]:
        """The inputs of the next call; everything not part of the method's work happens here."""
        if not self.s.backward:
            return self.inputs
        leaves = {}
        for n in self.s.grad_inputs:
            if self.s.inplace_backward:
                leaves[n] = self.base[n].detach().clone().requires_grad_(True)
            else:
                self.base[n].grad = None
                leaves[n] = self.base[n]
        self.leaves = leaves
        return {n: self.view(n, leaves.get(n, t.detach())) for n, t in self.base.items()}

    def run(self, x: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        if not self.s.backward:
            with torch.no_grad():
                return self.fn(x)
        outs = self.fn(x)
        sum(o.float().sum() for o in outs).backward()
        return tuple(o.detach() for o in outs)

    def grads(self) -> Dict[str, torch.Tensor]:
        """The gradients of the last backward call, as the methods' views see them."""
        return {n: self.view(n, leaf.grad) for n, leaf in self.leaves.items() if leaf.grad is not None}

    def release(self) -> None:
        for leaf in self.leaves.values():
            leaf.grad = None
        self.leaves = {}


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _max_abs(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> float:
    return (got.to(device, torch.float64) - want).abs().max().item() if want.numel() else 0.0


def max_differences(
    s: Setting, inputs: Mapping[str, torch.Tensor], outs: Tuple[torch.Tensor, ...],
    grads: Optional[Mapping[str, torch.Tensor]] = None,
) -> Tuple[float, Dict[str, float]]:
    """Largest absolute difference of the outputs (and of the gradients of their sum, for each
    input in ``grads``) from float64 autograd of the reference.

    Computed over chunks of rows of the per-token inputs, so that the float64 logits of a chunk
    hold at most :data:`REFERENCE_CHUNK_ELEMENTS` elements; an input shared by every row (the
    weight) is converted once, and its gradient accumulated over the chunks.
    """
    grads = dict(grads or {})
    any_input = next(iter(inputs.values()))
    ref_device = any_input.device if any_input.device.type != "mps" else torch.device("cpu")  # MPS: no float64
    per_token = [n for n in inputs if INPUTS[n].per_token]
    shared = {n: inputs[n].to(ref_device, torch.float64 if not INPUTS[n].integer else inputs[n].dtype)
              .requires_grad_(n in grads) for n in inputs if n not in per_token}
    b, t = inputs[per_token[0]].shape[:2]
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // s.shape[2])
    value_diff = 0.0
    grad_diff = {n: 0.0 for n in grads}
    for i in range(b):
        for t0 in range(0, t, rows):
            idx = (i, slice(t0, t0 + rows))
            chunk = dict(shared)
            for n in per_token:
                x = inputs[n][idx].to(ref_device)
                if not INPUTS[n].integer:
                    x = x.to(torch.float64).requires_grad_(n in grads)
                chunk[n] = x
            expected = reference(s, chunk)
            for got, want in zip(outs, expected):
                value_diff = _worse(value_diff, _max_abs(got[idx], want.detach(), ref_device))
            if grads:
                sum(e.sum() for e in expected).backward()
                for n in per_token:
                    if n in grads:
                        grad_diff[n] = _worse(grad_diff[n], _max_abs(grads[n][idx], chunk[n].grad, ref_device))
    for n, x in shared.items():
        if n in grads:
            grad_diff[n] = _worse(grad_diff[n], _max_abs(grads[n], x.grad, ref_device))
    return value_diff, grad_diff

