"""The conformance section of the ops over logits: ``logprobs``, ``entropy`` and
``logprobs_and_entropy`` (the ops of the op table whose dtype input is the logits).

Every test calls the backend through the public function with ``backend=NAME`` and compares with
the float64 reference within the tolerance of :mod:`logprob_registry.numerics`; each
declares with :func:`~logprob_registry.testing.sections.covers` the ops it exercises and the
capability whose promise it checks.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import pytest
import torch

from logprob_registry.numerics import EPS32, assert_close, gradient_rounding, tolerances

from ..harness import DTYPES, LABEL_OPS, LOGITS_OPS, Harness
from ._common import MEMORY_LIMIT, autocast, growth, require_no_copy, upstream, weighted_sum
from ._coverage import covers

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
# The shapes whose gradients test_gradients_of_shapes checks (test_gradients covers the ordinary one).
GRADIENT_SHAPES = ("1d", "empty", "empty-3d", "vocab-1", "vocab-7")
LARGE_VOCAB = 262144
STRIDED = ("shifted", "transposed", "every-other-row", "broadcast")
IGNORE = {"below-range": -100, "above-range": None, "in-range": 0}  # None: V + 5
# The no-copy checks: logits (2, rows + 1, 32768), read through their [:, :-1] slice (strided), at
# two numbers of rows; (2, 257, 32768) float32 is 64 MiB.
MEMORY_SHAPE = (2, 257, 32768)
MEMORY_ROWS = (64, MEMORY_SHAPE[1] - 1)


def _accepted(lp: Harness, dtypes: Sequence[torch.dtype]) -> list:
    """Those of ``dtypes`` the backend accepts (a test over several runs each of them)."""
    return [d for d in dtypes if d in lp.backend.dtypes]


class LogitsSection:
    """Tests of the ops over logits (a mixin of :class:`~logprob_registry.testing.BackendConformance`,
    which provides the ``lp`` fixture)."""

    # ------------------------------------------------------------------ shapes
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("shape", list(SHAPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_shapes(self, lp: Harness, op: str, shape: str) -> None:
        """1-D logits with a 0-d label, 2-D to 4-D, empty leading dims, V of 1, odd V."""
        dims = SHAPES[shape]
        lp.require(op, vocab=dims[-1])
        x = lp.logits(dims)
        y = lp.labels(dims[:-1], dims[-1])
        got, want = lp.call(op, x, y), lp.reference(op, x, y)
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x))):
            assert g.dtype == torch.float32, f"{op} output {i} is {g.dtype}, expected float32"
            assert g.device.type == lp.device.type, f"{op} output {i} is on {g.device}, expected {lp.device}"
            assert_close(g, w, tol, f"{op} output {i}, shape {dims}")

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_large_vocab(self, lp: Harness, op: str, dtype: str) -> None:
        """V = 262144 (a few rows, so that the CPU run stays quick)."""
        lp.require(op, DTYPES[dtype], vocab=LARGE_VOCAB)
        x = lp.logits((3, LARGE_VOCAB), DTYPES[dtype], scale=4.0)
        y = lp.labels((3,), LARGE_VOCAB)
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, V={LARGE_VOCAB}, {dtype}")

    # ------------------------------------------------------------------ dtypes
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_dtypes(self, lp: Harness, op: str, dtype: str) -> None:
        """Each input dtype against float64, within fp32 rounding; float32 out (float64 for float64)."""
        lp.require(op, DTYPES[dtype], vocab=1000)
        x = lp.logits((3, 5, 1000), DTYPES[dtype], scale=4.0)
        y = lp.labels((3, 5), 1000)
        expected_dtype = lp.result_dtype(DTYPES[dtype])
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert g.dtype == expected_dtype, (
                f"{op} output {i} of {dtype} input is {g.dtype}, expected {expected_dtype}")
            assert_close(g, w, tol, f"{op} output {i}, {dtype} input")

    @covers(LABEL_OPS)
    @pytest.mark.parametrize("label_dtype", ["int32", "int64"])
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_label_dtypes(self, lp: Harness, op: str, label_dtype: str) -> None:
        lp.require(op, vocab=777)
        x = lp.logits((4, 6, 777))
        y = lp.labels((4, 6), 777, dtype=getattr(torch, label_dtype))
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, {label_dtype} labels")

    # ------------------------------------------------------------------ layout
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("layout", STRIDED)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_strided_leading_dims(self, lp: Harness, op: str, layout: str) -> None:
        """Non-contiguous leading dims: logits[:, :-1] with labels[:, 1:], transposed, every other
        row, and a broadcast (stride 0) batch."""
        lp.require(op, vocab=640)
        x, y = _strided(lp.logits((3, 9, 640)), lp.labels((3, 9), 640), layout)
        assert not x.is_contiguous()
        for i, (g, w, tol) in enumerate(zip(lp.call(op, x, y), lp.reference(op, x, y), tolerances(op, x))):
            assert_close(g, w, tol, f"{op} output {i}, {layout} logits of strides {x.stride()}")

    @covers(LOGITS_OPS, capability="copies_logits", declared=False)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_no_copy_of_strided_logits(self, lp: Harness, op: str) -> None:
        """logits[:, :-1] is read where it lies: from 128 to 512 rows of 32768 (8 to 32 MiB of bf16,
        16 to 64 MiB of fp32, strided), the call's extra peak memory grows by less than half as
        much as the logits do, for bf16 without and fp32 with a temperature (one dtype for both
        where the backend accepts only one). A fixed workspace, however large, is allowed: only
        memory that grows with the rows counts."""
        lp.require(op, vocab=MEMORY_SHAPE[2])
        require_no_copy(lp)
        accepted = [d for d in (torch.bfloat16, torch.float32) if d in lp.backend.dtypes]
        if not accepted:
            pytest.skip(f"{lp.name} accepts neither bfloat16 nor float32")
        for dtype, temperature in ((accepted[0], 1.0), (accepted[-1], 0.7)):
            def case(rows: int, dtype=dtype, temperature=temperature):
                shape = (MEMORY_SHAPE[0], rows + 1, MEMORY_SHAPE[2])
                full = lp.logits(shape, dtype, seed=3)
                x, y = full[:, :-1], lp.labels(shape[:-1], shape[-1])[:, 1:]
                return functools.partial(lp.call, op, x, y, temperature=temperature), x.numel() * x.element_size()

            with torch.no_grad():
                found = growth(case, MEMORY_ROWS, lp)
            assert found.ratio < MEMORY_LIMIT, (
                f"{op} on strided {dtype} logits of shape ({MEMORY_SHAPE[0]}, rows, {MEMORY_SHAPE[2]}) "
                f"(T={temperature}): {found.describe('the logits')}. Its memory grows with the logits: it copies "
                "them (or makes temporaries as large). Read them through their strides, a block of rows at a time.")

    @covers(LOGITS_OPS, capability="copies_logits", declared=False, grad=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_forward_keeps_no_copy_for_backward(self, lp: Harness, op: str) -> None:
        """What the forward pass keeps for backward (strided fp32 logits needing gradients, 128 to
        512 rows of 32768) grows by less than half as much as the logits do: backward keeps no
        N x V tensor besides the logits."""
        lp.require(op, torch.float32, grad=True, vocab=MEMORY_SHAPE[2])
        require_no_copy(lp)

        def case(rows: int):
            shape = (MEMORY_SHAPE[0], rows + 1, MEMORY_SHAPE[2])
            base = lp.logits(shape, seed=3).requires_grad_(True)
            x, y = base[:, :-1], lp.labels(shape[:-1], shape[-1])[:, 1:]
            return (lambda: lp.call(op, x, y)), x.numel() * x.element_size()

        found = growth(case, MEMORY_ROWS, lp, retained=True)
        assert found.ratio < MEMORY_LIMIT, (
            f"the {op} forward pass on strided logits keeps memory alive for backward that grows with them: "
            f"{found.describe('the logits')}. Keep only per-row statistics (max, log-sum-exp) and recompute in "
            "backward.")

    # ------------------------------------------------------ temperature, ignore
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("temperature", [0.5, 2.0, 0.05])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_temperature(self, lp: Harness, op: str, temperature: float) -> None:
        lp.require(op, vocab=900)
        x = lp.logits((4, 5, 900))
        y = lp.labels((4, 5), 900)
        got = lp.call(op, x, y, temperature=temperature)
        want = lp.reference(op, x, y, temperature=temperature)
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x, temperature))):
            assert_close(g, w, tol, f"{op} output {i} at temperature {temperature}")

    @covers(LABEL_OPS)
    @pytest.mark.parametrize("case", list(IGNORE))
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_ignore_index(self, lp: Harness, op: str, case: str) -> None:
        """Ignored positions give exactly 0 and their label is never read as an index (it may lie
        outside the vocabulary); the entropy there is computed as usual."""
        vocab = 500
        lp.require(op, vocab=vocab)
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
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_extreme_magnitudes(self, lp: Harness, op: str, dtype: str) -> None:
        """Logits of +-1e4 next to ordinary ones: no overflow, no loss beyond fp32 rounding of 1e4."""
        lp.require(op, DTYPES[dtype], vocab=300)
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

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_negative_infinity(self, lp: Harness, op: str) -> None:
        """Masked vocabulary (-inf): a label on -inf gives -inf, entropy counts 0 * log 0 as 0."""
        lp.require(op, vocab=64)
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

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_nan_propagates(self, lp: Harness, op: str) -> None:
        """A NaN logit makes its own row NaN and no other."""
        lp.require(op, vocab=100)
        x = lp.logits((4, 100))
        y = lp.labels((4,), 100)
        y[0], y[1] = 3, 4
        x[0, 50] = math.nan  # not the label
        x[1, 4] = math.nan  # the label
        got, want = lp.call(op, x, y), lp.reference(op, x, y)
        for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x[2:]))):
            assert bool(torch.isnan(g[:2]).all()), (
                f"{op} output {i}: rows with a NaN logit give {g[:2].tolist()}, expected NaN")
            assert_close(g, w, tol, f"{op} output {i} with NaN in other rows")

    # --------------------------------------------------------------- gradients
    @covers(LOGITS_OPS, grad=True)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("case", ["plain", "temperature", "ignore-index", "negative-infinity"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_gradients(self, lp: Harness, op: str, case: str, dtype: str) -> None:
        """Gradients of the logits against float64 autograd, with random upstream gradients on every
        output (both outputs of logprobs_and_entropy); zero at ignored positions."""
        lp.require(op, DTYPES[dtype], grad=True, vocab=300)
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
        leaf = _compare_gradients(lp, op, x0, y, temperature, ignore, f"{op}, {case}, {dtype}", mask)
        if case == "negative-infinity":
            masked = leaf.grad[..., 250:]
            assert bool((masked == 0).all()), (
                f"{op}, {dtype}: the gradient at -inf logits (probability exactly 0) is "
                f"{masked[masked != 0][:3].tolist()}, expected exactly 0")

    @covers("logprobs_and_entropy", grad=True)
    @pytest.mark.parametrize("output", ["logprobs", "entropy"])
    def test_gradient_of_one_output(self, lp: Harness, output: str) -> None:
        """Only one output of ``logprobs_and_entropy`` enters the loss (backward receives no
        gradient for the other): the gradient is that output's alone."""
        op = "logprobs_and_entropy"
        lp.require(op, torch.float32, grad=True, vocab=300)
        x0 = lp.logits((3, 5, 300))
        y = lp.labels((3, 5), 300)
        mask = torch.zeros(3, 5, dtype=torch.bool, device=lp.device)
        mask[0, 1] = True
        y = y.masked_fill(mask, -100)
        used = ("logprobs", "entropy").index(output)
        _compare_gradients(lp, op, x0, y, 0.8, -100, f"{op} with only its {output} in the loss", mask, used=used)

    @covers(LOGITS_OPS, grad=True)
    @pytest.mark.parametrize("shape", GRADIENT_SHAPES)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_gradients_of_shapes(self, lp: Harness, op: str, shape: str) -> None:
        """Gradients of 1-D logits with a 0-d label, of empty leading dims (an empty gradient: the
        result is still connected to the logits, so that a training step's backward runs), of
        V = 1 (a zero gradient) and of an odd V."""
        dims = SHAPES[shape]
        lp.require(op, torch.float32, grad=True, vocab=dims[-1])
        x0 = lp.logits(dims)
        y = lp.labels(dims[:-1], dims[-1])
        mask = torch.zeros(dims[:-1], dtype=torch.bool, device=lp.device)
        _compare_gradients(lp, op, x0, y, 0.9, None, f"{op}, {shape} logits {dims}", mask)

    @covers(LOGITS_OPS, grad=True)
    @pytest.mark.parametrize("layout", STRIDED)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_gradients_strided(self, lp: Harness, op: str, layout: str) -> None:
        """Gradients through the layouts of test_strided_leading_dims (out of place): the logits
        are a view of a leaf, whose gradient autograd assembles (summed over a broadcast batch)."""
        lp.require(op, torch.float32, grad=True, vocab=640)
        full = lp.logits((3, 9, 640))
        labels = lp.labels((3, 9), 640)
        labels[1, 2] = -100
        kw = dict(temperature=0.8) if op == "entropy" else dict(temperature=0.8, ignore_index=-100)
        leaf = full.clone().requires_grad_(True)
        x, y = _strided(leaf, labels, layout)
        outs = lp.call(op, x, y, **kw)
        ups = upstream(outs, 5)
        weighted_sum(outs, ups).backward()
        ref_leaf = full.detach().cpu().double().requires_grad_(True)
        rx, ry = _strided(ref_leaf, labels.cpu(), layout)
        weighted_sum(lp.reference(op, rx, ry, **kw), ups).backward()
        copies = 4 if layout == "broadcast" else 1  # the gradient of a broadcast row sums its copies'
        atol = copies * 4 * max(tolerances(op, x, 0.8)) * _largest(ups) / 0.8
        assert leaf.grad is not None, f"{op}: no gradient reached the logits through the {layout} view"
        assert_close(leaf.grad, ref_leaf.grad, atol, f"{op}: gradient through {layout} logits of strides {x.stride()}",
                     rtol=4 * EPS32)

    @covers(LABEL_OPS, capability="inplace_backward", grad=True)
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_inplace_backward(self, lp: Harness, op: str) -> None:
        """``inplace_backward=True``: the gradient is right; a backend that declares
        ``inplace_backward`` writes it into the logits' storage, any other honours the flag out of place."""
        lp.require(op, torch.float32, grad=True, vocab=400)
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

    @covers(LABEL_OPS, capability="inplace_backward", grad=True)
    @pytest.mark.parametrize("layout", ["view-of-non-leaf", "leaf-view", "broadcast"])
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_inplace_backward_strided(self, lp: Harness, op: str, layout: str) -> None:
        """``inplace_backward=True`` on strided ``logits[:, :-1]``, a slice of an lm_head's output
        (``view-of-non-leaf``) or a leaf that is a view of a larger tensor (``leaf-view``): the
        gradient is right and the rows outside the view keep their values; a backend that declares
        ``inplace_backward`` writes the gradient through the view's strides. On a ``broadcast``
        batch (stride 0: one row's memory stands for several rows, so no gradient fits in it) the
        flag is honoured out of place: the gradient, summed over the copies, is right."""
        lp.require(op, torch.float32, grad=True, vocab=450)
        base = lp.logits((3, 8, 450))
        y = lp.labels((3, 8), 450)[:, 1:]
        kw = dict(temperature=0.8, ignore_index=-100)
        if layout == "broadcast":
            storage = base[:1].clone().requires_grad_(True) * 1.0  # one row of an lm_head's output
            logits = storage.expand(3, -1, -1)[:, :-1]
        elif layout == "view-of-non-leaf":
            storage = base.clone().requires_grad_(True) * 1.0
            logits = storage[:, :-1]
        else:
            storage = base.clone()
            logits = storage[:, :-1].detach().requires_grad_(True)  # shares storage's memory
        assert not logits.is_contiguous()
        outs = lp.call(op, logits, y, inplace_backward=True, **kw)
        ups = upstream(outs, 5)
        what = f"{op}, inplace_backward=True on {layout} logits of strides {logits.stride()}"
        if layout == "broadcast":
            (grad,) = torch.autograd.grad(weighted_sum(outs, ups), storage)
            ref_storage = base[:1].detach().cpu().double().requires_grad_(True)
            weighted_sum(lp.reference(op, ref_storage.expand(3, -1, -1)[:, :-1], y, **kw), ups).backward()
            atol = 3 * 4 * max(tolerances(op, base, 0.8)) * _largest(ups) / 0.8  # a sum over 3 copies
            assert_close(grad, ref_storage.grad, atol, f"{what}: gradient, summed over the copies", rtol=4 * EPS32)
            return
        (grad,) = torch.autograd.grad(weighted_sum(outs, ups), logits)
        ref_x = base[:, :-1].detach().cpu().double().requires_grad_(True)
        weighted_sum(lp.reference(op, ref_x, y, **kw), ups).backward()
        atol = 4 * max(tolerances(op, base, 0.8)) * _largest(ups) / 0.8
        assert_close(grad, ref_x.grad, atol, f"{what}: gradient", rtol=4 * EPS32)
        assert torch.equal(storage.detach()[:, -1], base[:, -1]), f"{what}: the rows outside the view changed"
        if lp.backend.inplace_backward:
            assert_close(storage.detach()[:, :-1], ref_x.grad, atol,
                         f"{what}: {lp.name} declares inplace_backward=True, so the view must hold the "
                         "gradient after backward, written through its strides", rtol=4 * EPS32)

    # ------------------------------------------------------------ second order, autocast
    @covers(LOGITS_OPS, grad=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_double_backward(self, lp: Harness, op: str) -> None:
        """``create_graph=True`` (a Hessian-vector product): the gradient of the gradient is that of
        float64 autograd of the reference, or backward refuses with an error. What fails is a
        gradient that silently lacks its second-order term (a backward that ignores grad mode, as
        ``once_differentiable`` does when the upstream gradient needs none): the loss also has a
        term of its own, as a training loss would, so a missing term shows as a wrong product."""
        lp.require(op, torch.float32, grad=True, vocab=300)
        x0 = lp.logits((3, 5, 300))
        y = lp.labels((3, 5), 300)
        y[1, 2] = -100
        kw = dict(temperature=0.8) if op == "entropy" else dict(temperature=0.8, ignore_index=-100)
        v = lp.logits((3, 5, 300), seed=7, scale=1.0)

        def hessian_vector_product(leaf, outs, ups):
            loss = weighted_sum(outs, ups) + 0.5 * (leaf * leaf).sum()
            (g,) = torch.autograd.grad(loss, leaf, create_graph=True)
            return torch.autograd.grad((g * v.to(g.device, g.dtype)).sum(), leaf)[0]

        leaf = x0.clone().requires_grad_(True)
        outs = lp.call(op, leaf, y, **kw)
        ups = upstream(outs, 5)
        try:
            got = hessian_vector_product(leaf, outs, ups)
        except RuntimeError as exc:  # refusing is allowed; what fails is a wrong result
            assert str(exc).strip(), f"{op}: double backward raised {type(exc).__name__} without a message"
            return
        ref_x = x0.detach().cpu().double().requires_grad_(True)
        want = hessian_vector_product(ref_x, lp.reference(op, ref_x, y, **kw), ups)
        atol = 16 * max(tolerances(op, x0, 0.8)) * _largest(ups) * _largest([v]) / 0.8 ** 2
        assert_close(got, want, atol,
                     f"{op}: Hessian-vector product through create_graph=True (a wrong product means the "
                     "second-order term was dropped: run a differentiable backward when torch.is_grad_enabled(), "
                     "or raise there)", rtol=4 * EPS32)

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("where", ["forward-and-backward", "forward-only"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_autocast(self, lp: Harness, op: str, where: str) -> None:
        """Under ``torch.autocast`` (bf16, or fp16 where the device lacks bf16) the float32 logits'
        results and, where the backend declares autograd, gradients are those without autocast,
        within the contract: with the backward inside the autocast region and outside it."""
        lp.require(op, vocab=700)
        x0 = lp.logits((3, 5, 700))
        y = lp.labels((3, 5), 700)
        y[0, 1] = -100
        kw = dict(temperature=0.9) if op == "entropy" else dict(temperature=0.9, ignore_index=-100)
        leaf = x0.clone().requires_grad_(lp.backend.autograd)
        with autocast(lp):
            outs = lp.call(op, leaf, y, **kw)
            ups = upstream(outs, 5)
            if lp.backend.autograd and where == "forward-and-backward":
                weighted_sum(outs, ups).backward()
        if lp.backend.autograd and where == "forward-only":
            weighted_sum(outs, ups).backward()
        ref_x = x0.detach().cpu().double().requires_grad_(True)
        refs = lp.reference(op, ref_x, y, **kw)
        for i, (g, w, tol) in enumerate(zip(outs, refs, tolerances(op, x0, 0.9))):
            assert g.dtype == torch.float32, f"{op} output {i} under autocast is {g.dtype}, expected float32"
            assert_close(g, w, tol, f"{op} output {i} under autocast ({where})")
        if lp.backend.autograd:
            weighted_sum(refs, ups).backward()
            atol = 4 * max(tolerances(op, x0, 0.9)) * _largest(ups) / 0.9
            assert leaf.grad is not None and leaf.grad.dtype == torch.float32, (
                f"{op}: the gradient under autocast ({where}) is {None if leaf.grad is None else leaf.grad.dtype}, "
                "expected float32")
            assert_close(leaf.grad, ref_x.grad, atol, f"{op}: gradient under autocast ({where})", rtol=4 * EPS32)

    # ------------------------------------------------------------- invariances
    @covers(LOGITS_OPS, capability="deterministic", declared=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_deterministic(self, lp: Harness, op: str) -> None:
        """Same inputs, same backend: bitwise the same results and gradients (float32, and bfloat16
        where the backend accepts it)."""
        lp.require(op, vocab=3000)
        lp.require_capability("deterministic", "bitwise reproducibility")
        for dtype in _accepted(lp, (torch.float32, torch.bfloat16)):
            x = lp.logits((4, 9, 3000), dtype)
            y = lp.labels((4, 9), 3000)
            y[0, 0] = -100
            kw = dict(temperature=0.9) if op == "entropy" else dict(temperature=0.9, ignore_index=-100)
            first, second = lp.call(op, x, y, **kw), lp.call(op, x, y, **kw)
            for i, (a, b) in enumerate(zip(first, second)):
                assert torch.equal(a, b), f"{op} output {i} ({dtype} logits) differs between two identical calls"
            if lp.backend.autograd:
                grads = []
                for _ in range(2):
                    leaf = x.clone().requires_grad_(True)
                    sum(o.sum() for o in lp.call(op, leaf, y, **kw)).backward()
                    grads.append(leaf.grad)
                assert torch.equal(grads[0], grads[1]), (
                    f"{op} gradient ({dtype} logits) differs between two identical calls")

    @covers(LOGITS_OPS, capability="batch_invariant", declared=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_batch_invariant(self, lp: Harness, op: str) -> None:
        """A row's result is bitwise the same alone, in a sub-batch, in the whole batch and under
        another leading shape."""
        lp.require(op, vocab=2000)
        lp.require_capability("batch_invariant", "batch invariance")
        x = lp.logits((12, 2000))
        y = lp.labels((12,), 2000)
        whole = lp.call(op, x, y)
        views = {"row 0 alone": slice(0, 1), "row 11 alone": slice(11, 12), "rows 3..7": slice(3, 8)}
        for what, rows in views.items():
            for i, (part, full) in enumerate(zip(lp.call(op, x[rows], y[rows]), whole)):
                assert torch.equal(part, full[rows]), (
                    f"{op} output {i}: {what} differs from the same rows in a batch of 12")
        for i, (shaped, full) in enumerate(zip(lp.call(op, x.view(3, 4, 2000), y.view(3, 4)), whole)):
            assert torch.equal(shaped.reshape(-1), full), f"{op} output {i}: a (3, 4, V) batch differs from (12, V)"

    @covers(LOGITS_OPS, capability="batch_invariant", declared=True, grad=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_batch_invariant_gradients(self, lp: Harness, op: str) -> None:
        """A row's gradient is bitwise the same alone, in a sub-batch and in the whole batch."""
        lp.require(op, torch.float32, grad=True, vocab=50257)
        lp.require_capability("batch_invariant", "batch invariance")
        x = lp.logits((7, 50257), scale=4.0)
        y = lp.labels((7,), 50257)
        ups = upstream(lp.call(op, x, y), 5)

        def gradient(rows: slice) -> torch.Tensor:
            leaf = x[rows].clone().requires_grad_(True)
            weighted_sum(lp.call(op, leaf, y[rows]), [u[rows] for u in ups]).backward()
            return leaf.grad

        whole = gradient(slice(0, 7))
        for what, rows in {"row 0 alone": slice(0, 1), "row 6 alone": slice(6, 7), "rows 2..5": slice(2, 6)}.items():
            assert torch.equal(gradient(rows), whole[rows]), (
                f"{op}: the gradient of {what} differs from that of the same rows in a batch of 7")

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_inputs_unmodified(self, lp: Harness, op: str) -> None:
        """Forward and backward (without inplace_backward) leave logits and labels as they were
        (float32, and bfloat16 where the backend accepts it)."""
        lp.require(op, vocab=500)
        for dtype in _accepted(lp, (torch.float32, torch.bfloat16)):
            base = lp.logits((3, 7, 500), dtype)
            y = lp.labels((3, 7), 500)
            y[1, :2] = -100
            kw = dict(temperature=0.7) if op == "entropy" else dict(temperature=0.7, ignore_index=-100)
            x = base.clone()
            x_before, y_before = x.clone(), y.clone()
            with torch.no_grad():
                lp.call(op, x, y, **kw)
            assert torch.equal(x, x_before), f"{op} (no gradients) modified the {dtype} logits"
            assert torch.equal(y, y_before), f"{op} (no gradients) modified the labels"
            if lp.backend.autograd:
                leaf = base.clone().requires_grad_(True)
                logits = leaf * 1.0
                sum(o.sum() for o in lp.call(op, logits, y, **kw)).backward()
                assert torch.equal(logits.detach(), x_before), f"{op} forward or backward modified the {dtype} logits"
                assert torch.equal(y, y_before), f"{op} forward or backward modified the labels"

    # ------------------------------------------------------------ torch.func transforms
    @covers(LOGITS_OPS, grad=True, features=("functorch",))
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_functorch_transforms(self, lp: Harness, op: str) -> None:
        """A backend that declares the ``functorch`` feature works inside ``torch.func``: the
        gradient from ``torch.func.grad`` against float64 autograd, and ``torch.func.vmap`` over
        the batch against the batched call."""
        lp.require(op, torch.float32, grad=True, features=("functorch",), vocab=200)
        x = lp.logits((4, 5, 200))
        y = lp.labels((4, 5), 200)
        y[1, 2] = -100
        kw = dict(temperature=0.7) if op == "entropy" else dict(temperature=0.7, ignore_index=-100)
        got = torch.func.grad(lambda t: sum(o.sum() for o in lp.call(op, t, y, **kw)))(x)
        ref_x = x.detach().cpu().double().requires_grad_(True)
        sum(r.sum() for r in lp.reference(op, ref_x, y, **kw)).backward()
        tols = tolerances(op, x, 0.7)
        assert_close(got, ref_x.grad, 4 * max(tols) / 0.7, f"{op}: gradient from torch.func.grad", rtol=4 * EPS32)
        if op == "entropy":
            batched = torch.func.vmap(lambda t: lp.call(op, t, **kw))(x)
        else:
            batched = torch.func.vmap(lambda t, labels: lp.call(op, t, labels, **kw))(x, y)
        for i, (b, whole, tol) in enumerate(zip(batched, lp.call(op, x, y, **kw), tols)):
            assert_close(b, whole.double(), 2 * tol, f"{op} output {i} under torch.func.vmap against the batched call")

    # ---------------------------------------------------------------- bad input
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("case", [
        "label-out-of-range", "negative-label", "shape-mismatch", "integer-logits",
        "non-positive-temperature", "different-devices",
    ])
    def test_bad_input_errors(self, lp: Harness, case: str) -> None:
        """Bad input raises a clear error before dispatch, naming what is wrong."""
        op = lp.first_op(LABEL_OPS if case != "integer-logits" and case != "non-positive-temperature" else LOGITS_OPS)
        lp.require(op, vocab=50)
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


# ------------------------------------------------------------------------------- helpers
def _strided(full: torch.Tensor, labels: torch.Tensor, layout: str) -> tuple:
    """Views of (3, 9, V) logits and their labels in one of the layouts of :data:`STRIDED`:
    ``logits[:, :-1]`` with ``labels[:, 1:]``, transposed, every other row, a broadcast batch."""
    if layout == "shifted":
        return full[:, :-1], labels[:, 1:]
    if layout == "transposed":
        return full.transpose(0, 1), labels.transpose(0, 1)
    if layout == "every-other-row":
        return full[:, ::2], labels[:, ::2]
    return full[:1].expand(4, *full.shape[1:]), labels[:1].expand(4, *labels.shape[1:])


def _largest(tensors: Sequence[torch.Tensor]) -> float:
    return max((float(t.abs().max()) for t in tensors if t.numel()), default=1.0)


def _compare_gradients(lp: Harness, op: str, x0: torch.Tensor, y: torch.Tensor, temperature: float,
                       ignore: Optional[int], what: str, mask: torch.Tensor,
                       used: Optional[int] = None) -> torch.Tensor:
    """The gradient of ``sum(output * random upstream)`` (over output ``used`` only, if given)
    against float64 autograd of the reference, zero at ignored positions; returns the leaf."""
    leaf = x0.clone().requires_grad_(True)
    kw = dict(temperature=temperature) if op == "entropy" else dict(temperature=temperature, ignore_index=ignore)
    outs = lp.call(op, leaf, y, **kw)
    ups = upstream(outs, 5)
    chosen = list(range(len(outs))) if used is None else [used]
    loss = weighted_sum([outs[i] for i in chosen], [ups[i] for i in chosen])
    assert isinstance(loss, torch.Tensor) and loss.requires_grad, (
        f"{what}: the outputs are not connected to the logits (no grad_fn), so backward cannot run")
    loss.backward()
    ref_x = x0.detach().cpu().double().requires_grad_(True)
    refs = lp.reference(op, ref_x, y, **kw)
    weighted_sum([refs[i] for i in chosen], [ups[i] for i in chosen]).backward()
    assert leaf.grad is not None, f"{what}: no gradient reached the logits"
    assert leaf.grad.dtype == x0.dtype, f"{what}: gradient is {leaf.grad.dtype}, expected {x0.dtype}"
    atol = 4 * max(tolerances(op, x0, temperature)) * _largest(ups) / temperature
    assert_close(leaf.grad, ref_x.grad, atol, f"{what}: gradient", rtol=gradient_rounding(x0.dtype))
    if op == "logprobs" and bool(mask.any()):
        assert bool((leaf.grad[mask] == 0).all()), f"{what}: the gradient at ignored positions is not zero"
    return leaf

