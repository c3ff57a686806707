"""Fused linear logprobs (``logprobs_from_hidden``): the chunked implementation, and conformance
checks for every backend that declares the op.

The ``check_*`` functions take a backend name and assert the op's contract against the float64
reference (values and the gradients of hidden, weight and bias); they are written to move into the
conformance suite (logprob_registry/testing) as they are. Until the ``chunked`` backend is wired
up, the chunked op runs here through a test-only plugin named ``chunked-hidden-test``.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.kernels import chunked_hidden as ch

TEST_BACKEND = "chunked-hidden-test"
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _test_plugin():
    @lr.hookimpl
    def register_backends(register):
        register(lr.Backend(
            name=TEST_BACKEND,
            ops={"logprobs_from_hidden": ch.logprobs_from_hidden},
            devices={"cpu", "cuda", "npu", "xpu", "mps"},
            dtypes=set(FLOATS),
            priority=10,
            autograd=True,
            batch_invariant=True,
            description="chunked logprobs_from_hidden, registered by tests/test_chunked_hidden.py",
        ))

    return types.SimpleNamespace(register_backends=register_backends)


@pytest.fixture(scope="module", autouse=True)
def chunked_plugin():
    registry = lr.get_registry()
    if TEST_BACKEND not in {b.name for b in registry.backends()}:
        added = registry.add_plugin(_test_plugin(), name="test:" + TEST_BACKEND)
        assert added == [TEST_BACKEND]
    yield
    registry.remove_plugin("test:" + TEST_BACKEND)


def _declaring() -> list:
    names = [b.name for b in lr.backends() if "logprobs_from_hidden" in b.ops and "cpu" in b.devices]
    return sorted(set(names) | {TEST_BACKEND})


# --------------------------------------------------------------------------- helpers (suite-ready)
def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _rounding(dtype: torch.dtype) -> float:
    """Relative error of rounding a result to ``dtype`` (gradients come back in the input dtype)."""
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 0.0)


def assert_matches(got, want, dtype, scale, what, rounded=False):
    """``got`` is within a small multiple of fp32 (fp64) rounding of ``scale`` of the float64
    ``want`` (plus one rounding to ``dtype`` if ``rounded``: gradients come back in the inputs'
    dtype); NaN and infinities in the same places."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN in other places than the reference"
    assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0)), f"{what}: +inf misplaced"
    assert torch.equal(got.isinf() & (got < 0), want.isinf() & (want < 0)), f"{what}: -inf misplaced"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    tol = 64 * _eps(dtype) * scale + (_rounding(dtype) if rounded else 0.0) * want[fin].abs()
    if err.numel():
        worst = int((err - tol).argmax())
        assert bool((err <= tol).all()), (
            f"{what}: error {err[worst].item():.3e} exceeds tolerance {tol[worst].item():.3e} "
            f"(reference {want[fin][worst].item():.6g})"
        )


def make_inputs(n=37, h=24, v=97, dtype=torch.float32, bias=True, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g)).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    if lead is not None:
        hidden, labels = hidden.view(*lead, h), labels.view(lead)
    return hidden, weight, b, labels


