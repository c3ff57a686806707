"""pytest plugin of logprob-registry's conformance suite (entry point ``pytest11``): the
command-line options that name the backend and device under test.

pytest loads it into every run in an environment where logprob-registry is installed, so it lives
outside the ``logprob_registry`` package (whose import imports torch) and imports nothing beyond
the standard library until a session collects conformance tests."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("logprob-registry", "logprob-registry conformance suite")
    group.addoption(
        "--logprob-backend", dest="logprob_backend", default=None, metavar="NAME",
        help="registered backend that logprob_registry.testing.BackendConformance subclasses "
             "without a 'backend' attribute test (logprob-registry check sets it)",
    )
    group.addoption(
        "--logprob-device", dest="logprob_device", default=None, metavar="DEVICE",
        help="device type the conformance suite runs on (default: the main device if the "
             "backend runs there, else the backend's own)",
    )


def pytest_report_header(config) -> list:
    backend = config.getoption("logprob_backend", default=None)
    device = config.getoption("logprob_device", default=None)
    if not backend and not device:
        return []
    return [f"logprob-registry conformance: backend={backend or '(per class)'} device={device or 'default'}"]


def pytest_collection_modifyitems(session, config, items) -> None:
    """When the session runs the conformance suite, pin glibc's mmap threshold before the first
    test, so that the suite's peak-memory readings count exactly what each call allocates."""
    if any(_is_conformance(item) for item in items):
        from logprob_registry.benchmark.memory import pin_mmap_threshold

        pin_mmap_threshold()


def _is_conformance(item) -> bool:
    cls = getattr(item, "cls", None)
    return cls is not None and any(
        c.__name__ == "BackendConformance" and c.__module__ == "logprob_registry.testing.suite" for c in cls.__mro__)
