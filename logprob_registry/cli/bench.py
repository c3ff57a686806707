"""``logprob-registry bench``: every eligible backend (built-in and plugins) and the textbook
baseline, measured side by side on this machine: time, peak memory above the inputs, largest
difference from float64, and the ratios against the baseline.

This module only parses the arguments and writes the outputs (the table, ``--json``, ``--plot``),
after checking that they can be written; the engine is :mod:`logprob_registry.benchmark`.
Exit status: 0, 1 when a method failed, 2 for a usage problem (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from ..benchmark.settings import DEFAULT_HIDDEN_SIZE, PRESETS, bench_ops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{k}: {p.what}" for k, p in PRESETS.items())
    parser.add_argument("--device", help="device to run on, such as cpu or cuda:0 (default: the machine's main device)")
    parser.add_argument("--dtype", action="append", default=[], metavar="DTYPE[,DTYPE]",
                        help="input dtype(s): float16, bfloat16, float32, float64 (default float32, or the preset's)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--shape", metavar="B,T,V",
                       help="batch, sequence, vocabulary: the logits' shape (for ops taking hidden states, "
                            "that of the logits they form)")
    shape.add_argument("--preset", choices=sorted(PRESETS), help=f"a seed's setting ({presets})")
    parser.add_argument("--hidden-size", type=int, metavar="H",
                        help="for ops taking hidden states (B, T, H) and a weight (V, H): H "
                             f"(default {DEFAULT_HIDDEN_SIZE}, or the preset's: "
                             + ", ".join(f"{k} {p.hidden_size}" for k, p in PRESETS.items()) + "); "
                             "kl_divergence takes logits unless it is given, and then both sides as hidden "
                             "states with their own weights")
    parser.add_argument("--slice", action="store_true",
                        help="feed x[:, :-1] and labels[:, 1:], non-contiguous, as trainers do (the trlx preset does)")
    parser.add_argument("--op", action="append", default=[], metavar="OP[,OP]",
                        help=f"op(s) to measure: {', '.join(bench_ops())} (default logprobs)")
    parser.add_argument("--outputs", action="append", default=[], metavar="NAME[,NAME]",
                        help="for token_stats: the fields to compute (logprobs, entropy, raw_logprobs, raw_entropy, "
                             "log_sum_p2, mean_logit, max_logit, is_argmax; default logprobs,entropy)")
    parser.add_argument("--backward", action="store_true",
                        help="measure forward + backward of the sum of the result (gradients of every "
                             "differentiable input: logits, or hidden and weight; kl_divergence's student only)")
    parser.add_argument("--inplace-backward", action="store_true",
                        help="with --backward: pass inplace_backward=True to the ops that take it "
                             "(each call gets a fresh copy of the logits)")
    parser.add_argument("--backend", action="append", default=[], metavar="NAME",
                        help="measure only these backends or external methods (default: every eligible one); "
                             "the baseline always runs")
    parser.add_argument("--undeclared", action="store_true",
                        help="also measure backends whose only 'no' is the input dtype, which they do not declare "
                             "(peers such as plugins/trl declaring float32 only): their kernel runs on the validated "
                             "call, and the row's name ends with '!'")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="timed calls per method (default 5)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="timing rounds, interleaved across methods so that a busy machine's drift hits "
                             "all alike (default 1)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed calls first (default 2)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch threads in each measuring process (default: torch's); with 1, the "
                             "JSON's process CPU time is the work done, little touched by other jobs")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE[:ATTR]",
                        help="also register this plugin (one not installed through an entry point)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': to stdout, table to stderr)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of time and memory (needs matplotlib; "
                                                           "any extension matplotlib writes: .png, .svg, .pdf, ...)")
    parser.add_argument("--process-group", type=int, metavar="N", help="the process_group= path over N local gloo "
                        "processes, beside gathering the logits to one rank (logprob_registry.benchmark.distributed)")
    parser.add_argument("--sampler", metavar="KEY=VALUE[,KEY=VALUE]", help="with --process-group: replay a "
                        "sampler in both methods, e.g. top_p=0.9,top_k=50 (softcap, top_k, top_p, min_p)")
    parser.add_argument("--peak-bandwidth", type=float, metavar="GB/S",
                        help="the GPU's memory bandwidth, for the '%% of peak' column (default: read from the device's "
                             "name for H200, H100, A100, B200, MI300X, L40S)")
    parser.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                        help="give up on a method after this long per measurement (default 1800)")


def check_output(path: str, flag: str) -> None:
    """Raise BenchError unless ``path`` can be written, so that a run is never lost at the end."""
    from ..benchmark import BenchError

    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise BenchError(f"{flag} {path}: is a folder; name a file")
    if not os.path.isdir(folder):
        raise BenchError(f"{flag} {path}: folder {folder} does not exist; create it or name a file in an "
                         "existing folder")
    if not os.access(full if os.path.exists(full) else folder, os.W_OK):
        raise BenchError(f"{flag} {path}: not writable here (permission denied); name a file you can write")


def options(args: argparse.Namespace):
    """The engine's :class:`~logprob_registry.benchmark.Options` from the parsed arguments."""
    from ..benchmark import Options

    return Options(
        ops=args.op, dtypes=args.dtype, shape=args.shape, preset=args.preset, hidden_size=args.hidden_size,
        sliced=args.slice, backward=args.backward, inplace_backward=args.inplace_backward, backends=args.backend,
        undeclared=args.undeclared,
        repeat=args.repeat, rounds=args.rounds, warmup=args.warmup, threads=args.threads, plugins=args.plugin,
        timeout=args.timeout, device=args.device, peak_bandwidth=args.peak_bandwidth, outputs=args.outputs,
    )


def _progress(text: str, end_line: bool) -> None:
    print(text, file=sys.stderr, end="\n" if end_line else "", flush=True)


def _fail(message: object) -> int:
    print(f"logprob-registry bench: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from ..benchmark import BenchError, Session, render

    if args.process_group is not None:
        from ..benchmark.distributed import run_cli

        return run_cli(args)
    session: Optional[Session] = None
    try:
        opts = options(args)
        opts.check()
        if args.json and args.json != "-":
            check_output(args.json, "--json")
        if args.plot:
            from ..benchmark.plot import check_path

            check_output(args.plot, "--plot")
            try:
                check_path(args.plot)
            except (RuntimeError, ValueError) as exc:
                raise BenchError(str(exc)) from None
        session = Session(opts, _progress).prepare()
    except BenchError as exc:
        return _fail(exc)
    try:
        doc = session.run()
    finally:
        session.close()
    print(render.render(doc), file=sys.stderr if args.json == "-" else sys.stdout)
    status = 1 if any(r["status"] != "ok" for run in doc["runs"] for r in run["results"]) else 0
    try:
        if args.json == "-":
            print(json.dumps(doc, indent=1))
        elif args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if args.plot:
            from ..benchmark.plot import plot

            plot(doc, args.plot)
            _progress(f"bench: chart written to {args.plot}", True)
    except OSError as exc:
        print(f"logprob-registry bench: could not write {exc.filename}: {exc.strerror}; "
              "the results are in the table above", file=sys.stderr)
        return 1
    return status