def _leaf(t, requires_grad):
    """A leaf copy of ``t`` with the same strides, gaps included (``clone`` would close them)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    assert out.stride() == t.stride()
    return out.requires_grad_(requires_grad)


def check_against_reference(backend, hidden, weight, bias, labels, *, temperature=1.0, ignore_index=None,
                            return_entropy=False, grads=True, seed=1):
    """Values and the gradients of hidden, weight and bias against float64 autograd of the reference.

    Both outputs enter the loss with random weights when the entropy is returned, so its gradient
    is checked too."""
    dtype = hidden.dtype
    leaves = [_leaf(t, grads) if t is not None else None for t in (hidden, weight, bias)]
    refs = [t.detach().double().requires_grad_(grads) if t is not None else None for t in (hidden, weight, bias)]
    kw = dict(temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy)
    got = lr.logprobs_from_hidden(leaves[0], leaves[1], labels, bias=leaves[2], backend=backend, **kw)
    want = ref.logprobs_from_hidden(refs[0], refs[1], labels, bias=refs[2], **kw)
    got = got if return_entropy else (got,)
    want = want if return_entropy else (want,)
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    z = ref.hidden_logits(refs[0], refs[1], refs[2]).detach() / temperature
    scale = 1.0 + (z[torch.isfinite(z)].abs().max().item() if z.numel() else 0.0)
    for name, g_, w_ in zip(("logprobs", "entropy"), got, want):
        assert g_.dtype == expected, f"{backend}: {name} is {g_.dtype}, expected {expected}"
        assert_matches(g_, w_, dtype, scale, f"{backend} {dtype} {name}")
    if not grads:
        return
    gen = torch.Generator().manual_seed(seed)
    coef = [torch.randn(w_.shape, generator=gen, dtype=torch.float64) for w_ in want]

    def loss(outs):
        return sum(((o.double().masked_fill(torch.isinf(w_), 0.0)) * c).sum() for o, w_, c in zip(outs, want, coef))

    inputs = [t for t in leaves if t is not None]
    ref_inputs = [t for t in refs if t is not None]
    dgot = torch.autograd.grad(loss(got), inputs)
    dwant = torch.autograd.grad(loss(want), ref_inputs)
    for name, a, b in zip(("hidden", "weight", "bias"), dgot, dwant):
        assert a.dtype == dtype and a.shape == b.shape, f"{backend}: grad of {name} is {a.dtype} {tuple(a.shape)}"
        gscale = max(b.abs().max().item(), 1e-30) if b.numel() else 1.0
        assert_matches(a, b, dtype, gscale, f"{backend} {dtype} grad {name}", rounded=True)


def check_values_and_grads(backend):
    for dtype in FLOATS:
        for kw in (dict(), dict(temperature=0.7, ignore_index=-100, return_entropy=True),
                   dict(temperature=1.6, ignore_index=5, return_entropy=False)):
            hidden, weight, bias, labels = make_inputs(dtype=dtype)
            if kw.get("ignore_index") is not None:
                labels = labels.clone()
                labels[::4] = kw["ignore_index"]
            check_against_reference(backend, hidden, weight, bias, labels, **kw)
    hidden, weight, _, labels = make_inputs(bias=False, lead=(37,))
    check_against_reference(backend, hidden, weight, None, labels, return_entropy=True)


def check_shapes(backend):
    # leading dims, 1-D hidden with a 0-d label, empty N, V of 1, a V that is no power of two
    hidden, weight, bias, labels = make_inputs(n=12, lead=(3, 4))
    check_against_reference(backend, hidden, weight, bias, labels, return_entropy=True)
    hidden, weight, bias, labels = make_inputs(n=1)
    check_against_reference(backend, hidden[0], weight, bias, labels[0], return_entropy=True)
    hidden, weight, bias, labels = make_inputs(n=0, lead=(0, 5))
    check_against_reference(backend, hidden, weight, bias, labels, return_entropy=True)
    hidden, weight, bias, labels = make_inputs(v=1)
    check_against_reference(backend, hidden, weight, bias, labels, return_entropy=True)
    hidden, weight, bias, labels = make_inputs(n=20, v=300)
    check_against_reference(backend, hidden, weight, bias, labels.int(), ignore_index=299, return_entropy=True)


def check_layouts(backend):
    """Non-contiguous hidden (``hidden[:, :-1]``), a weight that is a slice of a wider matrix, and
    one stored transposed."""
    hidden, weight, bias, labels = make_inputs(n=40, lead=(4, 10))
    assert not hidden[:, :-1].is_contiguous()
    check_against_reference(backend, hidden[:, :-1], weight, bias, labels[:, 1:], return_entropy=True)
    wide = torch.randn(97, 40)
    wide[:, :24] = weight
    check_against_reference(backend, hidden, wide[:, :24], bias, labels)
    check_against_reference(backend, hidden, weight.t().contiguous().t(), bias, labels, temperature=0.5)
    check_against_reference(backend, hidden[:, ::2], weight[::3], bias[::3], labels[:, ::2] // 3,
                            return_entropy=True)


def check_tied_embeddings(backend):
    """The lm_head is the embedding matrix: its gradient sums the embedding's and the head's."""
    v, h, n = 50, 16, 23
    g = torch.Generator().manual_seed(3)
    table = torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (n,), generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    proj = torch.randn(h, h, generator=g) / h ** 0.5

    def run(emb, fn, **kw):
        hidden = torch.tanh(emb[ids] @ proj.to(emb.dtype)) * 3
        return fn(hidden, emb, labels, **kw)

    emb = table.clone().requires_grad_(True)
    lp = run(emb, lr.logprobs_from_hidden, backend=backend)
    (grad,) = torch.autograd.grad(lp.sum(), emb)
    emb64 = table.double().requires_grad_(True)
    lp64 = run(emb64, ref.logprobs_from_hidden)
    (grad64,) = torch.autograd.grad(lp64.sum(), emb64)
    assert_matches(lp, lp64, torch.float32, 10.0, f"{backend} tied logprobs")
    assert_matches(grad, grad64, torch.float32, grad64.abs().max().item(), f"{backend} tied grad")


def check_special_values(backend):
    """A masked vocabulary (-inf bias), a label on a masked entry (-inf), NaN in one row only."""
    hidden, weight, bias, labels = make_inputs()
    bias = bias.clone()
    bias[::7] = float("-inf")
    labels = labels.clone()
    labels[0] = 14
    check_against_reference(backend, hidden, weight, bias, labels, return_entropy=True, temperature=0.8)
    hidden = hidden.clone()
    hidden[3, 5] = float("nan")
    check_against_reference(backend, hidden, weight, bias, labels, return_entropy=True, grads=False)
    hidden, weight, bias, labels = make_inputs()
    check_against_reference(backend, hidden * 300, weight, bias * 1e4, labels, return_entropy=True)


def check_deterministic_and_unmodified(backend):
    hidden, weight, bias, labels = make_inputs(n=45)
    copies = [t.clone() for t in (hidden, weight, bias, labels)]
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        lp, ent = lr.logprobs_from_hidden(leaves[0], leaves[1], labels, bias=leaves[2], return_entropy=True,
                                          ignore_index=3, backend=backend)
        grads = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), leaves)
        runs.append((lp, ent) + grads)
    for a, b in zip(*runs):
        assert torch.equal(a, b), f"{backend}: two runs on the same inputs differ"
    for t, c in zip((hidden, weight, bias, labels), copies):
        assert torch.equal(t, c), f"{backend}: an input was modified"


def check_batch_invariant(backend):
    """A row's logprob, entropy and hidden gradient do not depend on the other rows."""
    if not lr.get_registry().get(backend).batch_invariant:
        return
    hidden, weight, bias, labels = make_inputs(n=40, v=300)

    def run(rows):
        leaf = hidden[rows].clone().requires_grad_(True)
        lp, ent = lr.logprobs_from_hidden(leaf, weight, labels[rows], bias=bias, return_entropy=True, backend=backend)
        (g,) = torch.autograd.grad(lp.sum() + ent.sum(), leaf)
        return lp.detach(), ent.detach(), g

    full = run(slice(None))
    for rows in (slice(7, 8), slice(3, 20), slice(30, 40)):
        for a, b in zip(full, run(rows)):
            assert torch.equal(a[rows], b), f"{backend}: rows {rows} differ when run alone"


