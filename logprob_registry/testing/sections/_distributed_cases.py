"""The rank side of the conformance suite's distributed section (:mod:`.distributed`): the cases,
their inputs, and the program every rank of a spawned group runs. Imports no pytest: it runs in the
spawned processes.

One spawn of four processes covers groups of 1, 2 and 4 ranks: every rank alone (four groups of
one), two groups of two (ranks 0 and 1 split the vocabulary evenly with the default
``vocab_start``; ranks 2 and 3 unevenly, in reverse order, with explicit ``vocab_start``), and the
default group of four. Every case runs in each; a rank returns its outputs, and checks its own
shard's gradients itself (against float64 autograd, and bitwise against the gradient it computed
alone), since it holds the inputs: only small results travel back.

``kl_divergence`` cases (ops ``kl_shard_stats``, ``kl_shard_grad``) run in the same groups: both
sides' shards of the same columns on each rank (logits, or hidden states with their weight shards);
their inputs are named as the logits ops' (``logits``: the student's logits; ``hidden``, ``weight``:
the student's hidden states and weight) so that the gradients are checked alike, and each rank
records whether a gradient reached the teacher (it must not).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from logprob_registry.numerics import (
    EPS32,
    gradient_rounding,
    hidden_magnitude,
    subnormal_spacing,
    tolerance,
    tolerances,
)

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
    op: str                       # logprobs, entropy, logprobs_and_entropy, logprobs_from_hidden, kl_divergence
    dtype: str
    temperature: float = 1.0
    ignore: bool = False          # ignore_index=-100 on two positions
    masked: bool = False          # a tile of -inf and scattered -inf entries (logits ops)
    vocab: int = VOCAB
    bias: bool = False            # logprobs_from_hidden
    entropy: bool = False         # logprobs_from_hidden: return_entropy
    inplace: bool = False         # inplace_backward=True, on a non-leaf
    direction: str = "forward"    # kl_divergence
    hidden: bool = False          # kl_divergence: both sides hidden states with weight shards (kl_hidden)

    @property
    def aligned(self) -> bool:
        return self.vocab == VOCAB

    @property
    def kl(self) -> bool:
        return self.op == "kl_divergence"

    @property
    def shard_ops(self) -> Tuple[str, ...]:
        """The shard ops the case runs on."""
        if self.kl:
            return KL_SHARD_OPS
        return ("hidden_shard_stats", "hidden_shard_grad") if self.op == "logprobs_from_hidden" else \
            ("shard_stats", "shard_grad")

    @property
    def features(self) -> Tuple[str, ...]:
        """The backend features (``opspec.FEATURES``) the case needs."""
        return ("kl_hidden",) if self.hidden else ()


KL_SHARD_OPS = ("kl_shard_stats", "kl_shard_grad")


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
    # kl_divergence: temperature 0.7 and a mask (two positions False) in each; few, as every case
    # runs in each group
    out.append(Case("kl-forward-float32", "kl_divergence", "float32", temperature=0.7, masked=True))
    out.append(Case("kl-reverse-float32", "kl_divergence", "float32", temperature=0.7, masked=True,
                    direction="reverse"))
    out.append(Case("kl-reverse-bfloat16", "kl_divergence", "bfloat16", temperature=0.7, masked=True,
                    direction="reverse"))
    out.append(Case("kl-forward-float32-hidden", "kl_divergence", "float32", temperature=0.7, masked=True,
                    hidden=True))
    return out


def outputs_of(case: Case) -> int:
    if case.kl:
        return 1
    if case.op == "logprobs_from_hidden":
        return 1 + case.entropy
    return 2 if case.op == "logprobs_and_entropy" else 1


def inputs(case: Case) -> Dict[str, torch.Tensor]:
    """The case's full (unsharded) inputs on the CPU, the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(hash_name(case.name))
    dtype = getattr(torch, case.dtype)
    if case.kl:
        return _kl_inputs(case, g, dtype)
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


