"""``lr.nn.LogprobHead``: an ``nn.Linear`` whose forward is ``logprobs_from_hidden`` of its own
parameters; under FSDP2's ``fully_shard`` on a spawned gloo group of 2 it gives a single process's
logprobs and gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import logprob_registry as lr
from logprob_registry.distributed import launch

H, V = 16, 50


def _data(seed=0, shape=(3, 5), dtype=torch.float32, hidden=H, vocab=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, vocab, shape, generator=g)
    return x, y


def _head(bias=False, seed=1, dtype=torch.float32, **defaults):
    torch.manual_seed(seed)
    return lr.nn.LogprobHead(H, V, bias=bias, dtype=dtype, **defaults)


def _textbook(hidden, weight, labels, bias=None, temperature=1.0):
    """float64 log_softmax(hidden @ weight.T + bias)[label] and the entropy."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()) / temperature
    logp = z.log_softmax(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _grads(out, *tensors):
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * upstream).sum(), tensors)


# ---------------------------------------------------------------------------- an nn.Linear
def test_it_is_an_nn_linear_with_linears_parameters_and_state_dict():
    head, linear = lr.nn.LogprobHead(H, V), nn.Linear(H, V, bias=False)
    assert isinstance(head, nn.Linear) and head.bias is None
    assert {k: v.shape for k, v in head.state_dict().items()} == {k: v.shape for k, v in linear.state_dict().items()}
    head.load_state_dict(linear.state_dict())            # strict, both ways
    linear.load_state_dict(head.state_dict())
    assert torch.equal(head.weight, linear.weight)
    with_bias = lr.nn.LogprobHead(H, V, bias=True)
    assert list(with_bias.state_dict()) == list(nn.Linear(H, V).state_dict()) == ["weight", "bias"]
    assert [n for n, _ in with_bias.named_parameters()] == ["weight", "bias"]


def test_constructor_takes_linears_device_and_dtype():
    head = lr.nn.LogprobHead(H, V, True, "meta", torch.float64)   # nn.Linear's positional order
    assert head.weight.device.type == "meta" and head.weight.dtype == torch.float64
    assert head.bias.dtype == torch.float64
    head = lr.nn.LogprobHead(H, V, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert head.weight.dtype == torch.bfloat16 and head.weight.shape == (V, H)
    assert "in_features=16, out_features=50, bias=False" in repr(head)


# ---------------------------------------------------------------------------- values and gradients
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_are_those_of_logprobs_from_hidden(bias):
    head = _head(bias)
    x, y = _data()
    x.requires_grad_(True)
    params = [x, head.weight] + ([head.bias] if bias else [])
    out = head(x, y)
    want = lr.logprobs_from_hidden(x, head.weight, y, bias=head.bias)
    assert out.dtype == torch.float32 and out.shape == y.shape
    assert out._base is None                             # not a view (FSDP2 warns about a view output)
    assert torch.equal(out, want)                        # the same call: the same bits
    grads = _grads(out, *params)
    for got, expected in zip(grads, _grads(want, *params)):
        assert torch.equal(got, expected)
    # and the textbook formula, in float64
    x64, w64 = x.detach().double().requires_grad_(True), head.weight.detach().double().requires_grad_(True)
    b64 = head.bias.detach().double().requires_grad_(True) if bias else None
    ref, _ = _textbook(x64, w64, y, b64)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, _grads(ref.float(), x64, w64, *([b64] if bias else []))):
        torch.testing.assert_close(got.double(), expected.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_return_entropy_gives_logprobs_and_entropy(bias):
    head = _head(bias, dtype=torch.float64)
    x, y = _data(dtype=torch.float64)
    logp, ent = head(x, y, return_entropy=True, temperature=0.7)
    assert logp.dtype == ent.dtype == torch.float64
    want_logp, want_ent = _textbook(x, head.weight, y, head.bias, temperature=0.7)
    torch.testing.assert_close(logp, want_logp.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, want_ent.detach(), rtol=1e-10, atol=1e-10)
    (got,) = torch.autograd.grad((logp + ent).sum(), [head.weight])
    weight = head.weight.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = _textbook(x, weight, y, head.bias, temperature=0.7)
    (want,) = torch.autograd.grad((ref_logp + ref_ent).sum(), [weight])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("keywords", [
    dict(temperature=0.5, ignore_index=-100),
    dict(softcap=3.0),
    dict(top_k=5, top_p=0.9, min_p=0.01),
    dict(logits_dtype=torch.bfloat16, backend="chunked"),
    dict(return_entropy=True, backend="naive", temperature=0.8),
])
def test_keywords_pass_through(keywords):
    head = _head(bias=True)
    x, y = _data()
    y[0, :2] = -100
    keywords = dict(keywords)
    if "ignore_index" not in keywords:
        y[0, :2] = 0
    got = head(x, y, **keywords)
    want = lr.logprobs_from_hidden(x, head.weight, y, bias=head.bias, **keywords)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)
    if "ignore_index" in keywords:
        assert (got[0, :2] == 0).all()


