"""The conformance suite against TRL's kernels (``trl`` for the logits ops, ``trl-chunked`` for the fused head)."""

import pytest

from logprob_registry.testing import BackendConformance


class TestTRL(BackendConformance):
    @pytest.fixture(scope="class", params=["trl", "trl-chunked"])
    @classmethod
    def conformance_backend(cls, request):
        return request.param
