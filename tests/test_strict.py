"""Strict mode (lr.strict(), LOGPROB_REGISTRY_STRICT=1): no run-time fallback, and only backends
that promise batch invariance and determinism (group invariance for the shard ops)."""

import asyncio
import threading
import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry.config import ConfigError
from logprob_registry.environment import Environment
from logprob_registry.registry import Key, NoEligibleBackendError, strict_in_force

raised = []


def exploding(logits, labels=None, **kwargs):
    """A kernel that fails at run time; each failure is kept, to check that strict mode raises it as is."""
    raised.append(RuntimeError("kernel exploded"))
    raise raised[-1]


def logsoftmax_gather(logits, labels, **kwargs):
    """A correct logprobs op, counting its calls (``ran``)."""
    ran.append("test-unpromised")
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]


ran = []


class Flaky:
    """A high-priority backend that makes every promise and fails at run time."""

    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-strict-flaky", ops={"logprobs": exploding}, priority=990,
                            batch_invariant=True, deterministic=True))


class Unpromised:
    """A high-priority backend that works but promises no batch invariance (the Backend default)."""

    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-unpromised", ops={"logprobs": logsoftmax_gather}, priority=990))


@pytest.fixture
def flaky(plug):
    raised.clear()
    reg = plug(Flaky(), "test-strict-flaky-plugin")
    yield reg
    reg.reset()  # its broken marks and cached selections go too (plug then removes the plugin)


@pytest.fixture
def unpromised(plug):
    ran.clear()
    return plug(Unpromised(), "test-unpromised-plugin")


def inputs():
    torch.manual_seed(0)
    return torch.randn(3, 11), torch.randint(0, 11, (3,))


def expected(logits, labels):
    return torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]


# ----------------------------------------------------------------------------- no fallback
def test_a_failing_backend_raises_under_strict_and_falls_back_without(flaky):
    logits, labels = inputs()
    with lr.strict():
        assert lr.select("logprobs", device="cpu", shape=logits.shape).name == "test-strict-flaky"
        with warnings.catch_warnings():
            warnings.simplefilter("error", lr.BackendFallbackWarning)
            with pytest.raises(RuntimeError, match="kernel exploded") as info:
                lr.logprobs_from_logits(logits, labels)
    assert info.value is raised[-1], "the backend's own exception, not a wrapper"
    assert flaky.broken() == {}, "strict mode marks nothing"
    assert lr.explain("logprobs", device="cpu", shape=logits.shape).chosen == "test-strict-flaky"
    # without strict mode: one warning, the next backend's result, the failure marked
    with pytest.warns(lr.BackendFallbackWarning, match="lr.strict"):
        out = lr.logprobs_from_logits(logits, labels)
    torch.testing.assert_close(out, expected(logits, labels))
    assert "test-strict-flaky" in next(iter(flaky.broken().values()))
    assert len(raised) == 2


def test_strict_mode_ignores_broken_marks(flaky):
    """A fallback taken earlier outside strict mode does not change what a strict call runs: the
    backend a fresh process would choose is tried again, and its error raised."""
    logits, labels = inputs()
    with pytest.warns(lr.BackendFallbackWarning):
        lr.logprobs_from_logits(logits, labels)
    assert flaky.broken()
    with lr.strict():
        report = lr.explain("logprobs", device="cpu", shape=logits.shape)
        assert report.chosen == "test-strict-flaky" and report["test-strict-flaky"].broken is None
        with pytest.raises(RuntimeError, match="kernel exploded"):
            lr.logprobs_from_logits(logits, labels)
    assert len(raised) == 2
    # outside again: the mark still holds, no second attempt
    with warnings.catch_warnings():
        warnings.simplefilter("error", lr.BackendFallbackWarning)
        torch.testing.assert_close(lr.logprobs_from_logits(logits, labels), expected(logits, labels))
    assert len(raised) == 2


