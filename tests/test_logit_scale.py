"""logit_scale on every op: z = softcap(logit_scale * x) / temperature, against float64, on every
backend that runs here, with the sampler's truncation, from hidden states, in kl_divergence and
with process_group=."""

import inspect

import pytest
import torch

import logprob_registry as lr
from logprob_registry.opspec import OPS

SCALE, CAP, T = 0.0625, 30.0, 0.7  # a Granite-like head (logits / 16) and Gemma-like softcap
BACKENDS = ("naive", "chunked", "compiled")


def _z(x, scale=SCALE, softcap=CAP, temperature=T):
    z = x.double() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _data(seed=0, rows=6, vocab=301, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 40).to(dtype)
    return x, torch.randint(0, vocab, (rows,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_ops_against_float64(backend, dtype):
    x, y = _data(dtype=dtype)
    logp, ent = lr.logprobs_and_entropy(x, y, logit_scale=SCALE, softcap=CAP, temperature=T, backend=backend)
    ref = torch.log_softmax(_z(x), -1)
    torch.testing.assert_close(logp.double(), ref.gather(-1, y[:, None])[:, 0], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), atol=2e-5, rtol=0)


def test_truncation_sees_the_scaled_logits():
    x, y = _data(1)
    got = lr.logprobs_from_logits(x, y, logit_scale=SCALE, top_k=20, temperature=T, backend="chunked")
    z = _z(x, softcap=None)
    kept = z >= z.topk(20, -1).values[:, -1:]
    ref = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)
    values, ids = lr.topk_logprobs(x, 5, logit_scale=SCALE, temperature=T)
    torch.testing.assert_close(values.double(), torch.log_softmax(z, -1).topk(5, -1).values, atol=2e-5, rtol=0)
    assert torch.equal(ids, z.topk(5, -1).indices)


def test_fused_op_and_kl_divergence():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(6, 32, generator=g), torch.randn(301, 32, generator=g) * 4
    y = torch.randint(0, 301, (6,), generator=g)
    got = lr.logprobs_from_hidden(hidden, weight, y, logit_scale=SCALE, softcap=CAP, temperature=T)
    ref = torch.log_softmax(_z(hidden.double() @ weight.double().T), -1).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)
    s, t = _data(3)[0], _data(4)[0]
    kl = lr.kl_divergence(s, t, logit_scale=SCALE, temperature=T)
    ls, lt = torch.log_softmax(_z(s, softcap=None), -1), torch.log_softmax(_z(t, softcap=None), -1)
    torch.testing.assert_close(kl.double(), (lt.exp() * (lt - ls)).sum(-1), atol=2e-5, rtol=0)


def test_one_is_none_and_every_public_op_takes_it():
    x, y = _data(5)
    assert torch.equal(lr.logprobs_from_logits(x, y, logit_scale=1.0), lr.logprobs_from_logits(x, y))
    for spec in OPS.values():
        if spec.function is not None:
            assert "logit_scale" in inspect.signature(spec.public()).parameters, spec.function


@pytest.mark.parametrize("scale, kind", [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                         (float("nan"), ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_logit_scale_names_it(scale, kind):
    x, y = _data()
    with pytest.raises(kind, match="logit_scale"):
        lr.logprobs_from_logits(x, y, logit_scale=scale)
    with pytest.raises(kind, match="logit_scale"):
        lr.kl_divergence(x, x, logit_scale=scale)


def test_with_a_process_group(world):
    x, y = _data(6)
    got = lr.logprobs_from_logits(x, y, logit_scale=SCALE, softcap=CAP, temperature=T, process_group=world)
    ref = torch.log_softmax(_z(x), -1).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)
