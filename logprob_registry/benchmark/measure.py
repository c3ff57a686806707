"""The parent side: one child process per (method, measurement), the results collected, the
ratios against the baseline derived. A method that fails is recorded with its error; the others
still run."""

from __future__ import annotations

import json
import os
import site
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from .child import MARKER
from .render import fmt_bytes, fmt_time
from .settings import Setting

MMAP_THRESHOLD = "65536"


def memory_method(device_type: str) -> str:
    if device_type == "cpu":
        return ("peak resident memory (VmHWM) above that before the call, in its own process "
                f"with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}")
    if device_type in ("cuda", "npu", "xpu"):
        return f"torch.{device_type}.max_memory_allocated() above memory_allocated() before the call"
    return f"not measured on {device_type}"


def _package_root() -> str:
    import logprob_registry

    return os.path.dirname(os.path.dirname(os.path.abspath(logprob_registry.__file__)))


def child_env(pin_malloc: bool) -> Dict[str, str]:
    """The parent's environment, with this very package first on the path (so that the children
    run the code the parent runs) and, for memory children, glibc's mmap threshold pinned."""
    env = dict(os.environ)
    root = _package_root()
    sites = set(site.getsitepackages() + [site.getusersitepackages()])
    if root not in sites:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    if pin_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    return env


def run_child(what: str, s: Setting, method: str, plugins: Sequence[str], timeout: Optional[float]) -> dict:
    """Run one child; its JSON answer, or ``{"error": ...}`` if it failed or crashed."""
    spec = dict(what=what, setting=s.to_args(), method=method, plugins=list(plugins))
    try:
        p = subprocess.run(
            [sys.executable, "-m", "logprob_registry.benchmark.child", json.dumps(spec)],
            capture_output=True, text=True, env=child_env(what == "mem"), timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout:g} s (raise --timeout)")
    answer = [line for line in p.stdout.splitlines() if line.startswith(MARKER)]
    if answer:
        return json.loads(answer[-1][len(MARKER):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
    killed = " (killed: out of memory?)" if p.returncode in (-9, 137) else ""
    return dict(error=f"child process exited with code {p.returncode}{killed}: {tail[0]}".rstrip(": "))


def time_stats(times: List[float], cpu_times: List[float], traffic: Optional[int]) -> dict:
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    median = statistics.median(times)
    return dict(
        time_median_s=median, time_iqr_s=q3 - q1,
        time_min_s=min(times), time_max_s=max(times), times_s=times,
        cpu_time_median_s=statistics.median(cpu_times) if cpu_times else None,
        bandwidth_bytes_per_s=traffic / median if traffic and median > 0 else None,
    )


EMPTY = dict(time_median_s=None, time_iqr_s=None, time_min_s=None, time_max_s=None, times_s=[],
             cpu_time_median_s=None, cpu_times_s=[], bandwidth_bytes_per_s=None,
             peak_bytes=None, max_abs_diff=None, max_abs_diff_grad=None, max_abs_diff_grads=None,
             result_dtype=None, speedup=None, memory_ratio=None)


def add_ratios(results: List[dict]) -> None:
    """speed-up = baseline time / time; memory ratio = peak / baseline peak (None if unknown)."""
    base = next((r for r in results if r["kind"] == "baseline" and r["status"] == "ok"), None)
    for r in results:
        if base is None or r["status"] != "ok":
            continue
        if r["time_median_s"]:
            r["speedup"] = base["time_median_s"] / r["time_median_s"]
        if r["peak_bytes"] is not None and base["peak_bytes"]:
            r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]


def run_setting(
    s: Setting, methods: Sequence[dict], plugins: Sequence[str], timeout: Optional[float],
    progress: Callable[[str, bool], None], rounds: int = 1,
) -> List[dict]:
    """Measure each method (a dict with ``name``, ``kind``, ...): ``status`` "ok", or "failed"
    with ``error``. Timing runs in ``rounds`` rounds interleaved across the methods, so that drift
    of a shared machine hits all alike; on the CPU, memory is measured afterwards, one child each.
    """
    results = [dict(m, **EMPTY, status="ok", error=None) for m in methods]
    n = len(results)

    def fail(r: dict, error: str) -> None:
        r.update(status="failed", error=error, times_s=[], cpu_times_s=[])
        progress(f"FAILED: {error}", True)

    for k in range(rounds):
        tag = f"round {k + 1}/{rounds} " if rounds > 1 else ""
        for i, r in enumerate(results, 1):
            if r["status"] != "ok":
                continue
            progress(f"  {tag}[{i}/{n}] {r['name']} time ... ", False)
            timed = run_child("time", s, r["name"], plugins, timeout)
            if "error" in timed:
                fail(r, timed["error"])
                continue
            r["times_s"] = r["times_s"] + timed["times_s"]
            r["cpu_times_s"] = r["cpu_times_s"] + timed.get("cpu_times_s", [])
            for key in ("max_abs_diff", "max_abs_diff_grad", "max_abs_diff_grads", "result_dtype", "peak_bytes"):
                if key in timed and r[key] is None:
                    r[key] = timed[key]
            progress(f"{fmt_time(statistics.median(timed['times_s']))}", True)
    if s.device_type == "cpu":
        for i, r in enumerate(results, 1):
            if r["status"] != "ok":
                continue
            progress(f"  [{i}/{n}] {r['name']} memory ... ", False)
            mem = run_child("mem", s, r["name"], plugins, timeout)
            if "error" in mem:
                fail(r, f"memory measurement: {mem['error']}")
                continue
            r["peak_bytes"] = mem["peak_bytes"]
            progress(fmt_bytes(r["peak_bytes"]), True)
    for r in results:
        if r["status"] == "ok":
            r.update(time_stats(r["times_s"], r["cpu_times_s"], s.logits_traffic_bytes))
    add_ratios(results)
    return results


def probe(s: Setting, plugins: Sequence[str], timeout: Optional[float]) -> dict:
    """Free and total memory and name of an accelerator, asked in a child so that the parent
    never holds a device context of its own."""
    return run_child("probe", s, "", (), timeout)
