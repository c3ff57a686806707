"""How close a backend's result must be to the float64 reference, and the comparison itself.

Tolerance
---------
Every backend must be as accurate as one that rounds to float32 at each step; the error of bf16
arithmetic (about 1e-2 nats) must fail. For one row of ``V`` logits of magnitude at most ``M`` and
a temperature ``T``, a float32 computation of ``log_softmax(x / T)[y] = x_y / T - m - log(S)``,
with ``m`` the row's maximum and ``S = sum(exp(x / T - m))``, makes these errors, with
``eps = 2**-23`` (float32 machine epsilon):

* dividing by ``T`` and subtracting ``m``: about ``eps * M / T`` each;
* the sum ``S`` of ``V`` terms in ``[0, 1]``: a relative error of about ``eps * sqrt(V)`` when
  accumulated in blocks (a random walk over the sequential part; a pairwise sum does better, a
  worst case does worse), which ``log`` turns into that absolute error. This is what torch's own
  float32 ``log_softmax`` makes on the CPU: 3e-5 (250 eps) at V = 262144, where ``eps * log(V)``
  alone would allow only 1.5e-6;
* the logarithm, the final subtraction and the rescaling steps of an online softmax: a few ``eps``
  each.

So ``|error| <= c * eps * (M / T + sqrt(V) + 1)`` with ``c = 8`` (:data:`TOLERANCE_FACTOR`): 5e-5
for logits of a few units over V = 1000, 200 times below bf16 arithmetic. The entropy
``H = -sum(p * log p)`` carries the error of ``log(S)`` once per nat of entropy, since each
``p = exp(log p)`` inherits it: its tolerance is the above times ``1 + log(V)`` (``H <= log V``).
Inputs in float16 or bfloat16 are compared with the reference computed from the very same
(already rounded) values in float64, so only the backend's arithmetic is judged, not the rounding
of its inputs.

For gradients, ``d logp_y / dx_i = (onehot_i - p_i) / T`` and the entropy's gradient is
``-p_i * (log p_i + H) / T``: each element's error is ``p_i`` times the errors above, divided by
``T``, so a gradient must be within ``4 * tol * max|upstream| / T``, plus a relative error of one
unit of the gradient's own dtype (a bf16 gradient is rounded to bf16).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

EPS32 = torch.finfo(torch.float32).eps
TOLERANCE_FACTOR = 8.0


def magnitude(x: torch.Tensor) -> float:
    """The largest finite ``|x|`` (0 for an empty or all-infinite tensor)."""
    finite = x.detach()[torch.isfinite(x.detach())]
    return float(finite.abs().max()) if finite.numel() else 0.0


def tolerance(logits: torch.Tensor, temperature: float = 1.0, magnitude_bound: Optional[float] = None,
              output: str = "logprobs") -> float:
    """The largest error allowed on a log-probability (``output="entropy"``: an entropy) of these
    logits; see the module docstring for the derivation.

    ``magnitude_bound`` replaces ``max|logits|`` where the logits are not at hand, as for the fused
    op, whose logits ``hidden @ weight.T`` are bounded by ``max(|hidden| @ |weight|.T)``.
    """
    m = magnitude(logits) if magnitude_bound is None else magnitude_bound
    vocab = max(int(logits.shape[-1]), 1)
    tol = TOLERANCE_FACTOR * EPS32 * (m / temperature + math.sqrt(vocab) + 1.0)
    return tol * (1.0 + math.log(vocab)) if output == "entropy" else tol


def tolerances(op: str, logits: torch.Tensor, temperature: float = 1.0,
               magnitude_bound: Optional[float] = None) -> tuple:
    """The tolerance of each output of ``op``, in the order the op returns them."""
    kinds = {"logprobs": ("logprobs",), "entropy": ("entropy",),
             "logprobs_and_entropy": ("logprobs", "entropy")}[op]
    return tuple(tolerance(logits, temperature, magnitude_bound, k) for k in kinds)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str, rtol: float = 0.0) -> None:
    """``actual`` matches the float64 ``expected``: same shape, infinities and NaN in the same
    places, and finite values within ``atol + rtol * |expected|``. The message names the worst
    element, its error and the tolerance."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        where = _first(nan_a != nan_e)
        raise AssertionError(
            f"{what}: NaN mismatch at {where}: got {a[where].item()}, expected {e[where].item()} "
            "(NaN must propagate to exactly the positions where the reference has NaN)")
    inf_e = torch.isinf(e)
    if not torch.equal(torch.isinf(a), inf_e) or not torch.equal(a[inf_e], e[inf_e]):
        where = _first((torch.isinf(a) != inf_e) | (inf_e & (a != e)))
        raise AssertionError(f"{what}: infinity mismatch at {where}: got {a[where].item()}, expected {e[where].item()}")
    finite = ~(nan_e | inf_e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    allowed = atol + rtol * torch.where(finite, e.abs(), torch.zeros_like(e))  # no 0 * inf = NaN at infinities
    bad = err > allowed
    if bool(bad.any()):
        where = _first(err - allowed == (err - allowed).max())
        raise AssertionError(
            f"{what}: max error {err.max().item():.3g} exceeds the tolerance "
            f"{allowed[where].item():.3g} (worst at {where}: got {a[where].item()!r}, "
            f"expected {e[where].item()!r}); the contract is float32 accuracy, see "
            "logprob_registry.testing.numerics")


def _first(mask: torch.Tensor) -> tuple:
    index = mask.nonzero()
    return tuple(int(i) for i in index[0]) if index.numel() else ()