def test_constructor_keywords_are_defaults_a_call_overrides():
    head = _head(ignore_index=-100, temperature=0.5, backend="chunked")
    assert "ignore_index=-100" in repr(head) and "temperature=0.5" in repr(head)
    x, y = _data()
    y[1, 3] = -100
    got = head(x, y)
    assert torch.equal(got, lr.logprobs_from_hidden(x, head.weight, y, ignore_index=-100, temperature=0.5,
                                                    backend="chunked"))
    assert got[1, 3] == 0
    y[1, 3] = 4
    assert torch.equal(head(x, y, temperature=2.0),
                       lr.logprobs_from_hidden(x, head.weight, y, ignore_index=-100, temperature=2.0,
                                               backend="chunked"))
    assert head.defaults["temperature"] == 0.5   # a call's keywords do not change the defaults


def test_the_module_owns_its_bias_and_unknown_keywords_are_named():
    head = _head(bias=True)
    x, y = _data()
    with pytest.raises(TypeError, match=r"bias= is the module's own parameter \(self.bias\)"):
        head(x, y, bias=torch.zeros(V))
    with pytest.raises(TypeError, match="unexpected keyword argument.*tempreature.*temperature"):
        head(x, y, tempreature=0.5)
    with pytest.raises(TypeError, match="LogprobHead\\(\\) got unexpected keyword argument.*weight"):
        lr.nn.LogprobHead(H, V, weight=None)
    with pytest.raises(TypeError, match="need labels"):
        head(x, temperature=0.5)


def test_without_labels_it_gives_the_logits_like_linear():
    head = _head(bias=True)
    linear = nn.Linear(H, V)
    linear.load_state_dict(head.state_dict())
    x, _ = _data()
    assert torch.equal(head(x), linear(x)) and torch.equal(head.logits(x), linear(x))


# ---------------------------------------------------------------------------- from_linear
@pytest.mark.parametrize("bias", [False, True])
def test_from_linear_shares_the_parameters_without_copying(bias):
    torch.manual_seed(3)
    linear = nn.Linear(H, V, bias=bias, dtype=torch.float64)
    linear.eval()
    head = lr.nn.LogprobHead.from_linear(linear, temperature=0.9)
    assert type(head) is lr.nn.LogprobHead and not head.training and head.defaults == {"temperature": 0.9}
    assert head.weight is linear.weight and head.weight.data_ptr() == linear.weight.data_ptr()
    assert (head.bias is linear.bias) if bias else head.bias is None
    assert (head.in_features, head.out_features) == (H, V)
    with torch.no_grad():                                     # one storage: a change shows in both
        linear.weight[0, 0] = 42.0
    assert head.weight[0, 0] == 42.0
    x, y = _data(dtype=torch.float64)
    head(x, y).sum().backward()                               # gradients land on linear's parameters
    assert linear.weight.grad is not None and (linear.bias.grad is not None if bias else True)
    head.load_state_dict(linear.state_dict())
    # a model whose lm_head is replaced keeps its tied embedding tied
    emb = nn.Embedding(V, H)
    tied = nn.Linear(H, V, bias=False)
    tied.weight = emb.weight
    assert lr.nn.LogprobHead.from_linear(tied).weight is emb.weight
    with pytest.raises(TypeError, match="needs an nn.Linear, got Embedding"):
        lr.nn.LogprobHead.from_linear(emb)


