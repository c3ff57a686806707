"""``lr.next_token_labels``: the labels of a next-token objective for batches, packed streams and
context-parallel layouts (docs/layouts.md).

In this process: batches and packed streams (cu_seqlens and position_ids give the same labels),
log-probabilities through the labels against the per-sequence float64 shift, every bad input.
Over spawned gloo groups of 1, 2 and 4 (one group per size, every check inside it): each rank's
labels equal the single-process labels at its positions, for the contiguous and the zigzag layout,
and its log-probabilities gathered back in order equal the single-process ones bitwise; a bad input
on one rank raises the same error on every rank, and a 2 x 2 group of context and vocabulary
parallel together.
"""

from __future__ import annotations

import pytest
import torch

import logprob_registry as lr
from logprob_registry.distributed import launch
from logprob_registry.distributed.header import GroupMismatchError
from logprob_registry.numerics import assert_close, tolerance

V = 257
LENGTHS = [1, 2, 7, 300, 33]
IGNORE = -100
OFFSETS = (2, 3)  # besides 1, the labels of multi-token-prediction depths
BACKEND = "chunked"  # automatic choice may be `compiled`, which compiles per shape: slow on two cores


def _cu(lengths):
    return torch.tensor([0] + lengths).cumsum(0)


def _positions_of(lengths):
    return torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)


def _stream(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, V, (total,), generator=g)
    logits = torch.randn(total, V, generator=g, dtype=torch.float64).mul(4).float()
    return ids, logits


def _expected(ids, lengths, offset=1):
    """The shift written by hand, sequence by sequence."""
    out, start = [], 0
    for n in lengths:
        seq = ids[start:start + n]
        out.append(torch.cat([seq[offset:], torch.full((min(offset, n),), IGNORE)]) if n else seq.new_zeros(0))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_offset_scores_the_token_k_ahead_within_each_sequence(offset):
    ids, _ = _stream(LENGTHS)
    want = _expected(ids, LENGTHS, offset)
    assert torch.equal(lr.next_token_labels(ids, cu_seqlens=_cu(LENGTHS), offset=offset), want)
    assert torch.equal(lr.next_token_labels(ids, position_ids=_positions_of(LENGTHS), offset=offset), want)
    batch = ids[:40].view(4, 10)
    rows = torch.stack([_expected(row, [10], offset) for row in batch])
    assert torch.equal(lr.next_token_labels(batch, offset=offset), rows)


@pytest.mark.parametrize("offset, kind, message", [(0, ValueError, "offset must be >= 1"),
                                                   (-2, ValueError, "offset must be >= 1"),
                                                   (1.0, TypeError, "offset must be an int"),
                                                   (True, TypeError, "offset must be an int")])
def test_a_bad_offset_names_it(offset, kind, message):
    with pytest.raises(kind, match=message):
        lr.next_token_labels(torch.arange(6), offset=offset)


# ------------------------------------------------------------------------------ one process
def test_packed_stream_cu_seqlens_and_position_ids_give_the_same_labels():
    ids, logits = _stream(LENGTHS)
    by_cu = lr.next_token_labels(ids, cu_seqlens=_cu(LENGTHS))
    by_pos = lr.next_token_labels(ids, position_ids=_positions_of(LENGTHS))
    assert by_cu.dtype == torch.int64 and by_cu.shape == ids.shape
    assert torch.equal(by_cu, by_pos) and torch.equal(by_cu, _expected(ids, LENGTHS))
    assert (by_cu[_cu(LENGTHS)[1:] - 1] == IGNORE).all()  # each sequence's last position
    as_row = lr.next_token_labels(ids[None], cu_seqlens=_cu(LENGTHS).tolist())  # (1, T), a list
    assert torch.equal(as_row, by_cu[None])
    assert torch.equal(lr.next_token_labels(ids[None], position_ids=_positions_of(LENGTHS)[None]), by_cu[None])
    # empty sequences (a padded varlen batch) change nothing
    padded = [0, 1, 2, 0, 0, 7, 300, 33, 0]
    assert torch.equal(lr.next_token_labels(ids, cu_seqlens=_cu(padded)), by_cu)
    # int32 ids on input, int64 labels out; another ignore_index
    other = lr.next_token_labels(ids.int(), cu_seqlens=_cu(LENGTHS).int(), ignore_index=-1)
    assert other.dtype == torch.int64 and torch.equal(other, by_cu.masked_fill(by_cu == IGNORE, -1))


