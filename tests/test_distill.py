"""``kl_divergence`` through the public API, independent of backends: the reference's formulas,
the errors for bad input (raised before any backend runs), and what the teacher receives. The
numerical contract of every backend is the conformance suite's distillation section
(``logprob_registry/testing/sections/distill.py``)."""

import math

import pytest
import torch
import torch.nn.functional as F

import logprob_registry as lr
from logprob_registry import reference as ref

V = 50


def _pair(lead=(3, 4), vocab=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(lead + (vocab,), generator=g), 3 * torch.randn(lead + (vocab,), generator=g)


# ------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_reference_is_torch_kl_div(direction):
    s, t = (x.double() for x in _pair())
    p, q = (t, s) if direction == "forward" else (s, t)
    expected = F.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    got = ref.kl_divergence(s, t, direction=direction)
    torch.testing.assert_close(got, expected)
    tempered = ref.kl_divergence(s, t, direction=direction, temperature=2.0)
    torch.testing.assert_close(tempered, ref.kl_divergence(s / 2, t / 2, direction=direction))


def test_reference_hidden_is_the_logits_of_the_weight():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(V, 8, generator=g, dtype=torch.float64)
    t = torch.randn(3, V, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ref.kl_divergence(h, t, student_weight=w), ref.kl_divergence(h @ w.T, t))
    torch.testing.assert_close(ref.kl_divergence(t, h, teacher_weight=w), ref.kl_divergence(t, h @ w.T))


def test_reference_support_buckets():
    s, t = (x.double() for x in _pair(seed=2))
    support = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:7] for i in range(12)])
    support = support.view(3, 4, 7)
    logp = ref.support_logprobs(s, support)
    full = s.log_softmax(-1)
    torch.testing.assert_close(logp[..., :7], full.gather(-1, support))
    rest = torch.ones_like(s, dtype=torch.bool).scatter(-1, support, False)
    torch.testing.assert_close(logp[..., 7], torch.log((full.exp() * rest).sum(-1)))
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3, 4, dtype=torch.float64))
    renormalised = ref.support_logprobs(s, support, tail=False)
    torch.testing.assert_close(renormalised, s.gather(-1, support).log_softmax(-1))
    # the whole vocabulary as support: the full KL, with an empty tail (no NaN in the gradient)
    everything = torch.arange(V).expand(3, 4, V)
    leaf = s.clone().requires_grad_(True)
    out = ref.kl_divergence(leaf, t, support=everything)
    torch.testing.assert_close(out, ref.kl_divergence(s, t))
    out.sum().backward()
    assert not leaf.grad.isnan().any()


def test_reference_zero_mass_and_infinities():
    s = torch.tensor([[0.0, 1.0, float("-inf")], [0.0, float("-inf"), 2.0]], dtype=torch.float64,
                     requires_grad=True)
    t = torch.tensor([[0.0, 1.0, float("-inf")], [0.0, 1.0, 2.0]], dtype=torch.float64)
    forward = ref.kl_divergence(s, t)
    assert forward[0].item() == 0.0  # the same distribution, -inf at the same token: 0 log 0 = 0
    assert forward[1].item() == math.inf  # the teacher has mass where the student has none
    reverse = ref.kl_divergence(s, t, direction="reverse")
    assert math.isfinite(reverse[1].item())  # no student mass where the teacher has some: finite
    (forward.masked_fill(torch.isinf(forward), 0).sum() + reverse.sum()).backward()
    assert torch.isfinite(s.grad).all()


def test_mask_gives_zero_and_no_gradient_even_where_infinite():
    s = torch.tensor([[0.0, float("-inf")], [0.0, 1.0]], requires_grad=True)
    t = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([False, True])
    out = lr.kl_divergence(s, t, mask=mask, backend="naive")
    assert out[0].item() == 0.0 and out[1].item() > 0
    out.sum().backward()
    assert (s.grad[0] == 0).all() and torch.isfinite(s.grad).all()


def test_log_one_minus_sum_fails_in_float32_where_the_tail_is_small():
    """The reason for the log-sum-exp over the complement (docs/distillation.md)."""
    vocab, k = 1000, 8
    x = torch.full((vocab,), -25.5, dtype=torch.float64)
    x[:k] = 0.0
    support = torch.arange(k)
    exact = ref.support_logprobs(x, support)[-1].item()
    assert abs(exact - math.log((vocab - k) * math.exp(-25.5) / (k + (vocab - k) * math.exp(-25.5)))) < 1e-9
    p = torch.softmax(x.float(), -1)[:k].sum()
    naive = torch.log(1 - p).item()
    assert not math.isfinite(naive) or abs(naive - exact) > 0.1 * abs(exact)
    fp32 = ref.support_logprobs(x.float(), support, tail=True)[-1].item()
    assert abs(fp32 - exact) < 1e-5 * abs(exact)


