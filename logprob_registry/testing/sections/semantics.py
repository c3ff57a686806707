"""The semantics section of the conformance suite: the sampler's processing (``softcap``, ``top_k``,
``top_p``, ``min_p``, ``keep``), candidate labels, ``topk_logprobs`` and the fused op's
``logits_dtype``, for every backend that declares them (docs/sampler.md).

Each test declares the features it exercises; a backend that does not declare one of them has the
test deselected (or skipped, naming the feature). Values are compared with the float64 reference
(:mod:`logprob_registry.reference`) within the float32 tolerance of
:mod:`logprob_registry.numerics`; the kept set must be the reference's exactly (infinities
in the same places): it is vLLM's float32 decision, which a backend replays op for op.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from logprob_registry import reference as ref
from logprob_registry import truncation
from logprob_registry.numerics import EPS32, assert_close, tolerances

from ..harness import LABEL_OPS, LOGITS_OPS, Harness
from ._coverage import covers

TRUNCATION = ("top_k", "top_p", "min_p", "keep")
SAMPLER = ("softcap",) + TRUNCATION
HIDDEN = "logprobs_from_hidden"
TOPK = "topk_logprobs"
V = 500
SHAPE = (3, 5, V)
HIDDEN_VOCAB = 700  # the weight's rows in _hidden_inputs
TEMPERATURE = 0.8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------ helpers
def _labels(lp: Harness, x: torch.Tensor, candidates: int = 0, seed: int = 1) -> torch.Tensor:
    """Random labels, every other position on the row's most probable token (kept by any
    truncation), so that both kept and dropped labels are checked; ``candidates``: ``(..., K)``."""
    lead, vocab = x.shape[:-1], x.shape[-1]
    g = torch.Generator().manual_seed(seed)
    shape = lead + ((candidates,) if candidates else ())
    y = torch.randint(0, vocab, shape, generator=g)
    top = x.detach().float().cpu().argmax(-1)
    if candidates:
        y[..., 0] = top
    else:
        flat = y.view(-1)
        flat[::2] = top.reshape(-1)[::2]
    return y.to(lp.device)


def _keep(lp: Harness, form: str, shape=SHAPE, seed: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if form == "mask":
        keep = torch.rand(shape, generator=g) < 0.7
    else:
        keep = torch.randint(-1, shape[-1], shape[:-1] + (60,), generator=g)
    return keep.to(lp.device)


def _compare(lp: Harness, op: str, x: torch.Tensor, y: Optional[torch.Tensor], what: str, **kw) -> tuple:
    """Call ``op`` on the backend and check every output against the reference; returns the outputs."""
    got = lp.call(op, x, y, **kw)
    want = lp.reference(op, x, y, **kw)
    temperature = kw.get("temperature", 1.0)
    if op == TOPK:  # values within the tolerance of a logprob; the ids are checked by the caller
        got, want, tols = got[:1], want[:1], tolerances("logprobs", x, temperature)
    else:
        tols = tolerances(op, x, temperature)
    for i, (g, w, tol) in enumerate(zip(got, want, tols)):
        assert g.dtype == lp.result_dtype(x.dtype), f"{what}: {op} output {i} is {g.dtype}"
        assert_close(g, w, tol, f"{what}: {op} output {i}")
    return lp.call(op, x, y, **kw) if op == TOPK else got


def _upstream(outputs, seed: int = 5):
    return [torch.randn(tuple(o.shape), generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
            for i, o in enumerate(outputs)]


def _compare_gradients(lp: Harness, op: str, x0: torch.Tensor, y: Optional[torch.Tensor], what: str, **kw) -> None:
    """The logits' gradient against float64 autograd of the reference, with random upstream
    gradients on every output, infinite ones included (a label outside the kept set must get
    none of its upstream gradient, and no NaN)."""
    leaf = x0.clone().requires_grad_(True)
    outs = [o for o in lp.call(op, leaf, y, **kw) if o.is_floating_point()]
    ups = _upstream(outs)
    torch.autograd.backward(outs, [u.to(o.device, o.dtype) for o, u in zip(outs, ups)])
    ref_x = x0.detach().cpu().double().requires_grad_(True)
    refs = [r for r in lp.reference(op, ref_x, y, **kw) if r.is_floating_point()]
    torch.autograd.backward(refs, ups)
    assert leaf.grad is not None, f"{what}: no gradient reached the logits"
    temperature = kw.get("temperature", 1.0)
    atol = 4 * max(tolerances(op if op != TOPK else "logprobs", x0, temperature)) * \
        max(float(u.abs().max()) for u in ups) / temperature
    assert_close(leaf.grad, ref_x.grad, atol, f"{what}: gradient", rtol=4 * EPS32)


def _exact(shape, denominator: int, seed: int, limit: int = 8) -> torch.Tensor:
    """Small multiples of ``1 / denominator``: products and sums of them are exact in float32, so
    rounding the logits to bf16/fp16 gives the same bits from any matmul (and from float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-limit, limit + 1, tuple(shape), generator=g).double() / denominator


