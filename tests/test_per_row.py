"""Per-row sampler parameters (``temperature``, ``top_k``, ``top_p``, ``min_p`` as tensors of the
positions' shape) and ``sampler=``'s orders: a row's result is bitwise that of the call with the
row's values as numbers, on every op and every backend that declares the feature ``per_row``."""

import pytest
import torch

import logprob_registry as lr
from logprob_registry import truncation

ROWS, VOCAB, HIDDEN = 64, 97, 16
BACKENDS = ("naive", "chunked")
ORDERS = ("vllm", "hf", "sglang")


def _parameters(seed: int = 0):
    """64 rows of random parameters, some rows off for each truncation."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(ROWS, generator=g) * 1.5 + 0.3
    temperature[::7] = 1.0
    top_k = torch.randint(1, 40, (ROWS,), generator=g)
    top_k[::5] = 0
    top_k[3] = -1
    top_k[4] = VOCAB + 3
    top_p = torch.rand(ROWS, generator=g) * 0.9 + 0.05
    top_p[::3] = 1.0
    min_p = torch.rand(ROWS, generator=g) * 0.3
    min_p[::4] = 0.0
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _row(params, i):
    """Row ``i``'s values as numbers (what the per-row call must reproduce bitwise)."""
    return dict(temperature=float(params["temperature"][i]), top_k=int(params["top_k"][i]),
                top_p=float(params["top_p"][i]), min_p=float(params["min_p"][i]))


def _logits(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, VOCAB, generator=g) * 3
    x[5, :10] = x[5, 10]  # a tie, which engines break differently
    x[6, 3] = float("-inf")
    return x


