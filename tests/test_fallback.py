"""Run-time fallback: automatic choices fall back with one warning; explicit choices raise."""

import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.registry import Key

calls = []


def failing(logits, labels=None, name="test-flaky", **kwargs):
    calls.append(name)
    raise RuntimeError("kernel exploded")


def out_of_memory(logits, labels, **kwargs):
    calls.append("test-oom")
    raise torch.OutOfMemoryError("out of memory")


class Flaky:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-flaky", ops={"logprobs": failing, "entropy": failing}, priority=990))


@pytest.fixture
def flaky(plug):
    calls.clear()
    return plug(Flaky(), "test-flaky-plugin")


def inputs():
    torch.manual_seed(0)
    return torch.randn(3, 11), torch.randint(0, 11, (3,))


def test_automatic_choice_falls_back_with_one_warning(flaky, monkeypatch):
    logits, labels = inputs()
    # the next after test-flaky for this call's vocabulary (11: naive's bucket, see min_vocab); naive
    # breaks the memory promise test-flaky keeps, so it is eligible only without test-flaky (or with
    # speed over memory)
    monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "speed")
    fallback = [c.name for c in lr.explain("logprobs", device="cpu", shape=logits.shape).candidates if c.eligible][1]
    monkeypatch.delenv("LOGPROB_REGISTRY_MEMORY")
    assert lr.select("logprobs", device="cpu", shape=logits.shape).name == "test-flaky"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = lr.logprobs_from_logits(logits, labels)
    record = [w for w in record if issubclass(w.category, lr.BackendFallbackWarning)]
    assert len(record) == 1
    assert record[0].filename == __file__, "the warning points at the caller's line"
    message = str(record[0].message)
    assert "backend 'test-flaky' failed for logprobs on cpu float32 tensors, vocabularies of 1 to 256 (RuntimeError: kernel exploded)" in message
    assert f"using {fallback!r} instead" in message
    expected = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out, expected)
    # Marked broken for that key: no second attempt, no second warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", lr.BackendFallbackWarning)
        lr.logprobs_from_logits(logits, labels)
    assert calls == ["test-flaky"]
    report = lr.explain("logprobs", device="cpu", shape=logits.shape)  # the kind of call that failed
    assert report["test-flaky"].status == "broken"
    assert "failed at run time: RuntimeError: kernel exploded" in str(report)
    assert report.chosen == fallback
    # Other keys are not affected: it is tried again (and falls back again) for float64.
    with pytest.warns(lr.BackendFallbackWarning):
        lr.logprobs_from_logits(logits.double(), labels)
    assert calls == ["test-flaky", "test-flaky"]
    # reset() forgets the marks: the backend is tried again.
    flaky.reset()
    assert lr.explain("logprobs", device="cpu", shape=logits.shape)["test-flaky"].status == "chosen"


def test_a_cached_choice_failing_later_falls_back_and_so_does_its_replacement(flaky):
    """A choice that ran (so cached: the common call's short path, issue #36) and fails on a later
    call falls back as a first call does; when the replacement fails too, the next one runs, one
    warning for each failure."""
    runs = []

    def later(logits, labels, **kwargs):
        runs.append("test-later")
        if len(runs) > 1:
            raise RuntimeError("kernel exploded later")
        return torch.zeros(labels.shape)

    class Later:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="test-later", ops={"logprobs": later}, priority=995))

    registry = lr.get_registry()
    registry.add_plugin(Later(), name="test-later-plugin")
    try:
        logits, labels = inputs()
        assert torch.equal(lr.logprobs_from_logits(logits, labels), torch.zeros(3))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = lr.logprobs_from_logits(logits, labels)
        messages = [str(w.message) for w in record if issubclass(w.category, lr.BackendFallbackWarning)]
        assert len(messages) == 2 and "'test-later' failed" in messages[0] and "'test-flaky' failed" in messages[1]
        torch.testing.assert_close(out, torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0])
        assert runs == ["test-later"] * 2 and calls == ["test-flaky"]
        assert set(registry.broken()[lr.explain("logprobs", device="cpu", shape=logits.shape).key]) == {
            "test-later", "test-flaky"}
    finally:
        registry.remove_plugin("test-later-plugin")


def test_the_last_eligible_backend_is_never_marked_broken(make_registry):
    """With nothing to fall back to, the backend's own error reaches the caller and nothing is
    marked: the next call tries it again instead of raising NoEligibleBackendError for good."""
    calls.clear()

    class Alone:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="test-alone", ops={"entropy": lambda x, **kw: failing(x, name="test-alone")},
                                devices={"my_accel"}))

    from logprob_registry.environment import Environment

    reg = make_registry(("alone", Alone()), environment=Environment.fake(torch="2.6.0", devices={"my_accel": 1}))
    key = Key("entropy", "my_accel", torch.float32, False)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="kernel exploded"):
            reg.call(key, None, (torch.zeros(2, 3),), {"temperature": 1.0})
    assert calls == ["test-alone"] * 2
    assert reg.broken() == {}


def test_explicit_choice_raises_instead(flaky, monkeypatch):
    logits, labels = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="kernel exploded"):
            lr.logprobs_from_logits(logits, labels, backend="test-flaky")
        with lr.use_backend("test-flaky"), pytest.raises(RuntimeError, match="kernel exploded"):
            lr.entropy_from_logits(logits)
        monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "test-flaky")
        with pytest.raises(RuntimeError, match="kernel exploded"):
            lr.logprobs_from_logits(logits, labels)
    assert calls == ["test-flaky"] * 3
    assert lr.explain("logprobs", device="cpu")["test-flaky"].status != "broken"


