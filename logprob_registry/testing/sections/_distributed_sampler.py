"""The sampler family of the conformance suite's distributed section (:mod:`._distributed_cases`
runs it): the sampler's keywords with ``process_group=`` (softcap, keep mask and ids, top_k, top_p,
min_p, candidate labels, logits_dtype, topk_logprobs, a per-row temperature, ``sampler="hf"`` /
``"sglang"``) in groups of 1, 2, 3 and 4. Every case's outputs on every rank and each rank's shard
gradient come back; :func:`sampler_problems` compares them with each other (bits) and with the
unsharded float64 reference (the numerical contract). Imports no pytest: it runs in the spawned
processes."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ... import reference as ref
from ._distributed_common import KINDS, WORLD, hash_name, member, same_bits, split

FAMILY = "sampler"

SAMPLER_VOCAB = 4 * 4096
SAMPLER_HIDDEN = 32


def sampler_cases() -> Dict[str, dict]:
    """name -> the case: op, dtype, the options, and how labels and keep are made."""
    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "softcap-fp32": dict(op="logprobs_and_entropy", dtype=f32, kw=dict(softcap=5.0, temperature=0.7)),
        "softcap-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(softcap=5.0, temperature=0.7)),
        "keep-mask": dict(op="logprobs_and_entropy", dtype=f32, kw=dict(), keep="mask"),
        "keep-ids": dict(op="logprobs", dtype=f32, kw=dict(), keep="ids"),
        "top_k-fp32": dict(op="logprobs_and_entropy", dtype=f32, kw=dict(top_k=50, temperature=0.9)),
        "top_k-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(top_k=50)),
        "candidates": dict(op="logprobs", dtype=f32, kw=dict(top_k=40, softcap=8.0), candidates=4),
        "all-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(top_k=40, softcap=8.0, temperature=0.8),
                         keep="ids", candidates=3),
        "hidden-bf16": dict(op="logprobs_from_hidden", dtype=bf16,
                            kw=dict(top_k=30, softcap=6.0, logits_dtype=torch.bfloat16, return_entropy=True)),
        "hidden-fp32": dict(op="logprobs_from_hidden", dtype=f32, kw=dict(top_k=20), keep="ids"),
        "min_p-fp32": dict(op="logprobs_and_entropy", dtype=f32, kw=dict(min_p=0.05, temperature=0.8)),
        "min_p-top_k-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(min_p=0.02, top_k=40, softcap=9.0),
                                 candidates=2),
        "hidden-min_p": dict(op="logprobs_from_hidden", dtype=f32, kw=dict(min_p=0.1, return_entropy=True)),
        "top_p-top_k-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(top_p=0.9, top_k=50)),
        "top_p-min_p-fp32": dict(op="logprobs_and_entropy", dtype=f32, kw=dict(top_p=0.8, min_p=0.01, softcap=10.0),
                                 keep="mask"),
        "hidden-top_p": dict(op="logprobs_from_hidden", dtype=bf16, kw=dict(top_p=0.7, return_entropy=True,
                                                                           logits_dtype=torch.bfloat16)),
        "topk_logprobs-fp32": dict(op="topk_logprobs", dtype=f32, kw=dict(k=8, temperature=0.9)),
        "topk_logprobs-sampler-bf16": dict(op="topk_logprobs", dtype=bf16, kw=dict(k=6, top_k=4, softcap=9.0),
                                           keep="ids"),
        # a per-row temperature (positions (2, 3)) and the other engines' orders
        "per_row-temperature-bf16": dict(op="logprobs_and_entropy", dtype=bf16,
                                         kw=dict(temperature=_ROW_TEMPERATURE, top_k=40, softcap=9.0)),
        "hidden-per_row-temperature": dict(op="logprobs_from_hidden", dtype=f32,
                                           kw=dict(temperature=_ROW_TEMPERATURE, min_p=0.05, return_entropy=True)),
        "hf-bf16": dict(op="logprobs_and_entropy", dtype=bf16, kw=dict(sampler="hf", top_k=60, top_p=0.8, min_p=0.05)),
        "sglang-bf16": dict(op="logprobs_and_entropy", dtype=bf16,
                            kw=dict(sampler="sglang", top_k=60, top_p=0.8, min_p=0.02, temperature=_ROW_TEMPERATURE),
                            candidates=2),
        "hidden-sglang-top_p": dict(op="logprobs_from_hidden", dtype=bf16,
                                    kw=dict(sampler="sglang", top_p=0.7, return_entropy=True)),
    }


#: A per-row temperature for the positions (2, 3) of the sampler cases.
_ROW_TEMPERATURE = torch.tensor([[0.7, 1.3, 0.9], [1.0, 0.5, 2.0]])


def sampler_data(name: str) -> Dict[str, torch.Tensor]:
    """The case's full inputs (CPU), the same on every rank and in the parent: logits (or hidden and
    weight), labels (half of them the position's most probable tokens, so that most are kept), keep,
    and the weights of the loss whose gradient is compared."""
    case = sampler_cases()[name]
    g = torch.Generator().manual_seed(hash_name(name))
    lead, v = (2, 3), SAMPLER_VOCAB
    data: Dict[str, torch.Tensor] = {}
    if case["op"] == "logprobs_from_hidden":
        data["hidden"] = (torch.randn(*lead, SAMPLER_HIDDEN, generator=g)).to(case["dtype"])
        data["weight"] = (torch.randn(v, SAMPLER_HIDDEN, generator=g) * 0.5).to(case["dtype"])
        logits = data["hidden"].double() @ data["weight"].double().t()
    else:
        data["logits"] = (torch.randn(*lead, v, generator=g, dtype=torch.float64) * 3).to(case["dtype"])
        logits = data["logits"].double()
    k = case.get("candidates")
    order = logits.argsort(-1, descending=True)
    if k:
        labels = torch.randint(0, v, (*lead, k), generator=g)
        labels[..., 0] = order[..., 0]
        labels[..., 1] = order[..., 7]
    else:
        labels = torch.randint(0, v, lead, generator=g)
        labels[0] = order[0, :, 3]
    data["labels"] = labels
    if case.get("keep") == "mask":
        data["keep"] = torch.rand(*lead, v, generator=g) < 0.7
    elif case.get("keep") == "ids":
        ids = torch.cat([order[..., :60], torch.randint(-1, v, (*lead, 40), generator=g)], -1)
        data["keep"] = ids[..., torch.randperm(100, generator=g)]
    shape = lead + (case["kw"]["k"],) if case["op"] == "topk_logprobs" else labels.shape
    data["w_lp"] = torch.rand(shape, generator=g, dtype=torch.float64)
    data["w_ent"] = torch.rand(lead, generator=g, dtype=torch.float64)
    return data


def sampler_kwargs(name: str, data: Dict[str, torch.Tensor], start: int = 0, width: Optional[int] = None) -> dict:
    """The case's keyword arguments; a keep mask cut to the shard's columns ``[start, start + width)``."""
    kw = dict(sampler_cases()[name]["kw"])
    if "keep" in data:
        keep = data["keep"]
        kw["keep"] = keep[..., start:start + width] if keep.dtype == torch.bool and width is not None else keep
    return kw


def sampler_loss(outs, data) -> torch.Tensor:
    """A weighted sum of the finite log-probabilities (a label outside the kept set is -inf) and the entropy."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    lp = outs[0]
    loss = torch.where(torch.isfinite(lp), lp.double(), 0.0).mul(data["w_lp"]).sum()
    if len(outs) > 1 and outs[1].is_floating_point():  # (topk_logprobs' second output: the ids)
        loss = loss + outs[1].double().mul(data["w_ent"]).sum()
    return loss


def _sampler_call(name, data, start, width, group, backend, give_start, device="cpu"):
    import logprob_registry as lr

    case = sampler_cases()[name]
    data = {k: v.to(device) for k, v in data.items()}
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in
          sampler_kwargs(name, data, start, width).items()}
    kw.update(process_group=group, backend=backend)
    if give_start:
        kw["vocab_start"] = start
    if case["op"] == "logprobs_from_hidden":
        hidden = data["hidden"].clone().requires_grad_(True)
        weight = data["weight"][start:start + width].clone().requires_grad_(True)
        outs = lr.logprobs_from_hidden(hidden, weight, data["labels"], **kw)
        leaves = {"hidden": hidden, "weight": weight}
    elif case["op"] == "topk_logprobs":
        shard = data["logits"][..., start:start + width].clone().requires_grad_(True)
        outs = lr.topk_logprobs(shard, kw.pop("k"), **kw)
        leaves = {"logits": shard}
    else:
        shard = data["logits"][..., start:start + width].clone().requires_grad_(True)
        fn = lr.logprobs_and_entropy if case["op"] == "logprobs_and_entropy" else lr.logprobs_from_logits
        outs = fn(shard, data["labels"], **kw)
        leaves = {"logits": shard}
    sampler_loss(outs, data).backward()
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.detach().cpu() for o in outs], {k: v.grad.cpu() for k, v in leaves.items()}


