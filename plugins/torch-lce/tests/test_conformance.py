"""The conformance suite against torch's linear_cross_entropy, on its reference and chunked paths."""

import pytest

from logprob_registry.testing import BackendConformance


class TestTorchLCE(BackendConformance):
    @pytest.fixture(scope="class", params=["torch-lce", "torch-lce-chunked"])
    @classmethod
    def conformance_backend(cls, request):
        return request.param
