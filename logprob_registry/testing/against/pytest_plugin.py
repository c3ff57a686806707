"""The pytest plugin of ``check --against``'s suite process (``-p`` loads it; not an entry point).

It reads the target from ``LOGPROB_REGISTRY_AGAINST``, registers the temporary backend before the
suite's fixtures look it up, deselects the cases the convention cannot express (an op it does not
stand for, a feature or promise it lacks: ``suite.not_declared``), turns a
:class:`~logprob_registry.testing.against.NotExpressible` raised by the adapter at run time (a
temperature for a function that takes none, say) into a skip that says so, and writes each failed
case's message and each case not expressible to the report file the parent reads.
"""

from __future__ import annotations

import json
import os

import pytest

from . import ENV, register_target
from .conventions import NotExpressible

_spec: dict = {}
_failed: dict = {}
_not_expressible: dict = {}


def pytest_configure(config) -> None:
    raw = os.environ.get(ENV)
    if not raw:
        return
    _spec.update(json.loads(raw))
    register_target(_spec)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    if not _spec:
        return
    from logprob_registry.registry import get_registry

    from ..suite import BackendConformance, not_declared

    backend = get_registry().get(_spec["name"])
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        reason = None
        if cls is not None and issubclass(cls, BackendConformance):
            reason = not_declared(backend, item.originalname, params, cls)
        if reason is None:
            keep.append(item)
        else:
            drop.append(item)
            _not_expressible[item.name] = reason.replace(backend.name, _spec["signature"], 1).replace(
                "does not implement", "stands for no op")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except NotExpressible as exc:
        pytest.skip(f"not expressible: {exc}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _spec and report.failed:
        text = ""
        if call.excinfo is not None:
            text = f"raised {call.excinfo.typename}: {call.excinfo.value}" \
                if call.excinfo.typename != "AssertionError" else str(call.excinfo.value)
        _failed[item.name] = (text or str(report.longrepr))[:2000]
    elif _spec and report.skipped and call.when == "call" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
        message = message[len("Skipped: "):] if message.startswith("Skipped: ") else message
        if message.startswith("not expressible: "):
            _not_expressible[item.name] = message[len("not expressible: "):]
    return report


def pytest_sessionfinish(session, exitstatus) -> None:
    if _spec.get("report"):
        with open(_spec["report"], "w") as f:
            json.dump({"failed": _failed, "not_expressible": _not_expressible}, f)
