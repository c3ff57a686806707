"""The sampler's keywords with ``process_group=`` (softcap, keep mask and ids, top_k, top_p, min_p,
candidate labels, logits_dtype, topk_logprobs, a per-row temperature, sampler="hf" / "sglang"): one
spawned gloo group of four per backend runs every case in groups of 1, 2 and 4 ranks
(:func:`logprob_registry.testing.sections._distributed_cases.program`, its sampler family); here the results are
compared with each other and with the unsharded float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch

import logprob_registry as lr
from logprob_registry import processing, truncation
from logprob_registry import reference as ref
from logprob_registry.call import validate
from logprob_registry.distributed import launch, support
from logprob_registry.testing.sections import _distributed_cases as dc
from logprob_registry.testing.sections import _distributed_sampler as ds

NAMES = tuple(ds.sampler_cases())
KINDS = ("single", "pair", "world")


@functools.lru_cache(maxsize=None)
def spawned(backend: str):
    """Every rank's results for every case, from one group of four (shared by the tests below)."""
    results = launch.run(4, dc.program, backend, "cpu", {"sampler": NAMES}, timeout=600, collective_timeout=120)
    return [r.unwrap()["sampler"] for r in results]


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_every_rank_gets_the_unsharded_result_and_gradient(backend):
    """Every case in groups of 1, 2 and 4: every rank's outputs equal (bits) and within the contract of
    the unsharded float64 reference (-inf exactly where it has -inf: a label outside the kept set);
    each shard gradient equals the reference gradient's columns (the complete hidden gradient on
    every rank); with chunked (group_invariant) outputs and shard gradients are the same bits in
    every group size. Bad input raises on every rank of the group of four, without a hang."""
    ranks = spawned(backend)
    assert ds.sampler_problems(ranks, NAMES, invariant=backend == "chunked") == []


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_the_cases_drop_some_labels_on_every_rank(backend):
    """The cases above are not vacuous: truncating ones give -inf at some labels and finite values at
    others, on every rank of the group of four."""
    ranks = spawned(backend)
    for name in ("keep-ids", "top_k-fp32", "candidates", "all-bf16", "hidden-fp32", "min_p-fp32", "top_p-top_k-bf16",
                 "hidden-top_p", "per_row-temperature-bf16", "hidden-per_row-temperature", "hf-bf16", "sglang-bf16",
                 "hidden-sglang-top_p"):
        for rank in range(4):
            lp = ranks[rank]["world"][name][0][0]
            assert torch.isneginf(lp).any() and torch.isfinite(lp).any(), (name, rank)


