"""DTensor inputs: every public op on ``torch.distributed.tensor.DTensor`` logits (or hidden states
and an lm_head weight; ``kl_divergence``: a student's and a teacher's side, each either, placed
alike), on a device mesh of any number of dims (tested: 1-D and 2-D).

The placements say what runs (docs/distributed.md#dtensor):

- ``Shard`` on the vocabulary dim (the logits' last dim, the weight's first) on one mesh dim: the
  ``process_group=`` path over that mesh dim's group (``mesh.get_group(dim)``), with this rank's
  shard placed at its real global offset (torch's own ``compute_local_shape_and_global_offset``:
  uneven vocabularies included). The same bits as that path called by hand.
- ``Replicate``, or ``Shard`` on a leading dim: rows this rank holds; they run locally.
- Anything else (``Partial``, a sharded hidden dimension, the vocabulary sharded over two mesh
  dims or strided) raises an error naming the placement, on every rank (placements are the same
  on every rank).

Labels, a mask, support ids (and hidden states) are DTensors on the same mesh (redistributed to the logits' leading
placements when placed otherwise, replicated over the vocabulary's mesh dim) or plain tensors of
this rank's local rows. The call itself is the plain call on the local tensors (``to_local``, which
autograd differentiates), so validation, dispatch and the distributed path are the usual ones. The
outputs are DTensors (``from_local``): replicated over the vocabulary's mesh dim, placed like the
rows over the others. Gradients come back as DTensors with the inputs' placements; a weight (or
bias) replicated over a mesh dim whose rows are sharded gets a ``Partial`` gradient there (each
rank's rows' share; ``full_tensor()`` or ``redistribute`` sums them), as DTensor's own matmul gives.

Nothing here is imported unless a DTensor reaches a public function: :func:`involved` is called
only once ``torch.distributed.tensor`` has been imported by someone.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..opspec import OPS

_REDISTRIBUTE = ("redistribute it first (x.redistribute(mesh, placements)), or pass x.to_local() / "
                 "x.full_tensor() as a plain tensor")


def involved(op: str, given: Mapping[str, Any]) -> bool:
    """Whether any argument of a call of ``op``'s public function that may be a DTensor is one (the
    op table's ``OpSpec.placed``; once one is, any other DTensor argument is refused by the plan)."""
    for name in OPS[op].placed:
        value = given.get(name)
        if value is not None and value.__class__ is not torch.Tensor and isinstance(value, DTensor):
            return True
    return False