def test_bad_input_never_triggers_a_fallback(flaky):
    logits, labels = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="out of range"):
            lr.logprobs_from_logits(logits, labels + 100)
    assert calls == []


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"),
    RuntimeError("NPU out of memory. Tried to allocate 1.00 GiB"),
])
def test_out_of_memory_on_any_device_is_not_a_backend_fault(error):
    from logprob_registry.registry import caller_fault

    assert caller_fault(error) == "out of memory"
    assert caller_fault(RuntimeError("kernel exploded")) is None


def test_out_of_memory_is_not_a_backend_fault():
    calls.clear()

    class Oom:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="test-oom", ops={"logprobs": out_of_memory}, priority=995))

    reg = lr.get_registry()
    reg.add_plugin(Oom(), name="test-oom-plugin")
    try:
        logits, labels = inputs()
        with pytest.raises(torch.OutOfMemoryError):
            lr.logprobs_from_logits(logits, labels)
        assert reg.explain(Key("logprobs", "cpu", torch.float32, False))["test-oom"].status == "chosen"
    finally:
        reg.remove_plugin("test-oom-plugin")


# --------------------------------------------------------------------------- degradations
class Degrading:
    """A backend whose report says its bf16 CPU path runs degraded, and one whose report raises."""

    def __init__(self):
        self.state = [kit.Degradation("the bf16 path runs in float32", "its bf16 kernel failed to build", "cpu",
                                     torch.bfloat16)]

    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-degrading", ops={"logprobs": lambda *a, **k: None}, priority=-5,
                            degradations=lambda: list(self.state)))
        register(lr.Backend(name="test-bad-report", ops={"logprobs": lambda *a, **k: None}, priority=-6,
                            degradations=lambda: 1 / 0))


def test_a_backend_reports_a_degradation_and_explain_and_info_show_it(make_registry):
    from logprob_registry.report import info

    plugin = Degrading()
    reg = make_registry(("degrading", plugin), builtins=("logprob_registry.kernels.naive",))
    found = reg.degradations()
    assert [(d.backend, d.what) for d in found] == [
        ("test-degrading", "the bf16 path runs in float32"), ("test-bad-report", "its degradations() report")]
    assert found[1].reason == "raised ZeroDivisionError: division by zero" and found[1].device is None
    bf16 = reg.explain(Key("logprobs", "cpu", torch.bfloat16, False))
    assert [d.backend for d in bf16.degradations] == ["test-degrading", "test-bad-report"]
    assert ("degraded: test-degrading: the bf16 path runs in float32: its bf16 kernel failed to build"
            in str(bf16).splitlines())
    fp32 = reg.explain(Key("logprobs", "cpu", torch.float32, False))  # not its dtype: not shown
    assert [d.backend for d in fp32.degradations] == ["test-bad-report"]
    text = info(reg)
    assert "degradations: backends running below their best in this process" in text
    assert text.count("test-degrading: the bf16 path runs in float32") == 1  # once, not under every table
    plugin.state = []
    assert [d.backend for d in reg.degradations()] == ["test-bad-report"]  # the backend's state is the record
    reg.remove_plugin("degrading")
    assert reg.degradations() == [] and "degradations: none" in info(reg)


def test_compiled_reports_a_backward_it_runs_eagerly(monkeypatch):
    """compiled's eager backward, after its kernel failed to compile late, is a degradation that
    explain and info show, until compiled.reset()."""
    from logprob_registry.kernels import compiled
    from logprob_registry.kernels.compiled import _kernels, _ops

    if lr.explain("logprobs", device="cpu")["compiled"].reason is not None:
        pytest.skip(lr.explain("logprobs", device="cpu")["compiled"].reason)

    def kernel(name):  # eager forward kernels (no compile); every backward kernel fails to compile
        if name.startswith("bwd"):
            raise RuntimeError("no compiler today")
        return _kernels.KERNELS[name]

    compiled.reset()
    monkeypatch.setattr(_kernels, "_kernel", kernel)
    monkeypatch.setattr(_kernels, "_noticed", set())
    monkeypatch.setattr(_ops, "_warm_backward", lambda *a: None)  # as for a layout first met in backward
    try:
        logits, labels = inputs()
        x = logits.detach().requires_grad_(True)
        with pytest.warns(lr.BackendFallbackWarning, match="run the same math eagerly"):
            lr.logprobs_from_logits(x, labels, backend="compiled").sum().backward()
        ref = logits.double().requires_grad_(True)
        torch.log_softmax(ref, -1).gather(-1, labels[..., None]).sum().backward()
        torch.testing.assert_close(x.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
        found = [d for d in lr.get_registry().degradations() if d.backend == "compiled"]
        assert len(found) == 1 and found[0].device == "cpu" and found[0].dtype == torch.float32
        assert "the backward of logprobs on cpu float32 logits runs eagerly" in found[0].what
        assert "no compiler today" in found[0].reason
        text = str(lr.explain("logprobs", device="cpu", requires_grad=True))
        assert "degraded: compiled: the backward of logprobs on cpu float32 logits runs eagerly" in text
        assert "degraded:" not in str(lr.explain("logprobs", device="cpu", dtype=torch.float64))
    finally:
        compiled.reset()
    assert [d for d in lr.get_registry().degradations() if d.backend == "compiled"] == []
