"""The ``chunked`` backend: what is specific to its implementation. Its contract (values, dtypes,
strides, ``ignore_index``, -inf, NaN, gradients, in-place backward, determinism, batch invariance)
is checked by the shipped suite, which ``tests/test_conformance.py`` runs against ``chunked`` and
which runs again here with chunks of two rows; here are its workspace (setting, budget, chunk
boundaries, peak memory), its row blocks, the fixed-shape layout of accelerators, the reuse of the
logits' storage by in-place backward and the exact path for improbable labels.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.config import ConfigError
from logprob_registry.kernels import chunked
from logprob_registry.kernels.chunked import _rows as loops
from logprob_registry.testing import BackendConformance
from logprob_registry.testing.sections import covering_tests


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
    """A few fp32 (fp64) roundings of the magnitudes involved, |logits| / T and log V: chunked's
    own accuracy, tighter for large V than the contract's (``logprob_registry.numerics``, sqrt V)."""
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


def _reference_grads(logits, labels, weights, op, **kw):
    x = logits.detach().double().requires_grad_(True)
    if op == "logprobs":
        out = (ref.logprobs(x, labels, **kw) * weights[0]).sum()
    else:
        a, b = ref.logprobs_and_entropy(x, labels, **kw)
        out = (a * weights[0] + b * weights[1]).sum()
    out.backward()
    return x.grad


def _chunked_grads(logits, labels, weights, op, inplace=False, **kw):
    x = logits.detach().clone().requires_grad_(True)
    if op == "logprobs":
        out = (lp(x, labels, inplace_backward=inplace, **kw) * weights[0]).sum()
    else:
        a, b = both(x, labels, inplace_backward=inplace, **kw)
        out = (a * weights[0] + b * weights[1]).sum()
    out.backward()
    return x


def test_registered_with_its_promises():
    backend = lr.get_registry().get("chunked")
    assert backend.priority == 10
    assert set(backend.ops) == {"logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden", "topk_logprobs",
                                "kl_divergence", "shard_stats", "shard_grad", "hidden_shard_stats", "hidden_shard_grad",
                                "kl_shard_stats", "kl_shard_grad", "shard_topk", "hidden_shard_topk", "token_stats",
                                "shard_token_stats", "hidden_shard_token_stats"}
    assert backend.devices == {"cpu", "cuda", "npu", "xpu", "mps", "hpu"}
    assert backend.inplace_backward and backend.batch_invariant and backend.deterministic
    eligible = lr.explain("logprobs", device="cpu", dtype=torch.bfloat16, requires_grad=True).eligible
    assert eligible.index("chunked") < eligible.index("naive")


# ------------------------------------------------------------------- the suite, in chunks of two rows
class TestInChunksOfTwoRows(BackendConformance):
    """The suite's tests of the ops over logits with a workspace of one byte: two rows a chunk, so
    that every case crosses chunk boundaries (the default workspace holds every case of the suite
    but the memory checks in one chunk)."""

    backend = "chunked"
    device = "cpu"

    @pytest.fixture(autouse=True)
    def _two_rows_a_chunk(self, _default_workspace):
        chunked.set_workspace_bytes(1)
        assert loops.rows_per_chunk(7, torch.float32, chunked.workspace_bytes()) == 2


# Not collected here: the hidden op (its own tile budget, tests/test_chunked_hidden.py) and the
# no-copy memory checks (at two rows a chunk they measure nothing new, and slowly; the workspace's
# own bound is test_peak_memory_stays_within_the_workspace).
for _name in covering_tests(op="logprobs_from_hidden") + covering_tests(capability="copies_logits"):
    setattr(TestInChunksOfTwoRows, _name, None)


# ----------------------------------------------------------------------------------------- layouts
def test_vocabulary_stride_and_transposed_batch(small_workspace):
    """Beyond the contract (strided leading dims): a vocabulary with a stride is read in place too,
    and a transposed batch gives the same bits as the batch it is a view of."""
    base, ids = sample((3, 9, 211))
    t = base.transpose(0, 1)
    assert torch.equal(lp(t, ids.t()), lp(base, ids).t())
    wide = torch.cat([base, base], -1)[..., ::2]
    assert wide.stride(-1) == 2
    assert (lp(wide, ids).double() - ref.logprobs(wide, ids)).abs().max().item() <= tolerance(wide)
    assert (ent(wide).double() - ref.entropy(wide)).abs().max().item() <= tolerance(wide)


# ------------------------------------------------------------------------------- workspace memory
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
    from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, peak_extra_bytes
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


# ---------------------------------------------------------------------------------- in-place backward
@pytest.mark.parametrize("op", ["logprobs", "logprobs_and_entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_reuses_the_logits_storage(op, dtype, small_workspace):
    """With ``inplace_backward=True`` the gradient of a leaf is the logits' own storage (no new
    tensor) and the same gradient, bit for bit, as out of place."""
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


# ------------------------------------------------------------------- batch invariance across budgets
def _rows_alone(fn, logits, labels):
    return torch.stack([fn(logits[i:i + 1], labels[i:i + 1])[0] for i in range(logits.shape[0])])


@pytest.mark.parametrize("vocab", [37, 50257])
@pytest.mark.parametrize("threads", [None, 3])
def test_batch_invariant_across_workspace_budgets_and_threads(vocab, threads):
    """A row gives the same bits alone, in any batch, at any position, with any workspace budget
    and number of threads."""
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
    with pytest.raises(ConfigError, match="LOGPROB_REGISTRY_CHUNKED_WORKSPACE='lots'.*4MiB"):
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


@pytest.mark.parametrize("inplace", [False, True])
def test_backward_never_reads_chunks_of_ignored_rows(small_workspace, inplace):
    """A chunk whose rows are all ignored (a GRPO batch's prompt) gets zeros without its logits being
    read: NaN logits there (read, they would give NaN * 0 = NaN) give exact zeros; the active rows'
    gradients are bitwise those of a call with the active rows alone."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 50, generator=g)
    labels = torch.randint(0, 50, (8,), generator=g)
    labels[:4] = -100
    logits[:4] = math.nan
    leaf = logits.clone().requires_grad_(True)
    out = lr.logprobs_from_logits(leaf, labels, ignore_index=-100, backend="chunked", inplace_backward=inplace)
    out.sum().backward()
    assert torch.equal(leaf.grad[:4], torch.zeros(4, 50))
    alone = logits[4:].clone().requires_grad_(True)
    lr.logprobs_from_logits(alone, labels[4:], ignore_index=-100, backend="chunked").sum().backward()
    assert torch.equal(leaf.grad[4:], alone.grad)
    assert torch.equal(out[:4], torch.zeros(4)) and torch.equal(out[4:], lr.logprobs_from_logits(
        logits[4:], labels[4:], backend="chunked"))
