"""The ``chunked`` backend against the float64 reference: values, gradients, layouts, edge cases,
in-place backward, determinism and batch invariance, workspace configuration."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.kernels import _chunked_loops as loops
from logprob_registry.kernels import chunked

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _default_workspace():
    chunked.set_workspace_bytes(None)
    yield
    chunked.set_workspace_bytes(None)


@pytest.fixture
def small_workspace():
    """Two rows per chunk at most for any V here, so every test crosses chunk boundaries."""
    chunked.set_workspace_bytes(1)


@pytest.fixture
def fixed_shape(monkeypatch):
    """Run the accelerator layout (fixed-shape, zero-padded chunks) on the CPU."""
    monkeypatch.setattr(chunked, "ROW_WISE_DEVICES", frozenset())


def lp(logits, labels, **kw):
    return lr.logprobs_from_logits(logits, labels, backend="chunked", **kw)


def ent(logits, **kw):
    return lr.entropy_from_logits(logits, backend="chunked", **kw)


def both(logits, labels, **kw):
    return lr.logprobs_and_entropy(logits, labels, backend="chunked", **kw)


def tolerance(logits: torch.Tensor, temperature: float = 1.0) -> float:
    """A few fp32 (fp64) roundings of the magnitudes involved: |logits| / T and log V."""
    eps = torch.finfo(ref.result_dtype(logits.dtype)).eps
    finite = logits[torch.isfinite(logits)].double()
    scale = (finite.abs().max().item() if finite.numel() else 0.0) / temperature
    return 8 * eps * (1.0 + scale + math.log(max(logits.shape[-1], 2)))


def weights_for(shape, seed=2):
    """Upstream gradients for the two outputs, from their own generator (same case in any test order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def assert_grad_close(grad, want, logits, temperature):
    """``grad`` against the float64 ``want``: a few fp32 roundings (:func:`tolerance`), plus the one
    rounding to the gradient's dtype, relative to each element's magnitude."""
    eps = torch.finfo(grad.dtype).eps if grad.dtype != torch.float64 else 0.0
    rounding = eps * want.abs().clamp(min=1.0)
    excess = ((grad.double() - want).abs() - rounding).max().item()
    assert excess <= 4 * tolerance(logits, temperature), f"gradient off by {excess:.3g} beyond its dtype's rounding"


def sample(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, labels


def test_registered_with_its_promises():
    backend = lr.get_registry().get("chunked")
    assert backend.priority == 10
    assert set(backend.ops) == {"logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden"}
    assert backend.devices == {"cpu", "cuda", "npu", "xpu", "mps"}
    assert backend.inplace_backward and backend.batch_invariant and backend.deterministic
    eligible = lr.explain("logprobs", device="cpu", dtype=torch.bfloat16, requires_grad=True).eligible
    assert eligible.index("chunked") < eligible.index("naive")


# ------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_values_match_reference(dtype, temperature, small_workspace):
    logits, labels = sample((3, 7, 129), dtype)
    labels[0, 2] = -100
    got_lp = lp(logits, labels, temperature=temperature, ignore_index=-100)
    got_ent = ent(logits, temperature=temperature)
    pair = both(logits, labels, temperature=temperature, ignore_index=-100)
    want_lp = ref.logprobs(logits, labels, temperature=temperature, ignore_index=-100)
    want_ent = ref.entropy(logits, temperature=temperature)
    assert got_lp.dtype == got_ent.dtype == ref.result_dtype(dtype)
    tol = tolerance(logits, temperature)
    assert (got_lp.double() - want_lp).abs().max().item() <= tol
    assert (got_ent.double() - want_ent).abs().max().item() <= tol
    assert got_lp[0, 2].item() == 0.0
    # the joint op takes the entropy's path to the log-probabilities: equal up to rounding
    assert (pair[0].double() - want_lp).abs().max().item() <= tol
    assert torch.equal(pair[1], got_ent)


def test_large_magnitudes_and_int32_labels():
    logits, labels = sample((4, 300), torch.float32, scale=1e4)
    got = lp(logits, labels.int())
    assert (got.double() - ref.logprobs(logits, labels)).abs().max().item() <= tolerance(logits)
    got_ent = ent(logits)
    assert (got_ent.double() - ref.entropy(logits)).abs().max().item() <= tolerance(logits)


def test_half_precision_input_is_computed_in_fp32():
    # bf16 arithmetic would be off by ~1e-2 here; fp32 accumulation is off by ~1e-6
    logits, labels = sample((8, 4096), torch.bfloat16, scale=5.0)
    err = (lp(logits, labels).double() - ref.logprobs(logits, labels)).abs().max().item()
    assert err <= 1e-5


# --------------------------------------------------------------------------------------- gradients
def _reference_grads(logits, labels, weights, op, **kw):
    x = logits.detach().double().requires_grad_(True)
    if op == "logprobs":
        out = (ref.logprobs(x, labels, **kw) * weights[0]).sum()
    elif op == "entropy":
        kw.pop("ignore_index", None)
        out = (ref.entropy(x, **kw) * weights[1]).sum()
    else:
        a, b = ref.logprobs_and_entropy(x, labels, **kw)
        out = (a * weights[0] + b * weights[1]).sum()
    out.backward()
    return x.grad


def _chunked_grads(logits, labels, weights, op, inplace=False, **kw):
    x = logits.detach().clone().requires_grad_(True)
    if op == "logprobs":
        out = (lp(x, labels, inplace_backward=inplace, **kw) * weights[0]).sum()
    elif op == "entropy":
        kw.pop("ignore_index", None)
        out = (ent(x, **kw) * weights[1]).sum()
    else:
        a, b = both(x, labels, inplace_backward=inplace, **kw)
        out = (a * weights[0] + b * weights[1]).sum()
    out.backward()
    return x


@pytest.mark.parametrize("op", ["logprobs", "entropy", "logprobs_and_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gradients_match_float64_autograd(op, temperature, dtype, small_workspace):
    logits, labels = sample((2, 5, 77), dtype)
    labels[1, 3] = -1
    weights = weights_for((2, 5))
    kw = dict(temperature=temperature, ignore_index=-1)
    w = tuple(t.to(ref.result_dtype(dtype)) for t in weights)
    x = _chunked_grads(logits, labels, w, op, **dict(kw))
    want = _reference_grads(logits, labels, weights, op, **dict(kw))
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    assert_grad_close(x.grad, want, logits, temperature)
    if op == "logprobs":
        assert torch.all(x.grad[1, 3] == 0)


def test_ignored_positions_have_zero_gradient():
    logits, labels = sample((6, 33))
    labels[::2] = 7
    x = logits.clone().requires_grad_(True)
    lp(x, labels, ignore_index=7).sum().backward()
    assert torch.all(x.grad[::2] == 0)
    assert torch.all(x.grad[1::2].abs().sum(-1) > 0)


def test_gradient_of_unused_output_is_skipped():
    logits, labels = sample((3, 40))
    x = logits.clone().requires_grad_(True)
    a, b = both(x, labels)
    a.sum().backward()
    want = _reference_grads(logits, labels, (torch.ones(3, dtype=torch.float64), None), "logprobs")
    assert (x.grad.double() - want).abs().max().item() <= 4 * tolerance(logits)


# ----------------------------------------------------------------------------------------- layouts
def test_strided_leading_dims_without_copy(small_workspace):
    base, ids = sample((3, 9, 211))
    logits, labels = base[:, :-1], ids[:, 1:]
    assert not logits.is_contiguous()
    got = lp(logits, labels, temperature=0.8)
    assert (got.double() - ref.logprobs(logits, labels, temperature=0.8)).abs().max().item() <= tolerance(logits, 0.8)
    got_ent = ent(logits)
    assert (got_ent.double() - ref.entropy(logits)).abs().max().item() <= tolerance(logits)
    # a transposed batch, and a vocabulary with a stride: still no copy needed, same answers
    t = base.transpose(0, 1)
    assert torch.equal(lp(t, ids.t()), lp(base, ids).t())
    wide = torch.cat([base, base], -1)[..., ::2]
    assert (lp(wide, ids).double() - ref.logprobs(wide, ids)).abs().max().item() <= tolerance(wide)


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_no_allocation_of_the_logits_size():
    chunked.set_workspace_bytes(2 * 8 * 1000 * 4)  # chunks of 8 rows
    base, ids = sample((4, 65, 1000))
    logits, labels = base[:, :-1], ids[:, 1:]
    size = logits.numel() * logits.element_size()
    assert _largest_allocation(lambda: lp(logits, labels, temperature=0.5)) < size / 20
    assert _largest_allocation(lambda: both(logits, labels)) < size / 20
    half = logits.bfloat16()
    assert _largest_allocation(lambda: lp(half, labels)) < size / 20
    # the textbook formula does make one, so the measurement can see it
    assert _largest_allocation(lambda: ref.logprobs(logits, labels, dtype=torch.float32)) >= size


def test_backward_allocates_only_the_gradient():
    chunked.set_workspace_bytes(2 * 8 * 1000 * 4)  # chunks of 8 rows
    logits, labels = sample((256, 1000))
    x = logits.clone().requires_grad_(True)
    size = x.numel() * x.element_size()
    out = lp(x, labels)
    peak = _largest_allocation(lambda: out.sum().backward())
    assert size <= peak < size * 1.05  # the gradient itself, nothing else of that size
    y = logits.clone().requires_grad_(True)
    out = lp(y, labels, inplace_backward=True)
    assert _largest_allocation(lambda: out.sum().backward()) < size / 20


def _peak(make) -> int:
    """Peak bytes the call ``make()`` returns adds (resident memory), the least of three readings
    (noise only adds)."""
    from logprob_registry.testing.memory import MemoryMeasurementUnavailable, peak_extra_bytes
    try:
        return min(peak_extra_bytes(make(), torch.device("cpu"))[1] for _ in range(3))
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure peak memory here: {exc}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_stays_within_the_workspace(dtype):
    budget = 1 << 20
    chunked.set_workspace_bytes(budget)
    logits, labels = sample((2, 513, 4096), dtype)
    logits, labels = logits[:, :-1], labels[:, 1:]  # strided; 8 MiB in fp32, 4 MiB in bf16
    size = logits.numel() * logits.element_size()
    slack = 256 << 10  # per-row vectors and allocator rounding
    assert _peak(lambda: lambda: lp(logits, labels)) <= budget + slack
    assert _peak(lambda: lambda: both(logits, labels, temperature=0.7)) <= budget + slack

    def backward(inplace):
        def make():
            x = logits.detach().clone() if inplace else logits.detach()
            out = both(x.requires_grad_(True), labels, inplace_backward=inplace)
            return lambda: (out[0].sum() + out[1].sum()).backward()
        return make

    assert _peak(backward(False)) <= size + budget + slack  # the gradient and the workspace
    assert _peak(backward(True)) <= budget + slack  # the workspace only


# ---------------------------------------------------------------------------------- chunk boundaries
@pytest.mark.parametrize("workspace", [1, 3000, 1 << 20])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_rows_not_a_multiple_of_the_chunk(workspace, rows):
    chunked.set_workspace_bytes(workspace)
    logits, labels = sample((rows, 97))
    got = lp(logits, labels)
    assert (got.double() - ref.logprobs(logits, labels)).abs().max().item() <= tolerance(logits)


@pytest.mark.parametrize("vocab", [1, 2, 3, 1000, 50257])
def test_vocabulary_sizes(vocab, small_workspace):
    logits, labels = sample((3, vocab), scale=2.0)
    got_lp, got_ent = both(logits, labels)
    assert (got_lp.double() - ref.logprobs(logits, labels)).abs().max().item() <= tolerance(logits)
    assert (got_ent.double() - ref.entropy(logits)).abs().max().item() <= tolerance(logits)
    if vocab == 1:
        assert torch.all(got_lp == 0) and torch.all(got_ent == 0)


def test_empty_input():
    logits = torch.randn(0, 5, 11, requires_grad=True)
    labels = torch.zeros(0, 5, dtype=torch.long)
    a, b = both(logits, labels)
    assert a.shape == b.shape == (0, 5)
    (a.sum() + b.sum()).backward()
    assert logits.grad.shape == logits.shape
    assert ent(torch.randn(2, 0, 7)).shape == (2, 0)


def test_one_dimensional_logits_and_scalar_label():
    logits, _ = sample((50,))
    label = torch.tensor(17)
    x = logits.clone().requires_grad_(True)
    got = lp(x, label, temperature=0.9)
    assert got.shape == ()
    assert abs(got.item() - ref.logprobs(logits, label, temperature=0.9).item()) <= tolerance(logits, 0.9)
    got.backward()
    want = _reference_grads(logits, label, (torch.tensor(1.0, dtype=torch.float64), None), "logprobs", temperature=0.9)
    assert (x.grad.double() - want).abs().max().item() <= 4 * tolerance(logits)
    assert ent(logits).shape == ()


# ------------------------------------------------------------------------------------ -inf and NaN
def test_masked_vocabulary():
    logits, labels = sample((4, 64))
    logits[:, 10:30] = -math.inf
    labels[1:] %= 10
    labels[0] = 12  # on a masked entry
    x = logits.clone().requires_grad_(True)
    a, b = both(x, labels)
    assert a[0].item() == -math.inf
    assert torch.isfinite(a[1:]).all() and torch.isfinite(b).all()
    assert (b.double() - ref.entropy(logits)).abs().max().item() <= tolerance(logits)
    (a[1:].sum() + b.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert torch.all(x.grad[:, 10:30] == 0)
    want = _reference_grads(logits, labels, (torch.tensor([0.0, 1, 1, 1], dtype=torch.float64),
                                             torch.ones(4, dtype=torch.float64)), "logprobs_and_entropy")
    assert (x.grad.double() - want).abs().max().item() <= 4 * tolerance(logits)


def test_nan_propagates_to_its_row_only():
    logits, labels = sample((3, 40))
    logits[1, 5] = math.nan
    a, b = both(logits, labels)
    assert torch.isnan(a[1]) and torch.isnan(b[1])
    assert torch.isfinite(a[[0, 2]]).all() and torch.isfinite(b[[0, 2]]).all()


def test_inputs_are_not_modified():
    logits, labels = sample((5, 8, 33), torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    keep_x, keep_l = logits.clone(), labels.clone()
    a, b = both(x, labels, temperature=0.5, ignore_index=3)
    (a.sum() + b.sum()).backward()
    assert torch.equal(x.detach(), keep_x) and torch.equal(labels, keep_l)


# ---------------------------------------------------------------------------------- in-place backward
@pytest.mark.parametrize("op", ["logprobs", "logprobs_and_entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_gradient_into_the_logits(op, dtype, small_workspace):
    logits, labels = sample((4, 6, 51), dtype)
    weights = weights_for((4, 6))
    w = tuple(t.float() for t in weights)
    kw = dict(temperature=0.8, ignore_index=0)
    out_of_place = _chunked_grads(logits, labels, w, op, **dict(kw)).grad
    x = _chunked_grads(logits, labels, w, op, inplace=True, **dict(kw))
    assert x.grad.data_ptr() == x.data_ptr()  # the logits' own storage, no new tensor
    assert torch.equal(x.detach(), x.grad)  # the logits now hold their gradient
    assert torch.equal(x.grad, out_of_place)  # and it is the same gradient, bit for bit
    want = _reference_grads(logits, labels, weights, op, **dict(kw))
    assert_grad_close(x.grad, want, logits, 0.8)


def test_inplace_backward_through_strides(small_workspace):
    base, ids = sample((3, 8, 45))
    leaf = base.clone().requires_grad_(True)
    hidden = leaf * 1.0  # a non-leaf whose storage no other autograd node needs
    logits = hidden[:, :-1]
    out = lp(logits, ids[:, 1:], inplace_backward=True)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride()
    want = _reference_grads(base[:, :-1], ids[:, 1:], (torch.ones(3, 7, dtype=torch.float64), None), "logprobs")
    assert (grad.double() - want).abs().max().item() <= 4 * tolerance(base)
    assert torch.equal(hidden.detach()[:, :-1], grad)  # written through the strides of the view
    assert torch.equal(hidden.detach()[:, -1], base[:, -1])  # the rows outside it are untouched


def test_inplace_backward_into_a_non_contiguous_tensor(small_workspace):
    base, ids = sample((3, 9, 45))
    work = base.clone()
    logits = work[:, :-1].requires_grad_(False)
    x = logits.detach().requires_grad_(True)  # a leaf that is a strided view of `work`
    assert not x.is_contiguous()
    lp(x, ids[:, 1:], inplace_backward=True).sum().backward()
    want = _reference_grads(base[:, :-1], ids[:, 1:], (torch.ones(3, 8, dtype=torch.float64), None), "logprobs")
    assert (work[:, :-1].double() - want).abs().max().item() <= 4 * tolerance(base)  # written through strides
    assert torch.equal(work[:, -1], base[:, -1])  # the rows outside the view are untouched


# ------------------------------------------------------------------- determinism and batch invariance
def test_bitwise_deterministic():
    logits, labels = sample((6, 300, 501), torch.bfloat16)
    first = both(logits, labels, temperature=0.7)
    for _ in range(3):
        again = both(logits, labels, temperature=0.7)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def _rows_alone(fn, logits, labels):
    return torch.stack([fn(logits[i:i + 1], labels[i:i + 1])[0] for i in range(logits.shape[0])])


@pytest.mark.parametrize("vocab", [37, 50257])
@pytest.mark.parametrize("threads", [None, 3])
def test_batch_invariant(vocab, threads):
    """A row gives the same bits alone, in any batch, at any position, with any workspace budget."""
    logits, labels = sample((7, vocab), scale=4.0)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fns = [lambda x, y: torch.stack(both(x, y, temperature=0.9), -1),
               lambda x, y: lp(x, y).unsqueeze(-1)]
        for fn in fns:
            batch = fn(logits, labels)
            assert torch.equal(_rows_alone(fn, logits, labels), batch)
            assert torch.equal(fn(logits[2:], labels[2:]), batch[2:])
            for budget in (1, 5 * vocab * 4, 1 << 24):
                chunked.set_workspace_bytes(budget)
                assert torch.equal(fn(logits, labels), batch)
            chunked.set_workspace_bytes(None)
    finally:
        torch.set_num_threads(old)


def test_gradients_batch_invariant():
    logits, labels = sample((5, 50257))
    grads = []
    for rows in (slice(0, 5), slice(3, 4)):
        x = logits[rows].clone().requires_grad_(True)
        a, b = both(x, labels[rows])
        (a.sum() + b.sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0][3:4], grads[1])


# ------------------------------------------------------------------- the accelerator (fixed) layout
def test_fixed_shape_layout(fixed_shape):
    base, ids = sample((3, 8, 130), torch.bfloat16)
    logits, labels = base[:, :-1], ids[:, 1:]
    chunked.set_workspace_bytes(5 * 130 * 4)  # 2 workspaces: 2 rows per chunk, padded tail
    a, b = both(logits, labels, temperature=0.9, ignore_index=4)
    tol = tolerance(logits, 0.9)
    assert (a.double() - ref.logprobs(logits, labels, temperature=0.9, ignore_index=4)).abs().max() <= tol
    assert (b.double() - ref.entropy(logits, temperature=0.9)).abs().max() <= tol
    assert torch.equal(_rows_alone(lambda x, y: lp(x, y), logits.reshape(-1, 130), labels.reshape(-1)),
                       lp(logits, labels).reshape(-1))
    weights = weights_for((3, 7))
    x = _chunked_grads(logits, labels, tuple(w.float() for w in weights), "logprobs_and_entropy", temperature=0.9)
    want = _reference_grads(logits, labels, weights, "logprobs_and_entropy", temperature=0.9)
    assert_grad_close(x.grad, want, logits, 0.9)


# ------------------------------------------------------------------------------- workspace settings
def test_workspace_setting(monkeypatch):
    monkeypatch.delenv(chunked.WORKSPACE_ENV, raising=False)
    assert chunked.workspace_bytes() == chunked.DEFAULT_WORKSPACE_BYTES
    for text, value in [("123", 123), ("4MiB", 4 << 20), ("512k", 512 << 10), ("1 GiB", 1 << 30)]:
        monkeypatch.setenv(chunked.WORKSPACE_ENV, text)
        assert chunked.workspace_bytes() == value
    chunked.set_workspace_bytes(4096)
    assert chunked.workspace_bytes() == 4096  # the function wins over the environment
    chunked.set_workspace_bytes(None)
    monkeypatch.setenv(chunked.WORKSPACE_ENV, "lots")
    with pytest.raises(ValueError, match="LOGPROB_REGISTRY_CHUNKED_WORKSPACE='lots'.*4MiB"):
        chunked.workspace_bytes()
    with pytest.raises(ValueError, match="positive number of bytes"):
        chunked.set_workspace_bytes(0)


def test_rows_per_chunk_follows_the_budget():
    assert loops.rows_per_chunk(1000, torch.bfloat16, 80_000) == 10  # two fp32 buffers of 10 rows
    assert loops.rows_per_chunk(1000, torch.float64, 80_000) == 5
    assert loops.rows_per_chunk(262144, torch.float32, 1) == 2  # never fewer than two rows


def test_blocks_cover_rows_in_order_without_copies():
    base = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    views = list(loops.blocks(base[:, 1:]))
    assert [v.shape for v in views] == [(4, 3), (4, 3)]
    assert all(v.data_ptr() >= base.data_ptr() and v._base is not None for v in views)
    assert torch.equal(torch.cat(views), base[:, 1:].reshape(-1, 3))
    assert [v.shape for v in loops.blocks(base)] == [(10, 3)]


def test_improbable_labels_stay_accurate():
    # a label probability of e^-95 underflows fp32's normal range: those rows take the exact path
    logits = torch.zeros(4, 100)
    labels = torch.tensor([0, 1, 2, 3])
    logits[:, 50] = 95.0
    logits[1, 1] = 60.0
    logits[2, 2] = -math.inf
    got = lp(logits, labels)
    want = ref.logprobs(logits, labels)
    assert got[2].item() == -math.inf
    finite = [0, 1, 3]
    assert (got[finite].double() - want[finite]).abs().max().item() <= tolerance(logits)
