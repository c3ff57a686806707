"""``logprob-registry warmup``: build backends' kernels ahead of time, so that a later process loads
them instead of compiling (:mod:`logprob_registry.warmup`): every backend that declares
``prepare`` (today ``compiled``), or those named with ``--backend``."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", default="logprobs",
                        help="ops whose kernels to build, comma-separated (default logprobs; compiled builds "
                             "logprobs, entropy and logprobs_and_entropy)")
    parser.add_argument("--dtype", default="float32", help="logits dtypes, comma-separated (default float32)")
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                        help="also the backward, out of place (default: yes)")
    parser.add_argument("--inplace", action="store_true", help="also the in-place backward (inplace_backward=True)")
    parser.add_argument("--device", default="cpu", help="device type (only cpu has prebuilt kernels)")
    parser.add_argument("--vocab", default="32768",
                        help="vocabulary sizes of the calls, comma-separated: V <= 4096 and V > 4096 "
                             "have kernels of their own (default 32768)")
    parser.add_argument("--force", action="store_true", help="build again what is already there")
    parser.add_argument("--backend", action="append", default=None, metavar="NAME",
                        help="build for this backend only (repeatable; default: every backend that builds ahead)")
    parser.epilog = ("compiled writes into LOGPROB_REGISTRY_KERNEL_CACHE (default ~/.cache/logprob_registry/kernels), "
                     "the folder every process loads from.")


def run(args: argparse.Namespace) -> int:
    from ..registry import NoEligibleBackendError, get_registry
    from ..warmup import PrepareError, plan, summary, warmup

    registry = get_registry()
    names = None if not args.backend else [n.strip() for a in args.backend for n in a.split(",") if n.strip()]
    try:
        vocab = [int(v) for v in args.vocab.split(",") if v.strip()]
        kwargs = dict(ops=[o.strip() for o in args.op.split(",") if o.strip()],
                      dtypes=[d.strip() for d in args.dtype.split(",") if d.strip()],
                      backward=args.backward, inplace=args.inplace, device=args.device, vocab=vocab,
                      backend=names, registry=registry)
        planned = plan(**kwargs)
    except (ValueError, NoEligibleBackendError) as exc:
        print(f"logprob-registry warmup: {exc}", file=sys.stderr)
        return 2
    if not planned:
        print("logprob-registry warmup: no backend builds anything ahead for these arguments", file=sys.stderr)
        return 2
    for name in dict.fromkeys(p.backend for p in planned):
        folders = sorted({os.path.dirname(p.path) for p in planned if p.backend == name})
        print(f"warmup: {name} into {', '.join(folders)}", flush=True)
    start = time.perf_counter()
    try:
        done = warmup(**kwargs, force=args.force, progress=lambda line: print(line, flush=True))
    except PrepareError as exc:
        print(f"logprob-registry warmup: {exc}", file=sys.stderr)
        return 1
    for b in done:
        took = f"{b.seconds:6.1f} s" if b.status == "built" else "       "
        print(f"{b.status:8s} {b.backend:10s} {b.what:50s} {took}  {os.path.basename(b.path)}")
    print(f"warmup: {summary(done, time.perf_counter() - start)}; a new process loads these instead of compiling",
          flush=True)
    return 0
