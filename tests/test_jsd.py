"""kl_divergence(direction="jsd", beta=): the generalized Jensen-Shannon divergence, on naive and on
chunked, against a float64 formula written here, with its gradient; on chunked in tiles much smaller
than the vocabulary (logits and hidden states, fp32 and bf16, mask, support, -inf entries, large
magnitudes), bitwise batch invariant, allocating nothing of the logits' size for hidden states;
against TRL's ChunkedDivergenceFunction (values and the student's gradients); bad beta and
process_group= refused with a sentence."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.call import key_for
from logprob_registry.kernels import chunked
from logprob_registry.kernels.chunked import _hidden, _kl
from logprob_registry.numerics import EPS32, assert_close
from logprob_registry.opspec import OPS
from logprob_registry.registry import get_registry

BETAS = [0.25, 0.5, 0.75]
BF16_RTOL = 2.0 ** -7  # a bf16 gradient is rounded to bf16 once


def _jsd64(s, t, beta, temperature=1.0):
    ls = torch.log_softmax(s.double() / temperature, -1)
    lt = torch.log_softmax(t.double() / temperature, -1)
    m = torch.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    return beta * (lt.exp() * (lt - m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - m)).sum(-1)


def _sides(seed=0, rows=5, vocab=211, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(rows, vocab, generator=g) * 3).to(dtype), (torch.randn(rows, vocab, generator=g) * 3).to(dtype))


@pytest.fixture
def small_tiles(monkeypatch):
    """chunked's tiles of a few thousand cells, so that a call crosses many tile boundaries."""
    chunked.set_workspace_bytes(48 << 10)
    monkeypatch.setenv(_hidden.CHUNK_BYTES_ENV, str(48 << 10))
    yield
    chunked.set_workspace_bytes(None)


