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
