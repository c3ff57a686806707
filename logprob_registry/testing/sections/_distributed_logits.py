"""The logits family of the conformance suite's distributed section (:mod:`._distributed_cases`
runs it): ``logprobs``, ``entropy``, ``logprobs_and_entropy``, ``logprobs_from_hidden`` and
``token_stats`` (every field, of logits) over vocabulary shards (shard ops ``shard_stats``,
``shard_grad``; ``hidden_shard_stats``, ``hidden_shard_grad``; ``shard_token_stats``), their
float64 reference and tolerances, and the bad inputs every rank must reject alike. A rank checks
its own shard's gradients itself (against float64 autograd, and bitwise against the gradient it
computed alone), since it holds the inputs: only small results travel back. Imports no pytest: it
runs in the spawned processes."""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Tuple

import torch

from logprob_registry.numerics import EPS32, tolerance, tolerances

from ... import reference as ref
from ._distributed_common import HIDDEN, IGNORE, KINDS, ODD_VOCAB, SHAPE, VOCAB, WORLD, Case, hash_name, run_cases

FAMILY = "logits"
#: token_stats' fields, all asked; the first four have a gradient.
FIELDS = ("logprobs", "entropy", "raw_logprobs", "raw_entropy", "log_sum_p2", "mean_logit", "max_logit",
          "is_argmax")
DIFFERENTIABLE = FIELDS[:4]


def cases() -> List[Case]:
    """The logits ops' and the fused op's cases."""
    out = []
    for dtype in ("float32", "bfloat16"):
        for op in ("logprobs", "entropy", "logprobs_and_entropy"):
            out.append(Case(f"{op}-{dtype}-plain", op, dtype))
            out.append(Case(f"{op}-{dtype}-options", op, dtype, temperature=0.7, ignore=op != "entropy", masked=True))
        out.append(Case(f"hidden-{dtype}-plain", "logprobs_from_hidden", dtype))
        out.append(Case(f"hidden-{dtype}-options", "logprobs_from_hidden", dtype, temperature=0.7, ignore=True,
                        bias=True, entropy=True))
    out.append(Case("logprobs_and_entropy-float32-inplace", "logprobs_and_entropy", "float32", temperature=0.7,
                    ignore=True, inplace=True))
    out.append(Case("logprobs_and_entropy-float32-vocab-13192", "logprobs_and_entropy", "float32", temperature=0.7,
                    ignore=True, masked=True, vocab=ODD_VOCAB))
    out.append(Case("token_stats-float32-options", "token_stats", "float32", temperature=0.7, ignore=True, masked=True))
    out.append(Case("token_stats-bfloat16-vocab-13192", "token_stats", "bfloat16", vocab=ODD_VOCAB))
    out.append(Case("token_stats-float32-hidden", "token_stats", "float32", temperature=0.7, ignore=True, bias=True,
                    hidden=True))
    return out


def outputs_of(case: Case) -> int:
    if case.op == "token_stats":
        return len(FIELDS)
    if case.op == "logprobs_from_hidden":
        return 1 + case.entropy
    return 2 if case.op == "logprobs_and_entropy" else 1


