#!/usr/bin/env python3
"""Ignored rows cost next to nothing (issue #36): ``lr.logprobs_from_logits`` forward+backward on the
automatic choice with a fraction of the rows' labels ignored (scattered: GRPO's prompt rows, padding)
against the same call with every row active, and against the floor, interleaved, the fastest of
``--rounds`` of each.

The backward returns a dense ``(N, V)`` gradient: zeros at the ignored rows. The floor is what a
call that skips them cannot avoid: ``torch.zeros(N, V)`` (a fresh gradient) plus the all-active call
on the active rows alone. With ``--inplace`` (``inplace_backward=True``: the gradient written over
the logits) nothing is allocated, and the floor is zeroing the ignored rows of the logits in place
plus the active rows' call, in place too.

    python scripts/ignored_rows.py                          # 4096 x 32768 float32, 90% ignored, 1 thread
    python scripts/ignored_rows.py --rows 1024 --ignored 0.9 --rounds 5 [--inplace] [--threads 1]

Each timing starts from fresh logits (a copy made before the clock starts, so that an in-place
backward never sees a gradient of an earlier round); the labels and their ignored rows are fixed.
"""

from __future__ import annotations

import argparse
import time

import torch

import logprob_registry as lr

IGNORE = -100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ignored", type=float, default=0.9, help="fraction of rows ignored (default 0.9)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the fastest counts (default 5)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--inplace", action="store_true", help="inplace_backward=True")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, v, dtype = args.rows, args.vocab, getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    ignored_rows = torch.randperm(n, generator=g)[: round(args.ignored * n)].sort().values  # scattered
    some_ignored = labels.index_fill(0, ignored_rows, IGNORE)
    active = some_ignored != IGNORE
    active_logits, active_labels = logits[active].contiguous(), labels[active]
    kw = dict(ignore_index=IGNORE, inplace_backward=args.inplace)

    def call(x: torch.Tensor, y: torch.Tensor) -> None:
        out = lr.logprobs_from_logits(x.requires_grad_(True), y, **kw)  # in place: the gradient is x's storage
        out.sum().backward()

    def timed(make, run) -> float:
        x = make()
        start = time.perf_counter()
        run(x)
        return time.perf_counter() - start

    fresh = lambda: logits.clone()  # noqa: E731
    if args.inplace:  # nothing to allocate: zero the ignored rows of the logits, then the active rows' call
        floor = (lambda: (logits.clone(), active_logits.clone()),
                 lambda x: (x[0].index_fill_(0, ignored_rows, 0.0), call(x[1], active_labels)))
    else:  # a fresh (N, V) gradient of zeros, then the active rows' call
        floor = (lambda: active_logits.clone(), lambda x: (torch.zeros(n, v, dtype=dtype), call(x, active_labels)))
    ignored_name = f"{args.ignored:.0%} ignored"
    methods = {"all rows active": (fresh, lambda x: call(x, labels)),
               ignored_name: (fresh, lambda x: call(x, some_ignored)),
               "floor": floor}
    backend = lr.select("logprobs", device="cpu", dtype=dtype, requires_grad=True, shape=(n, v)).name
    for make, run in methods.values():  # warm up: compile, caches, the kernels of both row counts
        run(make())
    best = {name: float("inf") for name in methods}
    for _ in range(args.rounds):
        for name, (make, run) in methods.items():
            best[name] = min(best[name], timed(make, run))
    print(f"{n} x {v} {args.dtype}, forward+backward, {args.threads} thread(s), backend {backend}, "
          f"inplace_backward={args.inplace}, {len(ignored_rows)} rows ignored (scattered); fastest of {args.rounds} "
          f"interleaved rounds")
    base = best["all rows active"]
    for name, seconds in best.items():
        print(f"  {name:<18} {seconds:8.3f} s  {seconds / base:5.2f}x all active")
    print(f"  ignored / floor    {best[ignored_name] / best['floor']:8.2f}x")


if __name__ == "__main__":
    main()