CHECKS = (check_values_and_grads, check_shapes, check_layouts, check_tied_embeddings, check_special_values,
          check_deterministic_and_unmodified, check_batch_invariant)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", _declaring())
def test_conformance(backend, check):
    check(backend)


# ---------------------------------------------------------------------- the tolerance itself
def test_tolerance_rejects_bf16_logits():
    """The tolerance of the checks above would fail an op that rounds the logits to bf16."""
    hidden, weight, bias, labels = make_inputs(dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(hidden, weight, bias)  # bf16 output
    got = ref.logprobs(logits, labels, dtype=torch.float32)
    want = ref.logprobs_from_hidden(hidden, weight, labels, bias=bias)
    z = ref.hidden_logits(hidden, weight, bias)
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        assert_matches(got, want, torch.bfloat16, 1 + z.abs().max().item(), "bf16 logits")


def test_mixed_dtypes_raise():
    hidden, weight, bias, labels = make_inputs()
    with pytest.raises(TypeError, match="hidden is torch.bfloat16 but weight is torch.float32"):
        lr.logprobs_from_hidden(hidden.bfloat16(), weight, labels, backend=TEST_BACKEND)
    with pytest.raises(TypeError, match="but bias is torch.float64"):
        lr.logprobs_from_hidden(hidden, weight, labels, bias=bias.double(), backend=TEST_BACKEND)


# ------------------------------------------------------------------- the chunked implementation
def _direct(hidden, weight, bias, labels, budget, **kw):
    opts = dict(temperature=1.0, ignore_index=None, return_entropy=False)
    opts.update(kw)
    return ch.logprobs_from_hidden(hidden, weight, labels, bias=bias, chunk_bytes=budget, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("budget", [4, 96, 1000, 4 << 20])
def test_chunk_budgets(dtype, budget, monkeypatch):
    """Budgets from one logit a tile (vocabulary split to single entries, online log-sum-exp across
    31 blocks) to everything in one tile; N of 19 is no multiple of any tile height."""
    hidden, weight, bias, labels = make_inputs(n=19, v=31, dtype=dtype)
    tiles = ch.plan(19, 31, 24, dtype, budget)
    if budget < 1000:
        assert tiles.cols < 31
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, str(budget))
    labels = labels.clone()
    labels[::5] = -1
    bias = bias.clone()
    bias[10:15] = float("-inf")
    check_against_reference(TEST_BACKEND, hidden, weight, bias, labels, temperature=1.3, ignore_index=-1,
                            return_entropy=True)


def test_budget_changes_nothing_but_rounding():
    hidden, weight, bias, labels = make_inputs(n=64, v=200)
    outs = [_direct(hidden, weight, bias, labels, b, return_entropy=True) for b in (256, 4096, 1 << 20)]
    for lp, ent in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], rtol=0, atol=2e-5)
        torch.testing.assert_close(ent, outs[0][1], rtol=0, atol=2e-5)


