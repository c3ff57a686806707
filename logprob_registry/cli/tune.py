"""``logprob-registry tune``: measure every eligible backend on this machine and write the ranking
that selection then follows (:mod:`logprob_registry.tuning`)."""

from __future__ import annotations

import argparse
import sys

from ..dtypes import parse_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..tuning.measure import HIDDENS, ROWS, TUNED_OPS, VOCABS

    parser.add_argument("--device", default=None, help="device type to tune (default: the main device)")
    parser.add_argument("--op", default=",".join(TUNED_OPS),
                        help=f"ops to measure, comma-separated, among {', '.join(TUNED_OPS)} (default: all of them)")
    parser.add_argument("--dtype", default="float32,bfloat16", help="logits dtypes (default float32,bfloat16)")
    parser.add_argument("--grad", choices=("both", "yes", "no"), default="both",
                        help="forward only (no), forward+backward (yes) or both (default)")
    parser.add_argument("--vocab", default=",".join(map(str, VOCABS)),
                        help="vocabulary sizes, one per bucket that matters (default %(default)s)")
    parser.add_argument("--hidden", default=",".join(map(str, HIDDENS)),
                        help="hidden sizes, one per hidden-size bucket that matters, for the ops given hidden "
                             "states (logprobs_from_hidden; default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="row counts measured per key; the ranking uses their geometric mean "
                             "(default %(default)s)")
    parser.add_argument("--backend", action="append", default=[], metavar="NAME", help="only these backends")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per measurement (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer calls and row counts: a rough ranking in a minute or two")
    parser.add_argument("--no-memory", action="store_true",
                        help="time only: no peak memory measured (each backend's memory verdict is then declared)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="ranking file (default: LOGPROB_REGISTRY_TUNING, else "
                             "~/.cache/logprob_registry/tuning.json)")


def _ints(text: str, what: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"logprob-registry tune: --{what} takes positive integers separated by commas, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from ..registry import get_registry
    from ..tuning import cache
    from ..tuning.measure import TUNED_OPS, Plan
    from ..tuning.measure import run as measure

    registry = get_registry()
    env = registry.environment()
    device = (args.device or env.main_device).split(":")[0]
    if not env.has_device(device):
        print(f"logprob-registry tune: there is no {device} device here", file=sys.stderr)
        return 2
    ops = [o.strip() for o in args.op.split(",") if o.strip()]
    bad = [o for o in ops if o not in TUNED_OPS]
    if bad or not ops:
        print(f"logprob-registry tune: --op takes {', '.join(TUNED_OPS)}, got {args.op!r}", file=sys.stderr)
        return 2
    try:
        dtypes = [parse_dtype(d) for d in args.dtype.split(",") if d.strip()]
    except ValueError as exc:
        print(f"logprob-registry tune: {exc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("logprob-registry tune: --repeat must be at least 1", file=sys.stderr)
        return 2
    if args.backend:
        known = {b.name for b in registry.backends()}
        unknown = [n for n in args.backend if n not in known]
        if unknown:
            print(f"logprob-registry tune: unknown backend {', '.join(map(repr, unknown))}; the registered ones are "
                  f"{', '.join(sorted(known))} (logprob-registry info lists them)", file=sys.stderr)
            return 2
    path = args.output or cache.path_in_force() or cache.default_path()
    grads = {"both": (False, True), "yes": (True,), "no": (False,)}[args.grad]
    plan = Plan(device=device, ops=ops, dtypes=dtypes, grads=grads, vocabs=_ints(args.vocab, "vocab"),
                hiddens=_ints(args.hidden, "hidden"), rows=_ints(args.rows, "rows"), backends=args.backend,
                repeat=args.repeat, memory=not args.no_memory)
    if args.quick:
        plan.repeat, plan.warmup, plan.quick = 2, 1, True
    print(f"tune: {len(plan.keys())} keys on {device}; writing {path}", file=sys.stderr, flush=True)
    ranking = measure(plan, lambda text: print(text, flush=True))
    try:
        old = cache.load(path)
    except ValueError:
        old = None
    if old is not None:
        ranking = old.merged(ranking)
    ranking.save(path)
    registry.reset()
    print(f"tune: wrote {len(ranking.entries)} keys to {path}; selection follows it "
          "(LOGPROB_REGISTRY_TUNING=off to ignore it)")
    return 0
