"""Prebuilt kernels of the ``compiled`` backend (``logprob-registry warmup``) and the first-call notice.

One build per module: the float32 logprobs kernels (forward, backward out of place and in place)
for vocabularies over 4096, at V=5000; building them costs about a minute on 2 cores. The rest of
the suite loads no package (tests/conftest.py turns LOGPROB_REGISTRY_KERNEL_CACHE off), so that its
compile counts and compile failures stay about torch.compile.
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import logprob_registry as lr
from logprob_registry.cli import main
from logprob_registry.environment import get_environment
from logprob_registry.kernels import compiled
from logprob_registry.kernels.compiled import _aot, _kernels
from logprob_registry.warmup import plan, warmup

V = 5000
NO_COMPILER = compiled.available(get_environment(), "cpu")
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=f"needs a C++ compiler: {NO_COMPILER}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIABLE = _aot.KERNEL_CACHE.name
pytestmark = needs_compiler


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The folder of the module's packages, and what warmup reported building them."""
    folder = str(tmp_path_factory.mktemp("kernels"))
    done = warmup(["logprobs"], ["float32"], backward=True, inplace=True, vocab=[V], folder=folder)
    yield folder, done
    _aot.forget()


@pytest.fixture
def use(built, monkeypatch):
    """Packages from the module's folder, none loaded yet in this process."""
    monkeypatch.setenv(VARIABLE, built[0])
    _aot.forget()
    yield built[0]
    _aot.forget()


@pytest.fixture
def spy(monkeypatch):
    """The kernels that take the torch.compile path, by name; run eagerly here (no compile)."""
    names = []

    def kernel(name):
        names.append(name)
        return _kernels.KERNELS[name]

    monkeypatch.setattr(_kernels, "_kernel", kernel)
    monkeypatch.setattr(_kernels, "_noticed", set())
    return names


def case(rows=3, steps=4, vocab=V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, steps + 1, vocab, generator=g) * 3).to(dtype)
    logits[:, :, 7] = float("-inf")
    labels = torch.randint(0, vocab, (rows, steps + 1), generator=g)
    labels[0, 1] = -100
    return logits, labels


def fwd_bwd(logits, labels, sliced=False, view=None, weighted=True, **kw):
    """Log-probabilities and the gradient of a weighted sum, or of the sum (``sliced``: of
    ``logits[:, :-1]``; ``view``: of that view of the logits)."""
    leaf = logits.detach().clone().requires_grad_(True)
    x, y = (leaf[:, :-1], labels[:, 1:]) if sliced else (leaf, labels)
    x = x if view is None else view(x)
    if kw.get("inplace_backward"):
        x = x * 1.0
    out = lr.logprobs_from_logits(x, y, backend="compiled", ignore_index=-100, **kw)
    weights = torch.linspace(0.5, 1.5, out.numel()).view(out.shape) if weighted else 1.0
    (out * weights).sum().backward()
    return out.detach(), leaf.grad


def expected(logits, labels, temperature=1.0):
    lp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return lp.masked_fill(labels == -100, 0.0)


def test_warmup_builds_each_package_once(built, use):
    folder, done = built
    assert [(b.detail.kernel, b.status) for b in done] == [("fwd_logprobs", "built"), ("bwd", "built"),
                                                            ("bwd_inplace", "built")]
    assert {b.backend for b in done} == {"compiled"} and done[0].what == "fwd_logprobs float32 V>4096"
    for b in done:
        assert os.path.dirname(b.path) == folder and os.path.getsize(b.path) > 0 and b.seconds > 0
        with open(b.path[:-len(".pt2")] + ".json") as f:
            meta = json.load(f)
        assert meta["torch"] == torch.__version__ and meta["isa"] == torch.backends.cpu.get_cpu_capability()
        assert meta["kernel"] == b.detail.kernel and meta["dtype"] == "float32" and meta["large"] is True
    start = time.perf_counter()
    again = warmup(["logprobs"], ["float32"], backward=True, inplace=True, vocab=[V])  # from the variable
    assert [b.status for b in again] == ["present"] * 3 and [b.path for b in again] == [b.path for b in done]
    assert time.perf_counter() - start < 5
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp.pt2")]


