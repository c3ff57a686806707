"""The sampler's processing (softcap, top_k, top_p, min_p, keep), candidates and topk_logprobs
against this file's own float32 transcription of vLLM's sampler; the plain code paths bitwise
unchanged; chunked's memory bounds; the routing of keywords to the backends that declare them; and
the conformance suite's semantics section failing deliberately wrong backends."""

from __future__ import annotations

import math

import pytest
import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry import truncation
from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, peak_extra_bytes, pin_mmap_threshold
from logprob_registry.kernels import chunked
from logprob_registry.kernels.chunked import _hidden, _sampler
from logprob_registry.registry import Key
from logprob_registry.testing.harness import Harness
from logprob_registry.testing.sections.semantics import SemanticsSection

NEG = float("-inf")


# --------------------------------------------------------------------------- the transcription
def vllm_processed_logprobs(logits, *, temperature=1.0, softcap=None, top_k=None, top_p=None, min_p=None):
    """vLLM v0.33.0's V1 sampler in float32, op for op (sampler.py: fp32 cast, ``div_`` by the
    temperature tensor; builtin.py MinPLogitsProcessor; topk_topp_sampler.py
    apply_top_k_top_p_pytorch with a stable sort), then ``log_softmax`` in fp32. The softcap is
    computed exactly and rounded to float32 once, as this library defines it (vLLM computes it in
    the model's head dtype; docs/sampler.md)."""
    x = logits
    if softcap is not None:
        x64 = x.double()
        x = torch.where(torch.isneginf(x64), x64, torch.tanh(x64 / softcap) * softcap)
    x = x.to(torch.float32)
    x = x / torch.tensor([temperature], dtype=torch.float32)
    if min_p is not None:
        probs = torch.nn.functional.softmax(x, dim=-1)
        adjusted = torch.amax(probs, dim=-1, keepdim=True).mul_(torch.tensor(min_p, dtype=torch.float32))
        x = x.masked_fill(probs < adjusted, NEG)
    if top_k is not None or top_p is not None:
        vocab = x.shape[-1]
        s, idx = x.sort(dim=-1, descending=False, stable=True)
        if top_k is not None:
            kth = s.gather(-1, torch.full(s.shape[:-1] + (1,), vocab - top_k))
            s = s.masked_fill(s < kth, NEG)
        if top_p is not None:
            cum = s.softmax(dim=-1).cumsum(dim=-1)
            mask = cum <= 1 - torch.tensor(top_p, dtype=torch.float32)
            mask[..., -1] = False
            s = s.masked_fill(mask, NEG)
        x = torch.empty_like(x).scatter_(-1, idx, s)
    return x.log_softmax(dim=-1, dtype=torch.float32)


def _every_logprob(logits, backend, **kw):
    """Every token's processed logprob ``(..., V)`` from a backend: all V tokens as candidates."""
    vocab = logits.shape[-1]
    labels = torch.arange(vocab).expand(logits.shape[:-1] + (vocab,))
    return lr.logprobs_from_logits(logits, labels, backend=backend, **kw)


KEYWORDS = {
    "softcap": dict(softcap=4.0),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "top_k-top_p": dict(top_k=50, top_p=0.6),
    "all": dict(softcap=5.0, min_p=0.01, top_k=100, top_p=0.9),
}


@pytest.mark.parametrize("keywords", list(KEYWORDS))
@pytest.mark.parametrize("vocab, rows, dtype", [(512, 12, torch.bfloat16), (512, 12, torch.float32),
                                                 (151936, 3, torch.bfloat16)])
def test_against_the_float32_transcription(keywords, vocab, rows, dtype):
    """Same kept set as the transcription, exactly (bf16: many ties), values within fp32 rounding,
    entropy of the same distribution; naive, chunked and the float64 reference."""
    kw = dict(KEYWORDS[keywords], temperature=0.7)
    g = torch.Generator().manual_seed(vocab + rows)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    want = vllm_processed_logprobs(x, **kw)
    kept = torch.isfinite(want)
    entropy = -(torch.where(kept, want.exp() * want, torch.zeros(()))).double().sum(-1)
    assert kept.sum() < kept.numel() or keywords == "softcap"
    for name, got in [("reference", ref.processed_logprobs(x, **kw)),
                      ("naive", _every_logprob(x, "naive", **kw)), ("chunked", _every_logprob(x, "chunked", **kw))]:
        assert torch.equal(torch.isfinite(got), kept), f"{name}: kept set differs from vLLM's ({keywords})"
        err = (got[kept].double() - want[kept].double()).abs().max().item()
        assert err < 2e-5, f"{name}: values differ from the transcription by {err}"
    for backend in ("naive", "chunked"):
        h = lr.entropy_from_logits(x, backend=backend, **kw).double()
        assert (h - entropy).abs().max().item() < 1e-4, f"{backend}: entropy of the processed distribution"


