"""Any transformers causal LM: ``inject_head(model, outputs=("logprobs",))`` makes
``model(input_ids, labels=labels, return_token_stats=True)`` return an :class:`lr.TokenStats` computed
from the decoder's hidden states and the model's own ``lm_head`` parameters by :func:`lr.token_stats`,
run through the ``lm_head`` module's call (so FSDP2's ``fully_shard``, of the model or of the
``lm_head`` itself, gathers and reduces them as usual): the ``(N, V)`` logits are never formed. The
model's ``final_logit_softcapping`` and logit scale (Cohere's ``logit_scale``, Granite's ``1 /
logits_scaling``) are read from its config. ``labels`` are aligned with the positions, as
``lr.next_token_labels(input_ids)`` makes them (no shift inside); positions at ``ignore_index``
(default -100) give 0. Without ``return_token_stats`` the model is unchanged (generation included).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import logprob_registry as lr

from ._handle import Handle
from ._handle import install as _install


def _scale(config: Any) -> Optional[float]:
    scale = getattr(config, "logit_scale", None)
    if scale is None and getattr(config, "logits_scaling", None):
        scale = 1.0 / float(config.logits_scaling)
    return None if scale in (None, 0, 1.0) else float(scale)


def _through(head: Any, fn: Callable[[Any], Any], hidden: Any) -> Any:
    """``fn(hidden)`` run as ``head``'s forward, through ``head(hidden)``, so that the hooks of a
    wrapper of the lm_head run around it: ``fully_shard(model.lm_head)`` gathers the weight before
    and reduce-scatters its gradient after (``head.weight`` alone would be this rank's DTensor rows)."""
    own = head.__dict__.get("forward")
    head.forward = fn
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def inject_head(model: Any, outputs: Sequence[str] = ("logprobs",), *, temperature: float = 1.0,
                ignore_index: int = -100, backend: Optional[str] = None) -> Handle:
    """Give ``model`` (a transformers causal LM: ``get_decoder()`` and an ``lm_head`` Linear) the
    ``return_token_stats=True`` keyword (module docstring); the handle's ``uninstall()`` restores its
    forward. ``outputs``, ``temperature``, ``ignore_index``: the defaults of the token_stats call,
    each overridable per call (``token_stats_outputs=``, ``temperature=``)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "weight") or not hasattr(model, "get_decoder"):
        raise TypeError(f"inject_head needs a transformers causal LM with an lm_head and get_decoder(); "
                        f"{type(model).__name__} has {'no lm_head' if head is None else 'no get_decoder()'}")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap, scale = getattr(text, "final_logit_softcapping", None), _scale(text)
    original = model.forward

    def forward(*args: Any, return_token_stats: bool = False, token_stats_outputs: Optional[Sequence[str]] = None,
                **kwargs: Any) -> Any:
        if not return_token_stats:
            return original(*args, **kwargs)
        labels = kwargs.pop("labels", None)
        call_temperature = kwargs.pop("temperature", temperature)
        kwargs.pop("logits_to_keep", None)
        hidden = model.get_decoder()(*args, **kwargs)[0]

        def stats(hidden: Any) -> lr.TokenStats:  # read at call time: FSDP2's unsharded weight
            return lr.token_stats(hidden, labels, weight=head.weight, bias=head.bias,
                                  outputs=tuple(token_stats_outputs or outputs), temperature=call_temperature,
                                  ignore_index=ignore_index if labels is not None else None, softcap=softcap,
                                  logit_scale=scale, backend=backend)

        return _through(head, stats, hidden)

    forward.__doc__ = original.__doc__
    return _install(f"hf.inject_head({type(model).__name__}@{id(model):x})", lambda: [(model, "forward", forward)],
                    backend)


__all__ = ["inject_head"]
