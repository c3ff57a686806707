"""The ``chunked`` backend's ``kl_divergence`` (``logprob_registry/kernels/chunked/_kl.py``): values and
the student's gradients against the float64 reference (both directions, temperature, mask, hidden
states, support, bf16/fp32, -inf logits, strided logits), tiles of every size, the memory bound
(no allocation of the logits' size besides the gradient, forward and backward) and batch invariance."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.kernels import chunked
from logprob_registry.kernels.chunked import _hidden, _kl
from logprob_registry.numerics import EPS32, assert_close


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of a few thousand cells, so that every test crosses many tile boundaries."""
    chunked.set_workspace_bytes(48 << 10)
    monkeypatch.setenv(_hidden.CHUNK_BYTES_ENV, str(48 << 10))
    yield
    chunked.set_workspace_bytes(None)


def kl(student, teacher, **kw):
    return lr.kl_divergence(student, teacher, backend="chunked", **kw)


def finite_max(x: torch.Tensor) -> float:
    x = x.detach().abs()
    return float(x[torch.isfinite(x)].max())


def tol(*tensors, temperature=1.0) -> float:
    """A small multiple of fp32 rounding of the tempered logits' magnitude."""
    mag = max(finite_max(t) for t in tensors) / temperature
    return 32 * EPS32 * (1.0 + mag)


