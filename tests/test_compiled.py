"""The ``compiled`` backend: what is specific to it. Its contract (values, dtypes, strides, gradients,
-inf, NaN, in-place backward, determinism, batch invariance) is checked by the shipped suite, which
``tests/test_conformance.py`` runs against ``compiled``; here are its eligibility (a C++ compiler,
triton and compute capability, torch.compile disabled), its in-place backward reusing the logits'
storage, compile counts under changing shapes, and compile failures turning into the registry's
fallback.

Compiling costs seconds, so the tests share a few kinds of call (float32, V=37, contiguous or
sliced) and the ones that start the compiler afresh come last.
"""

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.environment import Environment, get_environment
from logprob_registry.kernels import compiled
from logprob_registry.kernels.compiled import _kernels, _ops
from logprob_registry.registry import Key

V = 300  # in the vocabulary buckets where compiled is the automatic choice (min_vocab=257)
NO_COMPILER = compiled.available(get_environment(), "cpu")
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=f"needs a C++ compiler: {NO_COMPILER}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def case(sliced=False, dtype=torch.float32, batch=3, steps=6, seed=0):
    """Logits with masked (-inf) entries, a label on one of them, and ignored positions; sliced:
    the ``logits[:, :-1]`` / ``labels[:, 1:]`` layout, without a copy."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(batch, steps + 1, V, generator=g, dtype=torch.float64) * 4
    full[:, :, 5] = float("-inf")
    labels = torch.randint(0, V, (batch, steps + 1), generator=g)
    labels[0, 1:3] = 5  # position (0, 1) in both layouts
    labels[1, 2] = -100
    labels[2, 3] = -100
    full = full.to(dtype)
    if sliced:
        return full[:, :-1], labels[:, 1:]
    return full[:, :-1].contiguous(), labels[:, :-1].contiguous()


def run(op, logits, labels, backend="compiled", **kw):
    if op == "logprobs":
        return (lr.logprobs_from_logits(logits, labels, backend=backend, **kw),)
    if op == "entropy":
        kw.pop("ignore_index", None)
        kw.pop("inplace_backward", None)
        return (lr.entropy_from_logits(logits, backend=backend, **kw),)
    return lr.logprobs_and_entropy(logits, labels, backend=backend, **kw)


def loss(outputs, seed=1):
    """A weighted sum of the outputs (log-probabilities on -inf logits left out)."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    for out in outputs:
        weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        total = total + (weight * out.masked_fill(torch.isinf(out), 0)).sum()
    return total


def reference_grad(op, logits, labels, **kw):
    x = logits.detach().double().requires_grad_(True)
    kw.pop("inplace_backward", None)
    if op == "logprobs":
        outs = (ref.logprobs(x, labels, **kw),)
    elif op == "entropy":
        kw.pop("ignore_index", None)
        outs = (ref.entropy(x, **kw),)
    else:
        outs = ref.logprobs_and_entropy(x, labels, **kw)
    loss(outs).backward()
    return [o.detach() for o in outs], x.grad


def test_registered_with_priority_20_and_in_place_backward():
    backend = lr.get_registry().get("compiled")
    assert backend.priority == 20
    # promised, so the conformance suite checks each (batch invariance, no copy of the logits)
    assert backend.inplace_backward and backend.deterministic and backend.batch_invariant
    assert not backend.copies_logits
    assert set(backend.ops) == {"logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden", "token_stats",
                                "shard_stats", "shard_grad", "hidden_shard_stats", "hidden_shard_grad"}


def test_chosen_automatically_on_cpu_where_a_compiler_is_found():
    explanation = lr.explain("logprobs", device="cpu", requires_grad=True)
    verdict = next(c for c in explanation.candidates if c.name == "compiled")
    if NO_COMPILER is None:
        assert explanation.chosen == "compiled"
    else:
        assert verdict.reason == NO_COMPILER and "C++ compiler" in verdict.reason


def _verdict(registry, device="cpu", dtype=torch.float32):
    key = Key("logprobs", device, dtype, True)
    return next(v for v in registry.verdicts(key) if v.name == "compiled")


