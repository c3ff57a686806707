"""``token_stats`` on ``compiled``: its fields bitwise the ops' where they duplicate one (forward and
gradient), in every layout the kernels take; what it leaves to others (hidden states, truncation)
explained by its feature declarations. The conformance suite's statistics section
(``tests/test_conformance.py``) checks every field against float64.

The kernels compile once per kind of call, so the cases share a few (float32 and bfloat16, V=300)."""

import pytest
import torch

import logprob_registry as lr
from logprob_registry.call import key_for
from logprob_registry.environment import get_environment
from logprob_registry.kernels import compiled

FIELDS = lr.TokenStats._fields
V = 300
NO_COMPILER = compiled.available(get_environment(), "cpu")
pytestmark = pytest.mark.skipif(NO_COMPILER is not None, reason=f"needs a C++ compiler: {NO_COMPILER}")


def case(dtype=torch.float32, seed=0):
    """(3, 7, V) logits with a masked column, labels with every third on the row's argmax, and
    ignored positions (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 7, V, generator=g) * 3).to(dtype)
    x[..., 5] = float("-inf")
    y = torch.randint(6, V, (3, 7), generator=g)
    y.view(-1)[::3] = x.float().argmax(-1).view(-1)[::3]
    y[1, 2] = y[2, 4] = -100
    return x, y


LAYOUTS = {
    "contiguous": lambda x, y: (x, y),
    "sliced": lambda x, y: (x[:, :-1], y[:, 1:]),  # logits[:, :-1]: a 3-D strided view, no copy
    "one-row": lambda x, y: (x[1, 3], y[1, 3]),    # 1-D logits, a 0-d label
}
OPTIONS = {"plain": {}, "softcap": dict(softcap=12.0, temperature=0.8)}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fields_bitwise_the_ops_and_close_to_naive(dtype, layout, options):
    x, y = LAYOUTS[layout](*case(dtype))
    kw = dict(OPTIONS[options], ignore_index=-100)
    lp = lr.logprobs_from_logits(x, y, backend="compiled", **kw)
    _, ent = lr.logprobs_and_entropy(x, y, backend="compiled", **kw)
    every = lr.token_stats(x, y, outputs=FIELDS, backend="compiled", **kw)  # token_stats' own kernel
    for subset in [FIELDS, ("logprobs",), ("logprobs", "entropy"), ("entropy", "mean_logit"), ("logprobs", "is_argmax")]:
        got = every if subset is FIELDS else lr.token_stats(x, y, outputs=subset, backend="compiled", **kw)
        if "logprobs" in subset:
            assert torch.equal(got.logprobs, lp), (subset, float((got.logprobs - lp).abs().max()))
        if "entropy" in subset:
            assert torch.equal(got.entropy, ent), (subset, float((got.entropy - ent).abs().max()))
        for name in FIELDS:
            value = getattr(got, name)
            assert (value is None) == (name not in subset), (subset, name)
            if value is not None:  # a field is the same whichever kernel the subset took
                assert torch.equal(value, getattr(every, name)), (subset, name)
    assert torch.equal(every.raw_logprobs, lp) and torch.equal(every.raw_entropy, ent)  # no truncation: raw = processed
    want = lr.token_stats(x, y, outputs=FIELDS, backend="naive", **kw)
    for name in FIELDS:
        a, b = getattr(every, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "is_argmax":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5, equal_nan=True, msg=name)


def test_is_argmax_ties_nan_and_ignored():
    x, y = case()
    x = x.clone()
    x[0, 0, 10] = x[0, 0, 200] = x[0, 0].amax() + 1  # a tie: the first maximum wins
    x[0, 1, 50] = float("nan")                        # NaN is the maximum, as in torch.argmax
    y[0, 0], y[0, 1], y[0, 2] = 10, 50, int(x[0, 2].argmax())
    top = lr.token_stats(x, y, outputs=("is_argmax",), ignore_index=-100, backend="compiled").is_argmax
    assert top[0, 0] and top[0, 1] and top[0, 2]
    y2 = y.clone()
    y2[0, 0] = 200
    assert not lr.token_stats(x, y2, outputs=("is_argmax",), ignore_index=-100, backend="compiled").is_argmax[0, 0]
    assert not top[1, 2] and not top[2, 4]  # ignored positions: False
    assert torch.equal(top, (x.argmax(-1) == y) & (y != -100))
    xs, ys = x[:, 1:], y2[:, 1:]  # a tie decided on a strided 3-D view's rows (a later maximum: False)
    ys[1, 0], ys[2, 1] = 10, 200
    xs[1, 0, 10] = xs[1, 0, 200] = xs[2, 1, 10] = xs[2, 1, 200] = 50.0
    sliced = lr.token_stats(xs, ys, outputs=("is_argmax",), ignore_index=-100, backend="compiled").is_argmax
    assert torch.equal(sliced, (xs.argmax(-1) == ys) & (ys != -100)) and sliced[1, 0] and not sliced[2, 1]
    assert bool(top.view(-1)[::3][(y != -100).view(-1)[::3]].all())  # the labels put on the argmax


def test_gradient_bitwise_the_ops_and_not_differentiable_fields():
    """The four differentiable fields' gradient runs the ops' one-pass kernel: with the same
    upstream weights (logprobs + raw_logprobs, entropy + raw_entropy) it is bitwise
    logprobs_and_entropy's; the other four have no grad_fn."""
    x, y = LAYOUTS["sliced"](*case(seed=2))
    g = torch.Generator().manual_seed(3)
    u1, u2, w1, w2 = (torch.randn(y.shape, generator=g) for _ in range(4))
    for kw in OPTIONS.values():
        a = x.detach().clone().requires_grad_(True)
        got = lr.token_stats(a, y, outputs=FIELDS, ignore_index=-100, backend="compiled", **kw)
        for name in ("log_sum_p2", "mean_logit", "max_logit", "is_argmax"):
            assert getattr(got, name).grad_fn is None and not getattr(got, name).requires_grad, name
        finite = torch.isfinite(got.logprobs)
        loss = (torch.where(finite, got.logprobs * u1 + got.raw_logprobs * u2, 0.0) + got.entropy * w1
                + got.raw_entropy * w2).sum()
        (grad,) = torch.autograd.grad(loss, a)
        b = x.detach().clone().requires_grad_(True)
        lp, ent = lr.logprobs_and_entropy(b, y, ignore_index=-100, backend="compiled", **kw)
        (want,) = torch.autograd.grad((torch.where(finite, lp * (u1 + u2), 0.0) + ent * (w1 + w2)).sum(), b)
        assert torch.equal(grad, want), float((grad - want).abs().max())
        (alone,) = torch.autograd.grad(lr.token_stats(a, None, outputs=("entropy",), backend="compiled", **kw)
                                       .entropy.sum(), a)
        c = x.detach().clone().requires_grad_(True)
        (ent_grad,) = torch.autograd.grad(lr.entropy_from_logits(c, backend="compiled", **kw).sum(), c)
        assert torch.equal(alone, ent_grad)