def pair(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return s, t


def check(student, teacher, *, weights=None, rtol=0.0, **kw):
    """Values and the student's gradients (logits, or hidden and weight) against the reference."""
    sw, tw = weights if weights is not None else (None, None)
    leaves = [student] if sw is None else [student, sw]
    xs = [x.detach().requires_grad_(True) for x in leaves]
    x64 = [x.detach().double().requires_grad_(True) for x in leaves]
    got = kl(xs[0], teacher, student_weight=None if sw is None else xs[1], teacher_weight=tw, **kw)
    want = ref.kl_divergence(x64[0], teacher, student_weight=None if sw is None else x64[1], teacher_weight=tw, **kw)
    assert got.dtype == (torch.float64 if student.dtype == torch.float64 else torch.float32)
    # hidden states: their logits are bounded by max(|hidden| @ |weight|.T)
    mag = max(float(finite_max(x) if w is None else
                    (x.detach().double().abs() @ w.detach().double().abs().t()).max())
              for x, w in ((student, sw), (teacher, tw)))
    bound = 32 * EPS32 * (1.0 + mag / kw.get("temperature", 1.0))
    assert_close(got, want, bound, "kl")
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got.backward(g.float())
    want.backward(g)
    for x, y, name in zip(xs, x64, ("student", "student_weight")):
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        assert_close(x.grad, y.grad, bound * float(g.abs().max()) * 4, f"grad {name}", rtol=rtol)
    return got


# ---------------------------------------------------------------------------------- values and gradients
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logits_against_the_reference(direction, temperature, dtype):
    s, t = pair((3, 13, 700), dtype)
    check(s, t, direction=direction, temperature=temperature, rtol=2.0 ** -7 if dtype == torch.bfloat16 else 0.0)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_mask_gives_zero_and_a_zero_gradient(direction):
    s, t = pair((5, 9, 300))
    mask = torch.rand(5, 9, generator=torch.Generator().manual_seed(3)) > 0.4
    s[~mask] = float("nan")  # masked positions are never read into the result
    x = s.clone().requires_grad_(True)
    out = kl(x, t, direction=direction, mask=mask)
    assert (out[~mask] == 0).all() and torch.isfinite(out[mask]).all()
    out.sum().backward()
    assert (x.grad[~mask] == 0).all()
    s[~mask] = 0.0
    check(s, t, direction=direction, mask=mask, temperature=0.9)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_states_against_the_reference(direction, dtype):
    g = torch.Generator().manual_seed(5)
    hs, ws = torch.randn(2, 21, 24, generator=g), torch.randn(900, 24, generator=g) / 3
    ht, wt = torch.randn(2, 21, 40, generator=g), torch.randn(900, 40, generator=g) / 4
    hs, ws, ht, wt = (x.to(dtype) for x in (hs, ws, ht, wt))
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    check(hs, ht, weights=(ws, wt), direction=direction, temperature=0.8, rtol=rtol)
    t_logits = (ht.double() @ wt.double().t()).to(dtype)  # a student of hidden states, a teacher of logits
    check(hs, t_logits, weights=(ws, None), direction=direction, rtol=rtol)


def test_teacher_hidden_student_logits():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(7, 600, generator=g) * 2
    ht, wt = torch.randn(7, 16, generator=g), torch.randn(600, 16, generator=g) / 2
    for direction in ("forward", "reverse"):
        check(s, ht, weights=(None, wt), direction=direction)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_support(tail, direction):
    s, t = pair((4, 6, 500))
    g = torch.Generator().manual_seed(7)
    support = torch.rand(4, 6, 500, generator=g).argsort(-1)[..., :9]
    check(s, t, support=support, tail=tail, direction=direction, temperature=0.9)
    mask = torch.rand(4, 6, generator=g) > 0.5
    check(s, t, support=support, tail=tail, direction=direction, mask=mask)


def test_support_with_hidden_states():
    g = torch.Generator().manual_seed(8)
    hs, ws = torch.randn(11, 20, generator=g), torch.randn(700, 20, generator=g) / 3
    t = torch.randn(11, 700, generator=g) * 2
    support = torch.rand(11, 700, generator=g).argsort(-1)[:, :5]
    for tail in (True, False):
        check(hs, t, weights=(ws, None), support=support, tail=tail, direction="reverse")


def test_support_of_the_whole_vocabulary_has_an_empty_tail():
    s, t = pair((3, 300))
    support = torch.arange(300).flip(0).expand(3, 300)
    check(s, t, support=support)
    assert_close(kl(s, t, support=support), ref.kl_divergence(s, t), tol(s, t), "whole vocabulary")


def test_minus_inf_logits():
    s, t = pair((4, 400))
    s[:, 10:50] = float("-inf")  # masked vocabulary on both sides
    t[:, 10:50] = float("-inf")
    for direction, zeros in (("forward", t), ("reverse", s)):
        one = zeros.clone()
        one[:, 60:70] = float("-inf")  # zero mass on the weighing side only: 0 log 0 = 0
        a, b = (s, one) if direction == "forward" else (one, t)
        got = check(a, b, direction=direction)
        assert torch.isfinite(got).all()
    # the weighing side has mass where the other has none: the KL is +inf
    s2 = s.clone()
    s2[:, 200] = float("-inf")
    assert torch.isinf(kl(s2, t)).all() and torch.isinf(kl(t, s2, direction="reverse")).all()


def test_large_magnitudes():
    s, t = pair((6, 500), scale=1.0)
    check(s + 1e4, t - 1e4, direction="forward")
    check(s * 1e3, t * 1e3, direction="reverse", temperature=50.0)


def test_strided_logits_are_not_copied_and_match():
    s, t = pair((3, 9, 400))
    check(s[:, :-1], t[:, 1:], direction="reverse", temperature=1.3)


@pytest.mark.parametrize("budget", [1, 5000, 1 << 20])
@pytest.mark.parametrize("rows", [1, 2, 17, 40])
def test_every_tile_size(budget, rows):
    chunked.set_workspace_bytes(budget)
    s, t = pair((rows, 97))
    for direction in ("forward", "reverse"):
        check(s, t, direction=direction)


def test_no_gradient_reaches_the_teacher():
    s, t = pair((4, 300))
    x, y = s.requires_grad_(True), t.requires_grad_(True)
    kl(x, y).sum().backward()
    assert x.grad is not None and y.grad is None


def test_double_backward():
    s, t = pair((2, 20), torch.float64)
    x = s.requires_grad_(True)
    torch.autograd.gradgradcheck(lambda a: kl(a, t, direction="reverse", temperature=0.8), (x,))


# ---------------------------------------------------------------------------------- memory
def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_allocation_of_the_logits_size(dtype):
    chunked.set_workspace_bytes(256 << 10)  # tiles of 64 KiB: 16 of them
    s, t = pair((2, 65, 2048), dtype)
    s, t = s[:, :-1], t[:, 1:]  # strided: never copied
    size = s.shape[0] * s.shape[1] * s.shape[2] * 4  # one (N, V) fp32 tensor
    for direction in ("forward", "reverse"):
        assert _largest_allocation(lambda d=direction: kl(s, t, direction=d, temperature=0.7)) < size / 10
        x = s.detach().requires_grad_(True)
        out = kl(x, t, direction=direction)
        grad = x.numel() * x.element_size()
        peak = _largest_allocation(out.sum().backward)
        assert grad <= peak < grad + size / 10  # the gradient itself, nothing else of that size
    # the textbook formula does make one, so the measurement can see it
    assert _largest_allocation(lambda: ref.kl_divergence(s, t, dtype=torch.float32)) >= size


def test_hidden_states_allocate_nothing_of_the_logits_size(monkeypatch):
    monkeypatch.setenv(_hidden.CHUNK_BYTES_ENV, str(1 << 20))  # tiles of 256 KiB: 16 of them
    g = torch.Generator().manual_seed(9)
    hs, ws = torch.randn(512, 32, generator=g).requires_grad_(True), torch.randn(2048, 32, generator=g) / 4
    ws.requires_grad_(True)
    ht, wt = torch.randn(512, 48, generator=g), torch.randn(2048, 48, generator=g) / 4
    size = 512 * 2048 * 4
    for direction in ("forward", "reverse"):
        outs: list = []

        def call(d=direction, outs=outs):
            outs.append(kl(hs, ht, student_weight=ws, teacher_weight=wt, direction=d))

        assert _largest_allocation(call) < size / 10
        assert _largest_allocation(outs[0].sum().backward) < size / 10


def _peak(make) -> int:
    from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, peak_extra_bytes
    try:
        return min(peak_extra_bytes(make(), torch.device("cpu"))[1] for _ in range(3))
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure peak memory here: {exc}")


def test_peak_memory_within_a_tenth_of_the_logits():
    """Resident peak, all allocations together: at most 0.1x one (N, V) fp32 tensor beyond the
    gradient, forward and backward."""
    # tiles of 128 KiB; resident readings carry a fixed ~0.5-2 MiB of noise (allocator, profiler-free
    # bookkeeping), so the logits are large enough (64 MiB in fp32) for the bound to mean something
    chunked.set_workspace_bytes(512 << 10)
    s, t = pair((1024, 16384), torch.bfloat16)
    size = 1024 * 16384 * 4  # 64 MiB
    assert _peak(lambda: lambda: kl(s, t, direction="reverse")) <= size / 10

    def backward():
        x = s.detach().requires_grad_(True)
        out = kl(x, t)
        return lambda: out.sum().backward()

    assert _peak(backward) <= s.numel() * s.element_size() + size / 10  # the gradient and the tiles


# ---------------------------------------------------------------------------------- batch invariance
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_batch_invariant(direction):
    s, t = pair((70, 333))
    x = s.requires_grad_(True)
    full = kl(x, t, direction=direction, temperature=0.9)
    full.sum().backward()
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(17, 70)):
        y = s.detach()[rows].clone().requires_grad_(True)
        part = kl(y, t[rows], direction=direction, temperature=0.9)
        part.sum().backward()
        assert torch.equal(part, full[rows])
        assert torch.equal(y.grad, x.grad[rows])