def test_cpu_needs_a_cxx_compiler(make_registry):
    """Configured the way torch supports (``config.patch``, undone on exit; pytest 9.2's
    monkeypatch.setattr would delete the option on undo), with the compiler lookup's cache cleared
    and a fresh registry, so that nothing outlives the test."""
    import torch._inductor.config as config

    before = config.cpp.cxx
    try:
        with config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
            compiled._found.cache_clear()
            reason = compiled.available(get_environment(), "cpu")
            verdict = _verdict(make_registry(builtins="all", environment=get_environment()))
    finally:
        compiled._found.cache_clear()
    assert reason == (
        "torch.compile on CPU needs a C++ compiler and none was found ('/nonexistent/c++'); "
        "install g++ or set CXX to a compiler"
    )
    assert verdict.reason == reason
    assert config.cpp.cxx == before  # restored: compiled stays eligible for the rest of the run
    assert compiled.available(get_environment(), "cpu") == NO_COMPILER


def test_cuda_needs_triton_and_capability_7(make_registry):
    env = Environment.fake(torch="2.13.0", devices={"cuda": 1})
    assert compiled.available(env, "cuda") == "torch.compile on CUDA needs triton, and triton is not installed"
    env = Environment.fake(torch="2.13.0", devices={"cuda": 1}, triton="3.9.0", capability=(6, 1))
    assert "compute capability 7.0 or newer" in compiled.available(env, "cuda")
    assert "found 6.1" in compiled.available(env, "cuda")
    env = Environment.fake(torch="2.13.0", devices={"cuda": 1}, triton="3.9.0")
    assert compiled.available(env, "cuda") is None
    assert _verdict(make_registry(builtins="all", environment=env), "cuda", torch.bfloat16).reason is None
    env = Environment.fake(torch="2.5.1", devices={"cuda": 1}, triton="3.9.0")
    assert _verdict(make_registry(builtins="all", environment=env), "cuda").reason == \
        "needs torch>=2.6, found 2.5.1"


def test_disabled_torch_compile_makes_it_ineligible():
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(disable=True):
        assert "torch.compile is disabled" in compiled.available(get_environment(), "cpu")
    assert not dynamo_config.disable


@needs_compiler
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_inplace_backward_writes_the_gradient_into_the_logits(sliced):
    logits, labels = case(sliced)
    kw = dict(temperature=0.7, ignore_index=-100)
    x = logits.detach().requires_grad_(True)
    loss(run("logprobs_and_entropy", x, labels, **kw)).backward()

    # the same logits inside a whole (B, T+1, V) tensor, sliced the same way, as a non-leaf whose
    # storage backward may overwrite
    leaf = torch.cat([logits, torch.randn(3, 1, V)], dim=1).requires_grad_(True)
    inner = leaf * 1.0
    y = inner[:, :-1] if sliced else inner[:, :-1].contiguous()
    untouched = inner.detach()[:, -1].clone()
    loss(run("logprobs_and_entropy", y, labels, inplace_backward=True, **kw)).backward()
    assert torch.equal(leaf.grad[:, :-1], x.grad)  # the same math as out of place, bit for bit
    assert torch.equal(y.detach(), x.grad)  # ... written into the logits' own storage
    assert torch.equal(inner.detach()[:, -1], untouched)  # rows outside the slice left alone


@needs_compiler
def test_inplace_gradient_of_a_leaf_is_kept_without_a_copy():
    logits, labels = case()
    x = logits.clone().requires_grad_(True)
    lr.logprobs_from_logits(x, labels, ignore_index=-100, inplace_backward=True, backend="compiled").sum().backward()
    assert x.grad.data_ptr() == x.data_ptr()


