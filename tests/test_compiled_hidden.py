"""``compiled``'s fused op (``logprobs_from_hidden``, :mod:`logprob_registry.kernels.compiled._hidden`):
what is specific to its implementation. The op's contract (values and gradients in every dtype,
shapes, layouts, tied embeddings, special values, determinism, batch invariance, no (N, V) tensor)
is checked by the shipped suite's hidden section, and ``logits_dtype`` by its semantics section,
which ``tests/test_conformance.py`` runs against ``compiled``; here are its tile plan, the suite's
checks again with tiles small enough that every call crosses row and vocabulary boundaries, the
softcap (which the suite checks for the fused op only together with truncation), batch invariance
at tile boundaries, one compile across shapes, the memory of backward, and compile failures.

Compiling costs seconds: the tests share a few kinds of call, and the ones that compile afresh come last.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, peak_extra_bytes
from logprob_registry.environment import get_environment
from logprob_registry.kernels import compiled
from logprob_registry.kernels.compiled import _hidden as ch
from logprob_registry.kit import MIN_GEMM_ROWS
from logprob_registry.numerics import hidden_tolerances
from logprob_registry.testing.harness import Harness
from logprob_registry.testing.sections.hidden import check_hidden

CPU = torch.device("cpu")
NO_COMPILER = compiled.available(get_environment(), "cpu")
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=f"needs a C++ compiler: {NO_COMPILER}")
SMALL = (32, 40)  # rows x cols of the tiles in the boundary tests


@pytest.fixture(scope="module")
def lp() -> Harness:
    """``compiled`` on the CPU, as the conformance suite reaches it."""
    return Harness(lr.get_registry().get("compiled"), CPU)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setitem(ch.TILES, "cpu", SMALL)


def make_inputs(n=37, h=24, v=97, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, labels


def call(hidden, weight, labels, **kw):
    return lr.logprobs_from_hidden(hidden, weight, labels, backend="compiled", **kw)


# --------------------------------------------------------------------------------- the tile plan
def test_plan_does_not_depend_on_the_number_of_tokens():
    f32 = torch.float32
    assert ch.plan(32768, 2048, f32, "cpu") == ch.Plan(4096, 1024, False)
    assert ch.plan(300, 2048, f32, "cpu") == ch.Plan(4096, 300, False)  # one block for a small vocabulary
    assert ch.plan(32768, 2048, f32, "cuda") == ch.Plan(1024, 8192, True)  # accelerators: one matmul shape
    assert ch.plan(1, 2048, f32, "cpu").cols == 1
    # a tile of bf16 hidden rows upcast to fp32 fits UPCAST_BYTES
    assert ch.plan(32768, 2048, torch.bfloat16, "cpu").rows * 2048 * 4 == ch.UPCAST_BYTES


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1023, 1024, 1025, 1039, 1040, 3000])
def test_row_tiles_cover_every_row_once_and_none_is_short(n):
    p = ch.plan(50000, 64, torch.float32, "cpu")._replace(rows=1024)
    bounds = ch.row_tiles(n, p)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(r1 - r0 <= p.rows for r0, r1 in bounds)
    if n >= MIN_GEMM_ROWS:  # only a call of fewer rows than the matmul needs is padded
        assert all(r1 - r0 >= MIN_GEMM_ROWS for r0, r1 in bounds), bounds
    cuda = ch.plan(50000, 64, torch.float32, "cuda")
    fixed = ch.row_tiles(n, cuda)  # no borrowing: every tile padded to its full height
    assert [r0 for r0, _ in fixed] == list(range(0, n, 1024))
    assert all(t.rows == 1024 for t in ch._tiles(n, cuda))  # padded to one shape


@pytest.mark.parametrize("v", [1, 2, 1024, 1025, 2049, 3000])
def test_vocabulary_blocks_cover_the_vocabulary_and_none_has_one_column_but_a_vocabulary_of_one(v):
    bounds = ch.vocab_blocks(v, ch.plan(v, 64, torch.float32, "cpu"))
    assert bounds[0][0] == 0 and bounds[-1][1] == v and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(v1 - v0 >= min(2, v) and v1 - v0 <= 1024 for v0, v1 in bounds), bounds


# --------------------------------------------------------------------------------- tile boundaries
@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_values_and_gradients_across_tiles(lp, small_tiles, dtype):
    """The suite's check with tiles of 32 x 40: 83 rows in tiles of 32, 32, 19; 97 vocabulary entries
    in blocks of 40, 40, 17 (online log-sum-exp across blocks, labels in each), masked entries, a
    masked label, ignored labels, temperature and entropy."""
    hidden, weight, bias, labels = make_inputs(n=83, v=97, dtype=dtype)
    labels[::5] = -1
    bias[38:45] = float("-inf")  # across a block boundary
    labels[3] = 41  # a label on a masked entry: -inf, no gradient
    check_hidden(lp, hidden, weight, bias, labels, temperature=1.3, ignore_index=-1, return_entropy=True,
                 what=f"compiled logprobs_from_hidden, {dtype}, tiles {SMALL}")


@needs_compiler
def test_a_block_whose_logits_are_all_masked_so_far(lp, small_tiles):
    """Rows whose first vocabulary block is all -inf (the running max stays -inf, then becomes finite)."""
    hidden, weight, bias, labels = make_inputs(n=20, v=97)
    bias[:40] = float("-inf")
    labels[labels < 40] += 40
    check_hidden(lp, hidden, weight, bias, labels, return_entropy=True, what="first block masked")


@needs_compiler
@pytest.mark.parametrize("cap", [3.0, None])
@pytest.mark.parametrize("logits_dtype", [None, torch.bfloat16])
def test_softcap_and_logits_dtype_against_the_reference(small_tiles, cap, logits_dtype):
    """softcap and logits_dtype in the fused op (values and gradients against float64 autograd of the
    reference; logits_dtype with exact products, so that the rounding is the same from any matmul)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randint(-64, 65, (2, 21, 48), generator=g).double() / 16
    weight = torch.randint(-64, 65, (97, 48), generator=g).double() / 256
    bias = torch.randint(-8, 9, (97,), generator=g).double() / 8
    labels = torch.randint(0, 97, (2, 21), generator=g)
    labels[0, 3] = -100
    kw = dict(temperature=0.7, ignore_index=-100, return_entropy=True, softcap=cap, logits_dtype=logits_dtype)
    leaves = [t.float().requires_grad_(True) for t in (hidden, weight, bias)]
    got = call(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
    refs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    want = ref.logprobs_from_hidden(refs[0], refs[1], labels, bias=refs[2], **kw)
    tol = max(hidden_tolerances(hidden.float(), weight.float(), bias.float(), 0.7))
    for name, a, b in zip(("logprobs", "entropy"), got, want):
        assert a.dtype == torch.float32
        err = float((a.detach().double() - b.detach()).abs().max())
        assert err <= tol, f"{name}: off by {err:.3g}, more than {tol:.3g}"
    g_up = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in want]
    torch.autograd.backward(list(got), [u.float() for u in g_up])
    torch.autograd.backward(list(want), g_up)
    for name, leaf, r in zip(("hidden", "weight", "bias"), leaves, refs):
        err, scale = float((leaf.grad.double() - r.grad).abs().max()), float(r.grad.abs().max())
        assert err <= 1e-5 * scale, f"gradient of {name}: off by {err:.3g} (largest element {scale:.3g})"
    if cap is not None:  # the softcap changed something
        plain = call(hidden.float(), weight.float(), labels, bias=bias.float(), temperature=0.7, ignore_index=-100)
        assert not torch.allclose(plain, got[0].detach())


