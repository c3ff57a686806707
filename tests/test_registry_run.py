"""The registry says who ran (``Registry.run``), checks a shard op's outputs against the op table
once, pre-selects a later call's backend (``preselect``), and sits below ``tuning``."""

import ast
import warnings
from pathlib import Path

import pytest
import torch

import logprob_registry as lr
from logprob_registry.environment import Environment
from logprob_registry.registry import BackendFallbackWarning, Expected, Key, NoEligibleBackendError, Registry

ROOT = Path(__file__).resolve().parents[1]


def _registry(ops_a, ops_b=None):
    class Plugin:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="first", ops=ops_a, priority=20))
            if ops_b is not None:
                register(lr.Backend(name="second", ops=ops_b, priority=10))

    reg = Registry(builtins=(), entry_points=False, environment=Environment.fake(torch="2.6.0"))
    reg.add_plugin(Plugin(), name="plugin")
    return reg


def _fails(*args, **kwargs):
    raise RuntimeError("kernel exploded")


def test_run_names_the_backend_that_ran_after_a_fallback_too():
    key = Key("entropy", "cpu", torch.float32, False)
    x = torch.zeros(2, 3)
    reg = _registry({"entropy": lambda x, **kw: x.sum(-1)}, {"entropy": lambda x, **kw: x.sum(-1) + 1})
    backend, out = reg.run(key, None, (x,), {"temperature": 1.0})
    assert backend.name == "first" and torch.equal(out, torch.zeros(2))
    backend, out = reg.run(key, "second", (x,), {"temperature": 1.0})
    assert backend.name == "second" and torch.equal(out, torch.ones(2))
    reg = _registry({"entropy": _fails}, {"entropy": lambda x, **kw: x.sum(-1) + 1})
    with pytest.warns(BackendFallbackWarning, match="'first' failed"):
        backend, out = reg.run(key, None, (x,), {"temperature": 1.0})
    assert backend.name == "second" and torch.equal(reg.call(key, None, (x,), {"temperature": 1.0}), out)


def test_a_shard_op_returning_the_wrong_outputs_is_named_once_by_the_registry():
    x = torch.zeros(2, 3)
    stats = Key("shard_stats", "cpu", torch.float32, False)
    grad = Key("shard_grad", "cpu", torch.float32, False)
    reg = _registry({"shard_stats": lambda *a, **kw: (x, x), "shard_grad": lambda *a, **kw: (x, x)})
    with pytest.raises(RuntimeError, match=r"backend 'first': shard_stats returned a tuple of 2, not the 4-tuple "
                                           r"\(tile_max, tile_sumexp, tile_elog, label_logits\) the op table"):
        reg.call(stats, None, (x, None), {})
    with pytest.raises(RuntimeError, match=r"backend 'first': shard_grad returned a tuple of 2, not one tensor "
                                           r"\(grad_logits\)"):
        reg.run(grad, None, (x,) * 6, {})
    reg = _registry({"shard_stats": lambda *a, **kw: (x, x, None, None), "shard_grad": lambda *a, **kw: x.double()})
    with pytest.raises(RuntimeError, match=r"shard_stats returned tile_sumexp of shape \(2, 3\), expected 2 rows"):
        reg.run(stats, None, (x, None), {}, (Expected((2, 3), flat=True), Expected((2, 1), flat=True,
                                                                                     words="2 rows x 1 tiles")))
    with pytest.raises(RuntimeError, match=r"shard_grad returned grad_logits of shape \(2, 3\) and dtype "
                                           r"torch.float64, expected shape \(2, 3\) and dtype torch.float32"):
        reg.run(grad, None, (x,) * 6, {}, (Expected((2, 3), torch.float32),))
    backend, out = reg.run(stats, None, (x, None), {}, (Expected((6,), flat=True), None, None, None))
    assert backend.name == "first" and out[2] is None  # None entries: not checked


def test_preselect_checks_now_and_pins_the_explicit_choice_in_force(monkeypatch):
    key = Key("entropy", "cpu", torch.float32, False)
    reg = _registry({"entropy": _fails}, {"entropy": _fails})
    assert reg.preselect(key) is None                    # automatic: chosen again at the later call
    assert reg.preselect(key, "second") == "second"
    monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "second")
    assert reg.preselect(key) == "second"                # the name, for a backward run wherever it is
    monkeypatch.delenv("LOGPROB_REGISTRY_BACKEND")
    with pytest.raises(NoEligibleBackendError, match="cannot run shard_grad"):
        reg.preselect(Key("shard_grad", "cpu", torch.float32, False), "first")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.broken() == {}


def test_the_registry_never_imports_tuning_and_the_package_wires_the_tuning_file():
    for path in sorted((ROOT / "logprob_registry" / "registry").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "tuning" not in (node.module or ""), f"{path.name} imports {node.module}"
    from logprob_registry.tuning.cache import Tuning

    assert isinstance(lr.get_registry().ranking, Tuning)
    assert Registry(builtins=(), entry_points=False).ranking is None
