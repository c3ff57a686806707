"""Calling conventions of the kernels in the field, and the adapters that make one a backend op.

A :class:`Convention` says how a foreign function is called (its inputs, its keywords, what it
returns) and ``adapt(function) -> {op: implementation}`` turns it into ops of the op table
(:mod:`logprob_registry.opspec`), called exactly as a backend's ops are. What the convention
cannot express (a temperature for a function that takes none, a bias, an entropy) raises
:class:`NotExpressible` from the adapter; the suite reports such a case as "not expressible" with
that reason, never as a pass or a departure.

What an adapter does around the function, and only this (each documented per convention):

- labels are passed as int64 (every convention here indexes with them);
- ``ignore_index``, where the function has none, is applied around it as its callers do: label 0
  is passed for the ignored positions and their log-probability is zeroed afterwards (so the
  function's own handling of ignored rows is not judged);
- the result is converted to the contract's result dtype (float32; float64 for float64 inputs): a
  function that computes in bf16 keeps its bf16 error, which the suite then measures;
- a fused head's hidden states are flattened to ``(N, H)`` where the convention takes 2-D input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from ...dtypes import result_dtype

__all__ = ["CONVENTIONS", "Convention", "NotExpressible", "register_convention"]


class NotExpressible(Exception):
    """The case asks for something the calling convention cannot express (the message says what)."""


@dataclass(frozen=True)
class Convention:
    """How one family of foreign functions is called.

    ``ops``: the op table's ops it can stand for; ``adapt(function)``: ``{op: implementation}``,
    each called as a backend's op (``opspec.OPS[op].signature()``); ``doc``: the calling convention
    in one line; ``expresses``: what it can express beyond the op's inputs, in words (shown by
    ``check --against`` and the docs); ``cannot``: what it cannot, in words; ``requires``: PEP 508
    requirements the functions of this convention need (the backend is ineligible, naming them,
    where they are missing); ``capabilities``: the ``Backend`` promises the suite holds the function
    to (``check --against --declare FLAG=BOOL`` overrides one); ``example``: a ``MODULE:FUNCTION``
    that follows it.
    """

    name: str
    ops: Tuple[str, ...]
    adapt: Callable[[Callable], Dict[str, Callable]]
    doc: str
    expresses: Tuple[str, ...] = ()
    cannot: Tuple[str, ...] = ()
    requires: Tuple[str, ...] = ()
    capabilities: Mapping[str, bool] = field(default_factory=dict)
    example: str = ""


#: What the suite holds a foreign function to unless ``--declare`` says otherwise: bitwise
#: determinism and batch invariance (the peers' known failures), autograd through the function;
#: the no-copy memory bound is not held (a function is judged for its results, and most copy).
DEFAULT_CAPABILITIES = {"autograd": True, "deterministic": True, "batch_invariant": True,
                        "copies_logits": True, "inplace_backward": False}


# ----------------------------------------------------------------------------- helpers
def _labels(labels: torch.Tensor, ignore_index: Optional[int]):
    """int64 labels with the ignored positions set to 0, and the mask of the kept positions (None: all)."""
    if ignore_index is None:
        return labels.long(), None
    keep = labels != ignore_index
    return labels.masked_fill(~keep, 0).long(), keep


def _finish(out: torch.Tensor, keep: Optional[torch.Tensor], dtype: torch.dtype, shape) -> torch.Tensor:
    out = out.to(result_dtype(dtype)).reshape(shape)
    return out if keep is None else out.masked_fill(~keep.reshape(shape), 0.0)


def _no_temperature(convention: str, temperature: float) -> None:
    if temperature != 1.0:
        raise NotExpressible(f"{convention} takes no temperature")


def _no_bias(convention: str, bias) -> None:
    if bias is not None:
        raise NotExpressible(f"{convention} takes no bias")


def _no_entropy(convention: str, return_entropy: bool) -> None:
    if return_entropy:
        raise NotExpressible(f"{convention} returns no entropy")


def _flat(hidden: torch.Tensor, labels: torch.Tensor):
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)


# ------------------------------------------------------------------------- adapters
def _verl_logprobs(fn):
    def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
        _no_temperature("verl-logprobs", temperature)
        index, keep = _labels(labels, ignore_index)
        return _finish(fn(logits, index), keep, logits.dtype, labels.shape)

    return {"logprobs": logprobs}


def _verl_fused(fn):
    def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
        _no_bias("verl-fused", bias)
        h, y = _flat(hidden, labels)
        index, keep = _labels(y, ignore_index)
        logp, ent = fn(h, weight, index, temperature, "none", None)
        logp = _finish(logp, keep, hidden.dtype, labels.shape)
        return (logp, _finish(ent, None, hidden.dtype, labels.shape)) if return_entropy else logp

    return {"logprobs_from_hidden": logprobs_from_hidden}


def _trl_selective(fn):
    def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
        index, keep = _labels(labels, ignore_index)
        return _finish(fn(logits, index, temperature=temperature), keep, logits.dtype, labels.shape)

    return {"logprobs": logprobs}


def _trl_selective_entropy(fn):
    def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward):
        index, keep = _labels(labels, ignore_index)
        logp, ent = fn(logits, index, temperature=temperature)
        return _finish(logp, keep, logits.dtype, labels.shape), _finish(ent, None, logits.dtype, labels.shape)

    def entropy(logits, *, temperature):
        index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return _finish(fn(logits, index, temperature=temperature)[1], None, logits.dtype, index.shape)

    return {"logprobs_and_entropy": logprobs_and_entropy, "entropy": entropy}


#: The vocabulary chunk the ``trl-chunked-head`` adapter passes (``check --against`` judges TRL's
#: kernel at this width; 4096 columns is the width TRL's trainers use by default).
TRL_CHUNK = 4096


def _trl_chunked_head(fn):
    def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
        h, y = _flat(hidden, labels)
        index, keep = _labels(y, ignore_index)
        outs = fn(h, weight, bias, index, temperature, TRL_CHUNK, None, 1.0, ("entropy",) if return_entropy else ())
        logp = _finish(outs[0], keep, hidden.dtype, labels.shape)
        return (logp, _finish(outs[1], None, hidden.dtype, labels.shape)) if return_entropy else logp

    return {"logprobs_from_hidden": logprobs_from_hidden}


def _torch_lce(chunked: bool):
    name = "torch-lce-chunked" if chunked else "torch-lce"

    def adapt(fn):
        def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
            _no_temperature(name, temperature)
            _no_entropy(name, return_entropy)
            h, y = _flat(hidden, labels)
            kw = {} if ignore_index is None else {"ignore_index": ignore_index}
            if chunked:
                kw["options"] = torch.nn.LinearCrossEntropyOptions()
            loss = fn(h, weight, y.long(), linear_bias=bias, reduction="none", **kw)
            return _finish(-loss, None, hidden.dtype, labels.shape)

        return {"logprobs_from_hidden": logprobs_from_hidden}

    return adapt


def _liger_ce(fn):
    def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
        _no_temperature("liger-ce", temperature)
        index, keep = _labels(labels, ignore_index)
        rows = logits.reshape(-1, logits.shape[-1])
        loss = fn(rows if rows.requires_grad else rows.detach().clone(), index.reshape(-1), reduction="none")
        return _finish(-loss, keep, logits.dtype, labels.shape)

    return {"logprobs": logprobs}


def _liger_flce(fn):
    def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
        _no_temperature("liger-flce", temperature)
        _no_entropy("liger-flce", return_entropy)
        h, y = _flat(hidden, labels)
        index, keep = _labels(y, ignore_index)
        loss = fn(h, weight, index, bias=bias, reduction="none")
        return _finish(-loss, keep, hidden.dtype, labels.shape)

    return {"logprobs_from_hidden": logprobs_from_hidden}


def _liger_flsce(fn):
    def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
        _no_bias("liger-flsce", bias)
        h, y = _flat(hidden, labels)
        index, keep = _labels(y, ignore_index)
        # no ignore_index given: the ignored rows get label 0 (their entropy is kept), zeroed after
        outs = fn(h, weight, index, temperature, -100, 1, return_entropy)
        nll, ent = outs if return_entropy else (outs, None)
        logp = _finish(-nll, keep, hidden.dtype, labels.shape)
        return (logp, _finish(ent, None, hidden.dtype, labels.shape)) if return_entropy else logp

    return {"logprobs_from_hidden": logprobs_from_hidden}


CONVENTIONS: Dict[str, Convention] = {}


def register_convention(convention: Convention, replace: bool = False) -> Convention:
    """Add a convention to :data:`CONVENTIONS` (``check --against --signature NAME`` then knows it)."""
    if convention.name in CONVENTIONS and not replace:
        raise ValueError(f"calling convention {convention.name!r} is already registered")
    CONVENTIONS[convention.name] = convention
    return convention


for _c in (
    Convention(
        "verl-logprobs", ("logprobs",), _verl_logprobs,
        "logprobs_from_logits(logits (..., V), labels (...)) -> logprobs (...)",
        expresses=("ignore_index (applied around the call)",),
        cannot=("temperature (verl divides the logits before the call)", "entropy"),
        example="verl.utils.torch_functional:logprobs_from_logits"),
    Convention(
        "verl-fused", ("logprobs_from_hidden",), _verl_fused,
        "linear_cross_entropy(hidden (N, H), weight (V, H), labels (N,), temperature, reduction, tp_group) "
        "-> (logprobs (N,), entropy (N,))",
        expresses=("temperature", "entropy", "ignore_index (applied around the call)"),
        cannot=("bias",),
        example="verl.utils.kernel.linear_cross_entropy:linear_cross_entropy"),
    Convention(
        "trl-selective", ("logprobs",), _trl_selective,
        "selective_log_softmax(logits (..., V), index (...), temperature=T) -> logprobs (...)",
        expresses=("temperature", "ignore_index (applied around the call)"),
        cannot=("entropy",),
        requires=(),
        example="trl.trainer.utils:selective_log_softmax"),
    Convention(
        "trl-selective-entropy", ("logprobs_and_entropy", "entropy"), _trl_selective_entropy,
        "selective_log_softmax_and_entropy(logits (..., V), index (...), temperature=T) -> (logprobs, entropy)",
        expresses=("temperature", "entropy", "ignore_index (applied around the call)"),
        example="trl.trainer.utils:selective_log_softmax_and_entropy"),
    Convention(
        "trl-chunked-head", ("logprobs_from_hidden",), _trl_chunked_head,
        "ChunkedLogProbFunction.apply(hidden (N, H), weight (V, H), bias, targets (N,), temperature, chunk_size, "
        "final_logit_softcapping, logit_scale, outputs) -> (logprobs, entropy, ...)",
        expresses=("temperature", "bias", "entropy", "ignore_index (applied around the call)"),
        example="trl.kernels:ChunkedLogProbFunction.apply"),
    Convention(
        "torch-lce", ("logprobs_from_hidden",), _torch_lce(False),
        "torch.nn.functional.linear_cross_entropy(input (N, H), linear_weight (V, H), target (N,), "
        "linear_bias=, reduction='none', ignore_index=) -> loss; log-probability = -loss",
        expresses=("bias", "ignore_index"), cannot=("temperature", "entropy"),
        example="torch.nn.functional:linear_cross_entropy"),
    Convention(
        "torch-lce-chunked", ("logprobs_from_hidden",), _torch_lce(True),
        "torch-lce with options=torch.nn.LinearCrossEntropyOptions() (the chunked path)",
        expresses=("bias", "ignore_index"), cannot=("temperature", "entropy"),
        example="torch.nn.functional:linear_cross_entropy"),
    Convention(
        "liger-ce", ("logprobs",), _liger_ce,
        "liger_cross_entropy(input (N, V), target (N,), reduction='none') -> loss; log-probability = -loss",
        expresses=("ignore_index (applied around the call)",), cannot=("temperature", "entropy"),
        requires=("liger-kernel",),
        example="liger_kernel.transformers.functional:liger_cross_entropy"),
    Convention(
        "liger-flce", ("logprobs_from_hidden",), _liger_flce,
        "liger_fused_linear_cross_entropy(input (N, H), weight (V, H), target (N,), bias=, reduction='none') "
        "-> loss; log-probability = -loss",
        expresses=("bias", "ignore_index (applied around the call)"), cannot=("temperature", "entropy"),
        requires=("liger-kernel",),
        example="liger_kernel.transformers.functional:liger_fused_linear_cross_entropy"),
    Convention(
        "liger-flsce", ("logprobs_from_hidden",), _liger_flsce,
        "LigerFusedLinearScaledCrossEntropyFunction.apply(input (N, H), weight (V, H), target (N,), temperature, "
        "ignore_index, m_tiles_per_cluster, return_entropy) -> nll or (nll, entropy); log-probability = -nll",
        expresses=("temperature", "entropy", "ignore_index (applied around the call)"), cannot=("bias",),
        requires=("liger-kernel",),
        example="liger_kernel.ops.fused_linear_scaled_cross_entropy:LigerFusedLinearScaledCrossEntropyFunction.apply"),
):
    register_convention(_c)