def test_cli_warmup_says_what_is_there(use, capsys):
    assert main(["warmup", "--vocab", str(V), "--inplace"]) == 0
    out = capsys.readouterr().out
    assert f"compiled into {use}" in out and out.count("present ") == 3 and "0 built, 3 already there" in out
    assert main(["warmup", "--vocab", str(V), "--backend", "compiled"]) == 0
    assert "0 built, 2 already there" in capsys.readouterr().out
    assert main(["warmup", "--op", "softmax"]) == 2
    assert main(["warmup", "--device", "cuda"]) == 2
    assert "for the CPU only" in capsys.readouterr().err
    assert main(["warmup", "--backend", "naive"]) == 2
    assert "'naive' builds nothing ahead (it declares no prepare); the backends that do: compiled" in \
        capsys.readouterr().err
    assert main(["warmup", "--backend", "nope"]) == 2
    assert "no backend named 'nope'" in capsys.readouterr().err


def test_cli_warmup_with_the_kernel_cache_off(monkeypatch, capsys):
    monkeypatch.setenv(VARIABLE, "off")
    assert main(["warmup"]) == 2
    assert "LOGPROB_REGISTRY_KERNEL_CACHE is off" in capsys.readouterr().err


def test_warmup_goes_through_the_registry_to_every_backend_that_prepares(tmp_path, make_registry):
    """A plugin's ``prepare`` is called like compiled's, with the request; the registry names the
    backend on each record and turns its failure into a PrepareError."""
    from logprob_registry.backend import Preparation, PrepareError

    asked = []

    def prepare(request):
        asked.append(request)
        if request.force:
            raise OSError("disk full")
        request.say("building it ...")
        status = "planned" if request.dry_run else "built"
        return [request.record(f"{op} {d}", str(tmp_path / op), status, 0.5) for op in request.ops
                for d in request.dtypes]

    reg = make_registry(lr.Backend(name="ahead", ops={"logprobs": lambda *a, **k: None}, prepare=prepare),
                        lr.Backend(name="lazy", ops={"logprobs": lambda *a, **k: None}))
    assert [b.name for b in reg.preparers()] == ["ahead"]
    lines = []
    done = warmup(["logprobs", "entropy"], ["bf16"], vocab=[100], registry=reg, progress=lines.append)
    assert [(d.backend, d.what, d.status) for d in done] == [("ahead", "logprobs torch.bfloat16", "built"),
                                                             ("ahead", "entropy torch.bfloat16", "built")]
    assert lines == ["building it ..."] and asked[0].vocab == (100,) and asked[0].dtypes == (torch.bfloat16,)
    assert isinstance(asked[0], Preparation) and not asked[0].dry_run
    assert [p.status for p in plan(registry=reg)] == ["planned"]
    with pytest.raises(PrepareError, match="ahead: disk full"):
        warmup(force=True, registry=reg)
    with pytest.raises(ValueError, match="'lazy' builds nothing ahead"):
        warmup(backend="lazy", registry=reg)


def test_plan_names_each_package_once(tmp_path):
    planned = plan(["logprobs_and_entropy", "entropy"], ["bf16", "float32"], backward=True, inplace=True,
                   vocab=[100, 32768, 50000], folder=str(tmp_path), backend="compiled")
    assert {p.status for p in planned} == {"planned"} and not os.listdir(tmp_path)
    specs = [p.detail for p in planned]
    assert len(specs) == len(set(specs)) == 2 * 2 * 4  # fwd_entropy, bwd x2, bwd_inplace; 2 dtypes, 2 classes
    assert not [s for s in specs if s.kernel == "bwd_inplace" and s.want == (False, True)]  # entropy has none
    with pytest.raises(ValueError, match="vocabulary sizes"):
        plan(vocab=[0])
    with pytest.raises(ValueError, match="unknown dtype"):
        plan(dtypes=["int32"])


