"""The conformance section of the vocabulary-parallel path (``process_group=``): for a backend that
implements the shard ops (``shard_stats``, ``shard_grad``; ``hidden_shard_stats``,
``hidden_shard_grad`` for the fused op), the public functions over gloo groups of 1, 2, 3 and 4
spawned processes.

One group of four processes is spawned per backend (``"spawn"``, ``file://`` rendezvous in a fresh
temporary file, a deadline after which the processes are killed and the tests fail); inside it
every rank alone, two pairs (one split evenly with the default ``vocab_start``, one unevenly and in
reverse order with explicit ``vocab_start``) and the group of four run every case
(:mod:`._distributed_cases`, which runs one module per case family): logprobs, entropy,
logprobs_and_entropy and logprobs_from_hidden, in float32 and bfloat16, plain and with
temperature, ignore_index and masked (-inf) vocabulary, with gradients; in-place backward; a
vocabulary that is no multiple of the tile. Then the bad inputs.
For a backend that implements ``kl_shard_stats`` and ``kl_shard_grad``, the same groups run
``kl_divergence`` (forward and reverse, float32 and bfloat16, temperature 0.7 with a mask; both
sides as hidden states with weight shards for a backend declaring ``kl_hidden``), checked by the
``test_distributed_kl_*`` tests as the logits ops are, and the teacher must get no gradient.

What is checked:

- every rank of a group returns the same bits, within the numerical contract of the float64
  reference, and close to the backend's own unsharded call;
- gradients of each shard (and of hidden, weight and bias) within the contract's tolerances;
- for a backend declaring ``group_invariant``: results and shard gradients bitwise the same in
  groups of 1, 2, 3 and 4 (uneven shards off the tile grid included);
- every bad input raises the same error on every rank, and the group stays in step.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from logprob_registry.numerics import assert_close

from ..harness import Harness
from . import _distributed_cases as dc
from . import _distributed_kl as dk
from . import _distributed_logits as dl
from . import _distributed_sampler as ds
from ._coverage import covers

SHARD_OPS = ("shard_stats", "shard_grad", "hidden_shard_stats", "hidden_shard_grad")
#: token_stats' shard ops: its cases run where a backend implements them (the same tests).
TOKEN_SHARD_OPS = ("shard_token_stats", "hidden_shard_token_stats")
#: The shard ops of the sampler's keywords (feature shard_sampler): the test_distributed_sampler test.
SAMPLER_SHARD_OPS = SHARD_OPS + ("shard_topk", "hidden_shard_topk")
KL_SHARD_OPS = dc.KL_SHARD_OPS  # kl_shard_stats, kl_shard_grad: the test_distributed_kl_* tests
#: Seconds before a spawned group counts as hung (its processes are then killed). Generous: a
#: cold torch.compile cache makes the compiled backend's ranks compile for a minute.
GROUP_TIMEOUT = 600.0
COLLECTIVE_TIMEOUT = 180.0

_results: Dict[Tuple[str, str], object] = {}


def _selected(lp: Harness, kl: Optional[bool] = None) -> List[dc.Case]:
    """The cases ``lp``'s backend declares what they need for: the ops, with gradients, the
    features, the dtype (``kl``: only the kl_divergence cases, or only the others)."""
    out = []
    for case in dc.cases():
        if kl is not None and case.kl != kl:
            continue
        if all(lp.backend.supports(op) for op in case.shard_ops) and getattr(torch, case.dtype) in lp.backend.dtypes \
                and all(f in lp.backend.features for f in case.features):
            out.append(case)
    return out


def _spawned(lp: Harness, kl: bool = False) -> List[dict]:
    """Every rank's results of the spawned group for ``lp`` (run once per backend and device, with
    the logits ops' cases and the kl_divergence cases the backend declares)."""
    stats, grad = dc.KL_SHARD_OPS if kl else ("shard_stats", "shard_grad")
    lp.require(stats)
    lp.require(grad, grad=False)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo, which the spawned groups use")
    if not _selected(lp, kl):
        pytest.skip(f"{lp.name} accepts neither float32 nor bfloat16")
    key = (lp.name, str(lp.device))
    if key not in _results:
        from ...distributed import launch

        families = {"logits": tuple(c.name for c in _selected(lp, kl=False)),
                    "kl": tuple(c.name for c in _selected(lp, kl=True)), "sampler": _sampler_names(lp)}
        try:
            ranks = launch.run(dc.WORLD, dc.program, lp.name, str(lp.device), families,
                               timeout=GROUP_TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)
            _results[key] = [r.unwrap() for r in ranks]
        except Exception as exc:
            _results[key] = exc
    found = _results[key]
    if isinstance(found, Exception):
        raise AssertionError(f"the spawned group of {dc.WORLD} failed for {lp.name}: {found}") from found
    return found


