"""lr.token_stats: bad input, the TokenStats record's shapes and dtypes, torch.compile, chunked's
chunk and tile budgets, and agreement with TRL's ChunkedLogProbFunction (when trl is installed).
The conformance suite's section (logprob_registry/testing/sections/stats.py) checks every field of
every backend against float64."""

import pytest
import torch
import torch._dynamo.utils

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.kernels import chunked
from logprob_registry.kernels.chunked import _hidden as chunked_hidden
from logprob_registry.kernels.chunked import _stats

FIELDS = lr.TokenStats._fields
V = 300
G = torch.Generator().manual_seed(0)
X = torch.randn(2, 5, V, generator=G) * 3
Y = torch.randint(0, V, (2, 5), generator=G)
HID = torch.randn(2, 5, 32, generator=G)
W = torch.randn(V, 32, generator=G) * 0.3
B = torch.randn(V, generator=G)


# ------------------------------------------------------------------------------------ bad input
def test_unknown_output_name():
    with pytest.raises(ValueError, match=r"outputs names 'logprob', which token_stats does not compute; the outputs "
                                         r"are logprobs, entropy, raw_logprobs"):
        lr.token_stats(X, Y, outputs=("logprob", "entropy"))


@pytest.mark.parametrize("outputs", [("is_argmax",), ("logprobs",), ("entropy", "raw_logprobs")])
def test_label_fields_need_labels(outputs):
    with pytest.raises(ValueError, match=r"outputs .* need labels: pass labels \(the token ids of the positions\), "
                                         r"or leave those outputs out"):
        lr.token_stats(X, None, outputs=outputs)


@pytest.mark.parametrize("outputs", [(), "nothing-here", (1, 2)])
def test_outputs_must_be_names(outputs):
    with pytest.raises((TypeError, ValueError), match="outputs"):
        lr.token_stats(X, Y, outputs=outputs)