# ---------------------------------------------------------------------------- FSDP2
B, T = 2, 3  # each rank's rows


class _Model(nn.Module):
    """A body layer and the head, as a language model's last layer and lm_head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.body = nn.Linear(H, H)
        self.head = lr.nn.LogprobHead(H, V - 1, bias=True)   # V - 1 = 49 rows: an uneven shard

    def forward(self, x, y):
        return self.head(torch.tanh(self.body(x)), y, return_entropy=True, ignore_index=-100, temperature=0.8,
                         backend="chunked")


def _global_data(world):
    x, y = _data(seed=5, shape=(world * B, T), vocab=V - 1)
    y[0, 1] = y[-1, 0] = -100
    return x, y


def _loss(logp, ent, world):
    # FSDP averages the ranks' gradients: the single process divides its sum by world to match
    return (-logp.sum() - 0.1 * ent.sum()) / world


def _fsdp_rank(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _Model()
    fully_shard(model.head)          # the head is its own unit: gathered for its forward, resharded after
    fully_shard(model)
    from torch.distributed.tensor import Shard

    sharded = {n: (type(p).__name__, tuple(p.placements) == (Shard(0),), tuple(p.to_local().shape))
               for n, p in model.named_parameters()}
    seen = []
    model.head.register_forward_pre_hook(lambda m, args: seen.append(
        (type(m.weight).__name__, isinstance(m.weight, DTensor), tuple(m.weight.shape))))
    x, y = _global_data(world)
    rows = slice(rank * B, (rank + 1) * B)
    x = x[rows].clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logp, ent = model(x, y[rows])
        _loss(logp, ent, 1).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    grad_types = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    return dict(logp=logp.detach(), ent=ent.detach(), x_grad=x.grad, grads=grads, grad_types=grad_types,
                sharded=sharded, seen=seen, warnings=[str(w.message) for w in caught])


def test_under_fully_shard_on_two_processes_it_gives_the_single_process_result():
    world = 2
    ranks = [r.unwrap() for r in launch.run(world, _fsdp_rank, timeout=120)]

    model = _Model()
    x, y = _global_data(world)
    x.requires_grad_(True)
    logp, ent = model(x, y)
    _loss(logp, ent, world).backward()

    for rank, got in enumerate(ranks):
        # the parameters are DTensors sharded on dim 0; the head's forward sees the whole weight
        assert got["sharded"]["head.weight"][:2] == ("DTensor", True)
        assert got["sharded"]["head.weight"][2] == ((25, H) if rank == 0 else (24, H))
        assert got["seen"] == [("Parameter", False, (V - 1, H))]
        assert set(got["grad_types"].values()) == {"DTensor"}
        assert not [w for w in got["warnings"] if "view" in w], got["warnings"]   # FSDP2's view warning
        rows = slice(rank * B, (rank + 1) * B)
        torch.testing.assert_close(got["logp"], logp.detach()[rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["ent"], ent.detach()[rows], rtol=1e-6, atol=1e-6)
        # a rank's own loss is not divided by world: its hidden gradient is world times the share
        torch.testing.assert_close(got["x_grad"] / world, x.grad[rows], rtol=1e-5, atol=1e-6)
        assert set(got["grads"]) == {n for n, _ in model.named_parameters()} == {
            "body.weight", "body.bias", "head.weight", "head.bias"}
        for name, p in model.named_parameters():
            assert got["grads"][name].shape == p.grad.shape, name
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
    assert (logp.detach()[0, 1], logp.detach()[-1, 0]) == (0.0, 0.0)   # ignore_index reached the op