def _sampler_names(lp: Harness) -> Tuple[str, ...]:
    """The sampler cases ``lp``'s backend runs in the same spawned group: every one where it declares
    ``shard_sampler`` and implements the shard ops (of the dtypes it accepts)."""
    if "shard_sampler" not in lp.backend.features or not all(lp.backend.supports(op) for op in SAMPLER_SHARD_OPS):
        return ()
    return tuple(name for name, case in ds.sampler_cases().items() if case["dtype"] in lp.backend.dtypes)


def _family(kl: bool) -> str:
    """The name of the case family (:data:`._distributed_cases.FAMILIES`) of the kl or the logits cases."""
    return "kl" if kl else "logits"


def _groups(kind: str) -> Tuple[Tuple[int, ...], ...]:
    return dc.GROUPS[kind]


class DistributedSection:
    """Conformance of the shard ops through the public functions' ``process_group=`` path."""

    @covers(SHARD_OPS + TOKEN_SHARD_OPS, grad=True)
    def test_distributed_results_on_every_rank(self, lp: Harness) -> None:
        """Every rank of groups of 1, 2, 3 and 4 gets the same result, within the contract of the
        float64 reference and of the backend's own unsharded call."""
        _check_results(lp, kl=False)

    @covers(SHARD_OPS + TOKEN_SHARD_OPS, capability="group_invariant", declared=True)
    def test_distributed_bitwise_across_group_sizes(self, lp: Harness) -> None:
        """Results and shard gradients are the same bits in groups of 1, 2, 3 and 4: even splits and
        uneven ones whose edges are off the tile grid, in any order of the ranks."""
        _check_bitwise(lp, kl=False)

    @covers(SHARD_OPS + TOKEN_SHARD_OPS, grad=True)
    def test_distributed_gradients(self, lp: Harness) -> None:
        """Gradients of each rank's shard (and of hidden, weight, bias) match float64 autograd of the
        unsharded call; the complete hidden gradient is the same on every rank of a group;
        ``inplace_backward`` writes the shard's gradient over it where the backend declares it."""
        _check_gradients(lp, kl=False)

    @covers(SAMPLER_SHARD_OPS, grad=True, features=("shard_sampler",))
    def test_distributed_sampler(self, lp: Harness) -> None:
        """The sampler's keywords with process_group= (softcap, keep mask and ids, top_k, candidate
        labels, logits_dtype; float32 and bfloat16) in groups of 1, 2, 3 and 4: every rank's outputs the
        same bits and within the contract of float64 (-inf exactly at the labels outside the kept
        set), shard gradients those of the unsharded call sliced, bitwise across group sizes for a
        backend declaring group_invariant; bad sampler input raises on every rank."""
        names = _sampler_names(lp)
        if not names:
            pytest.skip(f"{lp.name} does not declare shard_sampler (or lacks shard_topk / hidden_shard_topk)")
        ranks = _spawned(lp)
        problems = ds.sampler_problems([r["sampler"] for r in ranks], names, lp.backend.group_invariant)
        assert not problems, "\n".join(problems[:20])

    @covers(KL_SHARD_OPS, grad=True)
    def test_distributed_kl_results_on_every_rank(self, lp: Harness) -> None:
        """kl_divergence over groups of 1, 2, 3 and 4: every rank gets the same KL, within the
        contract of the float64 reference and of the backend's own unsharded call."""
        _check_results(lp, kl=True)

    @covers(KL_SHARD_OPS, capability="group_invariant", declared=True)
    def test_distributed_kl_bitwise_across_group_sizes(self, lp: Harness) -> None:
        """kl_divergence: the KL and the student's shard gradients are the same bits in groups of
        1, 2, 3 and 4, on uneven shards off the tile grid too."""
        _check_bitwise(lp, kl=True)

    @covers(KL_SHARD_OPS, grad=True)
    def test_distributed_kl_gradients(self, lp: Harness) -> None:
        """kl_divergence: the gradient of each rank's student shard (logits; or hidden states and
        weight shard) matches float64 autograd of the unsharded call, sliced; the complete hidden
        gradient is the same on every rank of a group; no gradient reaches the teacher."""
        _check_gradients(lp, kl=True)

    @covers(("shard_stats",))
    def test_distributed_bad_input_raises_on_every_rank(self, lp: Harness) -> None:
        """Each bad input raises the same error on every rank (a non-member only on the
        non-members), with no hang, and the group is in step afterwards."""
        ranks = _spawned(lp)
        problems = []
        errors = [r.get("logits", {}).get("errors", {}) for r in ranks]
        for name, (pattern, kind) in dl.BAD_INPUTS.items():
            if name not in errors[0]:
                continue
            got = [errors[r][name] for r in range(dc.WORLD)]
            raising = [2, 3] if name == "not-a-member" else list(range(dc.WORLD))
            for r, (etype, message) in enumerate(got):
                if r not in raising:
                    if etype:
                        problems.append(f"{name}: rank {r} raised {etype}: {message}")
                    continue
                if etype != kind or not re.search(pattern, message):
                    problems.append(f"{name}: rank {r} raised {etype or 'nothing'}: {message!r}; expected {kind} "
                                    f"matching {pattern!r}")
            if name != "not-a-member" and len({m for _, m in got}) != 1:
                problems.append(f"{name}: the ranks' messages differ: {[m for _, m in got]}")
        for r in range(dc.WORLD):
            etype, message = errors[r].get("still-in-step", ("", "no error"))
            if etype:
                problems.append(f"a good call after the bad ones failed on rank {r}: {etype}: {message}")
        assert not problems, "\n".join(problems[:12])