@needs_compiler
def test_inplace_backward_of_expanded_logits_is_done_out_of_place():
    logits, labels = case()
    row = logits[:1].detach().requires_grad_(True)
    wide = row.expand(3, -1, -1)  # three views of the same memory: not writable in place
    lr.logprobs_from_logits(wide, labels, ignore_index=-100, inplace_backward=True, backend="compiled").sum().backward()
    expected = logits[:1].detach().double().requires_grad_(True)
    ref.logprobs(expected.expand(3, -1, -1), labels, ignore_index=-100).sum().backward()
    torch.testing.assert_close(row.grad.double(), expected.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(row.detach(), logits[:1])


# ----------------------------------------------------------------- these start the compiler afresh
@pytest.fixture
def fresh():
    """Compiled kernels forgotten before and after; selections and broken marks too."""
    compiled.reset()
    lr.get_registry().reset()
    yield
    compiled.reset()
    lr.get_registry().reset()


def fallback_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, lr.BackendFallbackWarning)]


@needs_compiler
def test_one_compile_covers_five_batch_and_sequence_lengths_and_temperatures(fresh):
    shapes = [(2, 5), (3, 17), (1, 40), (6, 9), (4, 64)]
    for i, (batch, steps) in enumerate(shapes):
        x = torch.randn(batch, steps, V, requires_grad=True)
        labels = torch.randint(0, V, (batch, steps))
        out = lr.logprobs_from_logits(x, labels, temperature=(0.5, 1.0, 1.3, 2.0, 0.9)[i], backend="compiled")
        out.sum().backward()
    counts = compiled.compile_counts()
    assert counts["fwd_logprobs"] == 1 and counts["bwd"] == 1, counts
    # logits[:, :-1]: the forward reads it plane by plane with the same kernel; the backward kernel
    # for that layout compiles once, not once per shape
    for batch, steps in shapes[:3]:
        full = torch.randn(batch + 1, steps + 1, V, requires_grad=True)
        labels = torch.randint(0, V, (batch + 1, steps))
        lr.logprobs_from_logits(full[:, :-1], labels, backend="compiled").sum().backward()
    counts = compiled.compile_counts()
    assert counts["fwd_logprobs"] == 1 and counts["bwd"] == 2, counts


@needs_compiler
def test_compile_failure_falls_back_with_one_warning_and_raises_when_chosen(fresh, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected inductor failure")

    import torch._inductor.compile_fx  # not imported yet when this test runs first

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken)
    logits, labels = case()
    assert lr.select("logprobs", device="cpu").name == "compiled"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = lr.logprobs_from_logits(logits, labels, ignore_index=-100)
        again = lr.logprobs_from_logits(logits, labels, ignore_index=-100)
    messages = fallback_warnings(record)
    assert len(messages) == 1
    assert "backend 'compiled' failed" in messages[0] and "injected inductor failure" in messages[0]
    assert "using 'chunked' instead" in messages[0]
    expected = lr.logprobs_from_logits(logits, labels, ignore_index=-100, backend="chunked")
    assert torch.equal(out, expected) and torch.equal(again, expected)
    with pytest.raises(compiled.CompileError, match="fwd_logprobs(_rows)? kernel failed .* injected inductor failure"):
        lr.logprobs_from_logits(logits, labels, ignore_index=-100, backend="compiled")


@needs_compiler
def test_backward_compile_failure_surfaces_in_the_forward(fresh, monkeypatch):
    logits, labels = case()
    lr.logprobs_from_logits(logits, labels, ignore_index=-100, backend="compiled")  # the forward kernel compiles
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda *a, **k: 1 / 0)
    x = logits.detach().requires_grad_(True)
    with pytest.raises(compiled.CompileError, match="its bwd kernel failed .*ZeroDivisionError"):
        lr.logprobs_from_logits(x, labels, ignore_index=-100, backend="compiled")
    with pytest.warns(lr.BackendFallbackWarning, match="bwd kernel failed"):
        out = lr.logprobs_from_logits(x, labels, ignore_index=-100)
    out.sum().backward()  # through the fallback backend
    assert x.grad is not None