def test_logprobs_through_the_labels_equal_the_per_sequence_shift_in_float64():
    ids, logits = _stream(LENGTHS)
    labels = lr.next_token_labels(ids, cu_seqlens=_cu(LENGTHS))
    got = lr.logprobs_from_logits(logits, labels, ignore_index=IGNORE, backend=BACKEND)
    tol = tolerance(logits)
    start = 0
    for n in LENGTHS:
        seq_logits, seq_ids = logits[start:start + n].double(), ids[start:start + n]
        want = seq_logits[:-1].log_softmax(-1).gather(-1, seq_ids[1:, None]).squeeze(-1)
        assert_close(got[start:start + n - 1], want, tol, f"sequence of {n}")
        assert got[start + n - 1] == 0  # the last position: ignored, 0
        start += n


def test_batch_rows_and_position_ids_per_row():
    ids = torch.arange(10).view(2, 5) + 100
    assert torch.equal(lr.next_token_labels(ids), torch.tensor([[101, 102, 103, 104, IGNORE],
                                                                [106, 107, 108, 109, IGNORE]]))
    pos = torch.tensor([[0, 1, 0, 1, 2], [5, 6, 7, 0, 1]])
    assert torch.equal(lr.next_token_labels(ids, position_ids=pos),
                       torch.tensor([[101, IGNORE, 103, 104, IGNORE], [106, 107, IGNORE, 109, IGNORE]]))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, V, generator=g)
    got = lr.logprobs_from_logits(logits, lr.next_token_labels(ids % V), ignore_index=IGNORE, backend=BACKEND)
    want = logits[:, :-1].double().log_softmax(-1).gather(-1, (ids % V)[:, 1:, None]).squeeze(-1)
    assert_close(got[:, :-1], want, tolerance(logits), "batch")
    assert (got[:, -1] == 0).all()
    assert lr.next_token_labels(torch.zeros(0, dtype=torch.int64), cu_seqlens=[0]).shape == (0,)


@pytest.mark.parametrize("kwargs, kind, message", [
    (dict(cu_seqlens=[1, 3, 10]), ValueError, r"cu_seqlens must start at 0, got 1"),
    (dict(cu_seqlens=[0, 5, 3, 10]), ValueError, r"non-decreasing, but cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5"),
    (dict(cu_seqlens=[0, 3, 9]), ValueError, r"cu_seqlens must end at the length of the stream \(10 tokens\), got 9"),
    (dict(cu_seqlens=[0, 3, 10], position_ids=torch.zeros(10, dtype=torch.int64)), ValueError,
     r"give cu_seqlens or position_ids, not both"),
    (dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, r"cu_seqlens must be an integer tensor, got dtype torch.float32"),
    (dict(cu_seqlens=torch.tensor([[0, 10]])), ValueError, r"cu_seqlens must be 1-D \(S \+ 1,\), got shape \(1, 2\)"),
    (dict(position_ids=torch.zeros(9, dtype=torch.int64)), ValueError,
     r"position_ids must have the shape \(10,\) or \(1, 10\) of the stream \(10 tokens\), got \(9,\)"),
    (dict(cp_layout="ring"), ValueError, r"cp_layout must be one of 'contiguous', 'zigzag', got 'ring'"),
    (dict(ignore_index=1.5), TypeError, r"ignore_index must be an int, got float"),
])
def test_bad_input_names_what_is_wrong(kwargs, kind, message):
    with pytest.raises(kind, match=message):
        lr.next_token_labels(torch.arange(10), **kwargs)


