"""``logprob-registry warmup``: build the compiled backend's kernels ahead of time, so that a later
process loads them instead of compiling (:mod:`logprob_registry.warmup`)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..warmup import OPS

    parser.add_argument("--op", default="logprobs",
                        help=f"ops whose kernels to build, comma-separated, among {', '.join(OPS)} (default logprobs)")
    parser.add_argument("--dtype", default="float32", help="logits dtypes, comma-separated (default float32)")
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                        help="also the backward, out of place (default: yes)")
    parser.add_argument("--inplace", action="store_true", help="also the in-place backward (inplace_backward=True)")
    parser.add_argument("--device", default="cpu", help="device type (only cpu has prebuilt kernels)")
    parser.add_argument("--vocab", default="32768",
                        help="vocabulary sizes of the calls, comma-separated: V <= 4096 and V > 4096 "
                             "have kernels of their own (default 32768)")
    parser.add_argument("--force", action="store_true", help="build again what is already there")
    parser.epilog = ("Writes into LOGPROB_REGISTRY_KERNEL_CACHE (default ~/.cache/logprob_registry/kernels), "
                     "the folder every process loads from.")


def run(args: argparse.Namespace) -> int:
    from ..kernels.compiled import _aot
    from ..warmup import BuildError, plan, summary, warmup

    try:
        vocab = [int(v) for v in args.vocab.split(",") if v.strip()]
        kwargs = dict(ops=[o.strip() for o in args.op.split(",") if o.strip()],
                      dtypes=[d.strip() for d in args.dtype.split(",") if d.strip()],
                      backward=args.backward, inplace=args.inplace, device=args.device, vocab=vocab)
        plan(**kwargs)
    except ValueError as exc:
        print(f"logprob-registry warmup: {exc}", file=sys.stderr)
        return 2
    where = _aot.folder()
    if where is None:
        print("logprob-registry warmup: LOGPROB_REGISTRY_KERNEL_CACHE is off, so no prebuilt kernel would be "
              "loaded; unset it, or set it to a folder", file=sys.stderr)
        return 2
    print(f"warmup: into {where}", flush=True)
    start = time.perf_counter()
    try:
        done = warmup(**kwargs, force=args.force, folder=where, progress=lambda line: print(line, flush=True))
    except BuildError as exc:
        print(f"logprob-registry warmup: {exc}", file=sys.stderr)
        return 1
    for b in done:
        took = f"{b.seconds:6.1f} s" if b.status == "built" else "       "
        print(f"{b.status:8s} {b.spec.label():50s} {took}  {os.path.basename(b.path)}")
    print(f"warmup: {summary(done, time.perf_counter() - start)}; a new process loads these instead of compiling",
          flush=True)
    return 0