def _kl_inputs(case: Case, g: torch.Generator, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Student (``logits``; or ``hidden`` and ``weight``) and teacher (``teacher``; or
    ``teacher_hidden`` and ``teacher_weight``), the mask and the upstream gradient."""
    out: Dict[str, torch.Tensor] = {}
    if case.hidden:
        for prefix in ("", "teacher_"):
            out[prefix + "hidden"] = torch.randn(*SHAPE, HIDDEN, generator=g).to(dtype)
            out[prefix + "weight"] = (torch.randn(case.vocab, HIDDEN, generator=g) * 0.4).to(dtype)
    else:
        out["logits"] = (torch.randn(*SHAPE, case.vocab, generator=g, dtype=torch.float64) * 3.0).to(dtype)
        out["teacher"] = (torch.randn(*SHAPE, case.vocab, generator=g, dtype=torch.float64) * 3.0).to(dtype)
    mask = torch.ones(SHAPE, dtype=torch.bool)
    if case.masked:
        mask[0, 1] = mask[1, 2] = False
    out["mask"] = mask
    out["upstream"] = torch.randn(1, *SHAPE, generator=g, dtype=torch.float64)
    return out


def kl_options(case: Case, data: Dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> dict:
    """``kl_divergence``'s options of the unsharded call but the student's weight (the teacher's
    weight in ``dtype``, when given)."""
    kw: dict = dict(direction=case.direction, temperature=case.temperature, mask=data["mask"])
    if case.hidden:
        w = data["teacher_weight"]
        kw["teacher_weight"] = w if dtype is None else w.to(dtype)
    return kw


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
    ups = data["upstream"]
    if case.kl:
        names = ("hidden", "weight") if case.hidden else ("logits",)
        leaves = {k: data[k].detach().double().requires_grad_(True) for k in names}
        teacher = data["teacher_hidden" if case.hidden else "teacher"].double()
        kl = ref.kl_divergence(leaves[names[0]], teacher, student_weight=leaves.get("weight"),
                               **kl_options(case, data, torch.float64))
        (kl * ups[0]).sum().backward()
        return (kl.detach(),), {k: v.grad for k, v in leaves.items()}
    kw = options(case)
    kw.pop("inplace_backward", None)
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
    if case.kl:
        return (kl_tolerance(case, data),)
    if op == "logprobs_from_hidden":
        bound = data["hidden"].detach().double().abs() @ data["weight"].detach().double().abs().T
        if "bias" in data:
            bound = bound + data["bias"].detach().double().abs()
        kinds = ("logprobs", "entropy")[:outputs_of(case)]
        like = torch.empty(1, case.vocab)
        return tuple(tolerance(like, case.temperature, float(bound.max()), k) for k in kinds)
    return tolerances(op, data["logits"], case.temperature)


def kl_tolerance(case: Case, data: Dict[str, torch.Tensor]) -> float:
    """The error allowed on one KL value (as the distill section's): the larger of the two sides'
    log-probability tolerances times ``2 + A``, ``A`` the largest ``sum p |log p - log q|``."""
    tols = []
    if case.hidden:
        for prefix in ("", "teacher_"):
            h, w = data[prefix + "hidden"], data[prefix + "weight"]
            tols.append(tolerance(torch.empty(1, case.vocab), case.temperature, hidden_magnitude(h, w)))
        s, t = data["hidden"].double(), data["teacher_hidden"].double()
        sides = dict(student_weight=data["weight"].double(), teacher_weight=data["teacher_weight"].double())
    else:
        s, t = data["logits"].double(), data["teacher"].double()
        tols = [tolerance(s, case.temperature), tolerance(t, case.temperature)]
        sides = {}
    with torch.no_grad():
        log_p, log_q = ref.kl_distributions(s, t, direction=case.direction, temperature=case.temperature, **sides)
        terms = log_p.exp() * (log_p - log_q).abs()
        terms = torch.where(torch.isfinite(terms), terms, torch.zeros_like(terms))
    return max(tols) * (2 + float(terms.sum(-1).max()))


def _kl_gradient_excess(case: Case, data, got, want, columns) -> Dict[str, float]:
    """The distill section's gradient tolerances: ``4 tol max|upstream| / T`` (times the sum of the
    other factor's ``|.|`` and ``2 + log V`` for hidden states and weight), plus one rounding of the
    gradient's dtype relative to it. A missing gradient is off by inf."""
    dtype = getattr(torch, case.dtype)
    g_tol = 4 * kl_tolerance(case, data) * float(data["upstream"].abs().max()) / case.temperature
    rtol = gradient_rounding(dtype) + 4 * EPS32
    out = {}
    for name, g in got.items():
        if g is None:
            out[name] = math.inf
            continue
        w = want[name][columns[name]]
        atol = g_tol
        if name == "hidden":  # a sum over the vocabulary of the logits' gradients times |weight|
            atol = g_tol * float(data["weight"].double().abs().sum(0).max()) * (2 + math.log(case.vocab))
        elif name == "weight":  # a sum over the rows of the logits' gradients times |hidden|
            h = data["hidden"].double().reshape(-1, HIDDEN)
            atol = g_tol * float(h.abs().sum(0).max()) * (2 + math.log(case.vocab))
        allowed = atol + subnormal_spacing(dtype) + rtol * w.abs()
        err = (g.detach().cpu().double() - w).abs()
        out[name] = float((err - allowed).nan_to_num(nan=math.inf).max()) if err.numel() else -1.0
    return out


def _grad_eps(dtype: torch.dtype) -> float:
    return max(torch.finfo(dtype).eps, 4 * EPS32) if dtype != torch.float64 else 4 * EPS32


def gradient_excess(case: Case, data, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                    columns: Dict[str, slice]) -> Dict[str, float]:
    """Per input: ``max(|got - want| - allowed)`` (<= 0 passes), with the suite's gradient
    tolerances; ``columns`` selects this rank's shard of ``want`` (the whole tensor for hidden)."""
    if case.kl:
        return _kl_gradient_excess(case, data, got, want, columns)
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
    teacher_grad: Optional[bool] = None                            # kl_divergence: a gradient reached the teacher
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


def _call_kl(case: Case, data, start: int, width: int, give_start: bool, group, backend: str, device):
    """The sharded ``kl_divergence`` with gradients (the teacher's shards require grad too);
    returns (outputs, the student's gradients by input name, whether a gradient reached the teacher)."""
    import logprob_registry as lr

    kw = dict(direction=case.direction, temperature=case.temperature, mask=data["mask"].to(device),
              process_group=group, backend=backend)
    if give_start:
        kw["vocab_start"] = start
    cols = slice(start, start + width)
    if case.hidden:
        leaves = {"hidden": data["hidden"].to(device, copy=True).requires_grad_(True),
                  "weight": data["weight"][cols].to(device, copy=True).requires_grad_(True)}
        teachers = [data["teacher_hidden"].to(device, copy=True).requires_grad_(True),
                    data["teacher_weight"][cols].to(device, copy=True).requires_grad_(True)]
        kl = lr.kl_divergence(leaves["hidden"], teachers[0], student_weight=leaves["weight"],
                              teacher_weight=teachers[1], **kw)
    else:
        leaves = {"logits": data["logits"].to(device, copy=True)[..., cols].requires_grad_(True)}
        teachers = [data["teacher"].to(device, copy=True)[..., cols].requires_grad_(True)]
        kl = lr.kl_divergence(leaves["logits"], teachers[0], **kw)
    (kl * data["upstream"][0].to(kl.device, kl.dtype)).sum().backward()
    return [kl.detach().cpu()], {k: v.grad for k, v in leaves.items()}, any(t.grad is not None for t in teachers)


def run_cases(group, kind: str, rank: int, backend: str, device: str, names: Tuple[str, ...],
              singles: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Outcome]:
    out: Dict[str, Outcome] = {}
    for case in cases():
        if case.name not in names:
            continue
        data = inputs(case)
        start, width, give = split(kind, rank, case.vocab)
        teacher_grad = shard = None
        if case.kl:
            outs, grads, teacher_grad = _call_kl(case, data, start, width, give, group, backend, torch.device(device))
        else:
            outs, grads, shard = _call(case, data, start, width, give, group, backend, torch.device(device))
        _, want = reference(case, data)
        cols = slice(start, start + width)
        columns = {"logits": (Ellipsis, cols), "weight": cols, "bias": cols, "hidden": Ellipsis}
        o = Outcome(outs, gradient_excess(case, data, grads, want, columns), start=start, width=width,
                    teacher_grad=teacher_grad)
        if kind == "single":
            singles[case.name] = {k: g.detach().cpu() for k, g in grads.items() if g is not None}
            o.digests = {k: digest(g) for k, g in grads.items()}
        else:
            for name, g in grads.items():
                if g is None or name not in singles[case.name] and name != "hidden":
                    continue  # a missing gradient: gradient_excess reports it
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


def rank_program(rank: int, world: int, backend: str, device: str, names: Tuple[str, ...],
                 sampler: Tuple[str, ...] = ()) -> dict:
    """What every rank of the spawned group runs (see the module docstring): the cases ``names``, and
    the sampler cases ``sampler`` (:func:`run_sampler`) in the same groups."""
    import torch.distributed as dist

    if world != WORLD:
        raise ValueError(f"the distributed section runs on a group of {WORLD}, got {world}")
    singles_groups = [dist.new_group([r]) for r in range(world)]   # every rank calls new_group for every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles: Dict[str, Dict[str, torch.Tensor]] = {}
    result = {"single": run_cases(singles_groups[rank], "single", rank, backend, device, names, singles)}
    result["pair"] = run_cases(pairs[rank // 2], "pair", rank, backend, device, names, singles)
    result["world"] = run_cases(dist.group.WORLD, "world", rank, backend, device, names, singles)
    chosen = [c for c in cases() if c.name in names]
    hidden = any(c.op == "logprobs_from_hidden" for c in chosen)
    # the bad inputs call logprobs_and_entropy: only where the backend runs the logits cases
    logits = any(c.shard_ops == ("shard_stats", "shard_grad") for c in chosen)
    result["errors"] = bad_inputs(rank, backend, device, pairs, hidden) if logits else {}
    if sampler:
        groups = {"single": singles_groups[rank], "pair": pairs[rank // 2], "world": dist.group.WORLD}
        result["sampler"] = run_sampler(rank, groups, backend, sampler, device)
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


# ------------------------------------------------- the sampler's keywords with process_group=
# One spawn of four covers groups of 1, 2 and 4 (as run_group): every case's outputs on every rank
# and each rank's shard gradient come back; tests/test_distributed_sampler.py compares them with
# each other (bits) and with the unsharded float64 reference (the numerical contract).
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


def sampler_program(rank: int, world: int, backend: str, names: Tuple[str, ...], device: str = "cpu"):
    """What every rank of the spawned group of four runs: each case in its group of 1, 2 and 4 ranks;
    returns {kind: {case: (outputs, gradients, start, width)}} and the mismatch errors."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {"single": singles[rank], "pair": pairs[rank // 2], "world": dist.group.WORLD}
    return run_sampler(rank, groups, backend, names, device)


def run_sampler(rank: int, groups: Dict[str, Any], backend: str, names: Tuple[str, ...], device: str = "cpu"):
    """The sampler cases ``names`` in each group of ``groups`` (kind -> this rank's group), then the
    bad inputs on the group of four."""
    result: Dict[str, Any] = {}
    for kind, group in groups.items():
        result[kind] = {}
        for name in names:
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
    :func:`sampler_program`): outputs against float64 (-inf exactly where the reference has it),
    shard gradients against the reference's columns, every rank's outputs and, with ``invariant``
    (a backend declaring group_invariant), the same columns' gradients bitwise equal across groups
    of 1, 2 and 4; the bad inputs' errors on every rank."""
    problems: List[str] = []
    for name in names:
        want, want_grads = sampler_reference(name)
        rtol, atol = SAMPLER_TOLERANCE[sampler_cases()[name]["dtype"]]
        first = ranks[0]["single"][name]
        for kind in KINDS:
            for rank, got_all in enumerate(ranks):
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
