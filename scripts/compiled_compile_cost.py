#!/usr/bin/env python3
"""First-call cost of the ``compiled`` backend: what torch.compile adds, once per process.

Each measurement runs in a fresh process. "cold": an empty inductor cache directory (a first run on
a machine); "warm": the same directory again (inductor's on-disk caches hit; dynamo still traces).
The cost is the first call's time minus the median of the next calls.

  scripts/compiled_compile_cost.py [--shape B,T,V] [--dtype float32]

Not a bench option: bench times steady calls after warm-up, in one process per method, and says
nothing of the first call or of inductor's on-disk cache. Kept until issue #16's
``logprob-registry warmup`` and its first-call measurements replace it (the README's first-call
figures come from this script).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import json, sys, time, torch
import logprob_registry as lr
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
first = call(); rest = sorted(call() for _ in range(5))
print(json.dumps(dict(first=first, steady=rest[2])))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,1024,32768")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    print(f"shape {a.shape} {a.dtype}: first-call cost (first call - steady call), one fresh process each")
    for grad, what in (("0", "forward"), ("1", "forward+backward")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            for kind in ("cold", "warm"):
                p = subprocess.run([sys.executable, "-c", CHILD, a.shape, a.dtype, grad],
                                   capture_output=True, text=True, env=env)
                if p.returncode:
                    print(f"  {what:17s} {kind}: ERROR {p.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(p.stdout.strip().splitlines()[-1])
                print(f"  {what:17s} {kind}: {r['first'] - r['steady']:6.2f} s  "
                      f"(first call {r['first']:.2f} s, steady {r['steady'] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
