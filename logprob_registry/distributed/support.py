"""What the vocabulary-parallel path supports, checked on the validated call before any collective.

A ``process_group=`` call takes every option of its op that no backend feature governs
(``temperature``, ``ignore_index``, ``inplace_backward``, ``bias``, ``return_entropy``), and the
features in :data:`FEATURES`: candidate labels, ``softcap``, ``keep``, ``top_k``, ``top_p``,
``min_p`` (the last three also per row), ``logits_dtype`` and ``sampler`` (vLLM's, transformers' or
SGLang's order; :mod:`.sampled`); ``temperature`` also per row. Values
that change nothing (``top_k=0``, ``top_p=1.0``, ``logits_dtype=float32``) were made the defaults
by validation, so they need no feature and pass.
"""

from __future__ import annotations

from typing import Any

import torch

from ..call import Call

#: The backend features a process_group= call may use: kl_divergence's hidden-state sides, candidate
#: labels and the sampler's keywords that the shard ops implement (feature ``shard_sampler``).
FEATURES: frozenset = frozenset({"kl_hidden", "candidates", "softcap", "keep", "top_k", "top_p", "min_p",
                                 "logits_dtype", "per_row", "sampler"})


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<{'mask' if value.dtype == torch.bool else 'ids'} of shape {tuple(value.shape)}>"
    return repr(value)


def check(call: Call) -> None:
    """Raise ``NotImplementedError`` with a sentence when the process_group= path cannot run ``call``:
    inside a ``torch.func`` transform, ``kl_divergence`` with ``support=``, or with an option whose
    feature is not in :data:`FEATURES`."""
    if "functorch" in call.features:
        raise NotImplementedError("process_group= calls are not supported inside torch.func transforms (vmap, grad, "
                                  "...); call the op outside the transform")
    spec = call.spec
    if call.op == "kl_divergence" and call.options.get("support") is not None:
        raise NotImplementedError(
            f"kl_divergence(..., process_group=...) does not support support={_shown(call.options['support'])} "
            "yet; gather both sides' shards to one rank and call without process_group, or leave support=None")
    for option in spec.options:
        if option.feature in call.features and option.feature not in FEATURES:
            taken = ", ".join(sorted(o.name for o in spec.options if o.feature is None or o.feature in FEATURES))
            raise NotImplementedError(
                f"{spec.function}(..., process_group=...) does not support {option.name}="
                f"{_shown(call.options[option.name])} yet; the distributed path supports {taken}. Gather the logits "
                "to one rank and call without process_group, or leave the option at its default")


def unsupported_reason(call: Call) -> str:
    """:func:`check` as a sentence ("" when the call is supported), for ``explain``-like tools."""
    try:
        check(call)
    except NotImplementedError as exc:
        return str(exc)
    return ""
