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