def _check_results(lp: Harness, kl: bool) -> None:
    """The results of the cases (``kl``: the kl_divergence ones, else the others): the same bits on
    every rank of a group, within the contract of the float64 reference and of the unsharded call."""
    ranks = [r[_family(kl)] for r in _spawned(lp, kl)]
    problems = []
    for case in _selected(lp, kl):
        data = dc.inputs(case)
        want, _ = dc.reference(case, data)
        tols = dc.output_tolerances(case, data)
        alone = _unsharded(lp, case, data) or (None,) * len(want)
        for kind in dc.KINDS:
            for members in _groups(kind):
                first = ranks[members[0]][kind][case.name].outputs
                for r in members:
                    got = ranks[r][kind][case.name].outputs
                    what = f"{case.name}, group of {len(members)} {members}, rank {r}"
                    if not all(dc.same_bits(a, b) for a, b in zip(got, first)):
                        problems.append(f"{what}: not the same bits as rank {members[0]} of its group")
                    for i, (g, w, a, tol) in enumerate(zip(got, want, alone, tols)):
                        dtype = torch.bool if w.dtype == torch.bool else lp.result_dtype(getattr(torch, case.dtype))
                        if g.dtype != dtype or g.shape != w.shape:
                            problems.append(f"{what}: output {i} is {g.dtype} {tuple(g.shape)}")
                            continue
                        if dtype == torch.bool:  # token_stats' is_argmax: exactly, the unsharded call's too
                            if not torch.equal(g, w) or (a is not None and not torch.equal(g, a.cpu())):
                                problems.append(f"{what}: output {i} ({g.tolist()}) is not {w.tolist()}")
                            continue
                        try:
                            assert_close(g, w, tol, f"{what}: output {i}")
                            if a is not None:
                                assert_close(g, a.cpu().double(), 2 * tol, f"{what}: output {i} against "
                                             f"the unsharded call of {lp.name}")
                        except AssertionError as exc:
                            problems.append(str(exc))
    assert not problems, "\n".join(problems[:12])