def test_transcription_tie_rules_on_integer_logits():
    """Heavily tied integer logits: top_k keeps every tie of the k-th value; top_p drops the lower
    ids of a tie it splits (stable ascending sort)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (64, 40), generator=g).float()
    for kw in (dict(top_k=5), dict(top_p=0.5), dict(top_k=9, top_p=0.7), dict(min_p=0.3, top_p=0.4)):
        want = torch.isfinite(vllm_processed_logprobs(x, **kw))
        for backend in ("naive", "chunked"):
            got = torch.isfinite(_every_logprob(x, backend, **kw))
            assert torch.equal(got, want), (backend, kw)
    row = torch.tensor([[0.0, 0.0, 0.0, 0.0]])  # four equal tokens, top_p = 0.5: two kept, ids 2 and 3
    assert torch.isfinite(_every_logprob(row, "chunked", top_p=0.5)).tolist() == [[False, False, True, True]]


# --------------------------------------------------------------------------- bitwise no change
def test_no_keyword_runs_the_old_code_bitwise():
    """Calls without keywords run the code paths as they were: chunked's row loops and fused op,
    naive's textbook formula, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 1000, generator=g)
    y = torch.randint(0, 1000, (3, 7), generator=g)
    for temperature in (1.0, 0.7):
        assert torch.equal(lr.logprobs_from_logits(x, y, temperature=temperature, backend="chunked"),
                           chunked._run(x, y, temperature, None, False, True, False))
        assert torch.equal(lr.entropy_from_logits(x, temperature=temperature, backend="chunked"),
                           chunked._run(x, None, temperature, None, False, False, True))
        both = lr.logprobs_and_entropy(x, y, temperature=temperature, backend="chunked")
        old = chunked._run(x, y, temperature, None, False, True, True)
        assert all(torch.equal(a, b) for a, b in zip(both, old))
        naive = lr.logprobs_from_logits(x, y, temperature=temperature, backend="naive")
        textbook = (x / temperature if temperature != 1.0 else x).log_softmax(-1).gather(-1, y[..., None])[..., 0]
        assert torch.equal(naive, textbook)
    h, w = torch.randn(2, 5, 32, generator=g), torch.randn(300, 32, generator=g) * 0.3
    yh = torch.randint(0, 300, (2, 5), generator=g)
    for ret in (False, True):
        new = lr.logprobs_from_hidden(h, w, yh, return_entropy=ret, backend="chunked")
        old = _hidden.logprobs_from_hidden(h, w, yh, bias=None, temperature=1.0, ignore_index=None, return_entropy=ret)
        assert all(torch.equal(a, b) for a, b in zip(new if ret else (new,), old if ret else (old,)))


def test_keep_everything_changes_values_only_within_rounding():
    """A truncation that keeps every token takes the truncating path: same values up to rounding."""
    x = torch.randn(4, 300)
    y = torch.randint(0, 300, (4,))
    plain = lr.logprobs_from_logits(x, y, backend="chunked")
    kept_all = lr.logprobs_from_logits(x, y, backend="chunked", keep=torch.ones(4, 300, dtype=torch.bool))
    assert (plain - kept_all).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- logits_dtype and the softcap
def _engine_softcap(logits, cap):
    """The softcap as Hugging Face's Gemma-2 (``modeling_gemma2.py``) and vLLM's ``LogitsProcessor``
    (``vllm/model_executor/layers/logits_processor.py``) compute it on the lm_head's bf16/fp16 logits:
    three ops, each rounded to the logits' dtype."""
    logits = logits / cap
    logits = torch.tanh(logits)
    logits = logits * cap
    return logits