# --------------------------------------------------------------------------------- batch invariance
@needs_compiler
def test_batch_invariant_at_tile_boundaries(small_tiles):
    """A row's logprob, entropy and hidden gradient are bitwise the same alone (padded to 16 rows),
    as the last of 33 rows (a last tile of one row borrows 15 from the one before), and in batches
    of 64 and 100, with tiles of 32 x 40 (bf16 too: upcast per tile)."""
    def run(inputs, rows):
        hidden, weight, bias, labels = inputs
        leaf = hidden[rows].clone().requires_grad_(True)
        lp_, ent = call(leaf, weight, labels[rows], bias=bias, return_entropy=True)
        (grad,) = torch.autograd.grad(lp_.sum() + ent.sum(), leaf)
        return lp_.detach(), ent.detach(), grad

    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(n=100, v=97, dtype=dtype, seed=5)
        whole = run(inputs, slice(None))
        for rows in (slice(32, 33), slice(0, 33), slice(1, 33), slice(20, 84), slice(31, 100)):
            for name, part, full in zip(("logprobs", "entropy", "hidden's gradient"), run(inputs, rows), whole):
                assert torch.equal(part, full[rows]), f"{dtype} {name} of rows {rows} differs from the batch of 100"


@needs_compiler
def test_batch_invariant_with_the_default_tiles():
    """The default CPU tiles with a realistic hidden size: a row alone, among 17 rows, and as row
    4101 of 4102 (a tile of 4096 rows then one of 6, which takes 10 rows from the first) give the
    same bits: the CPU matmul gives a row the same result in any tile of at least 16 rows."""
    hidden, weight, _, labels = make_inputs(n=4102, h=256, v=1100, seed=7)
    with torch.no_grad():
        whole = call(hidden, weight, labels, return_entropy=True)
        for rows in (slice(4101, 4102), slice(4085, 4102), slice(4000, 4102), slice(0, 17), slice(3, 4099)):
            part = call(hidden[rows], weight, labels[rows], return_entropy=True)
            for name, a, b in zip(("logprobs", "entropy"), part, whole):
                assert torch.equal(a, b[rows]), f"{name} of rows {rows} differs from the batch of 1030"


