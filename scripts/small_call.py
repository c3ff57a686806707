#!/usr/bin/env python3
"""A small call against torch (issue #36): ``lr.logprobs_from_logits(logits, labels)`` on 8 rows of
a 128-token vocabulary (fp32, forward, one thread) interleaved with ``log_softmax + gather``; the
fastest per-call time of each over many rounds, and their ratio (the issue asks for <= 3x).

    python scripts/small_call.py                     # 8 rows x 128, float32
    python scripts/small_call.py --rows 8 --vocab 128 --calls 200 --rounds 50 [--dtensor] [--profile]

``--dtensor`` imports ``torch.distributed.tensor`` first, as a process using FSDP2 or DTensor has
(every call then asks whether an argument is a DTensor); ``--profile`` prints cProfile's top
functions of the library's call instead (cumulative time).
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

import logprob_registry as lr


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--calls", type=int, default=200, help="calls per timing (default 200)")
    parser.add_argument("--rounds", type=int, default=50, help="interleaved rounds; the fastest counts (default 50)")
    parser.add_argument("--dtensor", action="store_true", help="import torch.distributed.tensor first")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.dtensor:
        importlib.import_module("torch.distributed.tensor")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab)
    labels = torch.randint(0, args.vocab, (args.rows,))
    methods = {
        "log_softmax + gather": lambda: torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        "lr.logprobs_from_logits": lambda: lr.logprobs_from_logits(logits, labels),
    }
    with torch.no_grad():
        assert torch.allclose(methods["lr.logprobs_from_logits"](), methods["log_softmax + gather"]())
        if args.profile:
            import cProfile
            import pstats

            fn = methods["lr.logprobs_from_logits"]
            per_call(fn, args.calls)
            with cProfile.Profile() as prof:
                per_call(fn, args.calls * 10)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            return
        best = {name: float("inf") for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                best[name] = min(best[name], per_call(fn, args.calls))
    backend = lr.select("logprobs", device="cpu", dtype=torch.float32, shape=logits.shape).name
    print(f"{args.rows} rows x {args.vocab} float32, forward, 1 thread, fastest of {args.rounds} rounds x "
          f"{args.calls} calls (backend: {backend}; DTensor imported: {args.dtensor})")
    for name, seconds in best.items():
        print(f"  {name:<24} {seconds * 1e6:8.1f} us")
    torch_s, lr_s = best["log_softmax + gather"], best["lr.logprobs_from_logits"]
    print(f"  ratio                    {lr_s / torch_s:8.2f}x torch's time")


if __name__ == "__main__":
    main()
