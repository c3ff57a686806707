"""User code that calls the library compiles with ``torch.compile(fullgraph=True)``: the public
functions become the custom op ``logprob_registry::call`` while dynamo traces, whose eager body
is the ordinary validated dispatch (logprob_registry/traced.py)."""

import pytest
import torch
import torch._dynamo.utils

import logprob_registry as lr
from logprob_registry import reference as ref

calls = []


def _spy(logits, labels, *, temperature, ignore_index, inplace_backward):
    calls.append(tuple(logits.shape))
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32)


class Spy:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-compile-spy", ops={"logprobs": _spy}, priority=-50))


def _inputs(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, 300, generator=g) * 3
    y = torch.randint(0, 300, (2, rows), generator=g)
    y[0, 0] = -100
    h = torch.randn(2, rows, 32, generator=g)
    return x, y, h


W = torch.randn(300, 32, generator=torch.Generator().manual_seed(9)) * 0.2
B = torch.randn(300, generator=torch.Generator().manual_seed(10))


def step(x, y, h, w, b, t):
    """Every public function, as a training step would call them."""
    lp = lr.logprobs_from_logits(x, y, temperature=t, ignore_index=-100)
    lp2, ent = lr.logprobs_and_entropy(x * 2, y, ignore_index=-100)
    e = lr.entropy_from_logits(x, temperature=1.3)
    hl, he = lr.logprobs_from_hidden(h, w, y, bias=b, ignore_index=-100, return_entropy=True)
    return lp.sum() + lp2.sum() + 0.5 * ent.sum() + e.sum() + hl.sum() + 0.3 * he.sum() + lr.logprobs_from_hidden(
        h, w, y.clamp(min=0)).sum()


def _value_and_grads(fn, x, y, h, t):
    leaves = [z.clone().requires_grad_(True) for z in (x, h, W, B)]
    out = fn(leaves[0], y, leaves[1], leaves[2], leaves[3], t)
    return [out.detach()] + list(torch.autograd.grad(out, leaves))


def test_fullgraph_compile_gives_the_eager_results_and_gradients_without_graph_breaks():
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for rows, t in ((5, 0.7), (9, 0.8)):  # a new shape and temperature: dynamic, no failure
        x, y, h = _inputs(rows, seed=rows)
        want = _value_and_grads(step, x, y, h, t)
        got = _value_and_grads(compiled, x, y, h, t)
        for name, g, w in zip(("loss", "logits", "hidden", "weight", "bias"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_under_compile_the_label_range_is_still_checked_at_run_time():
    x, y, _ = _inputs(4)
    y = y.clamp(min=0)
    compiled = torch.compile(lambda a, b: lr.logprobs_from_logits(a, b).sum(), fullgraph=True)
    compiled(x, y)
    y[1, 2] = 301
    with pytest.raises(ValueError, match=r"label 301 at position \(1, 2\) is out of range"):
        compiled(x, y)
    assert lr.get_registry().broken() == {}


def test_under_compile_the_backend_is_chosen_at_run_time():
    reg = lr.get_registry()
    reg.add_plugin(Spy(), name="test-compile-spy-plugin")
    try:
        calls.clear()
        x, y, _ = _inputs(3)
        explicit = torch.compile(lambda a, b: lr.logprobs_from_logits(a, b, backend="test-compile-spy"), fullgraph=True)
        torch.testing.assert_close(explicit(x, y.clamp(min=0)), ref.logprobs(x, y.clamp(min=0), dtype=torch.float32))
        assert calls == [(2, 3, 300)]
        automatic = torch.compile(lambda a, b: lr.logprobs_from_logits(a, b), fullgraph=True)
        automatic(x, y.clamp(min=0))
        assert len(calls) == 1  # the automatic choice is not the spy...
        with lr.use_backend("test-compile-spy"):  # ...unless this thread forces it when the graph runs
            automatic(x, y.clamp(min=0))
        assert len(calls) == 2
    finally:
        reg.remove_plugin("test-compile-spy-plugin")


def test_eager_calls_while_another_thread_compiles():
    """``torch.compiler.is_compiling()`` is one flag for the process: while any thread compiles it
    is True in all of them. An eager call then still runs eagerly: the label range is checked,
    ``torch.func`` works, and nothing recurses through the custom op."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is None:
        pytest.fail("this torch has no torch.compiler._compile_session_context to set the process-wide flag with")
    x, y, _ = _inputs(3)
    with session():
        assert torch.compiler.is_compiling()
        with pytest.raises(ValueError, match="out of range"):
            lr.logprobs_from_logits(x, y + 1000)
        got = torch.func.grad(lambda t: lr.logprobs_from_logits(t, y.clamp(min=0)).sum())(x)
        x64 = x.double().requires_grad_(True)
        ref.logprobs(x64, y.clamp(min=0)).sum().backward()
        torch.testing.assert_close(got, x64.grad.float(), rtol=1e-5, atol=1e-5)


def sampler_step(x, y, cand):
    """The sampler's keywords, candidates and topk_logprobs through the same custom op."""
    lp = lr.logprobs_from_logits(x, y, temperature=0.9, softcap=30.0, top_k=50, top_p=0.9, ignore_index=-100)
    ent = lr.entropy_from_logits(x, min_p=0.05)
    values, ids = lr.topk_logprobs(x, 5, temperature=0.8)
    both = lr.logprobs_from_logits(x, cand)
    finite = lambda t: torch.where(torch.isinf(t), torch.zeros_like(t), t)  # noqa: E731
    return finite(lp).sum() + ent.sum() + finite(values).sum() + 0.01 * ids.sum() + finite(both).sum()


def test_fullgraph_compile_with_the_samplers_keywords_candidates_and_topk():
    x, y, _ = _inputs(6, seed=3)
    cand = torch.randint(0, 300, (2, 6, 4), generator=torch.Generator().manual_seed(4))
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(sampler_step, fullgraph=True)
    for fn in (sampler_step, compiled):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, y, cand)
        (grad,) = torch.autograd.grad(out, leaf)
        if fn is sampler_step:
            want = (out.detach(), grad)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want[1], rtol=1e-5, atol=1e-5)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def per_row_step(x, y, t, k, p, m):
    """Per-row temperature, top_k, top_p and min_p (tensors), and a sampler= order."""
    lp, ent = lr.logprobs_and_entropy(x, y, temperature=t, top_k=k, top_p=p, min_p=m, ignore_index=-100)
    hf = lr.logprobs_from_logits(x, y.clamp(min=0), temperature=t[:, :1], top_p=p, sampler="hf")
    values, _ = lr.topk_logprobs(x, 3, temperature=t, min_p=m, sampler="sglang")
    return lp.sum() + 0.5 * ent.sum() + hf.clamp(min=-30).sum() + values.clamp(min=-30).sum()


def test_fullgraph_compile_with_per_row_tensor_parameters():
    x, y, _ = _inputs(6, seed=5)
    g = torch.Generator().manual_seed(6)
    t = torch.rand(2, 6, generator=g) + 0.5
    k = torch.randint(0, 20, (2, 6), generator=g)
    p = torch.rand(2, 1, generator=g) * 0.5 + 0.5  # one value per sequence, broadcast over positions
    m = torch.rand(2, 6, generator=g) * 0.2
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(per_row_step, fullgraph=True)
    results = []
    for fn in (per_row_step, compiled):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, y, t, k, p, m)
        (grad,) = torch.autograd.grad(out, leaf)
        results.append((out.detach(), grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
