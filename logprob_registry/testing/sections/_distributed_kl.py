"""The ``kl_divergence`` family of the conformance suite's distributed section
(:mod:`._distributed_cases` runs it; shard ops ``kl_shard_stats``, ``kl_shard_grad``): both sides'
shards of the same columns on each rank (logits, or hidden states with their weight shards). Their
inputs are named as the logits family's (``logits``: the student's logits; ``hidden``, ``weight``:
the student's hidden states and weight) so that the gradients are checked alike, and each rank
records whether a gradient reached the teacher (it must not). Imports no pytest: it runs in the
spawned processes."""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from logprob_registry.numerics import EPS32, gradient_rounding, hidden_magnitude, subnormal_spacing, tolerance

from ... import reference as ref
from ._distributed_common import HIDDEN, KINDS, SHAPE, Case, hash_name, run_cases

FAMILY = "kl"


def cases() -> List[Case]:
    """The kl_divergence cases: temperature 0.7 and a mask (two positions False) in each; few, as
    every case runs in each group."""
    out = []
    out.append(Case("kl-forward-float32", "kl_divergence", "float32", temperature=0.7, masked=True))
    out.append(Case("kl-reverse-float32", "kl_divergence", "float32", temperature=0.7, masked=True,
                    direction="reverse"))
    out.append(Case("kl-reverse-bfloat16", "kl_divergence", "bfloat16", temperature=0.7, masked=True,
                    direction="reverse"))
    out.append(Case("kl-forward-float32-hidden", "kl_divergence", "float32", temperature=0.7, masked=True,
                    hidden=True))
    return out


def inputs(case: Case) -> Dict[str, torch.Tensor]:
    """The case's full (unsharded) inputs on the CPU, the same on every rank and in the parent:
    student (``logits``; or ``hidden`` and ``weight``) and teacher (``teacher``; or
    ``teacher_hidden`` and ``teacher_weight``), the mask and the upstream gradient."""
    g = torch.Generator().manual_seed(hash_name(case.name))
    dtype = getattr(torch, case.dtype)
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


def reference(case: Case, data: Dict[str, torch.Tensor]):
    """The KL and the student's gradients (dict) of the unsharded call in float64 autograd."""
    ups = data["upstream"]
    names = ("hidden", "weight") if case.hidden else ("logits",)
    leaves = {k: data[k].detach().double().requires_grad_(True) for k in names}
    teacher = data["teacher_hidden" if case.hidden else "teacher"].double()
    kl = ref.kl_divergence(leaves[names[0]], teacher, student_weight=leaves.get("weight"),
                           **kl_options(case, data, torch.float64))
    (kl * ups[0]).sum().backward()
    return (kl.detach(),), {k: v.grad for k, v in leaves.items()}


def output_tolerances(case: Case, data: Dict[str, torch.Tensor]) -> tuple:
    """The contract's tolerance of the KL (:mod:`logprob_registry.numerics`)."""
    return (kl_tolerance(case, data),)


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


def gradient_excess(case: Case, data, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                    columns: Dict[str, slice]) -> Dict[str, float]:
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


def call(case: Case, data, start: int, width: int, give_start: bool, group, backend: str, device):
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


def run(rank: int, groups: Dict[str, Any], backend: str, device: str, names: Tuple[str, ...]) -> dict:
    """This rank's side of the family: ``{kind: {case: Outcome}}`` for the cases ``names`` in each
    group (``groups``: kind -> this rank's group)."""
    singles: Dict[str, Dict[str, torch.Tensor]] = {}
    me = sys.modules[__name__]
    return {kind: run_cases(me, groups[kind], kind, rank, backend, device, names, singles) for kind in KINDS}