# --------------------------------------------------------------------------------- RL steps
@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_weight_forms_the_hidden_gradient_in_forward(small_tiles, monkeypatch, bias):
    """A weight (and bias) without ``requires_grad``: the forward accumulates ``softmax @ W`` across
    tiles (its running sum rescaled as the max grows) and the backward recomputes no tile; the
    hidden gradient is float64's, through several row and vocabulary tiles and a temperature."""
    hidden, weight, b, labels = make_inputs(n=70, v=130, bias=bias, seed=4)
    labels[::3] = -100
    recomputed = []
    monkeypatch.setattr(ch, "_backward", lambda *a, **k: recomputed.append(1))
    h = hidden.clone().requires_grad_(True)
    out = call(h, weight, labels, bias=b, temperature=0.7, ignore_index=-100)
    up = torch.linspace(-3, 5, 70, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * up.float()).sum(), h)
    h64 = hidden.double().requires_grad_(True)
    want = ref.logprobs_from_hidden(h64, weight.double(), labels, bias=None if b is None else b.double(),
                                    temperature=0.7, ignore_index=-100)
    (grad64,) = torch.autograd.grad((want * up).sum(), h64)
    assert not recomputed
    assert (out.double() - want).abs().max() < 1e-5
    assert (grad.double() - grad64).abs().max() < 1e-5 * grad64.abs().max()
    assert bool((grad[::3] == 0).all())


@needs_compiler
def test_the_hidden_gradient_is_formed_in_forward_only_when_it_is_the_only_one_needed(monkeypatch):
    """The running ``softmax @ W`` costs a matmul a tile: it is accumulated only when the hidden needs
    a gradient and the weight does not, never under ``torch.no_grad()``, nor with the entropy."""
    hidden, weight, _, labels = make_inputs(n=20, v=50, bias=False, seed=6)
    seen = []
    real = ch._forward
    monkeypatch.setattr(ch, "_forward", lambda c, entropy, accumulate=False, stats=False: seen.append(accumulate) or
                        real(c, entropy, accumulate, stats))
    with torch.no_grad():
        call(hidden.requires_grad_(True), weight, labels)
    call(hidden, weight.clone().requires_grad_(True), labels)
    call(hidden, weight, labels, return_entropy=True)
    call(hidden, weight, labels)
    assert seen == [False, False, False, True]


@needs_compiler
def test_ignored_rows_cost_nothing_and_change_no_active_row(monkeypatch):
    """Only the active rows reach the tiles, forward and backward; their results and gradients are
    bitwise those of the call in which every row is active; ignored rows get 0 and zero gradients."""
    hidden, weight, _, labels = make_inputs(n=300, v=200, bias=False, seed=8)
    ignored = torch.rand(300, generator=torch.Generator().manual_seed(1)) < 0.8
    rows = []
    real = ch._forward
    monkeypatch.setattr(ch, "_forward", lambda c, *a: rows.append(c.hidden.shape[0]) or real(c, *a))

    def run(y):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = call(h, w, y, ignore_index=-100)
        gh, gw = torch.autograd.grad(out.sum(), (h, w))
        return out, gh, gw

    out, gh, gw = run(labels.masked_fill(ignored, -100))
    assert rows == [int((~ignored).sum())]
    full, full_gh, _ = run(labels)
    assert torch.equal(out[~ignored], full[~ignored]) and torch.equal(gh[~ignored], full_gh[~ignored])
    assert bool((out[ignored] == 0).all()) and bool((gh[ignored] == 0).all())
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want = ref.logprobs_from_hidden(h64, w64, labels.masked_fill(ignored, -100), ignore_index=-100)
    (gw64,) = torch.autograd.grad(want.sum(), w64)
    assert (gw.double() - gw64).abs().max() < 1e-5


# --------------------------------------------------------------------------------- memory
@needs_compiler
def test_backward_keeps_no_logits():
    """Forward and backward at 2048 x 16384 (128 MiB of fp32 logits): the backward's extra peak is its
    gradients (weight 16 MiB, hidden 1 MiB) and a few tiles (8 MiB each here), far below the logits."""
    hidden, weight, _, labels = make_inputs(n=2048, h=128, v=16384, seed=9)
    logits = 2048 * 16384 * 4

    def fwd_bwd():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp_, ent = call(h, w, labels, return_entropy=True)
        return torch.autograd.grad(lp_.sum() + ent.sum(), (h, w))

    fwd_bwd()
    try:  # the least of three readings: other processes can only make one larger
        extra = min(peak_extra_bytes(fwd_bwd, CPU)[1] for _ in range(3))
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure peak memory here: {exc}")
    grads = (16384 + 2048) * 128 * 4 * 2  # the gradients and the leaves' copies of the inputs
    assert extra - grads < 0.25 * logits, (
        f"forward and backward took {(extra - grads) / 2**20:.1f} MiB beyond the gradients, more than a "
        f"quarter of the {logits / 2**20:.0f} MiB of logits they must never form")