# -------------------------------------------------------------------------- the promises
def test_a_backend_without_batch_invariance_is_never_chosen_under_strict(unpromised):
    logits, labels = inputs()
    shape = logits.shape
    assert lr.select("logprobs", device="cpu", shape=shape).name == "test-unpromised"
    with lr.strict():
        chosen = lr.select("logprobs", device="cpu", shape=shape).name
        assert chosen != "test-unpromised"
        torch.testing.assert_close(lr.logprobs_from_logits(logits, labels), expected(logits, labels))
        assert ran == []
        report = lr.explain("logprobs", device="cpu", shape=shape)
        assert report["test-unpromised"].status == "skipped"
        assert report["test-unpromised"].why == "strict mode: does not promise batch invariance"
        assert report.chosen == chosen and "(strict mode: lr.strict())" in str(report).splitlines()[0]
        assert "strict mode: does not promise batch invariance" in str(report)
    # the two choices are cached apart: each mode keeps its own
    assert lr.select("logprobs", device="cpu", shape=shape).name == "test-unpromised"
    lr.logprobs_from_logits(logits, labels)
    assert ran == ["test-unpromised"]
    assert "strict" not in str(lr.explain("logprobs", device="cpu", shape=shape))


def _never(*args, **kwargs):
    raise AssertionError("selection tests never run an op")


def test_each_promise_is_required_and_group_invariance_for_the_shard_ops(make_registry):
    ops = {"logprobs": _never, "shard_stats": _never}
    reg = make_registry(
        lr.Backend(name="fast-unordered", ops=ops, priority=40, batch_invariant=True, deterministic=False,
                   group_invariant=True),
        lr.Backend(name="batchy", ops=ops, priority=30, batch_invariant=False),
        lr.Backend(name="local-only", ops=ops, priority=20, batch_invariant=True),
        lr.Backend(name="everything", ops=ops, priority=10, batch_invariant=True, group_invariant=True),
        environment=Environment.fake(torch="2.6.0"),
    )
    logprobs = Key("logprobs", "cpu", torch.float32, False)
    shard = Key("shard_stats", "cpu", torch.float32, False)
    assert reg.select(logprobs).name == reg.select(shard).name == "fast-unordered"
    with lr.strict():
        assert reg.select(logprobs).name == "local-only"
        assert reg.select(shard).name == "everything"
        report = reg.explain(shard)
    assert report["fast-unordered"].why == "strict mode: does not promise determinism"
    assert report["batchy"].why == "strict mode: does not promise batch invariance or group invariance"
    assert report["local-only"].why == "strict mode: does not promise group invariance"
    assert report["everything"].status == "chosen"


def test_nothing_promising_raises_saying_how_to_fix(make_registry):
    reg = make_registry(lr.Backend(name="batchy", ops={"logprobs": _never}, batch_invariant=False),
                        environment=Environment.fake(torch="2.6.0"))
    key = Key("logprobs", "cpu", torch.float32, False)
    assert reg.select(key).name == "batchy"
    with lr.strict(), pytest.raises(NoEligibleBackendError, match=r"in strict mode \(lr.strict\(\)\).*"
                                    r"promises batch invariance and determinism.*lr.strict\(False\)"):
        reg.select(key)


# ------------------------------------------------------------------------ explicit choice
def test_an_explicit_choice_without_the_promises_raises_with_the_reason(unpromised, monkeypatch):
    logits, labels = inputs()
    fixes = (r"does not promise batch invariance\. Backends that can run it and make strict mode's promises here: "
             r".*naive.*lr.strict\(False\)")
    with lr.strict():
        with pytest.raises(NoEligibleBackendError, match=r"\(chosen by backend= argument\).*" + fixes):
            lr.logprobs_from_logits(logits, labels, backend="test-unpromised")
        with lr.use_backend("test-unpromised"):
            with pytest.raises(NoEligibleBackendError, match=r"\(chosen by use_backend\(\)\).*" + fixes):
                lr.logprobs_from_logits(logits, labels)
            report = lr.explain("logprobs", device="cpu", shape=logits.shape)
            assert report.chosen is None and report.forced == "test-unpromised (use_backend())"
        monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "test-unpromised")
        with pytest.raises(NoEligibleBackendError, match=r"LOGPROB_REGISTRY_BACKEND=test-unpromised.*" + fixes):
            lr.logprobs_from_logits(logits, labels)
        monkeypatch.delenv("LOGPROB_REGISTRY_BACKEND")
        # an explicit choice that makes the promises runs as usual
        torch.testing.assert_close(lr.logprobs_from_logits(logits, labels, backend="naive"), expected(logits, labels))
    assert ran == []
    lr.logprobs_from_logits(logits, labels, backend="test-unpromised")  # outside strict mode: it runs
    assert ran == ["test-unpromised"]


