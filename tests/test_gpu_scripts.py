"""The prepared GPU run (scripts/gpu_check.sh, scripts/gpu_proof.py) stays runnable: its proofs'
dry run on the CPU with small shapes, and its merge and summary of bench documents. The GPU run
itself needs a GPU (docs/hardware.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROOF = ROOT / "scripts" / "gpu_proof.py"


def _run(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(PROOF), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_shell_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_proofs_dry_run_merge_and_summary(tmp_path):
    proc = _run("--device", "cpu", "--quick", "--backend", "naive,chunked", "--json", str(tmp_path / "proof.json"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    verdicts = {r["check"]: r["ok"] for r in json.loads((tmp_path / "proof.json").read_text())}
    assert verdicts == {"past_int32 naive": True, "past_int32 chunked": True, "cuda_graph": None,
                        "batch_invariance naive": True, "batch_invariance chunked": True}
    assert "4 passed, 0 failed, 1 not run" in proc.stdout
    result = dict(name="triton", kind="backend", status="ok", error=None, automatic_choice=True, time_median_s=1e-3,
                  bandwidth_bytes_per_s=2.4e12, bandwidth_fraction=0.5, peak_bytes=2**20, max_abs_diff=1e-6,
                  max_abs_diff_grad=None)
    base = dict(result, name="baseline", kind="baseline", automatic_choice=False, time_median_s=3e-3)
    run = dict(settings=dict(op="logprobs", shape=[16, 1024, 32768], dtype="float32", backward=False), results=[base, result])
    for i in (1, 2):
        doc = dict(environment=dict(device_name="NVIDIA H200", torch="2.11.0", triton="3.6.0", python="3.12.3"),
                   created="2026-12-02", options={"n": i}, runs=[run])
        (tmp_path / f"part{i}.json").write_text(json.dumps(doc))
    assert _run("merge", str(tmp_path / "bench.json"), str(tmp_path / "part1.json"), str(tmp_path / "part2.json"),
                str(tmp_path / "missing.json")).returncode == 0
    merged = json.loads((tmp_path / "bench.json").read_text())
    assert len(merged["runs"]) == 2 and merged["commands"] == [{"n": 1}, {"n": 2}]
    summary = _run("summary", str(tmp_path))
    assert summary.returncode == 0, summary.stderr
    assert "| logprobs | 16x1024x32768 | float32 | fwd | triton * | 1.0 ms | 2400 | 50% | 1.0 MiB | 1.0e-06 | - |" \
        in summary.stdout
    assert "seed comparison: triton 1.000 ms, 3.00x the textbook baseline" in summary.stdout
    assert "| cuda_graph | not run | skipped=CUDA graphs need a CUDA device, not cpu |" in summary.stdout


@pytest.mark.parametrize("args", [["merge", "/nonexistent/out.json", "/nonexistent/a.json"], ["summary", "/nonexistent"]])
def test_merge_and_summary_say_when_there_is_nothing(args):
    proc = _run(*args)
    assert proc.returncode == 1