def test_fresh_process_loads_the_packages_without_dynamo(use, tmp_path, monkeypatch):
    """The whole first call, forward and backward, in a process that never imports dynamo or
    inductor; its bits equal this process's torch.compile path; its loaders clean up after it."""
    script = (
        "import json, logging, sys, torch, logprob_registry as lr\n"
        "from logprob_registry.kernels.compiled import _aot\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "x, y = torch.load(sys.argv[1])\n"
        "leaf = x.clone().requires_grad_(True)\n"
        "out = lr.logprobs_from_logits(leaf, y, backend='compiled', ignore_index=-100)\n"
        "(out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()\n"
        "torch.save((out.detach(), leaf.grad), sys.argv[2])\n"
        "print(json.dumps(dict(loaded=_aot.loaded, modules=sorted(m for m in sys.modules\n"
        "    if m.startswith(('torch._dynamo', 'torch._inductor'))))))\n"
    )
    logits, labels = case()
    torch.save((logits, labels), tmp_path / "in.pt")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TMPDIR=str(scratch))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [os.path.basename(p).split("-")[0] for p in report["loaded"]] == ["fwd_logprobs", "bwd"]
    assert all(os.path.dirname(p) == use for p in report["loaded"])
    assert report["modules"] == []
    assert "compiling" not in done.stderr  # no first-call notice: nothing compiled
    assert os.listdir(scratch) == []  # the loaders' extraction folders went with the process
    out, grad = torch.load(tmp_path / "out.pt")
    monkeypatch.setenv(VARIABLE, "off")
    ref_out, ref_grad = fwd_bwd(logits, labels)  # the torch.compile path, in this process
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)


