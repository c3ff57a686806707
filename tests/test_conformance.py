"""The conformance suite against every backend eligible on this machine, built-in or installed
through an entry point: what CI proves on every run (``logprob-registry check`` runs the same)."""

import pytest

import logprob_registry as lr
from logprob_registry.check import not_eligible_reason
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


def test_the_pytest_plugin_adds_nothing_heavy_to_the_package_import():
    """The pytest11 plugin is loaded into every pytest run where the package is installed: beyond
    ``import logprob_registry`` itself it imports nothing (not the suite, not pytest)."""
    from plugin_dists import run_python

    code = ("import sys, logprob_registry\n"
            "before = set(sys.modules)\n"
            "import logprob_registry.testing.plugin, logprob_registry.testing as t\n"
            "print(sorted(set(sys.modules) - before))\n"
            "print(t.suite_path().endswith('selected.py'))\n")
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [
        "['logprob_registry.testing', 'logprob_registry.testing.plugin']", "True"], proc.stdout


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
