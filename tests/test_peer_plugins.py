"""plugins/trl and plugins/torch-lce: peers' kernels as backends, found through their entry points
(each module written with a ``.dist-info`` into a folder of its own, as pip would install it) and
judged by ``logprob-registry check --backend``. What they declare is what the suite measured: the
checks below pin the outcome, failures included (they are TRL's and torch's, named)."""

import importlib.util

import pytest
import torch
from plugin_dists import ROOT, make_dist, run_python


def _site(tmp_path, folder, dist, module):
    source = (ROOT / "plugins" / folder / f"{module}.py").read_text()
    return make_dist(tmp_path / folder, dist, module, source)


def _rows(stdout):
    return {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.split() and line.split()[-1] in ("pass", "FAIL")}


def _failures(stdout, backend):
    return [line for line in stdout.splitlines() if line.startswith(f"{backend}: FAILED ")]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the peers extra)")
def test_trl_backends(tmp_path):
    site = _site(tmp_path, "trl", "logprob-registry-trl", "logprob_registry_trl")
    proc = run_python(["-m", "logprob_registry", "check", "--backend", "trl", "--backend", "trl-chunked"], site)
    rows = _rows(proc.stdout)
    assert set(rows) == {"trl", "trl-chunked"}, proc.stdout + proc.stderr
    assert int(rows["trl"][2]) > 150 and int(rows["trl-chunked"][2]) > 50, proc.stdout
    # what TRL 1.16 gets wrong on the CPU: a NaN entropy where logits are -inf (masked vocabulary),
    # and the chunked head's backward cannot run twice on one graph; nothing else
    for line in _failures(proc.stdout, "trl"):
        assert ("negative_infinity" in line or "negative-infinity" in line) and "NaN mismatch" in line, line
    for line in _failures(proc.stdout, "trl-chunked"):
        assert ("masked-vocabulary" in line and "NaN" in line) or "modified by an inplace operation" in line, line


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"),
                    reason=f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
def test_torch_lce_backends(tmp_path):
    site = _site(tmp_path, "torch-lce", "logprob-registry-torch-lce", "logprob_registry_torch_lce")
    proc = run_python(["-m", "logprob_registry", "check", "--backend", "torch-lce", "--backend",
                       "torch-lce-chunked"], site)
    rows = _rows(proc.stdout)
    assert set(rows) == {"torch-lce", "torch-lce-chunked"}, proc.stdout + proc.stderr
    for name in rows:
        assert int(rows[name][2]) > 30, proc.stdout
        # the only departure: torch's linear_cross_entropy has no entropy (return_entropy=True raises)
        for line in _failures(proc.stdout, name):
            assert "gives no entropy" in line, line


def test_liger_conventions_without_liger_kernel():
    """Liger's conventions exist without liger-kernel; their backend names the package it needs."""
    from logprob_registry.testing.against import CONVENTIONS

    for name in ("liger-ce", "liger-flce", "liger-flsce"):
        assert "liger-kernel" in CONVENTIONS[name].requires


def _peer_modules(tmp_path, monkeypatch):
    """Both peers' modules importable from their own folders, as pip would install them."""
    for folder, dist, module in (("trl", "logprob-registry-trl", "logprob_registry_trl"),
                                 ("torch-lce", "logprob-registry-torch-lce", "logprob_registry_torch_lce")):
        monkeypatch.syspath_prepend(str(_site(tmp_path, folder, dist, module)))
    return ["logprob_registry_trl", "logprob_registry_torch_lce"]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None or not hasattr(torch.nn.functional, "linear_cross_entropy"),
                    reason="needs trl (the peers extra) and torch >= 2.13's linear_cross_entropy")
def test_bench_lists_the_peers_beside_the_builtins(tmp_path, monkeypatch):
    """``bench --op logprobs_from_hidden`` measures the peers' backends as it does the built-ins; in
    bf16, which they do not declare, only with --undeclared, marked '!', on the validated call."""
    import logprob_registry as lr
    from logprob_registry.benchmark import BenchError, settings, workload
    from logprob_registry.benchmark.plugins import register_plugins, unregister_plugins
    from logprob_registry.benchmark.session import methods

    names = register_plugins(_peer_modules(tmp_path, monkeypatch))
    try:
        peers = {"trl-chunked", "torch-lce", "torch-lce-chunked"}
        fp32 = settings.Setting(op="logprobs_from_hidden", device="cpu", dtype="float32", shape=(1, 6, 300),
                                hidden_size=8, backward=True)
        listed = {m["name"]: m["kind"] for m in methods(fp32, ())[0]}
        assert peers | {"baseline", "chunked", "naive"} <= set(listed) and listed["trl-chunked"] == "backend"
        bf16 = settings.Setting(**dict(fp32.to_args(), dtype="bfloat16"))
        assert not peers & set(m["name"] for m in methods(bf16, ())[0])
        with pytest.raises(BenchError, match="does not accept bfloat16.*--undeclared measures it anyway"):
            methods(bf16, ("trl-chunked",))
        found = {m["name"]: m for m in methods(bf16, (), undeclared=True)[0]}
        assert {p + "!" for p in peers} <= set(found) and "chunked" in found
        assert found["trl-chunked!"]["kind"] == "undeclared" and "accepts float32" in found["trl-chunked!"]["description"]
        # the kernel on the validated call: the same numbers as the public call in a declared dtype ...
        ex = fp32.spec.example(fp32.shape, torch.float32, "cpu", seed=4, hidden_size=8)
        for name in peers:
            (got,) = workload.method(fp32, name + "!")(ex.inputs)
            want = lr.logprobs_from_hidden(ex.inputs["hidden"], ex.inputs["weight"], ex.inputs["labels"], backend=name)
            assert torch.equal(got, want), name
        # ... and a bad input still raises the call's own error
        bad = dict(ex.inputs, labels=ex.inputs["labels"] + 300)
        with pytest.raises(ValueError, match="out of range"):
            workload.method(fp32, "trl-chunked!")(bad)
    finally:
        unregister_plugins(names)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the peers extra)")
def test_bench_table_of_a_peer_in_bf16(tmp_path):
    """The command: a peer's row in bf16 has its time, peak memory and error against float64 (TRL's
    chunked head multiplies in bf16 off CUDA: far above the built-in's float32 accumulation)."""
    site = _site(tmp_path, "trl", "logprob-registry-trl", "logprob_registry_trl")
    proc = run_python(["-m", "logprob_registry", "bench", "--op", "logprobs_from_hidden", "--device", "cpu",
                       "--shape", "1,16,1024", "--hidden-size", "16", "--dtype", "bfloat16", "--undeclared",
                       "--backend", "trl-chunked", "--backend", "chunked", "--repeat", "1", "--warmup", "0",
                       "--threads", "1"], site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line.split("  ") for line in lines if line.startswith("method "))
    assert [h.strip() for h in header if h.strip()][:7] == ["method", "time", "IQR", "speed-up", "peak memory",
                                                            "vs baseline", "max |diff|"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("trl-chunked!", "chunked"))}
    assert set(rows) == {"trl-chunked!", "chunked"}, proc.stdout
    assert rows["trl-chunked!"][2] in ("us", "ms", "s") and rows["trl-chunked!"][-3] == "MiB", rows
    assert float(rows["trl-chunked!"][-1]) > 1e-3 > 1e-5 > float(rows["chunked"][-1]), proc.stdout
    assert any(line.startswith("! outside the dtypes the backend declares") for line in lines), proc.stdout
