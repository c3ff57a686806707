"""The conformance suite against every backend eligible on this machine, built-in or installed
through an entry point: what CI proves on every run (``logprob-registry check`` runs the same)."""

import pytest

import logprob_registry as lr
from logprob_registry.testing.runner import not_eligible_reason
from logprob_registry.environment import get_environment
from logprob_registry.testing import BackendConformance

DEVICE = get_environment().main_device
ELIGIBLE = [b.name for b in lr.backends() if not_eligible_reason(b, DEVICE) is None]


def test_naive_is_among_the_backends_checked():
    assert "naive" in ELIGIBLE


class TestEveryEligibleBackend(BackendConformance):
    device = DEVICE

    @pytest.fixture(scope="class", params=ELIGIBLE)
    def conformance_backend(self, request):
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
    assert not_declared(get("compiled"), "test_hidden_values", {"variant": "plain"}) == \
        "compiled does not implement logprobs_from_hidden"
    assert not_declared(get("naive"), "test_no_copy_of_strided_logits", {"op": "entropy"}) == \
        "naive declares copies_logits=True"
    assert not_declared(get("naive"), "test_batch_invariant", {"op": "logprobs"}) is None
    assert not_declared(get("chunked"), "test_hidden_never_materialises_logits", {}) is None
    assert not_declared(get("npu"), "test_shapes", {"op": "entropy"}) == "npu does not implement entropy"