def _every_value(dtype):
    """Every finite value of a 16-bit float dtype, in one tensor."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_dtype_softcap_is_the_engines_three_ops_bitwise(dtype):
    """On every finite bf16 (fp16) logit, the reference's processed logits with ``logits_dtype`` are
    bitwise the engine's three-op softcap cast to float32 (and divided by a float32 temperature), and
    chunked computes the same bits; the softcap computed exactly and rounded once differs."""
    x = _every_value(dtype)
    for cap in (30.0, 50.0, 5.0, 0.7):
        engine = _engine_softcap(x, cap).float()
        got = truncation.processed_logits(x, softcap=cap, logits_dtype=dtype, dtype=torch.float32)
        assert torch.equal(got, engine), (dtype, cap, int((got != engine).sum()))
        scaled = truncation.processed_logits(x, softcap=cap, logits_dtype=dtype, temperature=0.7, dtype=torch.float32)
        assert torch.equal(scaled, engine / torch.tensor(0.7)), (dtype, cap)
        plan = _sampler.make_plan((1, x.numel()), torch.float32, x.device, 1 << 30, temperature=0.7, softcap=cap,
                                  top_k=None, top_p=None, min_p=None, keep=None)
        plan.logits_dtype = dtype
        z, _, _ = _sampler._processed(x.float()[None], plan)
        assert torch.equal(z[0], scaled), (dtype, cap)
        once = truncation.processed_logits(x, softcap=cap, dtype=torch.float32)
        assert not torch.equal(once, engine)


def test_logits_dtype_softcap_special_values_and_gradient():
    """-inf stays -inf (zero gradient), +inf gives the cap, NaN stays NaN; the gradient is
    ``1 - tanh(u)**2`` at the rounded ``u = x / cap``, straight through each rounding, in float64."""
    x = torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, 1.0, -7.25, 29.5, 61.0, -300.0],
                     dtype=torch.bfloat16).double().requires_grad_(True)
    s = truncation.softcapped(x, 30.0, torch.bfloat16)
    engine = _engine_softcap(x.detach()[1:].to(torch.bfloat16), 30.0).double()
    assert s[0].item() == NEG and s[1].item() == 30.0 and math.isnan(s[2].item())
    assert torch.equal(s[3:].detach(), engine[2:])
    s[[0, 1, 3, 4, 5, 6, 7, 8]].sum().backward()
    u = (x.detach() / 30.0).float().to(torch.bfloat16).double()
    want = 1 / torch.cosh(u) ** 2  # = 1 - tanh(u)**2
    assert x.grad[0].item() == 0.0 and x.grad[1].item() == 0.0 and x.grad[2].item() == 0.0
    assert torch.allclose(x.grad[3:], want[3:], rtol=1e-14, atol=1e-16), (x.grad, want)
    assert float((x.grad[3:] - (1 - (s[3:].detach() / 30.0) ** 2)).abs().max()) > 1e-4  # not from the rounded tanh


def _exact_hidden(rows=6, vocab=1000, dim=32, seed=0):
    """Hidden states and an lm_head whose products are exact in float32 (multiples of 1/2048, a few
    thousand of them): any matmul gives the same logits, hence the same bf16 logits, spread to +-60
    as a Gemma-2's under its softcap of 30."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-8, 9, (rows, dim), generator=g).float() / 8
    w = torch.randint(-256, 257, (vocab, dim), generator=g).float() / 256
    return h, w