# ---------------------------------------------------------------------------- the public call
def test_float32_result_from_bf16_and_float64_from_float64():
    s, t = _pair()
    assert lr.kl_divergence(s.bfloat16(), t.bfloat16()).dtype == torch.float32
    assert lr.kl_divergence(s.double(), t.double()).dtype == torch.float64
    assert lr.kl_divergence(s, t).shape == (3, 4)


def test_the_teacher_is_detached():
    s, t = _pair()
    student, teacher = s.clone().requires_grad_(True), t.clone().requires_grad_(True)
    lr.kl_divergence(student, teacher, backend="naive").sum().backward()
    assert teacher.grad is None and student.grad is not None
    assert not lr.kl_divergence(s, teacher, backend="naive").requires_grad
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 4, 16, generator=g, requires_grad=True), torch.randn(V, 16, generator=g, requires_grad=True)
    student = s.clone().requires_grad_(True)
    lr.kl_divergence(student, h, teacher_weight=w, backend="naive").sum().backward()
    assert h.grad is None and w.grad is None and student.grad is not None


def test_hidden_sides_of_different_sizes():
    g = torch.Generator().manual_seed(4)
    hs, ws = torch.randn(2, 3, 16, generator=g), torch.randn(V, 16, generator=g)
    ht, wt = torch.randn(2, 3, 24, generator=g), torch.randn(V, 24, generator=g)
    got = lr.kl_divergence(hs, ht, student_weight=ws, teacher_weight=wt, backend="naive")
    want = ref.kl_divergence(hs.double() @ ws.double().T, ht.double() @ wt.double().T)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _call(s=None, t=None, **kw):
    s0, t0 = _pair()
    return lr.kl_divergence(s0 if s is None else s, t0 if t is None else t, **kw)


@pytest.mark.parametrize("case, kwargs, error, match", [
    ("positions", dict(t=torch.zeros(3, 5, V)), ValueError, r"different positions"),
    ("vocabularies", dict(t=torch.zeros(3, 4, V + 1)), ValueError, r"vocabulary \(50\) and the teacher's \(51\)"),
    ("direction", dict(direction="backward"), ValueError, r"direction must be"),
    ("temperature", dict(temperature=0.0), ValueError, r"temperature"),
    ("support-range", dict(support=torch.full((3, 4, 2), V)), ValueError, r"50"),
    ("support-negative", dict(support=torch.full((3, 4, 1), -1)), ValueError, r"-1"),
    ("support-shape", dict(support=torch.zeros(3, 5, 2, dtype=torch.long)), ValueError, r"support shape"),
    ("support-empty", dict(support=torch.zeros(3, 4, 0, dtype=torch.long)), ValueError, r"K >= 1"),
    ("support-repeated", dict(support=torch.tensor([0, 1]).repeat(3, 4, 2)), ValueError, r"repeat"),
    ("support-dtype", dict(support=torch.zeros(3, 4, 2)), TypeError, r"support must be"),
    ("mask-shape", dict(mask=torch.ones(3, 5, dtype=torch.bool)), ValueError, r"mask shape"),
    ("mask-dtype", dict(mask=torch.ones(3, 4)), TypeError, r"mask must be a bool"),
    ("weight-hidden", dict(s=torch.zeros(3, 4, 16), student_weight=torch.zeros(V, 17)), ValueError,
     r"student_weight shape \(50, 17\) does not fit student shape \(3, 4, 16\)"),
    ("weight-vocab", dict(s=torch.zeros(3, 4, 16), student_weight=torch.zeros(V + 1, 16)), ValueError,
     r"vocabulary \(51\) and the teacher's \(50\)"),
    ("weight-dtype", dict(t=torch.zeros(3, 4, 16), teacher_weight=torch.zeros(V, 16, dtype=torch.float64)),
     TypeError, r"teacher_weight"),
    ("integer", dict(s=torch.zeros(3, 4, V, dtype=torch.long)), TypeError, r"student"),
])
def test_bad_input_errors(case, kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_bad_input_is_refused_before_any_backend_runs():
    calls = []

    def kl(*args, **kwargs):
        calls.append(1)
        raise AssertionError("the backend ran")

    class Plugin:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="kl-spy", ops={"kl_divergence": kl}, devices={"cpu"},
                                features={"kl_hidden", "kl_support"}))

    registry = lr.get_registry()
    registry.add_plugin(Plugin(), name="test-plugin-kl-spy")
    try:
        with pytest.raises(ValueError, match="repeat"):
            _call(support=torch.tensor([3, 3]).repeat(3, 4, 1), backend="kl-spy")
        with pytest.raises(ValueError, match="direction"):
            _call(direction="both", backend="kl-spy")
    finally:
        registry.remove_plugin("test-plugin-kl-spy")
    assert not calls


def test_naive_declares_the_features():
    naive = lr.get_registry().get("naive")
    assert naive.supports("kl_divergence")
    assert {"kl_hidden", "kl_support"} <= set(naive.features)
