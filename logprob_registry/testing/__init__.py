"""The conformance suite that every backend must pass, shipped for plugin authors and users.

Subclass :class:`BackendConformance` in your own tests and name your backend, or run
``logprob-registry check --backend NAME``. The pytest plugin (the top-level module
``logprob_registry_pytest``, registered through the ``pytest11`` entry point) adds
``--logprob-backend`` and ``--logprob-device``. This package is
import-light: torch and pytest are imported only when the suite itself is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackendConformance", "assert_close", "tolerance", "suite_path"]


def suite_path() -> str:
    """The test module that runs the suite against the backend named by ``--logprob-backend``."""
    import os

    return os.path.join(os.path.dirname(__file__), "selected.py")


def __getattr__(name: str) -> Any:
    if name == "BackendConformance":
        from .suite import BackendConformance

        return BackendConformance
    if name in ("assert_close", "tolerance"):
        from .. import numerics

        return getattr(numerics, name)
    raise AttributeError(f"module 'logprob_registry.testing' has no attribute {name!r}")