def test_bad_input_ids():
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor \(token ids\), got dtype torch.float32"):
        lr.next_token_labels(torch.zeros(4))
    with pytest.raises(ValueError, match=r"input_ids must be \(T,\) \(a packed stream\), \(1, T\) or \(B, T\), got shape \(1, 2, 3\)"):
        lr.next_token_labels(torch.zeros(1, 2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens cuts a packed stream, \(T,\) or \(1, T\); input_ids has shape \(2, 5\)"):
        lr.next_token_labels(torch.zeros(2, 5, dtype=torch.int64), cu_seqlens=[0, 10])
    with pytest.raises(TypeError, match="cp_group must be|process_group must be"):
        lr.next_token_labels(torch.arange(4), cp_group="world")


# ------------------------------------------------------------------------------ context parallel
PACKED = [1, 2, 7, 300, 33, 1]      # 344 tokens: contiguous over 1, 2, 4 ranks
ZIGZAG = [8, 16, 304, 40, 0, 8]     # each a multiple of 2 * 4: zigzag over 1, 2, 4 ranks (one empty)


def _zigzag_index(lengths, cp, rank):
    """Global positions rank ``rank`` holds in the zigzag layout, built chunk by chunk."""
    parts, start = [], 0
    for n in lengths:
        c = n // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + k * c, start + (k + 1) * c))
        start += n
    return torch.cat(parts)


def _index(layout, lengths, cp, rank):
    total = sum(lengths)
    if layout == "contiguous":
        return torch.arange(rank * total // cp, (rank + 1) * total // cp)
    return _zigzag_index(lengths, cp, rank)


def _cases():
    """(name, layout, lengths, how): packed streams by cu_seqlens and by position_ids, a (B, T) batch."""
    out = []
    for layout, lengths in (("contiguous", PACKED), ("zigzag", ZIGZAG)):
        out += [(f"{layout}-cu", layout, lengths, "cu"), (f"{layout}-pos", layout, lengths, "pos")]
    out += [("contiguous-batch", "contiguous", [16, 16, 16], "batch"), ("zigzag-batch", "zigzag", [16, 16, 16], "batch")]
    return out


def _rank_side(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    for name, layout, lengths, how in _cases():
        ids, logits = _stream(lengths, seed=len(name))
        if how == "batch":
            ids, logits = ids.view(len(lengths), -1), logits.view(len(lengths), -1, V)
            index = _index(layout, [ids.shape[1]], world, rank)
            mine_ids, mine_logits, kw = ids[:, index], logits[:, index], {}
        else:
            index = _index(layout, lengths, world, rank)
            mine_ids, mine_logits = ids[index], logits[index]
            kw = dict(cu_seqlens=_cu(lengths)) if how == "cu" else dict(position_ids=_positions_of(lengths))
        lr.layouts.exchanged(reset=True)
        labels = lr.next_token_labels(mine_ids, cp_group=group, cp_layout=layout, **kw)
        out[name] = (labels, lr.logprobs_from_logits(mine_logits, labels, ignore_index=IGNORE, backend=BACKEND),
                     lr.layouts.exchanged())
        for offset in OFFSETS:  # a multi-token-prediction head's labels
            out[name, offset] = lr.next_token_labels(mine_ids, cp_group=group, cp_layout=layout, offset=offset, **kw)
    # bad input: on one rank only (the others valid), and on every rank; then a good call, in step
    ids = torch.arange(12 * world)[rank * 12:(rank + 1) * 12]
    errors = {}
    calls = {
        "one-rank": lambda: lr.next_token_labels(ids, cu_seqlens=[0, 5, 12 * world - (rank == world - 1)],
                                                 cp_group=group),
        "zigzag": lambda: lr.next_token_labels(ids, cu_seqlens=[0, 5, 12 * world], cp_group=group, cp_layout="zigzag"),
        "both": lambda: lr.next_token_labels(ids, cu_seqlens=[0, 12 * world], position_ids=torch.zeros(12 * world),
                                             cp_group=group),
        "local-length": lambda: lr.next_token_labels(ids, position_ids=torch.arange(12), cp_group=group),
        "disagree": lambda: lr.next_token_labels(ids, cu_seqlens=[0, 3 + rank, 12 * world], cp_group=group),
        "not-int": lambda: lr.next_token_labels(ids.float() if rank == 0 else ids, cp_group=group),
    }
    for key, call in calls.items():
        try:
            call()
            errors[key] = None
        except Exception as exc:
            errors[key] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    out["after"] = lr.next_token_labels(ids, cp_group=group)
    if world == 4:  # 2 context-parallel ranks x 2 vocabulary shards: cp groups {0, 1}, {2, 3}; tp {0, 2}, {1, 3}
        cps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        cp_rank, tp_rank = rank % 2, rank // 2
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 8192, (344,), generator=g)
        logits = torch.randn(344, 8192, generator=g)
        index = _index("contiguous", PACKED, 2, cp_rank)
        labels = lr.next_token_labels(ids[index], cu_seqlens=_cu(PACKED), cp_group=cps[rank // 2])
        shard = logits[index, tp_rank * 4096:(tp_rank + 1) * 4096]
        out["cp-x-tp"] = lr.logprobs_from_logits(shard, labels, ignore_index=IGNORE, process_group=tps[cp_rank],
                                                  backend=BACKEND)
    return out


@pytest.fixture(scope="module")
def groups():
    return {world: [r.unwrap() for r in launch.run(world, _rank_side, timeout=240)] for world in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_gets_the_single_process_labels_and_bitwise_logprobs(groups, world):
    for name, layout, lengths, how in _cases():
        ids, logits = _stream(lengths, seed=len(name))
        if how == "batch":
            ids, logits = ids.view(len(lengths), -1), logits.view(len(lengths), -1, V)
            labels = lr.next_token_labels(ids)
            index = [_index(layout, [ids.shape[1]], world, r) for r in range(world)]
            got = torch.empty_like(labels)
            got_logprobs = torch.empty(labels.shape)
            for r in range(world):
                assert torch.equal(groups[world][r][name][0], labels[:, index[r]]), (name, r)
                got[:, index[r]], got_logprobs[:, index[r]] = groups[world][r][name][:2]
        else:
            labels = lr.next_token_labels(ids, cu_seqlens=_cu(lengths))
            index = [_index(layout, lengths, world, r) for r in range(world)]
            got = torch.empty_like(labels)
            got_logprobs = torch.empty(labels.shape)
            for r in range(world):
                assert torch.equal(groups[world][r][name][0], labels[index[r]]), (name, r)
                got[index[r]], got_logprobs[index[r]] = groups[world][r][name][:2]
        assert torch.equal(got, labels)
        for offset in OFFSETS:
            kw = {} if how == "batch" else dict(cu_seqlens=_cu(lengths))
            whole = lr.next_token_labels(ids, offset=offset, **kw)
            for r in range(world):
                mine = whole[:, index[r]] if how == "batch" else whole[index[r]]
                assert torch.equal(groups[world][r][name, offset], mine), (name, offset, r)
        want = lr.logprobs_from_logits(logits, labels, ignore_index=IGNORE, backend=BACKEND)
        assert torch.equal(got_logprobs, want), name  # bitwise, gathered back in order
        rows = ids.shape[0] if how == "batch" else 1
        pieces = (world - 1) if layout == "contiguous" else 2 * (world - 1) * sum(1 for n in lengths if n)
        if how == "batch":
            pieces = (world - 1) if layout == "contiguous" else 2 * (world - 1)
        # the exchange: one int64 per chunk boundary (and row), nothing else
        assert sum(groups[world][r][name][2] for r in range(world)) == 8 * rows * pieces, name


def test_bad_input_raises_the_same_error_on_every_rank(groups):
    for world in (1, 2, 4):
        ranks = groups[world]
        for key in ranks[0]["errors"]:
            assert all(r["errors"][key] == ranks[0]["errors"][key] for r in ranks), (world, key)
        errors = ranks[0]["errors"]
        total = 12 * world
        assert errors["one-rank"] == (
            "ValueError", f"rank {world - 1} of cp_group: cu_seqlens must end at the length of the global stream "
                          f"({world} ranks x 12 tokens on this rank = {total}), got {total - 1}")
        assert errors["zigzag"] == (
            "ValueError", f"rank 0 of cp_group: the zigzag layout cuts each sequence into 2 * cp = {2 * world} equal "
                          f"chunks, but sequence 0 has 5 tokens, not a multiple of {2 * world}; pad each sequence to a "
                          f"multiple of {2 * world} (as TransformerEngine's THD layout requires), or use "
                          "cp_layout='contiguous'")
        assert errors["both"] == ("ValueError", "rank 0 of cp_group: give cu_seqlens or position_ids, not both: each "
                                                "alone says where the sequences start")
        assert errors["not-int"] == ("TypeError", "rank 0 of cp_group: input_ids must be an integer tensor (token "
                                                  "ids), got dtype torch.float32")
        if world > 1:
            assert errors["local-length"][0] == "ValueError"
            assert "position_ids describe the global stream (the same on every rank), of length" in \
                errors["local-length"][1]
            assert errors["disagree"][0] == GroupMismatchError.__name__
            assert "pass other cu_seqlens than rank 0" in errors["disagree"][1]
        else:
            assert errors["local-length"] is None and errors["disagree"] is None
        for r in range(world):  # the group is still in step
            assert torch.equal(ranks[r]["after"], lr.next_token_labels(torch.arange(total))[r * 12:(r + 1) * 12])


def test_context_and_vocabulary_parallel_together(groups):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 8192, (344,), generator=g)
    logits = torch.randn(344, 8192, generator=g)
    labels = lr.next_token_labels(ids, cu_seqlens=_cu(PACKED))
    want = lr.logprobs_from_logits(logits, labels, ignore_index=IGNORE, backend=BACKEND)
    ranks = groups[4]
    got = torch.cat([ranks[0]["cp-x-tp"], ranks[1]["cp-x-tp"]])
    assert torch.equal(ranks[2]["cp-x-tp"], ranks[0]["cp-x-tp"]) and torch.equal(ranks[3]["cp-x-tp"], ranks[1]["cp-x-tp"])
    assert_close(got, want.double(), tolerance(logits), "cp x tp")
