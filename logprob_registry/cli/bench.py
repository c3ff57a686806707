"""``logprob-registry bench``: every eligible backend (built-in and plugins) and the textbook
baseline, measured side by side on this machine: time, peak memory above the inputs, largest
difference from float64, and the ratios against the baseline. The work is in
:mod:`logprob_registry.benchmark`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..benchmark.settings import (
    BENCH_OPS, DEFAULT_PRESET, DTYPES, PRESETS, Setting, cpu_available_bytes, parse_list, parse_shape,
)


class BenchError(Exception):
    """A usage problem: reported in one sentence, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{k}: {p.what}" for k, p in PRESETS.items())
    parser.add_argument("--device", help="device to run on, such as cpu or cuda:0 (default: the machine's main device)")
    parser.add_argument("--dtype", action="append", default=[], metavar="DTYPE[,DTYPE]",
                        help="logits dtype(s): float16, bfloat16, float32, float64 (default float32, or the preset's)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--shape", metavar="B,T,V", help="logits shape (batch, sequence, vocabulary)")
    shape.add_argument("--preset", choices=sorted(PRESETS), help=f"a seed's setting ({presets})")
    parser.add_argument("--slice", action="store_true",
                        help="feed logits[:, :-1] and labels[:, 1:], non-contiguous, as trainers do (the trlx preset does)")
    parser.add_argument("--op", action="append", default=[], metavar="OP[,OP]",
                        help=f"op(s) to measure: {', '.join(BENCH_OPS)} (default logprobs)")
    parser.add_argument("--backward", action="store_true", help="measure forward + backward of the sum of the result")
    parser.add_argument("--inplace-backward", action="store_true",
                        help="with --backward: pass inplace_backward=True (each call gets a fresh copy of the logits)")
    parser.add_argument("--backend", action="append", default=[], metavar="NAME",
                        help="measure only these backends (default: every eligible one); the baseline always runs")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="timed calls per method (default 5)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="timing rounds, interleaved across methods so that a busy machine's drift hits all alike (default 1)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed calls first (default 2)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE[:ATTR]",
                        help="also register this plugin (one not installed through an entry point)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': to stdout, table to stderr)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of time and memory (needs matplotlib)")
    parser.add_argument("--process-group", type=int, metavar="N", help="the process_group= path over N local gloo "
                        "processes, beside gathering the logits to one rank (logprob_registry.benchmark.distributed)")
    parser.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                        help="give up on a method after this long per measurement (default 1800)")


def settings(args: argparse.Namespace, default_device: str) -> List[Setting]:
    """The settings the arguments ask for: one per (op, dtype)."""
    if "logprobs_from_hidden" in ",".join(args.op):
        raise BenchError("logprobs_from_hidden is not benchmarked yet: it needs hidden and weight shapes; "
                         f"choose from {', '.join(BENCH_OPS)}")
    try:
        ops = parse_list(args.op, BENCH_OPS, "op") if args.op else ["logprobs"]
        dtypes = parse_list(args.dtype, DTYPES, "dtype")
        if args.shape:
            shape, preset, sliced, dtype = parse_shape(args.shape), None, args.slice, "float32"
        else:
            preset = args.preset or DEFAULT_PRESET
            p = PRESETS[preset]
            shape, sliced, dtype = p.shape, p.sliced or args.slice, p.dtype
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if args.repeat < 1 or args.rounds < 1 or args.warmup < 0:
        raise BenchError("--repeat and --rounds must be at least 1, --warmup at least 0")
    if sliced and shape[1] < 2:
        raise BenchError("slicing [:, :-1] needs a sequence length T of at least 2")
    if args.inplace_backward and not args.backward:
        raise BenchError("--inplace-backward only makes sense with --backward")
    device = args.device or default_device
    return [
        Setting(op=op, device=device, dtype=DTYPES[d][0], shape=shape, sliced=sliced, backward=args.backward,
                inplace_backward=args.inplace_backward, repeat=args.repeat, warmup=args.warmup, preset=preset)
        for op in ops for d in (dtypes or [dtype])
    ]


def _check_device(device: str) -> str:
    import torch

    from ..environment import get_environment

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise BenchError(f"--device {device!r} is not a device such as cpu, cuda or cuda:1") from None
    env = get_environment()
    if not env.has_device(kind):
        here = ", ".join(d for d in env.devices if env.has_device(d))
        raise BenchError(f"there is no {kind} device on this machine; devices here: {here}")
    return kind


