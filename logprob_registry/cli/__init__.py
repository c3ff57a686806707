"""``logprob-registry`` (also ``python -m logprob_registry``): thin commands over their engines.

Each command is a module of this package with ``add_arguments(parser)`` and ``run(args) -> exit
status``: ``info`` (over :mod:`logprob_registry.report`), ``check`` (over
:mod:`logprob_registry.testing.runner`), ``bench`` (over :mod:`logprob_registry.benchmark`),
``tune`` (over :mod:`logprob_registry.tuning`), ``warmup`` (over :mod:`logprob_registry.warmup`),
``parity`` (over :mod:`logprob_registry.parity`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "info": ("logprob_registry.cli.info",
             "what was detected, which plugins loaded, which backend runs each op (default)"),
    "check": ("logprob_registry.cli.check", "run the conformance suite against backends; non-zero exit if one fails"),
    "bench": ("logprob_registry.cli.bench", "time and measure every eligible backend on this machine"),
    "tune": ("logprob_registry.cli.tune", "measure the eligible backends and write the ranking selection follows"),
    "parity": ("logprob_registry.cli.parity", "generate()'s sampled logprobs against the registry's replay"),
    "warmup": ("logprob_registry.cli.warmup", "build the compiled backend's kernels ahead, for fast first calls"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logprob-registry",
        description="Per-token log-probabilities through the best backend for this machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv or ["info"])
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
