"""``logprob-registry bench``: the command end to end on a tiny shape (every eligible backend and
the baseline present, a failing plugin reported while the others run, the JSON fields, the chart),
the refusal of a shape that cannot fit, and the pieces the children run, in process."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap

import pytest
import torch

import logprob_registry as lr
from logprob_registry.benchmark import child, measure, settings as st
from logprob_registry.benchmark.workload import Workload, max_differences
from logprob_registry.cli import main

BROKEN_PLUGIN = textwrap.dedent('''
    import logprob_registry as lr

    def broken(logits, labels, *, temperature, ignore_index, inplace_backward):
        raise RuntimeError("deliberately broken for the bench test")

    @lr.hookimpl
    def register_backends(register):
        register(lr.Backend(name="bench-test-broken", ops={"logprobs": broken}, devices={"cpu"}, priority=1))
''')

RESULT_FIELDS = {
    "name", "kind", "status", "error", "automatic_choice", "time_median_s", "time_iqr_s", "time_min_s",
    "time_max_s", "times_s", "peak_bytes", "max_abs_diff", "max_abs_diff_grad", "speedup", "memory_ratio",
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One run of the command on a tiny shape, with a broken plugin registered through --plugin
    (the children are subprocesses: they import it from the working directory too)."""
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "bench_test_broken.py").write_text(BROKEN_PLUGIN)
    expected = lr.explain("logprobs", device="cpu", dtype=torch.float32, requires_grad=True).eligible
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.chdir(tmp)
        rc = main(["bench", "--device", "cpu", "--shape", "2,8,64", "--slice", "--backward", "--repeat", "2",
                   "--warmup", "1", "--plugin", "bench_test_broken", "--json", "out.json", "--plot", "out.png"])
    sys.modules.pop("bench_test_broken", None)
    return dict(rc=rc, doc=json.loads((tmp / "out.json").read_text()), expected=expected, tmp=tmp,
                table=out.getvalue(), progress=err.getvalue())


def test_every_eligible_backend_and_the_baseline_are_measured(bench_run):
    doc, expected = bench_run["doc"], bench_run["expected"]
    (run,) = doc["runs"]
    names = [r["name"] for r in run["results"]]
    assert names[0] == "baseline"
    assert set(names) == {"baseline", "bench-test-broken", *expected}
    assert run["settings"]["logits_shape"] == [2, 7, 64] and run["settings"]["backward"] is True
    for name in names:
        assert f"] {name} time ... " in bench_run["progress"]  # one progress line per method, on stderr
        assert name in bench_run["table"]


def test_a_failing_backend_is_reported_and_the_others_still_run(bench_run):
    rc, doc = bench_run["rc"], bench_run["doc"]
    results = {r["name"]: r for r in doc["runs"][0]["results"]}
    broken = results.pop("bench-test-broken")
    assert broken["status"] == "failed" and "deliberately broken" in broken["error"]
    assert broken["time_median_s"] is None
    assert all(r["status"] == "ok" for r in results.values()), results
    assert rc == 1  # a failure is visible in the exit status
    assert "FAILED bench-test-broken: RuntimeError: deliberately broken" in bench_run["table"]
    assert "bench-test-broken" not in [b.name for b in lr.backends()], "the --plugin stays registered"


def test_json_has_every_field(bench_run):
    doc = bench_run["doc"]
    assert {"tool", "version", "environment", "options", "runs"} <= set(doc)
    run = doc["runs"][0]
    assert {"title", "settings", "rounds", "memory_method", "logits_bytes", "eligible", "automatic_choice", "results"} <= set(run)
    for r in run["results"]:
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        if r["status"] != "ok":
            continue
        assert len(r["times_s"]) == 2 and r["time_min_s"] <= r["time_median_s"] <= r["time_max_s"]
        assert r["time_iqr_s"] >= 0 and isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
        assert r["max_abs_diff"] < 1e-5 and r["max_abs_diff_grad"] < 1e-5  # float32 against float64
        assert r["speedup"] > 0
    assert run["results"][0]["speedup"] == 1.0


