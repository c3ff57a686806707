#!/usr/bin/env python3
"""The sampler features' numbers for issue #14: candidates and topk against single-label calls, and
the extra peak memory of ``top_p`` under ``chunked``.

  time    K candidate labels in one call against K single-label calls, and topk_logprobs(k) against
          one single-label call, per backend (median of --repeat calls after a warm-up; wall and
          process CPU seconds, the latter hardly touched by other jobs on shared cores);
  memory  the extra peak of one top_p call (no gradients) over bf16 logits of --shape, as a fraction
          of the logits' size; run in a child process started with MALLOC_MMAP_THRESHOLD_=65536 so
          that resident memory follows live memory (logprob_registry.benchmark.memory.peak_extra_bytes).

  flock /tmp/bench.lock python scripts/sampler_measure.py time --shape 4,256,151936
  flock /tmp/bench.lock python scripts/sampler_measure.py memory --shape 4,1024,151936

Prints one JSON line per measurement.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def _shape(text):
    return tuple(int(v) for v in text.split(","))


def _timed(fn, repeat):
    fn()  # warm-up
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    walls.sort()
    cpus.sort()
    return walls[len(walls) // 2], cpus[len(cpus) // 2]


def measure_time(args):
    import torch

    import logprob_registry as lr

    torch.set_num_threads(args.threads)
    b, t, v = args.shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, t, v, generator=g) * 3).to(getattr(torch, args.dtype))
    labels = torch.randint(0, v, (b, t, args.k), generator=g)
    singles = [labels[..., i].contiguous() for i in range(args.k)]
    for backend in args.backend:
        def one_call(backend=backend):
            return lr.logprobs_from_logits(x, labels, backend=backend)

        def k_calls(backend=backend):
            return [lr.logprobs_from_logits(x, y, backend=backend) for y in singles]

        def single(backend=backend):
            return lr.logprobs_from_logits(x, singles[0], backend=backend)

        def topk(backend=backend):
            return lr.topk_logprobs(x, args.k, backend=backend)

        together = torch.stack(k_calls(), -1)
        err = (one_call() - together).abs().max().item()
        row = dict(what="time", backend=backend, shape=list(args.shape), dtype=args.dtype, k=args.k,
                   threads=args.threads, max_diff_candidates_vs_singles=err)
        for name, fn in (("candidates", one_call), ("singles", k_calls), ("one_label", single), ("topk", topk)):
            wall, cpu = _timed(fn, args.repeat)
            row[f"{name}_wall_s"], row[f"{name}_cpu_s"] = round(wall, 4), round(cpu, 4)
        row["singles_over_candidates_cpu"] = round(row["singles_cpu_s"] / row["candidates_cpu_s"], 2)
        row["topk_over_one_label_cpu"] = round(row["topk_cpu_s"] / row["one_label_cpu_s"], 2)
        print(json.dumps(row), flush=True)


def measure_memory(args):
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        sys.exit(subprocess.call([sys.executable, __file__] + sys.argv[1:], env=env))
    import torch

    import logprob_registry as lr
    from logprob_registry import config
    from logprob_registry.benchmark.memory import peak_extra_bytes

    torch.set_num_threads(args.threads)
    b, t, v = args.shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, t, v, generator=g) * 3).to(torch.bfloat16)
    y = torch.randint(0, v, (b, t), generator=g)
    size = x.numel() * x.element_size()
    lr.logprobs_from_logits(x[:1, :2], y[:1, :2], top_p=args.top_p, backend="chunked")  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        _, extra = peak_extra_bytes(lambda: lr.logprobs_from_logits(x, y, top_p=args.top_p, backend="chunked"),
                                    torch.device("cpu"))
    print(json.dumps(dict(what="memory", backend="chunked", shape=list(args.shape), dtype="bfloat16",
                          top_p=args.top_p,
                          workspace_bytes=config.get("LOGPROB_REGISTRY_CHUNKED_WORKSPACE"),
                          logits_bytes=size, extra_peak_bytes=extra, extra_over_logits=round(extra / size, 5),
                          seconds=round(time.perf_counter() - start, 1))), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("time", help="candidates and topk against single-label calls")
    p.add_argument("--shape", type=_shape, default=(4, 256, 151936), help="B,T,V (default 4,256,151936)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--backend", action="append", default=None, help="default: chunked and naive")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(run=measure_time)
    p = sub.add_parser("memory", help="extra peak of top_p under chunked")
    p.add_argument("--shape", type=_shape, default=(4, 1024, 151936), help="B,T,V (default 4,1024,151936)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(run=measure_memory)
    args = parser.parse_args()
    if getattr(args, "backend", "unset") is None:
        args.backend = ["chunked", "naive"]
    args.run(args)


if __name__ == "__main__":
    main()
