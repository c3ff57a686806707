"""Plugins registered in process: one that raises or reuses a name is reported, never fatal."""

import subprocess
import sys

import pytest
import torch

import logprob_registry as lr
from logprob_registry.cli import main
from logprob_registry.registry import Key


def _op(*args, **kwargs):
    return None


class Good:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-good", ops={"logprobs": _op}))


class Raising:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-half-registered", ops={"logprobs": _op}))
        raise ImportError("needs libfoo.so")


class Duplicate:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-good", ops={"logprobs": _op}, priority=1000))
        register(lr.Backend(name="test-unique", ops={"logprobs": _op}))


class NotABackend:
    @lr.hookimpl
    def register_backends(self, register):
        register({"name": "dict-backend"})


def test_bad_plugins_are_reported_and_good_ones_kept(capsys):
    reg = lr.get_registry()
    plugins = {"test-good-plugin": Good(), "test-raising-plugin": Raising(),
               "test-duplicate-plugin": Duplicate(), "test-dict-plugin": NotABackend()}
    try:
        for name, plugin in plugins.items():
            reg.add_plugin(plugin, name=name, distribution=f"{name}-dist 0.1")
        names = [b.name for b in lr.backends()]
        assert "test-good" in names and "test-unique" in names
        assert "test-half-registered" not in names  # a plugin that raises contributes nothing
        assert lr.get_registry().get("test-good").origin == "test-good-plugin"  # the first one keeps the name
        errors = {f.plugin: f.error for f in reg.failures()}
        assert errors["test-raising-plugin"] == "raised while registering: ImportError: needs libfoo.so"
        assert errors["test-duplicate-plugin"] == (
            "backend name 'test-good' is already registered by test-good-plugin; this one is ignored")
        assert errors["test-dict-plugin"] == (
            "raised while registering: TypeError: register() takes a logprob_registry.Backend, got dict")
        report = str(lr.explain("logprobs", device="cpu"))
        assert "plugin test-raising-plugin (test-raising-plugin-dist 0.1) not loaded: raised while registering" in report
        assert main(["info"]) == 0
        out = capsys.readouterr().out
        assert "FAILED test-raising-plugin (test-raising-plugin-dist 0.1): raised while registering: ImportError: needs libfoo.so" in out
        assert "test-good-plugin" in out
    finally:
        for name in plugins:
            reg.remove_plugin(name)
    assert not any(f.plugin.startswith("test-") for f in reg.failures())


class BadPriority:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="test-bad-priority", ops={"logprobs": _op}, priority="10"))


def test_a_bad_field_is_a_failure_of_that_plugin_and_the_next_plugins_load(make_registry):
    reg = make_registry(("test-bad-priority-plugin", BadPriority()), ("test-good-plugin", Good()),
                        builtins=("logprob_registry.kernels.naive",))
    assert {b.name for b in reg.backends()} >= {"naive", "test-good"}
    (failure,) = reg.failures()
    assert failure.plugin == "test-bad-priority-plugin"
    assert failure.error.startswith("raised while registering: TypeError: backend 'test-bad-priority': priority "
                                    "must be an int")


def test_a_failing_builtin_module_is_reported(make_registry):
    reg = make_registry(builtins=("logprob_registry.kernels.naive", "logprob_registry.kernels.does_not_exist"))
    assert [b.name for b in reg.backends()] == ["naive"]
    (failure,) = reg.failures()
    assert failure.plugin == "builtin:does_not_exist"
    assert failure.error.startswith("failed to import: ModuleNotFoundError")


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="Bad Name", ops={"logprobs": _op}), "must be lowercase letters and digits joined by dashes"),
    (dict(name="x", ops={"logprob": _op}), r"declares unknown ops \['logprob'\]"),
    (dict(name="x", ops={}), "implements no op"),
    (dict(name="x", ops={"logprobs": 3}), "is 3, not a callable"),
    (dict(name="x", ops={"logprobs": _op}, devices={"GPU 0"}), r"devices must be device types such as 'cpu'"),
    (dict(name="x", ops={"logprobs": _op}, requires=("triton>=>3",)), r"requires entry 'triton>=>3' is not a requirement"),
    (dict(name="x", ops={"logprobs": _op}, features={"warp-drive"}), r"declares unknown features \['warp-drive'\]"),
    (dict(name="x", ops={"logprobs": _op}, torch="2.4"), "is not a version specifier such as '>=2.4'"),
    (dict(name="x", ops={"logprobs": _op}, dtypes={torch.int64}), "dtypes must be floating torch dtypes"),
])
def test_backend_record_rejects_mistakes(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        lr.Backend(**kwargs)


def test_backend_record_normalises():
    b = lr.Backend(name="x", ops={"logprobs": _op}, devices="cuda", requires="foo")
    assert b.devices == frozenset({"cuda"}) and b.requires == ("foo",)


def test_missing_required_module_reason(make_registry):
    class P:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="needs-lib", ops={"logprobs": _op}, requires=("surely_not_a_module_xyz",)))

    reg = make_registry(("p", P()))
    report = reg.explain(Key("logprobs", "cpu", torch.float32, False))
    assert report["needs-lib"].reason == "surely_not_a_module_xyz is not installed"


def test_import_is_light():
    """Importing the package compiles nothing and imports no kernel library."""
    code = ("import sys, logprob_registry as lr; "
            "print(sorted(m for m in ('triton', 'torch._inductor', 'torch_npu', 'liger_kernel') if m in sys.modules)); "
            "print(lr.get_registry().default.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == lr.select("logprobs", device="cpu").name


def test_deprecated_keywords_still_work_with_a_warning(make_registry):
    """triton=SPEC, available_on=f(env, device) and a one-argument available=f(env) keep working
    for one release, each with a DeprecationWarning naming the replacement."""
    from logprob_registry.environment import Environment

    with pytest.warns(DeprecationWarning, match=r'use requires=\("triton>=3.0",\)'):
        old_triton = lr.Backend(name="old-triton", ops={"logprobs": _op}, devices={"cuda"}, triton=">=3.0",
                                requires=("triton",))
    assert old_triton.requires == ("triton>=3.0",)
    with pytest.warns(DeprecationWarning, match=r"use available=f\(environment, device_type\)"):
        old_on = lr.Backend(name="old-on", ops={"logprobs": _op}, devices={"cpu", "cuda"},
                            available_on=lambda env, device: "no CUDA here" if device == "cuda" else None)
    with pytest.warns(DeprecationWarning, match=r"Backend\(available=f\(environment\)\) is deprecated"):
        old_one = lr.Backend(name="old-one", ops={"logprobs": _op}, available=lambda env: "never")

    class P:
        @lr.hookimpl
        def register_backends(self, register):
            for b in (old_triton, old_on, old_one):
                register(b)

    reg = make_registry(("p", P()), environment=Environment.fake(torch="2.6.0", devices={"cuda": 1}, triton="2.9"))
    cuda = reg.explain(Key("logprobs", "cuda", torch.float32, False))
    assert cuda["old-triton"].reason == "needs triton>=3.0, found 2.9"
    assert cuda["old-on"].reason == "no CUDA here"
    cpu = reg.explain(Key("logprobs", "cpu", torch.float32, False))
    assert cpu.chosen == "old-on" and cpu["old-one"].reason == "never"


def test_backend_repr_is_one_short_line():
    text = repr(lr.get_registry().get("chunked"))
    assert "\n" not in text and len(text) < 300
    assert text.startswith("<Backend 'chunked' priority=10, ")
    assert "from builtin:chunked" in text