def test_the_chart_is_written(bench_run):
    assert (bench_run["tmp"] / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_shape_that_cannot_fit_is_refused(capsys):
    rc = main(["bench", "--device", "cpu", "--shape", "4096,65536,262144", "--backward"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "needs about" in err and "GiB is available" in err and "Try --shape" in err


@pytest.mark.parametrize("argv, message", [
    (["--shape", "2,8"], "three positive integers"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--op", "logprobs_from_hidden"], "not benchmarked yet"),
    (["--backend", "no-such-backend"], "no backend named 'no-such-backend'"),
    (["--inplace-backward"], "only makes sense with --backward"),
    (["--plugin", "no_such_module_xyz"], "cannot import it"),
])
def test_usage_errors_say_what_is_wrong(capsys, argv, message):
    shape = [] if "--shape" in argv else ["--shape", "2,8,64"]
    rc = main(["bench", "--device", "cpu", *shape, *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_missing_matplotlib_gives_the_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--device", "cpu", "--shape", "2,8,64", "--plot", "x.png"]) == 2
    assert "pip install 'logprob-registry[plot]'" in capsys.readouterr().err


# ------------------------------------------------------------------ the pieces, in process
def test_rounds_interleave_methods_and_pool_their_times(monkeypatch):
    calls = []

    def fake_child(what, s, method, plugins, timeout):
        calls.append((what, method))
        if method == "bad":
            return dict(error="RuntimeError: no")
        if what == "mem":
            return dict(peak_bytes=100 if method == "baseline" else 50)
        return dict(times_s=[0.2 if method == "baseline" else 0.1] * 2, max_abs_diff=0.0, max_abs_diff_grad=None)

    monkeypatch.setattr(measure, "run_child", fake_child)
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(2, 4, 16), repeat=2)
    methods = [dict(name=n, kind="baseline" if n == "baseline" else "backend") for n in ("baseline", "fast", "bad")]
    lines = []
    results = measure.run_setting(s, methods, [], None, lambda text, end: lines.append(text), rounds=3)
    assert [c for c in calls if c[0] == "time"] == [
        ("time", "baseline"), ("time", "fast"), ("time", "bad"), ("time", "baseline"), ("time", "fast"),
        ("time", "baseline"), ("time", "fast")]
    base, fast, bad = results
    assert len(fast["times_s"]) == 6 and fast["speedup"] == pytest.approx(2.0) and fast["memory_ratio"] == 0.5
    assert bad["status"] == "failed" and bad["error"] == "RuntimeError: no" and bad["speedup"] is None
    assert "FAILED: RuntimeError: no" in lines


def test_presets_and_shapes():
    assert st.PRESETS["verl"] == ((16, 1024, 32768), "float32", False, st.PRESETS["verl"].what)
    assert st.PRESETS["trlx"][:3] == ((32, 2048, 64000), "float16", True)
    assert st.parse_shape("4x1024x32768") == (4, 1024, 32768)
    with pytest.raises(ValueError, match="three positive integers"):
        st.parse_shape("0,1,2")


def test_suggestion_fits_and_refusal_gives_numbers():
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(16, 1024, 32768), backward=True)
    need = sum(st.estimate_bytes(s).values())
    assert st.refusal(s, need, "test") is None
    message = st.refusal(s, need // 3, "test")
    assert "needs about" in message and "Try --shape" in message
    b, t, v = st.suggest(s, need // 3)
    assert (t, v) == (1024, 32768) and b < 16
    assert sum(st.estimate_bytes(st.Setting(**dict(s.to_args(), shape=(b, t, v)))).values()) <= need // 3


@pytest.mark.parametrize("op", st.BENCH_OPS)
@pytest.mark.parametrize("backward", [False, True])
def test_workload_matches_the_reference(op, backward):
    s = st.Setting(op=op, device="cpu", dtype="bfloat16", shape=(2, 5, 33), sliced=True, backward=backward)
    for name, tol in (("naive", 1e-5), ("baseline", 1e-1)):
        w = Workload(s, name)
        outs = w.run(w.prepare())
        diff, grad_diff = max_differences(s, w.logits, w.labels, outs, w.grad())
        assert 0 <= diff < tol and (grad_diff is None) == (not backward)
        if backward:
            assert 0 < grad_diff < 1e-1  # bfloat16 gradients are rounded
    # the textbook baseline in bfloat16 is visibly worse than float32 accumulation
    assert max_differences(s, w.logits, w.labels, w.run(w.prepare()), None)[0] > 1e-4


def test_children_measure_in_process(capsys):
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(2, 4, 16), repeat=3, warmup=1)
    for what in ("time", "mem"):
        child.main([json.dumps(dict(what=what, setting=s.to_args(), method="naive", plugins=[]))])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(child.MARKER)]
    timed, mem = (json.loads(l[len(child.MARKER):]) for l in lines)
    assert len(timed["times_s"]) == 3 and timed["max_abs_diff"] < 1e-6 and timed["max_abs_diff_grad"] is None
    assert mem["peak_bytes"] >= 0


def test_a_child_reports_an_error_as_json(capsys):
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(2, 4, 16))
    child.main([json.dumps(dict(what="time", setting=s.to_args(), method="no-such-backend", plugins=[]))])
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith(child.MARKER)][-1]
    assert "no backend named 'no-such-backend'" in json.loads(line[len(child.MARKER):])["error"]
