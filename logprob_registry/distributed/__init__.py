"""Vocabulary-parallel log-probabilities and entropy over a ``torch.distributed`` process group.

With ``process_group=`` (and optionally ``vocab_start=``) each rank passes its shard of the logits
``(..., V_local)``, or of the lm_head weight ``(V_local, H)``, and the same global labels; every rank
gets the complete result, and the gradients of the unsharded call (the shard's own; for
``logprobs_from_hidden`` the complete hidden gradient on every rank). Only per-row statistics cross
the group: a few numbers per row and per 4096-column tile, never ``(N, V)``.

How (docs/distributed.md has the whole story):

- the public function validates the call once (:func:`logprob_registry.call.validate`) and hands
  :mod:`.sharded` the validated call, or the error to raise on every rank;
- the local work is backend ops of the op table (``shard_stats``, ``shard_grad``,
  ``hidden_shard_stats``, ``hidden_shard_grad``, ``shard_topk``, ``kl_shard_stats``, ...), selected
  through the registry like any op, which checks their outputs against the op table;
- :mod:`.header`: one small all-gather first, so that bad input raises the same error on every
  rank before any collective that could hang;
- :mod:`.tiles`: tiles on a global grid of :data:`TILE` columns, their sums exact, so that the
  pieces of a tile two shards share add up to its bits (:func:`.core.complete` measures them
  against the whole tile's max);
- :mod:`.core`: one all-gather of the tile statistics and a merge in one fixed order on every rank
  (:mod:`.merge`), so results are bitwise independent of the group size and of how the vocabulary
  is split when the backend declares ``group_invariant``;
- :mod:`.sharded`: the one skeleton (forward, autograd backward) of every public op, driven by
  the op's plan (:mod:`.kl`: kl_divergence's);
- :mod:`.sampled`: the sampler's keywords, and the rounds of the truncation decision;
- :mod:`.support`: what a ``process_group=`` call supports;
- :mod:`.launch`: spawning a local gloo group (tests, the conformance suite, ``bench``).
"""

from __future__ import annotations

from .header import GroupMismatchError
from .support import FEATURES, check, unsupported_reason
from .tiles import TILE

__all__ = ["FEATURES", "TILE", "GroupMismatchError", "check", "unsupported_reason"]