def test_batch_invariant_hidden():
    g = torch.Generator().manual_seed(10)
    hs, ws = torch.randn(40, 24, generator=g), torch.randn(500, 24, generator=g) / 3
    ht, wt = torch.randn(40, 24, generator=g), torch.randn(500, 24, generator=g) / 3
    x = hs.clone().requires_grad_(True)
    full = kl(x, ht, student_weight=ws, teacher_weight=wt, direction="reverse")
    full.sum().backward()
    for rows in (slice(0, 1), slice(7, 9), slice(3, 40)):
        y = hs[rows].clone().requires_grad_(True)
        part = kl(y, ht[rows], student_weight=ws, teacher_weight=wt, direction="reverse")
        part.sum().backward()
        assert torch.equal(part, full[rows])
        assert torch.equal(y.grad, x.grad[rows])


def test_fixed_shape_layout_matches():
    """The accelerators' layout (every tile padded to one shape), run on the CPU: logits, support,
    hidden states, and the gradients of both."""
    s, t = pair((37, 400))
    support = torch.rand(37, 400, generator=torch.Generator().manual_seed(11)).argsort(-1)[:, :6]
    g = torch.Generator().manual_seed(12)
    h, w = torch.randn(37, 16, generator=g), torch.randn(400, 16, generator=g) / 3
    for direction in ("forward", "reverse"):
        for extra in ({}, {"support": support}):
            x = s.clone().requires_grad_(True)
            x64 = s.double().requires_grad_(True)
            a = _kl.kl_divergence(x, t, direction=direction, temperature=0.9, mask=None, tail=True,
                                  budget=48 << 10, fixed=True, **extra)
            want = ref.kl_divergence(x64, t, direction=direction, temperature=0.9, **extra)
            assert_close(a, want, tol(s, t, temperature=0.9), "fixed layout")
            a.sum().backward()
            want.sum().backward()
            assert_close(x.grad, x64.grad, tol(s, t, temperature=0.9), "fixed layout gradient")
        hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
        a = _kl.kl_divergence(hx, t, direction=direction, temperature=1.0, mask=None, tail=True,
                              student_weight=wx, budget=48 << 10, fixed=True)
        want = ref.kl_divergence(h64, t, direction=direction, student_weight=w64)
        a.sum().backward()
        want.sum().backward()
        assert_close(a, want, 1e-4, "fixed layout, hidden")
        assert_close(hx.grad, h64.grad, 1e-4, "fixed layout, hidden gradient")
        assert_close(wx.grad, w64.grad, 1e-4, "fixed layout, weight gradient")


def test_degenerate_shapes():
    s, t = pair((0, 5, 300))
    assert kl(s, t).shape == (0, 5)
    s1, t1 = pair((300,))
    check(s1, t1)  # one position: a 0-d result
    s2, t2 = pair((4, 1))
    assert (kl(s2, t2) == 0).all()  # one token: both distributions are the same


def test_declared():
    backend = next(b for b in lr.backends() if b.name == "chunked")
    assert "kl_divergence" in backend.ops
    assert {"kl_hidden", "kl_support"} <= set(backend.features)
    assert backend.batch_invariant