def test_logits_dtype_softcap_replays_the_engines_logits():
    """``logprobs_from_hidden(..., softcap=30, logits_dtype=bf16)`` gives what a replay of the
    engine's own softcapped bf16 logits gives (``logprobs_from_logits`` without softcap): bitwise in
    naive, within fp32 rounding in chunked, the same kept set in both."""
    h, w = _exact_hidden()
    assert torch.equal(h.double() @ w.double().T, (h @ w.T).double())
    logits = (h @ w.T).to(torch.bfloat16)
    engine = _engine_softcap(logits, 30.0).float()
    y = torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(1))
    y[::2] = engine.argmax(-1)[::2]
    labels = torch.cat([y[:, None], torch.arange(1000).expand(6, 1000)], 1)  # every token, as candidates
    for kw in (dict(temperature=0.7), dict(temperature=0.7, top_k=50, top_p=0.8), dict(min_p=0.05)):
        for backend in ("naive", "chunked"):
            got = lr.logprobs_from_hidden(h, w, labels, softcap=30.0, logits_dtype=torch.bfloat16, backend=backend,
                                          **kw)
            want = lr.logprobs_from_logits(engine, labels, backend=backend, **kw)
            kept = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), kept), (backend, kw)
            if backend == "naive":
                assert torch.equal(got, want), (kw, float((got - want)[kept].abs().max()))
            else:
                assert float((got - want)[kept].abs().max()) < 1e-6, kw
            old = lr.logprobs_from_logits(logits.float(), labels, softcap=30.0, backend=backend, **kw)
            assert float((old - want)[kept & torch.isfinite(old)].abs().max()) > 1e-2, kw  # what 0.1 did


def test_logits_dtype_softcap_gradients_naive_and_chunked_agree():
    """The fused op's gradients through the bf16 softcap: chunked against naive (the reference in
    float32), and against straight-through autograd of the engine's three ops in float64."""
    h0, w0 = _exact_hidden(rows=4, vocab=600)
    y = torch.randint(0, 600, (4,), generator=torch.Generator().manual_seed(2))
    grads = {}
    for backend in ("naive", "chunked"):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = lr.logprobs_from_hidden(h, w, y, softcap=30.0, logits_dtype=torch.bfloat16, temperature=0.8,
                                          top_p=0.95, return_entropy=True, backend=backend)
        (lp.sum() + ent.sum()).backward()
        grads[backend] = (h.grad, w.grad)
    for a, b in zip(*grads.values()):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), float((a - b).abs().max())
    plain = lr.logprobs_from_hidden(h0, w0.requires_grad_(True), y, softcap=30.0, temperature=0.8, top_p=0.95,
                                    backend="chunked")
    plain.sum().backward()
    assert not torch.allclose(w0.grad, grads["chunked"][1], rtol=1e-3, atol=0)  # the rounding is seen


def test_softcap_without_logits_dtype_is_computed_once_as_before():
    """Without logits_dtype the softcap is computed in float64 and rounded once (bitwise), and
    ``logits_dtype=None`` is bitwise the call without it, softcap included, in both backends."""
    x = _every_value(torch.bfloat16)
    x64 = x.double()
    once = torch.where(torch.isneginf(x64), x64, torch.tanh(x64 / 30.0) * 30.0).float()
    assert torch.equal(truncation.processed_logits(x, softcap=30.0, dtype=torch.float32), once)
    h, w = _exact_hidden(rows=3, vocab=500)
    y = torch.randint(0, 500, (3,), generator=torch.Generator().manual_seed(3))
    for backend in ("naive", "chunked"):
        for kw in (dict(softcap=30.0), dict(softcap=30.0, top_p=0.9)):
            a = lr.logprobs_from_hidden(h, w, y, return_entropy=True, backend=backend, **kw)
            b = lr.logprobs_from_hidden(h, w, y, return_entropy=True, backend=backend, logits_dtype=None, **kw)
            assert all(torch.equal(p, q) for p, q in zip(a, b)), (backend, kw)


# --------------------------------------------------------------------------- chunked's memory
def test_chunked_top_p_memory_is_bounded_by_its_workspace():
    """top_p: the extra peak is the chunk workspace (here 1 MiB, so one row of 32768 at a time,
    1.5 MiB of temporaries), whatever the number of rows (4 x 64 rows of bf16 logits, 16 MiB).
    scripts/sampler_measure.py measures 4 x 1024 x 151936."""
    if not pin_mmap_threshold():
        pytest.skip("measuring CPU peak memory needs glibc")
    vocab = 32768
    x = (torch.randn(4, 64, vocab) * 3).to(torch.bfloat16)
    y = torch.randint(0, vocab, (4, 64))
    size = x.numel() * x.element_size()
    chunked.set_workspace_bytes(1 << 20)
    try:
        lr.logprobs_from_logits(x[:1, :2], y[:1, :2], top_p=0.9, backend="chunked")  # warm-up
        best = math.inf
        for _ in range(2):  # other processes can only make a reading larger
            try:
                out, extra = peak_extra_bytes(lambda: lr.logprobs_from_logits(x, y, top_p=0.9, backend="chunked"),
                                              torch.device("cpu"))
            except MemoryMeasurementUnavailable as exc:
                pytest.skip(str(exc))
            best = min(best, extra)
            del out
            if best < 4 << 20:
                break
    finally:
        chunked.set_workspace_bytes(None)
    assert best < 4 << 20, f"top_p allocated {best / 2**20:.1f} MiB; one row's temporaries are 1.5 MiB"
    assert best < 0.25 * size, f"top_p allocated {best / size:.2f}x the logits"