@needs_compiler
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
def test_backward_kernel_failing_late_runs_the_same_math_eagerly(fresh, monkeypatch, inplace):
    logits, labels = case(sliced=True)
    full = torch.cat([logits, torch.randn(3, 1, V)], dim=1)  # logits is full[:, :-1]
    lr.logprobs_and_entropy(full[:, :-1], labels, ignore_index=-100, backend="compiled")  # forward compiles
    monkeypatch.setattr(_ops, "_warm_backward", lambda *a: None)  # as for a layout first met in backward
    monkeypatch.setattr(_ops, "EAGER_BLOCK_BYTES", 8 * V * 2)  # blocks of two rows
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda *a, **k: 1 / 0)
    kw = dict(temperature=0.7, ignore_index=-100, inplace_backward=inplace)
    _, grad = reference_grad("logprobs_and_entropy", logits, labels, **kw)
    messages = []
    for _ in range(2):
        leaf = full.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loss(lr.logprobs_and_entropy((leaf * 1.0)[:, :-1], labels, backend="compiled", **kw)).backward()
        messages.append(fallback_warnings(record))
        torch.testing.assert_close(leaf.grad[:, :-1].double(), grad, rtol=1e-5, atol=1e-6)
        assert leaf.grad[:, -1].eq(0).all()
    assert len(messages[0]) == 1 and messages[1] == []
    assert "bwd" in messages[0][0] and "run the same math eagerly" in messages[0][0]


@needs_compiler
@pytest.mark.parametrize("name", ["fwd_logprobs", "fwd_logprobs_rows"])
def test_graph_break_raises_from_the_forward(fresh, monkeypatch, name):
    kernel = _kernels.KERNELS[name]

    def breaks(*args):
        torch._dynamo.graph_break()
        return kernel(*args)

    monkeypatch.setitem(_kernels.KERNELS, name, breaks)
    logits, labels = case()  # with ignored labels: the row kernel; without, the kernel over every row
    labels = labels if name.endswith("_rows") else labels.clamp(min=0)
    with pytest.raises(compiled.CompileError, match=f"{name} kernel failed"):
        lr.logprobs_from_logits(logits, labels, ignore_index=-100, backend="compiled")


@needs_compiler
def test_recompile_storm_falls_back(fresh, monkeypatch):
    monkeypatch.setattr(_kernels, "RECOMPILE_LIMIT", 1)
    logits, labels = case()
    lr.logprobs_from_logits(logits, labels, ignore_index=-100)
    with pytest.warns(lr.BackendFallbackWarning, match="backend 'compiled' failed .*recompile|Recompile"):
        lr.logprobs_from_logits(logits.double(), labels, ignore_index=-100)