def test_plan():
    assert ch.plan(4096, 32768, 2048, torch.float32, 4 << 20) == ch.Plan(1024, 1024)
    # the vocabulary block does not depend on the number of tokens (batch invariance)
    assert ch.plan(1, 32768, 2048, torch.float32, 4 << 20).cols == 1024
    # a bf16 weight block's fp32 copy fits the budget
    tiles = ch.plan(4096, 32768, 2048, torch.bfloat16, 4 << 20)
    assert tiles.cols * 2048 * 4 <= 4 << 20 and tiles.rows * tiles.cols * 4 <= 4 << 20
    assert ch.plan(0, 0, 8, torch.float32, 1) == ch.Plan(1, 1)
    assert ch.plan(10, 5, 8, torch.float64, 1 << 20) == ch.Plan(10, 5)


def test_budget_sources(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ch.CHUNK_BYTES_ENV, raising=False)
    assert ch.resolve_chunk_bytes(cpu) == ch.DEFAULT_CHUNK_BYTES["cpu"]
    assert ch.resolve_chunk_bytes(torch.device("meta")) == ch.DEFAULT_CHUNK_BYTES["default"]
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, "12345")
    assert ch.resolve_chunk_bytes(cpu) == 12345
    assert ch.resolve_chunk_bytes(cpu, 77) == 77
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES='lots' is not an integer"):
        ch.resolve_chunk_bytes(cpu)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
        ch.resolve_chunk_bytes(cpu, 0)


