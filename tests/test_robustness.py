"""Nothing a caller does poisons the process: a fresh import, four threads making their first calls
at once, and a long sequence of valid and bad calls from four threads (tests/stress.py, each in a
fresh process, since marks, caches and environment variables are process-wide)."""

import json
from collections import Counter

import pytest
from plugin_dists import ROOT, run_python

IMPORT_WARNINGS = r'''
import json, sys, warnings
if sys.argv[1] == "no-numpy":
    sys.modules["numpy"] = None  # as in a fresh venv with torch alone: import numpy fails

def record(statement):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(statement)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]

print(json.dumps({"torch": record("import torch"), "logprob_registry": record("import logprob_registry")}))
'''


@pytest.mark.parametrize("numpy", ["numpy", "no-numpy"])
def test_importing_the_package_warns_nothing_that_importing_torch_does_not(numpy):
    """``import logprob_registry`` after ``import torch`` adds no warning, with numpy and without
    it (torch itself warns "Failed to initialize NumPy" at ``import torch`` when numpy is missing;
    the package must not import or call anything that warns again)."""
    proc = run_python(["-c", IMPORT_WARNINGS, numpy])
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["logprob_registry"] == [], found["logprob_registry"]
    if numpy == "no-numpy":  # the check above meant something: torch did warn about numpy
        assert any("NumPy" in w for w in found["torch"]), found["torch"]


def _stress(*args):
    proc = run_python([str(ROOT / "tests" / "stress.py"), *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["explicit", "automatic"])
def test_four_threads_making_their_first_calls_at_once(mode):
    """In a fresh process four threads call at once (``backend="compiled"``, or the automatic
    choice, with a backward): every call succeeds with the right values and gradient, from the
    backend ``explain`` names, and nothing is marked broken (an eligibility check that a half
    imported ``torch._dynamo`` makes fail is never cached)."""
    found = _stress("first-calls", mode)
    errors = {i: r["error"] for i, r in found["results"].items() if r["error"]}
    assert not errors, errors
    assert found["broken"] == {}
    served = {r["served"] for r in found["results"].values()}
    assert served == {"compiled" if mode == "explicit" else found["explained"]}, (served, found["explained"])


def test_fault_injection_from_four_threads():
    """Four threads, each a shuffled sequence of valid calls (every op, gradients, bf16,
    ``use_backend`` in one thread, ``torch.func.grad``) and every kind of bad call (V = 0, H = 0,
    labels out of range or of a float dtype, a zero temperature, meta tensors, an ignore_index
    beyond int64, an unknown backend, running out of memory on a device and on the host, a
    ``torch.func`` call through a backend without the feature, a bad environment variable set and
    unset), with a backend that always fails among them. At the end: every valid call gave the
    right values and gradients, from the backend ``explain`` named for it, the same backend for
    every call of its kind, and the failing backend is the only one marked broken, once."""
    found = _stress("faults")
    assert found["problems"] == [], "\n".join(found["problems"])
    kinds = Counter(r["call"] for r in found["records"])
    assert len(kinds) == 7 and min(kinds.values()) >= 3, kinds
    for r in found["records"]:
        assert r["served"] == r["explained"] == found["final"][r["call"]], r
    assert found["final"]["_valid_use_backend"] == found["final"]["_valid_functorch"] == "naive"
    assert found["final"]["_valid_both"] == "fi-memory"  # out of memory twice per thread, never marked
    assert found["broken"] == {"entropy torch.float32 grad=False": ["fi-faulty"]}
    assert found["fallbacks"] and all("backend 'fi-faulty' failed" in m for m in found["fallbacks"]), found["fallbacks"]
