"""logprob_registry.integrations.megatron.output_processor, called through Megatron-Core's exact
keywords (those ``GPTModel._postprocess`` hands it in core_v0.18.0 and main) with stand-ins for the
output layer and config, on a spawned gloo group of two: the group of two gives the group of one's
bits (log-probabilities, entropy, each rank's rows of the lm_head gradient) and its hidden gradient
within the contract, on an even split found from the output layer, an uneven one given by keyword
(tied weights, bf16, the MuP logit scale), and sequence parallel. Not through Megatron's own
GPTModel: the installable megatron-core (0.16.1) predates output_processor (0.18)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import logprob_registry as lr
from logprob_registry.distributed import launch
from logprob_registry.integrations import megatron

#: What GPTModel._postprocess passes (megatron/core/models/gpt/gpt_model.py, core_v0.18.0 and main).
MEGATRON_KEYWORDS = ("hidden_states", "output_layer", "output_weight", "labels", "loss_mask", "input_ids",
                     "position_ids", "attention_mask", "decoder_input", "inference_context", "packed_seq_params",
                     "runtime_gather_output", "context", "compute_language_model_loss", "scale_logits", "config")
VOCAB, HIDDEN, S, B = 5000, 16, 6, 3  # the shards cross the 4096-column tile
UNEVEN = (1234, 3766)
#: name -> (dtype, context, tied weights, uneven split by keyword, sequence parallel, MuP output multiplier)
CASES = {
    "even-entropy-temperature": ("float32", {"temperature": 0.7, "return_entropy": True}, False, False, False, 1.0),
    "uneven-tied-bf16-mup": ("bfloat16", SimpleNamespace(temperature=0.9, ignore_index=-100), True, True, False, 0.5),
    "sequence-parallel-entropy": ("float32", {"return_entropy": True}, False, False, True, 1.0),
}


class OutputLayer:
    """What Megatron's ColumnParallelLinear output layer carries that output_processor reads."""

    def __init__(self, weight, tp_group, sequence_parallel=False):
        self.weight, self.bias, self.skip_bias_add = weight, None, False
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def __call__(self, *args, **kwargs):
        raise AssertionError("output_processor must not compute the logits through the output layer")


def _refuse(*args, **kwargs):
    raise AssertionError("output_processor must not call Megatron's loss or logit scaling")


def _data(name):
    dtype = getattr(torch, CASES[name][0])
    g = torch.Generator().manual_seed(len(name))
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    if _opt(name, "ignore_index") is not None:
        labels[0, -1] = _opt(name, "ignore_index")
    return dict(hidden=torch.randn(S, B, HIDDEN, generator=g).to(dtype),
                weight=(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype), labels=labels,
                upstream=torch.rand(2, B, S, generator=g))


def _opt(name, key):
    context = CASES[name][1]
    return context.get(key) if isinstance(context, dict) else getattr(context, key, None)


def _call(name, group, rank, size):
    """The case through Megatron's keywords on this rank's shard: (outputs, weight gradient of this
    rank's rows, hidden gradient of this rank's hidden states, first vocabulary id)."""
    _, context, tied, uneven, sequence_parallel, mup = CASES[name]
    data = _data(name)
    widths = UNEVEN if uneven and size == 2 else (VOCAB // size,) * size
    start = sum(widths[:rank])
    weight = data["weight"][start:start + widths[rank]].clone().requires_grad_(True)
    split = sequence_parallel and size > 1  # Megatron turns sequence parallel off on one rank
    rows = slice(rank * S // size, (rank + 1) * S // size) if split else slice(None)
    hidden = data["hidden"][rows].clone().requires_grad_(True)
    processor = megatron.output_processor
    if uneven:  # no group on the output layer, Megatron's even split overridden by keyword
        processor = functools.partial(processor, process_group=group, vocab_start=start)
    layer = OutputLayer(None if tied else weight, None if uneven else group, sequence_parallel=split)
    config = SimpleNamespace(sequence_parallel=split, use_mup=mup != 1.0, mup_output_mult=mup)
    given = dict(hidden_states=hidden, output_layer=layer, output_weight=weight if tied else None,
                 labels=data["labels"], loss_mask=torch.ones(B, S), input_ids=data["labels"], position_ids=None,
                 attention_mask=None, decoder_input=None, inference_context=None, packed_seq_params=None,
                 runtime_gather_output=None, context=context, compute_language_model_loss=_refuse,
                 scale_logits=_refuse, config=config)
    assert tuple(given) == MEGATRON_KEYWORDS
    stats = processor(**given)
    assert isinstance(stats, lr.TokenStats) and (stats.entropy is not None) == bool(_opt(name, "return_entropy"))
    outs = [t for t in (stats.logprobs, stats.entropy) if t is not None]
    sum((t.float() * up).sum() for t, up in zip(outs, data["upstream"])).backward()
    return [t.detach() for t in outs], weight.grad, hidden.grad, start


def _program(rank, world):
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world)]
    with lr.use_backend("chunked"):  # no compilation in the spawned processes
        return {(name, size): _call(name, group, rank if size > 1 else 0, size)
                for name in CASES for size, group in ((1, alone[rank]), (2, dist.group.WORLD))}


