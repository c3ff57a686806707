"""What a conformance test covers: the :func:`covers` declaration and :func:`coverage_of`, which
reads it (a leaf module: the sections import it, and the package reads every section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple, TypeVar, Union

from ...backend import CAPABILITIES
from ...opspec import FEATURES, OPS

ATTRIBUTE = "__conformance_covers__"
F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Coverage:
    """What one conformance test covers.

    ``ops``: the ops it exercises. A test parametrised over ``op`` exercises the op of each of its
    cases (and ``ops`` lists them all); any other test needs one of ``ops`` (the first the backend
    implements).
    ``capability``: the ``Backend`` flag whose promise it checks; ``declared``: the value of that
    flag a backend must declare for the test to apply (None: it applies to every backend and
    checks whichever the backend declares, such as ``inplace_backward``, honoured either way).
    ``grad``: the test runs backward, so it applies only to backends that declare
    ``autograd=True`` (it covers that capability).
    ``features``: the ``opspec.FEATURES`` whose options it exercises (a backend must declare all).
    ``by_param``: features only some of its cases need, by parameter and value: ``(("form",
    (("hidden-bias", ("stats_hidden",)),)),)`` (:meth:`features_for`; :func:`covers` takes a mapping).
    """

    ops: Tuple[str, ...]
    capability: Optional[str] = None
    declared: Optional[bool] = None
    grad: bool = False
    features: Tuple[str, ...] = ()
    by_param: Tuple[Tuple[str, Tuple[Tuple[object, Tuple[str, ...]], ...]], ...] = ()

    @property
    def all_features(self) -> Tuple[str, ...]:
        """Every feature one of its cases exercises."""
        extra = tuple(f for _, values in self.by_param for _, fs in values for f in fs)
        return tuple(dict.fromkeys(self.features + extra))

    def features_for(self, params: Dict[str, object]) -> Tuple[str, ...]:
        """The features one case of the test needs a backend to declare (all of them)."""
        extra = tuple(f for name, values in self.by_param for value, fs in values
                      if name in params and params[name] == value for f in fs)
        return tuple(dict.fromkeys(self.features + extra))

    @property
    def capabilities(self) -> Tuple[str, ...]:
        """The capabilities whose promise the test checks."""
        return tuple(c for c in ((self.capability,) + (("autograd",) if self.grad else ())) if c)

    def ops_for(self, params: Dict[str, object]) -> Tuple[str, ...]:
        """The ops one case of the test needs a backend to implement (one of them)."""
        op = params.get("op")
        return (str(op),) if op is not None else self.ops


def covers(ops: Union[str, Iterable[str]], *, capability: Optional[str] = None, declared: Optional[bool] = None,
           grad: bool = False, features: Iterable[str] = (),
           by_param: Optional[Mapping[str, Mapping[object, Iterable[str]]]] = None) -> Callable[[F], F]:
    """Declare what the decorated conformance test covers (see :class:`Coverage`), e.g.
    ``@covers(LOGITS_OPS, capability="deterministic", declared=True, grad=True)``; ``by_param``: the
    features of the cases with a parameter's value, ``{"form": {"hidden-bias": ("stats_hidden",)}}``."""
    names = (ops,) if isinstance(ops, str) else tuple(ops)
    per_case = tuple((name, tuple((value, tuple(fs)) for value, fs in values.items()))
                     for name, values in (by_param or {}).items())
    every = tuple(features) + tuple(f for _, values in per_case for _, fs in values for f in fs)
    unknown = [o for o in names if o not in OPS] + [c for c in (capability,) if c and c not in CAPABILITIES] \
        + [f for f in every if f not in FEATURES]
    if unknown or not names:
        raise ValueError(f"covers(): unknown ops, capabilities or features {unknown} (or no op); the known "
                         "ones are in logprob_registry.opspec.OPS, backend.CAPABILITIES and opspec.FEATURES")
    if declared is not None and capability is None:
        raise ValueError("covers(): declared= needs the capability it is a value of")
    coverage = Coverage(names, capability, declared, grad, tuple(features), per_case)

    def mark(test: F) -> F:
        setattr(test, ATTRIBUTE, coverage)
        return test

    return mark


def coverage_of(cls: type, test: str) -> Optional[Coverage]:
    """The declaration of test ``test`` in ``cls`` or the nearest base class that declares it (a
    subclass that overrides a test without declaring it keeps the suite's declaration)."""
    for klass in cls.__mro__:
        found = getattr(klass.__dict__.get(test), ATTRIBUTE, None)
        if found is not None:
            return found
    return None


__all__ = ["ATTRIBUTE", "Coverage", "covers", "coverage_of"]