def test_double_backward_against_naive():
    x, y = case(seed=4)
    x, y = x[:1, :3], y[:1, :3]
    grads = {}
    for backend in ("compiled", "naive"):
        a = x.detach().clone().requires_grad_(True)
        got = lr.token_stats(a, y, outputs=("logprobs", "raw_entropy"), backend=backend)
        (g1,) = torch.autograd.grad((got.logprobs + got.raw_entropy).sum(), a, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * g1).sum(), a)
        grads[backend] = (g1.detach(), g2)
    for mine, ref in zip(grads["compiled"], grads["naive"]):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_empty_and_no_labels():
    x, _ = case()
    empty = lr.token_stats(x[:0], None, outputs=("entropy", "mean_logit"), backend="compiled")
    assert empty.entropy.shape == (0, 7) and empty.mean_logit.shape == (0, 7)
    free = ("entropy", "raw_entropy", "log_sum_p2", "mean_logit", "max_logit")
    got = lr.token_stats(x, None, outputs=free, backend="compiled")
    want = lr.token_stats(x, None, outputs=free, backend="naive")
    for name in free:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=2e-5)


@pytest.mark.parametrize("feature, kwargs", [
    ("stats_hidden", lambda: dict(weight=torch.randn(V, 16), bias=torch.randn(V))),
    ("top_k", lambda: dict(top_k=5)),
    ("per_row", lambda: dict(temperature=torch.full((3, 7), 0.9))),
])
def test_what_compiled_leaves_to_chunked_is_explained(feature, kwargs):
    """Hidden states, truncation and per-row values: compiled declares none of these features, so an
    explicit choice says why, and the automatic choice takes chunked."""
    x, y = case()
    kw = kwargs()
    inputs = torch.randn(3, 7, 16) if "weight" in kw else x
    with pytest.raises(lr.NoEligibleBackendError, match=f"backend .compiled.* does not support {feature}. Eligible here: chunked"):
        lr.token_stats(inputs, y, outputs=FIELDS, ignore_index=-100, backend="compiled", **kw)
    key = key_for("token_stats", device="cpu", features={feature} - {"stats_hidden"}, vocab=V,
                  hidden_size=16 if "weight" in kw else None)  # a hidden size: the feature stats_hidden
    verdicts = {v.name: v for v in lr.get_registry().verdicts(key)}
    assert verdicts["compiled"].reason == f"does not support {feature}"
    assert lr.get_registry().select(key).name == "chunked"
    plain = key_for("token_stats", device="cpu", vocab=V)
    assert lr.get_registry().select(plain).name == "compiled"  # where it can: its priority over chunked's
