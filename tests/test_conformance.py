"""The conformance suite against every backend eligible on this machine, built-in or installed
through an entry point: what CI proves on every run (``logprob-registry check`` runs the same)."""

import pytest

import logprob_registry as lr
from logprob_registry.backend import CAPABILITIES
from logprob_registry.environment import get_environment
from logprob_registry.opspec import FEATURES, OPS
from logprob_registry.testing import BackendConformance
from logprob_registry.testing.runner import not_eligible_reason
from logprob_registry.testing.sections import coverage, covering_tests, covers

pytest_plugins = ["pytester"]

DEVICE = get_environment().main_device
ELIGIBLE = [b.name for b in lr.backends() if not_eligible_reason(b, DEVICE) is None]


def test_naive_is_among_the_backends_checked():
    assert "naive" in ELIGIBLE


class TestEveryEligibleBackend(BackendConformance):
    device = DEVICE

    @pytest.fixture(scope="class", params=ELIGIBLE)
    @classmethod
    def conformance_backend(cls, request):
        return request.param


def test_the_pytest_plugin_imports_neither_torch_nor_the_package(tmp_path):
    """pytest loads the pytest11 plugin into every run where logprob-registry is installed: a test
    session of another project must not pay for importing torch."""
    from plugin_dists import run_python

    (tmp_path / "test_other_project.py").write_text(
        "import sys\n"
        "def test_nothing_heavy_was_imported():\n"
        "    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'logprob_registry'))\n"
        "    assert not heavy, heavy[:5]\n")
    # loaded as pytest loads it, through the installed entry point (--logprob-device is its option)
    proc = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--logprob-device", "cpu",
                       "--rootdir", str(tmp_path), str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout
    # and the suite's own entry point still finds its test module
    from logprob_registry.testing import suite_path
    assert suite_path().endswith("selected.py")


def test_not_declared_names_the_missing_op_or_promise_and_nothing_else():
    from logprob_registry.testing.suite import not_declared

    get = lr.get_registry().get
    assert not_declared(get("triton"), "test_hidden_values", {"variant": "plain"}) == \
        "triton does not implement logprobs_from_hidden"
    assert not_declared(get("naive"), "test_no_copy_of_strided_logits", {"op": "entropy"}) == \
        "naive declares copies_logits=True"
    assert not_declared(get("naive"), "test_batch_invariant", {"op": "logprobs"}) is None
    assert not_declared(get("chunked"), "test_hidden_never_materialises_logits", {}) is None
    assert not_declared(get("npu"), "test_shapes", {"op": "entropy"}) == "npu does not implement entropy"
    assert not_declared(get("npu"), "test_gradient_of_one_output", {"output": "entropy"}) == \
        "npu does not implement logprobs_and_entropy"
    assert not_declared(get("npu"), "test_bad_input_errors", {"case": "negative-label"}) is None  # one op is enough
    no_grad = lr.Backend(name="no-grad", ops={"logprobs": lambda *a, **k: None}, autograd=False)
    assert not_declared(no_grad, "test_gradients", {"op": "logprobs"}) == "no-grad declares autograd=False"
    assert not_declared(no_grad, "test_dtypes", {"op": "logprobs"}) is None
    assert not_declared(no_grad, "test_deterministic", {"op": "logprobs"}) is None  # declared by default


# ------------------------------------------------------------------ the suite covers the op table
# In the manner of datasette's test_plugin_hooks_have_tests: a new op, capability or feature
# without conformance tests fails here.
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_has_conformance_tests(op):
    assert covering_tests(op=op), f"no conformance test declares @covers({op!r}): add a section for it"


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_every_capability_has_conformance_tests(capability):
    assert covering_tests(capability=capability), (
        f"no conformance test checks the promise {capability!r}: add one with @covers(..., capability={capability!r})")


def test_every_feature_has_conformance_tests():
    """(opspec.FEATURES is empty today: this fails as soon as a feature is added without tests.)"""
    declared = {f for c in coverage().values() for f in c.all_features}
    assert declared <= set(FEATURES), f"tests declare unknown features {sorted(declared - set(FEATURES))}"
    missing = [f for f in FEATURES if not covering_tests(feature=f)]
    assert not missing, f"no conformance test exercises feature(s) {missing}: add them with @covers(..., features=...)"


def test_every_suite_test_declares_what_it_covers_and_its_op_parameters_agree():
    tests = [n for n in dir(BackendConformance) if n.startswith("test")]
    declared = coverage()
    assert len(tests) > 30 and set(tests) == set(declared), sorted(set(tests) - set(declared))
    for name in tests:
        marks = getattr(getattr(BackendConformance, name), "pytestmark", [])
        ops = [m.args[1] for m in marks if m.name == "parametrize" and m.args[0] == "op"]
        if ops:  # a test over `op` declares exactly the ops it is parametrised with
            assert tuple(ops[0]) == declared[name].ops, name


def test_coverage_answers_which_tests_cover_what():
    assert "test_hidden_tied_embeddings" in covering_tests(op="logprobs_from_hidden")
    assert "test_hidden_tied_embeddings" not in covering_tests(op="logprobs")
    assert covering_tests(capability="inplace_backward") == ["test_inplace_backward", "test_inplace_backward_strided"]
    assert "test_gradients" in covering_tests(op="entropy", capability="autograd")
    with pytest.raises(ValueError, match="unknown ops, capabilities or features"):
        covers("logprobz")
    with pytest.raises(ValueError, match="unknown"):
        covers("logprobs", capability="fast")


# --------------------------------------------------------------------------------- pytest versions
PLUGIN_TESTS = '''
import pytest
from logprob_registry.testing import BackendConformance

class TestNaive(BackendConformance):
    backend = "naive"

class TestSeveral(BackendConformance):
    @pytest.fixture(scope="class", params=["naive", "chunked"])
    @classmethod
    def conformance_backend(cls, request):
        return request.param
'''


def test_a_plugin_subclass_runs_without_pytest_deprecations(pytester):
    """A plugin's subclass of the suite, as the README shows it and as a project that overrides
    ``conformance_backend`` writes it, runs with pytest's deprecation warnings as errors
    (class-scoped fixtures written as instance methods are removed in pytest 10)."""
    pytester.makepyfile(test_plugin=PLUGIN_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error::pytest.PytestDeprecationWarning",
                                "-k", "test_shapes and logprobs-2d")
    assert "PytestRemovedIn" not in result.stdout.str(), result.stdout.str()
    result.assert_outcomes(passed=3)