def _mismatches(rank: int, backend: str, device="cpu") -> Dict[str, str]:
    """Bad input on one rank of the group of four: every rank must raise (and nothing hang)."""
    import torch.distributed as dist

    import logprob_registry as lr

    g = torch.Generator().manual_seed(7)
    v = SAMPLER_VOCAB
    full = torch.randn(2, v, generator=g).to(device)
    width = v // WORLD
    shard = full[:, rank * width:(rank + 1) * width]
    labels = torch.randint(0, v, (2,), generator=g).to(device)
    ids = torch.randint(0, v, (2, 5), generator=g).to(device)
    attempts = {
        "softcap-differs": lambda: dict(softcap=5.0 if rank != 3 else 6.0),
        "top_k-differs": lambda: dict(top_k=10 if rank != 1 else 11),
        "min_p-differs": lambda: dict(min_p=0.1 if rank != 2 else 0.2),
        "keep-ids-differ": lambda: dict(keep=ids if rank != 2 else ids.flip(-1)),
        "keep-id-out-of-range": lambda: dict(keep=torch.tensor([[0, v], [1, 2]], device=device)),
        "keep-mask-shape-on-one-rank": lambda: dict(keep=torch.ones(2, width + (rank == 0), dtype=torch.bool,
                                                                  device=device)),
        "top_p-differs": lambda: dict(top_p=0.9 if rank != 1 else 0.8),
        "per-row-temperature-differs": lambda: dict(temperature=torch.tensor([0.5, 0.7 if rank != 1 else 0.8],
                                                                             device=device)),
        "sampler-differs": lambda: dict(top_k=10, sampler="hf" if rank != 3 else "sglang"),
    }
    out = {}
    for what, make in attempts.items():
        try:
            lr.logprobs_from_logits(shard, labels, process_group=dist.group.WORLD, backend=backend, **make())
            out[what] = "no error"
        except Exception as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    return out


