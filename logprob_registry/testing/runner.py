"""The engine of ``logprob-registry check``: the shipped suite against registered backends.

Each backend runs the suite (:mod:`logprob_registry.testing`) in its own pytest process, so that a
crashing kernel takes down only its own result. A backend that cannot run on the device gets a
result saying why, without running anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from ..backend import Backend


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
    from ..call import key_for
    from ..registry import get_registry

    registry = get_registry()
    dtypes = sorted(backend.dtypes, key=str)
    first: Optional[str] = None
    for op in backend.ops:
        for dtype in dtypes:
            key = key_for(op, device=device, dtype=dtype)
            verdict = next(v for v in registry.verdicts(key) if v.name == backend.name)
            if verdict.reason is None:
                return None
            first = first or verdict.reason
    return first


def run_suite(name: str, device: str, keyword: Optional[str] = None, plugins: Sequence[str] = (),
              env: Optional[Mapping[str, str]] = None) -> Result:
    """The shipped suite against backend ``name`` on ``device``, in a pytest subprocess (with the
    pytest ``plugins`` loaded by ``-p`` and ``env`` added to its environment: ``check --against``)."""
    from . import suite_path

    with tempfile.TemporaryDirectory(prefix="logprob-check-") as tmp:
        ini, report = os.path.join(tmp, "pytest.ini"), os.path.join(tmp, "report.xml")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
        cmd = [sys.executable, "-m", "pytest", suite_path(), "-c", ini, "--rootdir", tmp,
               "-p", "no:cacheprovider", "-p", "logprob_registry_pytest", "-q", "-rfE",
               "--logprob-backend", name, "--logprob-device", device, "--junitxml", report]
        if keyword:
            cmd += ["-k", keyword]
        for plugin in plugins:
            cmd += ["-p", plugin]
        # No other pytest plugins; glibc maps large blocks from the start (exact peak-memory readings).
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", MALLOC_MMAP_THRESHOLD_="65536", **(env or {}))
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


def check(backends: List[Backend], device: str, keyword: Optional[str] = None,
          progress=lambda text: None) -> List[Result]:
    """One result per backend: the suite's outcome, or why it cannot run on ``device``."""
    results: List[Result] = []
    for backend in backends:
        reason = not_eligible_reason(backend, device)
        if reason is not None:
            results.append(Result(backend.name, f"not eligible on {device}: {reason}"))
            continue
        progress(f"checking {backend.name} on {device} ...")
        results.append(run_suite(backend.name, device, keyword))
    return results