def inputs(case: Case) -> Dict[str, torch.Tensor]:
    """The case's full (unsharded) inputs on the CPU, the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(hash_name(case.name))
    dtype = getattr(torch, case.dtype)
    labels = torch.randint(0, case.vocab, SHAPE, generator=g)
    out: Dict[str, torch.Tensor] = {}
    if case.fused:
        out["hidden"] = torch.randn(*SHAPE, HIDDEN, generator=g).to(dtype)
        out["weight"] = (torch.randn(case.vocab, HIDDEN, generator=g) * 0.4).to(dtype)
        if case.bias:
            out["bias"] = (torch.randn(case.vocab, generator=g) * 0.5).to(dtype)
        if case.op == "token_stats":  # a label at its row's first maximum: is_argmax has one to find
            z = torch.nn.functional.linear(out["hidden"][1, 1].double(), out["weight"].double(),
                                           out["bias"].double() if case.bias else None)
            labels[1, 1] = z.argmax()
    else:
        logits = torch.randn(*SHAPE, case.vocab, generator=g, dtype=torch.float64) * 3.0
        if case.masked:
            logits[1, 0, 4096:8192] = float("-inf")  # a whole tile
            logits[0, 2, ::7] = float("-inf")
            labels[1, 0], labels[0, 2] = 100, 3  # not on a -inf entry
        out["logits"] = logits.to(dtype)
        if case.op == "token_stats":  # a label at its row's first maximum: is_argmax has one to find
            labels[1, 1] = out["logits"][1, 1].double().argmax()
    if case.ignore:
        labels[0, 1] = labels[1, 2] = IGNORE
    out["labels"] = labels
    out["upstream"] = torch.randn(outputs_of(case), *SHAPE, generator=g, dtype=torch.float64)
    return out


def options(case: Case) -> dict:
    kw: dict = dict(temperature=case.temperature)
    if case.op == "token_stats":
        return dict(kw, ignore_index=IGNORE if case.ignore else None, outputs=FIELDS)
    if case.op != "entropy":
        kw["ignore_index"] = IGNORE if case.ignore else None
    if case.op == "logprobs_from_hidden":
        kw["return_entropy"] = case.entropy
    elif case.op != "entropy":
        kw["inplace_backward"] = case.inplace
    return kw


def reference(case: Case, data: Dict[str, torch.Tensor]):
    """Outputs and input gradients (dict) of the unsharded call in float64 autograd."""
    ups = data["upstream"]
    kw = options(case)
    kw.pop("inplace_backward", None)
    if case.fused:
        leaves = {k: data[k].detach().double().requires_grad_(True) for k in ("hidden", "weight", "bias")
                  if k in data}
        if case.op == "token_stats":
            named = ref.token_stats(leaves["hidden"], data["labels"], weight=leaves["weight"], bias=leaves.get("bias"),
                                    **kw)
            outs = tuple(named[f] for f in FIELDS)
        else:
            outs = ref.logprobs_from_hidden(leaves["hidden"], leaves["weight"], data["labels"],
                                            bias=leaves.get("bias"), **kw)
    elif case.op == "token_stats":
        leaves = {"logits": data["logits"].detach().double().requires_grad_(True)}
        named = ref.token_stats(leaves["logits"], data["labels"], **kw)
        outs = tuple(named[f] for f in FIELDS)
    else:
        leaves = {"logits": data["logits"].detach().double().requires_grad_(True)}
        fn = {"logprobs": ref.logprobs, "entropy": ref.entropy, "logprobs_and_entropy": ref.logprobs_and_entropy}
        args = (leaves["logits"],) if case.op == "entropy" else (leaves["logits"], data["labels"])
        outs = fn[case.op](*args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * u).sum() for o, u in _differentiable(case, outs, ups)).backward()
    return tuple(o.detach() for o in outs), {k: v.grad for k, v in leaves.items()}


def _differentiable(case: Case, outs, ups):
    """``(output, upstream)`` of the outputs with a gradient (token_stats: its first four fields)."""
    pairs = list(zip(outs, ups))
    return pairs[:len(DIFFERENTIABLE)] if case.op == "token_stats" else pairs


def output_tolerances(case: Case, data: Dict[str, torch.Tensor]) -> tuple:
    """The contract's tolerance of each output (:mod:`..numerics`)."""
    op = case.op
    if case.fused:
        bound = data["hidden"].detach().double().abs() @ data["weight"].detach().double().abs().T
        if "bias" in data:
            bound = bound + data["bias"].detach().double().abs()
        like = torch.empty(1, case.vocab)
        if op == "token_stats":
            return tolerances(op, like, case.temperature, float(bound.max()), options=options(case))
        kinds = ("logprobs", "entropy")[:outputs_of(case)]
        return tuple(tolerance(like, case.temperature, float(bound.max()), k) for k in kinds)
    return tolerances(op, data["logits"], case.temperature, options=options(case))


def _grad_eps(dtype: torch.dtype) -> float:
    return max(torch.finfo(dtype).eps, 4 * EPS32) if dtype != torch.float64 else 4 * EPS32