def _hidden_inputs(lp: Harness, dtype: torch.dtype = torch.float32, vocab: int = HIDDEN_VOCAB):
    # logits of 14 or so significant bits (multiples of 1/4096 of magnitude ~2): fp16 and bf16 round them
    h = _exact((2, 5, 48), 16, 8, limit=64).to(dtype).to(lp.device)
    w = _exact((vocab, 48), 256, 9, limit=64).to(dtype).to(lp.device)
    b = _exact((vocab,), 8, 10).to(dtype).to(lp.device)
    return h, w, b


def _hidden_tolerance(h, w, b, temperature: float) -> float:
    bound = h.detach().cpu().double().abs() @ w.detach().cpu().double().abs().T + b.detach().cpu().double().abs()
    return max(tolerances("logprobs_and_entropy", w.new_empty((1, w.shape[0])), temperature,
                          magnitude_bound=float(bound.max())))


def _check_hidden(lp: Harness, what: str, y: torch.Tensor, grad: bool, dtype=torch.float32, **kw) -> None:
    """logprobs_from_hidden (with the entropy) against the float64 reference, and with ``grad``
    the gradients of hidden, weight and bias: each element within ``4 tol + 2 eps`` times the sum
    of the absolute terms that make it up (``|d logits| @ |weight|`` and so on)."""
    h0, w0, b0 = _hidden_inputs(lp, dtype)
    leaves = [t.clone().requires_grad_(grad) for t in (h0, w0, b0)]
    got = lp.call_hidden(leaves[0], leaves[1], y, bias=leaves[2], return_entropy=True, **kw)
    refs = [t.detach().cpu().double().requires_grad_(grad) for t in leaves]
    rkw = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    want = lp.reference_hidden(refs[0], refs[1], y, bias=refs[2], return_entropy=True, **kw)
    tol = _hidden_tolerance(h0, w0, b0, kw.get("temperature", 1.0))
    for i, (g, r) in enumerate(zip(got, want)):
        assert_close(g, r, tol * ((1 + math.log(w0.shape[0])) if i else 1), f"{what}: output {i}")
    if not grad:
        return
    ups = _upstream(got, 11)
    torch.autograd.backward(list(got), [u.to(o.device, o.dtype) for o, u in zip(got, ups)])
    torch.autograd.backward(list(want), ups)
    logits_dtype = rkw.pop("logits_dtype", None)
    hr, wr, br = (r.detach() for r in refs)
    logits = ref.hidden_logits(hr, wr, br, logits_dtype=logits_dtype).requires_grad_(True)
    outs = ref.logprobs_and_entropy(logits, y.cpu(), logits_dtype=logits_dtype, **rkw)
    dl = torch.autograd.grad(outs, logits, ups)[0].abs().reshape(-1, w0.shape[0])
    bounds = {"hidden": dl @ wr.abs(), "weight": dl.T @ hr.abs().reshape(-1, h0.shape[-1]), "bias": dl.sum(0)}
    rel = 4 * tol * ((1 + math.log(w0.shape[0]))) + 2 * (EPS32 if dtype == torch.float32 else torch.finfo(dtype).eps)
    for name, leaf, r in zip(("hidden", "weight", "bias"), leaves, refs):
        assert leaf.grad is not None, f"{what}: no gradient reached {name}"
        err = (leaf.grad.cpu().double() - r.grad).abs().reshape(bounds[name].shape)
        assert not bool(torch.isnan(leaf.grad).any()), f"{what}: NaN in the gradient of {name}"
        worst = float((err - rel * bounds[name]).max())
        assert worst <= 1e-30, (f"{what}: gradient of {name} off by up to {float(err.max()):.3g} (allowed "
                                f"{rel:.2g} x the sum of absolute terms)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (-0.0 is not 0.0; a NaN equals the same NaN)."""
    width = {torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype)
    return t.contiguous().view(width) if width is not None else t


def _per_row_values(lp: Harness, shape=SHAPE[:-1], seed: int = 6) -> dict:
    """Random per-position temperature, top_k, top_p and min_p; each truncation off somewhere."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(shape, generator=g) + 0.5
    top_k = torch.randint(1, 80, shape, generator=g)
    top_p = torch.rand(shape, generator=g) * 0.5 + 0.5
    min_p = torch.rand(shape, generator=g) * 0.1
    top_k[0, 0], top_p[0, 0], min_p[0, 0] = 0, 1.0, 0.0  # every truncation off: the plain computation
    top_k[1, :2], top_p[2, 3:], min_p[0, 1:3] = 0, 1.0, 0.0
    return {k: v.to(lp.device) for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                                 min_p=min_p).items()}


def _order_logits(lp: Harness) -> torch.Tensor:
    """Logits (3, 5, V) on which vLLM's, transformers' and SGLang's orders keep different tokens:
    probabilities (after temperature 0.8) of about 0.5, 0.35 and 0.06 over a thin tail of 0.09
    (with min_p=0.1 and top_p=0.93 vLLM drops the 0.06 token, transformers keeps it), every other
    row random; one row with 25 tokens tied at the top (top_k=20: SGLang keeps 20 of them)."""
    g = torch.Generator().manual_seed(8)
    rows = SHAPE[0] * SHAPE[1]
    head = torch.tensor([0.5, 0.35, 0.06]) * (1 + 0.05 * torch.rand(rows, 3, generator=g))
    tail = torch.rand(rows, V - 3, generator=g) + 0.5
    x = 0.8 * torch.cat([head, 0.09 * tail / tail.sum(-1, keepdim=True)], -1).log()
    x[1::2] = torch.randn(rows // 2, V, generator=g) * 3
    x = x[:, torch.randperm(V, generator=g)]
    x[4, :25] = 9.0
    return x.view(SHAPE).to(lp.device)


# ------------------------------------------------------------------------------------ the section
class SemanticsSection:
    """The sampler's processing, candidates, topk and ``logits_dtype`` (docs/sampler.md)."""

    # ------------------------------------------------------------ one keyword at a time
    @covers(LOGITS_OPS, features=("softcap",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_softcap(self, lp: Harness, op: str, dtype: str) -> None:
        """``softcap * tanh(z / softcap)`` before the temperature; a -inf logit stays -inf."""
        lp.require(op, DTYPES[dtype], features=("softcap",), vocab=V)
        x = lp.logits(SHAPE, DTYPES[dtype], scale=8.0)
        x[0, 0, :7] = -math.inf
        y = _labels(lp, x)
        y[0, 0] = 3
        _compare(lp, op, x, y, f"softcap=5, {dtype}", softcap=5.0, temperature=TEMPERATURE)

    @covers(LOGITS_OPS, features=("top_k",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_top_k(self, lp: Harness, op: str, dtype: str) -> None:
        """The k largest, and every logit tied with the k-th (ties made certain in one row)."""
        lp.require(op, DTYPES[dtype], features=("top_k",), vocab=V)
        x = lp.logits(SHAPE, DTYPES[dtype])
        x[1, 2, :12] = 7.0  # 12 tokens tied at the top: top_k=10 keeps all 12
        y = _labels(lp, x)
        y[1, 2] = 11
        got = _compare(lp, op, x, y, f"top_k=10, {dtype}", top_k=10, temperature=TEMPERATURE)
        if op != "entropy":
            assert math.isfinite(got[0][1, 2].item()), "a token tied with the k-th largest was dropped"

    @covers(LOGITS_OPS, features=("top_p",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_top_p(self, lp: Harness, op: str, dtype: str) -> None:
        """The smallest most-probable set of mass >= top_p, by vLLM's float32 cumulative sum."""
        lp.require(op, DTYPES[dtype], features=("top_p",), vocab=V)
        x = lp.logits(SHAPE, DTYPES[dtype])
        y = _labels(lp, x)
        for p in (0.3, 0.9):
            _compare(lp, op, x, y, f"top_p={p}, {dtype}", top_p=p, temperature=TEMPERATURE)

    @covers(LOGITS_OPS, features=("min_p",))
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_min_p(self, lp: Harness, op: str, dtype: str) -> None:
        """Tokens less probable than min_p times the most probable one are dropped (strictly less)."""
        lp.require(op, DTYPES[dtype], features=("min_p",), vocab=V)
        x = lp.logits(SHAPE, DTYPES[dtype])
        y = _labels(lp, x)
        _compare(lp, op, x, y, f"min_p=0.05, {dtype}", min_p=0.05, temperature=TEMPERATURE)

    @covers(LOGITS_OPS, features=("keep",))
    @pytest.mark.parametrize("form", ["mask", "ids"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_keep(self, lp: Harness, op: str, form: str) -> None:
        """``keep`` as a bool mask (..., V) or as ids (..., K) padded with -1; both forms agree."""
        lp.require(op, features=("keep",), vocab=V)
        x = lp.logits(SHAPE)
        keep = _keep(lp, form)
        y = _labels(lp, x)
        got = _compare(lp, op, x, y, f"keep ({form})", keep=keep, temperature=TEMPERATURE)
        mask = truncation.keep_mask(keep, V)
        for a, b in zip(got, lp.call(op, x, y, keep=mask, temperature=TEMPERATURE)):
            assert torch.equal(a, b), f"{op}: keep as ids and as the same mask differ"

    # ------------------------------------------------------------ all together
    @covers(LOGITS_OPS, features=SAMPLER)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_sampler_combined(self, lp: Harness, op: str, dtype: str) -> None:
        """softcap, temperature, min_p, top_k, top_p and keep in one call, in the sampler's order
        (top_p on the distribution renormalised after min_p and top_k)."""
        lp.require(op, DTYPES[dtype], features=SAMPLER, vocab=V)
        x = lp.logits(SHAPE, DTYPES[dtype], scale=4.0)
        y = _labels(lp, x)
        kw = dict(softcap=6.0, min_p=0.01, top_k=40, top_p=0.85, keep=_keep(lp, "mask"), temperature=0.7)
        _compare(lp, op, x, y, f"every keyword, {dtype}", **kw)

    @covers(LOGITS_OPS, features=("top_k", "top_p", "min_p"))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_truncation_large_vocab(self, lp: Harness, op: str) -> None:
        """V = 262144, bf16 (many ties), two rows: top_p over the whole vocabulary."""
        lp.require(op, torch.bfloat16, features=("top_k", "top_p", "min_p"), vocab=262144)
        x = lp.logits((2, 262144), torch.bfloat16, scale=4.0)
        y = _labels(lp, x)
        _compare(lp, op, x, y, "V=262144, top_p=0.95", top_p=0.95)
        _compare(lp, op, x, y, "V=262144, top_k=1000, top_p=0.5, min_p=1e-4", top_k=1000, top_p=0.5, min_p=1e-4)

    # ------------------------------------------------------------ the -inf and gradient rules
    @covers(LABEL_OPS, features=("top_k", "keep"))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_label_outside_kept_set(self, lp: Harness, op: str) -> None:
        """A label outside the kept set (or on a -inf logit) gives -inf, never NaN; a row where
        nothing is kept gives -inf for every label and an entropy of 0."""
        lp.require(op, features=("top_k", "keep"), vocab=64)
        x = lp.logits((4, 64))
        x[3, 5] = -math.inf
        y = x.argmin(-1)  # never among the top 3
        y[3] = 5
        keep = torch.ones(4, 64, dtype=torch.bool, device=lp.device)
        keep[2] = False  # nothing kept in row 2
        got = _compare(lp, op, x, y, "labels outside the kept set", top_k=3, keep=keep)
        assert bool((got[0] == -math.inf).all()), f"{op}: labels outside the kept set give {got[0].tolist()}"
        if op == "logprobs_and_entropy":
            assert got[1][2].item() == 0.0, f"the entropy of a row with nothing kept is {got[1][2].item()}, not 0"

    @covers(LABEL_OPS, grad=True, features=("top_k", "keep"))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_label_outside_kept_set_gradient(self, lp: Harness, op: str) -> None:
        """... and a zero gradient: the -inf of a dropped label does not depend on the logits."""
        lp.require(op, grad=True, features=("top_k", "keep"), vocab=64)
        x = lp.logits((4, 64)).requires_grad_(True)
        y = x.detach().argmin(-1)
        keep = torch.ones(4, 64, dtype=torch.bool, device=lp.device)
        keep[2] = False
        outs = lp.call(op, x, y, top_k=3, keep=keep)
        outs[0].backward(torch.ones_like(outs[0]))
        assert x.grad is not None and bool((x.grad == 0).all()), (
            f"{op}: labels outside the kept set gave a gradient {x.grad.abs().max().item()} (NaN: "
            f"{bool(x.grad.isnan().any())}); it must be exactly 0")

    @covers(LOGITS_OPS, grad=True, features=("softcap",))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_softcap_gradients(self, lp: Harness, op: str) -> None:
        """Through the softcap: ``(1 - tanh(z / cap)**2) / T``."""
        lp.require(op, grad=True, features=("softcap",), vocab=300)
        x = lp.logits((3, 5, 300), scale=6.0)
        _compare_gradients(lp, op, x, _labels(lp, x), "softcap", softcap=4.0, temperature=TEMPERATURE)

    @covers(LOGITS_OPS, grad=True, features=SAMPLER)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_truncation_gradients(self, lp: Harness, op: str) -> None:
        """Through the softmax over the kept tokens (the kept set a constant), every keyword at once;
        a dropped label's upstream gradient goes nowhere."""
        lp.require(op, grad=True, features=SAMPLER, vocab=V)
        x = lp.logits(SHAPE, scale=4.0)
        kw = dict(softcap=6.0, min_p=0.01, top_k=40, top_p=0.85, keep=_keep(lp, "ids"), temperature=0.7)
        _compare_gradients(lp, op, x, _labels(lp, x), "every keyword", **kw)

    @covers(LOGITS_OPS, features=("top_p",))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_truncation_nan(self, lp: Harness, op: str) -> None:
        """A NaN logit makes its own row NaN (every output) and no other."""
        lp.require(op, features=("top_p",), vocab=100)
        x = lp.logits((3, 100))
        x[0, 7] = math.nan
        y = _labels(lp, x)
        got = lp.call(op, x, y, top_p=0.5)
        for i, g in enumerate(got):
            assert bool(torch.isnan(g[0]).all()), f"{op} output {i}: a row with a NaN logit gives {g[0].tolist()}"
        _compare(lp, op, x[1:], y[1:], "rows without NaN", top_p=0.5)

    # ------------------------------------------------------------ candidates
    @covers(LABEL_OPS, features=("candidates",))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_candidates(self, lp: Harness, op: str) -> None:
        """Labels (..., K) give (..., K) in one call, each as its own single-label call; ignore_index
        per candidate (0 there)."""
        lp.require(op, features=("candidates",), vocab=V)
        x = lp.logits(SHAPE)
        y = _labels(lp, x, candidates=4)
        y[0, 1, 2] = y[2, 0, 0] = -100
        got = _compare(lp, op, x, y, "4 candidates", ignore_index=-100, temperature=TEMPERATURE)
        assert tuple(got[0].shape) == (3, 5, 4), f"candidates give shape {tuple(got[0].shape)}"
        assert got[0][0, 1, 2].item() == 0.0 and got[0][2, 0, 0].item() == 0.0, "an ignored candidate is not 0"
        tol = tolerances("logprobs", x, TEMPERATURE)[0]
        for k in range(4):
            single = lp.call(op, x, y[..., k].contiguous(), ignore_index=-100, temperature=TEMPERATURE)
            assert_close(got[0][..., k], single[0].double(), 2 * tol, f"candidate {k} against a single-label call")

    @covers(LABEL_OPS, grad=True, features=("candidates",))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_candidates_gradients(self, lp: Harness, op: str) -> None:
        lp.require(op, grad=True, features=("candidates",), vocab=300)
        x = lp.logits((3, 5, 300))
        y = _labels(lp, x, candidates=3)
        y[1, 1, 1] = -100
        _compare_gradients(lp, op, x, y, "3 candidates", ignore_index=-100, temperature=TEMPERATURE)

    @covers(LABEL_OPS, features=("candidates", "top_p", "softcap"))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_candidates_truncated(self, lp: Harness, op: str) -> None:
        """Candidates with the sampler's processing: each one -inf outside the kept set."""
        lp.require(op, features=("candidates", "top_p", "softcap"), vocab=V)
        x = lp.logits(SHAPE)
        _compare(lp, op, x, _labels(lp, x, candidates=5), "5 candidates, top_p", top_p=0.7, softcap=5.0)

    # ------------------------------------------------------------ topk_logprobs
    @covers(TOPK)
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
    def test_topk_logprobs(self, lp: Harness, dtype: str) -> None:
        """The k largest logprobs and their ids, largest first, ties by smaller id (integer logits:
        many exact ties)."""
        dt = getattr(torch, dtype)
        lp.require(TOPK, dt, vocab=200)
        g = torch.Generator().manual_seed(2)
        x = torch.randint(-4, 5, (3, 4, 200), generator=g).to(dt).to(lp.device)
        values, ids = _compare(lp, TOPK, x, None, f"k=7, {dtype}", k=7, temperature=TEMPERATURE)
        _, want = lp.reference(TOPK, x, k=7, temperature=TEMPERATURE)
        assert ids.dtype == torch.int64, f"ids are {ids.dtype}, expected int64"
        assert torch.equal(ids.cpu(), want), "topk ids differ from the reference (largest first, ties by smaller id)"

    @covers(TOPK, features=("top_k", "top_p"))
    def test_topk_logprobs_truncated(self, lp: Harness) -> None:
        """Fewer than k tokens kept: the rest are -inf, at the smallest ids not listed."""
        lp.require(TOPK, features=("top_k", "top_p"), vocab=200)
        x = lp.logits((3, 4, 200))
        values, ids = _compare(lp, TOPK, x, None, "k=8, top_k=5", k=8, top_k=5)
        _, want = lp.reference(TOPK, x, k=8, top_k=5)
        assert torch.equal(ids.cpu(), want), "topk ids differ from the reference"
        assert bool((values[..., 5:] == -math.inf).all()), "positions beyond the kept tokens are not -inf"
        _compare(lp, TOPK, x, None, "k=8, top_p=0.6", k=8, top_p=0.6)

    @covers(TOPK, grad=True)
    def test_topk_logprobs_gradients(self, lp: Harness) -> None:
        lp.require(TOPK, grad=True, vocab=300)
        x = lp.logits((3, 4, 300))
        _compare_gradients(lp, TOPK, x, None, "topk k=6", k=6, temperature=TEMPERATURE)

    # ------------------------------------------------------------ per-row values and engines' orders
    @covers(LOGITS_OPS + (TOPK,), features=("per_row", "top_k", "top_p", "min_p"))
    @pytest.mark.parametrize("op", LOGITS_OPS + (TOPK,))
    def test_per_row_values(self, lp: Harness, op: str) -> None:
        """``temperature``, ``top_k``, ``top_p`` and ``min_p`` per position (some positions off):
        the reference's values, and each position's result bitwise that of the call with its
        values as numbers."""
        lp.require(op, features=("per_row", "top_k", "top_p", "min_p"), vocab=V)
        x = lp.logits(SHAPE, scale=4.0)
        y = _labels(lp, x)
        kw = _per_row_values(lp)
        got = lp.call(op, x, y, **(dict(k=4) if op == TOPK else {}), **kw)
        want = lp.reference(op, x, y, **(dict(k=4) if op == TOPK else {}), **kw)
        tols = tolerances("logprobs" if op == TOPK else op, x, float(kw["temperature"].min()))
        for i, (g, w, tol) in enumerate(zip(got[:1] if op == TOPK else got, want, tols)):
            assert_close(g, w, tol, f"per-row values: {op} output {i}")
        for pos in [(0, 0), (0, 1), (1, 2), (2, 4), (2, 3)]:
            one = {name: value[pos].item() for name, value in kw.items()}
            row = lp.call(op, x[pos][None], y[pos][None], **(dict(k=4) if op == TOPK else {}), **one)
            for i, (a, b) in enumerate(zip(got, row)):
                assert torch.equal(_bits(a[pos][None]), _bits(b)), \
                    f"{op} output {i} at position {pos} differs from the call with that position's values {one}"

    @covers(LOGITS_OPS + (HIDDEN,), features=("per_row",))
    @pytest.mark.parametrize("op", LOGITS_OPS + (HIDDEN,))
    def test_per_row_temperature(self, lp: Harness, op: str) -> None:
        """A temperature per sequence ``(B, 1)``, nothing truncated (an RL trainer's call): the
        reference's values, and each sequence bitwise the call with its temperature as a number."""
        lp.require(op, features=("per_row",), vocab=V)
        t = torch.tensor([[0.6], [1.0], [1.3]], device=lp.device)
        if op == HIDDEN:
            h, w, b = _hidden_inputs(lp, vocab=V)
            h = torch.cat([h, h[:1]])  # 3 sequences
            y = lp.labels(h.shape[:-1], V)
            t = t[:3]
            got = lp.call_hidden(h, w, y, bias=b, return_entropy=True, temperature=t)
            rows = [lp.call_hidden(h[i], w, y[i], bias=b, return_entropy=True, temperature=float(t[i, 0]))
                    for i in range(3)]
        else:
            x = lp.logits(SHAPE)
            y = _labels(lp, x)
            got = lp.call(op, x, y, temperature=t)
            want = lp.reference(op, x, y, temperature=t)
            for i, (g, w_, tol) in enumerate(zip(got, want, tolerances(op, x, 0.6))):
                assert_close(g, w_, tol, f"per-sequence temperature: {op} output {i}")
            rows = [lp.call(op, x[i], y[i], temperature=float(t[i, 0])) for i in range(3)]
        for i, row in enumerate(rows):
            for k, (a, b_) in enumerate(zip(got, row)):
                assert torch.equal(_bits(a[i]), _bits(b_)), f"{op} output {k}: sequence {i} differs from its own call"

    @covers(LOGITS_OPS, features=("sampler", "top_k", "top_p", "min_p"))
    @pytest.mark.parametrize("order", ["hf", "sglang"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_sampler_orders(self, lp: Harness, op: str, order: str) -> None:
        """``sampler="hf"`` (transformers: top_k, top_p, then min_p on what is left) and
        ``"sglang"`` (every filter on the full distribution, exactly k by position) on rows where
        the engines' orders keep different tokens; a tie at the k-th value in one row."""
        lp.require(op, features=("sampler", "top_k", "top_p", "min_p"), vocab=V)
        x = _order_logits(lp)
        y = _labels(lp, x)
        kw = dict(temperature=0.8, top_k=20, top_p=0.93, min_p=0.1)
        _compare(lp, op, x, y, f"sampler={order!r}", sampler=order, **kw)
        vllm = truncation.kept_tokens(x.cpu(), **kw)
        other = truncation.kept_tokens(x.cpu(), sampler=order, **kw)
        assert not torch.equal(vllm, other), "the case does not separate orders"

    # ------------------------------------------------------------ no keyword, no change
    @covers(LOGITS_OPS + (HIDDEN,))
    @pytest.mark.parametrize("op", LOGITS_OPS + (HIDDEN,))
    def test_disabled_keywords_change_nothing(self, lp: Harness, op: str) -> None:
        """The keywords at values that keep every token (None, top_k 0, -1 or V, top_p 1, min_p 0,
        logits_dtype None) give bitwise the result of a call without them."""
        lp.require(op, vocab=V)
        off = [dict(softcap=None, top_k=None, top_p=None, min_p=None, keep=None), dict(top_k=0), dict(top_k=-1),
               dict(top_k=V), dict(top_p=1.0), dict(min_p=0.0)]
        if op == HIDDEN:
            h, w, b = _hidden_inputs(lp, vocab=V)
            y = lp.labels((2, 5), V)
            plain = lp.call_hidden(h, w, y, bias=b, return_entropy=True)
            off.append(dict(logits_dtype=None))
            calls = [lp.call_hidden(h, w, y, bias=b, return_entropy=True, **kw) for kw in off]
        else:
            x = lp.logits(SHAPE)
            y = _labels(lp, x)
            plain = lp.call(op, x, y, temperature=TEMPERATURE)
            calls = [lp.call(op, x, y, temperature=TEMPERATURE, **kw) for kw in off]
        for kw, outs in zip(off, calls):
            for i, (a, b_) in enumerate(zip(outs, plain)):
                assert torch.equal(a, b_), f"{op} output {i} with {kw} differs from the call without keywords"

    # ------------------------------------------------------------ the fused op
    @covers(HIDDEN, features=SAMPLER)
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_fused_sampler(self, lp: Harness, dtype: str) -> None:
        """logprobs_from_hidden with every sampler keyword, against the float64 reference."""
        lp.require(HIDDEN, DTYPES[dtype], features=SAMPLER, vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        kw = dict(softcap=3.0, min_p=0.02, top_k=60, top_p=0.9, keep=_keep(lp, "ids", (2, 5, 700)), temperature=0.7)
        _check_hidden(lp, f"fused, every keyword, {dtype}", y, False, DTYPES[dtype], **kw)

    @covers(HIDDEN, grad=True, features=SAMPLER)
    def test_fused_sampler_gradients(self, lp: Harness) -> None:
        lp.require(HIDDEN, grad=True, features=SAMPLER, vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        kw = dict(softcap=3.0, min_p=0.02, top_k=60, top_p=0.9, keep=_keep(lp, "mask", (2, 5, 700)), temperature=0.7)
        _check_hidden(lp, "fused gradients, every keyword", y, True, **kw)

    @covers(HIDDEN, features=("logits_dtype",))
    @pytest.mark.parametrize("logits_dtype", ["bfloat16", "float16"])
    def test_fused_logits_dtype(self, lp: Harness, logits_dtype: str) -> None:
        """Each logit rounded to bf16/fp16 before the softmax (inputs whose products are exact, so
        that the rounding is the same from any matmul); values differ from exact fp32 products."""
        lp.require(HIDDEN, features=("logits_dtype",), vocab=HIDDEN_VOCAB)
        ld = getattr(torch, logits_dtype)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        _check_hidden(lp, f"logits_dtype={logits_dtype}", y, False, logits_dtype=ld, temperature=0.9)
        rounded = lp.call_hidden(h, w, y, bias=b, logits_dtype=ld)[0]
        exact = lp.call_hidden(h, w, y, bias=b)[0]
        assert not torch.equal(rounded, exact), f"logits_dtype={logits_dtype} changed nothing"

    @covers(HIDDEN, grad=True, features=("logits_dtype",))
    def test_fused_logits_dtype_gradients(self, lp: Harness) -> None:
        """The gradient goes straight through the rounding."""
        lp.require(HIDDEN, grad=True, features=("logits_dtype",), vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        _check_hidden(lp, "logits_dtype=bfloat16 gradients", y, True, logits_dtype=torch.bfloat16)

    @covers(HIDDEN, features=("logits_dtype", "softcap"))
    @pytest.mark.parametrize("logits_dtype", ["bfloat16", "float16"])
    def test_fused_logits_dtype_softcap(self, lp: Harness, logits_dtype: str) -> None:
        """With ``logits_dtype`` the softcap runs in it, as the engine's lm_head computes it: ``x / cap``,
        ``tanh``, ``* cap``, each rounded to ``logits_dtype``; then float32. A softcap computed in
        float32 on the rounded logits is off by an ulp of ``logits_dtype`` or so, beyond the tolerance
        (25 times it in bf16, 5 times in fp16, on these inputs)."""
        lp.require(HIDDEN, features=("logits_dtype", "softcap"), vocab=HIDDEN_VOCAB)
        ld = getattr(torch, logits_dtype)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        kw = dict(softcap=3.0, logits_dtype=ld, temperature=0.9)
        _check_hidden(lp, f"logits_dtype={logits_dtype}, softcap=3", y, False, **kw)
        got = lp.call_hidden(h, w, y, bias=b, **kw)[0].cpu().double()
        logits = ref.hidden_logits(*(t.cpu().double() for t in (h, w, b)), logits_dtype=ld)
        in_float32 = ref.logprobs(logits, y.cpu(), softcap=3.0, temperature=0.9)  # the softcap not in ld
        gap = float((got - in_float32).abs().max())
        assert gap > 4 * _hidden_tolerance(h, w, b, 0.9), (
            f"logits_dtype={logits_dtype}, softcap=3: within {gap:.3g} of a softcap computed in float32")

    @covers(HIDDEN, features=("logits_dtype",) + SAMPLER)
    def test_fused_logits_dtype_softcap_truncated(self, lp: Harness) -> None:
        """The kept set is decided on the float32 processed logits the engine's sampler sees: those
        of the softcap computed in ``logits_dtype``."""
        lp.require(HIDDEN, features=("logits_dtype",) + SAMPLER, vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        kw = dict(softcap=3.0, min_p=0.02, top_k=60, top_p=0.9, keep=_keep(lp, "ids", (2, 5, 700)), temperature=0.7)
        _check_hidden(lp, "logits_dtype=bfloat16, every keyword", y, False, logits_dtype=torch.bfloat16, **kw)

    @covers(HIDDEN, grad=True, features=("logits_dtype", "softcap"))
    def test_fused_logits_dtype_softcap_gradients(self, lp: Harness) -> None:
        """Straight through each of the three roundings; the softcap's derivative ``1 - tanh(u)**2``
        at the rounded ``u = x / cap``."""
        lp.require(HIDDEN, grad=True, features=("logits_dtype", "softcap"), vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T))
        _check_hidden(lp, "logits_dtype=bfloat16, softcap=3 gradients", y, True, logits_dtype=torch.bfloat16,
                      softcap=3.0, temperature=0.9)

    @covers(HIDDEN, features=("candidates",))
    def test_fused_candidates(self, lp: Harness) -> None:
        """Candidate labels (..., K) in the fused op, ignore_index per candidate."""
        lp.require(HIDDEN, features=("candidates",), vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T), candidates=3)
        y[1, 2, 1] = -100
        _check_hidden(lp, "fused, 3 candidates", y, False, ignore_index=-100)

    @covers(HIDDEN, grad=True, features=("candidates",))
    def test_fused_candidates_gradients(self, lp: Harness) -> None:
        lp.require(HIDDEN, grad=True, features=("candidates",), vocab=HIDDEN_VOCAB)
        h, w, b = _hidden_inputs(lp)
        y = _labels(lp, (h.double() @ w.double().T), candidates=3)
        y[1, 2, 1] = -100
        _check_hidden(lp, "fused gradients, 3 candidates", y, True, ignore_index=-100)

