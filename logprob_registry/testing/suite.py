"""The conformance suite: the contract of docs/conformance.md as tests, for any backend.

Subclass :class:`BackendConformance` in a test module of your own and name your backend::

    from logprob_registry.testing import BackendConformance

    class TestMyKernel(BackendConformance):
        backend = "my-kernel"
        device = "cuda"          # optional; default: --logprob-device, else the main device

Every test calls the backend through the public functions with ``backend=NAME`` (so that input
validation and dispatch run as for a user) and compares with the float64 reference
(:mod:`logprob_registry.reference`) within the tolerance derived in
:mod:`logprob_registry.numerics`. Ops, dtypes, gradients or devices the backend does not
declare, or that this machine lacks, are skipped with a reason that says which. Test names are part
of the API for subclassers: they are never renamed.

The tests live in sections (:mod:`logprob_registry.testing.sections`), one mixin class per part
of the contract, which :class:`BackendConformance` inherits; each test declares what it covers
(ops, capability), which :func:`not_declared` reads. To run the suite over several backends,
override the ``conformance_backend`` fixture, at class scope and as a classmethod (pytest 10
refuses class-scoped fixtures written as instance methods)::

    class TestMine(BackendConformance):
        @pytest.fixture(scope="class", params=["mine-a", "mine-b"])
        @classmethod
        def conformance_backend(cls, request):
            return request.param
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from logprob_registry.backend import Backend
from logprob_registry.registry import get_registry

from .harness import Harness, default_device
from .sections import Sections, coverage_of
from .sections._common import MEMORY_LIMIT
from .sections.logits import IGNORE, LARGE_VOCAB, MEMORY_SHAPE, SHAPES, STRIDED

__all__ = ["BackendConformance", "not_declared", "IGNORE", "LARGE_VOCAB", "MEMORY_LIMIT", "MEMORY_SHAPE",
           "SHAPES", "STRIDED"]


def not_declared(backend: Backend, test: str, params: dict, cls: Optional[type] = None) -> Optional[str]:
    """Why conformance test ``test`` (its function name; ``params``, its parameters) checks
    something ``backend`` does not declare (an op it lacks, a promise it does not make), or None.
    Read from the test's declaration (:func:`logprob_registry.testing.sections.covers`) in ``cls``
    (default: :class:`BackendConformance`).

    Known before the test runs, unlike a missing device or dtype: a project running the suite over
    its own backends can deselect such tests instead of skipping them (this project's
    ``tests/conftest.py`` does); at run time the test skips with the same reason."""
    declared = coverage_of(cls or BackendConformance, test)
    if declared is None:
        return None
    ops = declared.ops_for(params)
    if not any(backend.supports(op) for op in ops):
        return f"{backend.name} does not implement {' or '.join(ops)}"
    if declared.grad and not backend.autograd:
        return f"{backend.name} declares autograd=False"
    flag, wanted = declared.capability, declared.declared
    if flag is not None and wanted is not None and bool(getattr(backend, flag)) != wanted:
        return f"{backend.name} declares {flag}={not wanted}"
    missing = [f for f in declared.features_for(params) if f not in backend.features]
    if missing:
        return f"{backend.name} does not declare feature {', '.join(missing)}"
    return None


class BackendConformance(Sections):
    """Base class of the conformance suite: set ``backend`` (and optionally ``device``).

    ``backend``: the registered name. None takes ``--logprob-backend`` from the command line.
    ``device``: a device type such as ``"cuda"``. None takes ``--logprob-device``, else the
    machine's main device when the backend runs there, else the backend's own device type (whose
    tests then skip, naming the device, on a machine without it).
    """

    backend: Optional[str] = None
    device: Optional[str] = None

    # ---------------------------------------------------------------- fixtures
    # Class-level fixtures (a classmethod under the fixture decorator): pytest 10 refuses
    # class-scoped fixtures written as instance methods.
    @pytest.fixture(scope="class")
    @classmethod
    def conformance_backend(cls, request) -> str:
        """The name of the backend under test (override, the same way, to parametrise over several)."""
        name = cls.backend or request.config.getoption("logprob_backend", default=None)
        if not name:
            raise pytest.UsageError(
                f"{cls.__name__} names no backend: set the class attribute backend = 'name' "
                "or run pytest with --logprob-backend NAME")
        return name

    @pytest.fixture(scope="class")
    @classmethod
    def lp(cls, request, conformance_backend) -> Harness:
        """The backend under test on its device (see :class:`~logprob_registry.testing.harness.Harness`)."""
        backend: Backend = get_registry().get(conformance_backend)
        device = cls.device or request.config.getoption("logprob_device", default=None) or default_device(backend)
        return Harness(backend, torch.device(device))