def gradient_excess(case: Case, data, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                    columns: Dict[str, slice]) -> Dict[str, float]:
    """Per input: ``max(|got - want| - allowed)`` (<= 0 passes), with the suite's gradient
    tolerances; ``columns`` selects this rank's shard of ``want`` (the whole tensor for hidden)."""
    dtype = getattr(torch, case.dtype)
    out = {}
    if not case.fused:
        g, w = got["logits"].cpu().double(), want["logits"][columns["logits"]]
        atol = 4 * max(output_tolerances(case, data)) * float(data["upstream"].abs().max()) / case.temperature
        allowed = atol + _grad_eps(dtype) * w.abs()
        err = (g - w).abs()
        out["logits"] = float((err - allowed).nan_to_num(nan=math.inf).max()) if err.numel() else -1.0
        return out
    # the fused op: each element's error is bounded relative to the sum of its absolute terms
    h, wt = data["hidden"].double(), data["weight"].double()
    b = data["bias"].double() if "bias" in data else None
    logits = torch.nn.functional.linear(h, wt, b).requires_grad_(True)
    kw = options(case)
    if case.op == "token_stats":
        named = ref.token_stats(logits, data["labels"], **kw)
        lo = tuple(named[f] for f in DIFFERENTIABLE)
    else:
        kw.pop("return_entropy")
        lo = ref.logprobs_and_entropy(logits, data["labels"], **kw) if case.entropy else \
            (ref.logprobs(logits, data["labels"], **kw),)
    dlog = torch.autograd.grad(sum((o * u).sum() for o, u in zip(lo, data["upstream"])), logits)[0].abs()
    flat = dlog.reshape(-1, dlog.shape[-1])
    bounds = {"hidden": dlog @ wt.abs(), "weight": flat.T @ h.abs().reshape(-1, h.shape[-1]), "bias": flat.sum(0)}
    tol = max(output_tolerances(case, data))
    rel = 4 * tol + 2 * _grad_eps(dtype)
    for name, g in got.items():
        if g is None:
            continue
        w = want[name][columns[name]]
        bound = bounds[name][columns[name]]
        out[name] = float(((g.cpu().double() - w).abs() - (rel * bound + 1e-30)).max())
    return out


def call(case: Case, data, start: int, width: int, give_start: bool, group, backend: str, device):
    """The sharded call with gradients; returns (outputs, gradients by input name, logits for inplace)."""
    import logprob_registry as lr

    kw = dict(options(case), process_group=group, backend=backend)
    if give_start:
        kw["vocab_start"] = start
    cols = slice(start, start + width)
    if case.fused:
        leaves = {"hidden": data["hidden"].to(device, copy=True).requires_grad_(True),
                  "weight": data["weight"][cols].to(device, copy=True).requires_grad_(True)}
        if "bias" in data:
            leaves["bias"] = data["bias"][cols].to(device, copy=True).requires_grad_(True)
        if case.op == "token_stats":
            outs = lr.token_stats(leaves["hidden"], data["labels"].to(device), weight=leaves["weight"],
                                  bias=leaves.get("bias"), **kw)
        else:
            outs = lr.logprobs_from_hidden(leaves["hidden"], leaves["weight"], data["labels"].to(device),
                                           bias=leaves.get("bias"), **kw)
        shard = None
    else:
        base = data["logits"].to(device, copy=True)[..., cols].requires_grad_(True)  # a strided view
        shard = base * 1.0 if case.inplace else base  # a non-leaf for in-place backward, as an lm_head's output
        leaves = {"logits": base}
        fn = {"logprobs": lr.logprobs_from_logits, "entropy": lr.entropy_from_logits,
              "logprobs_and_entropy": lr.logprobs_and_entropy, "token_stats": lr.token_stats}[case.op]
        args = (shard,) if case.op == "entropy" else (shard, data["labels"].to(device))
        outs = fn(*args, **kw)
    outs = tuple(outs) if isinstance(outs, tuple) else (outs,)
    ups = data["upstream"]
    sum((o * u.to(o.device, o.dtype)).sum() for o, u in _differentiable(case, outs, ups)).backward()
    return [o.detach().cpu() for o in outs], {k: v.grad for k, v in leaves.items()}, shard


def run(rank: int, groups: Dict[str, Any], backend: str, device: str, names: Tuple[str, ...]) -> dict:
    """This rank's side of the family: ``{kind: {case: Outcome}}`` for the cases ``names`` in each
    group (``groups``: kind -> this rank's group, and ``"pairs"``: both groups of two), and
    ``"errors"``: the bad inputs' errors (where the logits cases run)."""
    singles: Dict[str, Dict[str, torch.Tensor]] = {}
    me = sys.modules[__name__]
    result: Dict[str, Any] = {kind: run_cases(me, groups[kind], kind, rank, backend, device, names, singles)
                              for kind in KINDS}
    chosen = [c for c in cases() if c.name in names]
    hidden = any(c.op == "logprobs_from_hidden" for c in chosen)
    # the bad inputs call logprobs_and_entropy: only where the backend runs the logits cases
    logits = any(c.shard_ops == ("shard_stats", "shard_grad") for c in chosen)
    result["errors"] = bad_inputs(rank, backend, device, groups["pairs"], hidden) if logits else {}
    return result


