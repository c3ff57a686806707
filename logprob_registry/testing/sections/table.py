"""The generic section: what the op table alone says of every public op, for any op in it.

Each test here is parametrised, when the suite is collected, over the public ops of the op table
(:data:`logprob_registry.opspec.OPS`) that have example inputs and a float64 reference, so an op
added to the table (by :func:`logprob_registry.opspec.register` too) is checked with no test
written for it: its outputs against the reference, their shapes and dtypes as its ``Output``
records say (empty leading dims included), its gradients against float64 autograd, and bitwise
repeatability and batch invariance where the backend promises them. The ops' own sections check
the rest of the contract.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from ...numerics import assert_close, tolerances
from ...opspec import OPS, OpSpec
from ..harness import Harness
from ._coverage import covers

#: Vocabulary and positions of the examples: small, V no power of two.
SHAPE = (2, 3, 37)
HIDDEN_SIZE = 16


def table_ops() -> List[str]:
    """The public ops with example inputs and a reference, read from the table now."""
    return [name for name, spec in OPS.items()
            if spec.function is not None and spec.examples is not None and spec.reference is not None]


def _dtypes(spec: OpSpec) -> List[str]:
    # float32 where the inputs are logits; float64 where the op forms logits from hidden states (then
    # the reference and the backend both form them exactly enough for the logits ops' tolerance).
    return ["float32", "float64"] if spec.form in ("logits", "either") else ["float64"]


def generate(metafunc: Any) -> None:
    """Parametrise the generic tests over :func:`table_ops` (and their dtypes)."""
    name = metafunc.definition.name
    if not name.startswith("test_table_") or "op" not in metafunc.fixturenames:
        return
    if "dtype" in metafunc.fixturenames:
        cases = [(op, dtype) for op in table_ops() for dtype in _dtypes(OPS[op])]
        metafunc.parametrize("op,dtype", cases, ids=[f"{op}-{dtype}" for op, dtype in cases])
    else:
        metafunc.parametrize("op", table_ops())


def _example(lp: Harness, op: str, dtype: torch.dtype, shape: Tuple[int, ...] = SHAPE, grad: bool = False,
             seed: int = 0):
    spec = OPS[op]
    hidden = None if spec.form in ("logits", "either") else HIDDEN_SIZE
    return spec, spec.example(shape, dtype, lp.device, requires_grad=grad, seed=seed, hidden_size=hidden)


def _call(lp: Harness, spec: OpSpec, example) -> Tuple[torch.Tensor, ...]:
    return spec.unpack(spec.public()(*example.args, backend=lp.name, **example.options), example.options)


def _reduced_logits(spec: OpSpec, example) -> torch.Tensor:
    """The float64 logits the op reduces (formed from hidden states where it takes them), for the
    tolerance."""
    inputs: Dict[str, Any] = dict(example.inputs, **example.options)
    if spec.form == "hidden":
        z = inputs["hidden"].detach().double() @ inputs["weight"].detach().double().T
        return z if inputs.get("bias") is None else z + inputs["bias"].detach().double()
    if spec.form == "sides":
        x, w = inputs["student"].detach().double(), inputs.get("student_weight")
        return x if w is None else x @ w.detach().double().T
    return inputs[spec.inputs[0]].detach().double()


def _require(lp: Harness, spec: OpSpec, dtype: torch.dtype, grad: bool = False) -> None:
    if not lp.backend.supports(spec.name):
        pytest.skip(f"{lp.name} does not implement {spec.name}")
    lp.require(spec.name, dtype, grad=grad, vocab=SHAPE[-1])


class TableSection:
    """The generic tests (a mixin of :class:`~logprob_registry.testing.BackendConformance`)."""

    def pytest_generate_tests(self, metafunc: Any) -> None:
        generate(metafunc)

    @covers(tuple(table_ops()))
    def test_table_matches_reference(self, lp: Harness, op: str, dtype: str) -> None:
        """Every output against the float64 reference, of the shape and dtype the op table says."""
        work = getattr(torch, dtype)
        spec, example = _example(lp, op, work)
        _require(lp, spec, work)
        got, want = _call(lp, spec, example), spec.ground_truth(*(x.cpu() for x in example.args),
                                                                **_cpu(example.options))
        z = _reduced_logits(spec, example)
        on = example.inputs[spec.dtype_input]
        labels = example.inputs.get("labels")
        names = spec.output_names(example.options)
        assert len(got) == len(names), f"{op} returned {len(got)} outputs, the op table says {names}"
        for out, g, w, tol in zip((spec.result(n) for n in names), got, want, tolerances(op, z)):
            shape = out.shape_for(on, labels, example.options)
            assert tuple(g.shape) == shape, f"{op}'s {out.name} has shape {tuple(g.shape)}, the op table says {shape}"
            assert g.dtype == out.dtype_for(on.dtype), (
                f"{op}'s {out.name} is {g.dtype}, the op table says {out.dtype_for(on.dtype)} for {dtype} inputs")
            if out.judged_as:
                assert_close(g, w, tol, f"{op}'s {out.name} ({dtype})")
            else:
                assert torch.equal(g.cpu(), w.to(g.dtype)), f"{op}'s {out.name} ({dtype}) differs from the reference"

    @covers(tuple(table_ops()))
    def test_table_empty(self, lp: Harness, op: str) -> None:
        """Empty leading dims give empty outputs of the op table's shapes and dtypes."""
        spec, example = _example(lp, op, torch.float64, shape=(0, SHAPE[-1]))
        _require(lp, spec, torch.float64)
        on = example.inputs[spec.dtype_input]
        names = spec.output_names(example.options)
        for n, g in zip(names, _call(lp, spec, example)):
            out = spec.result(n)
            assert tuple(g.shape) == out.shape_for(on, example.inputs.get("labels"), example.options), (op, n)
            assert g.dtype == out.dtype_for(on.dtype), (op, n, g.dtype)

    @covers(tuple(table_ops()), grad=True)
    def test_table_gradients(self, lp: Harness, op: str) -> None:
        """The gradients of the differentiable outputs, with random upstream weights, against
        float64 autograd of the reference, for every input the op table lists as differentiable."""
        spec, example = _example(lp, op, torch.float64, grad=True)
        _require(lp, spec, torch.float64, grad=True)
        names = spec.output_names(example.options)
        leaves = [x for x in list(example.inputs.values()) + list(example.options.values())
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        g = torch.Generator().manual_seed(5)
        got = _call(lp, spec, example)
        ref_leaves = [x.detach().cpu().requires_grad_(True) for x in leaves]
        swap = {id(x): r for x, r in zip(leaves, ref_leaves)}
        args = [swap.get(id(x), x.detach().cpu()) for x in example.args]
        options = {k: swap.get(id(v), v.detach().cpu()) if isinstance(v, torch.Tensor) else v
                   for k, v in example.options.items()}
        want = spec.ground_truth(*args, **options)
        loss_got, loss_want = 0.0, 0.0
        for n, a, b in zip(names, got, want):
            if not spec.result(n).differentiable:
                assert not a.requires_grad, f"{op}'s {n} requires grad, but the op table says it is not differentiable"
                continue
            up = torch.rand(a.shape, generator=g, dtype=torch.float64)
            finite = torch.isfinite(b.detach())
            loss_got = loss_got + torch.where(finite.to(a.device), a * up.to(a.device), 0).sum()
            loss_want = loss_want + torch.where(finite, b * up, 0).sum()
        if not isinstance(loss_got, torch.Tensor):
            pytest.skip(f"{op} has no differentiable output")
        grads = torch.autograd.grad(loss_got, leaves, allow_unused=True)
        refs = torch.autograd.grad(loss_want, ref_leaves, allow_unused=True)
        for x, a, b in zip(leaves, grads, refs):
            b = torch.zeros_like(x, device="cpu") if b is None else b
            a = torch.zeros_like(x) if a is None else a
            scale = float(b.abs().max()) if b.numel() else 0.0
            assert_close(a, b, 1e-5 * (1.0 + scale), f"{op}'s gradient of an input of shape {tuple(x.shape)}")

    @covers(tuple(table_ops()), capability="deterministic", declared=True)
    def test_table_repeatable(self, lp: Harness, op: str) -> None:
        """The same call twice gives the same bits."""
        spec, example = _example(lp, op, torch.float64)
        _require(lp, spec, torch.float64)
        for a, b in zip(_call(lp, spec, example), _call(lp, spec, example)):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), op

    @covers(tuple(table_ops()), capability="batch_invariant", declared=True)
    def test_table_batch_invariant(self, lp: Harness, op: str) -> None:
        """A position's result does not depend on the other positions of the call."""
        spec, example = _example(lp, op, torch.float64, shape=(5, SHAPE[-1]))
        _require(lp, spec, torch.float64)
        whole = _call(lp, spec, example)
        first = type(example)({k: (v[:1] if spec.inputs and v.shape[:1] == (5,) else v)
                               for k, v in example.inputs.items()},
                              {k: (v[:1] if isinstance(v, torch.Tensor) and v.shape[:1] == (5,) else v)
                               for k, v in example.options.items()})
        for a, b in zip(whole, _call(lp, spec, first)):
            assert torch.equal(a[:1], b), f"{op}: the first position's result changes with the batch"


def _cpu(options: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}


__all__ = ["TableSection", "generate", "table_ops"]
