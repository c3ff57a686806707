"""The conformance suite: the numerical contract of DESIGN.md as tests, for any backend.

Subclass :class:`BackendConformance` in a test module of your own and name your backend::

    from logprob_registry.testing import BackendConformance

    class TestMyKernel(BackendConformance):
        backend = "my-kernel"
        device = "cuda"          # optional; default: --logprob-device, else the main device

Every test calls the backend through the public functions with ``backend=NAME`` (so that input
validation and dispatch run as for a user) and compares with the float64 reference
(:mod:`logprob_registry.reference`) within the tolerance derived in
:mod:`logprob_registry.testing.numerics`. Ops, dtypes, gradients or devices the backend does not
declare, or that this machine lacks, are skipped with a reason that says which. Test names are part
of the API for subclassers: they are never renamed.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from logprob_registry.backend import Backend
from logprob_registry.registry import get_registry

from .harness import DTYPES, LABEL_OPS, LOGITS_OPS, Harness, default_device
from .memory import MemoryMeasurementUnavailable, describe, peak_extra_bytes
from .numerics import EPS32, assert_close, tolerances
from .sections.distributed import DistributedSection

SHAPES = {
    "1d": (1000,),
    "2d": (6, 1000),
    "3d": (2, 5, 1000),
    "4d": (2, 2, 3, 1000),
    "empty": (0, 1000),
    "empty-3d": (2, 0, 1000),
    "vocab-1": (4, 1),
    "vocab-7": (5, 7),
    "vocab-50257": (3, 50257),
}
LARGE_VOCAB = 262144
STRIDED = ("shifted", "transposed", "every-other-row", "broadcast")
IGNORE = {"below-range": -100, "above-range": None, "in-range": 0}  # None: V + 5
# The no-copy checks: a (2, 257, 32768) float32 tensor is 64 MiB, its [:, :-1] slice is strided.
MEMORY_SHAPE = (2, 257, 32768)
MEMORY_LIMIT = 0.5  # of the logits' own size


# Tests of a promise a backend may decline to make: the Backend flag each needs, and its value.
PROMISE_TESTS = {
    "test_deterministic": ("deterministic", True),
    "test_batch_invariant": ("batch_invariant", True),
    "test_no_copy_of_strided_logits": ("copies_logits", False),
    "test_forward_keeps_no_copy_for_backward": ("copies_logits", False),
    "test_hidden_never_materialises_logits": ("copies_logits", False),
}


def not_declared(backend: Backend, test: str, params: dict) -> Optional[str]:
    """Why conformance test ``test`` (its function name; ``params``, its parameters) checks
    something ``backend`` does not declare (an op it lacks, a promise it does not make), or None.

    Known before the test runs, unlike a missing device or dtype: a project running the suite over
    its own backends can deselect such tests instead of skipping them (this project's
    ``tests/conftest.py`` does); at run time the test skips with the same reason."""
    op = "logprobs_from_hidden" if test.startswith("test_hidden_") else params.get("op")
    if op is not None and not backend.supports(op):
        return f"{backend.name} does not implement {op}"
    flag, wanted = PROMISE_TESTS.get(test, (None, None))
    if flag is not None and bool(getattr(backend, flag)) != wanted:
        return f"{backend.name} declares {flag}={not wanted}"
    return None


def _grad_dtype_eps(dtype: torch.dtype) -> float:
    return max(torch.finfo(dtype).eps, 4 * EPS32) if dtype != torch.float64 else 4 * EPS32


class BackendConformance(DistributedSection):
    """Base class of the conformance suite: set ``backend`` (and optionally ``device``).

    ``backend``: the registered name. None takes ``--logprob-backend`` from the command line.
    ``device``: a device type such as ``"cuda"``. None takes ``--logprob-device``, else the
    machine's main device when the backend runs there, else the backend's own device type (whose
    tests then skip, naming the device, on a machine without it).
    """

    backend: Optional[str] = None
    device: Optional[str] = None

    # ---------------------------------------------------------------- fixtures
    @pytest.fixture(scope="class")
    def conformance_backend(self, request) -> str:
        """The name of the backend under test (override to parametrise over several)."""
        name = self.backend or request.config.getoption("logprob_backend", default=None)
        if not name:
            raise pytest.UsageError(
                f"{type(self).__name__} names no backend: set the class attribute backend = 'name' "
                "or run pytest with --logprob-backend NAME")
        return name

    @pytest.fixture(scope="class")
    def lp(self, request, conformance_backend) -> Harness:
        """The backend under test on its device (see :class:`~logprob_registry.testing.harness.Harness`)."""
        backend: Backend = get_registry().get(conformance_backend)
        device = self.device or request.config.getoption("logprob_device", default=None) or default_device(backend)
        return Harness(backend, torch.device(device))

    # ------------------------------------------------------------------ shapes
    @pytest.mark.parametrize("shape", list(SHAPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_shapes(self, lp: Harness, op: str, shape: str) -> None:
        """1-D logits with a 0-d label, 2-D to 4-D, empty leading dims, V of 1, odd V."""
        lp.require(op)
        dims = SHAPES[shape]
        x = lp.logits(dims)
        y = lp.labels(dims[:-1], dims[-1])
        got, want = lp.call(op, x, y), lp.reference(op, x, y)
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x))):
            assert g.dtype == torch.float32, f"{op} output {i} is {g.dtype}, expected float32"
            assert g.device.type == lp.device.type, f"{op} output {i} is on {g.device}, expected {lp.device}"
            assert_close(g, w, tol, f"{op} output {i}, shape {dims}")

    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_large_vocab(self, lp: Harness, op: str, dtype: str) -> None:
        """V = 262144 (a few rows, so that the CPU run stays quick)."""
        lp.require(op, DTYPES[dtype])
        x = lp.logits((3, LARGE_VOCAB), DTYPES[dtype], scale=4.0)
        y = lp.labels((3,), LARGE_VOCAB)
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, V={LARGE_VOCAB}, {dtype}")

    # ------------------------------------------------------------------ dtypes
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_dtypes(self, lp: Harness, op: str, dtype: str) -> None:
        """Each input dtype against float64, within fp32 rounding; float32 out (float64 for float64)."""
        lp.require(op, DTYPES[dtype])
        x = lp.logits((3, 5, 1000), DTYPES[dtype], scale=4.0)
        y = lp.labels((3, 5), 1000)
        expected_dtype = lp.result_dtype(DTYPES[dtype])
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert g.dtype == expected_dtype, f"{op} output {i} of {dtype} input is {g.dtype}, expected {expected_dtype}"
            assert_close(g, w, tol, f"{op} output {i}, {dtype} input")

    @pytest.mark.parametrize("label_dtype", ["int32", "int64"])
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_label_dtypes(self, lp: Harness, op: str, label_dtype: str) -> None:
        lp.require(op)
        x = lp.logits((4, 6, 777))
        y = lp.labels((4, 6), 777, dtype=getattr(torch, label_dtype))
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, {label_dtype} labels")

    # ------------------------------------------------------------------ layout
    @pytest.mark.parametrize("layout", STRIDED)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_strided_leading_dims(self, lp: Harness, op: str, layout: str) -> None:
        """Non-contiguous leading dims: logits[:, :-1] with labels[:, 1:], transposed, every other
        row, and a broadcast (stride 0) batch."""
        lp.require(op)
        full = lp.logits((3, 9, 640))
        labels = lp.labels((3, 9), 640)
        if layout == "shifted":
            x, y = full[:, :-1], labels[:, 1:]
        elif layout == "transposed":
            x, y = full.transpose(0, 1), labels.transpose(0, 1)
        elif layout == "every-other-row":
            x, y = full[:, ::2], labels[:, ::2]
        else:
            x, y = full[:1].expand(4, 9, 640), labels[:1].expand(4, 9)
        assert not x.is_contiguous()
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, {layout} logits of strides {x.stride()}")

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_no_copy_of_strided_logits(self, lp: Harness, op: str) -> None:
        """logits[:, :-1] (32 MiB in bf16, 64 MiB in fp32, strided) is read where it lies: the
        call's extra peak memory stays below half the logits' size, for bf16 without and fp32 with a
        temperature (one dtype for both where the backend accepts only one)."""
        lp.require(op)
        self._require_no_copy(lp)
        accepted = [d for d in (torch.bfloat16, torch.float32) if d in lp.backend.dtypes]
        if not accepted:
            pytest.skip(f"{lp.name} accepts neither bfloat16 nor float32")
        for dtype, temperature in ((accepted[0], 1.0), (accepted[-1], 0.7)):
            full = lp.logits(MEMORY_SHAPE, dtype, seed=3)
            labels = lp.labels(MEMORY_SHAPE[:-1], MEMORY_SHAPE[-1])
            x, y = full[:, :-1], labels[:, 1:]
            size = x.numel() * x.element_size()
            with torch.no_grad():
                lp.call(op, x, y, temperature=temperature)  # warm-up: lazy init, compilation
                out, extra = self._peak(lambda: lp.call(op, x, y, temperature=temperature), lp,
                                        MEMORY_LIMIT * size)
            del out, full, x
            assert extra < MEMORY_LIMIT * size, (
                f"{op} on strided {dtype} logits {tuple(MEMORY_SHAPE[:1]) + (MEMORY_SHAPE[1] - 1,) + MEMORY_SHAPE[2:]} "
                f"(T={temperature}) allocated {describe(extra)} at its peak, {extra / size:.2f}x the logits "
                f"({describe(size)}): it copies the logits. Read them through their strides, a block of rows at a time.")

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_forward_keeps_no_copy_for_backward(self, lp: Harness, op: str) -> None:
        """What the forward pass keeps for backward (strided 64 MiB logits needing gradients)
        stays below half the logits' size: backward keeps no N x V tensor besides the logits."""
        lp.require(op, torch.float32, grad=True)
        self._require_no_copy(lp)
        base = lp.logits(MEMORY_SHAPE, seed=3).requires_grad_(True)
        labels = lp.labels(MEMORY_SHAPE[:-1], MEMORY_SHAPE[-1])
        x, y = base[:, :-1], labels[:, 1:]
        size = x.numel() * x.element_size()
        warm = lp.call(op, x, y)
        sum(o.sum() for o in warm).backward()
        del warm
        base.grad = None
        out, kept = self._peak(lambda: lp.call(op, x, y), lp, MEMORY_LIMIT * size, retained=True)
        del out
        assert kept < MEMORY_LIMIT * size, (
            f"the {op} forward pass keeps {describe(kept)} alive for backward, {kept / size:.2f}x the "
            f"strided logits ({describe(size)}): keep only per-row statistics (max, log-sum-exp) and "
            "recompute in backward.")

    # ------------------------------------------------------ temperature, ignore
    @pytest.mark.parametrize("temperature", [0.5, 2.0, 0.05])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_temperature(self, lp: Harness, op: str, temperature: float) -> None:
        lp.require(op)
        x = lp.logits((4, 5, 900))
        y = lp.labels((4, 5), 900)
        got = lp.call(op, x, y, temperature=temperature)
        for i, (g, w, tol) in enumerate(zip(got, lp.reference(op, x, y, temperature=temperature), tolerances(op, x, temperature))):
            assert_close(g, w, tol, f"{op} output {i} at temperature {temperature}")

    @pytest.mark.parametrize("case", list(IGNORE))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_ignore_index(self, lp: Harness, op: str, case: str) -> None:
        """Ignored positions give exactly 0 and their label is never read as an index (it may lie
        outside the vocabulary); the entropy there is computed as usual."""
        lp.require(op)
        vocab = 500
        ignore = IGNORE[case] if IGNORE[case] is not None else vocab + 5
        x = lp.logits((3, 8, vocab))
        y = lp.labels((3, 8), vocab).clamp(min=1)
        mask = torch.zeros(3, 8, dtype=torch.bool)
        mask[0, :3] = mask[1, 5] = mask[2, :] = True
        mask = mask.to(lp.device)
        y = y.masked_fill(mask, ignore)
        got = lp.call(op, x, y, ignore_index=ignore)
        want = lp.reference(op, x, y, ignore_index=ignore)
        assert torch.equal(got[0][mask].cpu(), torch.zeros(int(mask.sum()), dtype=got[0].dtype)), (
            f"{op} gives {got[0][mask].tolist()} at positions whose label is ignore_index={ignore}, expected 0")
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i} with ignore_index={ignore}")

    # ------------------------------------------------------------------ values
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_extreme_magnitudes(self, lp: Harness, op: str, dtype: str) -> None:
        """Logits of +-1e4 next to ordinary ones: no overflow, no loss beyond fp32 rounding of 1e4."""
        lp.require(op, DTYPES[dtype])
        x = lp.logits((6, 300), torch.float64)
        x[0, 7] = 1e4
        x[1, :] -= 1e4
        x[2, ::3] = -1e4
        x[3, 5] = 1e4
        x[3, 9] = -1e4
        x[4, :] = 1e4
        x[5, 11] = 9.99e3
        y = lp.labels((6,), 300)
        y[3] = 5
        y[5] = 11
        x = x.to(DTYPES[dtype])
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, {dtype} logits of magnitude 1e4")

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_negative_infinity(self, lp: Harness, op: str) -> None:
        """Masked vocabulary (-inf): a label on -inf gives -inf, entropy counts 0 * log 0 as 0."""
        lp.require(op)
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in lp.backend.dtypes:
                continue
            x = lp.logits((4, 64), torch.float64)
            y = lp.labels((4,), 64)
            x[0, ::3] = -math.inf
            y[0] = 1
            x[1, 10:20] = -math.inf
            y[1] = 12
            x[2, :] = -math.inf
            x[2, 5] = 0.5
            y[2] = 5
            x[3, :] = -math.inf
            x[3, 2] = 1.0
            x[3, 40] = 3.0
            y[3] = 40
            x = x.to(dtype)
            got, want = lp.call(op, x, y), lp.reference(op, x, y)
            for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x))):
                assert_close(g, w, tol, f"{op} output {i} with -inf logits ({dtype})")
            if op != "entropy":
                assert got[0][1].item() == -math.inf, f"a label on a -inf logit gives {got[0][1].item()}, expected -inf"

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_nan_propagates(self, lp: Harness, op: str) -> None:
        """A NaN logit makes its own row NaN and no other."""
        lp.require(op)
        x = lp.logits((4, 100))
        y = lp.labels((4,), 100)
        y[0], y[1] = 3, 4
        x[0, 50] = math.nan  # not the label
        x[1, 4] = math.nan  # the label
        got, want = lp.call(op, x, y), lp.reference(op, x, y)
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x[2:]))):
            assert bool(torch.isnan(g[:2]).all()), f"{op} output {i}: rows with a NaN logit give {g[:2].tolist()}, expected NaN"
            assert_close(g, w, tol, f"{op} output {i} with NaN in other rows")

    # --------------------------------------------------------------- gradients
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("case", ["plain", "temperature", "ignore-index", "negative-infinity"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_gradients(self, lp: Harness, op: str, case: str, dtype: str) -> None:
        """Gradients of the logits against float64 autograd, with random upstream gradients on every
        output (both outputs of logprobs_and_entropy); zero at ignored positions."""
        lp.require(op, DTYPES[dtype], grad=True)
        temperature = 0.6 if case == "temperature" else 1.0
        ignore = -100 if case == "ignore-index" and op != "entropy" else None
        x0 = lp.logits((3, 5, 300), DTYPES[dtype])
        y = lp.labels((3, 5), 300)
        mask = torch.zeros(3, 5, dtype=torch.bool, device=lp.device)
        if ignore is not None:
            mask[0, 1] = mask[2, :2] = True
            y = y.masked_fill(mask, ignore)
        if case == "negative-infinity":
            x0[..., 250:] = -math.inf
            y = y % 250
        self._compare_gradients(lp, op, x0, y, temperature, ignore, f"{op}, {case}, {dtype}", mask)

    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_inplace_backward(self, lp: Harness, op: str) -> None:
        """``inplace_backward=True``: the gradient is right; a backend that declares
        ``inplace_backward`` writes it into the logits' storage, any other honours the flag out of place."""
        lp.require(op, torch.float32, grad=True)
        base = lp.logits((3, 6, 400)).requires_grad_(True)
        y = lp.labels((3, 6), 400)
        y[1, 2] = -100
        logits = base * 1.0  # a non-leaf, as the output of an lm_head would be
        outs = lp.call(op, logits, y, temperature=0.8, ignore_index=-100, inplace_backward=True)
        ups = [torch.randn(o.shape, generator=torch.Generator().manual_seed(5 + i), dtype=o.dtype).to(o.device)
               for i, o in enumerate(outs)]
        sum((o * u).sum() for o, u in zip(outs, ups)).backward()
        ref_x = base.detach().cpu().double().requires_grad_(True)
        refs = lp.reference(op, ref_x, y, temperature=0.8, ignore_index=-100)
        sum((r * u.cpu().double()).sum() for r, u in zip(refs, ups)).backward()
        atol = 4 * max(tolerances(op, base, 0.8)) * max(float(u.abs().max()) for u in ups) / 0.8
        assert_close(base.grad, ref_x.grad, atol, f"{op} gradient with inplace_backward=True", rtol=4 * EPS32)
        if lp.backend.inplace_backward:
            assert_close(logits.detach(), ref_x.grad, atol,
                         f"{op}: {lp.name} declares inplace_backward=True, so the logits' storage must hold "
                         "their gradient after backward", rtol=4 * EPS32)

    # ------------------------------------------------------------- invariances
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_deterministic(self, lp: Harness, op: str) -> None:
        """Same inputs, same backend: bitwise the same results and gradients."""
        lp.require(op)
        lp.require_capability("deterministic", "bitwise reproducibility")
        x = lp.logits((4, 9, 3000))
        y = lp.labels((4, 9), 3000)
        y[0, 0] = -100
        kw = dict(temperature=0.9) if op == "entropy" else dict(temperature=0.9, ignore_index=-100)
        first, second = lp.call(op, x, y, **kw), lp.call(op, x, y, **kw)
        for i, (a, b) in enumerate(zip(first, second)):
            assert torch.equal(a, b), f"{op} output {i} differs between two identical calls"
        if lp.backend.autograd:
            grads = []
            for _ in range(2):
                leaf = x.clone().requires_grad_(True)
                sum(o.sum() for o in lp.call(op, leaf, y, **kw)).backward()
                grads.append(leaf.grad)
            assert torch.equal(grads[0], grads[1]), f"{op} gradient differs between two identical calls"

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_batch_invariant(self, lp: Harness, op: str) -> None:
        """A row's result is bitwise the same alone, in a sub-batch, in the whole batch and under
        another leading shape."""
        lp.require(op)
        lp.require_capability("batch_invariant", "batch invariance")
        x = lp.logits((12, 2000))
        y = lp.labels((12,), 2000)
        whole = lp.call(op, x, y)
        views = {"row 0 alone": slice(0, 1), "row 11 alone": slice(11, 12), "rows 3..7": slice(3, 8)}
        for what, rows in views.items():
            for i, (part, full) in enumerate(zip(lp.call(op, x[rows], y[rows]), whole)):
                assert torch.equal(part, full[rows]), f"{op} output {i}: {what} differs from the same rows in a batch of 12"
        for i, (shaped, full) in enumerate(zip(lp.call(op, x.view(3, 4, 2000), y.view(3, 4)), whole)):
            assert torch.equal(shaped.reshape(-1), full), f"{op} output {i}: a (3, 4, V) batch differs from (12, V)"

    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_inputs_unmodified(self, lp: Harness, op: str) -> None:
        """Forward and backward (without inplace_backward) leave logits and labels as they were."""
        lp.require(op)
        base = lp.logits((3, 7, 500))
        y = lp.labels((3, 7), 500)
        y[1, :2] = -100
        kw = dict(temperature=0.7) if op == "entropy" else dict(temperature=0.7, ignore_index=-100)
        x = base.clone()
        x_before, y_before = x.clone(), y.clone()
        with torch.no_grad():
            lp.call(op, x, y, **kw)
        assert torch.equal(x, x_before), f"{op} (no gradients) modified the logits"
        assert torch.equal(y, y_before), f"{op} (no gradients) modified the labels"
        if lp.backend.autograd:
            leaf = base.clone().requires_grad_(True)
            logits = leaf * 1.0
            sum(o.sum() for o in lp.call(op, logits, y, **kw)).backward()
            assert torch.equal(logits.detach(), x_before), f"{op} forward or backward modified the logits"
            assert torch.equal(y, y_before), f"{op} forward or backward modified the labels"

    # ---------------------------------------------------------------- bad input
    @pytest.mark.parametrize("case", [
        "label-out-of-range", "negative-label", "shape-mismatch", "integer-logits",
        "non-positive-temperature", "different-devices",
    ])
    def test_bad_input_errors(self, lp: Harness, case: str) -> None:
        """Bad input raises a clear error before dispatch, naming what is wrong."""
        op = lp.first_op(LABEL_OPS if case != "integer-logits" and case != "non-positive-temperature" else LOGITS_OPS)
        lp.require(op)
        x = lp.logits((2, 5, 50))
        y = lp.labels((2, 5), 50)
        if case == "label-out-of-range":
            y[1, 3] = 57
            with pytest.raises(ValueError) as info:
                lp.call(op, x, y)
            assert "57" in str(info.value) and "(1, 3)" in str(info.value), str(info.value)
        elif case == "negative-label":
            y[0, 2] = -1
            with pytest.raises(ValueError) as info:
                lp.call(op, x, y)
            assert "-1" in str(info.value) and "(0, 2)" in str(info.value), str(info.value)
        elif case == "shape-mismatch":
            with pytest.raises(ValueError) as info:
                lp.call(op, x, y[:, :4])
            assert "(2, 4)" in str(info.value) and "(2, 5" in str(info.value), str(info.value)
        elif case == "integer-logits":
            with pytest.raises(TypeError, match="floating"):
                lp.call(op, x.to(torch.int32), y)
        elif case == "non-positive-temperature":
            for bad in (0.0, -1.0, math.nan, math.inf):
                with pytest.raises(ValueError, match="temperature"):
                    lp.call(op, x, y, temperature=bad)
        else:
            other = "cpu" if lp.device.type != "cpu" else "meta"  # meta: a second device on any machine
            with pytest.raises(ValueError) as info:
                lp.call(op, x, y.to(other))
            assert other in str(info.value) and lp.device.type in str(info.value), str(info.value)

    # ------------------------------------------------------- the fused hidden op
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("variant", ["plain", "bias", "entropy", "temperature-ignore-index"])
    def test_hidden_values(self, lp: Harness, variant: str, dtype: str) -> None:
        """logprobs_from_hidden against float64 ``hidden @ weight.T + bias``."""
        lp.require("logprobs_from_hidden", DTYPES[dtype])
        h, w, b, y, kw = self._hidden_case(lp, variant, DTYPES[dtype])
        got = lp.call_hidden(h, w, y, bias=b, **kw)
        want = lp.reference_hidden(h, w, y, bias=b, **kw)
        tols = self._hidden_tolerances(h, w, b, kw.get("temperature", 1.0))
        for i, (g, r, tol) in enumerate(zip(got, want, tols)):
            assert g.dtype == lp.result_dtype(DTYPES[dtype]), f"output {i} is {g.dtype}"
            assert_close(g, r, tol, f"logprobs_from_hidden output {i}, {variant}, {dtype}")

    @pytest.mark.parametrize("shape", ["1d", "empty", "strided"])
    def test_hidden_shapes(self, lp: Harness, shape: str) -> None:
        lp.require("logprobs_from_hidden")
        w = lp.logits((300, 32), scale=0.3, seed=7)
        if shape == "1d":
            h, y = lp.logits((32,), seed=8), lp.labels((), 300)
        elif shape == "empty":
            h, y = lp.logits((0, 32), seed=8), lp.labels((0,), 300)
        else:
            h, y = lp.logits((3, 6, 32), seed=8)[:, :-1], lp.labels((3, 6), 300)[:, 1:]
        for ret in (False, True):
            got = lp.call_hidden(h, w, y, return_entropy=ret)
            want = lp.reference_hidden(h, w, y, return_entropy=ret)
            for i, (g, r, tol) in enumerate(zip(got, want, self._hidden_tolerances(h, w, None, 1.0))):
                assert_close(g, r, tol, f"{shape} hidden, output {i}")

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("variant", ["plain", "bias", "entropy", "temperature-ignore-index"])
    def test_hidden_gradients(self, lp: Harness, variant: str, dtype: str) -> None:
        """Gradients of hidden, weight and bias against float64 autograd."""
        lp.require("logprobs_from_hidden", DTYPES[dtype], grad=True)
        h0, w0, b0, y, kw = self._hidden_case(lp, variant, DTYPES[dtype])
        leaves = [t.clone().requires_grad_(True) for t in (h0, w0) + ((b0,) if b0 is not None else ())]
        refs = [t.detach().cpu().double().requires_grad_(True) for t in leaves]
        outs = lp.call_hidden(leaves[0], leaves[1], y, bias=leaves[2] if b0 is not None else None, **kw)
        want = lp.reference_hidden(refs[0], refs[1], y, bias=refs[2] if b0 is not None else None, **kw)
        ups = [torch.randn(o.shape, generator=torch.Generator().manual_seed(11 + i), dtype=torch.float64)
               for i, o in enumerate(outs)]
        sum((o * u.to(o.device, o.dtype)).sum() for o, u in zip(outs, ups)).backward()
        sum((r * u).sum() for r, u in zip(want, ups)).backward()
        temperature = kw.get("temperature", 1.0)
        tol = max(self._hidden_tolerances(h0, w0, b0, temperature))
        # The error of each gradient element is bounded by the tolerance (plus one rounding to the
        # gradient's dtype) times the sum of the absolute terms that make it up.
        logits_ref = torch.nn.functional.linear(
            refs[0].detach(), refs[1].detach(), None if b0 is None else refs[2].detach()).requires_grad_(True)
        op = "logprobs_and_entropy" if kw.get("return_entropy") else "logprobs"
        lo = lp.reference(op, logits_ref, y, temperature=temperature, ignore_index=kw.get("ignore_index"))
        dlogits = torch.autograd.grad(sum((o * u).sum() for o, u in zip(lo, ups)), logits_ref)[0].abs()
        bounds = [dlogits @ refs[1].detach().abs(),
                  (dlogits.reshape(-1, dlogits.shape[-1]).T @ refs[0].detach().abs().reshape(-1, h0.shape[-1])),
                  dlogits.reshape(-1, dlogits.shape[-1]).sum(0)]
        rel = 4 * tol + 2 * _grad_dtype_eps(DTYPES[dtype])
        for name, leaf, r, bound in zip(("hidden", "weight", "bias"), leaves, refs, bounds):
            assert leaf.grad is not None, f"no gradient reached {name}"
            err = (leaf.grad.cpu().double() - r.grad).abs()
            allowed = rel * bound + 1e-30
            worst = float((err - allowed).max())
            assert worst <= 0, (
                f"logprobs_from_hidden {variant} {dtype}: gradient of {name} off by up to "
                f"{float(err.max()):.3g} (allowed {rel:.2g} x the sum of absolute terms)")

    def test_hidden_never_materialises_logits(self, lp: Harness) -> None:
        """hidden (2048, 256) @ weight (8192, 256).T: the call's extra peak stays below half the size
        of the float32 logits it must not form (64 MiB)."""
        lp.require("logprobs_from_hidden")
        self._require_no_copy(lp)
        h, w = lp.logits((2048, 256), scale=1.0, seed=8), lp.logits((8192, 256), scale=0.05, seed=9)
        y = lp.labels((2048,), 8192)
        size = 2048 * 8192 * 4
        with torch.no_grad():
            lp.call_hidden(h, w, y)
            out, extra = self._peak(lambda: lp.call_hidden(h, w, y), lp, MEMORY_LIMIT * size)
        assert extra < MEMORY_LIMIT * size, (
            f"logprobs_from_hidden allocated {describe(extra)} at its peak, {extra / size:.2f}x the "
            f"float32 logits ({describe(size)}) it must never form; work through blocks of rows or vocabulary")

    def test_hidden_inputs_unmodified_and_deterministic(self, lp: Harness) -> None:
        lp.require("logprobs_from_hidden")
        h, w, b, y, kw = self._hidden_case(lp, "temperature-ignore-index", torch.float32)
        before = [t.clone() for t in (h, w, b, y) if t is not None]
        first = lp.call_hidden(h, w, y, bias=b, return_entropy=True, **kw)
        for t, t0 in zip([t for t in (h, w, b, y) if t is not None], before):
            assert torch.equal(t, t0), "logprobs_from_hidden modified one of its inputs"
        if lp.backend.deterministic:
            second = lp.call_hidden(h, w, y, bias=b, return_entropy=True, **kw)
            assert all(torch.equal(a, c) for a, c in zip(first, second)), "two identical calls differ"

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _require_no_copy(lp: Harness) -> None:
        if lp.backend.copies_logits:
            pytest.skip(f"{lp.name} declares copies_logits=True (it materialises a copy of the logits), "
                        "so the no-copy memory bound does not apply to it")

    @staticmethod
    def _peak(fn, lp: Harness, limit: float, retained: bool = False):
        """(result, bytes) of ``fn()``; a reading over ``limit`` is taken again and the lesser
        kept, since other processes can only make a reading larger than the call's own."""
        best = None
        try:
            for attempt in range(2):
                if attempt:
                    del result  # its memory would otherwise count in the next baseline
                result, extra = peak_extra_bytes(fn, lp.device, retained=retained)
                best = extra if best is None else min(best, extra)
                if best < limit:
                    break
        except MemoryMeasurementUnavailable as exc:
            pytest.skip(f"cannot measure peak memory here: {exc}")
        return result, best

    @staticmethod
    def _compare_gradients(lp: Harness, op: str, x0: torch.Tensor, y: torch.Tensor, temperature: float,
                           ignore: Optional[int], what: str, mask: torch.Tensor) -> None:
        leaf = x0.clone().requires_grad_(True)
        kw = dict(temperature=temperature) if op == "entropy" else dict(temperature=temperature, ignore_index=ignore)
        outs = lp.call(op, leaf, y, **kw)
        ups = [torch.randn(o.shape, generator=torch.Generator().manual_seed(5 + i), dtype=torch.float64)
               for i, o in enumerate(outs)]
        sum((o * u.to(o.device, o.dtype)).sum() for o, u in zip(outs, ups)).backward()
        ref_x = x0.detach().cpu().double().requires_grad_(True)
        refs = lp.reference(op, ref_x, y, **kw)
        sum((r * u).sum() for r, u in zip(refs, ups)).backward()
        assert leaf.grad is not None, f"{what}: no gradient reached the logits"
        assert leaf.grad.dtype == x0.dtype, f"{what}: gradient is {leaf.grad.dtype}, expected {x0.dtype}"
        atol = 4 * max(tolerances(op, x0, temperature)) * max(float(u.abs().max()) for u in ups) / temperature
        assert_close(leaf.grad, ref_x.grad, atol, f"{what}: gradient", rtol=_grad_dtype_eps(x0.dtype))
        if op == "logprobs" and bool(mask.any()):
            assert bool((leaf.grad[mask] == 0).all()), f"{what}: the gradient at ignored positions is not zero"

    @staticmethod
    def _hidden_case(lp: Harness, variant: str, dtype: torch.dtype):
        h = lp.logits((2, 5, 48), dtype, scale=1.0, seed=8)
        w = lp.logits((700, 48), dtype, scale=0.4, seed=9)
        b = lp.logits((700,), dtype, scale=0.5, seed=10) if variant == "bias" else None
        y = lp.labels((2, 5), 700)
        kw: dict = {}
        if variant == "entropy":
            kw["return_entropy"] = True
        if variant == "temperature-ignore-index":
            kw.update(temperature=0.7, ignore_index=-100)
            y[0, 1] = y[1, 4] = -100
        return h, w, b, y, kw

    @staticmethod
    def _hidden_tolerances(h, w, b, temperature: float) -> tuple:
        bound = h.detach().cpu().double().abs() @ w.detach().cpu().double().abs().T
        if b is not None:
            bound = bound + b.detach().cpu().double().abs()
        m = float(bound.max()) if bound.numel() else 0.0
        return tolerances("logprobs_and_entropy", w.new_empty((1, w.shape[0])), temperature, magnitude_bound=m)