# --------------------------------------------------------------------------------- compilation
@pytest.fixture
def fresh():
    ch.reset()
    lr.get_registry().reset()
    yield
    ch.reset()
    lr.get_registry().reset()


@needs_compiler
def test_one_compile_covers_tokens_vocabularies_hidden_sizes_and_temperatures(fresh):
    """Five calls with gradients and different N, V, H and temperature (bf16 among them: upcast
    outside the kernels), two of them with a frozen weight, and token_stats of each, cost one
    compile of each kernel."""
    for i, (n, h, v, dtype) in enumerate([(5, 24, 97, torch.float32), (40, 32, 1500, torch.float32),
                                          (4110, 16, 3000, torch.bfloat16), (17, 8, 50, torch.float32),
                                          (64, 24, 2049, torch.float32)]):
        hidden, weight, bias, labels = make_inputs(n=n, h=h, v=v, dtype=dtype, seed=i)
        hidden.requires_grad_(True)
        weight.requires_grad_(i % 2 == 0)  # odd: a frozen weight, whose forward kernel is fwd_acc_step
        t = (0.5, 1.0, 1.3, 2.0, 0.9)[i]
        out = call(hidden, weight, labels, bias=bias, temperature=t)
        out.sum().backward()
        with torch.no_grad():  # token_stats' tiles (every field): one compile too
            lr.token_stats(hidden, labels, weight=weight, bias=bias, outputs=lr.TokenStats._fields, temperature=t,
                           backend="compiled")
    assert ch.compile_counts() == {"fwd_step": 1, "bwd_step": 1, "fwd_acc_step": 1, "fwd_stats_step": 1}


@needs_compiler
def test_compile_failure_raises_from_the_forward_and_falls_back(fresh, monkeypatch):
    import torch._inductor.compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("injected inductor failure")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    # compiled's min_size for the fused op lies above every bounded bucket: the automatic choice
    # takes it for vocabularies above the last bucket (262144) only
    hidden, weight, bias, labels = make_inputs(h=16, v=262200)
    with pytest.raises(compiled.CompileError, match="logprobs_from_hidden fwd_step kernel failed .* injected"):
        call(hidden, weight, labels, bias=bias)
    assert lr.select("logprobs_from_hidden", device="cpu", shape=(37, 262200), hidden_size=16).name == "compiled"
    with pytest.warns(lr.BackendFallbackWarning, match="injected inductor failure"):
        out = lr.logprobs_from_hidden(hidden, weight, labels, bias=bias)
    expected = lr.logprobs_from_hidden(hidden, weight, labels, bias=bias, backend="chunked")
    assert torch.equal(out, expected)


@needs_compiler
def test_backward_compile_failure_surfaces_in_the_forward(fresh, monkeypatch):
    hidden, weight, bias, labels = make_inputs()
    call(hidden, weight, labels, bias=bias)  # the forward kernel compiles
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda *a, **k: 1 / 0)
    leaf = hidden.clone().requires_grad_(True)
    trained = weight.clone().requires_grad_(True)  # (a frozen weight's plain call has no backward kernel)
    with pytest.raises(compiled.CompileError, match="bwd_step kernel failed .*ZeroDivisionError"):
        call(leaf, trained, labels, bias=bias)


@needs_compiler
def test_backward_kernel_failing_late_runs_the_same_function_eagerly(fresh, monkeypatch, small_tiles):
    hidden, weight, bias, labels = make_inputs(n=50)
    call(hidden, weight, labels, bias=bias)  # the forward kernel compiles
    monkeypatch.setattr(ch, "_warm_backward", lambda *a: None)  # as if the warm-up had not met it
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda *a, **k: 1 / 0)
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref.logprobs_from_hidden(hr, wr, labels, bias=bias.double(), temperature=0.8).sum().backward()
    messages = []
    for _ in range(2):
        leaf, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call(leaf, w, labels, bias=bias, temperature=0.8).sum().backward()
        messages.append([str(r.message) for r in record if issubclass(r.category, lr.BackendFallbackWarning)])
        for got, want in ((leaf.grad, hr.grad), (w.grad, wr.grad)):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert len(messages[0]) == 1 and messages[1] == []
    assert "bwd_step" in messages[0][0] and "eagerly" in messages[0][0]
    assert not math.isnan(float(leaf.grad.sum()))
