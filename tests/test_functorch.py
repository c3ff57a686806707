"""torch.func transforms: a call inside grad/vmap goes only to backends that declare the
``functorch`` feature (naive, built from composable torch ops); an explicit choice of another backend
says why; nothing is ever marked broken by the caller's context."""

import pytest
import torch

import logprob_registry as lr


def test_grad_and_vmap_through_the_automatic_choice():
    x, y = torch.randn(3, 7, dtype=torch.float64), torch.randint(0, 7, (3,))
    got = torch.func.grad(lambda t: lr.logprobs_from_logits(t, y, temperature=0.7).sum())(x)
    want = torch.func.grad(lambda t: (t / 0.7).log_softmax(-1).gather(-1, y[:, None]).sum())(x)
    torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda t, label: lr.logprobs_from_logits(t, label))(x, y)
    torch.testing.assert_close(batched, lr.logprobs_from_logits(x, y))
    ent = torch.func.vmap(lr.entropy_from_logits)(x)
    torch.testing.assert_close(ent, lr.entropy_from_logits(x))
    hess = torch.func.hessian(lambda t: lr.entropy_from_logits(t[None])[0])(x[0])
    assert hess.shape == (7, 7) and torch.allclose(hess, hess.T)
    assert lr.get_registry().broken() == {}


def test_ordinary_calls_are_unaffected_afterwards():
    x, y = torch.randn(3, 7), torch.randint(0, 7, (3,))
    torch.func.grad(lambda t: lr.logprobs_from_logits(t, y).sum())(x)
    assert lr.select("logprobs", device="cpu").name != "naive"  # the fast backend still wins outside
    assert lr.get_registry().broken() == {}


@pytest.mark.parametrize("name", ["chunked", "compiled"])
def test_an_explicit_backend_without_the_feature_is_refused_with_the_reason(name):
    x, y = torch.randn(3, 7), torch.randint(0, 7, (3,))
    with pytest.raises(lr.NoEligibleBackendError, match=f"backend '{name}' .* using functorch: does not support functorch"):
        torch.func.grad(lambda t: lr.logprobs_from_logits(t, y, backend=name).sum())(x)
    assert lr.get_registry().broken() == {}
