"""kl_divergence(direction="jsd", beta=): the generalized Jensen-Shannon divergence, against a float64
formula written here, with its gradient, from hidden states and over a support; against TRL's
ChunkedDivergenceFunction where TRL is installed; bad beta and process_group= refused with a sentence."""

import math

import pytest
import torch

import logprob_registry as lr
from logprob_registry.opspec import OPS


def _jsd64(s, t, beta, temperature=1.0):
    ls = torch.log_softmax(s.double() / temperature, -1)
    lt = torch.log_softmax(t.double() / temperature, -1)
    m = torch.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    return beta * (lt.exp() * (lt - m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - m)).sum(-1)


def _sides(seed=0, rows=5, vocab=211, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(rows, vocab, generator=g) * 3).to(dtype), (torch.randn(rows, vocab, generator=g) * 3).to(dtype))


@pytest.mark.parametrize("beta", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_float64_with_gradient(beta, dtype):
    s, t = _sides(dtype=dtype)
    s.requires_grad_(True)
    got = lr.kl_divergence(s, t, direction="jsd", beta=beta, temperature=0.9)
    want_s = s.detach().double().requires_grad_(True)
    want = _jsd64(want_s, t, beta, 0.9)
    torch.testing.assert_close(got.double(), want.detach(), atol=2e-6, rtol=0)
    up = torch.rand(5, dtype=torch.float64)
    (got * up.float()).sum().backward()
    (want * up).sum().backward()
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps  # the gradient comes in the logits' dtype
    torch.testing.assert_close(s.grad.double(), want_s.grad, atol=1e-6, rtol=rounding)


def test_symmetric_at_one_half_and_between_the_kls():
    s, t = _sides(1)
    a = lr.kl_divergence(s, t, direction="jsd", beta=0.5)
    b = lr.kl_divergence(t, s, direction="jsd", beta=0.5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert bool((a >= 0).all()) and bool((a <= math.log(2) + 1e-6).all())  # JSD(1/2) is bounded by log 2


def test_hidden_sides_and_support_with_tail():
    g = torch.Generator().manual_seed(2)
    hs, ht = torch.randn(4, 16, generator=g), torch.randn(4, 24, generator=g)
    ws, wt = torch.randn(97, 16, generator=g), torch.randn(97, 24, generator=g)
    got = lr.kl_divergence(hs, ht, student_weight=ws, teacher_weight=wt, direction="jsd", beta=0.3)
    torch.testing.assert_close(got.double(), _jsd64(hs.double() @ ws.double().T, ht.double() @ wt.double().T, 0.3),
                               atol=2e-6, rtol=0)
    s, t = _sides(3, vocab=50)
    support = torch.stack([torch.randperm(50, generator=g)[:7] for _ in range(5)])
    got = lr.kl_divergence(s, t, direction="jsd", beta=0.4, support=support)
    (ref,) = OPS["kl_divergence"].ground_truth(s, t, direction="jsd", beta=0.4, support=support)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5, 2.0, float("nan")])
def test_beta_outside_the_open_interval_names_it(beta):
    s, t = _sides()
    with pytest.raises(ValueError, match="beta must be in"):
        lr.kl_divergence(s, t, direction="jsd", beta=beta)
    with pytest.raises(TypeError, match="beta must be a number"):
        lr.kl_divergence(s, t, direction="jsd", beta="0.5")
    assert torch.equal(lr.kl_divergence(s, t, beta=beta if beta == beta else 3.0), lr.kl_divergence(s, t))


def test_with_process_group_is_refused_with_a_sentence(world):
    s, t = _sides()
    with pytest.raises(NotImplementedError, match="beta"):
        lr.kl_divergence(s, t, direction="jsd", process_group=world)


def test_against_trl_chunked_divergence():
    divergence = pytest.importorskip("trl.kernels.chunked_divergence", reason="needs trl (the [test] extra)")
    g = torch.Generator().manual_seed(4)
    hs, ht = torch.randn(6, 32, generator=g), torch.randn(6, 48, generator=g)
    ws, wt = torch.randn(300, 32, generator=g) * 0.5, torch.randn(300, 48, generator=g) * 0.5
    exact = {}
    for beta in (0.25, 0.5, 0.75):
        ours = lr.kl_divergence(hs, ht, student_weight=ws, teacher_weight=wt, direction="jsd", beta=beta,
                                temperature=0.8)
        theirs, _ = divergence.ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta, 0.8)
        exact[beta] = _jsd64(hs.double() @ ws.double().T, ht.double() @ wt.double().T, beta, 0.8)
        torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.double(), exact[beta], atol=2e-6, rtol=0)
        torch.testing.assert_close(theirs.double(), exact[beta], atol=1e-5, rtol=0)
