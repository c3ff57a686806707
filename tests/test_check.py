"""``logprob-registry check``: one row per backend, and a non-zero exit when one fails."""

import re

from plugin_dists import make_dist, run_python

SIGN_ERROR = '''
import torch
import logprob_registry as lr
from logprob_registry import reference as ref


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return -ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(name="test-sign-error", ops={"logprobs": logprobs}, devices={"cpu"},
                        dtypes={torch.float32}))
'''


def _rows(stdout):
    return {line.split()[0]: line.split() for line in stdout.splitlines()[2:] if line and ":" not in line.split()[0]}


def test_check_prints_a_row_per_backend_and_fails_when_one_fails(tmp_path):
    site = make_dist(tmp_path / "site", "test-sign-error-dist", "test_sign_error_plugin", SIGN_ERROR)
    proc = run_python(["-m", "logprob_registry", "check", "-k", "test_dtypes and logprobs"], site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert rows["naive"][-1] == "pass" and rows["naive"][3] == "0", proc.stdout
    assert rows["test-sign-error"][-1] == "FAIL" and rows["test-sign-error"][3] == "1", proc.stdout
    assert "test-sign-error: FAILED test_dtypes[logprobs-float32]: AssertionError: logprobs output 0" in proc.stdout
    assert "test-sign-error: skipped" in proc.stdout  # the other dtypes, with the reason


def test_check_lists_backends_that_cannot_run_on_the_device_and_fails_when_nothing_was_checked(monkeypatch):
    """A CI job that lost its GPU must not stay green: every backend listed with its reason, and
    a non-zero exit because nothing ran."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # lose the GPU, if this machine has one
    proc = run_python(["-m", "logprob_registry", "check", "--device", "cuda"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^naive +cuda +- +- +- +- +not eligible on cuda: no CUDA device$", proc.stdout, re.M), proc.stdout
    assert "nothing was checked on cuda: no backend can run there" in proc.stderr
    named = run_python(["-m", "logprob_registry", "check", "--device", "cuda:0", "--backend", "naive"])
    assert named.returncode == 1  # a backend asked for by name that cannot be checked is no pass
    assert "naive" in named.stdout and "nothing was checked on cuda" in named.stderr


def test_check_refuses_a_device_torch_does_not_know():
    proc = run_python(["-m", "logprob_registry", "check", "--device", "gpu0"])
    assert proc.returncode == 2
    assert "--device 'gpu0' is not a device type torch knows" in proc.stderr and proc.stdout == ""


def test_check_names_an_unknown_backend():
    proc = run_python(["-m", "logprob_registry", "check", "--backend", "no-such-kernel"])
    assert proc.returncode == 2
    assert "no backend named 'no-such-kernel' is registered; registered: " in proc.stderr and "naive" in proc.stderr
