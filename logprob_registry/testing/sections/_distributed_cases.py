"""The rank side of the conformance suite's distributed section (:mod:`.distributed`): the cases,
their inputs, and the program every rank of a spawned group runs. Imports no pytest: it runs in the
spawned processes.

One spawn of four processes covers groups of 1, 2 and 4 ranks: every rank alone (four groups of
one), two groups of two (ranks 0 and 1 split the vocabulary evenly with the default
``vocab_start``; ranks 2 and 3 unevenly, in reverse order, with explicit ``vocab_start``), and the
default group of four. Every case runs in each; a rank returns its outputs, and checks its own
shard's gradients itself (against float64 autograd, and bitwise against the gradient it computed
alone), since it holds the inputs: only small results travel back.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from logprob_registry.numerics import EPS32, tolerance, tolerances

from ... import reference as ref

WORLD = 4
SHAPE = (2, 3)            # leading dims of every case
VOCAB = 16384             # four tiles of 4096: every split below is tile-aligned
ODD_VOCAB = 13192         # 8192 + 5000: not a multiple of the tile; values only
HIDDEN = 32
KINDS = ("single", "pair", "world")  # groups of 1, 2 and 4 ranks
IGNORE = -100


@dataclass(frozen=True)
class Case:
    """One call: the op, the input dtype, and its options."""

    name: str
    op: str                       # logprobs, entropy, logprobs_and_entropy, logprobs_from_hidden
    dtype: str
    temperature: float = 1.0
    ignore: bool = False          # ignore_index=-100 on two positions
    masked: bool = False          # a tile of -inf and scattered -inf entries (logits ops)
    vocab: int = VOCAB
    bias: bool = False            # logprobs_from_hidden
    entropy: bool = False         # logprobs_from_hidden: return_entropy
    inplace: bool = False         # inplace_backward=True, on a non-leaf

    @property
    def aligned(self) -> bool:
        return self.vocab == VOCAB


def cases() -> List[Case]:
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
    return out


def outputs_of(case: Case) -> int:
    if case.op == "logprobs_from_hidden":
        return 1 + case.entropy
    return 2 if case.op == "logprobs_and_entropy" else 1


def inputs(case: Case) -> Dict[str, torch.Tensor]:
    """The case's full (unsharded) inputs on the CPU, the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(hash_name(case.name))
    dtype = getattr(torch, case.dtype)
    labels = torch.randint(0, case.vocab, SHAPE, generator=g)
    out: Dict[str, torch.Tensor] = {}
    if case.op == "logprobs_from_hidden":
        out["hidden"] = torch.randn(*SHAPE, HIDDEN, generator=g).to(dtype)
        out["weight"] = (torch.randn(case.vocab, HIDDEN, generator=g) * 0.4).to(dtype)
        if case.bias:
            out["bias"] = (torch.randn(case.vocab, generator=g) * 0.5).to(dtype)
    else:
        logits = torch.randn(*SHAPE, case.vocab, generator=g, dtype=torch.float64) * 3.0
        if case.masked:
            logits[1, 0, 4096:8192] = float("-inf")  # a whole tile
            logits[0, 2, ::7] = float("-inf")
            labels[1, 0], labels[0, 2] = 100, 3  # not on a -inf entry
        out["logits"] = logits.to(dtype)
    if case.ignore:
        labels[0, 1] = labels[1, 2] = IGNORE
    out["labels"] = labels
    out["upstream"] = torch.randn(outputs_of(case), *SHAPE, generator=g, dtype=torch.float64)
    return out


def hash_name(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)