# ------------------------------------------------------------------------ bad input
#: name -> (regular expression every rank's error must match, exception type name)
BAD_INPUTS = {
    "widths-differ": (r"different widths .* vocab_start was not given", "GroupMismatchError"),
    "vocab-start-outside": (r"rank 1: vocab_start=99999 is outside the vocabulary of 16384", "GroupMismatchError"),
    "shards-overlap": (r"do not tile \[0, 16384\): rank \d's shard starts at 0 and overlaps", "GroupMismatchError"),
    "vocab-start-on-some-ranks": (r"vocab_start was given on ranks \[0, 1, 2\] but not on ranks \[3\]",
                                  "GroupMismatchError"),
    "labels-differ": (r"labels differ across the group: ranks \[3\]", "GroupMismatchError"),
    "temperature-differs": (r"ranks \[2\] disagree with rank 0 on the temperature \(rank 0: 0.7, rank 2: 0.5\)",
                            "GroupMismatchError"),
    "integer-logits-on-one-rank": (r"rank 1 of the process group: logits must be a floating-point tensor",
                                   "TypeError"),
    "labels-shape-on-one-rank": (r"rank 0 of the process group: labels shape \(3, 2\) does not match",
                                 "ValueError"),
    "unknown-backend-on-one-rank": (r"rank 2 of the process group: no backend named 'no-such-backend'",
                                    "NoEligibleBackendError"),
    "label-out-of-range": (r"label 16384 at position \(1, 1\) is out of range for a vocabulary of 16384",
                           "ValueError"),
    "hidden-gradients-on-some-ranks": (r"disagree with rank 0 on the call's options", "GroupMismatchError"),
    "not-a-member": (r"is not a member of process_group", "ValueError"),
}


def bad_inputs(rank: int, backend: str, device: str, pairs, hidden: bool) -> Dict[str, Tuple[str, str]]:
    """Each bad input on the group of four (the last on the pairs); per case this rank's
    ``(exception type, message)``, or ``("", "no error")``. A final good call proves that the
    group is still in step."""
    import torch.distributed as dist

    import logprob_registry as lr

    dev = torch.device(device)
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(*SHAPE, VOCAB, generator=g) * 3).to(dev)
    labels = torch.randint(0, VOCAB, SHAPE, generator=g).to(dev)
    width = VOCAB // WORLD
    shard = full[..., rank * width:(rank + 1) * width]
    world = dist.group.WORLD
    results: Dict[str, Tuple[str, str]] = {}

    def attempt(name, fn):
        try:
            fn()
            results[name] = ("", "no error")
        except Exception as exc:
            results[name] = (type(exc).__name__, str(exc))

    def call(x=shard, y=labels, **kw):
        kw = dict(dict(process_group=world, backend=backend, temperature=0.7, ignore_index=IGNORE), **kw)
        return lr.logprobs_and_entropy(x, y, **kw)

    attempt("widths-differ", lambda: call(x=shard[..., :2048] if rank == 3 else shard))
    attempt("vocab-start-outside", lambda: call(vocab_start=99999 if rank == 1 else rank * width))
    attempt("shards-overlap", lambda: call(vocab_start=0 if rank == 2 else rank * width))
    attempt("vocab-start-on-some-ranks", lambda: call(**({} if rank == 3 else {"vocab_start": rank * width})))
    changed = labels.clone()
    changed[1, 1] += 1
    attempt("labels-differ", lambda: call(y=changed if rank == 3 else labels))
    attempt("temperature-differs", lambda: call(temperature=0.5 if rank == 2 else 0.7))
    attempt("integer-logits-on-one-rank", lambda: call(x=shard.long() if rank == 1 else shard))
    attempt("labels-shape-on-one-rank", lambda: call(y=labels.reshape(3, 2) if rank == 0 else labels))
    attempt("unknown-backend-on-one-rank", lambda: call(backend="no-such-backend" if rank == 2 else backend))
    out_of_range = labels.clone()
    out_of_range[1, 1] = VOCAB
    attempt("label-out-of-range", lambda: call(y=out_of_range))

    def hidden_call():  # rank 0 asks for no gradient: the others' backward would wait for it
        h = torch.randn(*SHAPE, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dev)
        w = torch.randn(width, HIDDEN, generator=torch.Generator().manual_seed(4 + rank)).to(dev)
        lr.logprobs_from_hidden(h.requires_grad_(rank != 0), w.requires_grad_(rank != 0), labels,
                                process_group=world, backend=backend)

    if hidden:
        attempt("hidden-gradients-on-some-ranks", hidden_call)

    def member_call():  # ranks 2 and 3 hold GroupMember.NON_GROUP_MEMBER for the pair (0, 1)
        half = full[..., (rank % 2) * (VOCAB // 2):(rank % 2 + 1) * (VOCAB // 2)]
        call(x=half, process_group=pairs[0])

    attempt("not-a-member", member_call)
    attempt("still-in-step", lambda: call())
    return results

