"""The accuracy contract: how close a backend's result must be to the float64 reference (the op
table's ground truth, :meth:`logprob_registry.opspec.OpSpec.ground_truth`), and the comparison
itself. The conformance suite, ``bench``, ``tune`` and ``parity`` judge by it.

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
unit of the gradient's own dtype (a bf16 gradient is rounded to bf16; :func:`gradient_rounding`).

The fused op (``logprobs_from_hidden``)
---------------------------------------
Its logits ``z = hidden @ weight.T + bias`` are not at hand. Each is a dot product of ``H``
terms, which float32 accumulation forms within ``c * eps * B_v`` of the exact value, with
``B_v = sum_k |h_k * w_vk| + |b_v|`` the sum of the absolute terms (bf16 and fp16 products are
exact in float32; ``c`` is about ``log2 H`` for the blocked and pairwise sums of BLAS, and random
roundings do far better). ``B``, the largest ``B_v`` (:func:`hidden_magnitude`), bounds both the
logits' magnitude and the error of forming them, so it takes the place of ``M`` above and the
tolerance of the logits ops applies unchanged (:func:`hidden_tolerances`). Entries that are
compared exactly are left out of ``B``: a bias of ``-inf`` (a masked vocabulary entry) and NaN.

A gradient of the fused op is a sum of terms ``dhidden[n, k] = sum_v g[n, v] * w[v, k]``,
``dweight[v, k] = sum_n g[n, v] * h[n, k]``, ``dbias[v] = sum_n g[n, v]``, where ``g`` is the
gradient of the loss with respect to the logits. With upstream gradients ``a`` on the
log-probability and ``c`` on the entropy of a row, ``g_v = (a * (onehot_v - p_v) - c * p_v *
(log p_v + H)) / T``. An error ``tol`` in ``log p_v`` (and ``H``) moves ``p_v`` by ``p_v * tol``,
so ``g_v`` is off by at most ``tol * G_v`` with ``G_v = (|a| + |c| * (2 + H + |log p_v|)) * p_v / T``
(:func:`logits_gradient_scale`): an error relative to ``p_v``, not to ``g_v``, which vanishes
where ``log p_v = -H`` while its error does not. The sums then add float32 rounding and the
rounding to the gradient's dtype ``r`` (:func:`gradient_rounding`). So an element may be off by
``4 * tol`` times the sum of ``G`` and ``|g|`` over its terms, plus ``2 * r`` times the sum of
``|g|`` over its terms (each term weighted by ``|w|`` or ``|h|``), plus one step of the dtype's
subnormal numbers (an fp16 gradient that underflows its normal range, below 6e-5, is rounded to
steps of 6e-8; :func:`subnormal_spacing`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

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
               magnitude_bound: Optional[float] = None, options: Optional[Mapping[str, Any]] = None) -> tuple:
    """The tolerance of each output of ``op`` (those a call with ``options`` returns, as the op table
    names them), in the order the op returns them: by each output's ``judged_as`` in the op table, an
    entropy's, or a log-probability's (the values of ``topk_logprobs`` too)."""
    from .opspec import get

    spec = get(op)
    return tuple(tolerance(logits, temperature, magnitude_bound,
                           "entropy" if spec.result(name).judged_as == "entropy" else "logprobs")
                 for name in spec.output_names(options))


def gradient_rounding(dtype: torch.dtype) -> float:
    """The relative error allowed for rounding a gradient to ``dtype``: one unit of ``dtype``
    (``eps``), at least four units of float32 (a float64 gradient is judged at float32 accuracy,
    which is the contract)."""
    return max(torch.finfo(dtype).eps, 4 * EPS32) if dtype != torch.float64 else 4 * EPS32


def subnormal_spacing(dtype: torch.dtype) -> float:
    """The step between ``dtype``'s subnormal numbers (6e-8 for float16): the absolute error of a
    result rounded to ``dtype`` below its normal range."""
    info = torch.finfo(dtype)
    return float(info.tiny) * float(info.eps)


def logits_gradient_scale(logits: torch.Tensor, temperature: float = 1.0,
                          up_logprobs: Optional[torch.Tensor] = None,
                          up_entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``G`` (module docstring): for each logit, the scale of the error an fp32-accurate backend
    makes in the gradient of ``sum(up_logprobs * logprobs + up_entropy * entropy)`` with respect
    to it. ``logits`` (..., V) are exact (float64, ``-inf`` allowed); the upstream gradients have
    the logits' leading shape (0 at ignored positions), None for an output not in the loss."""
    logp = torch.log_softmax(logits.detach().double() / temperature, -1)
    p = logp.exp()
    p_logp = torch.where(p > 0, p * logp, torch.zeros_like(p))  # 0 * log 0 = 0
    scale = torch.zeros_like(p)
    if up_logprobs is not None:
        scale = scale + up_logprobs.detach().double().abs().unsqueeze(-1) * p
    if up_entropy is not None:
        entropy = -p_logp.sum(-1, keepdim=True)
        scale = scale + up_entropy.detach().double().abs().unsqueeze(-1) * (p * (2 + entropy) + p_logp.abs())
    return scale / temperature


def hidden_magnitude(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> float:
    """``B``: the largest ``sum_k |hidden[n, k] * weight[v, k]| + |bias[v]|``, which bounds the fused
    op's logits and the error of forming them (module docstring). NaN and infinite inputs count
    as 0: what they produce is compared exactly."""
    def finite(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu", torch.float64)
        return torch.where(torch.isfinite(t), t, torch.zeros_like(t)).abs()

    h = finite(hidden).reshape(-1, hidden.shape[-1])
    bound = h @ finite(weight).T
    if bias is not None:
        bound = bound + finite(bias)
    return float(bound.max()) if bound.numel() else 0.0


def hidden_tolerances(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      temperature: float = 1.0) -> tuple:
    """The tolerances of ``logprobs_from_hidden``'s log-probabilities and entropy: those of the
    logits ops over ``V = weight.shape[0]`` with :func:`hidden_magnitude` as the magnitude."""
    return tolerances("logprobs_and_entropy", weight.new_empty((1, weight.shape[0])), temperature,
                      magnitude_bound=hidden_magnitude(hidden, weight, bias))


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
            "logprob_registry.numerics")


def _first(mask: torch.Tensor) -> tuple:
    index = mask.nonzero()
    return tuple(int(i) for i in index[0]) if index.numel() else ()
