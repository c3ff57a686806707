#!/usr/bin/env python3
"""First call of the ``compiled`` backend in a fresh process: cold, warm, and with prebuilt kernels.

Each run is a fresh process that imports torch and logprob_registry (not counted), then times its
first call and the median of the next three (forward + backward of logprobs by default):

- ``cold``: an empty inductor cache and no prebuilt kernels (a first run on a machine);
- ``warm``: inductor's on-disk cache filled by an earlier, unmeasured process; no prebuilt kernels;
- ``prebuilt``: kernels built by ``logprob_registry.warmup.warmup`` (timed once, before the runs;
  skipped when ``--kernel-cache`` already holds them), an empty inductor cache.

  scripts/compiled_compile_cost.py [--shape B,T,V] [--dtype float32] [--repeat 3]
                                   [--modes cold,warm,prebuilt] [--forward] [--kernel-cache PATH]

Prints one line per run (with the number of kernels it compiled, counted from the backend's
first-compile notices: 0 when prebuilt kernels served every call), then the median and range per
mode. To measure another checkout of the
project (the code before prebuilt kernels, say), put it first on PYTHONPATH and pass
``--modes cold,warm``: the child prints which ``logprob_registry`` it imported.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r'''
import json, logging, sys, time
start = time.perf_counter()
import torch
import logprob_registry as lr
imported = time.perf_counter() - start
class Count(logging.Handler):  # the backend's first-compile notices: one per kernel torch.compile builds
    compiles = 0
    def emit(self, record):
        Count.compiles += "is compiling" in record.getMessage()
logging.getLogger("logprob_registry").addHandler(Count())
B, T, V = map(int, sys.argv[1].split(",")); dt = getattr(torch, sys.argv[2]); grad = sys.argv[3] == "1"
torch.manual_seed(0)
x = torch.randn(B, T, V, dtype=dt); y = torch.randint(0, V, (B, T))
def call():
    z = x.detach().requires_grad_(grad)
    t = time.perf_counter()
    out = lr.logprobs_from_logits(z, y, backend="compiled")
    if grad:
        out.sum().backward()
    return time.perf_counter() - t
first = call(); rest = sorted(call() for _ in range(3))
print(json.dumps(dict(first=first, steady=rest[1], imported=imported, dynamo="torch._dynamo" in sys.modules,
                      compiles=Count.compiles, module=lr.__file__)))
'''


def child(args, grad: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, args.shape, args.dtype, grad],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"child failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,1024,32768")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per mode (default 3)")
    ap.add_argument("--modes", default="cold,warm,prebuilt")
    ap.add_argument("--forward", action="store_true", help="also time the forward alone")
    ap.add_argument("--kernel-cache", default=None, metavar="PATH",
                    help="prebuilt kernels' folder (default: a new temporary one, built here)")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    work = tempfile.mkdtemp(prefix="first_call_")
    try:
        measure(a, modes, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(a, modes, work):
    base = dict(os.environ, LOGPROB_REGISTRY_KERNEL_CACHE="off")
    whats = ([("0", "forward")] if a.forward else []) + [("1", "forward+backward")]
    print(f"shape {a.shape} {a.dtype}; first call and steady call (median of the next 3), in seconds; "
          f"one fresh process per line")
    if "prebuilt" in modes:
        folder = a.kernel_cache or os.path.join(work, "kernels")
        build = (f"import time, torch; from logprob_registry.warmup import warmup, summary; t = time.perf_counter(); "
                 f"done = warmup(['logprobs'], [{a.dtype!r}], backward=True, vocab=[{a.shape.split(',')[-1]}], "
                 f"folder={folder!r}, backend='compiled'); print(summary(done, time.perf_counter() - t))")
        p = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True,
                           env=dict(base, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor-build")))
        if p.returncode:
            raise SystemExit(f"warmup failed: {p.stderr.strip()[-2000:]}")
        print(f"warmup (logprobs forward + backward) into {folder}: {p.stdout.strip()}")
    for grad, what in whats:
        warm_dir = os.path.join(work, f"inductor-warm-{grad}")
        for mode in modes:
            firsts = []
            for i in range(a.repeat):
                if mode == "cold":
                    env = dict(base, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work))
                elif mode == "warm":
                    env = dict(base, TORCHINDUCTOR_CACHE_DIR=warm_dir)
                    if i == 0:
                        child(a, grad, env)  # fills the cache, not measured
                else:
                    env = dict(base, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work),
                               LOGPROB_REGISTRY_KERNEL_CACHE=folder)
                r = child(a, grad, env)
                firsts.append(r["first"])
                print(f"  {what:17s} {mode:8s} first {r['first']:6.2f}  steady {r['steady']:5.2f}  "
                      f"(import {r['imported']:.2f}, dynamo imported: {r['dynamo']}, "
                      f"kernels compiled: {r['compiles']}, "
                      f"{os.path.dirname(os.path.dirname(r['module']))})", flush=True)
            print(f"{what:17s} {mode:8s} first call: median {statistics.median(firsts):.2f} s "
                  f"({min(firsts):.2f}-{max(firsts):.2f}) over {len(firsts)} processes", flush=True)


if __name__ == "__main__":
    main()
