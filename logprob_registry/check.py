"""``logprob-registry check``: the conformance suite against registered backends (issue 3)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", default=[], metavar="NAME")
    parser.add_argument("--device", default=None)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("logprob-registry check: the conformance suite is not built yet")