# --------------------------------------------------------------- the variable and nesting
def test_the_variable_turns_strict_mode_on_and_strict_false_off(unpromised, monkeypatch):
    logits, labels = inputs()
    shape = logits.shape
    assert not strict_in_force()
    monkeypatch.setenv("LOGPROB_REGISTRY_STRICT", "1")
    assert strict_in_force()
    assert lr.select("logprobs", device="cpu", shape=shape).name != "test-unpromised"
    assert "LOGPROB_REGISTRY_STRICT=1" in str(lr.explain("logprobs", device="cpu", shape=shape)).splitlines()[0]
    with lr.strict(False):
        assert not strict_in_force()
        assert lr.select("logprobs", device="cpu", shape=shape).name == "test-unpromised"
        with lr.strict():  # blocks nest: the innermost decides
            assert strict_in_force()
        assert not strict_in_force()
    assert strict_in_force()
    monkeypatch.setenv("LOGPROB_REGISTRY_STRICT", "off")
    assert not strict_in_force()
    assert lr.select("logprobs", device="cpu", shape=shape).name == "test-unpromised"
    monkeypatch.setenv("LOGPROB_REGISTRY_STRICT", "maybe")
    with pytest.raises(ConfigError, match="LOGPROB_REGISTRY_STRICT='maybe' is not a switch"):
        lr.logprobs_from_logits(logits, labels)
    assert ran == []
    with pytest.raises(TypeError, match="True or False"):
        with lr.strict("yes"):
            pass


# ------------------------------------------------------------------- threads and tasks
def test_strict_mode_holds_in_its_own_thread_only(unpromised):
    shape = (3, 11)
    inside, seen = threading.Barrier(2), {}

    def strict_thread():
        with lr.strict():
            inside.wait()  # both threads select at once: one in strict mode, one not
            seen["strict"] = lr.select("logprobs", device="cpu", shape=shape).name
            inside.wait()

    def plain_thread():
        inside.wait()
        seen["plain"] = lr.select("logprobs", device="cpu", shape=shape).name
        inside.wait()

    threads = [threading.Thread(target=strict_thread), threading.Thread(target=plain_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["plain"] == "test-unpromised" and seen["strict"] != "test-unpromised"

    with lr.strict():  # a thread started inside the block starts with a fresh context
        started = threading.Thread(target=lambda: seen.update(started=strict_in_force()))
        started.start()
        started.join()
    assert seen["started"] is False


def test_strict_mode_holds_in_its_own_asyncio_task_only(unpromised):
    async def one(strict):
        if strict:
            with lr.strict():
                await asyncio.sleep(0.01)  # the other task runs meanwhile
                return lr.select("logprobs", device="cpu", shape=(3, 11)).name
        await asyncio.sleep(0.005)
        return lr.select("logprobs", device="cpu", shape=(3, 11)).name

    async def both():
        return await asyncio.gather(one(True), one(False))

    strict_choice, plain_choice = asyncio.run(both())
    assert plain_choice == "test-unpromised" and strict_choice != "test-unpromised"


# ------------------------------------------------------------------------- process_group
class ShardBackends:
    """Two wrappers of chunked's shard_stats: one without the group-invariance promise (higher
    priority), one with it; ``ran`` records which ran."""

    @lr.hookimpl
    def register_backends(self, register):
        stats = lr.get_registry().get("chunked").ops["shard_stats"]

        def recording(name):
            return lambda *args, **kwargs: ran.append(name) or stats(*args, **kwargs)

        register(lr.Backend(name="test-group-variant", ops={"shard_stats": recording("test-group-variant")},
                            priority=990, batch_invariant=True))
        register(lr.Backend(name="test-group-invariant", ops={"shard_stats": recording("test-group-invariant")},
                            priority=980, batch_invariant=True, group_invariant=True))


def test_a_process_group_call_under_strict_takes_a_group_invariant_backend(world):
    ran.clear()
    reg = lr.get_registry()
    reg.add_plugin(ShardBackends(), name="test-shard-plugin")
    try:
        logits, labels = inputs()
        out = lr.logprobs_from_logits(logits, labels, process_group=world)
        assert ran == ["test-group-variant"]
        with lr.strict():
            strict_out = lr.logprobs_from_logits(logits, labels, process_group=world)
        assert ran == ["test-group-variant", "test-group-invariant"]
        torch.testing.assert_close(strict_out, out)
        torch.testing.assert_close(out, expected(logits, labels))
    finally:
        reg.remove_plugin("test-shard-plugin")
