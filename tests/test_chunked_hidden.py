"""``chunked``'s fused linear logprobs (``logprobs_from_hidden``, :mod:`logprob_registry.kernels.chunked._hidden`):
what is specific to its implementation. The op's contract (values and gradients in every dtype,
shapes, layouts, tied embeddings, special values, determinism, batch invariance) is checked by
the shipped suite's hidden section, which ``tests/test_conformance.py`` runs against ``chunked``;
here are its tile plan, its budgets (the suite's checks again, with tiles down to one logit), the
memory of its tiles and the accumulation of the weight gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.config import ConfigError
from logprob_registry.kernels.chunked import _hidden as ch
from logprob_registry.numerics import EPS32, assert_close
from logprob_registry.testing.harness import Harness
from logprob_registry.testing.sections.hidden import check_hidden

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lp() -> Harness:
    """``chunked`` on the CPU, as the conformance suite reaches it."""
    return Harness(lr.get_registry().get("chunked"), CPU)


def make_inputs(n=37, h=24, v=97, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g)).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, labels


def _direct(hidden, weight, bias, labels, budget, **kw):
    opts = dict(temperature=1.0, ignore_index=None, return_entropy=False)
    opts.update(kw)
    return ch.logprobs_from_hidden(hidden, weight, labels, bias=bias, chunk_bytes=budget, **opts)


# --------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("budget", [4, 96, 1000, 4 << 20])
def test_chunk_budgets(lp, dtype, budget, monkeypatch):
    """The suite's value and gradient check at budgets from one logit a tile (vocabulary split to
    single entries, online log-sum-exp across 31 blocks) to everything in one tile; N of 19 is no
    multiple of any tile height."""
    hidden, weight, bias, labels = make_inputs(n=19, v=31, dtype=dtype)
    tiles = ch.plan(19, 31, 24, dtype, budget)
    if budget < 1000:
        assert tiles.cols < 31
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, str(budget))
    assert ch.resolve_chunk_bytes(CPU) == budget
    labels[::5] = -1
    bias[10:15] = float("-inf")
    check_hidden(lp, hidden, weight, bias, labels, temperature=1.3, ignore_index=-1, return_entropy=True,
                 what=f"chunked logprobs_from_hidden, {dtype}, tiles {tiles}")


def test_budget_changes_nothing_but_rounding():
    hidden, weight, bias, labels = make_inputs(n=64, v=200)
    outs = [_direct(hidden, weight, bias, labels, b, return_entropy=True) for b in (256, 4096, 1 << 20)]
    for lp_, ent in outs[1:]:
        torch.testing.assert_close(lp_, outs[0][0], rtol=0, atol=2e-5)
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
    monkeypatch.delenv(ch.CHUNK_BYTES_ENV, raising=False)
    assert ch.resolve_chunk_bytes(CPU) == ch.DEFAULT_CHUNK_BYTES["cpu"]
    assert ch.resolve_chunk_bytes(torch.device("meta")) == ch.DEFAULT_CHUNK_BYTES["default"]
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, "12345")
    assert ch.resolve_chunk_bytes(CPU) == 12345
    assert ch.resolve_chunk_bytes(CPU, 77) == 77  # the keyword wins
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, "16MiB")  # the same syntax as the workspace of the row ops
    assert ch.resolve_chunk_bytes(CPU) == 16 << 20
    monkeypatch.setenv(ch.CHUNK_BYTES_ENV, "lots")
    with pytest.raises(ConfigError, match="LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES='lots' is not a positive size"):
        ch.resolve_chunk_bytes(CPU)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive number of bytes"):
        ch.resolve_chunk_bytes(CPU, 0)


# ---------------------------------------------------------------------------------- memory
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
        lp_, ent = _direct(leaves[0], leaves[1], leaves[2], labels, budget, return_entropy=True)
        (lp_.sum() + ent.sum()).backward()
    tiles = ch.plan(n, v, h, dtype, budget)
    bound = max(v * h, n * h, budget // 4, ch.MIN_GEMM_ROWS * tiles.cols)
    assert bound < n * v // 8
    assert sizes.largest <= bound, (sizes.largest, bound)
    assert max(saved) <= max(v * h, n * h), saved


# ------------------------------------------------------------------ weight-gradient accumulation
def test_weight_gradient_accumulates_once_per_use():
    """Two calls on one weight (two sequences, one lm_head) sum their gradients, as autograd does,
    although backward accumulates the weight gradient tile by tile."""
    hidden, weight, bias, labels = make_inputs()
    w = weight.clone().requires_grad_(True)
    a = _direct(hidden[:20], w, bias, labels[:20], 4096)
    b = _direct(hidden[20:], w, bias, labels[20:], 4096)
    (g,) = torch.autograd.grad(a.sum() + b.sum(), w)
    w64 = weight.double().requires_grad_(True)
    r = ref.logprobs_from_hidden(hidden.double(), w64, labels, bias=bias.double())
    (g64,) = torch.autograd.grad(r.sum(), w64)
    assert_close(g, g64, 64 * EPS32 * float(g64.abs().max()), "weight gradient over two calls")


def test_frozen_weight_forms_the_hidden_gradient_in_forward(monkeypatch):
    """A weight without ``requires_grad``: the forward accumulates ``softmax @ W`` tile by tile, the
    backward recomputes nothing, and the hidden gradient under per-row upstream gradients (zeros,
    signs, a wide range) is float64's; ignored rows get exact zeros."""
    from logprob_registry.kernels.chunked import _hidden as chh

    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(45, 16, generator=g), torch.randn(90, 16, generator=g) / 4
    labels = torch.randint(0, 90, (45,), generator=g)
    labels[::4] = -100
    monkeypatch.setattr(chh, "_backward", lambda *a, **k: pytest.fail("a frozen weight's backward recomputed tiles"))
    h = hidden.clone().requires_grad_(True)
    out = chh.logprobs_from_hidden(h, weight, labels, bias=None, ignore_index=-100, temperature=1.3,
                                   return_entropy=False, chunk_bytes=20 * 30 * 4)  # tiles of 20 x 30
    up = torch.randn(45, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (45,), generator=g)
    up[::5] = 0
    (grad,) = torch.autograd.grad((out * up.float()).sum(), h)
    h64 = hidden.double().requires_grad_(True)
    want = ref.logprobs_from_hidden(h64, weight.double(), labels, ignore_index=-100, temperature=1.3)
    (grad64,) = torch.autograd.grad((want * up).sum(), h64)
    scale = up.abs().clamp(min=1e-300).unsqueeze(1)  # each row at its own upstream's scale
    assert ((grad.double() - grad64).abs() / scale).max() < 1e-5
    assert bool((grad[::4] == 0).all())


def test_ignored_rows_reach_no_tile_and_change_no_active_row(monkeypatch):
    """Only the active rows reach the tiles; their results are bitwise those of the all-active call."""
    from logprob_registry.kernels.chunked import _hidden as chh

    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(200, 16, generator=g), torch.randn(90, 16, generator=g) / 4
    labels = torch.randint(0, 90, (200,), generator=g)
    ignored = torch.rand(200, generator=g) < 0.9
    rows = []
    real = chh._forward
    monkeypatch.setattr(chh, "_forward", lambda hidden, *a, **k: rows.append(hidden.shape[0]) or real(hidden, *a, **k))
    h = hidden.clone().requires_grad_(True)
    out = lr.logprobs_from_hidden(h, weight, labels.masked_fill(ignored, -100), ignore_index=-100, backend="chunked")
    (gh,) = torch.autograd.grad(out.sum(), h)
    assert rows == [int((~ignored).sum())]
    full = lr.logprobs_from_hidden(hidden, weight, labels, ignore_index=-100, backend="chunked")
    assert torch.equal(out.detach()[~ignored], full[~ignored])
    assert bool((out[ignored] == 0).all()) and bool((gh[ignored] == 0).all())
