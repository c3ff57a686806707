"""DTensor inputs (``logprob_registry/distributed/dtensor.py``, docs/distributed.md#dtensor).

One spawned gloo group per world size runs every check (:func:`_checks`): a 1-D mesh of 2 and of 4
processes (a vocabulary shard in float32 and bfloat16, an uneven vocabulary included; Replicate and
a leading-dim Shard, which run locally; the fused op with a vocabulary-row-sharded weight; topk,
rows sharded and vocabulary sharded; the errors) and, on 4, a 2x2 mesh. Each check returns "" or its traceback; the tests below assert
them by name, so a failure names the check and the rank.
"""

from __future__ import annotations

import subprocess
import sys
import traceback

import pytest
import torch

import logprob_registry as lr
from logprob_registry.distributed import launch
from logprob_registry.numerics import gradient_rounding, hidden_tolerances, tolerance

B = "chunked"  # no compilation in the spawned processes


def _logits(shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _labels(shape, vocab, seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


_FN = {"logprobs": lr.logprobs_from_logits, "entropy": lr.entropy_from_logits,
       "logprobs_and_entropy": lr.logprobs_and_entropy}


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _close(actual, expected, atol, what, rtol=0.0):
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _equal(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}: not bitwise equal (max diff " \
        f"{(actual.double() - expected.double()).abs().max().item()})"


def _start(vocab, parts, index):
    """torch's Shard rule (torch.chunk): ceil(V / parts) columns each, the remainder last."""
    return min(index * -(-vocab // parts), vocab)


# ------------------------------------------------------------------------------ rank-side checks
def _vocab_shard(mesh, mesh_dim, placements, x, y, y_dt, what):
    """Logits ops on logits DTensor-placed ``placements`` with the vocabulary sharded over
    ``mesh_dim``: the result against the process_group path by hand (bitwise) and the plain call on
    the full tensor (the contract), and the gradients."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    group = mesh.get_group(mesh_dim)
    start = _start(x.shape[-1], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    out_placements = tuple(Replicate() if i == mesh_dim else p for i, p in enumerate(placements))
    for op, fn in _FN.items():
        d = distribute_tensor(x, mesh, placements).requires_grad_()
        labels = () if op == "entropy" else (y_dt,)
        got = _tuple(fn(d, *labels, temperature=0.9, backend=B))
        local = d.to_local().detach().clone().requires_grad_()
        local_labels = () if op == "entropy" else (y_dt.to_local() if hasattr(y_dt, "to_local") else y_dt,)
        by_hand = _tuple(fn(local, *local_labels, process_group=group, vocab_start=start, temperature=0.9,
                            backend=B))
        full = x.clone().requires_grad_()
        plain = _tuple(fn(full, *(() if op == "entropy" else (y,)), temperature=0.9, backend=B))
        ups = [_logits(tuple(p.shape), seed=7 + k, scale=1.0) for k, p in enumerate(plain)]
        loss = 0
        for k, (g, h, p) in enumerate(zip(got, by_hand, plain)):
            assert type(g).__name__ == "DTensor" and tuple(g.placements) == out_placements, \
                f"{what} {op}: output placed {g.placements}"
            _equal(g.to_local(), h, f"{what} {op} output {k} vs the process_group path")
            kind = "entropy" if op == "entropy" or k == 1 else "logprobs"
            _close(g.full_tensor(), p, tolerance(x.double(), 0.9, output=kind), f"{what} {op} output {k} vs plain")
            up = distribute_tensor(ups[k], mesh, out_placements)
            loss = loss + (g * up).sum()
        loss.backward()
        sum((h * distribute_tensor(u, mesh, out_placements).to_local()).sum() for h, u in zip(by_hand, ups)).backward()
        sum((p * u).sum() for p, u in zip(plain, ups)).backward()
        assert type(d.grad).__name__ == "DTensor" and tuple(d.grad.placements) == tuple(placements), \
            f"{what} {op}: gradient placed {getattr(d.grad, 'placements', type(d.grad))}"
        _equal(d.grad.to_local(), local.grad, f"{what} {op} gradient vs the process_group path")
        _close(d.grad.full_tensor(), full.grad, 1e-6, f"{what} {op} gradient vs plain",
               rtol=2 * gradient_rounding(x.dtype))


def _runs_locally(mesh, x, y):
    """Replicate and a leading-dim Shard: the plain call on the local rows, bitwise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = mesh.get_local_rank(0)
    rows = x.shape[0] // mesh.size(0)
    mine = slice(rank * rows, (rank + 1) * rows)
    plain_x = x.clone().requires_grad_()
    plain = lr.logprobs_and_entropy(plain_x, y, backend=B)
    (plain[0].sum() + plain[1].sum()).backward()
    for placement, labels in ((Replicate(), y), (Replicate(), distribute_tensor(y, mesh, [Replicate()])),
                              (Shard(0), y[mine]), (Shard(0), distribute_tensor(y, mesh, [Shard(0)])),
                              (Shard(0), distribute_tensor(y, mesh, [Replicate()]))):  # redistributed to Shard(0)
        what = f"{placement!r} with {type(labels).__name__} labels"
        d = distribute_tensor(x, mesh, [placement]).requires_grad_()
        lp, ent = lr.logprobs_and_entropy(d, labels, backend=B)
        for got, want in ((lp, plain[0]), (ent, plain[1])):
            assert tuple(got.placements) == (placement,), f"{what}: placed {got.placements}"
            local_want = want if placement == Replicate() else want[mine]
            _equal(got.to_local(), local_want.detach(), what)
            _equal(got.full_tensor(), want.detach(), what + " (full)")
        (lp.sum() + ent.sum()).backward()
        assert tuple(d.grad.placements) == (placement,), f"{what}: gradient placed {d.grad.placements}"
        _equal(d.grad.full_tensor(), plain_x.grad, what + " gradient")
    values, ids = lr.topk_logprobs(distribute_tensor(x, mesh, [Shard(0)]), 3, backend=B)
    want_v, want_i = lr.topk_logprobs(x, 3, backend=B)
    assert tuple(values.placements) == tuple(ids.placements) == (Shard(0),)
    _equal(values.full_tensor(), want_v, "topk values")
    _equal(ids.full_tensor(), want_i, "topk ids")


def _hidden_vocab_shard(mesh, mesh_dim, hidden_placements, weight_placements, grad_weight_placements, h, w, y, what):
    """logprobs_from_hidden with the weight's vocabulary rows sharded over ``mesh_dim``."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    start = _start(w.shape[0], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    for plain_hidden in (False, True):
        dw = distribute_tensor(w, mesh, weight_placements).requires_grad_()
        if plain_hidden:  # a plain tensor: this rank's rows (here: all of them)
            if any(p != Replicate() for p in hidden_placements):
                continue
            dh = h.clone().requires_grad_()
            labels = y
        else:
            dh = distribute_tensor(h, mesh, hidden_placements).requires_grad_()
            labels = distribute_tensor(y, mesh, [Replicate() if p == Replicate() else p for p in hidden_placements])
        lp, ent = lr.logprobs_from_hidden(dh, dw, labels, return_entropy=True, backend=B)
        local_h = (dh if plain_hidden else dh.to_local()).detach().clone().requires_grad_()
        local_w = dw.to_local().detach().clone().requires_grad_()
        local_y = labels if plain_hidden else labels.to_local()
        by_hand = lr.logprobs_from_hidden(local_h, local_w, local_y, return_entropy=True,
                                          process_group=mesh.get_group(mesh_dim), vocab_start=start, backend=B)
        full_h, full_w = h.clone().requires_grad_(), w.clone().requires_grad_()
        plain = lr.logprobs_from_hidden(full_h, full_w, y, return_entropy=True, backend=B)
        tol = hidden_tolerances(h.double(), w.double())
        rows = tuple(Replicate() if i == mesh_dim else p for i, p in enumerate(hidden_placements))
        for k, (g, b, p) in enumerate(zip((lp, ent), by_hand, plain)):
            assert tuple(g.placements) == rows, f"{what}: output placed {g.placements}"
            _equal(g.to_local(), b, f"{what} output {k} vs the process_group path")
            _close(g.full_tensor(), p, tol[k], f"{what} output {k} vs plain")
        (lp.sum() + ent.sum()).backward()
        (by_hand[0].sum() + by_hand[1].sum()).backward()
        (plain[0].sum() + plain[1].sum()).backward()
        assert tuple(dw.grad.placements) == tuple(grad_weight_placements), f"{what}: weight gradient placed " \
            f"{dw.grad.placements}"
        _close(dw.grad.full_tensor(), full_w.grad, 1e-5, what + " weight gradient vs plain", rtol=1e-5)
        hidden_grad = dh.grad if plain_hidden else dh.grad.full_tensor()
        if not plain_hidden:
            assert tuple(dh.grad.placements) == tuple(hidden_placements), f"{what}: hidden gradient placed " \
                f"{dh.grad.placements}"
        _close(hidden_grad, full_h.grad, 1e-5, what + " hidden gradient vs plain", rtol=1e-5)


def _vocab_topk(mesh, x):
    """topk_logprobs of vocabulary-sharded logits: the process_group path by hand (bitwise), values
    and global ids replicated over the vocabulary's mesh dim; the plain call within the contract;
    the gradient a DTensor of the logits' placement."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    start = _start(x.shape[-1], mesh.size(0), mesh.get_local_rank(0))
    d = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    values, ids = lr.topk_logprobs(d, 5, temperature=0.9, backend=B)
    local = d.to_local().detach().clone().requires_grad_()
    by_hand = lr.topk_logprobs(local, 5, temperature=0.9, process_group=mesh.get_group(0), vocab_start=start,
                               backend=B)
    full = x.clone().requires_grad_()
    plain = lr.topk_logprobs(full, 5, temperature=0.9, backend=B)
    assert tuple(values.placements) == tuple(ids.placements) == (Replicate(),), values.placements
    _equal(values.to_local(), by_hand[0], "topk values vs the process_group path")
    _equal(ids.to_local(), by_hand[1], "topk ids vs the process_group path")
    _equal(ids.full_tensor(), plain[1], "topk ids vs plain")
    _close(values.full_tensor(), plain[0], tolerance(x.double(), 0.9), "topk values vs plain")
    values.sum().backward()
    by_hand[0].sum().backward()
    plain[0].sum().backward()
    assert tuple(d.grad.placements) == (Shard(2),), d.grad.placements
    _equal(d.grad.to_local(), local.grad, "topk gradient vs the process_group path")
    _close(d.grad.full_tensor(), full.grad, 1e-6, "topk gradient vs plain", rtol=2 * gradient_rounding(x.dtype))


def _vocab_kl(mesh, x):
    """kl_divergence of two vocabulary-sharded logits DTensors with a DTensor mask, both directions:
    the process_group path by hand (bitwise, the student's gradient too), the plain call within the
    contract, the output replicated over the vocabulary's mesh dim."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    start = _start(x.shape[-1], mesh.size(0), mesh.get_local_rank(0))
    teacher = _logits(tuple(x.shape), seed=5)
    mask = torch.ones(x.shape[:-1], dtype=torch.bool)
    mask[1, 2] = False
    for kw in (dict(direction="forward", temperature=2.0), dict(direction="reverse")):
        d = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
        t = distribute_tensor(teacher, mesh, [Shard(2)])
        m = distribute_tensor(mask, mesh, [Replicate()])
        got = lr.kl_divergence(d, t, mask=m, backend=B, **kw)
        local = d.to_local().detach().clone().requires_grad_()
        by_hand = lr.kl_divergence(local, t.to_local(), mask=mask, process_group=mesh.get_group(0), vocab_start=start,
                                   backend=B, **kw)
        full = x.clone().requires_grad_()
        plain = lr.kl_divergence(full, teacher, mask=mask, backend=B, **kw)
        what = f"kl {kw.get('direction')}"
        assert tuple(got.placements) == (Replicate(),), f"{what}: placed {got.placements}"
        _equal(got.to_local(), by_hand, f"{what} vs the process_group path")
        _close(got.full_tensor(), plain, 1e-5, f"{what} vs plain")
        got.sum().backward()
        by_hand.sum().backward()
        plain.sum().backward()
        assert tuple(d.grad.placements) == (Shard(2),), d.grad.placements
        _equal(d.grad.to_local(), local.grad, f"{what} gradient vs the process_group path")
        _close(d.grad.full_tensor(), full.grad, 1e-6, f"{what} gradient vs plain", rtol=2 * gradient_rounding(x.dtype))


def _vocab_kl_hidden(mesh, h, w):
    """kl_divergence of two hidden sides, each lm_head weight sharded by vocabulary rows (Shard(0))
    and the hidden states replicated: the process_group path by hand, bitwise (the student's hidden
    gradient complete, its weight gradient a vocabulary shard)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    start = _start(w.shape[0], mesh.size(0), mesh.get_local_rank(0))
    ht, wt = _logits(tuple(h.shape), seed=8, scale=1.0), _logits(tuple(w.shape), seed=9, scale=0.3)
    hs = distribute_tensor(h, mesh, [Replicate()]).requires_grad_()
    ws = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    got = lr.kl_divergence(hs, distribute_tensor(ht, mesh, [Replicate()]), student_weight=ws,
                           teacher_weight=distribute_tensor(wt, mesh, [Shard(0)]), temperature=1.5, backend=B)
    lh, lw = h.clone().requires_grad_(), ws.to_local().detach().clone().requires_grad_()
    by_hand = lr.kl_divergence(lh, ht, student_weight=lw, teacher_weight=wt[start:start + lw.shape[0]],
                               temperature=1.5, process_group=mesh.get_group(0), vocab_start=start, backend=B)
    plain = lr.kl_divergence(h, ht, student_weight=w, teacher_weight=wt, temperature=1.5, backend=B)
    assert tuple(got.placements) == (Replicate(),), got.placements
    _equal(got.to_local(), by_hand, "kl hidden vs the process_group path")
    _close(got.full_tensor(), plain, 1e-5, "kl hidden vs plain")
    got.sum().backward()
    by_hand.sum().backward()
    assert tuple(hs.grad.placements) == (Replicate(),) and tuple(ws.grad.placements) == (Shard(0),)
    _equal(hs.grad.to_local(), lh.grad, "kl hidden: hidden gradient vs the process_group path")
    _equal(ws.grad.to_local(), lw.grad, "kl hidden: weight gradient vs the process_group path")


def _errors(mesh, x, y, world):
    """Placements that cannot run, and mismatched meshes: a clear error, on every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    def raises(kind, match, fn):
        try:
            fn()
        except kind as exc:
            assert match in str(exc), f"{type(exc).__name__} without {match!r}: {exc}"
            return
        raise AssertionError(f"no {kind.__name__} ({match!r})")

    partial = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    raises(ValueError, "Partial(sum) on mesh dim 0 is not supported", lambda: lr.logprobs_from_logits(partial, y))
    other = DeviceMesh("cpu", list(reversed(range(world))))
    d = distribute_tensor(x, mesh, [Shard(2)])
    raises(ValueError, "different device meshes", lambda: lr.logprobs_from_logits(
        d, distribute_tensor(y, other, [Replicate()])))
    raises(ValueError, "leave process_group and vocab_start out",
           lambda: lr.logprobs_from_logits(d, y, process_group=mesh.get_group(0)))
    h, w = _logits((4, 8), seed=3, scale=1.0), _logits((x.shape[-1], 8), seed=4, scale=0.3)
    raises(ValueError, "Shard(dim=1) on mesh dim 0 is not supported (a sharded hidden dimension",
           lambda: lr.logprobs_from_hidden(h, distribute_tensor(w, mesh, [Shard(1)]), y[:, 0]))
    raises(ValueError, "Shard(dim=1) on mesh dim 0 is not supported (a sharded hidden dimension",
           lambda: lr.logprobs_from_hidden(distribute_tensor(h, mesh, [Shard(1)]), w, y[:, 0]))
    raises(ValueError, "different device meshes", lambda: lr.logprobs_from_hidden(
        distribute_tensor(h, other, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)]), y[:, 0]))
    raises(TypeError, "labels is a DTensor but logits is a plain", lambda: lr.logprobs_from_logits(
        x, distribute_tensor(y, mesh, [Replicate()])))
    raises(ValueError, "both sides must be placed alike",  # a hidden student sharded, a whole teacher
           lambda: lr.kl_divergence(h, distribute_tensor(x[:, 0], mesh, [Replicate()]),
                                    student_weight=distribute_tensor(w, mesh, [Shard(0)])))
    raises(ValueError, "both sides must be placed alike",
           lambda: lr.kl_divergence(d, distribute_tensor(x, mesh, [Replicate()])))
    raises(TypeError, "student is a DTensor but teacher is a plain", lambda: lr.kl_divergence(d, x))
    if world == 4:  # plain hidden states with a weight on a 2-D mesh: which rows they are is unknown
        from torch.distributed.device_mesh import init_device_mesh

        mesh2 = init_device_mesh("cpu", (2, 2))
        raises(ValueError, "pass the hidden states as a DTensor on that mesh", lambda: lr.logprobs_from_hidden(
            h, distribute_tensor(w, mesh2, [Replicate(), Shard(0)]), y[:, 0]))


def _checks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    results = {}

    def record(name, fn, *args):
        try:
            fn(*args)
            results[name] = ""
        except Exception:
            results[name] = traceback.format_exc()

    mesh = init_device_mesh("cpu", (world,))
    y = _labels((4, 3), 1001)
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (1000, 1001):  # even, and uneven (torch gives the first ranks one column more)
            x = _logits((4, 3, vocab), dtype)
            record(f"1d-vocab-{dtype}-{vocab}-plain-labels", _vocab_shard, mesh, 0, [Shard(2)], x, y % vocab, y % vocab,
                   "1-D")
        from torch.distributed.tensor import distribute_tensor
        record(f"1d-vocab-{dtype}-dtensor-labels", _vocab_shard, mesh, 0, [Shard(2)], x, y % 1001,
               distribute_tensor(y % 1001, mesh, [Replicate()]), "1-D")
    x = _logits((4, 3, 1001))
    record("1d-local", _runs_locally, mesh, x, y)
    record("1d-vocab-topk", _vocab_topk, mesh, x)
    record("1d-vocab-kl", _vocab_kl, mesh, x)
    h, w = _logits((4, 16), seed=3, scale=1.0), _logits((1001, 16), seed=4, scale=0.3)
    record("1d-hidden", _hidden_vocab_shard, mesh, 0, [Replicate()], [Shard(0)], [Shard(0)], h, w, y[:, 0], "1-D")
    record("1d-vocab-kl-hidden", _vocab_kl_hidden, mesh, h, w)
    record("errors", _errors, mesh, x, y, world)
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dtype in (torch.float32, torch.bfloat16):
            x = _logits((4, 3, 1001), dtype)
            from torch.distributed.tensor import distribute_tensor
            dp = mesh2.get_local_rank(0)
            record(f"2x2-dp-tp-{dtype}-dtensor-labels", _vocab_shard, mesh2, 1, [Shard(0), Shard(2)], x, y,
                   distribute_tensor(y, mesh2, [Shard(0), Replicate()]), "2x2")
            record(f"2x2-dp-tp-{dtype}-plain-labels", _vocab_shard_local_labels, mesh2, x, y, dp)
            record(f"2x2-tp-replicated-{dtype}", _vocab_shard, mesh2, 0, [Shard(2), Replicate()], x, y, y, "2x2 (vocab on dim 0)")
        record("2x2-hidden", _hidden_vocab_shard, mesh2, 1, [Shard(0), Replicate()], [Replicate(), Shard(0)],
               [Partial(), Shard(0)], h, w, y[:, 0], "2x2")
    return results


def _vocab_shard_local_labels(mesh2, x, y, dp):
    """Plain labels of this rank's rows (dp shard), logits (Shard(0), Shard(2))."""
    from torch.distributed.tensor import Shard

    _vocab_shard(mesh2, 1, [Shard(0), Shard(2)], x, y, y[dp * 2:(dp + 1) * 2], "2x2 plain labels")


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request):
    return [r.unwrap() for r in launch.run(request.param, _checks, timeout=240)]


def _assert(ranks, prefix):
    names = [n for n in ranks[0] if n.startswith(prefix)]
    assert names, f"no check named {prefix}*"
    failed = [f"rank {r} {n}:\n{res[n]}" for r, res in enumerate(ranks) for n in names if res[n]]
    assert not failed, "\n".join(failed)


def test_a_vocabulary_shard_is_the_process_group_path_bitwise_and_the_plain_call_within_the_contract(ranks):
    _assert(ranks, "1d-vocab-")


def test_replicate_and_a_leading_shard_run_locally_bitwise(ranks):
    _assert(ranks, "1d-local")


def test_logprobs_from_hidden_with_a_vocab_row_sharded_weight(ranks):
    _assert(ranks, "1d-hidden")


def test_partial_a_sharded_hidden_dim_and_mismatched_meshes_raise(ranks):
    _assert(ranks, "errors")


def test_a_2x2_mesh_shards_rows_and_vocabulary(ranks):
    """On 4 processes: the 2x2 mesh's checks; on 2, _checks builds no 2x2 mesh (asserted)."""
    if len(ranks) == 4:
        _assert(ranks, "2x2-")
    else:
        assert not any(name.startswith("2x2-") for rank in ranks for name in rank)


def test_importing_the_package_does_not_import_dtensor():
    code = "import sys, logprob_registry; assert 'torch.distributed.tensor' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_tensors_under_torch_compile_keep_their_behaviour_with_dtensor_imported():
    import torch.distributed.tensor  # noqa: F401  (the DTensor check in _run is now live)

    x, y = _logits((2, 3, 50)), _labels((2, 3), 50)
    f = torch.compile(lambda a, b: lr.logprobs_from_logits(a, b, backend=B), fullgraph=True, backend="eager")
    _equal(f(x, y), lr.logprobs_from_logits(x, y, backend=B), "compiled")