def test_chunked_top_p_sorts_at_most_a_chunk_of_rows(monkeypatch):
    """V = 262144: each sort gets at most the chunk's rows (one here, as 48 bytes a logit exceed
    the 8 MiB default)."""
    sorted_rows = []
    original = truncation.sorted_values

    def spy(y):
        sorted_rows.append(y.shape[0])
        return original(y)

    monkeypatch.setattr(truncation, "sorted_values", spy)
    x = torch.randn(6, 262144)
    lr.logprobs_from_logits(x, torch.zeros(6, dtype=torch.long), top_p=0.9, backend="chunked")
    rows = _sampler.rows_per_chunk(262144, True, chunked.workspace_bytes())
    assert sorted_rows and max(sorted_rows) <= rows == 1, (sorted_rows, rows)
    assert sum(sorted_rows) == 6


def test_chunked_truncation_in_chunks_of_one_row_matches_whole_rows():
    """The decision and values do not depend on the chunk size (the reference's row-wise decision)."""
    x = (torch.randn(9, 700) * 3).to(torch.bfloat16)
    y = torch.randint(0, 700, (9, 3))
    kw = dict(top_p=0.8, top_k=90, min_p=0.01, softcap=5.0, temperature=0.9)
    whole = lr.logprobs_and_entropy(x, y, backend="chunked", **kw)
    chunked.set_workspace_bytes(1)
    try:
        one = lr.logprobs_and_entropy(x, y, backend="chunked", **kw)
    finally:
        chunked.set_workspace_bytes(None)
    assert all(torch.equal(a, b) for a, b in zip(whole, one))


# --------------------------------------------------------------------------- routing
def test_keywords_go_only_to_backends_that_declare_them():
    registry = lr.get_registry()
    key = Key("logprobs", "cpu", torch.float32, False, frozenset({"top_p", "softcap"}))
    reasons = {v.name: v.reason for v in registry.verdicts(key)}
    assert reasons["naive"] is None and reasons["chunked"] is None
    assert reasons["compiled"] in ("does not support softcap, top_p", "does not support top_p") \
        or "torch.compile" in str(reasons["compiled"]), reasons["compiled"]
    x, y = torch.randn(2, 50), torch.zeros(2, dtype=torch.long)
    with pytest.raises(lr.NoEligibleBackendError, match="does not support top_p"):
        lr.logprobs_from_logits(x, y, top_p=0.5, backend="compiled")
    topk = {v.name: v.reason for v in registry.verdicts(Key("topk_logprobs", "cpu", torch.float32, False))}
    assert topk["compiled"] == "does not implement topk_logprobs" and topk["chunked"] is None


# --------------------------------------------------------------------------- the suite catches bugs
def _full_vocab(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    """The trainers' bug: normalised over the full vocabulary, -inf outside the kept set."""
    full = ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32,
                        softcap=sampler.get("softcap"))
    kept = truncation.kept_tokens(logits, temperature=temperature, **sampler).gather(-1, labels.unsqueeze(-1))[..., 0]
    return torch.where(kept, full, NEG)


def _exactly_k(logits, labels, *, temperature, ignore_index, inplace_backward, top_k=None, **sampler):
    """vLLM's Triton semantics: exactly k tokens kept, the lower ids among ties."""
    keep = sampler.pop("keep", None)
    if top_k is not None:
        ids = truncation.topk_ids(truncation.processed_logits(logits, temperature=temperature, dtype=torch.float32), top_k)
        exactly = truncation.keep_mask(ids, logits.shape[-1])
        keep = exactly if keep is None else exactly & truncation.keep_mask(keep, logits.shape[-1])
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32,
                        keep=keep, **sampler)