# -------------------------------------------------------------------------- the record itself
@pytest.mark.parametrize("backend", ["naive", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hidden", [False, True])
def test_shapes_and_dtypes(backend, dtype, hidden):
    kw = dict(weight=W.to(dtype), bias=B.to(dtype)) if hidden else {}
    x = (HID if hidden else X).to(dtype)
    got = lr.token_stats(x, Y, outputs=FIELDS, backend=backend, **kw)
    assert isinstance(got, lr.TokenStats) and got._fields == FIELDS
    want_float = torch.float64 if dtype == torch.float64 else torch.float32
    for name in FIELDS:
        value = getattr(got, name)
        assert tuple(value.shape) == (2, 5), name
        assert value.dtype == (torch.bool if name == "is_argmax" else want_float), (name, value.dtype)
    some = lr.token_stats(x, Y, outputs=("max_logit", "logprobs"), backend=backend, **kw)
    assert [n for n in FIELDS if getattr(some, n) is not None] == ["logprobs", "max_logit"]
    default = lr.token_stats(x, Y, backend=backend, **kw)  # outputs=("logprobs", "entropy")
    assert [n for n in FIELDS if getattr(default, n) is not None] == ["logprobs", "entropy"]


@pytest.mark.parametrize("backend", ["naive", "chunked"])
def test_candidates_and_degenerate_shapes(backend):
    cand = torch.randint(0, V, (2, 5, 4), generator=torch.Generator().manual_seed(1))
    got = lr.token_stats(X, cand, outputs=FIELDS, top_k=20, backend=backend)
    for name in FIELDS:
        expect = (2, 5, 4) if name in ("logprobs", "raw_logprobs", "is_argmax") else (2, 5)
        assert tuple(getattr(got, name).shape) == expect, name
    one = lr.token_stats(X[0, 0], Y[0, 0], outputs=FIELDS, backend=backend)  # 1-D logits, a 0-d label
    assert all(getattr(one, n).shape == () for n in FIELDS)
    empty = lr.token_stats(X[:0], Y[:0], outputs=FIELDS, backend=backend)
    assert all(tuple(getattr(empty, n).shape) == (0, 5) for n in FIELDS)
    strided = lr.token_stats(X[:, :-1], Y[:, 1:], outputs=FIELDS, backend=backend)  # the shifted-slice case
    contiguous = lr.token_stats(X[:, :-1].contiguous(), Y[:, 1:].contiguous(), outputs=FIELDS, backend=backend)
    for name in FIELDS:
        assert torch.equal(getattr(strided, name), getattr(contiguous, name)), name


# ------------------------------------------------------------------------------ torch.compile
def _stats_step(x, y, h, w, b):
    s = lr.token_stats(x, y, outputs=FIELDS, temperature=0.8, ignore_index=-100)
    f = lr.token_stats(h, y.clamp(min=0), weight=w, bias=b, outputs=("logprobs", "entropy", "log_sum_p2"))
    return (s.logprobs.sum() + 0.5 * s.entropy.sum() + s.raw_logprobs.sum() + 0.3 * s.raw_entropy.sum()
            + f.logprobs.sum() + 0.2 * f.entropy.sum(),
            s.log_sum_p2 + s.mean_logit + s.max_logit + s.is_argmax.float() + f.log_sum_p2)


def test_fullgraph_compile():
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_stats_step, fullgraph=True)
    y = Y.clone()
    y[0, 0] = -100
    results = []
    for fn in (_stats_step, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (X, HID, W, B)]
        loss, rest = fn(leaves[0], y, leaves[1], leaves[2], leaves[3])
        results.append([loss.detach(), rest.detach()] + list(torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


# -------------------------------------------------------- chunked: many chunks and tiles
def _close(got: lr.TokenStats, want: dict, tol=2e-5):
    for name, w in want.items():
        g = getattr(got, name)
        if name == "is_argmax":
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=tol, equal_nan=True, msg=name)


@pytest.mark.parametrize("options", [{}, dict(top_p=0.9, softcap=10.0, temperature=0.7), dict(top_k=7)])
def test_chunked_small_budgets(options, monkeypatch):
    """A workspace of a few rows and tiles of 64 x 64: every field as the float64 reference, and still
    bitwise chunked's own ops under the same budgets; the argmax and sum p**2 across vocabulary tiles."""
    monkeypatch.setenv(chunked_hidden.CHUNK_BYTES_ENV, str(64 * 64 * 4))
    chunked.set_workspace_bytes(3 * V * 4 * 2)
    try:
        y = Y.clone()
        y.view(-1)[::2] = X.argmax(-1).view(-1)[::2]
        got = lr.token_stats(X, y, outputs=FIELDS, backend="chunked", **options)
        _close(got, ref.token_stats(X.double(), y, outputs=FIELDS, **options))
        assert torch.equal(got.logprobs, lr.logprobs_from_logits(X, y, backend="chunked", **options))
        assert torch.equal(got.entropy, lr.logprobs_and_entropy(X, y, backend="chunked", **options)[1])
        z = HID @ W.T + B
        yh = Y.clone()
        yh.view(-1)[::2] = z.argmax(-1).view(-1)[::2]
        got = lr.token_stats(HID, yh, weight=W, bias=B, outputs=FIELDS, backend="chunked", **options)
        _close(got, ref.token_stats(HID.double(), yh, weight=W.double(), bias=B.double(), outputs=FIELDS, **options))
        assert bool(got.is_argmax.view(-1)[::2].all())
        assert torch.equal(got.logprobs, lr.logprobs_from_hidden(HID, W, yh, bias=B, backend="chunked", **options))
        ent = lr.logprobs_from_hidden(HID, W, yh, bias=B, return_entropy=True, backend="chunked", **options)[1]
        assert torch.equal(got.entropy, ent)
    finally:
        chunked.set_workspace_bytes(None)


def test_chunked_fixed_shape_chunks_change_nothing():
    """The accelerators' path (every chunk padded to one shape) gives the CPU path's bits."""
    kw = dict(weight=None, bias=None, outputs=FIELDS, temperature=0.9, ignore_index=None, budget=3 * V * 8)
    for sampler in ({}, dict(top_k=9)):
        a = _stats.token_stats(X, Y, fixed_shape=True, **kw, **sampler)
        b = _stats.token_stats(X, Y, fixed_shape=False, **kw, **sampler)
        for name in FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, sampler)


def test_chunked_per_row_values_are_the_calls_with_numbers():
    t = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.0, 1.3, 0.9, 1.0, 1.0]).view(2, 5)
    k = torch.tensor([0, 10, 0, 5, 0, 0, V, 3, 0, 12]).view(2, 5)
    got = lr.token_stats(X, Y, outputs=FIELDS, temperature=t, top_k=k, backend="chunked")
    for i in range(2):
        for j in range(5):
            kk = int(k[i, j])
            one = lr.token_stats(X[i, j:j + 1], Y[i, j:j + 1], outputs=FIELDS, temperature=float(t[i, j]),
                                 top_k=kk if 0 < kk < V else None, backend="chunked")
            for name in FIELDS:
                assert torch.equal(getattr(got, name)[i, j], getattr(one, name)[0]), (name, i, j)