@needs_compiler
def test_broken_compiler_at_run_time_falls_back_with_one_warning(tmp_path):
    # A fresh process and inductor cache, so that nothing already compiled is reused; /bin/false
    # exists, so the backend stays eligible, but compiles nothing.
    script = (
        "import warnings, torch, logprob_registry as lr\n"
        "import torch._inductor.config as config\n"
        "config.cpp.cxx = ('/bin/false',)\n"
        "x = torch.randn(4, 300); y = torch.randint(0, 300, (4,))\n"
        "with warnings.catch_warnings(record=True) as record:\n"
        "    warnings.simplefilter('always')\n"
        "    out = lr.logprobs_from_logits(x, y)\n"
        "    lr.logprobs_from_logits(x, y)\n"
        "messages = [str(w.message) for w in record if issubclass(w.category, lr.BackendFallbackWarning)]\n"
        "assert torch.equal(out, lr.logprobs_from_logits(x, y, backend='chunked'))\n"
        "print(len(messages)); print(messages[0])\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    count, message = done.stdout.strip().splitlines()[-2:]
    assert count == "1"
    assert "backend 'compiled' failed" in message and "using 'chunked' instead" in message


def spy_rows(monkeypatch) -> list:
    """(kernel, rows it computes) for each kernel _ops runs but the backward's warm-up: the length of
    the index a row kernel gets, the rows another gets."""
    seen = []
    run = _ops._run

    def spied(name, *args):
        if name == "bwd_rows":
            seen.append((name, args[2].numel()))
        elif name.endswith("_rows"):
            seen.append((name, args[1].numel()))
        elif not (name.startswith("bwd") and args[0].shape[0] <= 2):  # not a warm-up
            seen.append((name, args[0].shape[0]))
        return run(name, *args)

    monkeypatch.setattr(_ops, "_run", spied)
    return seen


@pytest.mark.parametrize("inplace", [False, True])
def test_backward_skips_rows_with_a_zero_upstream_gradient(inplace, monkeypatch):
    """Ignored labels and zero upstream gradients (GRPO's prompt rows): exact zeros there, every
    other row's gradient bitwise that of a call on those rows alone (the kernel is per row), and the
    gradient kernel sees the active rows only: the row kernel gets their index, no copy of them."""
    seen = spy_rows(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 700, generator=g) * 3
    y = torch.randint(0, 700, (48,), generator=g)
    y[::3] = -100
    up = torch.randn(48, generator=g)
    up[1::4] = 0
    leaf = x.clone().requires_grad_(True)
    lp, ent = lr.logprobs_and_entropy(leaf * 1, y, ignore_index=-100, inplace_backward=inplace, backend="compiled")
    (lp.sum() + (ent * up).sum()).backward()
    active = (y != -100) | (up != 0)
    assert bool((leaf.grad[~active] == 0).all()) and int((~active).sum()) > 0
    assert seen == [("fwd_entropy", 48), ("bwd_rows", int(active.sum()))]
    sub = x[active].clone().requires_grad_(True)
    lp, ent = lr.logprobs_and_entropy(sub, y[active], ignore_index=-100, backend="compiled")
    (lp.sum() + (ent * up[active]).sum()).backward()
    assert torch.equal(leaf.grad[active], sub.grad)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_logprobs_forward_runs_on_the_rows_whose_label_is_not_ignored(inplace, softcap, monkeypatch):
    """logprobs_from_logits (no entropy asked) runs its kernel on the active rows only: their results
    and gradients bitwise a call over them alone, the ignored rows 0 with a zero gradient, also when
    every row is ignored. The row kernels read them where they lie (the softcap's forward: on their
    copy, see _math._fwd_logprobs_rows)."""
    seen = spy_rows(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 600, generator=g) * 3
    y = torch.randint(0, 600, (40,), generator=g)
    y[::3] = -100
    y[1] = -100
    kw = dict(ignore_index=-100, temperature=0.7, softcap=softcap, backend="compiled")
    leaf = x.clone().requires_grad_(True)
    lp = lr.logprobs_from_logits(leaf * 1, y, inplace_backward=inplace, **kw)
    lp.sum().backward()
    active = y != -100
    sub = x[active].clone().requires_grad_(True)
    alone = lr.logprobs_from_logits(sub, y[active], **kw)
    alone.sum().backward()
    assert torch.equal(lp[active], alone) and torch.equal(leaf.grad[active], sub.grad)
    assert bool((lp[~active] == 0).all()) and bool((leaf.grad[~active] == 0).all())
    forward = "fwd_logprobs_rows" if softcap is None else "fwd_logprobs_softcap"
    base, k = "fwd_logprobs" + ("" if softcap is None else "_softcap"), int(active.sum())
    assert seen == [(forward, k), ("bwd_rows", k), (base, k), ("bwd" + ("" if softcap is None else "_softcap"), k)]
    none = lr.logprobs_from_logits(x, torch.full_like(y, -100), **kw)
    assert torch.equal(none, torch.zeros(40))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("count", [1, 7])
def test_row_kernels_give_an_active_row_the_bits_of_the_call_over_every_row(inplace, count, monkeypatch):
    """The row kernels (the gather fused into their loads, backward the scatter into their stores;
    a single active row as two) give each active row the bits of the call over every row, forward
    and backward, and every other row exact zeros, in place over the logits too (there in blocks of
    rows: 3 here, the last block of one row as two)."""
    seen = spy_rows(monkeypatch)
    monkeypatch.setattr(_ops, "INPLACE_BLOCK_BYTES", 3 * 4 * 900)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, 900, generator=g) * 3
    y = torch.randint(0, 900, (24,), generator=g)
    active = torch.zeros(24, dtype=torch.bool)
    active[torch.randperm(24, generator=g)[:count]] = True
    weights = torch.rand(24, generator=g) + 0.5
    kw = dict(ignore_index=-100, temperature=0.9, backend="compiled")
    leaf = x.clone().requires_grad_(True)
    lp = lr.logprobs_from_logits(leaf * 1, y.masked_fill(~active, -100), inplace_backward=inplace, **kw)
    (lp * weights).sum().backward()
    blocks = ([2] if count == 1 else [3, 3, 2]) if inplace else [max(count, 2)]
    assert seen[:1 + len(blocks)] == [("fwd_logprobs_rows", max(count, 2))] + [("bwd_rows", b) for b in blocks]
    every = x.clone().requires_grad_(True)
    full = lr.logprobs_from_logits(every, y, **kw)
    (full * weights * active).sum().backward()  # the same upstream gradients: 0 off the active rows
    assert torch.equal(lp[active], full[active]) and torch.equal(leaf.grad[active], every.grad[active])
    assert bool((lp[~active] == 0).all()) and bool((leaf.grad[~active] == 0).all())