def run(rank: int, groups: Dict[str, Any], backend: str, device: str, names: Tuple[str, ...]) -> dict:
    """This rank's side of the family: ``{kind: {case: (outputs, gradients, start, width)}}`` for the
    sampler cases ``names`` in each group (``groups``: kind -> this rank's group), and
    ``"mismatch"``: the bad inputs' errors on the group of four."""
    result: Dict[str, Any] = {}
    for kind in KINDS:
        group = groups[kind]
        result[kind] = {}
        for name in (names if group is not None else ()):  # not a member of a group of this kind
            data = sampler_data(name)
            start, width, give = split(kind, rank, SAMPLER_VOCAB)
            outs, grads = _sampler_call(name, data, start, width, group, backend, give, device)
            result[kind][name] = (outs, grads, start, width)
    result["mismatch"] = _mismatches(rank, backend, device)
    return result


def sampler_reference(name: str):
    """The unsharded call in float64 autograd (:mod:`logprob_registry.reference`): outputs, and the
    gradients of :func:`sampler_loss` by input name."""
    case = sampler_cases()[name]
    data = sampler_data(name)
    kw = sampler_kwargs(name, data)
    if case["op"] == "logprobs_from_hidden":
        h = data["hidden"].double().requires_grad_(True)
        w = data["weight"].double().requires_grad_(True)
        outs = ref.logprobs_from_hidden(h, w, data["labels"], **kw)
        leaves = {"hidden": h, "weight": w}
    elif case["op"] == "topk_logprobs":
        x = data["logits"].double().requires_grad_(True)
        outs = ref.topk_logprobs(x, kw.pop("k"), **kw)
        leaves = {"logits": x}
    else:
        x = data["logits"].double().requires_grad_(True)
        fn = ref.logprobs_and_entropy if case["op"] == "logprobs_and_entropy" else ref.logprobs
        outs = fn(x, data["labels"], **kw)
        leaves = {"logits": x}
    sampler_loss(outs, data).backward()
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.detach() for o in outs], {k: v.grad for k, v in leaves.items()}


