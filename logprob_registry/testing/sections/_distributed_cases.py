"""The rank side of the conformance suite's distributed section (:mod:`.distributed`): the one
program every rank of a spawned group runs, :func:`program`, which runs each case family by name.
Imports no pytest: it runs in the spawned processes.

The families, one module each:

- ``"logits"`` (:mod:`._distributed_logits`): the logits ops and ``logprobs_from_hidden``, and the
  bad inputs every rank must reject alike;
- ``"kl"`` (:mod:`._distributed_kl`): ``kl_divergence``, logits or hidden states on both sides;
- ``"sampler"`` (:mod:`._distributed_sampler`): the sampler's keywords.

One spawn of four processes covers groups of 1, 2, 3 and 4 ranks: every rank alone (four groups
of one), two groups of two (ranks 0 and 1 split the vocabulary evenly with the default
``vocab_start``; ranks 2 and 3 unevenly, off the tile grid, in reverse order, with explicit
``vocab_start``), a group of three (ranks 0 to 2, uneven widths off the grid) and the default group
of four (:func:`._distributed_common.split`). Every case of a family runs in each.
What the families share is :mod:`._distributed_common`.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from . import _distributed_kl as kl
from . import _distributed_logits as logits
from . import _distributed_sampler as sampler
from ._distributed_common import GROUPS, KINDS, KL_SHARD_OPS, WORLD, Case, same_bits

#: family name -> its module: ``run(rank, groups, backend, device, names)`` on a rank, and (logits,
#: kl) ``cases``, ``inputs``, ``reference``, ``output_tolerances`` for the parent's checks.
FAMILIES = {"logits": logits, "kl": kl, "sampler": sampler}


def program(rank: int, world: int, backend: str, device: str, families: Dict[str, Tuple[str, ...]]) -> dict:
    """What every rank of the spawned group of four runs: for each family named in ``families``
    (family -> the names of its cases to run; a family with none is not run), its cases in this
    rank's groups of 1, 2, 3 and 4; returns ``{family: that family's results}``."""
    import torch.distributed as dist

    if world != WORLD:
        raise ValueError(f"the distributed section runs on a group of {WORLD}, got {world}")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"no case family named {unknown}; the families are {sorted(FAMILIES)}")
    singles = [dist.new_group([r]) for r in range(world)]   # every rank calls new_group for every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    groups = {"single": singles[rank], "pair": pairs[rank // 2], "triple": triple if rank < 3 else None,
              "world": dist.group.WORLD, "pairs": pairs}
    return {name: FAMILIES[name].run(rank, groups, backend, device, tuple(names))
            for name, names in families.items() if names}


def family_of(case: Case):
    """The module of ``case``'s family (logits or kl)."""
    return kl if case.kl else logits


def cases() -> List[Case]:
    """The cases of the logits and kl families."""
    return logits.cases() + kl.cases()


def inputs(case: Case):
    return family_of(case).inputs(case)


def reference(case: Case, data):
    return family_of(case).reference(case, data)


def output_tolerances(case: Case, data) -> tuple:
    return family_of(case).output_tolerances(case, data)


__all__ = ["FAMILIES", "GROUPS", "KINDS", "KL_SHARD_OPS", "WORLD", "Case", "cases", "family_of", "inputs",
           "output_tolerances", "program", "reference", "same_bits"]