@pytest.fixture(scope="module")
def ranks():
    return [r.unwrap() for r in launch.run(2, _program, timeout=240)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_the_bits_of_one(ranks, name):
    for rank, got in enumerate(ranks):
        outs1, wgrad1, hgrad1, _ = got[(name, 1)]
        outs2, wgrad2, hgrad2, start = got[(name, 2)]
        for i, (a, b) in enumerate(zip(outs2, outs1)):
            assert a.shape == (B, S) and torch.equal(a, b), f"rank {rank}, output {i}"
        assert torch.equal(wgrad2, wgrad1[start:start + wgrad2.shape[0]]), f"rank {rank}: the lm_head rows' gradient"
        rows = slice(rank * S // 2, (rank + 1) * S // 2) if CASES[name][4] else slice(None)
        torch.testing.assert_close(hgrad2.double(), hgrad1[rows].double(), rtol=1e-2, atol=1e-5)
        assert torch.equal(ranks[0][(name, 2)][0][0], got[(name, 2)][0][0])


@pytest.mark.parametrize("name", list(CASES))
def test_the_group_of_one_is_the_float64_computation(ranks, name):
    dtype, context, _, _, _, mup = CASES[name]
    data = _data(name)
    logits = data["hidden"].double().transpose(0, 1) @ data["weight"].double().T * mup
    temperature = _opt(name, "temperature") or 1.0
    ignore = _opt(name, "ignore_index")
    want = lr.logprobs_and_entropy(logits / temperature, data["labels"], ignore_index=ignore, backend="naive")
    outs = ranks[0][(name, 1)][0]
    tol = 1e-5 if dtype == "float32" else 1e-4
    for got, expected in zip(outs, want):
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=0)
    if ignore is not None:
        assert outs[0][0, -1] == 0


def test_the_signature_takes_megatrons_keywords_and_the_overrides():
    import inspect

    params = inspect.signature(megatron.output_processor).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items() if n != "_megatron")
    assert {"hidden_states", "output_layer", "output_weight", "labels", "context", "config"} <= set(params)
    assert {"process_group", "vocab_start", "backend"} <= set(params)
    assert params["_megatron"].kind is inspect.Parameter.VAR_KEYWORD  # Megatron's other keywords


def test_without_a_group_or_labels_the_error_says_what_to_pass():
    layer = SimpleNamespace(weight=torch.randn(8, 4), bias=None)
    with pytest.raises(RuntimeError, match="no tensor-parallel group.*functools.partial"):
        megatron.output_processor(hidden_states=torch.randn(3, 2, 4), output_layer=layer, output_weight=None,
                                  labels=torch.zeros(2, 3, dtype=torch.long), context=None, config=None)
    with pytest.raises(ValueError, match="labels="):
        megatron.output_processor(hidden_states=torch.randn(3, 2, 4), output_layer=layer, output_weight=None,
                                  labels=None, context=None, config=None)