def _softcap_after_temperature(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    return ref.logprobs(logits / temperature, labels, ignore_index=ignore_index, dtype=torch.float32, **sampler)


def _gradient_through_dropped_labels(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    """log_softmax over the kept tokens, then a plain gather: a dropped label's -inf passes its
    upstream gradient to the kept tokens."""
    z = truncation.processed_logits(logits, temperature=temperature, softcap=sampler.pop("softcap", None),
                             dtype=torch.float32)
    kept = truncation.kept_tokens(logits, temperature=temperature, **sampler)
    return z.masked_fill(~kept, NEG).log_softmax(-1).gather(-1, labels.unsqueeze(-1))[..., 0]


def _top_p_before_top_k(logits, labels, *, temperature, ignore_index, inplace_backward, **sampler):
    """top_p on the full distribution, then top_k (the wrong order)."""
    top_k, top_p = sampler.pop("top_k", None), sampler.pop("top_p", None)
    kw = dict(temperature=temperature, softcap=sampler.get("softcap"))
    keep = truncation.kept_tokens(logits, top_p=top_p, **kw) & truncation.kept_tokens(logits, top_k=top_k, **kw)
    if sampler.get("keep") is not None:
        keep &= truncation.keep_mask(sampler.pop("keep"), logits.shape[-1])
    sampler.pop("keep", None)
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32,
                        keep=keep, **sampler)


def _softcap_in_float32(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                        logits_dtype=None, **sampler):
    """logits_dtype's rounding, then the softcap computed exactly (not in logits_dtype, as 0.1 did)."""
    logits = ref.hidden_logits(hidden, weight, bias, torch.float32, logits_dtype)
    kw = dict(temperature=temperature, dtype=torch.float32, **sampler)
    if return_entropy:
        return ref.logprobs_and_entropy(logits, labels, ignore_index=ignore_index, **kw)
    return ref.logprobs(logits, labels, ignore_index=ignore_index, **kw)


BUGS = {
    "full-vocabulary": (_full_vocab, "test_top_p", dict(op="logprobs", dtype="float32")),
    "exactly-k": (_exactly_k, "test_top_k", dict(op="logprobs", dtype="float32")),
    "softcap-after-temperature": (_softcap_after_temperature, "test_softcap", dict(op="logprobs", dtype="float32")),
    "gradient-through-dropped-labels": (_gradient_through_dropped_labels, "test_label_outside_kept_set_gradient",
                                        dict(op="logprobs")),
    "top_p-before-top_k": (_top_p_before_top_k, "test_sampler_combined", dict(op="logprobs", dtype="float32")),
}


FUSED_BUGS = {
    "softcap-in-float32-bf16": (_softcap_in_float32, "test_fused_logits_dtype_softcap", dict(logits_dtype="bfloat16")),
    "softcap-in-float32-fp16": (_softcap_in_float32, "test_fused_logits_dtype_softcap", dict(logits_dtype="float16")),
    "softcap-in-float32-truncated": (_softcap_in_float32, "test_fused_logits_dtype_softcap_truncated", {}),
}


@pytest.mark.parametrize("bug", list(BUGS) + list(FUSED_BUGS))
def test_semantics_section_fails_a_wrong_backend(bug):
    function, test, params = BUGS[bug] if bug in BUGS else FUSED_BUGS[bug]
    op = "logprobs" if bug in BUGS else "logprobs_from_hidden"
    name = "bug-" + bug.replace("_", "-")

    class Plugin:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name=name, ops={op: function}, devices={"cpu"}, autograd=True,
                                features={"softcap", "top_k", "top_p", "min_p", "keep", "logits_dtype"}))

    registry = lr.get_registry()
    registry.add_plugin(Plugin(), name="test-plugin-" + name)
    try:
        lp = Harness(registry.get(name), torch.device("cpu"))
        with pytest.raises(AssertionError):
            getattr(SemanticsSection(), test)(lp, **params)
        good = Harness(registry.get("naive"), torch.device("cpu"))
        getattr(SemanticsSection(), test)(good, **params)  # the same test passes on the reference
    finally:
        registry.remove_plugin("test-plugin-" + name)
