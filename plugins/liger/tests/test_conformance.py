"""The conformance suite against the Liger adapter: on CUDA, or on the CPU with TRITON_INTERPRET=1."""

from logprob_registry.testing import BackendConformance


class TestLiger(BackendConformance):
    backend = "liger"
