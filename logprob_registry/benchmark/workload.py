"""The measured work, as a child process sees it: the inputs, one call of a method (a backend or the
textbook baseline), and the largest difference from a float64 reference."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from .. import reference as ref
from .settings import REFERENCE_CHUNK_ELEMENTS, Setting

BASELINE = "baseline"
BASELINE_DESCRIPTION = ("the textbook formula in the input dtype: log_softmax + gather, and -sum(p * log p) "
                        "for the entropy (the seeds' starting point)")


def _baseline_logprobs(x, labels):
    return x.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _baseline_entropy(x):
    logp = x.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def _baseline_both(x, labels):
    logp = x.log_softmax(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def method(s: Setting, name: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """``f(logits, labels)`` running ``s.op`` through backend ``name``, or the baseline."""
    if name == BASELINE:
        return {
            "logprobs": _baseline_logprobs,
            "entropy": lambda x, labels: _baseline_entropy(x),
            "logprobs_and_entropy": _baseline_both,
        }[s.op]
    import logprob_registry as lr

    ip = s.inplace_backward
    return {
        "logprobs": lambda x, labels: lr.logprobs_from_logits(x, labels, backend=name, inplace_backward=ip),
        "entropy": lambda x, labels: lr.entropy_from_logits(x, backend=name),
        "logprobs_and_entropy": lambda x, labels: lr.logprobs_and_entropy(
            x, labels, backend=name, inplace_backward=ip),
    }[s.op]


def outputs(result: object) -> Tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)  # type: ignore[arg-type]


class Workload:
    """The inputs of one setting and how to run a method on them once.

    In backward mode each call gets a fresh gradient (and, for in-place backward, a fresh copy of
    the logits made before the clock starts); the loss is the sum of every output.
    """

    def __init__(self, s: Setting, name: str) -> None:
        self.s = s
        self.fn = method(s, name)
        device = torch.device(s.device)
        dtype = getattr(torch, s.dtype)
        gen = torch.Generator(device="cpu").manual_seed(s.seed)
        b, t, v = s.shape
        # Made on the CPU from a seeded generator so every device sees the same numbers, then moved.
        self.base = torch.randn(b, t, v, generator=gen, dtype=dtype).mul_(3.0).to(device)
        labels = torch.randint(0, v, (b, t), generator=gen).to(device)
        self.labels = labels[:, 1:] if s.sliced else labels
        self.leaf: Optional[torch.Tensor] = None
        if s.backward and not s.inplace_backward:
            self.base.requires_grad_(True)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, :-1] if self.s.sliced else t

    @property
    def logits(self) -> torch.Tensor:
        """The logits the methods see (no autograd history)."""
        return self.view(self.base.detach())

    def prepare(self) -> torch.Tensor:
        """The input of the next call; everything not part of the method's work happens here."""
        if not self.s.backward:
            return self.logits
        if self.s.inplace_backward:
            self.leaf = self.base.detach().clone().requires_grad_(True)
        else:
            self.base.grad = None
            self.leaf = self.base
        return self.view(self.leaf)

    def run(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if not self.s.backward:
            with torch.no_grad():
                return outputs(self.fn(x, self.labels))
        outs = outputs(self.fn(x, self.labels))
        sum(o.float().sum() for o in outs).backward()
        return tuple(o.detach() for o in outs)

    def grad(self) -> Optional[torch.Tensor]:
        """The gradient of the last backward call, as seen by the logits view."""
        if self.leaf is None or self.leaf.grad is None:
            return None
        return self.view(self.leaf.grad)

    def release(self) -> None:
        if self.leaf is not None:
            self.leaf.grad = None
        self.leaf = None


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _reference(op: str, x: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    if op == "logprobs":
        return (ref.logprobs(x, labels),)
    if op == "entropy":
        return (ref.entropy(x),)
    return tuple(ref.logprobs_and_entropy(x, labels))


def max_differences(
    s: Setting, logits: torch.Tensor, labels: torch.Tensor,
    outs: Tuple[torch.Tensor, ...], grad: Optional[torch.Tensor],
) -> Tuple[float, Optional[float]]:
    """Largest absolute difference of the outputs (and of the gradient of their sum, if given)
    from float64 autograd of the reference, computed over chunks of rows to bound the memory."""
    ref_device = logits.device if logits.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    b, t, v = logits.shape
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // v)
    value_diff, grad_diff = 0.0, 0.0
    for i in range(b):
        for t0 in range(0, t, rows):
            idx = (i, slice(t0, t0 + rows))
            x = logits[idx].to(ref_device, torch.float64)
            if grad is not None:
                x.requires_grad_(True)
            expected = _reference(s.op, x, labels[idx].to(ref_device))
            for got, want in zip(outs, expected):
                d = (got[idx].to(ref_device, torch.float64) - want.detach()).abs().max().item()
                value_diff = _worse(value_diff, d)
            if grad is not None:
                sum(e.sum() for e in expected).backward()
                d = (grad[idx].to(ref_device, torch.float64) - x.grad).abs().max().item()
                grad_diff = _worse(grad_diff, d)
    return value_diff, (grad_diff if grad is not None else None)