def split(kind: str, rank: int, vocab: int) -> Tuple[int, int, bool]:
    """``(start, width, pass vocab_start)`` of ``rank``'s shard in a group of ``kind``."""
    if kind == "single":
        return 0, vocab, False
    if kind == "world":
        return rank * (vocab // WORLD), vocab // WORLD, False
    if rank < 2:  # ranks 0 and 1: even halves, default vocab_start
        return (rank % 2) * (vocab // 2), vocab // 2, False
    tail = 4096 if vocab % 4096 == 0 else vocab - 8192
    return (vocab - tail, tail, True) if rank == 2 else (0, vocab - tail, True)  # reversed, explicit


def options(case: Case) -> dict:
    kw: dict = dict(temperature=case.temperature)
    if case.op != "entropy":
        kw["ignore_index"] = IGNORE if case.ignore else None
    if case.op == "logprobs_from_hidden":
        kw["return_entropy"] = case.entropy
    elif case.op != "entropy":
        kw["inplace_backward"] = case.inplace
    return kw


def digest(t: Optional[torch.Tensor]) -> str:
    """The exact bits of ``t`` (signed zeros and NaN payloads included)."""
    if t is None:
        return "none"
    t = t.detach().cpu().contiguous()
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest() + str(t.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and digest(a) == digest(b)


# ------------------------------------------------------------------------ float64 reference
def reference(case: Case, data: Dict[str, torch.Tensor]):
    """Outputs and input gradients (dict) of the unsharded call in float64 autograd."""
    kw = options(case)
    kw.pop("inplace_backward", None)
    ups = data["upstream"]
    if case.op == "logprobs_from_hidden":
        leaves = {k: data[k].detach().double().requires_grad_(True) for k in ("hidden", "weight", "bias")
                  if k in data}
        outs = ref.logprobs_from_hidden(leaves["hidden"], leaves["weight"], data["labels"], bias=leaves.get("bias"),
                                        **kw)
    else:
        leaves = {"logits": data["logits"].detach().double().requires_grad_(True)}
        fn = {"logprobs": ref.logprobs, "entropy": ref.entropy, "logprobs_and_entropy": ref.logprobs_and_entropy}
        args = (leaves["logits"],) if case.op == "entropy" else (leaves["logits"], data["labels"])
        outs = fn[case.op](*args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    return tuple(o.detach() for o in outs), {k: v.grad for k, v in leaves.items()}


def output_tolerances(case: Case, data: Dict[str, torch.Tensor]) -> tuple:
    """The contract's tolerance of each output (:mod:`..numerics`)."""
    op = case.op
    if op == "logprobs_from_hidden":
        bound = data["hidden"].detach().double().abs() @ data["weight"].detach().double().abs().T
        if "bias" in data:
            bound = bound + data["bias"].detach().double().abs()
        kinds = ("logprobs", "entropy")[:outputs_of(case)]
        like = torch.empty(1, case.vocab)
        return tuple(tolerance(like, case.temperature, float(bound.max()), k) for k in kinds)
    return tolerances(op, data["logits"], case.temperature)


def _grad_eps(dtype: torch.dtype) -> float:
    return max(torch.finfo(dtype).eps, 4 * EPS32) if dtype != torch.float64 else 4 * EPS32


def gradient_excess(case: Case, data, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                    columns: Dict[str, slice]) -> Dict[str, float]:
    """Per input: ``max(|got - want| - allowed)`` (<= 0 passes), with the suite's gradient
    tolerances; ``columns`` selects this rank's shard of ``want`` (the whole tensor for hidden)."""
    dtype = getattr(torch, case.dtype)
    out = {}
    if case.op != "logprobs_from_hidden":
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
    kw.pop("return_entropy")
    op = "logprobs_and_entropy" if case.entropy else "logprobs"
    lo = ref.logprobs_and_entropy(logits, data["labels"], **kw) if case.entropy else \
        (ref.logprobs(logits, data["labels"], **kw),)
    dlog = torch.autograd.grad(sum((o * u).sum() for o, u in zip(lo, data["upstream"])), logits)[0].abs()
    flat = dlog.reshape(-1, dlog.shape[-1])
    bounds = {"hidden": dlog @ wt.abs(), "weight": flat.T @ h.abs().reshape(-1, h.shape[-1]), "bias": flat.sum(0)}
    tol = max(output_tolerances(case, data))
    rel = 4 * tol + 2 * _grad_eps(dtype)
    del op
    for name, g in got.items():
        if g is None:
            continue
        w = want[name][columns[name]]
        bound = bounds[name][columns[name]]
        out[name] = float(((g.cpu().double() - w).abs() - (rel * bound + 1e-30)).max())
    return out


# ------------------------------------------------------------------------ the rank program
@dataclass
class Outcome:
    """One case in one group, on one rank."""

    outputs: List[torch.Tensor] = field(default_factory=list)
    excess: Dict[str, float] = field(default_factory=dict)        # gradient error beyond the contract
    bitwise: Dict[str, bool] = field(default_factory=dict)        # shard gradients == own single-group ones
    digests: Dict[str, str] = field(default_factory=dict)         # complete gradients (hidden; single: all)
    inplace_ok: Optional[bool] = None
    start: int = 0
    width: int = 0


def _call(case: Case, data, start: int, width: int, give_start: bool, group, backend: str, device):
    """The sharded call with gradients; returns (outputs, gradients by input name, logits for inplace)."""
    import logprob_registry as lr

    kw = dict(options(case), process_group=group, backend=backend)
    if give_start:
        kw["vocab_start"] = start
    cols = slice(start, start + width)
    if case.op == "logprobs_from_hidden":
        leaves = {"hidden": data["hidden"].to(device, copy=True).requires_grad_(True),
                  "weight": data["weight"][cols].to(device, copy=True).requires_grad_(True)}
        if "bias" in data:
            leaves["bias"] = data["bias"][cols].to(device, copy=True).requires_grad_(True)
        outs = lr.logprobs_from_hidden(leaves["hidden"], leaves["weight"], data["labels"].to(device),
                                       bias=leaves.get("bias"), **kw)
        shard = None
    else:
        base = data["logits"].to(device, copy=True)[..., cols].requires_grad_(True)  # a strided view
        shard = base * 1.0 if case.inplace else base  # a non-leaf for in-place backward, as an lm_head's output
        leaves = {"logits": base}
        fn = {"logprobs": lr.logprobs_from_logits, "entropy": lr.entropy_from_logits,
              "logprobs_and_entropy": lr.logprobs_and_entropy}[case.op]
        args = (shard,) if case.op == "entropy" else (shard, data["labels"].to(device))
        outs = fn(*args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = data["upstream"]
    sum((o * u.to(o.device, o.dtype)).sum() for o, u in zip(outs, ups)).backward()
    return [o.detach().cpu() for o in outs], {k: v.grad for k, v in leaves.items()}, shard


def run_cases(group, kind: str, rank: int, backend: str, device: str, names: Tuple[str, ...],
              singles: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Outcome]:
    out: Dict[str, Outcome] = {}
    for case in cases():
        if case.name not in names:
            continue
        data = inputs(case)
        start, width, give = split(kind, rank, case.vocab)
        outs, grads, shard = _call(case, data, start, width, give, group, backend, torch.device(device))
        _, want = reference(case, data)
        cols = slice(start, start + width)
        columns = {"logits": (Ellipsis, cols), "weight": cols, "bias": cols, "hidden": Ellipsis}
        o = Outcome(outs, gradient_excess(case, data, grads, want, columns), start=start, width=width)
        if kind == "single":
            singles[case.name] = {k: g.detach().cpu() for k, g in grads.items()}
            o.digests = {k: digest(g) for k, g in grads.items()}
        else:
            for name, g in grads.items():
                if name == "hidden":
                    o.digests[name] = digest(g)
                    continue
                alone = singles[case.name][name]
                o.bitwise[name] = same_bits(g.cpu(), alone[..., cols] if name == "logits" else alone[cols])
        if case.inplace:
            o.inplace_ok = bool(torch.allclose(shard.detach().cpu().double(), grads["logits"].cpu().double(),
                                               rtol=0, atol=0))
        out[case.name] = o
    return out


def rank_program(rank: int, world: int, backend: str, device: str, names: Tuple[str, ...]) -> dict:
    """What every rank of the spawned group runs (see the module docstring): the cases ``names``."""
    import torch.distributed as dist

    if world != WORLD:
        raise ValueError(f"the distributed section runs on a group of {WORLD}, got {world}")
    singles_groups = [dist.new_group([r]) for r in range(world)]   # every rank calls new_group for every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles: Dict[str, Dict[str, torch.Tensor]] = {}
    result = {"single": run_cases(singles_groups[rank], "single", rank, backend, device, names, singles)}
    result["pair"] = run_cases(pairs[rank // 2], "pair", rank, backend, device, names, singles)
    result["world"] = run_cases(dist.group.WORLD, "world", rank, backend, device, names, singles)
    hidden = any(c.op == "logprobs_from_hidden" for c in cases() if c.name in names)
    result["errors"] = bad_inputs(rank, backend, device, pairs, hidden)
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