# ------------------------------------------------------------------- in this process, a group of one
def _logits(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(dtype)


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_a_label_outside_the_kept_set_gives_minus_inf_and_a_zero_gradient(world, backend):
    """Upstream gradient 1 at every label, dropped ones included: the dropped labels pass nothing on
    (their log-probability is the constant -inf), as in the unsharded reference."""
    x = _logits((4, 8192)).requires_grad_(True)
    labels = torch.tensor([5, 17, 4000, 8191])
    labels[0] = x.detach()[0].argmax()
    kw = dict(top_k=20, softcap=6.0)
    lp = lr.logprobs_from_logits(x, labels, process_group=world, backend=backend, **kw)
    assert torch.isneginf(lp[1:]).all() and torch.isfinite(lp[0])
    (g,) = torch.autograd.grad(lp, x, torch.ones_like(lp))
    assert torch.equal(g[1:], torch.zeros_like(g[1:]))
    xd = x.detach().double().requires_grad_(True)
    want = ref.logprobs(xd, labels, **kw)
    (gw,) = torch.autograd.grad(want, xd, torch.ones_like(want))
    torch.testing.assert_close(g.double(), gw, rtol=1e-5, atol=1e-6)


def _truncations(g, n):
    """Per-row ``top_k``, ``min_p`` and ``top_p`` for ``n`` rows, drawn from ``g``, each off on some rows."""
    top_k = torch.randint(0, 60, (64,), generator=g)
    top_k[::5] = 0
    min_p = torch.rand(64, generator=g) * 0.2
    min_p[::3] = 0.0
    top_p = 0.5 + torch.rand(64, generator=g) * 0.5
    top_p[::4] = 1.0
    return top_k, min_p, top_p


def test_per_row_top_k_top_p_and_min_p_equal_single_row_calls_bitwise(world):
    """64 rows with random top_k, top_p and min_p (some rows off), a softcap and entropy: each row
    equals the call of that row alone with its values as numbers, bitwise, with a group (chunked)."""
    g = torch.Generator().manual_seed(3)
    x = _logits((64, 8192), torch.bfloat16, seed=4)
    labels = torch.randint(0, 8192, (64,), generator=g)
    labels[::2] = x[::2].float().argmax(-1)
    top_k, min_p, top_p = _truncations(g, 64)
    lp, ent = lr.logprobs_and_entropy(x, labels, process_group=world, backend="chunked", top_k=top_k, min_p=min_p,
                                      top_p=top_p, softcap=7.0)
    assert torch.isneginf(lp).any() and torch.isfinite(lp).any()
    for i in range(64):
        k, p, q = int(top_k[i]), float(min_p[i]), float(top_p[i])
        one = lr.logprobs_and_entropy(x[i:i + 1], labels[i:i + 1], process_group=world, backend="chunked",
                                      top_k=k or None, min_p=p or None, top_p=q, softcap=7.0)
        assert torch.equal(lp[i:i + 1], one[0]) and torch.equal(ent[i:i + 1], one[1]), i


def test_shard_lists_merge_to_the_same_top_k_whatever_the_split():
    """Each shard's top-k (value, id) lists, concatenated in vocabulary order and merged, give the
    global top-k bits and ids whatever the number of shards (ties by smaller id)."""
    y = _logits((5, 4 * 4096)).round()  # many ties
    want = processing.top_list(y, 0, 50)
    for parts in (2, 4):
        width = y.shape[1] // parts
        lists = [processing.top_list(y[:, r * width:(r + 1) * width], r * width, 50) for r in range(parts)]
        got = processing.merge_lists(torch.cat([v for v, _ in lists], 1), torch.cat([i for _, i in lists], 1), 50)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[1], truncation.topk_ids(y, 50))


def test_per_row_temperature_and_every_order_pass_the_support_check():
    def reason(**kw):
        return support.unsupported_reason(validate("logprobs", dict(
            logits=torch.zeros(2, 8), labels=torch.zeros(2, dtype=torch.long), process_group=object(), **kw)))

    assert reason(temperature=torch.tensor([0.5, 1.0])) == ""
    assert reason(top_p=0.9, sampler="sglang") == "" and reason(top_k=3, min_p=0.1, sampler="hf") == ""
    assert reason(min_p=torch.tensor([0.0, 0.1]), top_k=torch.tensor([0, 3]), top_p=torch.tensor([1.0, 0.5])) == ""
    assert "support=" in support.unsupported_reason(validate("kl_divergence", dict(  # still refused, with a sentence
        student=torch.zeros(2, 8), teacher=torch.zeros(2, 8), support=torch.arange(3).expand(2, 3),
        process_group=object())))