@pytest.mark.parametrize("backend", ["naive", "chunked"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_float64_with_gradient(backend, beta, dtype):
    s, t = _sides(dtype=dtype)
    s.requires_grad_(True)
    got = lr.kl_divergence(s, t, direction="jsd", beta=beta, temperature=0.9, backend=backend)
    want_s = s.detach().double().requires_grad_(True)
    want = _jsd64(want_s, t, beta, 0.9)
    torch.testing.assert_close(got.double(), want.detach(), atol=2e-6, rtol=0)
    up = torch.rand(5, dtype=torch.float64)
    (got * up.float()).sum().backward()
    (want * up).sum().backward()
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps  # the gradient comes in the logits' dtype
    torch.testing.assert_close(s.grad.double(), want_s.grad, atol=1e-6, rtol=rounding)


def test_chunked_is_the_automatic_choice_for_jsd():
    for hidden in (None, 1024):
        features = ("kl_jsd",) + (("kl_hidden",) if hidden else ())
        key = key_for("kl_divergence", device="cpu", requires_grad=True, features=features, vocab=32768,
                      hidden_size=hidden)
        assert get_registry().select(key).name == "chunked", get_registry().explain(key)


def test_symmetric_at_one_half_and_between_the_kls():
    s, t = _sides(1)
    a = lr.kl_divergence(s, t, direction="jsd", beta=0.5)
    b = lr.kl_divergence(t, s, direction="jsd", beta=0.5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert bool((a >= 0).all()) and bool((a <= math.log(2) + 1e-6).all())  # JSD(1/2) is bounded by log 2


def test_hidden_sides_and_support_with_tail():
    g = torch.Generator().manual_seed(2)
    hs, ht = torch.randn(4, 16, generator=g), torch.randn(4, 24, generator=g)
    ws, wt = torch.randn(97, 16, generator=g), torch.randn(97, 24, generator=g)
    got = lr.kl_divergence(hs, ht, student_weight=ws, teacher_weight=wt, direction="jsd", beta=0.3, backend="naive")
    torch.testing.assert_close(got.double(), _jsd64(hs.double() @ ws.double().T, ht.double() @ wt.double().T, 0.3),
                               atol=2e-6, rtol=0)
    s, t = _sides(3, vocab=50)
    support = torch.stack([torch.randperm(50, generator=g)[:7] for _ in range(5)])
    got = lr.kl_divergence(s, t, direction="jsd", beta=0.4, support=support, backend="naive")
    (want,) = OPS["kl_divergence"].ground_truth(s, t, direction="jsd", beta=0.4, support=support)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5, 2.0, float("nan")])
def test_beta_outside_the_open_interval_names_it(beta):
    s, t = _sides()
    with pytest.raises(ValueError, match="beta must be in"):
        lr.kl_divergence(s, t, direction="jsd", beta=beta)
    with pytest.raises(TypeError, match="beta must be a number"):
        lr.kl_divergence(s, t, direction="jsd", beta="0.5")
    assert torch.equal(lr.kl_divergence(s, t, beta=beta if beta == beta else 3.0), lr.kl_divergence(s, t))


def test_with_process_group_is_refused_with_a_sentence(world):
    s, t = _sides()
    with pytest.raises(NotImplementedError, match="beta"):
        lr.kl_divergence(s, t, direction="jsd", process_group=world)


# ---------------------------------------------------------------------------------- chunked, small tiles
def _finite_max(x: torch.Tensor) -> float:
    x = x.detach().abs()
    return float(x[torch.isfinite(x)].max())


def _check(student, teacher, *, beta, weights=(None, None), rtol=0.0, **kw):
    """chunked's JSD and the student's gradients (logits, or hidden and weight) against float64
    autograd of the reference, within a small multiple of fp32 rounding of the logits' magnitude."""
    sw, tw = weights
    leaves = [student] if sw is None else [student, sw]
    xs = [x.detach().clone().requires_grad_(True) for x in leaves]
    x64 = [x.detach().double().requires_grad_(True) for x in leaves]
    got = lr.kl_divergence(xs[0], teacher, student_weight=None if sw is None else xs[1], teacher_weight=tw,
                           direction="jsd", beta=beta, backend="chunked", **kw)
    want = ref.kl_divergence(x64[0], teacher, student_weight=None if sw is None else x64[1],
                             teacher_weight=None if tw is None else tw.double(), direction="jsd", beta=beta, **kw)
    assert got.dtype == torch.float32
    mag = max(float(_finite_max(x) if w is None else (x.detach().double().abs() @ w.detach().double().abs().t()).max())
              for x, w in ((student, sw), (teacher, tw)))
    bound = 32 * EPS32 * (1.0 + mag / kw.get("temperature", 1.0))
    assert_close(got, want, bound, f"jsd beta={beta}")
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got.backward(up.float())
    want.backward(up)
    for x, y, name in zip(xs, x64, ("student", "student_weight")):
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        assert_close(x.grad, y.grad, bound * float(up.abs().max()) * 4, f"jsd beta={beta}: gradient of the {name}",
                     rtol=rtol)
    return got


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logits_in_small_tiles(small_tiles, beta, dtype):
    g = torch.Generator().manual_seed(11)
    s, t = (torch.randn(2, 9, 700, generator=g) * 3).to(dtype), (torch.randn(2, 9, 700, generator=g) * 3).to(dtype)
    s[..., 40:60] = float("-inf")  # a masked vocabulary on both sides: adds nothing
    t[..., 40:60] = float("-inf")
    t[0, 1, 300] = float("-inf")   # one side without mass: its term only
    s[1, 2, int(t[1, 2].argmax())] = float("-inf")
    got = _check(s, t, beta=beta, temperature=0.8, rtol=BF16_RTOL if dtype == torch.bfloat16 else 0.0)
    assert bool(torch.isfinite(got).all())  # m > 0 wherever either side has mass: never infinite


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_hidden_states_in_small_tiles(small_tiles, beta, dtype):
    g = torch.Generator().manual_seed(12)
    hs, ws = torch.randn(2, 13, 24, generator=g), torch.randn(900, 24, generator=g) / 3
    ht, wt = torch.randn(2, 13, 40, generator=g), torch.randn(900, 40, generator=g) / 4
    hs, ws, ht, wt = (x.to(dtype) for x in (hs, ws, ht, wt))
    rtol = BF16_RTOL if dtype == torch.bfloat16 else 0.0
    _check(hs, ht, beta=beta, weights=(ws, wt), temperature=0.7, rtol=rtol)
    t_logits = (ht.double() @ wt.double().t()).to(dtype)  # a student of hidden states, a teacher of logits
    _check(hs, t_logits, beta=beta, weights=(ws, None), rtol=rtol)
    _check(t_logits, hs, beta=beta, weights=(None, ws), rtol=rtol)  # a teacher of hidden states


def test_chunked_mask_support_and_large_magnitudes(small_tiles):
    g = torch.Generator().manual_seed(13)
    s, t = torch.randn(4, 6, 500, generator=g) * 3, torch.randn(4, 6, 500, generator=g) * 3
    mask = torch.rand(4, 6, generator=g) > 0.4
    x = s.clone()
    x[~mask] = float("nan")  # masked positions are never read into the result
    x.requires_grad_(True)
    out = lr.kl_divergence(x, t, direction="jsd", beta=0.3, mask=mask, backend="chunked")
    out.sum().backward()
    assert bool((out[~mask] == 0).all()) and bool(torch.isfinite(out[mask]).all())
    assert bool((x.grad[~mask] == 0).all())
    _check(s, t, beta=0.3, mask=mask, temperature=0.9)
    support = torch.rand(4, 6, 500, generator=g).argsort(-1)[..., :9]
    for tail in (True, False):
        _check(s, t, beta=0.6, support=support, tail=tail, temperature=0.9)
    _check(s, t, beta=0.6, support=torch.arange(500).flip(0).expand(4, 6, 500))  # an empty tail on both sides
    _check(s[0] + 1e4, t[0] - 1e4, beta=0.25)
    _check(s[0] * 1e3, t[0] * 1e3, beta=0.75, temperature=50.0)


def test_chunked_strided_and_fixed_layout(small_tiles):
    """Strided logits (never copied), and the accelerators' layout (every tile padded to one shape)
    run on the CPU: logits, hidden states and support, with the gradients."""
    g = torch.Generator().manual_seed(16)
    s, t = torch.randn(3, 9, 400, generator=g) * 3, torch.randn(3, 9, 400, generator=g) * 3
    _check(s[:, :-1], t[:, 1:], beta=0.7, temperature=1.3)
    h, w = torch.randn(20, 16, generator=g), torch.randn(400, 16, generator=g) / 3
    s2, t2 = s.reshape(27, 400)[:20], t.reshape(27, 400)[:20]
    support = torch.rand(20, 400, generator=g).argsort(-1)[:, :6]
    for student, weight, extra in ((s2, None, {}), (s2, None, {"support": support}), (h, w, {})):
        leaves = [x.clone().requires_grad_(True) for x in ((student,) if weight is None else (student, weight))]
        x64 = [x.detach().double().requires_grad_(True) for x in leaves]
        got = _kl.kl_divergence(leaves[0], t2, direction="jsd", beta=0.35, temperature=0.9, mask=None, tail=True,
                                student_weight=None if weight is None else leaves[1], budget=48 << 10, fixed=True,
                                **extra)
        want = ref.kl_divergence(x64[0], t2, direction="jsd", beta=0.35, temperature=0.9,
                                 student_weight=None if weight is None else x64[1], **extra)
        got.sum().backward()
        want.sum().backward()
        assert_close(got, want, 1e-5, "fixed layout")
        for x, y in zip(leaves, x64):
            assert_close(x.grad, y.grad, 1e-5, "fixed layout gradient")


def test_chunked_double_backward():
    s, t = _sides(5, rows=2, vocab=12, dtype=torch.float64)
    x = s.requires_grad_(True)
    torch.autograd.gradgradcheck(
        lambda a: lr.kl_divergence(a, t, direction="jsd", beta=0.3, temperature=0.8, backend="chunked"), (x,))


def test_chunked_batch_invariant(small_tiles):
    """A row's JSD and gradient are bitwise the same alone, in a sub-batch and in the whole batch
    (chunked declares batch invariance), for logits and for hidden states."""
    g = torch.Generator().manual_seed(14)
    s, t = torch.randn(40, 333, generator=g) * 3, torch.randn(40, 333, generator=g) * 3
    hs, ws = torch.randn(40, 24, generator=g), torch.randn(333, 24, generator=g) / 3
    for student, options in ((s, {}), (hs, {"student_weight": ws})):
        def call(rows, student=student, options=options):
            x = student[rows].clone().requires_grad_(True)
            out = lr.kl_divergence(x, t[rows], direction="jsd", beta=0.4, temperature=0.9, backend="chunked",
                                   **options)
            out.sum().backward()
            return out, x.grad

        full, full_grad = call(slice(0, 40))
        for rows in (slice(0, 1), slice(7, 9), slice(39, 40), slice(3, 40)):
            part, part_grad = call(rows)
            assert torch.equal(part, full[rows]) and torch.equal(part_grad, full_grad[rows]), rows


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_chunked_hidden_states_allocate_nothing_of_the_logits_size(monkeypatch):
    monkeypatch.setenv(_hidden.CHUNK_BYTES_ENV, str(1 << 20))  # tiles of 200 KiB: about 20 of them
    g = torch.Generator().manual_seed(15)
    hs, ws = torch.randn(512, 32, generator=g).requires_grad_(True), (torch.randn(2048, 32, generator=g) / 4)
    ws.requires_grad_(True)
    ht, wt = torch.randn(512, 48, generator=g), torch.randn(2048, 48, generator=g) / 4
    size = 512 * 2048 * 4  # one (N, V) fp32 tensor
    outs: list = []
    assert _largest_allocation(lambda: outs.append(lr.kl_divergence(
        hs, ht, student_weight=ws, teacher_weight=wt, direction="jsd", beta=0.5, backend="chunked"))) < size / 10
    assert _largest_allocation(outs[0].sum().backward) < size / 10
    # the textbook formula does make one, so the measurement can see it
    assert _largest_allocation(lambda: ref.kl_divergence(hs.detach() @ ws.detach().t(), ht @ wt.t(),
                                                         direction="jsd", beta=0.5, dtype=torch.float32)) >= size


# ---------------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("backend", ["naive", "chunked"])
def test_against_trl_chunked_divergence(backend):
    divergence = pytest.importorskip("trl.kernels.chunked_divergence", reason="needs trl (the [test] extra)")
    g = torch.Generator().manual_seed(4)
    hs, ht = torch.randn(6, 32, generator=g), torch.randn(6, 48, generator=g)
    ws, wt = torch.randn(300, 32, generator=g) * 0.5, torch.randn(300, 48, generator=g) * 0.5
    up = torch.rand(6, generator=g)
    for beta in BETAS:
        leaves = [x.clone().requires_grad_(True) for x in (hs, ws, hs, ws)]
        ours = lr.kl_divergence(leaves[0], ht, student_weight=leaves[1], teacher_weight=wt, direction="jsd",
                                beta=beta, temperature=0.8, backend=backend)
        theirs, _ = divergence.ChunkedDivergenceFunction.apply(leaves[2], leaves[3], None, ht, wt, None, beta, 0.8)
        exact = _jsd64(hs.double() @ ws.double().T, ht.double() @ wt.double().T, beta, 0.8)
        torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.double(), exact, atol=2e-6, rtol=0)
        torch.testing.assert_close(theirs.double(), exact, atol=1e-5, rtol=0)
        (ours * up).sum().backward()
        (theirs * up).sum().backward()
        for mine, trl_grad, name in ((leaves[0], leaves[2], "hidden"), (leaves[1], leaves[3], "weight")):
            torch.testing.assert_close(mine.grad, trl_grad.grad, atol=1e-5, rtol=1e-5, msg=f"{name} beta={beta}")
