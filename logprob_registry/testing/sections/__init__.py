"""The sections of the conformance suite, and what each test covers.

:class:`~logprob_registry.testing.BackendConformance` is the sum of its sections, one mixin class
per part of the contract (:mod:`.logits`: the ops over logits; :mod:`.hidden`: the fused
``logprobs_from_hidden``; :mod:`.distill`: ``kl_divergence``; :mod:`.table`: what the op table alone says
of every public op, a new op included; :mod:`.peers`: the peers' known failures, each naming its issue);
a new part of the contract is a new section that the base class inherits. Every test declares, with
:func:`covers`, which ops it exercises and which backend capability
(``logprob_registry.backend.CAPABILITIES``) or feature (``opspec.FEATURES``) it checks.
Two things read the declarations:

- :func:`logprob_registry.testing.suite.not_declared`: whether a test checks something a backend
  does not declare (so that a project can deselect it before it runs, and the test skips with the
  same reason when it runs);
- :func:`covering_tests`: which tests cover an op, a capability or a feature (this project's
  tests require at least one for each, so that a new op without conformance tests fails CI).
"""

from __future__ import annotations

from typing import Dict, Optional

from ._coverage import Coverage, coverage_of, covers
from .distill import DistillSection
from .distributed import DistributedSection
from .hidden import HiddenSection
from .logits import LogitsSection
from .peers import PeersSection
from .semantics import SemanticsSection
from .stats import StatsSection
from .table import TableSection


class Sections(TableSection, LogitsSection, HiddenSection, SemanticsSection, DistillSection, DistributedSection,
               PeersSection, StatsSection):
    """Every section: the suite's tests without its fixtures (:class:`BackendConformance
    <logprob_registry.testing.BackendConformance>` adds those)."""


def coverage(cls: Optional[type] = None) -> Dict[str, Coverage]:
    """``{test name: Coverage}`` for every test of ``cls`` (default: the whole suite)."""
    cls = Sections if cls is None else cls
    found: Dict[str, Coverage] = {}
    for name in dir(cls):
        if name.startswith("test"):
            declared = coverage_of(cls, name)
            if declared is not None:
                found[name] = declared
    return found


def covering_tests(op: Optional[str] = None, capability: Optional[str] = None, feature: Optional[str] = None,
                   cls: Optional[type] = None) -> list:
    """The names of the suite's tests that cover ``op``, ``capability`` and ``feature`` (each
    given one a condition), sorted."""
    return sorted(
        name for name, c in coverage(cls).items()
        if (op is None or op in c.ops)
        and (capability is None or capability in c.capabilities)
        and (feature is None or feature in c.all_features)
    )


__all__ = ["Coverage", "Sections", "covers", "coverage", "coverage_of", "covering_tests"]
