"""The conformance section of the fused op ``logprobs_from_hidden``: the log-probabilities (and
entropy) of ``hidden @ weight.T + bias`` without forming the logits.

Values and the gradients of hidden, weight and bias are compared with float64 autograd of the
reference (:func:`check_hidden`), within the tolerances derived for the fused op in
:mod:`logprob_registry.numerics` (:func:`~logprob_registry.numerics.hidden_tolerances`).
A project can run :func:`check_hidden` on its own cases too (``tests/test_chunked_hidden.py``
does, for chunked's tile budgets).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional, Sequence

import pytest
import torch

from logprob_registry import reference as ref
from logprob_registry.numerics import (
    EPS32,
    assert_close,
    gradient_rounding,
    hidden_tolerances,
    logits_gradient_scale,
    subnormal_spacing,
)

from ..harness import DTYPES, Harness
from ._common import MEMORY_LIMIT, autocast, growth, require_no_copy, same_strides_leaf, upstream, weighted_sum
from ._coverage import covers

OP = "logprobs_from_hidden"
INPUTS = ("hidden", "weight", "bias")
VARIANTS = ["plain", "bias", "entropy", "temperature-ignore-index", "all-options", "in-range-ignore-index"]
SHAPES = ["1d", "empty", "strided", "3d", "vocab-1", "int32-labels-ignore-last"]
LAYOUTS = ["shifted-hidden", "weight-column-slice", "transposed-weight", "strided-rows-weight-and-bias"]
SPECIAL = ["masked-vocabulary", "nan", "large-magnitudes"]
VOCAB = 97  # the weight's rows in _inputs unless a test asks for others
VARIANT_VOCAB = 700  # those of the cases of _variant
SHAPE_VOCAB = {"1d": 300, "empty": 300, "strided": 300, "3d": VOCAB, "vocab-1": 1, "int32-labels-ignore-last": 300}


def check_hidden(lp: Harness, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 labels: torch.Tensor, *, grads: bool = True, used: Optional[int] = None,
                 grad_of: Sequence[str] = INPUTS, seed: int = 11, what: str = OP,
                 forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
                 upstreams: Optional[Sequence[torch.Tensor]] = None, **options) -> None:
    """``logprobs_from_hidden`` of ``lp``'s backend against float64 autograd of the reference:
    the outputs (dtype, device, shape, values), and, when ``grads`` and the backend declares
    autograd, the gradients of the inputs named in ``grad_of`` (the others need none) under random
    upstream gradients on every output (on output ``used`` only, if given: backward then receives
    no gradient for the other). ``options``: ``temperature``, ``ignore_index``,
    ``return_entropy``. Leaves keep the inputs' strides (gaps included), so a strided input is a
    strided leaf. ``forward_context()`` is entered around the call alone (``torch.autocast``, say).
    ``upstreams``: the float64 upstream gradients of the outputs (default: random, unit scale)."""
    grads = grads and lp.backend.autograd
    dtype = hidden.dtype
    temperature = options.get("temperature", 1.0)
    given = dict(zip(INPUTS, (hidden, weight, bias)))
    wanted = [n for n in INPUTS if n in grad_of and given[n] is not None] if grads else []
    leaves = {n: None if t is None else same_strides_leaf(t, n in wanted) for n, t in given.items()}
    refs = {n: None if t is None else t.detach().cpu().double().requires_grad_(n in wanted) for n, t in given.items()}
    with forward_context():
        got = lp.call_hidden(leaves["hidden"], leaves["weight"], labels, bias=leaves["bias"], **options)
    want = lp.reference_hidden(refs["hidden"], refs["weight"], labels, bias=refs["bias"], **options)
    tols = hidden_tolerances(hidden, weight, bias, temperature)
    for i, (g, r, tol) in enumerate(zip(got, want, tols)):
        assert g.dtype == lp.result_dtype(dtype), f"{what}: output {i} is {g.dtype}, expected {lp.result_dtype(dtype)}"
        assert g.device.type == lp.device.type, f"{what}: output {i} is on {g.device}, expected {lp.device}"
        assert_close(g, r, tol, f"{what}: output {i}")
    if not wanted:
        return
    chosen = list(range(len(want))) if used is None else [used]
    ups = list(upstreams) if upstreams is not None else upstream(want, seed)
    ups, skip = [ups[i] for i in chosen], [torch.isinf(want[i].detach()) for i in chosen]  # -inf: no gradient
    loss = weighted_sum([got[i] for i in chosen], ups, skip)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad, (
        f"{what}: the outputs are not connected to {', '.join(wanted)} (no grad_fn), so backward cannot run")
    got_grads = torch.autograd.grad(loss, [leaves[n] for n in wanted])
    want_grads = torch.autograd.grad(weighted_sum([want[i] for i in chosen], ups, skip), [refs[n] for n in wanted])
    rel = 4 * max(tols)
    bounds = _gradient_bounds(refs, labels, chosen, ups, skip, rel, 2 * gradient_rounding(dtype), options)
    floor = subnormal_spacing(dtype)
    for name, g, w in zip(wanted, got_grads, want_grads):
        leaf = leaves[name]
        assert g is not None, f"{what}: no gradient reached {name}"
        assert g.dtype == dtype and tuple(g.shape) == tuple(leaf.shape), (
            f"{what}: the gradient of {name} is {g.dtype} {tuple(g.shape)}, expected {dtype} {tuple(leaf.shape)}")
        g = g.detach().to("cpu", torch.float64)
        assert bool(torch.isfinite(g).all()), f"{what}: the gradient of {name} has NaN or infinite elements"
        excess = (g - w).abs() - (bounds[name] + floor)
        if excess.numel() and float(excess.max()) > 0:
            at = tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
            raise AssertionError(
                f"{what}: the gradient of {name} is off by {float((g - w).abs()[at]):.3g} at {at} (got "
                f"{float(g[at])!r}, expected {float(w[at])!r}), more than the {float(bounds[name][at]):.3g} that "
                "float32 arithmetic allows; the contract is float32 accuracy, see logprob_registry.numerics")


def _gradient_bounds(refs: dict, labels, chosen, ups, skip, rel: float, rounding: float, options) -> dict:
    """The error allowed on each element of the gradients of hidden, weight and bias
    (:mod:`~logprob_registry.numerics`, "The fused op"): ``C = rel * (|g| + G) + rounding
    * |g|`` per logit, with ``g`` the logits' exact gradient and ``G`` its error scale, summed over
    the terms of each element: ``C @ |weight|``, ``C.T @ |hidden|``, ``sum C``."""
    h, w, b = (None if refs[n] is None else refs[n].detach() for n in INPUTS)
    z = ref.hidden_logits(h, w, b).requires_grad_(True)
    temperature, ignore_index = options.get("temperature", 1.0), options.get("ignore_index")
    op = "logprobs_and_entropy" if options.get("return_entropy") else "logprobs"
    outs = Harness.reference(op, z, labels, temperature=temperature, ignore_index=ignore_index)
    (g,) = torch.autograd.grad(weighted_sum([outs[i] for i in chosen], ups, skip), z)
    up = {i: u.masked_fill(s, 0.0) for i, u, s in zip(chosen, ups, skip)}
    up_lp = up.get(0)
    if up_lp is not None and ignore_index is not None:
        up_lp = up_lp.masked_fill(labels.cpu() == ignore_index, 0.0)
    scale = logits_gradient_scale(z, temperature, up_lp, up.get(1))
    c = (rel * (g.abs() + scale) + rounding * g.abs()).reshape(-1, w.shape[0])
    return {"hidden": (c @ w.abs()).reshape(h.shape), "weight": c.T @ h.abs().reshape(-1, w.shape[1]), "bias": c.sum(0)}


def _inputs(lp: Harness, lead, h: int = 24, v: int = VOCAB, dtype: torch.dtype = torch.float32, bias: bool = True,
            seed: int = 0):
    """hidden (*lead, h), weight (v, h) (logits of a few units), bias (v,) or None, labels (*lead)."""
    hidden = lp.logits(tuple(lead) + (h,), dtype, scale=2.0, seed=seed)
    weight = lp.logits((v, h), dtype, scale=3.0 / math.sqrt(h), seed=seed + 1)
    b = lp.logits((v,), dtype, scale=1.0, seed=seed + 2) if bias else None
    return hidden, weight, b, lp.labels(tuple(lead), v, seed=seed + 3)


class HiddenSection:
    """Tests of ``logprobs_from_hidden`` (a mixin of
    :class:`~logprob_registry.testing.BackendConformance`, which provides the ``lp`` fixture)."""

    # ------------------------------------------------------------- values, gradients
    @covers(OP)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_hidden_values(self, lp: Harness, variant: str, dtype: str) -> None:
        """logprobs_from_hidden against float64 ``hidden @ weight.T + bias``."""
        lp.require(OP, DTYPES[dtype], vocab=VARIANT_VOCAB)
        h, w, b, y, kw = _variant(lp, variant, DTYPES[dtype])
        check_hidden(lp, h, w, b, y, grads=False, what=f"{OP} {variant} {dtype}", **kw)

    @covers(OP, grad=True)
    @pytest.mark.parametrize("dtype", list(DTYPES))
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_hidden_gradients(self, lp: Harness, variant: str, dtype: str) -> None:
        """Gradients of hidden, weight and bias against float64 autograd, every output in the loss."""
        lp.require(OP, DTYPES[dtype], grad=True, vocab=VARIANT_VOCAB)
        h, w, b, y, kw = _variant(lp, variant, DTYPES[dtype])
        check_hidden(lp, h, w, b, y, what=f"{OP} {variant} {dtype}", **kw)

    @covers(OP, grad=True)
    @pytest.mark.parametrize("output", ["logprobs", "entropy"])
    def test_hidden_gradient_of_one_output(self, lp: Harness, output: str) -> None:
        """Only one of the two outputs enters the loss (backward receives no gradient for the
        other): the gradients are that output's alone."""
        lp.require(OP, torch.float32, grad=True, vocab=VOCAB)
        h, w, b, y = _inputs(lp, (37,))
        check_hidden(lp, h, w, b, y, used=("logprobs", "entropy").index(output), return_entropy=True,
                     ignore_index=3, what=f"{OP} with only its {output} in the loss")

    @covers(OP, grad=True)
    def test_hidden_gradients_of_some_inputs(self, lp: Harness) -> None:
        """Only the weight requires a gradient: it gets the right one; under ``torch.no_grad()``
        the result has no ``grad_fn``."""
        lp.require(OP, torch.float32, grad=True, vocab=VOCAB)
        h, w, b, y = _inputs(lp, (37,))
        check_hidden(lp, h, w, b, y, grad_of=("weight",), what=f"{OP} with only the weight requiring a gradient")
        weight = w.clone().requires_grad_(True)
        with torch.no_grad():
            out = lp.call_hidden(h, weight, y, bias=b)[0]
        assert out.grad_fn is None and not out.requires_grad, (
            f"{OP} under torch.no_grad() returned a result with a grad_fn")

    @covers(OP, grad=True)
    def test_hidden_tied_embeddings(self, lp: Harness) -> None:
        """The lm_head is the embedding matrix: its gradient sums the embedding's and the head's."""
        v, h, n = 50, 16, 23
        lp.require(OP, torch.float32, grad=True, vocab=v)
        table = lp.logits((v, h), scale=1.0, seed=3)
        ids = lp.labels((n,), v, seed=4)
        labels = lp.labels((n,), v, seed=5)
        proj = lp.logits((h, h), scale=1.0 / math.sqrt(h), seed=6)

        def hidden_of(emb):
            return torch.tanh(emb[ids] @ proj.to(emb.dtype)) * 3

        emb = table.clone().requires_grad_(True)
        hidden = hidden_of(emb)
        got = lp.call_hidden(hidden, emb, labels)[0]
        (grad,) = torch.autograd.grad(got.sum(), emb)
        emb64 = table.detach().cpu().double().requires_grad_(True)
        proj64, ids64 = proj.cpu().double(), ids.cpu()
        want = ref.logprobs_from_hidden(torch.tanh(emb64[ids64] @ proj64) * 3, emb64, labels.cpu())
        (grad64,) = torch.autograd.grad(want.sum(), emb64)
        tol = max(hidden_tolerances(hidden, emb, None))
        assert_close(got, want, tol, f"{OP} with tied embeddings: logprobs")
        assert_close(grad, grad64, 4 * tol * max(float(grad64.abs().max()), 1.0),
                     f"{OP} with tied embeddings: gradient of the shared matrix", rtol=gradient_rounding(torch.float32))

    @covers(OP, grad=True)
    def test_hidden_double_backward(self, lp: Harness) -> None:
        """``create_graph=True``: the gradient of ``sum(grad * grad)`` with respect to hidden, weight
        and bias (a second-order quantity, as a gradient penalty is) is that of float64 autograd of
        the reference, or backward refuses with an error; a gradient that silently lacks its
        second-order term fails."""
        lp.require(OP, torch.float32, grad=True, vocab=120)
        h, w, b, y = _inputs(lp, (2, 7), v=120)
        y[0, 3] = -100
        kw = dict(temperature=0.8, ignore_index=-100, return_entropy=True)

        def second_order(tensors, call):
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            logp, ent = call(*leaves)
            ups = upstream((logp, ent), 11)
            loss = weighted_sum((logp, ent), ups) + 0.5 * sum((t * t).sum() for t in leaves)
            grads = torch.autograd.grad(loss, leaves, create_graph=True)
            return torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)

        try:
            got = second_order((h, w, b), lambda hh, ww, bb: lp.call_hidden(hh, ww, y, bias=bb, **kw))
        except RuntimeError as exc:  # refusing is allowed; what fails is a wrong result
            assert str(exc).strip(), f"{OP}: double backward raised {type(exc).__name__} without a message"
            return
        want = second_order([t.detach().cpu().double() for t in (h, w, b)],
                            lambda hh, ww, bb: lp.reference_hidden(hh, ww, y, bias=bb, **kw))
        tol = 16 * max(hidden_tolerances(h, w, b, 0.8)) / 0.8 ** 2
        for name, g, r in zip(INPUTS, got, want):
            assert_close(g, r, tol * max(float(r.abs().max()), 1.0),
                         f"{OP}: second-order gradient of {name} through create_graph=True (a wrong value means "
                         "the second-order term was dropped: run a differentiable backward when "
                         "torch.is_grad_enabled(), or raise there)", rtol=4 * EPS32)

    @covers(OP)
    @pytest.mark.parametrize("where", ["forward-and-backward", "forward-only"])
    def test_hidden_autocast(self, lp: Harness, where: str) -> None:
        """Under ``torch.autocast`` (bf16, or fp16 where the device lacks bf16), float32 hidden,
        weight and bias give the results and (where the backend declares autograd) gradients of
        float32 products, as without autocast, with the backward inside the autocast region and
        outside it: autocast must not turn the fused op's products into bf16 ones."""
        lp.require(OP, vocab=500)
        h, w, b, y = _inputs(lp, (3, 6), h=64, v=500)
        y[1, 1] = -100
        kw = dict(temperature=0.8, ignore_index=-100, return_entropy=True)
        what = f"{OP} under autocast ({where})"
        if where == "forward-and-backward":
            with autocast(lp):
                check_hidden(lp, h, w, b, y, what=what, **kw)
        else:
            check_hidden(lp, h, w, b, y, what=what, forward_context=lambda: autocast(lp), **kw)

    # ------------------------------------------------------------------ shapes, layouts
    @covers(OP)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_hidden_shapes(self, lp: Harness, shape: str) -> None:
        """1-D hidden with a 0-d label, empty, strided and 3-D leading dims, V = 1, int32 labels
        with the last vocabulary entry as ignore_index; with and without the entropy."""
        lp.require(OP, vocab=SHAPE_VOCAB[shape])
        h, w, b, y, kw = _shape_case(lp, shape)
        for ret in (False, True):
            check_hidden(lp, h, w, b, y, grads=False, return_entropy=ret, what=f"{OP}, {shape} hidden", **kw)

    @covers(OP, grad=True)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_hidden_gradients_of_shapes(self, lp: Harness, shape: str) -> None:
        """The gradients of the cases of test_hidden_shapes (an empty batch: empty gradients, the
        result still connected to hidden and weight)."""
        lp.require(OP, torch.float32, grad=True, vocab=SHAPE_VOCAB[shape])
        h, w, b, y, kw = _shape_case(lp, shape)
        check_hidden(lp, h, w, b, y, return_entropy=True, what=f"{OP}, {shape} hidden", **kw)

    @covers(OP)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_hidden_layouts(self, lp: Harness, layout: str) -> None:
        """Non-contiguous inputs, read as they are: ``hidden[:, :-1]``, a weight that is a column
        slice of a wider matrix, a weight stored transposed, and every other row of hidden with
        every third row of weight and bias (gradients too, where the backend declares autograd)."""
        lp.require(OP, vocab=len(range(0, VOCAB, 3)) if layout == "strided-rows-weight-and-bias" else VOCAB)
        h, w, b, y = _inputs(lp, (4, 10))
        kw: dict = dict(return_entropy=True)
        if layout == "shifted-hidden":
            h, y = h[:, :-1], y[:, 1:]
        elif layout == "weight-column-slice":
            wide = lp.logits((w.shape[0], 40), scale=1.0, seed=20)
            wide[:, :24] = w
            w = wide[:, :24]
            kw = {}
        elif layout == "transposed-weight":
            w = w.t().contiguous().t()
            kw = dict(temperature=0.5)
        else:
            h, w, b, y = h[:, ::2], w[::3], b[::3], y[:, ::2] // 3
        assert not (h.is_contiguous() and w.is_contiguous() and b.is_contiguous()), layout
        check_hidden(lp, h, w, b, y, what=f"{OP}, {layout} (strides {h.stride()}, {w.stride()})", **kw)

    # ------------------------------------------------------------------ values
    @covers(OP)
    @pytest.mark.parametrize("case", SPECIAL)
    def test_hidden_special_values(self, lp: Harness, case: str) -> None:
        """A masked vocabulary (a bias of -inf; a label on it gives -inf), NaN in one row of hidden
        (that row alone is NaN), and logits of magnitude 1e4 (gradients too, except for NaN)."""
        lp.require(OP, vocab=VOCAB)
        h, w, b, y = _inputs(lp, (37,))
        if case == "masked-vocabulary":
            b[::7] = -math.inf
            y[0] = 14
            check_hidden(lp, h, w, b, y, return_entropy=True, temperature=0.8, what=f"{OP}, -inf bias entries")
        elif case == "nan":
            h[3, 5] = math.nan
            # the reference is NaN in row 3 alone, and assert_close wants NaN exactly where it is
            check_hidden(lp, h, w, b, y, grads=False, return_entropy=True, what=f"{OP}, NaN in row 3 of hidden")
        else:
            check_hidden(lp, h * 300, w, b * 1e4, y, return_entropy=True, what=f"{OP}, logits of magnitude 1e4")

    @covers(OP, capability="copies_logits", declared=False)
    def test_hidden_never_materialises_logits(self, lp: Harness) -> None:
        """hidden (N, 256) @ weight (8192, 256).T from N = 512 to 2048 rows: the call's extra peak
        memory grows by less than half as much as the float32 logits it must not form (16 to
        64 MiB). A fixed tile, however large, is allowed: only memory that grows with the rows counts."""
        lp.require(OP, vocab=8192)
        require_no_copy(lp)
        w = lp.logits((8192, 256), scale=0.05, seed=9)

        def case(rows: int):
            h, y = lp.logits((rows, 256), scale=1.0, seed=8), lp.labels((rows,), 8192)
            return (lambda: lp.call_hidden(h, w, y)), rows * 8192 * 4

        with torch.no_grad():
            found = growth(case, (512, 2048), lp)
        assert found.ratio < MEMORY_LIMIT, (
            f"logprobs_from_hidden: {found.describe('the float32 logits it must never form')}. Its memory grows "
            "with the logits: work through blocks of rows or vocabulary.")

    # ------------------------------------------------------------- invariances
    @covers(OP, capability="deterministic")
    def test_hidden_inputs_unmodified_and_deterministic(self, lp: Harness) -> None:
        lp.require(OP, vocab=VARIANT_VOCAB)
        h, w, b, y, kw = _variant(lp, "temperature-ignore-index", torch.float32)
        before = [t.clone() for t in (h, w, b, y) if t is not None]
        first = lp.call_hidden(h, w, y, bias=b, return_entropy=True, **kw)
        for t, t0 in zip([t for t in (h, w, b, y) if t is not None], before):
            assert torch.equal(t, t0), "logprobs_from_hidden modified one of its inputs"
        if lp.backend.deterministic:
            second = lp.call_hidden(h, w, y, bias=b, return_entropy=True, **kw)
            assert all(torch.equal(a, c) for a, c in zip(first, second)), "two identical calls differ"

    @covers(OP, capability="deterministic", grad=True)
    def test_hidden_backward_deterministic_and_unmodified(self, lp: Harness) -> None:
        """Forward and backward leave hidden, weight, bias and labels as they were; a deterministic
        backend gives bitwise the same outputs and gradients twice; backward does not read the
        entropy tensor handed to the caller (who may overwrite it)."""
        lp.require(OP, torch.float32, grad=True, vocab=VOCAB)
        h, w, b, y = _inputs(lp, (45,))
        copies = [t.clone() for t in (h, w, b, y)]
        runs = []
        for overwrite in (False, True):
            leaves = [t.clone().requires_grad_(True) for t in (h, w, b)]
            logp, ent = lp.call_hidden(leaves[0], leaves[1], y, bias=leaves[2], return_entropy=True, ignore_index=3)
            loss = logp.sum() + 0.5 * ent.sum()
            outs = (logp.detach().clone(), ent.detach().clone())
            if overwrite:
                with torch.no_grad():
                    ent.zero_()
            runs.append(outs + torch.autograd.grad(loss, leaves))
        for t, c, name in zip((h, w, b, y), copies, ("hidden", "weight", "bias", "labels")):
            assert torch.equal(t, c), f"{OP} forward or backward modified the {name}"
        tol = 4 * max(hidden_tolerances(h, w, b))
        names = ("logprobs", "entropy", "hidden's gradient", "weight's gradient", "bias's gradient")
        for name, a, c in zip(names, *runs):
            what = (f"{OP}: {name} differs between two identical calls (the second with the entropy output "
                    "zeroed in place before backward, which backward must not read)")
            if lp.backend.deterministic:
                assert torch.equal(a, c), what
            else:
                assert_close(a, c.double(), tol * max(float(c.abs().max()), 1.0), what)

    @covers(OP, capability="batch_invariant", declared=True)
    def test_hidden_batch_invariant(self, lp: Harness) -> None:
        """A row's logprob, entropy and (where the backend declares autograd) hidden gradient are
        bitwise the same alone, in a sub-batch and in the whole batch."""
        lp.require(OP, vocab=300)
        lp.require_capability("batch_invariant", "batch invariance")
        h, w, b, y = _inputs(lp, (40,), v=300)
        grads = lp.backend.autograd

        def run(rows: slice) -> tuple:
            leaf = h[rows].clone().requires_grad_(grads)
            out, ent = lp.call_hidden(leaf, w, y[rows], bias=b, return_entropy=True)
            found = (out.detach(), ent.detach())
            return found + torch.autograd.grad(out.sum() + ent.sum(), leaf) if grads else found

        whole = run(slice(None))
        for rows in (slice(7, 8), slice(3, 20), slice(30, 40)):
            for name, part, full in zip(("logprobs", "entropy", "hidden's gradient"), run(rows), whole):
                assert torch.equal(part, full[rows]), (
                    f"{OP}: {name} of rows {rows.start}..{rows.stop - 1} alone differs from the same rows "
                    "in a batch of 40")

    # ------------------------------------------------------------- RL steps
    @covers(OP, grad=True)
    @pytest.mark.parametrize("weight_grad", ["trainable", "frozen"])
    def test_hidden_upstream_gradients(self, lp: Harness, weight_grad: str) -> None:
        """Per-token upstream gradients as an RL loss makes them (advantages times ratios): zeros,
        negatives and a 1e6 range of magnitudes across rows, with ignored rows; each gradient
        element is checked at the scale of its own rows' upstream gradients, so that a small row
        beside large ones is checked too (a fused kernel that scales the gradient by one number
        per batch, or drops a row's sign, fails here; Liger-Kernel #1298 gave wrong weight gradients
        for per-token upstream gradients). ``frozen``: the weight and bias need no gradient, the
        path of a LoRA step or a reference model."""
        lp.require(OP, torch.float32, grad=True, vocab=300)
        h, w, b, y = _inputs(lp, (61,), h=32, v=300)
        y[::4] = -100
        g = torch.Generator().manual_seed(5)
        ups = torch.randn(61, generator=g, dtype=torch.float64) * 10.0 ** (6 * torch.rand(61, generator=g) - 3)
        ups[::5] = 0.0
        ups[1], ups[2] = -1e3, 1e-3
        grad_of = INPUTS if weight_grad == "trainable" else ("hidden",)
        check_hidden(lp, h, w, b, y, grad_of=grad_of, upstreams=[ups], ignore_index=-100, temperature=0.9,
                     what=f"{OP} with RL-like upstream gradients, {weight_grad} weight")

    @covers(OP, grad=True)
    @pytest.mark.parametrize("weight_grad", ["trainable", "frozen"])
    def test_hidden_ignored_rows(self, lp: Harness, weight_grad: str) -> None:
        """Rows whose label is ``ignore_index`` (most rows of a GRPO batch are prompt tokens):
        their log-probability is 0 and their hidden gradient exactly 0, and (batch-invariant
        backends) the active rows' results and hidden gradients are bitwise those of a call in
        which every row is active."""
        lp.require(OP, torch.float32, grad=True, vocab=300)
        h, w, b, y = _inputs(lp, (50,), v=300)
        ignored = torch.zeros(50, dtype=torch.bool)
        ignored[torch.randperm(50, generator=torch.Generator().manual_seed(2))[:40]] = True
        sparse = y.masked_fill(ignored.to(y.device), -100)

        def run(labels):
            leaf = h.clone().requires_grad_(True)
            weight = w.clone().requires_grad_(weight_grad == "trainable")
            out = lp.call_hidden(leaf, weight, labels, bias=b, ignore_index=-100)[0]
            (grad,) = torch.autograd.grad(out.sum(), leaf)
            return out.detach(), grad

        out, grad = run(sparse)
        on = ignored.to(out.device)
        assert bool((out[on] == 0).all()), f"{OP}: an ignored row's log-probability is not 0"
        assert bool((grad[on] == 0).all()), f"{OP}: an ignored row's hidden gradient is not 0"
        check_hidden(lp, h, w, b, sparse, ignore_index=-100, grad_of=INPUTS if weight_grad == "trainable" else
                     ("hidden",), what=f"{OP} with 40 of 50 rows ignored, {weight_grad} weight")
        if lp.backend.batch_invariant:
            full_out, full_grad = run(y)
            assert torch.equal(out[~on], full_out[~on]) and torch.equal(grad[~on], full_grad[~on]), (
                f"{OP}: an active row's result or hidden gradient depends on which other rows are ignored")

    # ---------------------------------------------------------------- bad input
    @covers(OP)
    @pytest.mark.parametrize("case", ["mixed-dtypes", "weight-shape", "bias-shape"])
    def test_hidden_bad_input_errors(self, lp: Harness, case: str) -> None:
        """hidden, weight and bias of different dtypes, a weight whose H differs from hidden's, or a
        bias that is not (V,): a clear error before dispatch, naming both."""
        lp.require(OP, vocab=VOCAB)
        h, w, b, y = _inputs(lp, (5,))
        if case == "mixed-dtypes":
            with pytest.raises(TypeError, match="hidden is torch.bfloat16 but weight is torch.float32"):
                lp.call_hidden(h.bfloat16(), w, y)
            with pytest.raises(TypeError, match="but bias is torch.float64"):
                lp.call_hidden(h, w, y, bias=b.double())
        elif case == "weight-shape":
            with pytest.raises(ValueError) as info:
                lp.call_hidden(h, w[:, :20], y)
            assert "(97, 20)" in str(info.value) and "(5, 24)" in str(info.value), str(info.value)
        else:
            with pytest.raises(ValueError) as info:
                lp.call_hidden(h, w, y, bias=b[:50])
            assert "(50,)" in str(info.value) and "(97, 24)" in str(info.value), str(info.value)


