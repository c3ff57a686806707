"""The conformance suite against this plugin's backend: all a plugin needs as tests."""

from logprob_registry.testing import BackendConformance


class TestTemplate(BackendConformance):
    backend = "template"
