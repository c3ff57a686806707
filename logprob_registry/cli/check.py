"""``logprob-registry check``: the conformance suite against registered backends, one table
(:mod:`logprob_registry.testing.runner` does the work).

With ``--against MODULE:FUNCTION --signature NAME`` it judges a foreign function instead
(:mod:`logprob_registry.testing.against`): a table of the cases that depart from the contract,
and the cases its calling convention cannot express; exit status 1 when one departs.

Exit status: 1 when a backend fails or errors, when a backend named with ``--backend`` cannot run
on the device, or when nothing at all could be checked there (a CI job that lost its GPU must not
stay green); 2 for a usage error; 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", default=[], metavar="NAME",
                        help="backend to check (repeat for several); default: every registered backend")
    parser.add_argument("--device", default=None, metavar="TYPE",
                        help="device type to run on, such as cpu, cuda or npu (default: the machine's main device)")
    parser.add_argument("-k", dest="keyword", default=None, metavar="EXPRESSION",
                        help="only the suite's tests matching this pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's report for each backend")
    parser.add_argument("--against", default=None, metavar="MODULE:FUNCTION",
                        help="judge a foreign function instead of registered backends: import it, wrap it by "
                             "its calling convention (--signature) and run the suite's cases it can express")
    parser.add_argument("--signature", default=None, metavar="NAME",
                        help="the calling convention of --against (logprob_registry.testing.against.CONVENTIONS: "
                             "verl-logprobs, verl-fused, trl-selective, trl-selective-entropy, trl-chunked-head, "
                             "torch-lce, torch-lce-chunked, liger-ce, liger-flce, liger-flsce; or MODULE:ATTR "
                             "naming a Convention)")
    parser.add_argument("--declare", action="append", default=[], metavar="FLAG=BOOL",
                        help="with --against: a promise to hold the function to, or not (deterministic=false, "
                             "batch_invariant=false, copies_logits=false to apply the no-copy memory bound)")


def run(args: argparse.Namespace) -> int:
    from ..registry import NoEligibleBackendError, get_registry
    from ..report import table
    from ..testing.runner import check

    registry = get_registry()
    device = _device_type(args.device or registry.environment().main_device)
    if device is None:
        print(f"logprob-registry check: --device {args.device!r} is not a device type torch knows, "
              "such as cpu, cuda or npu", file=sys.stderr)
        return 2
    if args.against or args.signature:
        return _run_against(args, device)
    try:
        backends = [registry.get(n) for n in args.backend] if args.backend else registry.backends()
    except NoEligibleBackendError as exc:
        print(f"logprob-registry check: {exc}", file=sys.stderr)
        return 2
    results = check(backends, device, args.keyword, lambda text: print(text, file=sys.stderr, flush=True))
    for r in results:
        if args.verbose and r.output:
            print(r.output)
    rows = [(r.backend, device, *(("-",) * 4 if r.verdict.startswith("not eligible") else
                                   (str(r.passed), str(r.failed), str(r.skipped), f"{r.seconds:.1f}")), r.verdict)
            for r in results]
    print(table(("backend", "device", "passed", "failed", "skipped", "seconds", "verdict"), rows))
    for r in results:
        for failure in r.failures:
            print(f"{r.backend}: FAILED {failure}")
        for reason, count in sorted(r.skips.items(), key=lambda kv: -kv[1]):
            print(f"{r.backend}: skipped {count}: {reason}")
        if r.verdict.startswith("error") and not args.verbose:
            print(f"{r.backend}: {r.output.strip()[-2000:]}")
    explicit = set(args.backend)
    bad = [r for r in results if not r.ok and (not r.verdict.startswith("not eligible") or r.backend in explicit)]
    if all(r.verdict.startswith("not eligible") for r in results):
        print(f"logprob-registry check: nothing was checked on {device}: no backend can run there "
              "(see the verdicts above)", file=sys.stderr)
        return 1
    return 1 if bad else 0


def _run_against(args: argparse.Namespace, device: str) -> int:
    """``--against MODULE:FUNCTION --signature NAME``: 1 when a case departs from the contract (or
    nothing ran), 2 for a usage error, 0 when every expressible case conforms."""
    from ..backend import CAPABILITIES
    from ..testing.against import check_against, format_result

    if not (args.against and args.signature) or args.backend:
        print("logprob-registry check: --against MODULE:FUNCTION needs --signature NAME (and no --backend)",
              file=sys.stderr)
        return 2
    declare = {}
    for item in args.declare:
        flag, _, value = item.partition("=")
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            print(f"logprob-registry check: --declare {item!r}: give FLAG=true or FLAG=false", file=sys.stderr)
            return 2
        if flag.strip() not in CAPABILITIES:
            print(f"logprob-registry check: --declare {item!r}: {flag.strip()!r} is none of the promises "
                  f"{', '.join(CAPABILITIES)}", file=sys.stderr)
            return 2
        declare[flag.strip()] = value.lower() in ("true", "1", "yes")
    try:
        result = check_against(args.against, args.signature, device, args.keyword, declare,
                               progress=lambda text: print(text, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"logprob-registry check: {exc}", file=sys.stderr)
        return 2
    if args.verbose and result.output:
        print(result.output)
    print(format_result(result, verbose=args.verbose))
    return 0 if result.ok else 1


def _device_type(device: str):
    """``"cuda:1"`` -> ``"cuda"``; None for a name torch does not know."""
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, ValueError):
        return None