class _Sizes(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tensor_of_logits_size(dtype):
    """Neither pass creates a tensor anywhere near N x V, nor saves one for backward: the largest
    is the weight gradient (V x H) or one tile."""
    n, h, v, budget = 256, 8, 512, 16 << 10
    hidden, weight, bias, labels = make_inputs(n=n, h=h, v=v, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _Sizes() as sizes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = _direct(leaves[0], leaves[1], leaves[2], labels, budget, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
    tiles = ch.plan(n, v, h, dtype, budget)
    bound = max(v * h, n * h, budget // 4, ch.MIN_GEMM_ROWS * tiles.cols)
    assert bound < n * v // 8
    assert sizes.largest <= bound, (sizes.largest, bound)
    assert max(saved) <= max(v * h, n * h), saved


def test_weight_gradient_accumulates_once_per_use():
    """Two calls on one weight (two sequences, one lm_head) sum their gradients, as autograd does."""
    hidden, weight, bias, labels = make_inputs()
    w = weight.clone().requires_grad_(True)
    a = _direct(hidden[:20], w, bias, labels[:20], 4096)
    b = _direct(hidden[20:], w, bias, labels[20:], 4096)
    (g,) = torch.autograd.grad(a.sum() + b.sum(), w)
    w64 = weight.double().requires_grad_(True)
    r = ref.logprobs_from_hidden(hidden.double(), w64, labels, bias=bias.double())
    (g64,) = torch.autograd.grad(r.sum(), w64)
    assert_matches(g, g64, torch.float32, g64.abs().max().item(), "weight grad over two calls")


@pytest.mark.parametrize("used", ["logprobs", "entropy"])
def test_one_output_used(used):
    """Only one of the two outputs enters the loss: the other's gradient is None, not zeros."""
    hidden, weight, bias, labels = make_inputs()
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    refs = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    got = _direct(leaves[0], leaves[1], leaves[2], labels, 4096, return_entropy=True, ignore_index=3)
    want = ref.logprobs_from_hidden(refs[0], refs[1], labels, bias=refs[2], return_entropy=True, ignore_index=3)
    k = 0 if used == "logprobs" else 1
    for a, b in zip(torch.autograd.grad(got[k].sum(), leaves), torch.autograd.grad(want[k].sum(), refs)):
        assert_matches(a, b, torch.float32, b.abs().max().item(), f"grad through {used} only")


def test_only_requested_gradients():
    hidden, weight, bias, labels = make_inputs()
    w = weight.clone().requires_grad_(True)
    out = _direct(hidden, w, bias, labels, 4096)
    (g,) = torch.autograd.grad(out.sum(), w)
    assert g.shape == weight.shape
    with torch.no_grad():
        out = _direct(hidden, w, bias, labels, 4096)
    assert out.grad_fn is None and out.dtype == torch.float32


def test_entropy_output_modified_in_place():
    """Backward does not read the entropy tensor handed to the caller, who may overwrite it."""
    hidden, weight, bias, labels = make_inputs()
    grads = []
    for overwrite in (False, True):
        leaf = hidden.clone().requires_grad_(True)
        lp, ent = _direct(leaf, weight, bias, labels, 4096, return_entropy=True)
        loss = lp.sum() + ent.sum()
        if overwrite:
            with torch.no_grad():
                ent.zero_()
        grads.append(torch.autograd.grad(loss, leaf)[0])
    assert torch.equal(grads[0], grads[1])