def _labels(x):
    g = torch.Generator().manual_seed(2)
    top = x.topk(5, -1).indices  # labels among the likely tokens: most are kept
    pick = torch.randint(0, 5, (ROWS,), generator=g)
    return top.gather(1, pick[:, None]).squeeze(1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (so -0.0 differs from 0.0, and NaN equals the same NaN)."""
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    if t.dtype == torch.float64:
        return t.contiguous().view(torch.int64)
    return t


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), (what, a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_rows_equal_single_row_calls_bitwise(backend, order):
    params = _parameters()
    x = _logits()
    y = _labels(x)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.8
    calls = {
        "logprobs": lambda rows, kw: lr.logprobs_from_logits(x[rows], y[rows], **kw),
        "entropy": lambda rows, kw: lr.entropy_from_logits(x[rows], **kw),
        "logprobs_and_entropy": lambda rows, kw: lr.logprobs_and_entropy(x[rows], y[rows], **kw),
        "topk_logprobs": lambda rows, kw: lr.topk_logprobs(x[rows], 4, **kw),
        "logprobs_from_hidden": lambda rows, kw: lr.logprobs_from_hidden(hidden[rows], weight, y[rows],
                                                                         return_entropy=True, **kw),
    }
    for op, call in calls.items():
        whole = call(slice(None), dict(params, sampler=order, backend=backend))
        whole = whole if isinstance(whole, tuple) else (whole,)
        for i in range(ROWS):
            one = call(slice(i, i + 1), dict(_row(params, i), sampler=order, backend=backend))
            one = one if isinstance(one, tuple) else (one,)
            for a, b in zip(whole, one):
                _assert_bitwise(a[i:i + 1], b, (op, order, i))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_of_rows_equal_single_row_calls(backend):
    """The gradient too: a row's is that of its own call (bitwise on the CPU)."""
    params = _parameters(seed=4)
    x = _logits(seed=5)
    y = _labels(x)

    def grad(rows, kw):
        leaf = x[rows].clone().requires_grad_(True)
        lp, ent = lr.logprobs_and_entropy(leaf, y[rows], backend=backend, **kw)
        (lp.clamp(min=-50).sum() + 0.5 * ent.sum()).backward()
        return leaf.grad

    whole = grad(slice(None), params)
    for i in range(ROWS):
        _assert_bitwise(whole[i:i + 1], grad(slice(i, i + 1), _row(params, i)), i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_alone_per_row_and_per_sequence_broadcast(backend):
    """A per-row temperature without truncation (the RL case), and one value per sequence ``(B, 1)``
    broadcast over the positions of ``(B, T)``."""
    x = _logits(seed=6).view(8, 8, VOCAB)
    y = _labels(x.view(ROWS, VOCAB)).view(8, 8)
    per_sequence = torch.linspace(0.5, 1.5, 8).view(8, 1)
    out = lr.logprobs_and_entropy(x, y, temperature=per_sequence, backend=backend)
    for b in range(8):
        want = lr.logprobs_and_entropy(x[b], y[b], temperature=float(per_sequence[b, 0]), backend=backend)
        for got, w in zip(out, want):
            _assert_bitwise(got[b], w, b)
    top_p = torch.full((8, 1), 0.8)
    top_p[2] = 1.0
    got = lr.entropy_from_logits(x, temperature=per_sequence, top_p=top_p, backend=backend)
    for b in range(8):
        want = lr.entropy_from_logits(x[b], temperature=float(per_sequence[b, 0]), top_p=float(top_p[b, 0]),
                                      backend=backend)
        _assert_bitwise(got[b], want, b)


def test_per_row_and_sampler_need_their_features():
    """A backend that does not declare per_row / sampler is not chosen for such calls."""
    x = _logits()
    key = lr.ops.validate("entropy", dict(logits=x, temperature=torch.ones(ROWS), top_k=2)).key
    assert {"per_row", "top_k"} <= key.features
    key = lr.ops.validate("entropy", dict(logits=x, top_k=2, sampler="hf")).key
    assert "sampler" in key.features and "per_row" not in key.features
    # the order matters only where top_k, top_p or min_p truncate: a temperature-only call needs nothing
    call = lr.ops.validate("entropy", dict(logits=x, temperature=0.5, sampler="sglang"))
    assert call.options["sampler"] is None and "sampler" not in call.features
    assert lr.ops.validate("entropy", dict(logits=x, top_k=2, sampler="vllm")).options["sampler"] is None
    for name in ("per_row", "sampler"):
        assert name in lr.opspec.FEATURES


# ------------------------------------------------------------------------------ the engines' orders
def _hf_kept(x, temperature, top_k, top_p, min_p):
    """The tokens transformers' generate warpers keep, in its order (float32 scores)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = x.float()
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p),
                   MinPLogitsWarper(min_p)):
        scores = warper(None, scores)
    return torch.isfinite(scores)


def _order_rows(seed=7, rows=256, vocab=50, temperature=0.8):
    """Rows where the orders disagree: probabilities (after the temperature) of about 0.5, 0.35 and
    0.06 over a tail of 0.09 spread thin. min_p=0.1 drops the tail; vLLM then applies top_p=0.93 to
    the renormalised survivors and drops the 0.06 token, transformers applies top_p first, where
    the tail's mass comes before it in the cumulative sum, and keeps it. Half the rows random."""
    g = torch.Generator().manual_seed(seed)
    head = torch.tensor([0.5, 0.35, 0.06]) * (1 + 0.05 * torch.rand(rows, 3, generator=g))
    tail = torch.rand(rows, vocab - 3, generator=g) + 0.5
    probs = torch.cat([head, 0.09 * tail / tail.sum(-1, keepdim=True)], -1)
    x = temperature * probs.log()
    x[rows // 2:] = torch.randn(rows - rows // 2, vocab, generator=g) * 3
    return x[:, torch.randperm(vocab, generator=g)]


ORDER_CASE = dict(temperature=0.8, top_k=20, top_p=0.93, min_p=0.1)


def test_hf_order_equals_transformers_warpers():
    pytest.importorskip("transformers")
    x = _order_rows()
    kw = ORDER_CASE
    want = _hf_kept(x, **kw)
    hf = truncation.kept_tokens(x, sampler="hf", **kw)
    assert torch.equal(hf, want)
    vllm = truncation.kept_tokens(x, **kw)
    assert int((vllm != want).any(-1).sum()) >= 64  # the rows were built so that the orders disagree
    # and the public functions follow it: a token vLLM's order drops and transformers' keeps
    row, label = ((hf & ~vllm).nonzero()[0]).tolist()
    y = torch.tensor([label])
    for backend in BACKENDS:
        assert lr.logprobs_from_logits(x[row:row + 1], y, sampler="hf", backend=backend, **kw).isfinite().all()
        assert lr.logprobs_from_logits(x[row:row + 1], y, backend=backend, **kw).isneginf().all()
    # per row: each row's values as transformers' own call with them
    params = dict(temperature=torch.rand(64) + 0.5, top_k=torch.randint(1, 8, (64,)),
                  top_p=torch.rand(64) * 0.5 + 0.5, min_p=torch.rand(64) * 0.4)
    rows = truncation.kept_tokens(x[:64], sampler="hf", **params)
    for i in range(64):
        one = {k: (v[i].item()) for k, v in params.items()}
        assert torch.equal(rows[i:i + 1], _hf_kept(x[i:i + 1], **one)), i


def _sglang_kept(x, temperature, top_k, top_p, min_p):
    """SGLang's top_k_top_p_min_p_sampling_from_probs_torch (python/sglang/srt/layers/sampler.py),
    transcribed: which tokens can be sampled (probs_sort left non-zero). Rows here have no zero
    probabilities, so "kept" and "non-zero" coincide."""
    rows = x.shape[0]
    temperatures = torch.full((rows, 1), temperature)  # SGLang's per-request tensors
    top_ks, top_ps, min_ps = (torch.full((rows,), v) for v in (top_k, top_p, min_p))
    logits = x.float().div_(temperatures)
    probs = torch.softmax(logits, dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[torch.arange(0, probs.shape[-1]).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    min_p_thresholds = probs_sort[:, 0] * min_ps
    probs_sort[probs_sort < min_p_thresholds.view(-1, 1)] = 0.0
    kept = torch.zeros_like(probs, dtype=torch.bool)
    return kept.scatter(1, probs_idx, probs_sort > 0)


def test_sglang_order_equals_its_transcription_and_breaks_ties_by_position():
    x = _order_rows(seed=8)
    kw = ORDER_CASE
    assert torch.equal(truncation.kept_tokens(x, sampler="sglang", **kw), _sglang_kept(x, **kw))
    # a tie at the k-th value: vLLM and transformers keep every copy, SGLang exactly k (the lower ids)
    tie = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    assert truncation.kept_tokens(tie, top_k=2, sampler="sglang").tolist() == [[True, True, False, False, False, False]]
    assert truncation.kept_tokens(tie, top_k=2).tolist() == [[True, True, True, True, False, False]]
    assert truncation.kept_tokens(tie, top_k=2, sampler="hf").tolist() == [[True, True, True, True, False, False]]
    for backend in BACKENDS:
        lp = lr.logprobs_from_logits(tie.expand(3, 6), torch.tensor([1, 2, 3]), top_k=2, sampler="sglang",
                                     backend=backend)
        assert lp[0].isfinite() and lp[1:].isneginf().all(), backend


def test_kl_divergence_temperature_stays_one_number():
    x = _logits()
    with pytest.raises(TypeError, match="kl_divergence's temperature must be one positive number, got a tensor "
                                        r"of shape \(64,\)"):
        lr.kl_divergence(x, x.flip(0), temperature=torch.ones(ROWS))
