"""Real entry-point plugins: plugins/template installed with pip into a folder of its own, and
distributions written at test time; each is found through its entry point alone, in a fresh
process that imports this worktree's package."""

import shutil
import subprocess
import sys

import pytest
from plugin_dists import ROOT, make_dist, run_python

WINNER = '''
import torch
import logprob_registry as lr
from logprob_registry import reference as ref

CALLS = []


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    CALLS.append(tuple(logits.shape))
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=torch.float32)


@lr.hookimpl
def register_backends(register):
    register(lr.Backend(name="test-winner", ops={"logprobs": logprobs}, devices={"cpu"}, priority=99))
'''


@pytest.fixture(scope="session")
def template_site(tmp_path_factory):
    """plugins/template, installed by pip into a folder that is put on PYTHONPATH."""
    target = tmp_path_factory.mktemp("template-site")
    source = tmp_path_factory.mktemp("template-src") / "template"
    shutil.copytree(ROOT / "plugins" / "template", source)  # the build writes next to the sources
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_the_installed_template_appears_in_info(template_site):
    proc = run_python(["-m", "logprob_registry", "info"], template_site)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["template", "logprob-registry-template", "0.1.0", "template"] in rows, proc.stdout
    assert "FAILED" not in proc.stdout


def test_the_installed_template_passes_check(template_site):
    proc = run_python(["-m", "logprob_registry", "check", "--backend", "template"], template_site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = [line.split() for line in proc.stdout.splitlines() if line.startswith("template ")]
    assert row[0:2] == ["template", "cpu"] and row[-1] == "pass" and row[3] == "0", proc.stdout
    assert int(row[2]) > 30  # the logprobs tests ran; entropy and the fused op are skipped, with reasons
    assert "template: skipped" in proc.stdout and "does not implement entropy" in proc.stdout


def test_the_templates_own_test_module_subclasses_the_suite(template_site):
    proc = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "plugins/template/tests",
                       "-k", "test_dtypes or test_gradients and float32"], template_site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_a_higher_priority_plugin_wins_automatically(tmp_path, template_site):
    site = make_dist(tmp_path / "site", "test-winner-dist", "test_winner_plugin", WINNER)
    code = (
        "import torch, logprob_registry as lr, test_winner_plugin as w\n"
        "print(lr.select('logprobs', device='cpu').name)\n"
        "out = lr.logprobs_from_logits(torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.long))\n"
        "print(w.CALLS)\n"
        "print(lr.select('logprobs', device='cpu', dtype=torch.float32, requires_grad=True).name)\n"
    )
    proc = run_python(["-c", code], site, template_site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["test-winner", "[(2, 3, 10)]", "test-winner"], proc.stdout


def test_a_plugin_that_raises_on_import_is_reported_and_breaks_nothing(tmp_path):
    site = make_dist(tmp_path / "site", "broken-plugin", "broken_plugin",
                     "raise ImportError('needs libfoo.so')\n")
    code = (
        "import torch, logprob_registry as lr\n"
        "print(lr.logprobs_from_logits(torch.zeros(3), torch.tensor(1)).item())\n"
        "print(lr.explain('logprobs', device='cpu'))\n"
    )
    proc = run_python(["-c", code], site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("-1.0986")  # log(1/3): the package works
    assert "plugin broken_plugin (broken-plugin 0.1) not loaded: failed to import: ImportError: needs libfoo.so" in proc.stdout
    info = run_python(["-m", "logprob_registry", "info"], site)
    assert info.returncode == 0, info.stderr
    assert "FAILED broken_plugin (broken-plugin 0.1): failed to import: ImportError: needs libfoo.so" in info.stdout