def _variant(lp: Harness, variant: str, dtype: torch.dtype):
    """The cases of test_hidden_values and test_hidden_gradients: (hidden, weight, bias, labels, options)."""
    h = lp.logits((2, 5, 48), dtype, scale=1.0, seed=8)
    w = lp.logits((VARIANT_VOCAB, 48), dtype, scale=0.4, seed=9)
    with_bias = variant in ("bias", "all-options", "in-range-ignore-index")
    b = lp.logits((VARIANT_VOCAB,), dtype, scale=0.5, seed=10) if with_bias else None
    y = lp.labels((2, 5), VARIANT_VOCAB)
    kw: dict = {}
    if variant in ("entropy", "all-options"):
        kw["return_entropy"] = True
    if variant in ("temperature-ignore-index", "all-options"):
        kw.update(temperature=0.7, ignore_index=-100)
        y[0, 1] = y[1, 4] = -100
    if variant == "in-range-ignore-index":
        kw.update(temperature=1.6, ignore_index=5)
        y[0, ::2] = 5
    return h, w, b, y, kw


def _shape_case(lp: Harness, shape: str):
    """The cases of test_hidden_shapes: (hidden, weight, bias, labels, options)."""
    v = SHAPE_VOCAB[shape]
    if shape in ("1d", "empty", "strided"):
        w = lp.logits((v, 32), scale=0.3, seed=7)
        if shape == "1d":
            h, y = lp.logits((32,), seed=8), lp.labels((), v)
        elif shape == "empty":
            h, y = lp.logits((0, 32), seed=8), lp.labels((0,), v)
        else:
            h, y = lp.logits((3, 6, 32), seed=8)[:, :-1], lp.labels((3, 6), v)[:, 1:]
        return h, w, None, y, {}
    if shape in ("3d", "vocab-1"):
        h, w, b, y = _inputs(lp, (3, 4) if shape == "3d" else (37,), v=v)
        return h, w, b, y, {}
    h, w, b, y = _inputs(lp, (20,), v=v)
    y[::4] = v - 1
    return h, w, b, y.int(), dict(ignore_index=v - 1)