def test_chunked_no_double_backward():
    x = X.clone().requires_grad_(True)
    out = lr.token_stats(x, Y, outputs=("logprobs", "entropy"), backend="chunked")
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.logprobs.sum(), x, create_graph=True)


def test_chunked_declares_token_stats():
    backend = lr.get_registry().get("chunked")
    assert backend.supports("token_stats")
    assert lr.select("token_stats", device="cpu", shape=(8, 32768)).name in ("chunked", "compiled", "triton")


# ------------------------------------------------------------------------------------- TRL
def _trl():
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception as exc:  # noqa: BLE001 - any failure to import it skips
        pytest.skip(f"trl (1.16) is not importable here: {exc}")
    return ChunkedLogProbFunction


@pytest.mark.parametrize("backend", ["chunked", "naive"])
@pytest.mark.parametrize("options", [dict(temperature=1.0, softcap=None, logit_scale=None, bias=False),
                                     dict(temperature=0.7, softcap=None, logit_scale=None, bias=True),
                                     dict(temperature=0.9, softcap=12.0, logit_scale=0.5, bias=True)])
def test_against_trl_chunked_logprob_function(backend, options):
    """TRL's fused head (trl.kernels.ChunkedLogProbFunction, fp32 on the CPU, all its outputs):
    logprobs, entropy, log_sum_sq_probs, mean_logits and is_top1 agree with logprobs, entropy,
    log_sum_p2, mean_logit and is_argmax (within 1e-5; is_argmax exactly, away from ties). TRL applies
    logit_scale, then the softcap, then the temperature, as token_stats does."""
    fn = _trl()
    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 32, 1000
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (3.0 / h ** 0.5)
    bias = torch.randn(v, generator=g) if options["bias"] else None
    z = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::3] = z.argmax(-1)[::3]
    theirs = fn.apply(hidden, weight, bias, targets, options["temperature"], 256, options["softcap"],
                      1.0 if options["logit_scale"] is None else options["logit_scale"],
                      ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    mine = lr.token_stats(hidden, targets, weight=weight, bias=bias, outputs=FIELDS, temperature=options["temperature"],
                          softcap=options["softcap"], logit_scale=options["logit_scale"], backend=backend)
    for a, b, name in zip(theirs[:4], (mine.logprobs, mine.entropy, mine.log_sum_p2, mine.mean_logit),
                          ("logprobs", "entropy", "log_sum_p2", "mean_logit")):
        torch.testing.assert_close(b, a.float(), rtol=0, atol=1e-5, msg=name)
    top = torch.sort(z, -1, descending=True).values
    apart = (top[:, 0] - top[:, 1]) > 1e-3
    assert torch.equal(mine.is_argmax[apart], theirs[4][apart])
    assert bool(mine.is_argmax[::3].all())


# ------------------------------------------------------------------------------------ bench
@pytest.mark.parametrize("hidden", [None, 8])
@pytest.mark.parametrize("backward", [False, True])
def test_bench_workload_with_outputs(hidden, backward):
    """bench --op token_stats --outputs ...: the fields asked, each within float32 of float64 (the
    baseline too), the loss of backward the differentiable ones."""
    from logprob_registry.benchmark import settings as st
    from logprob_registry.benchmark.workload import Workload, max_differences

    s = st.Setting(op="token_stats", device="cpu", dtype="float32", shape=(2, 5, 300), hidden_size=hidden,
                   backward=backward, outputs_asked=FIELDS)
    assert s.outputs == FIELDS and st.Setting(**s.to_args()) == s
    for name in ("chunked", "naive", "baseline"):
        w = Workload(s, name)
        outs = w.run(w.prepare())
        assert len(outs) == len(FIELDS)
        diff, grads = max_differences(s, w.inputs, outs, w.grads())
        assert diff < 1e-4, (name, diff)
        assert set(grads) == (set() if not backward else {"inputs", "weight"} if hidden else {"inputs"})
        assert all(d < 1e-4 for d in grads.values()), (name, grads)


def test_bench_outputs_option():
    from logprob_registry.benchmark import BenchError
    from logprob_registry.benchmark.session import Options, settings

    got = settings(Options(ops=["token_stats,logprobs_and_entropy"], shape=(1, 8, 300),
                           outputs=["is_argmax,logprobs", "entropy"]), "cpu")
    assert [s.outputs for s in got] == [("logprobs", "entropy", "is_argmax"), ("logprobs", "entropy")]
    assert settings(Options(ops=["token_stats"], shape=(1, 8, 300)), "cpu")[0].outputs == ("logprobs", "entropy")
    with pytest.raises(BenchError, match="unknown output 'nope'"):
        settings(Options(ops=["token_stats"], shape=(1, 8, 300), outputs=["nope"]), "cpu")
    with pytest.raises(BenchError, match="--outputs only applies to ops whose outputs are chosen"):
        settings(Options(ops=["logprobs"], shape=(1, 8, 300), outputs=["entropy"]), "cpu")


# ------------------------------------------------------------------------------------ memory
def _extra(fn, retained=False):
    from logprob_registry.benchmark.memory import MemoryMeasurementUnavailable, peak_extra_bytes

    try:
        fn()  # warm-up
        return min(peak_extra_bytes(fn, torch.device("cpu"), retained=retained)[1] for _ in range(2))
    except MemoryMeasurementUnavailable as exc:
        pytest.skip(f"cannot measure memory here: {exc}")


@pytest.mark.parametrize("options", [{}, dict(top_k=20, softcap=10.0)])
def test_chunked_keeps_and_forms_no_logits_sized_tensor(options, monkeypatch):
    """chunked's token_stats keeps a few numbers per row for backward (logits), and forms no (N, V)
    tensor in forward or backward (hidden states): the memory grows far less than the logits."""
    monkeypatch.setenv(chunked_hidden.CHUNK_BYTES_ENV, str(128 * 128 * 4))  # tiles of 128 rows at both sizes
    v, h = 4096, 64  # (a truncated call keeps its top-k per row, ~0.8 KB: at 2048 columns that was 0.1x the logits)
    sizes, retained, peaks = (256, 2048), [], []
    weight = torch.randn(v, h, generator=torch.Generator().manual_seed(2)) * 0.2
    for n in sizes:
        x = (torch.randn(n, v, generator=torch.Generator().manual_seed(n)) * 3).requires_grad_(True)
        y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(n + 1))
        hidden = torch.randn(n, h, generator=torch.Generator().manual_seed(n + 2)).requires_grad_(True)

        def forward(x=x, y=y):
            return lr.token_stats(x, y, outputs=FIELDS, backend="chunked", **options)

        def fused_step(hidden=hidden, y=y):
            out = lr.token_stats(hidden, y, weight=weight, outputs=FIELDS, backend="chunked", **options)
            (out.logprobs.sum() + out.entropy.sum() + out.raw_entropy.sum()).backward()
            hidden.grad = None

        retained.append(_extra(forward, retained=True))
        peaks.append(_extra(fused_step))
    logits_growth = (sizes[1] - sizes[0]) * v * 4
    assert retained[1] - retained[0] < 0.1 * logits_growth, (retained, logits_growth)
    assert peaks[1] - peaks[0] < 0.25 * logits_growth, (peaks, logits_growth)


