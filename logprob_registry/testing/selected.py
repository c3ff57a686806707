"""The conformance suite against the backend named on the command line::

    python -m pytest --logprob-backend NAME [--logprob-device DEVICE] <path of this file>

which is what ``logprob-registry check`` runs, once per backend.
"""

from logprob_registry.testing import BackendConformance


class TestConformance(BackendConformance):
    """The backend and device come from ``--logprob-backend`` and ``--logprob-device``."""
