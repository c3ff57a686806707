"""The hook a plugin implements, and the markers it uses.

A plugin module (or object) implements :func:`register_backends` with ``@hookimpl`` and is found
either as a built-in (``logprob_registry.kernels``) or through the entry-point group
``logprob_registry``.
"""

from __future__ import annotations

from typing import Callable

import pluggy

from .opspec import OPS

PROJECT = "logprob_registry"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register: Callable[..., None]) -> None:
    """Register backends by calling ``register(Backend(...))`` once for each.

    Each entry of ``Backend.ops`` is called exactly as the op table (``logprob_registry.opspec``)
    says, with the validated inputs as the caller gave them (shapes and strides untouched) and
    every keyword option, and returns what the public function returns::

        {signatures}

    ``kl_divergence`` receives the teacher (and its weight) detached, ``mask`` a bool ``(...)`` or
    None, ``direction`` "forward" or "reverse" (docs/distillation.md). ``logits`` is ``(..., V)`` of
    a float dtype the backend declared, ``labels`` ``(...)`` int32 or
    int64 in ``[0, V)`` or equal to ``ignore_index``; ``hidden`` is ``(..., H)``, ``weight``
    ``(V, H)``, ``bias`` ``(V,)`` or None, all of one dtype. Results are float32 (float64 for
    float64 inputs). Optional options reach only backends that declare their feature
    (``Backend(features={...})``, see ``opspec.FEATURES``): ``softcap``, ``top_k``, ``top_p``,
    ``min_p``, ``keep`` (the sampler's processing), ``logits_dtype`` (the fused op),
    ``student_weight`` and ``teacher_weight`` (``kl_hidden``) and ``support`` (``kl_support``) then
    come as keywords too; ``candidates`` means labels of shape ``(..., K)``; ``stats_hidden``,
    ``token_stats`` given hidden states (its ``weight``, which every backend of it receives, not None);
    ``functorch`` means its ops
    work inside ``torch.func`` transforms. The ``*shard_*`` ops are one rank's work for calls with
    ``process_group=``, called by :mod:`logprob_registry.distributed` on a vocabulary shard
    (docs/distributed.md).

    Keep the module that implements this light: it is imported by ``import logprob_registry``.
    Import kernel libraries inside the op functions, and name them in ``Backend.requires``.
    """


# The op table's calls, one line each, as OpSpec.signature() writes them.
register_backends.__doc__ = (register_backends.__doc__ or "").replace(
    "{signatures}", "\n        ".join(spec.signature() for spec in OPS.values()))
