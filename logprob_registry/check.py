"""``logprob-registry check``: the conformance suite against registered backends, one table.

Each backend runs the shipped suite (:mod:`logprob_registry.testing`) in its own pytest process, so
that a crashing kernel takes down only its own row. Backends that cannot run on the device are
listed with the reason. The exit status is 1 when a backend fails, errors, or was named with
``--backend`` but cannot run here; 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .backend import DEVICE_TYPES, Backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", default=[], metavar="NAME",
                        help="backend to check (repeat for several); default: every registered backend")
    parser.add_argument("--device", default=None, choices=DEVICE_TYPES,
                        help="device type to run on (default: the machine's main device)")
    parser.add_argument("-k", dest="keyword", default=None, metavar="EXPRESSION",
                        help="only the suite's tests matching this pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's report for each backend")


@dataclass
class Result:
    """One backend's outcome."""

    backend: str
    verdict: str  # pass, FAIL, error: ..., not eligible: ...
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: List[str] = field(default_factory=list)
    skips: Dict[str, int] = field(default_factory=dict)  # reason -> count
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"


def not_eligible_reason(backend: Backend, device: str) -> Optional[str]:
    """None when ``backend`` can run at least one of its ops on ``device`` here, else why not."""
    from .eligibility import Key, why_not
    from .environment import get_environment

    env = get_environment()
    dtypes = sorted(backend.dtypes, key=str)
    first: Optional[str] = None
    for op in backend.ops:
        for dtype in dtypes:
            reason = why_not(backend, Key(op, device, dtype, False), env)
            if reason is None:
                return None
            first = first or reason
    return first


def run_suite(name: str, device: str, keyword: Optional[str] = None) -> Result:
    """The shipped suite against backend ``name`` on ``device``, in a pytest subprocess."""
    from .testing import suite_path

    with tempfile.TemporaryDirectory(prefix="logprob-check-") as tmp:
        ini, report = os.path.join(tmp, "pytest.ini"), os.path.join(tmp, "report.xml")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        cmd = [sys.executable, "-m", "pytest", suite_path(), "-c", ini, "--rootdir", tmp,
               "-p", "no:cacheprovider", "-p", "logprob_registry_pytest", "-q", "-rfE",
               "--logprob-backend", name, "--logprob-device", device, "--junitxml", report]
        if keyword:
            cmd += ["-k", keyword]
        # No other pytest plugins; glibc maps large blocks from the start (exact peak-memory readings).
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", MALLOC_MMAP_THRESHOLD_="65536")
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        seconds = time.perf_counter() - start
        output = proc.stdout + proc.stderr
        if not os.path.exists(report):
            last = output.strip().splitlines()[-1:] or ["no output"]
            return Result(name, f"error: pytest exited {proc.returncode} ({last[0]})", seconds=seconds, output=output)
        result = _parse(name, report, seconds, output)
    if proc.returncode not in (0, 1, 5) and result.ok:
        result.verdict = f"error: pytest exited {proc.returncode}"
    return result


def _parse(name: str, report: str, seconds: float, output: str) -> Result:
    result = Result(name, "pass", seconds=seconds, output=output)
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            result.failed += 1
            bad = kinds.get("failure", kinds.get("error"))
            message = (bad.get("message") or "").strip().splitlines()[:1]
            result.failures.append(f"{case.get('name')}: {message[0] if message else bad.tag}")
        elif "skipped" in kinds:
            result.skipped += 1
            reason = (kinds["skipped"].get("message") or "no reason given").strip()
            reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
            result.skips[reason] = result.skips.get(reason, 0) + 1
        else:
            result.passed += 1
    if result.failed:
        result.verdict = "FAIL"
    elif not result.passed:
        result.verdict = "error: no test ran"
    return result


def run(args: argparse.Namespace) -> int:
    from .environment import get_environment
    from .registry import NoEligibleBackendError, get_registry
    from .report import table

    registry = get_registry()
    device = args.device or get_environment().main_device
    try:
        backends = [registry.get(n) for n in args.backend] if args.backend else registry.backends()
    except NoEligibleBackendError as exc:
        print(f"logprob-registry check: {exc}", file=sys.stderr)
        return 2
    results: List[Result] = []
    for backend in backends:
        reason = not_eligible_reason(backend, device)
        if reason is not None:
            results.append(Result(backend.name, f"not eligible on {device}: {reason}"))
            continue
        print(f"checking {backend.name} on {device} ...", file=sys.stderr, flush=True)
        result = run_suite(backend.name, device, args.keyword)
        if args.verbose:
            print(result.output)
        results.append(result)
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
    return 1 if bad else 0
