"""``logprob-registry bench``: the command end to end on a tiny shape (every eligible backend and
the baseline present, a failing plugin reported while the others run, the JSON fields, the chart),
``--op logprobs_from_hidden``, the refusals that come before anything runs (usage, unwritable
outputs, a shape that cannot fit), the engine from Python, and the pieces the children run, in
process."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import logprob_registry as lr
from logprob_registry.benchmark import BenchError, Options, bench, child, fit, measure
from logprob_registry.benchmark import settings as st
from logprob_registry.benchmark.render import render
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
    "time_max_s", "times_s", "cpu_time_median_s", "cpu_times_s", "bandwidth_bytes_per_s", "peak_bytes",
    "max_abs_diff", "max_abs_diff_grad", "max_abs_diff_grads", "speedup", "memory_ratio",
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
    assert {"title", "settings", "rounds", "memory_method", "baseline", "logits_bytes", "input_bytes", "grad_inputs",
            "eligible", "automatic_choice", "results"} <= set(run)
    assert run["grad_inputs"] == ["logits"] and run["input_bytes"] == {"logits": 2 * 8 * 64 * 4, "labels": 2 * 8 * 8}
    for r in run["results"]:
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        if r["status"] != "ok":
            continue
        assert len(r["times_s"]) == 2 and r["time_min_s"] <= r["time_median_s"] <= r["time_max_s"]
        assert r["time_iqr_s"] >= 0 and isinstance(r["peak_bytes"], int) and r["peak_bytes"] >= 0
        assert r["max_abs_diff"] < 1e-5 and r["max_abs_diff_grad"] < 1e-5  # float32 against float64
        assert r["max_abs_diff_grads"] == {"logits": r["max_abs_diff_grad"]}
        assert len(r["cpu_times_s"]) == 2 and r["cpu_time_median_s"] > 0
        assert r["bandwidth_bytes_per_s"] == pytest.approx(3 * 2 * 7 * 64 * 4 / r["time_median_s"])
        assert r["speedup"] > 0
    assert run["results"][0]["speedup"] == 1.0


def test_the_chart_is_written(bench_run):
    assert (bench_run["tmp"] / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_shape_that_cannot_fit_is_refused(capsys):
    rc = main(["bench", "--device", "cpu", "--shape", "4096,65536,262144", "--backward"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "needs about" in err and "GiB is available" in err and "Try --shape" in err


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a measuring child would start."""
    def no_child(*args, **kwargs):
        raise AssertionError("a measurement started although the arguments were refused")

    monkeypatch.setattr(measure, "run_child", no_child)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "2,8"], "three positive integers"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--op", "no_such_op"], "unknown op 'no_such_op'; choose from logprobs, entropy"),
    (["--backend", "no-such-backend"], "no backend named 'no-such-backend'"),
    (["--inplace-backward"], "only makes sense with --backward"),
    (["--op", "entropy", "--backward", "--inplace-backward"], "entropy has no inplace_backward option"),
    (["--hidden-size", "64"],
     "--hidden-size only applies to ops with hidden states (logprobs_from_hidden, kl_divergence, token_stats)"),
    (["--op", "logprobs_from_hidden", "--hidden-size", "0"], "--hidden-size must be an integer of at least 1"),
    (["--plugin", "no_such_module_xyz"], "cannot import it"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5.0"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--repeat", "0"], "--repeat must be an integer of at least 1, got 0"),
    (["--rounds", "0"], "--rounds must be an integer of at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be an integer of at least 0, got -1"),
    (["--threads", "0"], "--threads must be an integer of at least 1, got 0"),
    (["--device", "nonsense"], "is not a device such as cpu"),
])
def test_usage_errors_say_what_is_wrong(capsys, nothing_runs, argv, message):
    shape = [] if "--shape" in argv else ["--shape", "2,8,64"]
    rc = main(["bench", "--device", "cpu", *shape, *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("logprob-registry bench: ")


@pytest.mark.parametrize("argv, message", [
    (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: folder /nonexistent does not exist"),
    (["--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: folder /nonexistent does not exist"),
    (["--plot", "x.txt"], "--plot x.txt: extension .txt; name a file matplotlib can write: "),
    (["--plot", "chart"], "--plot chart: no extension"),
    (["--json", "."], "--json .: is a folder"),
])
def test_outputs_that_cannot_be_written_are_refused_before_anything_runs(capsys, nothing_runs, argv, message):
    rc = main(["bench", "--device", "cpu", "--shape", "2,8,64", *argv])
    captured = capsys.readouterr()
    assert rc == 2 and message in captured.err, captured.err
    assert captured.out == "" and "time ..." not in captured.err


def test_plot_accepts_what_matplotlib_writes():
    from logprob_registry.benchmark.plot import check_path, formats

    assert {"png", "svg", "pdf"} <= set(formats())
    check_path("x.svg")
    with pytest.raises(ValueError, match=r"\.png"):
        check_path("x.txt")


def test_missing_matplotlib_gives_the_install_hint(monkeypatch, capsys, nothing_runs):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--device", "cpu", "--shape", "2,8,64", "--plot", "x.png"]) == 2
    assert "pip install 'logprob-registry[plot]'" in capsys.readouterr().err


# ------------------------------------------------------------------ logprobs_from_hidden
def test_bench_of_the_fused_op_prints_its_table():
    """The command as a user types it: the baseline (the logits formed, then the textbook formula)
    and every CPU backend of the fused op, in one table."""
    proc = subprocess.run(
        [sys.executable, "-m", "logprob_registry", "bench", "--op", "logprobs_from_hidden", "--device", "cpu",
         "--shape", "2,64,512", "--hidden-size", "32", "--repeat", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "logprobs_from_hidden on cpu float32 2x64x512 H=32, forward"
    assert "against the baseline (hidden @ weight.T, then the textbook formula in the input dtype)" in proc.stdout
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isalpha() and "  " in line}
    for name in ("baseline", "chunked", "naive"):
        assert name in rows, proc.stdout
        assert float(rows[name][-1]) < 1e-5, rows[name]  # max |diff| against float64, float32 inputs
    assert "the logits this op reduces, 2x64x512 in float32, take 0.2 MiB" in proc.stdout


def test_the_engine_benches_the_fused_op_backward_from_python():
    """``benchmark.bench``: gradients of hidden and weight against float64, every eligible
    backend, in bfloat16 (the baseline's bf16 logits are visibly worse than the fused op's)."""
    lines = []
    doc = bench(progress=lambda text, end: lines.append(text), ops=["logprobs_from_hidden"], device="cpu",
                dtypes=["bf16"], shape=(2, 6, 96), hidden_size=16, sliced=True, backward=True, repeat=1, warmup=0)
    (run,) = doc["runs"]
    assert run["settings"]["inputs"] == {"hidden": [2, 5, 16], "weight": [96, 16], "labels": [2, 5]}
    assert run["grad_inputs"] == ["hidden", "weight"] and run["settings"]["hidden_size"] == 16
    assert run["input_bytes"]["weight"] == 96 * 16 * 2
    report = lr.explain("logprobs_from_hidden", device="cpu", dtype=torch.bfloat16, requires_grad=True)
    expected = [c.name for c in report.candidates if c.reason is None and c.broken is None]  # naive: skipped, run
    results = {r["name"]: r for r in run["results"]}
    assert set(results) == {"baseline", *expected} and "chunked" in results
    for r in results.values():
        assert r["status"] == "ok", r
        assert set(r["max_abs_diff_grads"]) == {"hidden", "weight"}
        assert r["max_abs_diff_grad"] == r["max_abs_diff_grads"]["hidden"]
        assert all(0 < d < 0.1 for d in r["max_abs_diff_grads"].values()), r
        assert r["bandwidth_bytes_per_s"] is None  # the fused op forms its logits: no traffic bound
    assert results["chunked"]["max_abs_diff"] < 1e-5 < results["baseline"]["max_abs_diff"]
    assert "max |hidden grad diff|" in render(doc) and "max |weight grad diff|" in render(doc)
    assert any("chunked time" in line for line in lines)


def test_the_fit_estimate_counts_weight_hidden_their_grads_and_the_baseline_logits():
    s = st.Setting(op="logprobs_from_hidden", device="cpu", dtype="bfloat16", shape=(4, 1024, 131072),
                   hidden_size=4096, backward=True)
    parts = fit.estimate_bytes(s)
    n, v, h = 4 * 1024, 131072, 4096
    assert parts["weight"] == v * h * 2 and parts["hidden"] == n * h * 2 and parts["labels"] == n * 8
    assert parts["gradients"] == (v * h + n * h) * 2
    assert parts["baseline logits"] == 2 * n * v * 2
    assert parts["float64 reference"] >= 3 * v * h * 8  # the weight, its gradient, one product
    forward = fit.estimate_bytes(st.Setting(**dict(s.to_args(), backward=False)))
    assert forward["gradients"] == 0 and forward["baseline logits"] == n * v * 2
    need = sum(parts.values())
    fixed = sum(fit.estimate_bytes(st.Setting(**dict(s.to_args(), shape=(1, 1, v)))).values())
    assert fixed > 3 * v * h * 8  # the weight's parts stay whatever the number of tokens
    message = fit.refusal(s, (need + fixed) // 2, "test")
    assert "needs about" in message and "weight" in message and "Try --shape" in message
    b, t, _ = fit.suggest(s, (need + fixed) // 2)
    assert b * t < 4 * 1024
    # a weight that alone does not fit: no shape helps
    assert "try a smaller vocabulary or hidden size" in fit.refusal(s, v * h * 2, "test")


def test_a_hidden_shape_that_cannot_fit_is_refused(capsys, nothing_runs):
    rc = main(["bench", "--device", "cpu", "--op", "logprobs_from_hidden", "--shape", "64,65536,262144",
               "--hidden-size", "16384", "--backward"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs about" in err and "weight" in err and "baseline logits" in err


def test_options_are_checked_in_the_engine():
    with pytest.raises(BenchError, match="--repeat must be an integer of at least 1"):
        Options(repeat=0).check()
    with pytest.raises(BenchError, match="--timeout must be a positive number of seconds"):
        Options(timeout=float("inf")).check()
    with pytest.raises(BenchError, match="give --shape or --preset, not both"):
        Options(shape=(1, 2, 3), preset="small").check()
    Options(timeout=None).check()  # no limit, from Python
    from logprob_registry.benchmark.session import settings

    made = settings(Options(ops=["logprobs,logprobs_from_hidden"], preset="verl", dtypes=["bf16"]), "cpu")
    assert [(s.op, s.dtype, s.shape, s.hidden_size) for s in made] == [
        ("logprobs", "bfloat16", (16, 1024, 32768), None),
        ("logprobs_from_hidden", "bfloat16", (16, 1024, 32768), 4096)]
    made = settings(Options(ops=["logprobs_from_hidden"], shape="2,8,64"), "cpu")
    assert made[0].hidden_size == st.DEFAULT_HIDDEN_SIZE


# ------------------------------------------------------------------ the pieces, in process
def test_rounds_interleave_methods_and_pool_their_times(monkeypatch):
    calls = []

    def fake_child(what, s, method, plugins, timeout):
        calls.append((what, method))
        if method == "bad":
            return dict(error="RuntimeError: no")
        if what == "mem":
            return dict(peak_bytes=100 if method == "baseline" else 50)
        return dict(times_s=[0.2 if method == "baseline" else 0.1] * 2, cpu_times_s=[0.1] * 2, max_abs_diff=0.0,
                    max_abs_diff_grad=None)

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
    assert fast["cpu_time_median_s"] == 0.1 and fast["bandwidth_bytes_per_s"] == pytest.approx(2 * 4 * 16 * 4 / 0.1)
    assert bad["status"] == "failed" and bad["error"] == "RuntimeError: no" and bad["speedup"] is None
    assert "FAILED: RuntimeError: no" in lines


def test_presets_and_shapes():
    assert st.PRESETS["verl"] == ((16, 1024, 32768), "float32", False, st.PRESETS["verl"].what, 4096)
    assert st.PRESETS["trlx"][:3] == ((32, 2048, 64000), "float16", True)
    assert st.parse_shape("4x1024x32768") == (4, 1024, 32768)
    with pytest.raises(ValueError, match="three positive integers"):
        st.parse_shape("0,1,2")


def test_suggestion_fits_and_refusal_gives_numbers():
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(16, 1024, 32768), backward=True)
    need = sum(fit.estimate_bytes(s).values())
    assert fit.refusal(s, need, "test") is None
    message = fit.refusal(s, need // 3, "test")
    assert "needs about" in message and "Try --shape" in message
    b, t, v = fit.suggest(s, need // 3)
    assert (t, v) == (1024, 32768) and b < 16
    assert sum(fit.estimate_bytes(st.Setting(**dict(s.to_args(), shape=(b, t, v)))).values()) <= need // 3


def test_the_bench_reads_its_ops_from_the_op_table():
    # every public op giving logprobs/entropy/KL (topk_logprobs returns ids; the shard ops have no public function)
    assert st.bench_ops() == ("logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden", "kl_divergence",
                              "token_stats")
    assert [st.uses_hidden_size(op) for op in st.bench_ops()] == [op == "logprobs_from_hidden" for op in st.bench_ops()]
    assert [st.takes_hidden_size(op) for op in st.bench_ops()] == [False, False, False, True, True, True]
    assert st.hidden_weights("kl_divergence") == {"student_weight": "student", "teacher_weight": "teacher"}


@pytest.mark.parametrize("op", st.bench_ops())
@pytest.mark.parametrize("backward", [False, True])
def test_workload_matches_the_reference(op, backward):
    hidden = 8 if st.uses_hidden_size(op) else None
    s = st.Setting(op=op, device="cpu", dtype="bfloat16", shape=(2, 5, 33), hidden_size=hidden, sliced=True,
                   backward=backward)
    for name, tol in (("naive", 1e-5), ("baseline", 1e-1)):
        w = Workload(s, name)
        outs = w.run(w.prepare())
        diff, grad_diffs = max_differences(s, w.inputs, outs, w.grads())
        assert 0 <= diff < tol and len(outs) == len(s.outputs)
        wanted = set() if not backward else {"hidden", "weight"} if hidden else {"student"} if op == "kl_divergence" \
            else {"inputs"} if op == "token_stats" else {"logits"}
        assert set(grad_diffs) == set(s.grad_inputs) == wanted
        assert all(0 < d < 1e-1 for d in grad_diffs.values())  # bfloat16 gradients are rounded
    # the textbook baseline in bfloat16 is visibly worse than float32 accumulation
    assert max_differences(s, w.inputs, w.run(w.prepare()))[0] > 1e-4


def test_children_measure_in_process(capsys):
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(2, 4, 16), repeat=3, warmup=1)
    for what in ("time", "mem"):
        child.main([json.dumps(dict(what=what, setting=s.to_args(), method="naive", plugins=[]))])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(child.MARKER)]
    timed, mem = (json.loads(line[len(child.MARKER):]) for line in lines)
    assert len(timed["times_s"]) == 3 and timed["max_abs_diff"] < 1e-6 and timed["max_abs_diff_grad"] is None
    assert len(timed["cpu_times_s"]) == 3 and timed["max_abs_diff_grads"] == {}
    assert mem["peak_bytes"] >= 0


def test_a_child_reports_an_error_as_json(capsys):
    s = st.Setting(op="logprobs", device="cpu", dtype="float32", shape=(2, 4, 16))
    child.main([json.dumps(dict(what="time", setting=s.to_args(), method="no-such-backend", plugins=[]))])
    line = [text for text in capsys.readouterr().out.splitlines() if text.startswith(child.MARKER)][-1]
    assert "no backend named 'no-such-backend'" in json.loads(line[len(child.MARKER):])["error"]


@pytest.mark.parametrize("op", st.bench_ops() + ("topk_logprobs",))
def test_the_op_table_makes_example_inputs_and_their_ground_truth(op):
    from logprob_registry.opspec import OPS

    spec = OPS[op]
    ex = spec.example((2, 3, 40), torch.bfloat16, "cpu", requires_grad=True, seed=7, hidden_size=8)
    assert tuple(ex.inputs) == spec.inputs
    again = spec.example((2, 3, 40), torch.bfloat16, "cpu", seed=7, hidden_size=8)
    assert all(torch.equal(a, b) for a, b in zip(ex.args, again.args))  # the same numbers for a seed
    assert {n for n, x in ex.inputs.items() if x.requires_grad} == set(spec.grad_inputs) & set(spec.inputs)
    options = {k: v.detach().double() if isinstance(v, torch.Tensor) else v for k, v in ex.options.items()}
    want = spec.ground_truth(*(x.detach().double() if x.is_floating_point() else x for x in ex.args), **options)
    assert len(want) == len(spec.output_names(ex.options)) and want[0].dtype == torch.float64
    got = spec.public()(*ex.args, backend="naive", **ex.options)
    got = got if isinstance(got, tuple) else (got,)
    assert (got[0].double() - want[0]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="no example inputs"):
        OPS["shard_stats"].example((2, 40))


# ------------------------------------------------------------------ kl_divergence
KL_TRUTH = ("logits", None), ("hidden states", 8)


@pytest.mark.parametrize("what, hidden", KL_TRUTH)
@pytest.mark.parametrize("backward", [False, True])
def test_kl_workload_matches_the_reference(what, hidden, backward):
    """Logits, or both sides as hidden states with their own weights: the inputs, the weights passed
    as options, gradients of the student (and its weight) only, against float64."""
    s = st.Setting(op="kl_divergence", device="cpu", dtype="bfloat16", shape=(2, 5, 33), hidden_size=hidden,
                   sliced=True, backward=backward)
    tensors = {"student": [2, 4, 33], "teacher": [2, 4, 33]} if hidden is None else {
        "student": [2, 4, 8], "teacher": [2, 4, 8], "student_weight": [33, 8], "teacher_weight": [33, 8]}
    assert s.to_json()["inputs"] == tensors
    assert s.grad_inputs == (() if not backward else ("student",) if hidden is None else ("student", "student_weight"))
    for name, tol in (("naive", 1e-5), ("baseline", 1e-1)):
        w = Workload(s, name)
        assert set(w.inputs) == set(tensors)
        assert w.inputs["student_weight" if hidden else "student"].dtype == torch.bfloat16
        outs = w.run(w.prepare())
        assert outs[0].shape == (2, 4)
        diff, grad_diffs = max_differences(s, w.inputs, outs, w.grads())
        assert 0 <= diff < tol, (name, diff)
        assert set(grad_diffs) == set(s.grad_inputs)
        assert all(0 < d < 1e-1 for d in grad_diffs.values()), grad_diffs
        assert all(t.grad is None for n, t in w.base.items() if n.startswith("teacher"))  # a detached target
    # the textbook formula in bfloat16 is visibly worse than float32 accumulation
    assert max_differences(s, w.inputs, w.run(w.prepare()))[0] > 1e-3


def test_kl_settings_take_hidden_states_only_with_a_hidden_size():
    from logprob_registry.benchmark.session import settings

    made = settings(Options(ops=["kl_divergence,logprobs_from_hidden"], preset="verl"), "cpu")
    assert [(s.op, s.hidden_size) for s in made] == [("kl_divergence", None), ("logprobs_from_hidden", 4096)]
    assert made[0].tensors == ("student", "teacher") and not made[0].forms_logits
    (s,) = settings(Options(ops=["kl_divergence"], shape="1,4096,32768", hidden_size=1024, backward=True), "cpu")
    assert s.tensors == ("student", "teacher", "student_weight", "teacher_weight") and s.forms_logits
    assert s.input_shape("student") == (1, 4096, 1024) and s.input_shape("teacher_weight") == (32768, 1024)
    assert s.describe() == "kl_divergence on cpu float32 1x4096x32768 H=1024, forward+backward"
    parts = fit.estimate_bytes(s)
    n, v, h = 4096, 32768, 1024
    assert parts["student_weight"] == parts["teacher_weight"] == v * h * 4 and parts["student"] == n * h * 4
    assert parts["gradients"] == (n * h + v * h) * 4
    assert parts["baseline logits"] == 3 * n * v * 4  # both sides' logits and the student's gradient
    # logits: both read forward; backward reads the student again and writes its gradient
    logits = st.Setting(op="kl_divergence", device="cpu", dtype="float32", shape=(1, 4, 16), backward=True)
    assert logits.logits_traffic_bytes == 4 * 16 * 4 * 4 and s.logits_traffic_bytes is None
    assert st.Setting(**dict(logits.to_args(), backward=False)).logits_traffic_bytes == 2 * 4 * 16 * 4


def test_the_kl_table_from_python_and_its_backends():
    """``benchmark.bench`` on hidden states: the baseline forms both sides' logits, every backend
    declaring kl_hidden runs, the student's and its weight's gradients against float64."""
    doc = bench(ops=["kl_divergence"], device="cpu", shape=(2, 6, 96), hidden_size=16, backward=True, repeat=1,
                warmup=0)
    (run,) = doc["runs"]
    assert run["grad_inputs"] == ["student", "student_weight"]
    assert run["input_bytes"]["teacher_weight"] == 96 * 16 * 4
    assert run["baseline"] == "each side's hidden @ weight.T, then the textbook formula in the input dtype"
    from logprob_registry.call import key_for
    from logprob_registry.registry import get_registry

    report = get_registry().explain(key_for("kl_divergence", device="cpu", requires_grad=True, features={"kl_hidden"}))
    expected = [c.name for c in report.candidates if c.reason is None and c.broken is None]  # naive: skipped, run
    results = {r["name"]: r for r in run["results"]}
    assert set(results) == {"baseline", *expected} and "naive" in results
    for r in results.values():
        assert r["status"] == "ok", r
        assert r["max_abs_diff"] < 1e-5 and all(d < 1e-5 for d in r["max_abs_diff_grads"].values()), r
        assert r["bandwidth_bytes_per_s"] is None
    table = render(doc)
    assert "max |student grad diff|" in table and "max |student_weight grad diff|" in table
    assert "the logits this op reduces, 2x6x96 in float32" in table and "the weight gradient, 0.0 MiB" in table


def test_bench_of_kl_over_logits_prints_its_table():
    proc = subprocess.run(
        [sys.executable, "-m", "logprob_registry", "bench", "--op", "kl_divergence", "--device", "cpu",
         "--shape", "2,16,128", "--backward", "--repeat", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "kl_divergence on cpu float32 2x16x128, forward+backward"
    assert "against the baseline (the textbook formula in the input dtype)" in proc.stdout
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isalpha() and "  " in line}
    assert {"baseline", "naive"} <= set(rows) and "liger-kl" not in rows  # Liger: CUDA only
    assert "the logits this op reduces" not in proc.stdout


class _FakeLigerKLDIVLoss(torch.nn.KLDivLoss):
    """What liger_kernel.transformers.LigerKLDIVLoss computes (an nn.KLDivLoss), without Triton."""

    def __init__(self, eps: float = 1e-10, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_the_liger_row_appears_only_where_liger_imports_on_cuda(monkeypatch):
    from logprob_registry.benchmark import workload

    cuda = st.Setting(op="kl_divergence", device="cuda", dtype="float32", shape=(2, 3, 40))
    monkeypatch.setattr(workload, "liger_available", lambda: False)
    assert workload.external_methods(cuda) == []
    monkeypatch.setattr(workload, "liger_available", lambda: True)
    assert [n for n, _ in workload.external_methods(cuda)] == ["liger-kl"]
    assert workload.external_methods(st.Setting(**dict(cuda.to_args(), device="cpu"))) == []
    assert workload.external_methods(st.Setting(op="logprobs", device="cuda", dtype="float32", shape=(2, 3, 40))) == []
    # the call itself, with a stand-in for Liger's module: the KL per position, in both directions
    fake = type(sys)("liger_kernel.transformers")
    fake.LigerKLDIVLoss = _FakeLigerKLDIVLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", type(sys)("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    for direction in ("forward", "reverse"):
        s = st.Setting(op="kl_divergence", device="cpu", dtype="float32", shape=(2, 3, 40), backward=True)
        s_options = dict(direction=direction, temperature=2.0)
        ex = s.spec.example(s.shape, torch.float32, "cpu", requires_grad=True, seed=3)
        got = workload.liger_kl(ex.inputs, s_options)
        want = s.spec.ground_truth(*(x.detach().double() for x in ex.args), **s_options)[0]
        assert got.shape == (2, 3) and (got.double() - want).abs().max() < 1e-5
        assert (workload.textbook_kl(ex.inputs, s_options).double() - want).abs().max() < 1e-5


def test_percent_of_peak_bandwidth_on_an_accelerator(monkeypatch):
    """On a GPU the table gains '% of peak', the achieved GB/s against the memory bandwidth read from
    the device's name (or given with --peak-bandwidth); on the CPU, or for an unknown name, it is absent."""
    from logprob_registry.benchmark import Session
    from logprob_registry.benchmark import render as rd
    from logprob_registry.registry.explanation import Explanation

    assert rd.peak_bandwidth("NVIDIA H200") == 4.8e12 and rd.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert rd.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert rd.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12 and rd.peak_bandwidth("NVIDIA A100 80GB PCIe") == 1.935e12
    assert rd.peak_bandwidth("NVIDIA GH200 480GB") is None and rd.peak_bandwidth("Some GPU") is None
    with pytest.raises(BenchError, match="--peak-bandwidth must be a positive number of GB/s"):
        Options(peak_bandwidth=-1.0).check()

    def fake_run_setting(s, found, plugins, timeout, progress, rounds):
        return [dict(measure.EMPTY, name=n, kind="backend", status="ok", error=None, automatic_choice=False,
                     time_median_s=t, time_iqr_s=0.0, bandwidth_bytes_per_s=b, peak_bytes=1, max_abs_diff=0.0)
                for n, t, b in (("fast", 1e-3, 2.4e12), ("slow", 2e-3, 1.2e12))]

    monkeypatch.setattr(measure, "run_setting", fake_run_setting)
    explanation = Explanation(key=None, candidates=[], chosen="fast")
    tables = {}
    for device, name, given in (("cuda", "NVIDIA H200", None), ("cuda", "Some GPU", 2400.0), ("cuda", "Some GPU", None),
                                ("cpu", None, 2400.0)):
        session = Session(Options(device=device, peak_bandwidth=given))
        session.device_name = name
        session.plan = [(st.Setting(op="logprobs", device=device, dtype="float32", shape=(2, 3, 40)), [], explanation)]
        doc = session.run()
        tables[(name, given)] = (doc["runs"][0], rd.render(doc))
    run, table = tables[("NVIDIA H200", None)]
    assert [r["bandwidth_fraction"] for r in run["results"]] == [0.5, 0.25]
    assert "% of peak" in table and " 50% " in table and " 25% " in table
    assert "of the device's memory bandwidth, 4800 GB/s (the datasheet of NVIDIA H200)" in table
    run, table = tables[("Some GPU", 2400.0)]
    assert [r["bandwidth_fraction"] for r in run["results"]] == [1.0, 0.5] and "2400 GB/s (--peak-bandwidth)" in table
    for key in (("Some GPU", None), (None, 2400.0)):
        run, table = tables[key]
        assert "% of peak" not in table and "bandwidth_fraction" not in run["results"][0]


def test_backend_names_filter_the_external_methods_too(monkeypatch):
    """``--backend NAME`` measures the baseline and what it names: an external method (Liger's KL)
    only when named, and naming one is accepted."""
    from logprob_registry.benchmark import session, workload

    s = st.Setting(op="kl_divergence", device="cpu", dtype="float32", shape=(2, 3, 40))
    monkeypatch.setitem(workload.EXTERNAL, "test-external", ("a stand-in", lambda s: True, None))
    every = [m["name"] for m in session.methods(s, ())[0]]
    assert "test-external" in every and "naive" in every
    assert [m["name"] for m in session.methods(s, ("naive",))[0]] == ["baseline", "naive"]
    assert [m["name"] for m in session.methods(s, ("test-external",))[0]] == ["baseline", "test-external"]
