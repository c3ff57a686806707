"""What the case families of the conformance suite's distributed section share
(:mod:`._distributed_cases` runs them): the group layout, the :class:`Case` record of the logits
and ``kl_divergence`` families, the bit digests, and the loop that runs a family's cases in each
group. Imports no pytest: it runs in the spawned processes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

WORLD = 4
SHAPE = (2, 3)            # leading dims of every case
VOCAB = 16384             # four tiles of 4096: the even splits are on the tile grid, the others off it
ODD_VOCAB = 13192         # 8192 + 5000: not a multiple of the tile
HIDDEN = 32
KINDS = ("single", "pair", "triple", "world")  # groups of 1, 2, 3 and 4 ranks
#: The groups of each kind, by their ranks (one spawn of four processes holds them all).
GROUPS = {"single": ((0,), (1,), (2,), (3,)), "pair": ((0, 1), (2, 3)), "triple": ((0, 1, 2),),
          "world": ((0, 1, 2, 3),)}
IGNORE = -100


@dataclass(frozen=True)
class Case:
    """One call: the op, the input dtype, and its options."""

    name: str
    op: str                       # logprobs, entropy, logprobs_and_entropy, logprobs_from_hidden, kl_divergence,
    #                               token_stats (of logits: every field)
    dtype: str
    temperature: float = 1.0
    ignore: bool = False          # ignore_index=-100 on two positions
    masked: bool = False          # a tile of -inf and scattered -inf entries (logits ops)
    vocab: int = VOCAB
    bias: bool = False            # logprobs_from_hidden
    entropy: bool = False         # logprobs_from_hidden: return_entropy
    inplace: bool = False         # inplace_backward=True, on a non-leaf
    direction: str = "forward"    # kl_divergence
    hidden: bool = False          # kl_divergence: both sides hidden states with weight shards (kl_hidden);
    #                               token_stats: hidden states with a weight shard

    @property
    def kl(self) -> bool:
        return self.op == "kl_divergence"

    @property
    def shard_ops(self) -> Tuple[str, ...]:
        """The shard ops the case runs on."""
        if self.kl:
            return KL_SHARD_OPS
        if self.op == "token_stats":
            return ("hidden_shard_token_stats", "hidden_shard_grad") if self.hidden else \
                ("shard_token_stats", "shard_grad")
        return ("hidden_shard_stats", "hidden_shard_grad") if self.op == "logprobs_from_hidden" else \
            ("shard_stats", "shard_grad")

    @property
    def features(self) -> Tuple[str, ...]:
        """The backend features (``opspec.FEATURES``) the case needs."""
        return ("kl_hidden",) if self.hidden and self.kl else ()

    @property
    def fused(self) -> bool:
        """Hidden states with a weight shard: logprobs_from_hidden, or token_stats given a weight."""
        return self.op == "logprobs_from_hidden" or (self.op == "token_stats" and self.hidden)


KL_SHARD_OPS = ("kl_shard_stats", "kl_shard_grad")


def hash_name(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)


def member(kind: str, rank: int) -> bool:
    """Whether ``rank`` is in a group of ``kind`` (rank 3 has no group of three)."""
    return any(rank in members for members in GROUPS[kind])


def split(kind: str, rank: int, vocab: int) -> Tuple[int, int, bool]:
    """``(start, width, pass vocab_start)`` of ``rank``'s shard in a group of ``kind``: even
    splits with the default ``vocab_start`` (the group of four, ranks 0 and 1 of the pairs), and
    uneven ones off the tile grid with explicit ``vocab_start`` (ranks 2 and 3 of the pairs, in
    reverse order; the group of three, widths not multiples of 128)."""
    if kind == "single":
        return 0, vocab, False
    if kind == "world":
        return rank * (vocab // WORLD), vocab // WORLD, False
    if kind == "triple":
        cuts = (0, vocab * 5 // 16 + 7, vocab * 11 // 16 - 13, vocab)
        return cuts[rank], cuts[rank + 1] - cuts[rank], True
    if rank < 2:  # ranks 0 and 1: even halves, default vocab_start
        return (rank % 2) * (vocab // 2), vocab // 2, False
    tail = vocab // 3 + 1
    return (vocab - tail, tail, True) if rank == 2 else (0, vocab - tail, True)  # reversed, explicit



def digest(t: Optional[torch.Tensor]) -> str:
    """The exact bits of ``t`` (signed zeros and NaN payloads included)."""
    if t is None:
        return "none"
    t = t.detach().cpu().contiguous()
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest() + str(t.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and digest(a) == digest(b)


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


def run_cases(family, group, kind: str, rank: int, backend: str, device: str, names: Tuple[str, ...],
              singles: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Outcome]:
    """The cases ``names`` of ``family`` (a module with ``cases``, ``inputs``, ``call``, ``reference``
    and ``gradient_excess``) in this rank's ``group`` of ``kind``; ``singles`` keeps each case's
    gradients alone (the groups of one run first), against which the others are compared bitwise."""
    out: Dict[str, Outcome] = {}
    if group is None:  # not a member of a group of this kind
        return out
    for case in family.cases():
        if case.name not in names:
            continue
        data = family.inputs(case)
        start, width, give = split(kind, rank, case.vocab)
        outs, grads, extra = family.call(case, data, start, width, give, group, backend, torch.device(device))
        shard = None if case.kl else extra          # logits: the shard (for in-place backward)
        teacher_grad = extra if case.kl else None   # kl_divergence: whether the teacher got a gradient
        _, want = family.reference(case, data)
        cols = slice(start, start + width)
        columns = {"logits": (Ellipsis, cols), "weight": cols, "bias": cols, "hidden": Ellipsis}
        o = Outcome(outs, family.gradient_excess(case, data, grads, want, columns), start=start, width=width,
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
