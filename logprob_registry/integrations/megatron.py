"""Megatron-Core (>= 0.18): :func:`output_processor`, the callback of ``GPTModel.forward(...,
output_processor=, output_processor_context=)``. Megatron hands it the decoder's hidden states
``[s, b, h]`` and the vocab-parallel output layer instead of computing the logits; it returns an
:class:`lr.TokenStats` ``[b, s]`` (``logprobs``, and ``entropy`` when the context asks) computed by
:func:`lr.logprobs_from_hidden` over the tensor-parallel group from this rank's rows of the lm_head:
the logits are never formed, let alone gathered.

    from logprob_registry.integrations import megatron
    stats = model(input_ids, position_ids, attention_mask, labels=labels,
                  output_processor=megatron.output_processor,
                  output_processor_context={"temperature": 0.7, "return_entropy": True})

Where it finds what it needs (each overridable by keyword, ``functools.partial(output_processor,
process_group=..., vocab_start=..., backend=...)``):

- the weight: ``output_weight`` (the shared embedding, for tied models), else ``output_layer.weight``;
  the bias: ``output_layer.bias`` unless ``output_layer.skip_bias_add``;
- the group: ``output_layer.tp_group`` (``ColumnParallelLinear``; ``_tp_group`` of Transformer
  Engine's), else ``megatron.core.parallel_state.get_tensor_model_parallel_group()``; else an error;
- ``vocab_start``: the rank in that group times the weight's rows, Megatron's even split
  (``VocabUtility``); the padded vocabulary's rows take part, as in Megatron's own loss;
- sequence parallel (``output_layer.sequence_parallel``, else ``config.sequence_parallel``): the
  hidden states' ``s / tp`` rows are gathered first (the backward keeps this rank's rows of the
  hidden gradient, which :func:`lr.logprobs_from_hidden` already sums over the group);
- the logit scale: ``config.mup_output_mult`` where ``config.use_mup`` (what ``scale_logits`` does).

The context (Megatron forwards ``output_processor_context`` untouched) may be None, a mapping or an
object with attributes: ``temperature`` (1.0), ``return_entropy`` (False), ``ignore_index`` (None:
every position counts). Megatron's other keywords are accepted and unused. Megatron needs no
``install()``: the callback is an argument of its forward, nothing of Megatron's is replaced.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

import logprob_registry as lr

#: The Megatron-Core versions whose ``GPTModel._postprocess`` calls ``output_processor`` with the
#: keywords below (read from core_v0.18.0 and main at 0.20.0: megatron/core/models/gpt/gpt_model.py).
TESTED = ">=0.18"


def _option(context: Any, name: str, default: Any) -> Any:
    if context is None:
        return default
    if isinstance(context, Mapping):
        return context.get(name, default)
    return getattr(context, name, default)


def _group(output_layer: Any) -> Any:
    for attr in ("tp_group", "_tp_group"):
        group = getattr(output_layer, attr, None)
        if group is not None:
            return group
    try:
        from megatron.core import parallel_state
    except ImportError:
        parallel_state = None
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    raise RuntimeError(
        f"megatron.output_processor found no tensor-parallel group: the output layer "
        f"({type(output_layer).__name__}) has no tp_group and megatron.core.parallel_state is "
        f"{'not importable' if parallel_state is None else 'not initialized'}; pass it, with this rank's first "
        "vocabulary id: functools.partial(megatron.output_processor, process_group=group, vocab_start=start)")


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel: every rank's ``[s / tp, b, h]`` rows, in rank order, as ``[s, b, h]``.
    The gradient arriving is already summed over the group (the hidden gradient of
    ``logprobs_from_hidden``), so the backward keeps this rank's rows: no reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, group: Any) -> torch.Tensor:
        from logprob_registry.distributed.group import resolve

        resolved = resolve(group)
        ctx.rank, ctx.rows = resolved.rank, hidden.shape[0]
        gathered = resolved.all_gather(hidden, resolved.device_for(hidden)).to(hidden.device)
        return gathered.reshape((-1,) + tuple(hidden.shape[1:]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.narrow(0, ctx.rank * ctx.rows, ctx.rows), None


def output_processor(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: Optional[torch.Tensor] = None,
                     labels: Optional[torch.Tensor] = None, context: Any = None, config: Any = None,
                     process_group: Any = None, vocab_start: Optional[int] = None, backend: Optional[str] = None,
                     **_megatron: Any) -> lr.TokenStats:
    """Megatron-Core's ``output_processor``: ``TokenStats(logprobs [b, s], entropy [b, s] or None)``
    of ``labels`` ``[b, s]`` (module docstring). ``_megatron``: the keywords Megatron also hands
    (``loss_mask``, ``input_ids``, ``position_ids``, ``attention_mask``, ``decoder_input``,
    ``inference_context``, ``packed_seq_params``, ``runtime_gather_output``,
    ``compute_language_model_loss``, ``scale_logits``), unused."""
    if labels is None:
        raise ValueError("megatron.output_processor computes the log-probabilities of labels: call the model with "
                         "labels= (Megatron passes labels=None at inference, where it needs the logits themselves)")
    weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    if weight is None:
        raise ValueError("megatron.output_processor found no lm_head weight: output_weight is None and the output "
                         f"layer ({type(output_layer).__name__}) has no weight")
    if hidden_states.dim() != 3:
        raise ValueError(f"megatron.output_processor takes Megatron's hidden states [s, b, h], got shape "
                         f"{tuple(hidden_states.shape)}")
    group = process_group if process_group is not None else _group(output_layer)
    sequence_parallel = getattr(output_layer, "sequence_parallel", None)
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if sequence_parallel:
        hidden_states = _GatherSequence.apply(hidden_states, group)
    s, b = hidden_states.shape[:2]
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"megatron.output_processor takes labels [b, s] = {(b, s)} for hidden states [s, b, h] = "
                         f"{tuple(hidden_states.shape)}, got labels {tuple(labels.shape)}")
    if vocab_start is None:
        import torch.distributed as dist

        vocab_start = dist.get_rank(group) * weight.shape[0]
    bias = None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None)
    scale = getattr(config, "mup_output_mult", 1.0) if getattr(config, "use_mup", False) else 1.0
    return_entropy = bool(_option(context, "return_entropy", False))
    out = lr.logprobs_from_hidden(hidden_states.transpose(0, 1), weight, labels, bias=bias,
                                  temperature=_option(context, "temperature", 1.0),
                                  ignore_index=_option(context, "ignore_index", None), return_entropy=return_entropy,
                                  logit_scale=None if scale == 1.0 else float(scale), process_group=group,
                                  vocab_start=vocab_start, backend=backend)
    return lr.TokenStats(logprobs=out[0], entropy=out[1]) if return_entropy else lr.TokenStats(logprobs=out)


__all__ = ["TESTED", "output_processor"]