def test_exact_sums_are_the_kits_bits_from_float32_parts():
    """The tile kernels' exact sum (three float32 sums, constants written out in _math, whose source
    keys the prebuilt packages, as literals in the kernels' code) is kit.exact_sum's bits, for float32
    and float64 terms, in any order, and so is a tile's sum from pieces of any widths read in place
    (the shard op's blocks)."""
    from logprob_registry import kit
    from logprob_registry.distributed.tiles import PART_CONSTANTS
    from logprob_registry.kernels.compiled import _math

    assert _math._PARTS == PART_CONSTANTS and _math._QUANTUM == 2.0 ** kit.QUANTUM_BITS
    source = inspect.getsource(_math._part_sums)  # the kernels write them as literals
    assert all(repr(c) in source for c in PART_CONSTANTS + (_math._QUANTUM, 1 / _math._QUANTUM))
    g = torch.Generator().manual_seed(3)
    terms = torch.rand(16, 4096, generator=g) * 1.37 - 0.37  # e in [0, 1] and e * (z - m) in [-1/e, 0]
    terms[0, :7] = torch.tensor([2.0 ** -37, 3 * 2.0 ** -37, 0.5 + 2.0 ** -37, 1.0, 0.0, -2.0 ** -37, 2.0 ** -12 * 1.5])
    for x in (terms, terms.double()):
        whole = _math._exact(x).view(-1)
        assert torch.equal(whole, kit.exact_sum(x)) and whole.dtype == torch.float64
        assert torch.equal(_math._exact(x.flip(-1)).view(-1), whole)
    hi, mid, lo = kit.exact_parts(terms)
    for part, bits in ((hi, 12), (mid, 24), (lo, 36)):  # each a multiple of its quantum
        assert torch.equal(torch.round(part.double() * 2.0 ** bits), part.double() * 2.0 ** bits)
    from logprob_registry.kernels.compiled import _shards

    x = (torch.randn(5, 3 * 4096 + 7, generator=g) * 4).to(torch.bfloat16)
    x[1, 4096:8192] = float("-inf")
    kw = dict(tile=4096, temperature=0.7, ignore_index=None, with_entropy=True)
    whole = _shards.shard_stats(x[:, :3 * 4096], None, vocab_start=0, **kw)
    for cut in (4096 + 1, 4096 + 2000, 2 * 4096 - 2):  # the tile [4096, 8192) in two pieces
        top = whole[0][:, 1]
        left = _shards.shard_stats(x[:, 4096:cut], None, vocab_start=4096, reference=top, **kw)
        right = _shards.shard_stats(x[:, cut:8192], None, vocab_start=cut, reference=top, **kw)
        for i in (1, 2):
            assert torch.equal(left[i][:, 0] + right[i][:, 0], whole[i][:, 1])
        tail = _shards.shard_stats(x[:, cut:], None, vocab_start=cut, **kw)  # a strided shard off the grid
        for i in range(3):
            assert torch.equal(tail[i][:, 1], whole[i][:, 2])