def test_the_kit_names_the_fields_as_the_op_table_does():
    """kit.DIFFERENTIABLE_STATS and kit.LABEL_STATS are the op table's; stats_gradients adds a field's
    and its raw twin's upstream gradients; asked_stats copies a processed field into its raw twin."""
    from logprob_registry import kit
    from logprob_registry.opspec import OPS

    spec = OPS["token_stats"]
    assert kit.DIFFERENTIABLE_STATS == {o.name for o in spec.results if o.differentiable}
    assert kit.LABEL_STATS == {"logprobs", "raw_logprobs", "is_argmax"}
    a, b = torch.ones(3), torch.full((3,), 2.0)
    grads = [None] * len(lr.TokenStats._fields)
    grads[lr.TokenStats._fields.index("logprobs")], grads[lr.TokenStats._fields.index("raw_logprobs")] = a, b
    g_lp, g_ent = kit.stats_gradients(grads)
    assert torch.equal(g_lp, a + b) and g_ent is None
    assert kit.stats_gradients({"raw_entropy": b})[1] is b
    got = kit.asked_stats({"logprobs": a, "entropy": b, "max_logit": None}, {"logprobs", "raw_logprobs", "raw_entropy"})
    assert set(got) == {"logprobs", "raw_logprobs", "raw_entropy"} and got["logprobs"] is a
    assert torch.equal(got["raw_logprobs"], a) and got["raw_logprobs"] is not a and got["raw_entropy"] is b
    assert kit.stats_asked(("raw_logprobs", "max_logit")) == (True, False)