@pytest.mark.parametrize("kind", ["contiguous", "sliced", "single-row", "temperature", "int32-labels", "inplace"])
def test_packages_give_the_torch_compile_bits(use, monkeypatch, kind):
    logits, labels = case(seed=1)
    kw = dict(sliced=kind == "sliced", temperature=0.7 if kind == "temperature" else 1.0,
              inplace_backward=kind == "inplace")
    if kind == "single-row":
        logits, labels = logits[:1, :2], labels[:1, :2]
    if kind == "int32-labels":
        labels = labels.int()  # made int64 before any kernel: the packages never see int32
    got = fwd_bwd(logits, labels, **kw)
    assert len(_aot.loaded) >= 2 and all(os.path.dirname(p) == use for p in _aot.loaded)
    monkeypatch.setenv(VARIABLE, "off")
    want = fwd_bwd(logits, labels, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    y = labels[:, 1:] if kw["sliced"] else labels
    x = logits[:, :-1] if kw["sliced"] else logits
    torch.testing.assert_close(got[0].double(), expected(x, y.long(), kw["temperature"]), rtol=1e-5, atol=1e-5)


def test_packages_are_batch_invariant(use, monkeypatch):
    """A row alone gives the bits it gets in a batch: both through the package (contiguous rows), or
    the batch through torch.compile (row-strided: no package fits) and the row through the package
    (a single row fits whatever the row stride): the two paths give the same bits."""
    compiled_names = []
    real = _kernels._kernel
    monkeypatch.setattr(_kernels, "_kernel", lambda name: compiled_names.append(name) or real(name))
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(64, V, generator=g) * 3, torch.randint(0, V, (64,), generator=g)
    wide = torch.cat([logits, logits], -1)
    for kind, x, view in (("contiguous", logits, None), ("row-strided", wide, lambda t: t[..., :V])):
        batch = fwd_bwd(x, labels, view=view, weighted=False)
        for row in (0, 5, 63):
            alone = fwd_bwd(x[row:row + 1], labels[row:row + 1], view=view, weighted=False)
            assert torch.equal(batch[0][row:row + 1], alone[0]) and torch.equal(batch[1][row:row + 1], alone[1]), kind
        assert compiled_names == ([] if kind == "contiguous" else ["fwd_logprobs", "bwd", "bwd"]), kind


@pytest.mark.parametrize("kind", ["strided-vocabulary", "strided-rows", "float64", "small-vocabulary"])
def test_calls_that_do_not_fit_take_torch_compile(use, spy, kind):
    logits, labels = case(seed=3)
    view = None
    if kind == "strided-vocabulary":
        logits = logits.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif kind == "strided-rows":  # rows V + 10 apart
        logits, view = torch.cat([logits, logits[..., :10]], -1), (lambda t: t[..., :V])
    elif kind == "float64":
        logits = logits.double()
    else:
        logits, labels = logits[..., :4000].contiguous(), labels.clamp(max=3999)
    out, grad = fwd_bwd(logits, labels, view=view)
    # an ignored label: contiguous rows take the row kernels, strided ones the kernels over every row
    rows = kind in ("float64", "small-vocabulary")
    assert spy[0] == ("fwd_logprobs_rows" if rows else "fwd_logprobs") and spy[-1] == ("bwd_rows" if rows else "bwd")
    x = logits if view is None else view(logits)
    torch.testing.assert_close(out.double(), expected(x, labels), rtol=1e-5, atol=1e-5)
    assert grad.shape == logits.shape


def test_the_packages_check_what_they_run():
    """Calls the packages would get wrong (or die of) never reach them: int32 indices, strides,
    another dtype, a size the arguments disagree on."""
    x = torch.randn(4, V)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    k = _kernels.LOG2E
    assert _aot._forward(None, x, idx.int(), k) is _aot.MISSING
    assert _aot._forward(None, x[:, ::2], idx, k) is _aot.MISSING
    assert _aot._forward(None, x, idx[:3], k) is _aot.MISSING
    assert _aot._forward(None, x, torch.zeros(4, 2, dtype=torch.int64)[:, :1], k) is _aot.MISSING
    pair = torch.randn(V, 2)[:, :1].t().expand(2, V)  # a single row of a vocabulary-strided batch
    assert _aot._forward(None, pair, idx[:2], k) is _aot.MISSING
    m = torch.zeros(4, 1)
    args = (idx, m, m, None, m, None, k, 1.0)
    assert _aot._backward(None, False, x, idx.int(), *args[1:]) is _aot.MISSING
    assert _aot._backward(None, False, x, idx, m.double(), *args[2:]) is _aot.MISSING
    m3 = m.view(2, 2, 1)
    assert _aot._backward(None, True, x.view(2, 2, V), idx.view(2, 2, 1), m3, m3, None, m3, None, k, 1.0) \
        is _aot.MISSING  # in place: 2-D planes only


def test_a_stale_package_is_not_used(use, spy, monkeypatch):
    """A package keyed on another torch or another CPU is never looked at: the call compiles."""
    logits, labels = case(seed=4)
    fwd_bwd(logits, labels)
    assert spy == [] and len(_aot.loaded) == 2
    real = _aot.identity()
    for field, value in (("torch", "2.99.0"), ("isa", "AVX2"), ("cpu_flags", "0" * 16)):
        monkeypatch.setattr(_aot, "identity", lambda changed={field: value}: dict(real, **changed))
        _aot.forget()
        del _aot.loaded[:]
        fwd_bwd(logits, labels)
        assert _aot.loaded == [] and spy[-2:] == ["fwd_logprobs_rows", "bwd_rows"], field


def test_a_damaged_package_is_reported_and_skipped(use, spy, tmp_path, monkeypatch, caplog):
    spec = _aot.Spec("fwd_logprobs", torch.float32, True)
    (tmp_path / os.path.basename(_aot.path(spec, str(tmp_path)))).write_bytes(b"not a zip")
    monkeypatch.setenv(VARIABLE, str(tmp_path))
    logits, labels = case(seed=5)
    with caplog.at_level(logging.WARNING, logger="logprob_registry"):
        out = lr.logprobs_from_logits(logits, labels, backend="compiled", ignore_index=-100)
    assert spy == ["fwd_logprobs_rows"]  # the row kernel, without a package to gather the rows for
    assert any("could not be loaded" in r.getMessage() and "warmup --force" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out.double(), expected(logits, labels), rtol=1e-5, atol=1e-5)


def test_first_compile_says_so_once_per_kind(spy, monkeypatch, caplog):
    monkeypatch.setenv(VARIABLE, "off")
    logits, labels = case(seed=6)
    with caplog.at_level(logging.WARNING, logger="logprob_registry"):
        for _ in range(2):
            fwd_bwd(logits, labels)
        lr.logprobs_from_logits(logits.double(), labels, backend="compiled", ignore_index=-100)
    notes = [r.getMessage() for r in caplog.records if "is compiling" in r.getMessage()]
    # for float32 once each: the forward's row kernel, the backward's (and its warm-up's kernel over
    # every row, unless an earlier test warmed it); the forward for float64
    names = [n.split(" kernel for ")[0].split("its ")[-1] for n in notes]
    assert names[0] == "fwd_logprobs_rows" and names[1:-1] in (["bwd", "bwd_rows"], ["bwd_rows"]), notes
    assert "cpu float32 logits" in notes[0] and "float64" in notes[-1] and names[-1] == "fwd_logprobs_rows"
    assert "backend 'compiled'" in notes[0]
    assert "15-25 s" in notes[0] and "logprob-registry warmup --dtype float32" in notes[0]
    assert all(r.levelno == logging.WARNING and r.name == "logprob_registry" for r in caplog.records)


def test_no_notice_when_a_package_runs(use, spy, caplog):
    logits, labels = case(seed=7)
    with caplog.at_level(logging.INFO, logger="logprob_registry"):
        fwd_bwd(logits, labels)
    assert spy == [] and caplog.records == []


def test_threads_share_a_package(use):
    """Two threads in one loader deadlock without the loader's lock."""
    logits, labels = case(rows=16, steps=7, seed=8)
    want = lr.logprobs_from_logits(logits, labels, backend="compiled", ignore_index=-100)
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(lr.logprobs_from_logits(logits, labels, backend="compiled", ignore_index=-100))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert len(results) == 15 and all(torch.equal(r, want) for r in results)


FAKE_BUILD = r"""
import sys, time
from logprob_registry.kernels.compiled import _aot
import torch
def slow(spec, file):  # stands for export + AOTInductor: writes the file in pieces
    with open(file, "wb") as f:
        for _ in range(20):
            f.write(b"x" * 1000); f.flush(); time.sleep(0.05)
_aot._compile = slow
_aot._check = lambda spec, file: None
print(_aot.build(_aot.Spec("fwd_logprobs", torch.float16, True), sys.argv[1]).status)
"""


def test_two_processes_building_at_once_leave_one_whole_package(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", FAKE_BUILD, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    assert sorted(o[0].strip() for o in outs) == ["built", "present"]
    packages = [n for n in os.listdir(tmp_path) if n.endswith(".pt2")]
    assert len(packages) == 1 and os.path.getsize(tmp_path / packages[0]) == 20000


def test_two_rows_of_one_storage_keep_their_labels(use, spy):
    """A user's ``row.expand(2, V)`` looks like the single-row pair the forward makes: both labels count."""
    row = torch.randn(1, V)
    labels = torch.tensor([3, 4000])
    out = lr.logprobs_from_logits(row.expand(2, V), labels, backend="compiled")
    assert spy == []
    torch.testing.assert_close(out.double(), expected(row.expand(2, V), labels), rtol=1e-5, atol=1e-5)
