"""``logprob-registry info``: the environment, the plugins, the configuration, and the verdicts of
every backend for every op (:func:`logprob_registry.report.info`)."""

from __future__ import annotations

import argparse

from ..dtypes import parse_dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", help="input dtype of the tables (default float32)")
    parser.add_argument("--grad", action="store_true", help="tables for inputs that need gradients")


def run(args: argparse.Namespace) -> int:
    from ..registry import get_registry
    from ..report import info

    try:
        dtype = parse_dtype(args.dtype)
    except ValueError as exc:
        raise SystemExit(f"logprob-registry info: {exc}") from None
    print(info(get_registry(), dtype, args.grad))
    return 0
