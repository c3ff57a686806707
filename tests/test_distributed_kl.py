"""kl_divergence with process_group=: both sides' vocabulary shards on each rank.

One spawned gloo group per size (1, 2, 4) runs every check inside (:func:`_checks`); the test then
compares the ranks and the group sizes: bitwise equal results and gradients across group sizes
(``chunked``, shards at multiples of 4096), close to a float64 computation of the unsharded call,
the student's shard gradient the unsharded one sliced, the hidden gradient complete on every rank;
an uneven split with vocab_start; a mismatched call and support= raise on every rank, no hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import logprob_registry as lr
from logprob_registry.distributed import launch

V, N, H, HT, T = 4 * 4096, 3, 8, 6, 1.5
CASES = (("forward", "chunked"), ("reverse", "chunked"), ("forward", "naive"), ("reverse", "naive"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(N, V, generator=g) * 3
    t = torch.randn(N, V, generator=g) * 3
    s[1, 5000:5100] = float("-inf")
    t[1, 5000:5200] = float("-inf")  # the teacher masks more than the student: KL stays finite both ways
    s[1, 5100:5200] = float("-inf")
    hs, ws = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    ht, wt = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g)
    mask = torch.tensor([True, True, False])
    return s, t, hs, ws, ht, wt, mask


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _checks(rank, world):
    group = dist.group.WORLD
    s, t, hs, ws, ht, wt, mask = _inputs()
    width = V // world
    cols = slice(rank * width, (rank + 1) * width)
    gup = torch.tensor([0.5, -1.25, 2.0])
    out = {}
    for direction, backend in CASES:
        x = s[:, cols].clone().requires_grad_()
        kl = lr.kl_divergence(x, t[:, cols], direction=direction, temperature=T, mask=mask, process_group=group,
                              backend=backend)
        (grad,) = torch.autograd.grad((kl * gup).sum(), x)
        h = hs.clone().requires_grad_()
        w = ws[cols].clone().requires_grad_()
        klh = lr.kl_divergence(h, ht, student_weight=w, teacher_weight=wt[cols], direction=direction,
                               temperature=T, mask=mask, process_group=group, backend=backend)
        gh, gw = torch.autograd.grad((klh * gup).sum(), (h, w))
        out[direction, backend] = dict(kl=kl.detach(), grad=grad, klh=klh.detach(), gh=gh, gw=gw)
    # an uneven split: rank r holds [starts[r], starts[r + 1]) given by vocab_start
    starts = [0, 5000, 11000, 13001][:world] + [V]
    cut = slice(starts[rank], starts[rank + 1])
    x = s[:, cut].clone().requires_grad_()
    kl = lr.kl_divergence(x, t[:, cut], direction="reverse", temperature=T, process_group=group,
                          vocab_start=starts[rank], backend="chunked")
    (grad,) = torch.autograd.grad((kl * gup).sum(), x)
    out["uneven"] = dict(kl=kl.detach(), grad=grad, cut=(starts[rank], starts[rank + 1]))
    # errors every rank raises, before any collective that could hang
    other = "reverse" if rank == world - 1 and world > 1 else "forward"
    out["mismatch"] = _error(lambda: lr.kl_divergence(s[:, cols], t[:, cols], direction=other, process_group=group,
                                                      backend="chunked"))
    other_mask = torch.tensor([True, rank != world - 1 or world == 1, False])
    out["mask"] = _error(lambda: lr.kl_divergence(s[:, cols], t[:, cols], mask=other_mask, process_group=group,
                                                  backend="chunked"))
    support = torch.arange(6).reshape(N, 2)
    out["support"] = _error(lambda: lr.kl_divergence(s[:, cols], t[:, cols], support=support, process_group=group,
                                                     backend="chunked"))
    # and the group still works afterwards
    out["after"] = lr.kl_divergence(s[:, cols], t[:, cols], process_group=group, backend="chunked")
    return out


def _reference(student, teacher, direction):
    ls = torch.log_softmax(student / T, -1)
    lt = torch.log_softmax(teacher / T, -1)
    p, lp, lq = (lt.exp(), lt, ls) if direction == "forward" else (ls.exp(), ls, lt)
    live = p != 0  # 0 * log 0 = 0, with a finite gradient (no NaN through the unselected branch)
    return (p * (torch.where(live, lp, 0.0) - torch.where(live, lq, 0.0))).sum(-1)


def _expected(direction, mask, gup, uneven=False):
    """Float64: the KL of logits and of hidden states, and their gradients."""
    s, t, hs, ws, ht, wt, _ = (x.double() if x.is_floating_point() else x for x in _inputs())
    s, hs, ws = s.requires_grad_(), hs.requires_grad_(), ws.requires_grad_()
    kl = _reference(s, t, direction)
    klh = _reference(hs @ ws.T, ht @ wt.T, direction)
    if mask is not None:
        kl, klh = torch.where(mask, kl, 0.0), torch.where(mask, klh, 0.0)
    gs, = torch.autograd.grad((kl * gup.double()).sum(), s)
    gh, gw = torch.autograd.grad((klh * gup.double()).sum(), (hs, ws))
    return dict(kl=kl.detach(), grad=gs, klh=klh.detach(), gh=gh, gw=gw)


def _close(got, want, what, scale=1.0):
    tol = 2e-5 * scale * (1 + want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"{what}: off by {err:.3g} (tolerance {tol:.3g})"


@pytest.fixture(scope="module")
def groups():
    return {world: [r.unwrap() for r in launch.run(world, _checks, timeout=240)] for world in (1, 2, 4)}


def test_every_rank_gets_the_complete_result_bitwise_across_group_sizes(groups):
    for world, ranks in groups.items():
        for case in CASES:
            for r in ranks:  # every rank: the same complete result and hidden gradient
                for name in ("kl", "klh", "gh"):
                    assert torch.equal(r[case][name], ranks[0][case][name]), (world, case, name)
            if case[1] != "chunked":
                continue
            one = groups[1][0][case]
            width = V // world
            for rank, r in enumerate(ranks):  # chunked is group invariant: the bits of a group of one
                cols = slice(rank * width, (rank + 1) * width)
                for name in ("kl", "klh"):  # the hidden gradient is an all-reduce's sum: close, not bitwise
                    assert torch.equal(r[case][name], one[name]), (world, case, name)
                assert torch.equal(r[case]["grad"], one["grad"][:, cols]), (world, case, "student shard gradient")
                assert torch.equal(r[case]["gw"], one["gw"][cols]), (world, case, "weight shard gradient")
        assert torch.equal(ranks[-1]["after"], groups[1][0]["after"])


def test_close_to_the_unsharded_call_in_float64(groups):
    _, _, _, _, _, _, mask = _inputs()
    gup = torch.tensor([0.5, -1.25, 2.0])
    for world, ranks in groups.items():
        width = V // world
        for direction, backend in CASES:
            want = _expected(direction, mask, gup)
            for rank, r in enumerate(ranks):
                got = r[direction, backend]
                cols = slice(rank * width, (rank + 1) * width)
                _close(got["kl"], want["kl"], f"{world} {direction} {backend} kl")
                _close(got["klh"], want["klh"], f"{world} {direction} {backend} kl of hidden states")
                _close(got["grad"], want["grad"][:, cols], f"{world} {direction} {backend} logits gradient")
                _close(got["gh"], want["gh"], f"{world} {direction} {backend} hidden gradient")
                _close(got["gw"], want["gw"][cols], f"{world} {direction} {backend} weight gradient")
                assert got["kl"][2] == 0 and not got["grad"][2].any() and got["gw"].abs().sum() > 0
                assert torch.isinf(got["kl"][1]) == torch.isinf(want["kl"][1])
        want = _expected("reverse", None, gup)
        for r in ranks:  # the uneven split
            c0, c1 = r["uneven"]["cut"]
            _close(r["uneven"]["kl"], want["kl"], f"{world} uneven kl")
            _close(r["uneven"]["grad"], want["grad"][:, c0:c1], f"{world} uneven gradient")


def test_a_mismatched_call_and_support_raise_on_every_rank(groups):
    for world, ranks in groups.items():
        for r in ranks:
            if world > 1:
                kind, text = r["mismatch"]
                assert kind == "GroupMismatchError" and "disagree with rank 0 on the call's options" in text, text
                kind, text = r["mask"]
                assert kind == "GroupMismatchError" and "the mask differs across the group" in text, text
            else:
                assert r["mismatch"] is None and r["mask"] is None
            kind, text = r["support"]
            assert kind == "NotImplementedError"
            assert "kl_divergence(..., process_group=...) does not support support=" in text
