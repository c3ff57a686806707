"""Group invariance on any vocabulary (docs/distributed.md#invariance-the-same-bits-on-any-split): with process_group=,
results and the gradients of what is sharded are the same bits for every group size and every split
of the vocabulary into contiguous shards of any widths, on the vocabularies people train (Qwen's
151936, Qwen3.5's 248320, Llama 3's 128256), whose shards are not multiples of 128, let alone of
the 4096-column tile.

One spawned gloo group of four runs every case (:func:`_program`) in groups of 1, 2 (ranks in
reverse order), 3 and 4 ranks with uneven widths, and a DTensor ``Shard(-1)`` of a 1-D mesh of
three ranks, and the group of four on one row alone (batch invariance); the tests below compare
the bits with the group of one (each rank alone, the same process_group= path).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from logprob_registry.distributed import launch

B = "chunked"  # no compilation in the spawned processes
VOCABS = (151936, 248320, 128256)
ROWS, HIDDEN = (2, 4), 16
GROUPS = {1: ((0,), (1,), (2,), (3,)), 2: ((1, 0), (3, 2)), 3: ((0, 1, 2),), 4: ((0, 1, 2, 3),)}
#: name -> (op, dtype, options)
CASES = {
    "logits-fp32": ("logprobs_and_entropy", "float32", {}),
    "logits-bf16-temperature": ("logprobs_and_entropy", "bfloat16", {"temperature": 0.7}),
    "logits-top_k-top_p": ("logprobs_and_entropy", "float32", {"top_k": 50, "top_p": 0.9}),
    "logits-bf16-top_k-temperature": ("logprobs", "bfloat16", {"top_k": 20, "temperature": 0.8}),
    "hidden-fp32-bias": ("logprobs_from_hidden", "float32", {"bias": True}),
    "hidden-bf16-temperature-entropy": ("logprobs_from_hidden", "bfloat16", {"temperature": 0.7,
                                                                             "return_entropy": True}),
    "hidden-fp32-top_p": ("logprobs_from_hidden", "float32", {"top_p": 0.8}),
    "topk": ("topk_logprobs", "float32", {"k": 5}),
    "kl-forward": ("kl_divergence", "float32", {"direction": "forward"}),
    "kl-reverse-bf16-temperature": ("kl_divergence", "bfloat16", {"direction": "reverse", "temperature": 0.9}),
    "kl-hidden-forward": ("kl_divergence", "float32", {"direction": "forward", "hidden": True}),
    # token_stats: all eight fields (the four differentiable ones in the loss)
    "stats-fp32": ("token_stats", "float32", {}),
    "stats-bf16-top_k-top_p-temperature": ("token_stats", "bfloat16", {"top_k": 40, "top_p": 0.9, "temperature": 0.7}),
    "stats-hidden-fp32-bias": ("token_stats", "float32", {"hidden": True, "bias": True}),
    "stats-hidden-bf16-min_p": ("token_stats", "bfloat16", {"hidden": True, "min_p": 0.05}),
}
BATCH_CASES = ("logits-top_k-top_p", "hidden-fp32-bias", "kl-reverse-bf16-temperature",
               "stats-bf16-top_k-top_p-temperature")
DTENSOR_CASES = ("logits-fp32", "logits-bf16-temperature", "logits-top_k-top_p", "stats-fp32")


def widths(vocab: int, parts: int) -> tuple:
    """Uneven widths of ``parts`` shards, none a multiple of 128 (so every edge is off the tile grid)."""
    if parts == 1:
        return (vocab,)
    g = torch.Generator().manual_seed(vocab * 10 + parts)
    while True:
        cuts = sorted(torch.randperm(vocab - 1, generator=g)[:parts - 1].add(1).tolist())
        out = tuple(b - a for a, b in zip([0] + cuts, cuts + [vocab]))
        if all(w % 128 and w > 1 for w in out):
            return out


def _data(vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = dict(logits=(torch.randn(*ROWS, vocab, generator=g) * 3).to(dtype),
                teacher=(torch.randn(*ROWS, vocab, generator=g) * 3).to(dtype),
                teacher_weight=(torch.randn(vocab, HIDDEN + 8, generator=g) * 0.5).to(dtype),
                teacher_hidden=torch.randn(*ROWS, HIDDEN + 8, generator=g).to(dtype),
                labels=torch.randint(0, vocab, ROWS, generator=g),
                hidden=torch.randn(*ROWS, HIDDEN, generator=g).to(dtype),
                weight=(torch.randn(vocab, HIDDEN, generator=g) * 0.5).to(dtype),
                bias=torch.randn(vocab, generator=g).to(dtype),
                upstream=torch.rand(*ROWS, 8, generator=g))
    # two labels at their row's argmax (token_stats' is_argmax then has something to find)
    out["labels"][0, 0] = out["logits"][0, 0].float().argmax()
    out["labels"][1, 1] = (out["hidden"][1, 1].float() @ out["weight"].float().T + out["bias"].float()).argmax()
    return out


def _call(name: str, vocab: int, start: int, width: int, group, dtensor_mesh=None, first=None):
    """The case on this rank's shard ``[start, start + width)``: (outputs, gradient of the shard,
    gradient of the hidden states or None); ``first``: on the first ``first`` rows (of dim 0) only."""
    import logprob_registry as lr

    op, dtype, options = CASES[name]
    data = _data(vocab, getattr(torch, dtype), int(hashlib.sha1(name.encode()).hexdigest()[:6], 16) + vocab)
    if first is not None:
        data = {k: v if k in ("weight", "teacher_weight", "bias") else v[:first] for k, v in data.items()}
    options = dict(options)
    cols = slice(start, start + width)
    kw = dict(backend=B, process_group=group, vocab_start=start)
    if dtensor_mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor
        kw = dict(backend=B)
        shard = distribute_tensor(data["logits"], dtensor_mesh, [Shard(-1)]).detach().requires_grad_(True)
    else:
        shard = data["logits"][..., cols].clone().requires_grad_(True)
    up = data["upstream"]
    hidden = None
    if op == "logprobs_from_hidden":
        hidden = data["hidden"].clone().requires_grad_(True)
        shard = data["weight"][cols].clone().requires_grad_(True)
        bias = data["bias"][cols] if options.pop("bias", False) else None
        outs = lr.logprobs_from_hidden(hidden, shard, data["labels"], bias=bias, **options, **kw)
    elif op == "token_stats":
        fields = lr.TokenStats._fields
        if options.pop("hidden", False):
            hidden = data["hidden"].clone().requires_grad_(True)
            shard = data["weight"][cols].clone().requires_grad_(True)
            bias = data["bias"][cols] if options.pop("bias", False) else None
            outs = tuple(lr.token_stats(hidden, data["labels"], weight=shard, bias=bias, outputs=fields, **options,
                                        **kw))
        else:
            outs = tuple(lr.token_stats(shard, data["labels"], outputs=fields, **options, **kw))
    elif op == "topk_logprobs":
        outs = lr.topk_logprobs(shard, options.pop("k"), **options, **kw)
    elif op == "kl_divergence" and options.pop("hidden", False):  # both sides hidden states, each its H
        shard = data["weight"][cols].clone().requires_grad_(True)
        hidden = data["hidden"].clone().requires_grad_(True)
        outs = lr.kl_divergence(hidden, data["teacher_hidden"], student_weight=shard,
                                teacher_weight=data["teacher_weight"][cols], **options, **kw)
    elif op == "kl_divergence":
        outs = lr.kl_divergence(shard, data["teacher"][..., cols], **options, **kw)
    else:
        fn = {"logprobs": lr.logprobs_from_logits, "logprobs_and_entropy": lr.logprobs_and_entropy}[op]
        outs = fn(shard, data["labels"], **options, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if dtensor_mesh is not None:  # replicated DTensors: every rank's local value is the whole result
        outs = tuple(o.to_local() if hasattr(o, "to_local") else o for o in outs)
    loss = sum((o.float() * up[..., i:i + 1] if o.dim() > len(ROWS) else o.float() * up[..., i]).sum()
               for i, o in enumerate(outs) if o.is_floating_point())
    loss.backward()
    grad = shard.grad.to_local() if dtensor_mesh is not None else shard.grad
    return ([o.detach() for o in outs], grad,
            None if hidden is None else hidden.grad)


def _program(rank: int, world: int) -> dict:
    """Every case in this rank's groups of 1, 2, 3 and 4, and through DTensor on three ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    groups = {n: [dist.new_group(list(members)) for members in GROUPS[n]] for n in (1, 2, 3)}
    groups[4] = [dist.group.WORLD]
    mesh = DeviceMesh("cpu", [0, 1, 2])
    out = {}
    for vocab in VOCABS:
        for n, members_list in GROUPS.items():
            for members, group in zip(members_list, groups[n]):
                if rank not in members:
                    continue
                where = members.index(rank)
                ws = widths(vocab, n)
                start = sum(ws[:where])
                for name in CASES:
                    out[(vocab, n, name)] = (_call(name, vocab, start, ws[where], group), start, ws[where])
        ws = widths(vocab, 4)
        for name in BATCH_CASES:  # batch invariance: the group of four on the first row of dim 0 alone
            out[(vocab, "batch", name)] = (_call(name, vocab, sum(ws[:rank]), ws[rank], dist.group.WORLD, first=1),
                                           sum(ws[:rank]), ws[rank])
        if rank < 3:
            for name in DTENSOR_CASES:
                w = -(-vocab // 3)
                start = min(rank * w, vocab)
                out[(vocab, "dtensor", name)] = (_call(name, vocab, start, min(w, vocab - start), None, mesh),
                                                 start, min(w, vocab - start))
    return out


@pytest.fixture(scope="module")
def ranks():
    results = launch.run(4, _program, timeout=1200)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    return [r.value for r in results]


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() + str(t.dtype)


def _problems(ranks, vocab, name, kinds) -> list:
    problems = []
    (alone_outs, alone_grad, alone_hidden), _, _ = ranks[0][(vocab, 1, name)]
    for kind in kinds:
        for rank, got in enumerate(ranks):
            if (vocab, kind, name) not in got:
                continue
            (outs, grad, hidden), start, width = got[(vocab, kind, name)]
            what = f"V={vocab} {name}, group {kind}, rank {rank} (columns {start}:{start + width})"
            for i, (a, b) in enumerate(zip(outs, alone_outs)):
                if _bits(a) != _bits(b):
                    problems.append(f"{what}: output {i} differs from the group of one's bits "
                                    f"(max {(a.double() - b.double()).abs().max().item():.3g})")
            rows_sharded = CASES[name][0] == "logprobs_from_hidden" or CASES[name][2].get("hidden")  # weight rows
            cols = alone_grad[start:start + width] if rows_sharded else alone_grad[..., start:start + width]
            if _bits(grad) != _bits(cols.contiguous()):
                problems.append(f"{what}: the shard's gradient differs from the same columns of the group of one's")
            if hidden is not None and not torch.allclose(hidden.double(), alone_hidden.double(), rtol=1e-2,
                                                         atol=1e-5):
                problems.append(f"{what}: the hidden gradient is outside the contract of the group of one's")
    return problems


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_split_gives_the_bits_of_the_group_of_one(ranks, vocab, name):
    assert not _problems(ranks, vocab, name, (1, 2, 3, 4)), "\n".join(_problems(ranks, vocab, name, (1, 2, 3, 4)))


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_hidden_gradient_is_the_same_on_every_rank_of_a_group(ranks, vocab):
    for n, members_list in GROUPS.items():
        for members in members_list:
            for name in CASES:
                if ranks[0][(vocab, 1, name)][0][2] is None:  # no hidden states
                    continue
                digests = {_bits(ranks[r][(vocab, n, name)][0][2]) for r in members}
                assert len(digests) == 1, f"V={vocab} {name}: ranks {members} have different hidden gradients"


@pytest.mark.parametrize("vocab", VOCABS)
def test_a_dtensor_shard_of_three_ranks_gives_the_bits_of_the_group_of_one(ranks, vocab):
    for name in DTENSOR_CASES:
        problems = _problems(ranks, vocab, name, ("dtensor",))
        assert not problems, "\n".join(problems)


@pytest.mark.parametrize("vocab", VOCABS)
def test_a_row_alone_gives_its_bits_among_all_rows(ranks, vocab):
    """Batch invariance on the sharded path: the first row of dim 0 alone, in the group of four,
    gives its outputs and its rows of the shard's gradient among all rows."""
    for name in BATCH_CASES:
        for rank, got in enumerate(ranks):
            (outs, grad, _), _, _ = got[(vocab, "batch", name)]
            (all_outs, all_grad, _), _, _ = got[(vocab, 4, name)]
            for i, (a, b) in enumerate(zip(outs, all_outs)):
                assert _bits(a) == _bits(b[:1].contiguous()), f"V={vocab} {name} rank {rank}: output {i}"
            if CASES[name][0] != "logprobs_from_hidden":  # (the weight's gradient sums over the rows)
                assert _bits(grad) == _bits(all_grad[:1].contiguous()), f"V={vocab} {name} rank {rank}: gradient"


@pytest.mark.parametrize("vocab", VOCABS)
def test_token_stats_fields_are_those_of_the_call_without_a_group(ranks, vocab):
    """token_stats with process_group= (the group of one) within the contract of the call without a
    group on the same backend, is_argmax exactly (two labels sit at their row's argmax)."""
    import logprob_registry as lr

    for name in ("stats-fp32", "stats-hidden-fp32-bias"):
        op, dtype, options = CASES[name]
        data = _data(vocab, torch.float32, int(hashlib.sha1(name.encode()).hexdigest()[:6], 16) + vocab)
        kw = dict(outputs=lr.TokenStats._fields, backend=B)
        if options.get("hidden"):
            plain = lr.token_stats(data["hidden"], data["labels"], weight=data["weight"], bias=data["bias"], **kw)
        else:
            plain = lr.token_stats(data["logits"], data["labels"], **kw)
        outs = ranks[0][(vocab, 1, name)][0][0]
        for field, got, want in zip(lr.TokenStats._fields, outs, plain):
            if field == "is_argmax":
                assert torch.equal(got, want) and int(got.sum()) >= 1, f"V={vocab} {name}: is_argmax"
            else:
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"V={vocab} {name}: {field}"


def test_the_splits_are_uneven_and_off_the_tile_grid():
    for vocab in VOCABS:
        for n in (2, 3, 4):
            ws = widths(vocab, n)
            assert sum(ws) == vocab and len(set(ws)) == n and all(w % 128 for w in ws)