def _check_memory(todo: List[Setting], plugins: List[str], timeout: float) -> Optional[str]:
    """Refuse settings that cannot fit; returns the accelerator's name when one was probed."""
    from ..benchmark import measure
    from ..benchmark.settings import refusal

    s0 = todo[0]
    name = None
    if s0.device_type == "cpu":
        available, source = cpu_available_bytes(), "MemAvailable in /proc/meminfo"
    else:
        answer = measure.probe(s0, plugins, timeout)
        available, source, name = answer.get("free_bytes"), f"free memory of {s0.device}", answer.get("name")
    if available is None:
        why = "" if s0.device_type == "cpu" else f" ({answer.get('error') or 'it has no mem_get_info'})"
        print(f"bench: cannot tell how much memory {s0.device} has{why}; not checking that the shape fits",
              file=sys.stderr)
        return name
    for s in todo:
        problem = refusal(s, available, source)
        if problem:
            raise BenchError(problem)
    return name


def _methods(s: Setting, only: List[str]) -> tuple:
    import torch

    import logprob_registry as lr
    from ..benchmark.workload import BASELINE, BASELINE_DESCRIPTION

    expl = lr.explain(s.op, device=s.device_type, dtype=getattr(torch, s.dtype), requires_grad=s.backward)
    names = expl.eligible
    for name in only:
        if name not in names:
            try:
                why = expl[name].reason or expl[name].broken or "not eligible"
            except KeyError as exc:
                raise BenchError(str(exc).strip("'\"")) from None
            raise BenchError(f"--backend {name} cannot run {expl.key.describe()}: {why}")
    names = [n for n in names if n in only] if only else names
    backends = {b.name: b for b in lr.backends()}
    methods = [dict(name=BASELINE, kind="baseline", description=BASELINE_DESCRIPTION, priority=None,
                    origin=None, automatic_choice=False)]
    for n in names:
        b = backends[n]
        methods.append(dict(name=n, kind="backend", description=b.description, priority=b.priority,
                            origin=b.origin, automatic_choice=n == expl.chosen))
    return methods, expl


def _progress(text: str, end_line: bool) -> None:
    print(text, file=sys.stderr, end="\n" if end_line else "", flush=True)


def run(args: argparse.Namespace) -> int:
    from ..benchmark import measure, render
    from ..benchmark.plugins import register_plugins, unregister_plugins
    from ..environment import get_environment

    if args.process_group is not None:
        from ..benchmark.distributed import run_cli

        return run_cli(args)
    registered: List[str] = []
    try:
        todo = settings(args, get_environment().main_device)
        _check_device(todo[0].device)
        if args.plot:
            from ..benchmark.plot import check_available

            try:
                check_available()
            except RuntimeError as exc:
                raise BenchError(str(exc)) from None
        try:
            registered = register_plugins(args.plugin)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        device_name = _check_memory(todo, args.plugin, args.timeout)
        plan = [(s, *_methods(s, args.backend)) for s in todo]
    except BenchError as exc:
        unregister_plugins(registered)
        print(f"logprob-registry bench: {exc}", file=sys.stderr)
        return 2
    try:
        runs = []
        for s, methods, expl in plan:
            _progress(f"bench: {s.describe()}: {len(methods)} methods", True)
            results = measure.run_setting(s, methods, args.plugin, args.timeout, _progress, args.rounds)
            b, t, v = s.logits_shape
            runs.append(dict(
                title=s.describe(), settings=s.to_json(), rounds=args.rounds, memory_method=measure.memory_method(s.device_type),
                logits_bytes=b * t * v * s.itemsize, eligible=expl.eligible,
                automatic_choice=expl.chosen, results=results,
            ))
    finally:
        unregister_plugins(registered)
    options = {k: v for k, v in vars(args).items() if k != "command"}
    doc = render.document(runs, device_name, options)
    text = render.render(doc)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        from ..benchmark.plot import plot

        plot(doc, args.plot)
        _progress(f"bench: chart written to {args.plot}", True)
    failed = [r["name"] for run in runs for r in run["results"] if r["status"] != "ok"]
    return 1 if failed else 0