def _shown(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _unsupported(name: str, x: DTensor, mesh_dim: int, why: str) -> ValueError:
    p = x.placements[mesh_dim]
    return ValueError(f"{name} is a DTensor placed {_shown(x.placements)} on a mesh of shape "
                      f"{tuple(x.device_mesh.shape)}: {p!r} on mesh dim {mesh_dim} is not supported ({why}); "
                      f"{_REDISTRIBUTE}")


def _same_mesh(mesh, name: str, x: DTensor, against: str) -> None:
    if x.device_mesh != mesh:
        raise ValueError(f"{name} and {against} are DTensors of different device meshes ({name}: {x.device_mesh}, "
                         f"{against}: {mesh}); put both on the same mesh (or pass {name} as a plain tensor of this "
                         "rank's local rows)")


def _leading(name: str, x: DTensor, lead: int, vocab_dim: Optional[int], what: str,
             owns_vocab: bool = False) -> List[Any]:
    """The placements of the rows of ``x`` (a DTensor whose first ``lead`` dims are the positions):
    each mesh dim ``Replicate()`` or a ``Shard`` of a leading dim; on ``vocab_dim`` ``Replicate()``
    (where ``x``, ``owns_vocab``, is the tensor sharded there by vocabulary)."""
    rows: List[Any] = []
    for i, p in enumerate(x.placements):
        if p.is_replicate() or (owns_vocab and i == vocab_dim):
            rows.append(Replicate())
        elif p.is_shard() and getattr(p, "dim", lead) < lead:
            if i == vocab_dim:
                raise _unsupported(name, x, i, f"that mesh dim shards the vocabulary, so every rank of it must hold "
                                   f"the same rows: {name} must be Replicate() there")
            rows.append(p)
        elif p.is_shard():
            raise _unsupported(name, x, i, what)
        else:
            raise _unsupported(name, x, i, "only Replicate() and Shard(dim) are supported; a Partial value is a "
                               "sum not taken yet")
    return rows


class _Plan:
    """What one DTensor call does: its mesh, the mesh dim that shards the vocabulary (or None), the
    rows' placements (the outputs'), the global leading shape, the plain call's arguments."""

    def __init__(self, op: str, given: Mapping[str, Any]) -> None:
        self.op = op
        self.local: Dict[str, Any] = dict(given)
        self.vocab_dim: Optional[int] = None
        self.vocab_start: Optional[int] = None
        self.vocab_sharded: List[str] = []  # the arguments sharded by vocabulary
        spec = OPS[op]
        self.placed = spec.placed
        if spec.form == "hidden":
            self._hidden(given)
        elif spec.form == "sides":
            self._kl(given)
        else:
            self._logits(given, spec.inputs[0])
        for name in spec.row_args:
            value = given.get(name)
            if isinstance(value, DTensor):
                _same_mesh(self.mesh, name, value, self.main)
                if tuple(value.placements) != tuple(self.rows):  # Partial, or a sharded last dim of ids: refused
                    _leading(name, value, len(self.lead), None, "only the positions' dims may be sharded, not the "
                             "ids' last dim")
                    value = value.redistribute(self.mesh, self.rows)
                self.local[name] = value.to_local()
        for name, value in given.items():
            if name not in self.placed and isinstance(value, DTensor):
                raise TypeError(f"{name} is a DTensor; only {', '.join(self.placed)} may be: pass {name} as a plain "
                                "tensor of this rank's local rows")
        if self.vocab_dim is not None:
            self.local["process_group"] = self.mesh.get_group(self.vocab_dim)
            self.local["vocab_start"] = self.vocab_start

    # ---------------------------------------------------------------- the logits ops
    def _logits(self, given: Mapping[str, Any], name: str) -> None:
        logits = given.get(name)
        self.main = name
        if not isinstance(logits, DTensor):
            other = next(n for n in self.placed if isinstance(given.get(n), DTensor))
            raise TypeError(f"{other} is a DTensor but {name} is a plain {type(logits).__name__}; pass {name} as a "
                            f"DTensor too, or {other}.to_local() (this rank's local rows)")
        self.mesh, last = logits.device_mesh, logits.ndim - 1
        for i, p in enumerate(logits.placements):
            if p.is_shard() and getattr(p, "dim", None) == last:
                self._vocab(name, logits, i, last)
        self.rows = _leading(name, logits, last, self.vocab_dim, "", owns_vocab=True)
        self.lead = tuple(logits.shape[:-1])
        self.local[name] = logits.to_local()  # its gradient: a DTensor of the logits' placements

    # ------------------------------------------------------------------ kl_divergence
    def _kl(self, given: Mapping[str, Any]) -> None:
        """Each side planned as the logits ops plan logits, or (with its ``*_weight``) as
        logprobs_from_hidden plans hidden states: the student's plan is the call's; the teacher's must
        give the same mesh, rows and vocabulary shards."""
        plans = []
        for side in ("student", "teacher"):
            if given.get(f"{side}_weight") is not None:
                self._hidden(given, side, f"{side}_weight", None)
            else:
                self._logits(given, side)
            plans.append((self.mesh, tuple(self.rows), self.lead))
        (mesh, rows, lead), (t_mesh, t_rows, t_lead) = plans
        if t_mesh != mesh:
            raise ValueError(f"the student and the teacher are DTensors of different device meshes (student: {mesh}, "
                             f"teacher: {t_mesh}); put both on the same mesh")
        sharded = {name.split("_")[0] for name in self.vocab_sharded}
        if (rows, lead) != (t_rows, t_lead) or (sharded and sharded != {"student", "teacher"}):
            raise ValueError(f"the student's rows are {lead} placed {_shown(rows)} with its vocabulary "
                             f"{'sharded' if 'student' in sharded else 'whole'}, the teacher's {t_lead} placed "
                             f"{_shown(t_rows)} with its vocabulary {'sharded' if 'teacher' in sharded else 'whole'}: "
                             "both sides must be placed alike (teacher.redistribute(mesh, student.placements))")
        self.main = "student"

    # ------------------------------------------------------------ logprobs_from_hidden
    def _hidden(self, given: Mapping[str, Any], hname: str = "hidden", wname: str = "weight",
                bname: Optional[str] = "bias") -> None:
        hidden, weight = given.get(hname), given.get(wname)
        bias = given.get(bname) if bname else None
        named = [(n, x) for n, x in ((hname, hidden), (wname, weight), (bname, bias)) if isinstance(x, DTensor)]
        if not named:
            other = next(n for n in self.placed if isinstance(given.get(n), DTensor))
            raise TypeError(f"{other} is a DTensor but {hname} and {wname} are plain tensors; pass the hidden states "
                            f"(or the weight) as a DTensor too, or {other}.to_local() (this rank's local rows)")
        self.main, first = named[0]
        self.mesh = first.device_mesh
        if isinstance(weight, DTensor):
            _same_mesh(self.mesh, wname, weight, self.main)
            for i, p in enumerate(weight.placements):
                if p.is_shard() and getattr(p, "dim", None) == 0:
                    self._vocab(wname, weight, i, 0)
                elif p.is_shard():
                    raise _unsupported(wname, weight, i, "a sharded hidden dimension: the lm_head weight (V, H) may "
                                       "be sharded by vocabulary rows (Shard(0)) only")
                elif not p.is_replicate():
                    raise _unsupported(wname, weight, i, "only Replicate() and Shard(0) are supported; a Partial "
                                       "value is a sum not taken yet")
        if isinstance(hidden, DTensor):
            _same_mesh(self.mesh, hname, hidden, self.main)
            self.rows = _leading(hname, hidden, hidden.ndim - 1, self.vocab_dim,
                                 "a sharded hidden dimension: the hidden states may be sharded by positions only")
            self.lead = tuple(hidden.shape[:-1])
            self.local[hname] = hidden.to_local()
        elif self.mesh.ndim > 1:  # which rows it holds over the other mesh dims cannot be known
            raise ValueError(f"{hname} is a plain tensor but {wname} is a DTensor on a {self.mesh.ndim}-D mesh "
                             f"{tuple(self.mesh.shape)}: pass the hidden states as a DTensor on that mesh, placed "
                             "like its rows (Shard(0) over a data-parallel dim, Replicate() over the vocabulary's), "
                             "so that the result and the weight gradient carry the right placements")
        else:  # this rank's rows, the same on every rank of the 1-D mesh (the vocabulary's)
            self.rows = [Replicate()] * self.mesh.ndim
            self.lead = tuple(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else ()
        # a weight replicated where the rows are sharded: each rank's gradient is its rows' share
        if isinstance(weight, DTensor):
            self.local[wname] = weight.to_local(grad_placements=self._shared(weight))
        if isinstance(bias, DTensor):
            _same_mesh(self.mesh, bname, bias, self.main)
            want = [Shard(0) if i == self.vocab_dim else Replicate() for i in range(self.mesh.ndim)]
            if [p for p in bias.placements] != want:
                raise ValueError(f"bias is a DTensor placed {_shown(bias.placements)}; it must be placed like the "
                                 f"weight's vocabulary rows, {_shown(want)}; {_REDISTRIBUTE}")
            self.local[bname] = bias.to_local(grad_placements=self._shared(bias))

    def _shared(self, x: DTensor) -> List[Any]:
        return [Partial() if r.is_shard() else p for r, p in zip(self.rows, x.placements)]

    # ----------------------------------------------------------------- the vocabulary
    def _vocab(self, name: str, x: DTensor, mesh_dim: int, dim: int) -> None:
        if type(x.placements[mesh_dim]) is not Shard:
            raise _unsupported(name, x, mesh_dim, "the vocabulary may be sharded by a plain Shard only")
        if self.vocab_dim is not None and self.vocab_dim != mesh_dim:
            raise _unsupported(name, x, mesh_dim, f"the vocabulary is already sharded over mesh dim {self.vocab_dim}; "
                               "it may be sharded over one mesh dim only")
        start = _offset(x, dim)
        if self.vocab_dim is not None and start != self.vocab_start:  # kl_divergence's second side
            raise _unsupported(name, x, mesh_dim, f"this rank's vocabulary starts at {start}, the other side's at "
                               f"{self.vocab_start}: both sides must have the same vocabulary, sharded alike")
        self.vocab_dim = mesh_dim
        self.vocab_start = start
        self.vocab_sharded.append(name)


def _offset(x: DTensor, dim: int) -> int:
    """The global index of this rank's first element of ``x`` along ``dim`` (torch's own rule, which
    gives uneven shards' remainder to the first ranks, as ``torch.chunk`` does)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - an older torch: torch.chunk's rule
        mesh = x.device_mesh
        for i, p in enumerate(x.placements):
            if p.is_shard() and getattr(p, "dim", None) == dim:
                n = mesh.size(i)
                return min(mesh.get_local_rank(i) * -(-x.shape[dim] // n), x.shape[dim])
        return 0
    return int(compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)[1][dim])


def _stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def run(op: str, given: Mapping[str, Any], local_run: Callable[[str, Mapping[str, Any]], Any]) -> Any:
    """The public op ``op`` on arguments ``given`` of which some are DTensors: the plain call
    ``local_run(op, arguments)`` on the local tensors (with the vocabulary's group, if any), its
    outputs as DTensors."""
    for name in ("process_group", "vocab_start"):
        if given.get(name) is not None:
            raise ValueError(f"{name}= was given with DTensor inputs; the group and this rank's vocabulary offset are "
                             "read from the DTensor's mesh and placements: leave process_group and vocab_start out")
    plan = _Plan(op, given)
    out = local_run(op, plan.local)
    lead = len(plan.lead)

    def wrap(t: torch.Tensor) -> DTensor:
        shape = plan.lead + tuple(t.shape[lead:])
        return DTensor.from_local(t, plan.mesh, plan.rows, run_check=False, shape=torch.Size(shape),
                                  stride=_stride(shape))

    if isinstance(out, tuple):
        return tuple(wrap(t) for t in out)
    return wrap(out)


__all__ = ["involved", "run"]
