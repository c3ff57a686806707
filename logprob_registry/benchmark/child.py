"""The child process: ``python -m logprob_registry.benchmark.child SPEC_JSON``.

One child measures one method for one setting, so that a method's compiled caches, allocator
state or crash never touch the next one. It prints one line, ``MARKER`` followed by JSON:

- ``time``: wall and process CPU times of ``repeat`` calls after ``warmup`` calls (device
  synchronised around each; :func:`.timing.time_workload`, the timing engine ``tune`` uses too),
  the largest differences from float64 (of the outputs, and of the gradient of each input that
  gets one), and on an accelerator the allocator's peak above the inputs (reset before each
  measured call).
- ``mem`` (CPU): the peak resident memory above the resident memory just before a call. The
  parent starts this child with ``MALLOC_MMAP_THRESHOLD_`` pinned, so that glibc returns freed
  blocks and resident memory follows live memory; measured by :func:`.memory.peak_extra_bytes`, as
  the conformance suite measures (peak reset through ``/proc/self/clear_refs`` before each call,
  read from ``VmHWM`` after it).
- ``probe``: free and total memory of an accelerator, and its name.

An exception becomes ``{"error": "Type: message"}``.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback

MARKER = "@@logprob-registry-bench@@ "
MEMORY_REPEAT = 2


def _accelerator(device_type: str):
    import torch

    return getattr(torch, device_type) if device_type in ("cuda", "npu", "xpu") else None


def _load_plugins(specs) -> None:
    from .plugins import register_plugins

    register_plugins(specs)


def _workload(spec: dict):
    import torch

    from .settings import Setting
    from .workload import Workload

    s = Setting(**spec["setting"])
    if s.threads:
        torch.set_num_threads(s.threads)
    return s, Workload(s, spec["method"])


def measure_time(spec: dict) -> dict:
    from .timing import time_workload
    from .workload import max_differences

    s, w = _workload(spec)
    times, cpu_times = time_workload(w)
    out = dict(times_s=times, cpu_times_s=cpu_times)
    acc = _accelerator(s.device_type)
    if acc is not None:
        out["peak_bytes"] = _peak_bytes(w, s.device)
    x = w.prepare()
    outs = w.run(x)
    out["result_dtype"] = str(outs[0].dtype).replace("torch.", "")
    diff, grad_diffs = max_differences(s, w.inputs, outs, w.grads())
    first = s.grad_inputs[0] if s.grad_inputs else None
    out.update(max_abs_diff=diff, max_abs_diff_grad=grad_diffs.get(first) if first else None,
               max_abs_diff_grads=grad_diffs)
    return out


def measure_memory(spec: dict) -> dict:
    s, w = _workload(spec)
    for _ in range(s.warmup):
        w.run(w.prepare())
        w.release()
    return dict(peak_bytes=_peak_bytes(w, "cpu"))


def _peak_bytes(w, device) -> int:
    """The largest extra peak of ``MEMORY_REPEAT`` calls, measured as the conformance suite does
    (:func:`.memory.peak_extra_bytes`: the allocator's peak on an accelerator, peak resident memory
    on the CPU); each call's inputs are prepared beforehand."""
    from .memory import peak_extra_bytes

    peak = 0
    for _ in range(MEMORY_REPEAT):
        outs, extra = peak_extra_bytes(functools.partial(w.run, w.prepare()), device)
        peak = max(peak, extra)
        del outs
        w.release()
    return peak


def probe(spec: dict) -> dict:
    device = spec["setting"]["device"]
    acc = _accelerator(device.split(":", 1)[0])
    if acc is None or not hasattr(acc, "mem_get_info"):
        return dict(free_bytes=None, total_bytes=None, name=None)
    free, total = acc.mem_get_info(device)
    name = acc.get_device_name(device) if hasattr(acc, "get_device_name") else None
    return dict(free_bytes=int(free), total_bytes=int(total), name=name)


RUNNERS = {"time": measure_time, "mem": measure_memory, "probe": probe}


def main(argv=None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    try:
        _load_plugins(spec.get("plugins", ()))
        result = RUNNERS[spec["what"]](spec)
    except Exception as exc:
        traceback.print_exc()
        text = str(exc).strip().splitlines()
        result = dict(error=f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