def _check_bitwise(lp: Harness, kl: bool) -> None:
    """Results and shard gradients the same bits in groups of 1, 2, 3 and 4, on uneven shards off
    the tile grid too."""
    if not lp.backend.group_invariant:
        pytest.skip(f"{lp.name} does not declare group_invariant=True, so results independent of the "
                    "group size are not promised")
    ranks = [r[_family(kl)] for r in _spawned(lp, kl)]
    problems = []
    for case in _selected(lp, kl):
        base = ranks[0]["single"][case.name]
        for kind in dc.KINDS:
            for members in _groups(kind):
                for r in members:
                    problems += _bitwise_problems(ranks[r][kind][case.name], base, kind, r, case.name)
    assert not problems, "\n".join(problems[:12])


def _bitwise_problems(o, base, kind: str, r: int, name: str) -> List[str]:
    """How rank ``r``'s outcome ``o`` in a group of ``kind`` differs in its bits from ``base`` (rank 0 alone)."""
    problems = []
    what = f"{name}, group of {len(_groups(kind)[0])}, rank {r}"
    if not all(dc.same_bits(a, b) for a, b in zip(o.outputs, base.outputs)):
        problems.append(f"{what}: results differ from the group of 1 in their bits")
    for shard, same in o.bitwise.items():
        if not same:
            problems.append(f"{what}: the gradient of its {shard} shard differs from the same "
                            "columns of the group of 1's gradient in its bits")
    if kind == "single" and o.digests != base.digests:
        problems.append(f"{what}: alone, its gradients differ from rank 0's alone")
    return problems


def _check_gradients(lp: Harness, kl: bool) -> None:
    """Shard gradients within the contract's tolerance of float64 autograd, sliced; the complete
    hidden gradient the same on every rank of a group; in-place backward; no teacher gradient."""
    ranks = [r[_family(kl)] for r in _spawned(lp, kl)]
    problems = []
    for case in _selected(lp, kl):
        for kind in dc.KINDS:
            for members in _groups(kind):
                for r in members:
                    o = ranks[r][kind][case.name]
                    what = f"{case.name}, group of {len(members)} {members}, rank {r}"
                    for name, excess in o.excess.items():
                        if not excess <= 0:
                            problems.append(f"{what}: gradient of {name} off by {excess:.3g} beyond the "
                                            "contract's tolerance (logprob_registry.numerics)")
                    hidden = o.digests.get("hidden")
                    if hidden is not None and hidden != ranks[members[0]][kind][case.name].digests["hidden"]:
                        problems.append(f"{what}: its hidden gradient differs from rank {members[0]}'s")
                    if case.inplace and lp.backend.inplace_backward and not o.inplace_ok:
                        problems.append(f"{what}: {lp.name} declares inplace_backward=True but the shard's "
                                        "storage does not hold its gradient after backward")
                    if o.teacher_grad:
                        problems.append(f"{what}: a gradient reached the teacher (a detached target)")
    assert not problems, "\n".join(problems[:12])


def _unsharded(lp: Harness, case: dc.Case, data):
    """The backend's own call without a group (forward only), or None if it lacks the public op
    (or, for kl_divergence with hidden states, the feature)."""
    if not lp.backend.supports(case.op) or not all(f in lp.backend.features for f in case.features):
        return None
    if case.kl:
        kw = {k: (v.to(lp.device) if isinstance(v, torch.Tensor) else v) for k, v in dk.kl_options(case, data).items()}
        with torch.no_grad():
            if case.hidden:
                return lp.call(case.op, data["hidden"].to(lp.device), data["teacher_hidden"].to(lp.device),
                               student_weight=data["weight"].to(lp.device), **kw)
            return lp.call(case.op, data["logits"].to(lp.device), data["teacher"].to(lp.device), **kw)
    kw = dl.options(case)
    kw.pop("inplace_backward", None)
    with torch.no_grad():
        if case.fused:
            bias = data["bias"].to(lp.device) if "bias" in data else None
            if case.op == "token_stats":
                return lp.call(case.op, data["hidden"].to(lp.device), data["labels"].to(lp.device),
                               weight=data["weight"].to(lp.device), bias=bias, **kw)
            return lp.call_hidden(data["hidden"].to(lp.device), data["weight"].to(lp.device),
                                  data["labels"].to(lp.device), bias=bias, **kw)
        return lp.call(case.op, data["logits"].to(lp.device), data["labels"].to(lp.device), **kw)
