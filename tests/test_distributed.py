"""The vocabulary-parallel path (``process_group=``), this project's own tests: the tile protocol and
the merge, the header's checks, the supported-options check, the registry integration, and the few
things the conformance section (``logprob_registry/testing/sections/distributed.py``, which runs
every backend over spawned groups of 1, 2 and 4) does not: a hang fails within a deadline, a
backward that fails on one rank raises on every rank, ``bench --process-group``.

Most tests run in this process, in a gloo group of one (the same code path as a larger group);
the spawned ones use :mod:`logprob_registry.distributed.launch`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.call import validate
from logprob_registry.distributed import header, launch, support, tiles
from logprob_registry.distributed.group import traffic
from logprob_registry.distributed.merge import merge
from logprob_registry.numerics import tolerance
from logprob_registry.opspec import OPS, SHARD_OPS

ROOT = Path(__file__).resolve().parents[1]
V = 16384


def _logits(shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------------ tile protocol
def test_exact_sums_of_the_pieces_of_a_tile_add_up_to_its_bits_and_tree_sum_needs_a_power_of_two():
    e = (_logits((5, 4096)) - 12.0).exp()
    whole = tiles.exact_sum(e)
    for cut in (1, 1000, 4095):
        left, right = e.clone(), e.clone()
        left[:, cut:], right[:, :cut] = 0.0, 0.0
        assert torch.equal(tiles.exact_sum(left) + tiles.exact_sum(right), whole)
    assert torch.equal(tiles.exact_sum(e.flip(-1)), whole) and whole.dtype == torch.float64
    assert torch.isnan(tiles.exact_sum(torch.tensor([[0.5, float("nan")]]))).all()
    with pytest.raises(ValueError, match="power-of-two last dim, got 6; pad with zeros first"):
        tiles.tree_sum(torch.ones(2, 6))


def test_the_grid_cuts_a_shard_at_global_multiples_of_the_tile():
    assert tiles.grid(5000, 3000) == [tiles.Slot(0, 3000, 904)]
    assert tiles.grid(0, 8193) == [tiles.Slot(0, 4096, 0), tiles.Slot(4096, 8192, 0), tiles.Slot(8192, 8193, 0)]
    assert tiles.grid(4000, 200) == [tiles.Slot(0, 96, 4000), tiles.Slot(96, 200, 0)]
    assert tiles.grid_slots(4000, 200) == 2 and tiles.grid(4000, 200)[0].p1 == 4096


def test_tile_stats_of_masked_and_nan_tiles():
    z = _logits((3, 2, 4096))
    z[0, 1] = float("-inf")          # a tile of nothing but -inf
    z[1, 0, ::3] = float("-inf")     # scattered -inf
    z[2, 1, 17] = float("nan")
    m, s, t = tiles.tile_stats_(z.clone(), True)
    assert (m[0, 1], s[0, 1], t[0, 1]) == (float("-inf"), 0.0, 0.0)
    assert torch.isnan(m[2, 1]) and torch.isnan(s[2, 1]) and torch.isnan(t[2, 1])
    x = z[1, 0].double()
    e = (x - x.max()).exp()
    d = torch.where(torch.isneginf(x), 0.0, x - x.max())
    torch.testing.assert_close(s[1, 0].double(), e.sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(t[1, 0].double(), (e * d).sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_merging_the_tiles_of_any_split_gives_the_same_bits(backend):
    """The core's invariance, in one process: a backend's shard_stats of 1, 2, 4 or 37 shards (and
    an uneven split), concatenated in vocabulary order and merged, give the same bits, and match
    float64 within the contract."""
    vocab = 37 * tiles.TILE
    x = _logits((6, vocab), torch.bfloat16, scale=4.0)
    x[1, 4096:8192] = float("-inf")
    stats_op = lr.get_registry().get(backend).ops["shard_stats"]
    results = []
    for bounds in ([0, vocab], [0, 18 * 4096, vocab], [0, 9 * 4096, 18 * 4096, 27 * 4096, vocab],
                   list(range(0, vocab + 1, 4096)), [0, 36 * 4096, vocab]):
        parts = [stats_op(x[:, a:b], None, vocab_start=a, tile=tiles.TILE, temperature=0.7, ignore_index=None,
                          with_entropy=True) for a, b in zip(bounds, bounds[1:])]
        results.append(merge(*(torch.cat([p[i] for p in parts], dim=1) for i in range(3))))
    for lse, ent in results[1:]:
        assert torch.equal(lse, results[0][0]) and torch.equal(ent, results[0][1])
    want = ref.entropy(x, temperature=0.7)
    assert (results[0][1].double() - want).abs().max() <= tolerance(x, 0.7, output="entropy")
    lse64 = torch.logsumexp(x.double() / 0.7, -1)
    assert (results[0][0].double() - lse64).abs().max() <= tolerance(x, 0.7)


def test_a_row_of_nothing_but_minus_infinity_merges_to_nan_like_the_reference():
    m = torch.full((1, 3), float("-inf"))
    lse, ent = merge(m, torch.zeros(1, 3), torch.zeros(1, 3))
    assert lse.item() == float("-inf") and torch.isnan(ent).all()


# ------------------------------------------------------------------------------ the header
def _table(*locals_):
    return torch.stack([header.row(loc, torch.device("cpu")) for loc in locals_])


def _local(rank=0, width=4096, start=None, labels=None, **kw):
    base = dict(op="logprobs", flags=header.WANT_LOGPROBS | header.HAS_LABELS, rows=6, shape=(2, 3), width=width,
                tile=4096, temperature=1.0, dtype=torch.float32)
    base.update(kw)
    if start is not None:
        base["flags"] |= header.START_GIVEN
    loc = header.Local(start=rank * width if start is None else start, **base)
    loc.labels = torch.arange(6).view(2, 3) if labels is None else labels
    return loc


def test_the_header_gives_the_layout_when_the_ranks_agree():
    layout = header.check(_table(_local(0, 8192, 4096), _local(1, 4096, 0), _local(2, 4096, 12288)), _local())
    assert layout.order == (1, 0, 2) and layout.vocab == 16384 and layout.slots == (2, 1, 1) and layout.aligned


def test_the_layout_names_the_grid_tiles_each_shard_meets_and_those_it_shares():
    """Shards off the 4096-column grid: [0, 5000), [5000, 8000) (inside one tile), [8000, 16384)."""
    layout = header.check(_table(_local(0, 5000, 0), _local(1, 3000, 5000), _local(2, 8384, 8000)), _local())
    assert layout.slots == (2, 1, 3) and not layout.aligned
    assert [layout.shared(r) for r in range(3)] == [(False, True), (True, True), (True, False)]
    assert [layout.first_tile(r) for r in range(3)] == [0, 1, 1]


@pytest.mark.parametrize("ranks, message", [
    ([_local(0, 4096), _local(1, 2048)], r"shards have different widths \(rank 0: 4096, rank 1: 2048\) and "
                                         r"vocab_start was not given.*pass vocab_start="),
    ([_local(0, 4096, 0), _local(1, 4096, 8192)], r"rank 1: vocab_start=8192 is outside the vocabulary of 8192"),
    ([_local(0, 4096, 0), _local(1, 4096, 0)], r"do not tile \[0, 8192\): rank 1's shard starts at 0 and overlaps"),
    ([_local(0, 4096, 0), _local(1, 4096, 5000), _local(2, 4096, 8192)],
     r"rank 1's shard starts at 5000 and leaves columns \[4096, 5000\) to no rank"),
    ([_local(0, 4096, 0), _local(1, 4096)], r"vocab_start was given on ranks \[0\] but not on ranks \[1\]"),
    ([_local(0), _local(1, labels=torch.tensor([[0, 1, 2], [3, 5, 4]]))], r"labels differ .* ranks \[1\]"),
    ([_local(0), _local(1, temperature=0.5)], r"disagree with rank 0 on the temperature \(rank 0: 1.0, rank 1: 0.5\)"),
    ([_local(0), _local(1, rows=5, shape=(5,))], r"disagree with rank 0 on the number of rows"),
    ([_local(0), _local(1, shape=(3, 2))], r"disagree with rank 0 on the shape of the leading dims"),
    ([_local(0), _local(1, dtype=torch.bfloat16)], r"on the input dtype \(rank 0: float32, rank 1: bfloat16\)"),
])
def test_the_header_finds_what_the_ranks_disagree_on(ranks, message):
    with pytest.raises(header.GroupMismatchError, match=message):
        header.check(_table(*ranks), ranks[0])


def test_an_error_met_before_the_gather_reaches_every_rank_with_its_type():
    bad = _local(1)
    bad.error = TypeError("logits must be a floating-point tensor " + "x" * 600)
    table = _table(_local(0), bad)
    for me in (_local(0), bad):
        with pytest.raises(TypeError, match=r"^rank 1 of the process group: logits must be a floating") as info:
            header.check(table, me)
        assert len(str(info.value)) < 450  # the message travels in a fixed number of bytes
    with pytest.raises(TypeError) as info:
        header.check(table, bad)
    assert info.value.__cause__ is bad.error  # the rank that met it keeps its own traceback
    other = _local(0)
    other.error = KeyError("unexpected")  # not one of the carried types: a RuntimeError naming it
    with pytest.raises(RuntimeError, match=r"rank 0 of the process group: KeyError: 'unexpected'"):
        header.check(_table(other, _local(1)), other)


def test_another_protocol_version_is_named():
    table = _table(_local(0), _local(1))
    table[1, header.MAGIC_] += 1
    with pytest.raises(header.GroupMismatchError, match=r"ranks \[1\] run another version"):
        header.check(table, _local(0))


def test_label_checksums_see_one_change_and_a_swap_and_not_the_dtype():
    labels = torch.randint(0, 50000, (4, 7), generator=torch.Generator().manual_seed(3))
    base = header.checksums(labels)
    assert torch.equal(base, header.checksums(labels.int()))
    changed, swapped = labels.clone(), labels.clone()
    changed[2, 3] += 1
    swapped[0, 0], swapped[0, 1] = labels[0, 1], labels[0, 0]
    assert not torch.equal(base, header.checksums(changed)) and not torch.equal(base, header.checksums(swapped))


# ------------------------------------------------------------------------------ what is supported
_GROUP = object()  # validation only stores the group: these calls never reach a collective


def _call(op="logprobs", **kw):
    """The validated process_group= call of ``op`` on small shards (logits 2x3x8, hidden 2x3x4)."""
    if op == "logprobs_from_hidden":
        given = dict(hidden=torch.zeros(2, 3, 4), weight=torch.zeros(8, 4), labels=torch.zeros(2, 3, dtype=torch.long))
    else:
        given = dict(logits=torch.zeros(2, 3, 8), labels=torch.zeros(2, 3, dtype=torch.long))
    return validate(op, dict(given, process_group=_GROUP, **kw))


def test_an_option_the_distributed_path_lacks_is_refused_by_name():
    support.check(_call(temperature=0.5, softcap=30.0, top_k=3, top_p=0.9, min_p=0.1,
                        keep=torch.ones(2, 3, 8, dtype=torch.bool)))  # the sampler's keywords: fine
    support.check(_call(temperature=torch.full((2, 3), 0.5), top_k=3, sampler="hf"))  # per row, other orders: fine
    support.check(_call(top_p=0.9, sampler="sglang"))
    call = validate("kl_divergence", dict(student=torch.zeros(2, 8), teacher=torch.zeros(2, 8), process_group=_GROUP,
                                          support=torch.arange(3).expand(2, 3)))
    with pytest.raises(NotImplementedError, match=r"kl_divergence\(\.\.\., process_group=\.\.\.\) does not support "
                                                  r"support=.*gather both sides' shards to one rank"):
        support.check(call)


def test_double_backward_is_refused_with_a_remedy_that_works_with_a_group():
    from logprob_registry.distributed import sharded

    for fn, remedy in ((sharded._ShardedFunction.backward, "gather the logits to one rank and call without "
                        "process_group"),
                       (sharded._ShardedHiddenFunction.backward, "gather the weight shards and call without process_group")):
        with torch.enable_grad(), pytest.raises(RuntimeError, match=f"does not support double backward.*{remedy}"):
            fn(None, torch.ones(1))


def test_candidate_labels_pass_the_support_check():
    support.check(_call(labels=torch.zeros(2, 3, dtype=torch.long)))  # (...): fine
    support.check(_call(labels=torch.zeros(2, 3, 4, dtype=torch.long)))  # (..., K): fine too


def test_values_that_mean_keep_everything_are_the_default_with_a_group_too():
    """top_k 0 or -1, top_p 1, min_p 0 and logits_dtype float32 run without a group as if not given:
    with one, they must not be refused either; a bad value gets the error it gets without a group."""
    support.check(_call(top_k=0, top_p=1.0, min_p=0.0))
    support.check(_call(top_k=-1))
    support.check(_call("logprobs_from_hidden", logits_dtype=torch.float32))
    # more than the shard's 8 columns still truncates the whole vocabulary: kept as given, and supported
    assert _call(top_k=100).options["top_k"] == 100
    support.check(_call(top_k=100))
    support.check(_call("logprobs_from_hidden", logits_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="top_p"):
        _call(top_p=2.0)


def test_the_shard_ops_are_in_the_op_table_without_a_public_function():
    logprob_shards = ("shard_stats", "shard_grad", "hidden_shard_stats", "hidden_shard_grad", "shard_topk",
                      "hidden_shard_topk")
    assert set(SHARD_OPS) == set(logprob_shards) | {"kl_shard_stats", "kl_shard_grad", "shard_token_stats",
                                                    "hidden_shard_token_stats"}
    with pytest.raises(ValueError, match="has no public function: the distributed core calls it"):
        OPS["shard_stats"].public()
    for name in ("chunked", "compiled", "triton", "naive"):
        assert set(logprob_shards[:4]) <= set(lr.get_registry().get(name).ops), name
    for name in ("chunked", "naive"):  # the sampler's keywords (feature shard_sampler)
        backend = lr.get_registry().get(name)
        assert set(logprob_shards) <= set(backend.ops) and "shard_sampler" in backend.features, name
    for name in ("chunked", "naive"):  # kl_divergence(..., process_group=...)
        assert {"kl_shard_stats", "kl_shard_grad"} <= set(lr.get_registry().get(name).ops), name
    # token_stats(..., process_group=...)
    assert {"shard_token_stats", "hidden_shard_token_stats"} <= set(lr.get_registry().get("chunked").ops)
    invariant = {b.name for b in lr.backends() if b.group_invariant}
    assert {"chunked", "compiled", "triton"} <= invariant and "naive" not in invariant


# ------------------------------------------------------------------------------ the public API
def test_vocab_start_without_a_group_and_bad_groups_are_refused():
    x, y = _logits((2, 8)), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="vocab_start=8 was given without process_group"):
        lr.logprobs_from_logits(x, y, vocab_start=8)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        lr.entropy_from_logits(x, process_group="world")
    with pytest.raises(ValueError, match="is not a member of process_group"):
        lr.logprobs_and_entropy(x, y, process_group=dist.GroupMember.NON_GROUP_MEMBER)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_dtypes_shapes_and_layouts(world, dtype):
    x = _logits((3, 5, 1000), dtype)
    y = torch.randint(0, 1000, (3, 5), generator=torch.Generator().manual_seed(1)).int()
    lp, ent = lr.logprobs_and_entropy(x[:, :-1], y[:, :-1], process_group=world, temperature=1.3, backend="chunked")
    assert lp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want_lp, want_ent = ref.logprobs_and_entropy(x[:, :-1], y[:, :-1], temperature=1.3)
    assert (lp.double() - want_lp).abs().max() <= tolerance(x, 1.3)
    assert (ent.double() - want_ent).abs().max() <= tolerance(x, 1.3, output="entropy")
    one = lr.logprobs_from_logits(x[0, 0], y[0, 0], process_group=world, backend="chunked")  # 1-D, 0-d label
    assert one.shape == () and abs(float(one) - float(ref.logprobs(x[0, 0], y[0, 0]))) <= tolerance(x)
    empty = lr.logprobs_and_entropy(x[:0], y[:0], process_group=world, backend="chunked")
    assert [t.shape for t in empty] == [(0, 5), (0, 5)]


def test_gradients_of_one_output_and_of_the_weight_alone(world):
    x = _logits((4, 3000)).requires_grad_(True)
    y = torch.tensor([0, 5, -100, 2999])
    lp, ent = lr.logprobs_and_entropy(x, y, ignore_index=-100, process_group=world, backend="chunked")
    lp.sum().backward()  # the entropy gets no gradient
    x64 = x.detach().double().requires_grad_(True)
    ref.logprobs(x64, y, ignore_index=-100).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-6)
    assert (x.grad[2] == 0).all()
    h, w = _logits((4, 16), scale=1.0), _logits((3000, 16), seed=2, scale=0.3).requires_grad_(True)
    lr.logprobs_from_hidden(h, w, y.clamp(min=0), process_group=world, backend="chunked").sum().backward()
    w64 = w.detach().double().requires_grad_(True)
    ref.logprobs_from_hidden(h.double(), w64, y.clamp(min=0)).sum().backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_the_collectives_move_a_few_numbers_per_row_and_tile(world):
    traffic(reset=True)
    lr.logprobs_and_entropy(_logits((4, 3 * 4096)), torch.zeros(4, dtype=torch.long), process_group=world,
                            backend="chunked")
    assert traffic() == 0  # a group of one receives nothing from others
    assert header.LENGTH * 8 <= 600


class _Spy:
    """A plugin backend implementing only the shard ops, by delegating to naive's: a third-party
    backend gains the process_group= path this way. ``fail`` makes shard_stats raise."""

    def __init__(self, name, priority, fail=False):
        naive = lr.get_registry().get("naive").ops
        self.calls = []
        self.name = name

        def stats(*args, **kw):
            self.calls.append("shard_stats")
            if fail:
                raise RuntimeError("spy kernel crashed")
            return naive["shard_stats"](*args, **kw)

        def grad(*args, **kw):
            self.calls.append("shard_grad")
            return naive["shard_grad"](*args, **kw)

        self.backend = lr.Backend(name=name, ops={"shard_stats": stats, "shard_grad": grad}, priority=priority)

    @lr.hookimpl
    def register_backends(self, register):
        register(self.backend)


@pytest.fixture
def spies():
    reg = lr.get_registry()
    added = []

    def add(name, priority, fail=False):
        spy = _Spy(name, priority, fail)
        reg.add_plugin(spy, name=f"{name}-plugin")
        added.append(f"{name}-plugin")
        return spy

    yield add
    for name in added:
        reg.remove_plugin(name)
    reg.reset()


def test_shard_ops_are_selected_through_the_registry(world, spies):
    spy = spies("spy-shards", priority=60)
    x, y = _logits((2, 5000)).requires_grad_(True), torch.tensor([3, 4999])
    assert lr.select("shard_stats", device="cpu").name == "spy-shards"
    lr.logprobs_from_logits(x, y, process_group=world).sum().backward()
    assert spy.calls == ["shard_stats", "shard_grad"]
    with lr.use_backend("chunked"):  # an explicit choice holds for the backward too
        lr.logprobs_from_logits(x, y, process_group=world).sum().backward()
    assert spy.calls == ["shard_stats", "shard_grad"]
    with pytest.raises(lr.NoEligibleBackendError, match="rank 0 of the process group: backend 'spy-shards'"):
        lr.logprobs_from_hidden(x[:, :8].detach(), x[:, :8].detach(), y, process_group=world, backend="spy-shards")


def test_a_failing_shard_backend_falls_back_with_a_warning(world, spies):
    spies("spy-crashing", priority=70, fail=True)
    working = spies("spy-working", priority=65)
    x, y = _logits((2, 5000)), torch.tensor([3, 4999])
    with pytest.warns(lr.BackendFallbackWarning, match="'spy-crashing' failed for shard_stats"):
        lp = lr.logprobs_from_logits(x, y, process_group=world)
    assert working.calls == ["shard_stats"]
    assert (lp.double() - ref.logprobs(x, y)).abs().max() <= tolerance(x)


def test_a_backend_returning_the_wrong_shapes_is_named(world, spies):
    spy = spies("spy-wrong", priority=80)
    lr.get_registry().get(spy.name).ops["shard_stats"] = lambda logits, labels, **kw: (logits[..., :1],) * 4
    with pytest.raises(RuntimeError, match=r"backend 'spy-wrong': shard_stats returned tile_max of shape \(2, 1\), "
                                           r"expected 2 rows x 2"):
        lr.logprobs_from_logits(_logits((2, 5000)), torch.tensor([3, 4]), process_group=world, backend="spy-wrong")


# ------------------------------------------------------------------------------ spawned groups
def _sleep_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(3600)
    return "done"


def test_a_hang_fails_within_the_deadline_and_its_processes_are_killed():
    start = time.monotonic()
    with pytest.raises(launch.GroupTimeout, match="on a group of 2 did not finish in 8 s"):
        launch.run(2, _sleep_on_rank_1, timeout=8, collective_timeout=5)
    assert time.monotonic() - start < 60


class _FlakyBackward:
    """hidden_shard_stats from chunked; hidden_shard_grad that fails on rank 1."""

    @lr.hookimpl
    def register_backends(self, register):
        chunked = lr.get_registry().get("chunked").ops

        def grad(*args, **kw):
            if dist.get_rank() == 1:
                raise RuntimeError("out of registers on rank 1")
            return chunked["hidden_shard_grad"](*args, **kw)

        register(lr.Backend(name="flaky", priority=90, ops={"hidden_shard_stats": chunked["hidden_shard_stats"],
                                                             "hidden_shard_grad": grad}))


def _two_ranks(rank, world):
    """A subgroup, the default group, and a backward failing on rank 1: results per check."""
    out = {}
    solo = [dist.new_group([0]), dist.new_group([1])]
    x = _logits((3, 8192))
    y = torch.tensor([1, 4097, 8191])
    mine = x[:, rank * 4096:(rank + 1) * 4096]
    kw = dict(temperature=0.9, backend="chunked")
    out["default"] = lr.logprobs_and_entropy(mine, y, process_group=dist.group.WORLD, **kw)
    out["alone"] = lr.logprobs_and_entropy(x, y, process_group=solo[rank], **kw)
    lr.get_registry().add_plugin(_FlakyBackward(), name="flaky-plugin")
    h = _logits((3, 16), scale=1.0).requires_grad_(True)
    w = _logits((8192, 16), seed=2, scale=0.3)[rank * 4096:(rank + 1) * 4096].requires_grad_(True)
    try:
        lr.logprobs_from_hidden(h, w, y, process_group=dist.group.WORLD, backend="flaky").sum().backward()
        out["backward"] = ("", "no error")
    except Exception as exc:
        out["backward"] = (type(exc).__name__, str(exc), repr(exc.__cause__))
    out["after"] = lr.logprobs_from_logits(mine, y, process_group=dist.group.WORLD, backend="chunked")  # in step
    # after backward nothing but the graph's saved tensors held the shard: a non-leaf shard is freed
    import gc
    import weakref

    base = mine.clone().requires_grad_(True)
    shard = base * 1.0
    kept = weakref.ref(shard)
    lp = lr.logprobs_from_logits(shard, y, process_group=dist.group.WORLD, backend="chunked")
    lp.sum().backward()
    del shard
    gc.collect()
    out["freed"] = kept() is None and lp.grad_fn is not None
    return out


def test_subgroups_and_a_backward_failing_on_one_rank():
    ranks = [r.unwrap() for r in launch.run(2, _two_ranks, timeout=300)]
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["default"], ranks[0]["default"]))
        assert all(torch.equal(a, b) for a, b in zip(r["alone"], ranks[0]["default"]))  # group size: same bits
        assert r["backward"][0] == "BackwardFailedError"
        assert "failed on 1 rank(s) of the group" in r["backward"][1]
        assert torch.equal(r["after"], ranks[0]["after"])
        assert r["freed"]  # the autograd context keeps no reference to the shard besides its saved tensors
    assert "out of registers on rank 1" in ranks[1]["backward"][2] and ranks[0]["backward"][2] == "None"


def test_bench_process_group_runs_beside_gathering_the_logits(capsys):
    from logprob_registry.cli import main

    argv = ["bench", "--process-group", "2", "--shape", "1,64,8192", "--repeat", "1", "--warmup", "0", "--backward",
            "--op", "logprobs_and_entropy", "--backend", "chunked"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bench --process-group 2: logprobs_and_entropy, float32 logits (1, 64, 8192)")
    ours = next(line for line in lines if line.startswith("process_group"))
    theirs = next(line for line in lines if line.startswith("gather to rank 0"))
    assert int(ours.split()[-1].replace(",", "")) < int(theirs.split()[-1].replace(",", "")) / 100
    header = next(line for line in lines if line.startswith("method"))
    assert header.split()[1:5] == ["time", "(ms)", "CPU", "(ms)"]
    assert float(ours.split()[1]) > 0 and float(ours.split()[2]) > 0  # wall and the busiest rank's CPU time
    assert lines[-1].startswith("largest difference between the two (from the unsharded call): ")


def test_bench_process_group_refuses_what_it_cannot_split(capsys):
    from logprob_registry.cli import main

    assert main(["bench", "--process-group", "3", "--shape", "1,4,1000"]) == 2
    assert "V=1000 does not split evenly over 3 processes" in capsys.readouterr().err


def test_check_runs_the_distributed_section():
    """``logprob-registry check`` runs the shipped suite (``testing/selected.py``), which inherits the
    distributed section: collected as check collects it (tests/test_conformance.py runs it)."""
    from logprob_registry.testing import suite_path

    cmd = [sys.executable, "-m", "pytest", suite_path(), "--collect-only", "-q", "-p", "no:cacheprovider",
           "-p", "logprob_registry_pytest", "--logprob-backend", "chunked", "-k", "distributed"]
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir(), env=env)
    names = sorted(line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line)
    assert names == ["test_distributed_bad_input_raises_on_every_rank", "test_distributed_bitwise_across_group_sizes",
                     "test_distributed_gradients", "test_distributed_kl_bitwise_across_group_sizes",
                     "test_distributed_kl_gradients", "test_distributed_kl_results_on_every_rank",
                     "test_distributed_results_on_every_rank", "test_distributed_sampler"], proc.stdout + proc.stderr


def test_the_triton_tile_kernel_compiles_for_gpus():
    """What the interpreter cannot catch (types, constexpr branches, lowering): compiled, not run,
    for an H100/H200 (sm_90) and an MI300 (gfx942)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it on Linux)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_TILE_KERNEL], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "compiled 8 tile kernels" in proc.stdout


