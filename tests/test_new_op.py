"""A seventh op from the op table alone: an entry, its float64 reference, its public function (one
line) and one kernel, all defined here, with no package file edited. Validation, selection,
explain, torch.compile, the suite's generic sections and process_group= take it from the table."""

import math

import pytest
import torch

import logprob_registry as lr
from logprob_registry import ops, opspec
from logprob_registry.opspec import OpSpec, Option, Output, examples_by_name
from logprob_registry.validation import check_temperature

pytest_plugins = ["pytester"]

OP = "logsumexp"
FUNCTION = "logsumexp_from_logits"


def logsumexp_from_logits(logits, *, temperature=1.0, process_group=None, vocab_start=None, backend=None):
    """log sum exp(logits / temperature) over the last dim: float32 (...) (float64 for float64)."""
    return ops.run(OP, locals())


def reference(logits, *, temperature=1.0, dtype=torch.float64):
    return torch.logsumexp(logits.to(dtype) / temperature, -1)


SPEC = OpSpec(
    name=OP, function=FUNCTION, inputs=("logits",),
    options=(Option("temperature", 1.0, "float > 0: divides the logits",
                    check=lambda value, context: check_temperature(value)),),
    outputs=(Output("lse", shape="positions"),),
    doc="log sum exp of logits (..., V) / temperature over the last dim",
    dtype_input="logits", grad_inputs=("logits",), reference=reference, examples=examples_by_name,
)


def lse_kernel(logits, *, temperature):
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.logsumexp(logits.to(work) / temperature, -1)


class LsePlugin:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="lse-kernel", ops={OP: lse_kernel}, devices={"cpu"},
                            dtypes={torch.float16, torch.bfloat16, torch.float32, torch.float64},
                            priority=50, torch="", autograd=True))


@pytest.fixture(scope="module")
def seventh():
    """The op in the table and its kernel in the process-wide registry, for this module."""
    opspec.register(SPEC, logsumexp_from_logits)
    registry = lr.get_registry()
    registry.add_plugin(LsePlugin(), name="lse-plugin")
    try:
        yield registry
    finally:
        registry.remove_plugin("lse-plugin")
        opspec.unregister(OP)


def test_the_public_call_validates_and_matches_the_reference(seventh):
    x = torch.randn(4, 7, 37, dtype=torch.bfloat16) * 3
    got = logsumexp_from_logits(x, temperature=0.7)
    assert got.dtype == torch.float32 and got.shape == (4, 7)
    torch.testing.assert_close(got.double(), reference(x, temperature=0.7), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        logsumexp_from_logits(x, temperature=0.0)
    with pytest.raises(TypeError, match="logits"):
        logsumexp_from_logits(torch.ones(3, 5, dtype=torch.int64))
    with pytest.raises(TypeError):
        logsumexp_from_logits(x, top_k=3)  # not an option of this op


def test_selection_and_explain(seventh):
    assert lr.select(OP, device="cpu", dtype=torch.float32).name == "lse-kernel"
    table = str(lr.explain(OP, device="cpu", dtype=torch.float32, requires_grad=True))
    assert "using lse-kernel" in table
    assert "does not implement logsumexp" in table  # the built-ins, each with its sentence
    with pytest.raises(lr.NoEligibleBackendError, match="does not implement logsumexp"):
        logsumexp_from_logits(torch.randn(2, 5), backend="naive")


def test_gradients_against_float64(seventh):
    x = (torch.randn(3, 37, dtype=torch.float64) * 3).requires_grad_(True)
    logsumexp_from_logits(x, temperature=1.3).sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    reference(ref, temperature=1.3).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, atol=1e-10, rtol=0)


def test_torch_compile_fullgraph(seventh):
    x = (torch.randn(4, 37) * 3).requires_grad_(True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(z):
        return logsumexp_from_logits(z, temperature=0.5).mean()

    loss = step(x)
    loss.backward()
    want = reference(x.detach(), temperature=0.5).mean()
    assert math.isclose(float(loss.detach()), float(want), abs_tol=1e-5)
    ref = x.detach().double().requires_grad_(True)
    reference(ref, temperature=0.5).mean().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=1e-6, rtol=0)


def test_the_suite_generic_sections_judge_it(seventh, pytester):
    pytester.makepyfile(test_lse="""
        from logprob_registry.testing import BackendConformance

        class TestLse(BackendConformance):
            backend = "lse-kernel"
            device = "cpu"
    """)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-k", "table and logsumexp")
    outcomes = result.parseoutcomes()
    # matches_reference (float32, float64), empty, gradients, repeatable, batch_invariant
    assert outcomes.get("passed", 0) == 6, result.stdout.str()
    assert "failed" not in outcomes, result.stdout.str()


def test_process_group_is_refused_with_a_sentence(seventh, world):
    x = torch.randn(2, 37)
    with pytest.raises(NotImplementedError, match="logsumexp"):
        logsumexp_from_logits(x, process_group=world)
