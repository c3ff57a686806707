"""The distillation section of the conformance suite: ``kl_divergence`` (docs/distillation.md), for
every backend that implements it.

Values and the student's gradients are compared with float64 autograd of the reference
(:func:`logprob_registry.reference.kl_divergence`) in both directions, with a temperature, a mask,
large magnitudes and ``-inf`` entries, in float32 and bfloat16; hidden-state inputs (feature
``kl_hidden``) and support ids with and without the tail bucket (feature ``kl_support``) for the
backends that declare them. The teacher is a target: no gradient may reach it.

Tolerance. ``KL(p || q) = sum p (log p - log q)``: an fp32-accurate backend makes an error of at
most ``tol`` (:func:`logprob_registry.numerics.tolerance` of the logits, the larger of the two
sides') in each ``log p`` and ``log q``, and so in each ``p`` relatively; the KL is then off by at
most ``tol * (2 + A)`` with ``A = sum p |log p - log q|`` (the worst position's), and its gradient
with respect to the student's logits by ``4 * tol * (2 + A) * max|upstream| / T`` (as the logits
ops', with ``A`` in place of the entropy), plus one unit of the gradient's dtype.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import pytest
import torch

from logprob_registry import reference as ref
from logprob_registry.numerics import (
    EPS32,
    assert_close,
    gradient_rounding,
    hidden_magnitude,
    subnormal_spacing,
    tolerance,
)
from logprob_registry.opspec import make_input

from ..harness import Harness
from ._coverage import covers

OP = "kl_divergence"
V = 300          # no power of two
LEAD = (2, 5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (direction, temperature)
CASES = {
    "forward": ("forward", 1.0),
    "reverse": ("reverse", 1.0),
    "forward-temperature-0.5": ("forward", 0.5),
    "reverse-temperature-2.0": ("reverse", 2.0),
}
HIDDEN_VARIANTS = ("student-hidden", "teacher-hidden", "both-hidden")
TAIL_MASS = 1e-9  # test_kl_support_tail_accuracy: the mass outside the support of the sharp side


# ------------------------------------------------------------------------------------ helpers
def _draw(lp: Harness, name: str, shape: Sequence[int], dtype: torch.dtype, seed: int,
          scale: Optional[float] = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return make_input(name, shape, dtype, g, scale=scale).to(lp.device)


def _pair(lp: Harness, dtype: torch.dtype = torch.float32, lead: Sequence[int] = LEAD, vocab: int = V,
          seed: int = 0):
    """Student and teacher logits (the op table's example values, standard normal times 3)."""
    return (_draw(lp, "student", tuple(lead) + (vocab,), dtype, seed),
            _draw(lp, "teacher", tuple(lead) + (vocab,), dtype, seed + 1))


def _support(lp: Harness, lead: Sequence[int], vocab: int, k: int, seed: int = 7) -> torch.Tensor:
    """Distinct ids ``(..., k)`` per position, in random order."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    return ids.view(tuple(lead) + (k,)).to(lp.device)


def _cpu(options: Dict) -> Dict:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}


def _spread(student64: torch.Tensor, teacher64: torch.Tensor, options: Dict) -> float:
    """``A``: the largest ``sum p |log p - log q|`` over positions (inf and NaN terms left out)."""
    kw = {k: v for k, v in options.items() if k in ("direction", "temperature", "support", "tail",
                                                      "student_weight", "teacher_weight")}
    with torch.no_grad():
        log_p, log_q = ref.kl_distributions(student64, teacher64, **kw)
        terms = (log_p.exp() * (log_p - log_q).abs())
        terms = torch.where(torch.isfinite(terms), terms, torch.zeros_like(terms))
    return float(terms.sum(-1).max()) if terms.numel() else 0.0


def _tolerance(student64, teacher64, options: Dict) -> float:
    """The error allowed on one KL value (module docstring)."""
    t = options.get("temperature", 1.0)
    tols = []
    for side, name in ((student64, "student_weight"), (teacher64, "teacher_weight")):
        weight = options.get(name)
        if weight is None:
            tols.append(tolerance(side, t))
        else:
            tols.append(tolerance(weight.new_empty((1, weight.shape[0])), t,
                                  magnitude_bound=hidden_magnitude(side, weight)))
    return max(tols) * (2 + _spread(student64, teacher64, options))


def _check(lp: Harness, student: torch.Tensor, teacher: torch.Tensor, what: str, grad: bool = True,
           rtol: float = 0.0, **options) -> torch.Tensor:
    """The backend's KL (and, with ``grad``, the gradients of the student and of ``student_weight``)
    against float64 autograd of the reference on the same (already rounded) values; infinite
    reference values must be matched exactly and get no upstream gradient."""
    s_weight = options.pop("student_weight", None)
    leaves = [student.detach().clone().requires_grad_(grad)]
    if s_weight is not None:
        leaves.append(s_weight.detach().clone().requires_grad_(grad))
        options["student_weight"] = leaves[1]
    got = lp.call(OP, leaves[0], teacher, **options)[0]
    assert got.dtype == lp.result_dtype(student.dtype), f"{what}: the result is {got.dtype}"
    refs = [x.detach().cpu().double().requires_grad_(grad) for x in leaves]
    ref_options = _cpu(options)
    for name in ("student_weight", "teacher_weight"):
        if options.get(name) is not None:
            ref_options[name] = options[name].detach().cpu().double()
    if s_weight is not None:
        ref_options["student_weight"] = refs[1]
    teacher64 = teacher.detach().cpu().double()
    want = ref.kl_divergence(refs[0], teacher64, **ref_options)
    tol = _tolerance(refs[0].detach(), teacher64, ref_options)
    assert_close(got, want, tol, f"{what}: kl", rtol=max(rtol, 4 * EPS32))
    if not grad:
        return got
    up = torch.randn(tuple(want.shape), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    up = up.masked_fill(~torch.isfinite(want.detach()), 0.0)
    skip = ~torch.isfinite(got.detach())
    (got.masked_fill(skip, 0.0) * up.to(got.device, got.dtype)).sum().backward()
    want.masked_fill(~torch.isfinite(want.detach()), 0.0).mul(up).sum().backward()
    t = options.get("temperature", 1.0)
    g_tol = 4 * tol * float(up.abs().max()) / t
    rounding = gradient_rounding(student.dtype)
    for i, (leaf, r) in enumerate(zip(leaves, refs)):
        name = "student" if i == 0 else "student_weight"
        assert leaf.grad is not None, f"{what}: no gradient reached the {name}"
        if s_weight is None:
            atol = g_tol
        else:  # a sum over V (hidden) or over the rows (weight) of logits' gradients times |w| or |h|
            other = refs[1] if i == 0 else refs[0].reshape(-1, refs[0].shape[-1])
            atol = g_tol * float(other.detach().abs().sum(0).max()) * (2 + math.log(V))
        atol += subnormal_spacing(student.dtype)
        assert_close(leaf.grad, r.grad, atol, f"{what}: gradient of the {name}", rtol=rounding + 4 * EPS32)
    return got


def _directions(lp: Harness):
    """``(direction, options)``: both KLs, and the generalized JSD where the backend declares kl_jsd."""
    out = [("forward", {}), ("reverse", {})]
    if "kl_jsd" in lp.backend.features:
        out.append(("jsd", {"beta": 0.3}))
    return out


def _hidden(lp: Harness, dtype: torch.dtype, size: int, seed: int, vocab: int = V):
    """Hidden states ``LEAD + (size,)`` and a weight ``(vocab, size)`` whose logits are like the logits'."""
    h = _draw(lp, "hidden", LEAD + (size,), dtype, seed)
    w = _draw(lp, "weight", (vocab, size), dtype, seed + 1)
    return h, w


def _tail_case(lp: Harness, direction: str, k: int = 8, vocab: int = 1000):
    """Logits whose ``k`` support ids hold ``1 - TAIL_MASS`` of the mass on the side whose tail
    the KL weighs by a large ``p`` (the student for "forward", the teacher for "reverse"), the other
    side standard normal times 3 (its support holds little mass: its tail is most of it)."""
    lead = (4,)
    support = _support(lp, lead, vocab, k, seed=11)
    g = torch.Generator().manual_seed(12)
    sharp = 5.0 + 0.1 * torch.randn(lead + (vocab,), generator=g, dtype=torch.float64)
    # the rest lies log((V - k) / k / TAIL_MASS) below the support (about 25.5 here)
    gap = math.log((vocab - k) / k / TAIL_MASS)
    sharp = sharp - gap
    sharp.scatter_(-1, support.cpu(), 5.0 + 0.1 * torch.randn(lead + (k,), generator=g, dtype=torch.float64))
    broad = 3.0 * torch.randn(lead + (vocab,), generator=g, dtype=torch.float64)
    sharp, broad = sharp.float().to(lp.device), broad.float().to(lp.device)
    return (sharp, broad, support) if direction == "forward" else (broad, sharp, support)


def _naive_tail(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``log(1 - sum p)`` over the support in float32: the formula the tail must not use."""
    p = torch.softmax(logits.float(), -1).gather(-1, support.long())
    return torch.log(1 - p.sum(-1))


class DistillSection:
    """The conformance tests of ``kl_divergence``."""

    @covers(OP)
    @pytest.mark.parametrize("dtype", list(DTYPES) + ["float64"])
    @pytest.mark.parametrize("case", list(CASES))
    def test_kl_values(self, lp: Harness, case: str, dtype: str) -> None:
        """Both directions, with temperatures, in fp32, bf16 (against float64 on the same rounded
        values: fp32 accuracy, not bf16's) and fp64 (a float64 result)."""
        dt = torch.float64 if dtype == "float64" else DTYPES[dtype]
        lp.require(OP, dt, vocab=V)
        direction, temperature = CASES[case]
        s, t = _pair(lp, dt)
        _check(lp, s, t, f"{case} {dtype}", grad=False, direction=direction, temperature=temperature)

    @covers(OP, grad=True)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("case", list(CASES))
    def test_kl_gradients(self, lp: Harness, case: str, dtype: str) -> None:
        """The student's gradient against float64 autograd, in both directions, with temperatures."""
        dt = DTYPES[dtype]
        lp.require(OP, dt, grad=True, vocab=V)
        direction, temperature = CASES[case]
        s, t = _pair(lp, dt, seed=20)
        _check(lp, s, t, f"{case} {dtype}", direction=direction, temperature=temperature)

    @covers(OP, grad=True, features=("kl_jsd",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("beta", [0.25, 0.5, 0.75])
    def test_kl_jsd(self, lp: Harness, beta: float, dtype: str) -> None:
        """The generalized Jensen-Shannon divergence (TRL's GKD), values and the student's gradient
        against float64 autograd, with a temperature."""
        dt = DTYPES[dtype]
        lp.require(OP, dt, grad=True, features=("kl_jsd",), vocab=V)
        s, t = _pair(lp, dt, seed=30)
        _check(lp, s, t, f"jsd beta={beta} {dtype}", direction="jsd", beta=beta, temperature=0.8)

    @covers(OP, grad=True)
    def test_kl_teacher_gets_no_gradient(self, lp: Harness) -> None:
        """The teacher is a detached target: a teacher that requires grad gets none, and a call whose
        student does not require grad returns a result that does not either."""
        lp.require(OP, grad=True, vocab=V)
        s, t = _pair(lp, seed=30)
        for direction in ("forward", "reverse"):
            student = s.clone().requires_grad_(True)
            teacher = t.clone().requires_grad_(True)
            out = lp.call(OP, student, teacher, direction=direction)[0]
            out.sum().backward()
            assert teacher.grad is None, f"{direction}: a gradient reached the teacher"
            assert student.grad is not None, f"{direction}: no gradient reached the student"
            alone = lp.call(OP, s, t.clone().requires_grad_(True), direction=direction)[0]
            assert not alone.requires_grad, f"{direction}: the result requires grad through the teacher alone"

    @covers(OP, grad=True)
    @pytest.mark.parametrize("direction", ["forward", "reverse"])
    def test_kl_mask(self, lp: Harness, direction: str) -> None:
        """mask False gives 0 and a zero gradient, even where the KL would be infinite (a student
        ``-inf`` under a teacher's mass), and changes nothing elsewhere."""
        lp.require(OP, grad=True, vocab=V)
        s, t = _pair(lp, seed=40)
        g = torch.Generator().manual_seed(41)
        mask = (torch.rand(LEAD, generator=g) < 0.6).to(lp.device)
        mask[0, 0], mask[0, 1] = False, True
        s[0, 0, 3] = float("-inf")   # masked out: would give +inf (forward) with a finite teacher there
        t[0, 0, 5] = float("-inf")   # and +inf (reverse) where the teacher has no mass
        got = _check(lp, s, t, f"{direction} mask", direction=direction, mask=mask)
        assert bool((got[~mask] == 0).all()), f"{direction}: masked positions are not 0"
        leaf = s.clone().requires_grad_(True)
        lp.call(OP, leaf, t, direction=direction, mask=mask)[0].sum().backward()
        assert bool((leaf.grad[~mask] == 0).all()), f"{direction}: masked positions have a gradient"
        assert not bool(leaf.grad.isnan().any()), f"{direction}: NaN in the gradient"

    @covers(OP, grad=True)
    @pytest.mark.parametrize("direction", ["forward", "reverse"])
    def test_kl_large_magnitude_and_inf(self, lp: Harness, direction: str) -> None:
        """Logits of magnitude 1e4 and ``-inf`` entries: masked vocabulary on both sides (0 log 0 =
        0), on one side only (+inf where the other side has mass, 0 where it has none), finite
        gradients everywhere the KL is finite."""
        lp.require(OP, grad=True, vocab=V)
        s, t = _pair(lp, seed=50)
        s, t = s * (1e4 / 9), t * (1e4 / 9)
        s[..., :7] = float("-inf")
        t[..., :7] = float("-inf")           # a masked vocabulary
        t[1, 2, 9] = float("-inf")           # teacher without mass where the student has some
        top = int(t[0, 3].argmax())
        s[0, 3, top] = float("-inf")         # student without mass on the teacher's mode
        top = int(s[1, 4].argmax())
        t[1, 4, top] = float("-inf")         # teacher without mass on the student's mode
        got = _check(lp, s, t, f"{direction} large/-inf", direction=direction)
        infinite = (0, 3) if direction == "forward" else (1, 4)
        value = float(got.detach()[infinite])
        assert math.isinf(value) and value > 0, f"{direction}: KL at {infinite} should be +inf, got {value}"

    @covers(OP, grad=True, features=("kl_hidden",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("variant", HIDDEN_VARIANTS)
    def test_kl_hidden(self, lp: Harness, variant: str, dtype: str) -> None:
        """Either side (or both, of different hidden sizes) as hidden states with its lm_head:
        values and the gradients of the student's hidden states and weight (both directions, and
        the generalized JSD for a backend with kl_jsd); the teacher's hidden states and weight get
        none, even when they require it."""
        dt = DTYPES[dtype]
        lp.require(OP, dt, grad=True, features=("kl_hidden",), vocab=V)
        s, t = _pair(lp, dt, seed=60)
        options = {}
        if variant in ("student-hidden", "both-hidden"):
            s, options["student_weight"] = _hidden(lp, dt, 48, 61)
        if variant in ("teacher-hidden", "both-hidden"):
            t, options["teacher_weight"] = _hidden(lp, dt, 80, 63)
        for direction, extra in _directions(lp):
            _check(lp, s, t, f"{variant} {direction} {dtype}", direction=direction, temperature=0.7, **extra,
                   **options)
        if "teacher_weight" in options:
            teacher = t.clone().requires_grad_(True)
            weight = options["teacher_weight"].clone().requires_grad_(True)
            student = s.clone().requires_grad_(True)
            kw = {"student_weight": options.get("student_weight")}
            lp.call(OP, student, teacher, teacher_weight=weight, **kw)[0].sum().backward()
            assert teacher.grad is None and weight.grad is None, "a gradient reached the teacher's hidden or weight"

    @covers(OP, grad=True, features=("kl_support",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("tail", ["tail", "renormalised"])
    @pytest.mark.parametrize("direction", ["forward", "reverse"])
    def test_kl_support(self, lp: Harness, direction: str, tail: str, dtype: str) -> None:
        """Support ids ``(..., K)``: the K tokens plus the tail bucket, or renormalised over the K;
        values and gradients; a support of the whole vocabulary with its (empty) tail is the full KL."""
        dt = DTYPES[dtype]
        lp.require(OP, dt, grad=True, features=("kl_support",), vocab=V)
        s, t = _pair(lp, dt, seed=70)
        with_tail = tail == "tail"
        for k in (1, 20, V):
            support = _support(lp, LEAD, V, k)
            _check(lp, s, t, f"{direction} {tail} K={k} {dtype}", direction=direction, support=support,
                   tail=with_tail, temperature=0.9)

    @covers(OP, grad=True, features=("kl_hidden", "kl_support"))
    def test_kl_hidden_with_support(self, lp: Harness) -> None:
        """Hidden states on both sides with support ids and the tail."""
        lp.require(OP, grad=True, features=("kl_hidden", "kl_support"), vocab=V)
        s, sw = _hidden(lp, torch.float32, 48, 80)
        t, tw = _hidden(lp, torch.float32, 64, 82)
        for with_tail in (True, False):
            _check(lp, s, t, f"hidden support tail={with_tail}", student_weight=sw, teacher_weight=tw,
                   support=_support(lp, LEAD, V, 16), tail=with_tail)

    @covers(OP, grad=True, features=("kl_support",))
    @pytest.mark.parametrize("direction", ["forward", "reverse"])
    def test_kl_support_tail_accuracy(self, lp: Harness, direction: str) -> None:
        """The tail bucket where the support holds ``1 - 1e-9`` of one side's mass and the other side
        puts most of its mass outside: the KL is then dominated by ``p_tail * log(p_tail / q_tail)``
        with ``q_tail`` about 1e-9, and must match float64 within fp32 accuracy (and 1e-3 relative).

        Evidence that the formula matters: ``log(1 - sum p)`` in float32 over such a support is off
        by more than 10% (``sum p`` rounds to 1, or to 1 - 6e-8: ``-inf``, NaN, or about -16.6 for
        the true -20.7); the log-sum-exp over the complement is exact to fp32 rounding."""
        lp.require(OP, grad=True, features=("kl_support",), vocab=1000)
        s, t, support = _tail_case(lp, direction)
        sharp = s if direction == "forward" else t
        true_tail = ref.support_logprobs(sharp.cpu().double(), support.cpu())[..., -1]
        assert bool(((true_tail > math.log(TAIL_MASS) - 1) & (true_tail < math.log(TAIL_MASS) + 1)).all())
        naive = _naive_tail(sharp.cpu(), support.cpu()).double()
        off = ~torch.isfinite(naive) | ((naive - true_tail).abs() > 0.1 * true_tail.abs())
        assert bool(off.all()), "the case no longer shows log(1 - sum p) failing in float32"
        got = _check(lp, s, t, f"{direction} tail of mass 1e-9", direction=direction, support=support, rtol=1e-3)
        assert bool(torch.isfinite(got).all()) and bool((got > 5).all()), (
            f"{direction}: the KL should be dominated by the tail's 20 nats, got {got.tolist()}")

    @covers(OP, capability="batch_invariant", declared=True)
    def test_kl_batch_invariant(self, lp: Harness) -> None:
        """A position's KL is bitwise the same alone, in a sub-batch and in the whole batch, and
        under another leading shape (logits; hidden states too with kl_hidden, support ids with
        kl_support; the generalized JSD too with kl_jsd)."""
        lp.require(OP, vocab=V)
        lp.require_capability("batch_invariant", "batch invariance")
        s, t = _pair(lp, lead=(12,), seed=90)
        cases = {"logits": ({}, s, t)}
        if "kl_support" in lp.backend.features:
            cases["support"] = ({"support": _support(lp, (12,), V, 10)}, s, t)
        if "kl_hidden" in lp.backend.features:
            h = _draw(lp, "hidden", (12, 48), torch.float32, 91)
            w = _draw(lp, "weight", (V, 48), torch.float32, 92)
            cases["hidden"] = ({"student_weight": w}, h, t)
        for name, (options, student, teacher) in cases.items():
            for direction, extra in _directions(lp):
                both = dict(options, **extra)

                def call(rows, _o=both, _s=student, _t=teacher, _d=direction):  # noqa: B006 - read only
                    o = {k: (v[rows] if k == "support" else v) for k, v in _o.items()}
                    return lp.call(OP, _s[rows], _t[rows], direction=_d, **o)[0]

                whole = call(slice(0, 12))
                for what, rows in {"row 0 alone": slice(0, 1), "row 11 alone": slice(11, 12),
                                   "rows 3..7": slice(3, 8)}.items():
                    assert torch.equal(call(rows), whole[rows]), (
                        f"{name} {direction}: {what} differs from the same rows in a batch of 12")
                o = {k: (v.view(3, 4, -1) if k == "support" else v) for k, v in options.items()}
                shaped = lp.call(OP, student.view(3, 4, -1), teacher.view(3, 4, -1), direction=direction, **extra,
                                 **o)[0]
                assert torch.equal(shaped.reshape(-1), whole), f"{name} {direction}: a (3, 4) batch differs from (12,)"