@pytest.mark.parametrize("order", ["vllm", "hf", "sglang"])
def test_per_row_values_and_temperature_equal_single_row_calls_bitwise(world, order):
    """64 rows with random temperature, top_k, top_p and min_p (some rows off) in ``order``: each row
    equals the call of that row alone with its values as numbers, bitwise, with a group (chunked);
    the kept sets equal the unsharded reference's but for a token at a top_p boundary."""
    g = torch.Generator().manual_seed(5)
    vocab = 4096
    x = _logits((64, vocab), torch.bfloat16, seed=6)
    labels = torch.randint(0, vocab, (64,), generator=g)
    labels[::2] = x[::2].float().argmax(-1)
    temperature = 0.5 + torch.rand(64, generator=g)
    temperature[::6] = 1.0
    top_k, min_p, top_p = _truncations(g, 64)
    kw = dict(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p, sampler=order)
    lp, ent = lr.logprobs_and_entropy(x, labels, process_group=world, backend="chunked", **kw)
    assert torch.isneginf(lp).any() and torch.isfinite(lp).any()
    for i in range(64):
        one = dict(temperature=float(temperature[i]), top_k=int(top_k[i]) or None, min_p=float(min_p[i]) or None,
                   top_p=float(top_p[i]), sampler=order)
        got = lr.logprobs_and_entropy(x[i:i + 1], labels[i:i + 1], process_group=world, backend="chunked", **one)
        assert torch.equal(lp[i:i + 1], got[0]) and torch.equal(ent[i:i + 1], got[1]), i
    every = torch.arange(vocab).expand(64, vocab)
    kept = torch.isfinite(lr.logprobs_from_logits(x, every, process_group=world, backend="chunked", **kw))
    differ = (kept != truncation.kept_tokens(x, **kw)).sum(-1)
    assert int(differ.max()) <= 1 and int((differ > 0).sum()) <= 3, differ


@pytest.mark.parametrize("order", ["hf", "sglang"])
def test_ties_at_the_boundary_follow_the_engine(world, order):
    """Integer logits (many ties): top_k cuts through a tie; transformers keeps every copy of the
    k-th value, SGLang exactly k tokens, the lower ids first: the kept set is the reference's."""
    x = _logits((6, 8192)).round()
    every = torch.arange(8192).expand(6, 8192)
    for kw in (dict(top_k=7), dict(top_k=7, top_p=0.6), dict(top_p=0.5, min_p=0.1)):
        kw["sampler"] = order
        kept = torch.isfinite(lr.logprobs_from_logits(x, every, process_group=world, backend="naive", **kw))
        assert torch.equal(kept, truncation.kept_tokens(x, **kw)), kw
    if order == "sglang":
        assert (kept.sum(-1) >= 1).all()
        top7 = torch.isfinite(lr.logprobs_from_logits(x, every, process_group=world, backend="naive", top_k=7,
                                                      sampler=order))
        assert (top7.sum(-1) == 7).all()


def test_top_p_keeps_the_reference_set_but_for_rounding_at_the_boundary(world):
    """All 16384 tokens as candidate labels: the kept set (finite log-probabilities) equals vLLM's
    procedure on the unsharded row (truncation.kept_tokens) in at least 95% of the rows; elsewhere
    by one token, at the top_p boundary (the mass above it summed in another order)."""
    rows = disagree = 0
    vocab = 16384
    for seed in range(3):
        x = _logits((16, vocab), torch.bfloat16, seed=seed) * (1 + seed)
        every = torch.arange(vocab).expand(16, vocab)
        for kw in (dict(top_p=0.9, top_k=50), dict(top_p=0.9), dict(top_p=0.95, min_p=0.02)):
            got = torch.isfinite(lr.logprobs_from_logits(x, every, process_group=world, backend="chunked", **kw))
            differ = (got != truncation.kept_tokens(x, **kw)).sum(-1)
            assert int(differ.max()) <= 1, kw
            rows += differ.numel()
            disagree += int((differ > 0).sum())
    assert disagree <= 0.05 * rows, (disagree, rows)


def test_the_supported_keywords_pass_the_support_check():
    call = validate("logprobs", dict(logits=torch.zeros(2, 8), labels=torch.zeros(2, 3, dtype=torch.long),
                                     process_group=object(), softcap=2.0, top_k=3,
                                     keep=torch.ones(2, 8, dtype=torch.bool)))
    assert support.unsupported_reason(call) == ""
