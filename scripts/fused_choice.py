"""Whether the automatic choice of ``logprobs_from_hidden`` is the fast one (issue #26).

For each (rows, H, V), dtype and pass, in one process: every backend eligible for the call is
timed on the op table's example inputs (``tuning.measure.time_call``: ``bench``'s timing engine,
the median of ``--repeat`` calls after ``--warmup``), then the automatic choice is read twice from
the registry, once by its declarations alone (no tuning file: priority, ``min_vocab`` and
``min_size``) and once following the tuning file ``--tuning`` (written by ``logprob-registry tune``),
and each is set against the fastest backend of the same run.

    logprob-registry tune --op logprobs_from_hidden --vocab 4096,32768,151936 --hidden 256,1024,2048 \\
        --output /tmp/fused_tuning.json
    python scripts/fused_choice.py --tuning /tmp/fused_tuning.json --shapes 256x256x4096,4096x1024x32768
    python scripts/fused_choice.py --tuning /tmp/fused_tuning.json --shapes 4096x2048x151936 --repeat 1 --warmup 0

Shapes are ROWSxHxV. Each backend first makes one small call of the same kind (compiled compiles
its kernels there, once per kind of call, whatever the shape), so ``--warmup 0`` suits a heavy
shape. The choice never depends on the rows (only on the V and H buckets), so the ratio shows what
a batch invariant choice costs at that row count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import logprob_registry as lr
from logprob_registry.call import key_for
from logprob_registry.dtypes import dtype_name, parse_dtype
from logprob_registry.registry import Registry
from logprob_registry.tuning.cache import Tuning
from logprob_registry.tuning.measure import time_call

OP = "logprobs_from_hidden"


def parse_shapes(text: str):
    shapes = []
    for part in text.split(","):
        rows, h, v = (int(x) for x in part.lower().split("x"))
        shapes.append((rows, h, v))
    return shapes


def choices(key, tuning_path):
    """(choice by declarations, choice following the tuning file or None without one)."""
    plain = Registry(ranking=None).select(key).name
    tuned = Registry(ranking=Tuning(tuning_path)).select(key).name if tuning_path else None
    return plain, tuned


def measure(rows, h, v, dtype, grad, tuning_path, repeat, warmup, backends):
    key = key_for(OP, device="cpu", dtype=dtype, requires_grad=grad, vocab=v, hidden_size=h)
    eligible = [x.name for x in lr.get_registry().verdicts(key) if x.reason is None and x.broken is None]
    eligible = [n for n in eligible if not backends or n in backends]
    times = {}
    for name in eligible:
        # one small call of the same kind first: compiled compiles its kernels once per kind of call
        # (dynamic shapes), so that --warmup 0 at a heavy shape times the work, not the compile
        time_call(OP, name, 16, min(v, 4096), dtype, "cpu", grad, 1, 0, seed=0, hidden=min(h, 64))
        times[name] = time_call(OP, name, rows, v, dtype, "cpu", grad, repeat, warmup, seed=0, hidden=h)
    plain, tuned = choices(key, tuning_path)
    return times, plain, tuned


def ratio(times, name):
    if name is None or name not in times:
        return "-"
    return f"{name} {times[name] / min(times.values()):.2f}x"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256x256x4096,4096x1024x32768,4096x2048x151936",
                   help="ROWSxHxV, comma-separated")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--grad", choices=("both", "yes", "no"), default="both")
    p.add_argument("--tuning", default=None,
                   help="tuning file written by logprob-registry tune (else: no tuned column)")
    p.add_argument("--backend", action="append", default=[], help="only these backends")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    if args.tuning and not os.path.exists(args.tuning):
        print(f"fused_choice: no tuning file at {args.tuning}; run logprob-registry tune --output it first",
              file=sys.stderr)
        return 2
    dtypes = [parse_dtype(d) for d in args.dtype.split(",")]
    grads = {"both": (False, True), "yes": (True,), "no": (False,)}[args.grad]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, repeat {args.repeat}, warmup {args.warmup}")
    print("| rows x H x V | dtype | pass | times (ms) | fastest | by declarations | with the tuning file |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows, h, v in parse_shapes(args.shapes):
        for dtype in dtypes:
            for grad in grads:
                times, plain, tuned = measure(rows, h, v, dtype, grad, args.tuning, args.repeat, args.warmup,
                                              args.backend)
                fastest = min(times, key=times.get)
                shown = ", ".join(f"{n} {t * 1e3:.3g}" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
                print(f"| {rows}x{h}x{v} | {dtype_name(dtype)} | {'fwd+bwd' if grad else 'fwd'} | {shown} | {fastest} "
                      f"| {ratio(times, plain)} | {ratio(times, tuned)} |", flush=True)
    print(f"# done {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
