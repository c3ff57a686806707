"""Modules: :class:`LogprobHead`, an ``nn.Linear`` lm_head whose forward gives the labels'
log-probabilities through :func:`logprob_registry.logprobs_from_hidden`, never the logits.

Because it is an ``nn.Linear`` and computes from ``self.weight`` inside ``forward``, the wrappers
that gather a sharded weight through module hooks (FSDP2's ``fully_shard``, FSDP1, DeepSpeed
ZeRO-3) gather it for this module as they do for any Linear. See docs/fused-linear.md.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, FrozenSet, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from .ops import logprobs_from_hidden

__all__ = ["LogprobHead"]

_OWN = frozenset({"bias"})  # logprobs_from_hidden's keywords the module fills from itself
_keywords: Optional[FrozenSet[str]] = None


def _accepted() -> FrozenSet[str]:
    """The keywords of :func:`logprobs_from_hidden` a caller may give the module (all but ``bias``)."""
    global _keywords
    if _keywords is None:
        parameters = inspect.signature(logprobs_from_hidden).parameters.values()
        _keywords = frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY) - _OWN
    return _keywords


def _check(keywords: Dict[str, Any], where: str) -> None:
    own = sorted(_OWN & keywords.keys())
    if own:
        raise TypeError(f"{where}: {own[0]}= is the module's own parameter (self.{own[0]}); "
                        "create the head with bias=True, or use lr.logprobs_from_hidden for another bias")
    unknown = sorted(keywords.keys() - _accepted())
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"it accepts those of logprobs_from_hidden: {', '.join(sorted(_accepted()))}")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy if it is a view: FSDP2 warns about (and an in-place op on it would drop the
    pre-backward hook of) a module output that is a view. The copy is of one number per token."""
    return t if t._base is None else t.clone()


class LogprobHead(nn.Linear):
    """An lm_head (``nn.Linear(in_features=H, out_features=V)``) that returns log-probabilities.

    ``head(hidden, labels, **keywords)`` is ``lr.logprobs_from_hidden(hidden, head.weight, labels,
    bias=head.bias, **keywords)``: float32 ``(...)`` log-probabilities (float64 for float64
    parameters), or ``(logprobs, entropy)`` with ``return_entropy=True``; the ``(..., V)`` logits are
    never materialised. Every keyword of :func:`logprobs_from_hidden` but ``bias`` is accepted
    (``temperature``, ``ignore_index``, ``return_entropy``, ``softcap``, ``top_k``, ``top_p``,
    ``min_p``, ``keep``, ``logits_dtype``, ``process_group``, ``vocab_start``, ``backend``).

    ``head(hidden)`` without labels gives the logits, as ``nn.Linear`` does (generation code that
    calls the lm_head keeps working); so does :meth:`logits`. Both go through ``forward``, so the
    module hooks of FSDP2 / ZeRO-3 gather the weight for them too.

    The constructor takes ``nn.Linear``'s arguments (``bias`` defaults to False, as an lm_head's
    does) and, optionally, keywords of ``logprobs_from_hidden`` that become this head's defaults
    (a call's own keywords override them), e.g. ``LogprobHead(H, V, ignore_index=-100)``. The
    parameters and ``state_dict`` are exactly ``nn.Linear``'s. :meth:`from_linear` makes a head
    that shares an existing Linear's parameters.

    With ``process_group=`` the weight (and bias) is this rank's vocabulary shard, ``out_features``
    the shard's size (see docs/distributed.md).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None, **defaults: Any) -> None:
        _check(defaults, "LogprobHead()")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.defaults: Dict[str, Any] = dict(defaults)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **defaults: Any) -> "LogprobHead":
        """A head whose ``weight`` and ``bias`` are ``linear``'s own Parameter objects (no copy, no
        new memory): tied embeddings stay tied, an optimizer over the model's parameters still
        updates them, and ``linear``'s state_dict loads into the head unchanged. ``defaults`` as in
        the constructor. Replace the model's lm_head with it, e.g.
        ``model.lm_head = LogprobHead.from_linear(model.lm_head)``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LogprobHead.from_linear needs an nn.Linear, got {type(linear).__name__}")
        _check(defaults, "LogprobHead.from_linear()")
        # Built on the meta device (nothing allocated or initialised), then given linear's parameters.
        head = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                   dtype=linear.weight.dtype, **defaults)
        head.weight = linear.weight
        if linear.bias is not None:
            head.bias = linear.bias
        head.train(linear.training)
        return head

    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None,
                **keywords: Any) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if labels is None:
            if keywords:
                raise TypeError(f"LogprobHead: keywords ({', '.join(sorted(keywords))}) need labels; "
                                "head(hidden) without labels gives the plain logits")
            return F.linear(hidden, self.weight, self.bias)
        if keywords:
            _check(keywords, "LogprobHead.forward()")
            keywords = {**self.defaults, **keywords}
        else:
            keywords = self.defaults
        out = logprobs_from_hidden(hidden, self.weight, labels, bias=self.bias, **keywords)
        return tuple(_own(t) for t in out) if isinstance(out, tuple) else _own(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The plain logits ``hidden @ weight.T + bias`` in the parameters' dtype (``self(hidden)``:
        through the module's hooks, so a sharded weight is gathered first)."""
        return self(hidden)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text + "".join(f", {k}={v!r}" for k, v in sorted(self.defaults.items()))