#: Tolerances of the sampler cases against float64 (rtol, atol), by input dtype: float32 computes in
#: float32; bfloat16 inputs are exact in float32 but a softcap's or logits_dtype's roundings are not.
SAMPLER_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}
#: The expected start of each bad input's message, on every rank (see _mismatches).
SAMPLER_MISMATCH = {
    "softcap-differs": "GroupMismatchError: ranks [3] disagree with rank 0 on the sampler's softcap",
    "top_k-differs": "GroupMismatchError: ranks [1] disagree with rank 0 on the sampler's top_k",
    "min_p-differs": "GroupMismatchError: ranks [2] disagree with rank 0 on the sampler's min_p",
    "keep-ids-differ": "GroupMismatchError: ranks [2] disagree with rank 0 on the sampler's keep",
    "keep-id-out-of-range": "ValueError: keep id 16384 at flat position 1 is out of range",
    "keep-mask-shape-on-one-rank": "ValueError: rank 0 of the process group: keep is a bool mask of shape",
    "top_p-differs": "GroupMismatchError: ranks [1] disagree with rank 0 on the sampler's top_p",
    "per-row-temperature-differs": "GroupMismatchError: ranks [1] disagree with rank 0 on the temperature "
                                   "(rank 0: <per-row tensor, checksum",
    "sampler-differs": "GroupMismatchError: ranks [3] disagree with rank 0 on the sampler's logits_dtype",
}


def sampler_problems(ranks: List[dict], names: Tuple[str, ...], invariant: bool) -> List[str]:
    """What is wrong in the spawned results ``ranks`` (one dict per rank, from
    :func:`run`): outputs against float64 (-inf exactly where the reference has it),
    shard gradients against the reference's columns, every rank's outputs and, with ``invariant``
    (a backend declaring group_invariant), the same columns' gradients bitwise equal across groups
    of 1, 2, 3 and 4 (splits on and off the tile grid); the bad inputs' errors on every rank."""
    problems: List[str] = []
    for name in names:
        want, want_grads = sampler_reference(name)
        rtol, atol = SAMPLER_TOLERANCE[sampler_cases()[name]["dtype"]]
        first = ranks[0]["single"][name]
        for kind in KINDS:
            for rank, got_all in enumerate(ranks):
                if not member(kind, rank):
                    continue
                outs, grads, start, width = got_all[kind][name]
                where = f"{name} {kind} rank {rank}"
                for i, (got, exp) in enumerate(zip(outs, want)):
                    if not torch.equal(torch.isneginf(got), torch.isneginf(exp)):
                        problems.append(f"{where}: output {i} is -inf elsewhere than the reference")
                        continue
                    finite = torch.isfinite(exp)
                    exp = exp.double()  # (topk_logprobs' ids: exact integers)
                    if not torch.allclose(got.double()[finite], exp[finite], rtol=rtol, atol=atol):
                        err = (got.double()[finite] - exp[finite]).abs().max().item()
                        problems.append(f"{where}: output {i} differs from float64 by {err:.3g}")
                    bits = first[0][i] if invariant else ranks[0][kind][name][0][i]
                    if not same_bits(got, bits):
                        problems.append(f"{where}: output {i} is not the bits of rank 0 "
                                        + ("alone" if invariant else "of the same group"))
                for what, got in grads.items():
                    exp = want_grads[what]
                    def cut(t, what=what, start=start, width=width):
                        if what == "weight":
                            return t[start:start + width]
                        return t[..., start:start + width] if what == "logits" else t
                    if not torch.allclose(got.double(), cut(exp), rtol=rtol, atol=5 * atol):
                        err = (got.double() - cut(exp)).abs().max().item()
                        problems.append(f"{where}: the gradient of {what} differs from float64 by {err:.3g}")
                    if invariant and what != "hidden" and not same_bits(got, cut(first[1][what]).contiguous()):
                        problems.append(f"{where}: the gradient of {what} is not the bits of the same columns "
                                        "in a group of one")
    for rank, got_all in enumerate(ranks):
        for what, start in SAMPLER_MISMATCH.items():
            if not got_all["mismatch"][what].startswith(start):
                problems.append(f"bad input {what} on rank {rank}: {got_all['mismatch'][what]!r}, expected "
                                f"{start!r}...")
    return problems