COMPILE_TILE_KERNEL = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logprob_registry.kernels.triton import _shards
fn, count = _shards._tile_stats_kernel, 0
for x, acc, flags in (("bf16", "fp32", (True, True, True)), ("fp32", "fp32", (False, False, False)),
                      ("fp16", "fp32", (True, False, True)), ("fp64", "fp64", (True, True, True))):
    consts = dict(TILE=4096, ACC=tl.float64 if acc == "fp64" else tl.float32, LABELS=flags[0], IGNORE=flags[1],
                  ENTROPY=flags[2], REF=flags[0])
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + acc for n in ("m_ptr", "pick_ptr", "ref_ptr")})
    sig.update({n: "*fp64" for n in ("s_ptr", "t_ptr")})
    sig.update(x_ptr="*" + x, lab_ptr="*i64", t_hi="fp32", t_lo="fp32", xs0="i64", xs1="i64", xs2="i64",
               vocab_start="i64", offset="i64", ignore_index="i64")
    sig.update({n: "constexpr" for n in consts})
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        compiled = triton.compile(ASTSource(fn, sig, consts), target=target,
                                  options={"num_warps": _shards._num_warps(None)})
        assert compiled.asm.get("cubin") or compiled.asm.get("hsaco")
        count += 1
print(f"compiled {count} tile kernels")
"""


def test_calls_inside_torch_func_transforms_are_refused(world):
    x, y = _logits((2, 300)), torch.tensor([1, 2])
    with pytest.raises(NotImplementedError, match="not supported inside torch.func transforms"):
        torch.func.grad(lambda t: lr.logprobs_from_logits(t, y, process_group=world, backend="chunked").sum())(x)
