"""``token_stats`` on ``compiled``: its fields bitwise the ops' where they duplicate one (forward and
gradient), in every layout the kernels take, over logits and over hidden states (the fused op's
tiles); what it leaves to others (truncation, per-row values) explained by its feature declarations. The conformance suite's statistics section
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
    ("top_k", lambda: dict(top_k=5)),
    ("per_row", lambda: dict(temperature=torch.full((3, 7), 0.9))),
    ("top_p", lambda: dict(weight=torch.randn(V, 16), bias=torch.randn(V), top_p=0.9)),  # hidden states too
])
def test_what_compiled_leaves_to_chunked_is_explained(feature, kwargs):
    """Truncation and per-row values (over logits or hidden states): compiled declares none of these
    features, so an explicit choice says why, and the automatic choice takes chunked."""
    x, y = case()
    kw = kwargs()
    inputs = torch.randn(3, 7, 16) if "weight" in kw else x
    with pytest.raises(lr.NoEligibleBackendError, match=f"backend .compiled.* does not support {feature}. Eligible here: chunked"):
        lr.token_stats(inputs, y, outputs=FIELDS, ignore_index=-100, backend="compiled", **kw)
    key = key_for("token_stats", device="cpu", features={feature}, vocab=V, hidden_size=16 if "weight" in kw else None)
    verdicts = {v.name: v for v in lr.get_registry().verdicts(key)}
    assert verdicts["compiled"].reason == f"does not support {feature}"
    assert lr.get_registry().select(key).name == "chunked"
    plain = key_for("token_stats", device="cpu", vocab=V)
    assert lr.get_registry().select(plain).name == "compiled"  # where it can: its priority over chunked's


# ------------------------------------------------------------------ hidden states (stats_hidden)
VH, H = 2500, 16  # three vocabulary blocks of the fused op's tiles (1024 columns on the CPU), the last short
HIDDEN_OPTIONS = dict(softcap=12.0, temperature=0.8, logit_scale=0.7, ignore_index=-100)


def hidden_case(dtype=torch.float32, seed=0):
    """(3, 7, H) hidden states, a (VH, H) weight and a bias; labels with every third on the row's
    argmax, one on the first and one on the last column, and ignored positions (-100)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(3, 7, H, generator=g) * 2).to(dtype)
    w = (torch.randn(VH, H, generator=g) * 0.6).to(dtype)
    b = torch.randn(VH, generator=g).to(dtype)
    z = h.double() @ w.double().T + b.double()
    y = torch.randint(0, VH, (3, 7), generator=g)
    y.view(-1)[::3] = z.argmax(-1).view(-1)[::3]
    y[0, 1], y[0, 2] = 0, VH - 1
    y[1, 2] = y[2, 4] = -100
    return h, w, b, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_fields_bitwise_the_fused_op_and_close_to_float64(dtype):
    """Given hidden states, every field in one pass over the fused op's tiles: logprobs bitwise
    logprobs_from_hidden's, entropy bitwise its return_entropy=True entropy (softcap, logit_scale and
    temperature together); each field against float64; a subset is the full call's values."""
    h, w, b, y = hidden_case(dtype)
    kw = dict(weight=w, bias=b, backend="compiled", **HIDDEN_OPTIONS)
    every = lr.token_stats(h, y, outputs=FIELDS, **kw)
    fused = dict(bias=b, backend="compiled", **HIDDEN_OPTIONS)
    lp = lr.logprobs_from_hidden(h, w, y, **fused)
    _, ent = lr.logprobs_from_hidden(h, w, y, return_entropy=True, **fused)
    assert torch.equal(every.logprobs, lp), float((every.logprobs - lp).abs().max())
    assert torch.equal(every.entropy, ent), float((every.entropy - ent).abs().max())
    assert torch.equal(every.raw_logprobs, lp) and torch.equal(every.raw_entropy, ent)  # no truncation
    for subset in [("logprobs",), ("entropy", "raw_logprobs"), ("entropy", "mean_logit"), ("is_argmax",)]:
        got = lr.token_stats(h, y, outputs=subset, **kw)
        for name in FIELDS:
            value = getattr(got, name)
            assert (value is None) == (name not in subset), (subset, name)
            if value is not None:
                assert torch.equal(value, getattr(every, name)), (subset, name)
    want = lr.token_stats(h.double(), y, outputs=FIELDS, weight=w.double(), bias=b.double(), backend="naive",
                          **HIDDEN_OPTIONS)
    for name in FIELDS:
        a, ref = getattr(every, name), getattr(want, name)
        assert a.shape == ref.shape and a.dtype == (torch.bool if name == "is_argmax" else torch.float32), name
        if name == "is_argmax":
            assert torch.equal(a, ref) and int(a.sum()) >= 5  # the labels put on the argmax, not ignored
        else:
            torch.testing.assert_close(a.double(), ref, rtol=0, atol=2e-5, msg=name)
    free = lr.token_stats(h, None, outputs=("entropy", "log_sum_p2", "mean_logit", "max_logit"), **kw)
    for name in ("entropy", "log_sum_p2", "mean_logit", "max_logit"):
        assert torch.equal(getattr(free, name), getattr(every, name)), name  # labels change none of them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_gradients_bitwise_the_fused_op_and_close_to_float64(dtype):
    """The gradients to hidden, weight and bias of the four differentiable fields run the fused op's
    backward tiles: bitwise its gradient for the same upstream weights (logprobs + raw_logprobs,
    entropy + raw_entropy), and close to float64 autograd; the other four have no grad_fn."""
    h, w, b, y = hidden_case(dtype, seed=1)
    g = torch.Generator().manual_seed(3)
    u1, u2, w1, w2 = (torch.randn(y.shape, generator=g) for _ in range(4))
    leaves = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    got = lr.token_stats(leaves[0], y, outputs=FIELDS, weight=leaves[1], bias=leaves[2], backend="compiled",
                         **HIDDEN_OPTIONS)
    for name in ("log_sum_p2", "mean_logit", "max_logit", "is_argmax"):
        assert getattr(got, name).grad_fn is None and not getattr(got, name).requires_grad, name
    loss = (got.logprobs * u1 + got.raw_logprobs * u2 + got.entropy * w1 + got.raw_entropy * w2).sum()
    grads = torch.autograd.grad(loss, leaves)
    same = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    lp, ent = lr.logprobs_from_hidden(same[0], same[1], y, bias=same[2], return_entropy=True, backend="compiled",
                                      **HIDDEN_OPTIONS)
    for a, want in zip(grads, torch.autograd.grad((lp * (u1 + u2) + ent * (w1 + w2)).sum(), same)):
        assert torch.equal(a, want), float((a - want).abs().max())
    ref = [t.detach().double().requires_grad_(True) for t in (h, w, b)]
    truth = lr.token_stats(ref[0], y, outputs=FIELDS, weight=ref[1], bias=ref[2], backend="naive", **HIDDEN_OPTIONS)
    loss64 = (truth.logprobs * u1 + truth.raw_logprobs * u2 + truth.entropy * w1 + truth.raw_entropy * w2).sum()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradients are rounded to bf16
    for a, want in zip(grads, torch.autograd.grad(loss64, ref)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_hidden_double_backward_against_naive():
    h, w, b, y = hidden_case(seed=4)
    h, y = h[:1, :3], y[:1, :3]
    grads = {}
    for backend in ("compiled", "naive"):
        a = h.detach().clone().requires_grad_(True)
        got = lr.token_stats(a, y, weight=w, bias=b, outputs=("logprobs", "raw_entropy", "max_logit"), backend=backend)
        (g1,) = torch.autograd.grad((got.logprobs + got.raw_entropy).sum(), a, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * g1).sum(), a)
        grads[backend] = (g1.detach(), g2)
    for mine, ref in zip(grads["compiled"], grads["naive"]):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_hidden_choice_keeps_the_fused_op_rule():
    """compiled declares stats_hidden, and for token_stats given hidden states the fused op's size
    rule (min_size above every bounded bucket: chunked was as fast on this CPU), so the automatic
    choice of a hidden call is chunked, with the rule as the reason; its logits calls stay compiled."""
    assert "stats_hidden" in lr.get_registry().get("compiled").features
    hidden = lr.explain("token_stats", device="cpu", shape=(3, 7, VH), hidden_size=H)
    assert hidden.chosen == "chunked"
    assert "declares min_size['token_stats']={'hidden': 8589934592}" in hidden["compiled"].why
    assert lr.explain("token_stats", device="cpu", shape=(3, 7, VH)).chosen == "compiled"
    h, w, b, y = hidden_case()
    auto = lr.token_stats(h, y, weight=w, bias=b, outputs=FIELDS, **HIDDEN_OPTIONS)
    chunked = lr.token_stats(h, y, weight=w, bias=b, outputs=FIELDS, backend="chunked", **HIDDEN_OPTIONS)
    assert all(torch.equal(getattr(auto, n), getattr(chunked, n)) for n in FIELDS)
