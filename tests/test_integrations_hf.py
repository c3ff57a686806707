"""logprob_registry.integrations.hf.inject_head on tiny Llama, Gemma-2 (softcap) and Cohere (logit
scale) models built from configs with random weights: TokenStats equal to the computation from the
model's own logits within the contract, gradients to the lm_head too, generate() unchanged, and
uninstall() gives the model back its class's forward."""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import logprob_registry as lr
from logprob_registry.integrations import hf, installed

MODELS = {"llama": (LlamaForCausalLM, LlamaConfig), "gemma2": (Gemma2ForCausalLM, Gemma2Config),
          "cohere": (CohereForCausalLM, CohereConfig)}


def _model(name):
    cls, config = MODELS[name]
    torch.manual_seed(0)
    return cls(config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_token_stats_without_logits_equal_the_models_own(name):
    model = _model(name)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = lr.next_token_labels(ids)
    with torch.no_grad():
        logits = model(ids).logits
        before = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    handle = hf.inject_head(model, outputs=("logprobs", "entropy", "max_logit"))
    try:
        assert hf.inject_head(model) is handle and len(installed()) == 1
        stats = model(ids, labels=labels, return_token_stats=True)
        want = lr.logprobs_and_entropy(logits.double(), labels, ignore_index=-100, backend="naive")
        torch.testing.assert_close(stats.logprobs.double(), want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(stats.entropy.double(), want[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(stats.max_logit.double(), logits.double().amax(-1), atol=1e-5, rtol=0)
        assert stats.raw_logprobs is None and bool((stats.logprobs[:, -1] == 0).all())
        stats.logprobs.sum().backward()  # the model's own lm_head parameters get the gradient
        assert model.lm_head.weight.grad is not None and bool(model.lm_head.weight.grad.abs().sum() > 0)
        with torch.no_grad():
            after = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert torch.equal(before, after)
        assert isinstance(model(ids).logits, torch.Tensor)  # without return_token_stats: unchanged
    finally:
        handle.uninstall()
    assert "forward" not in model.__dict__ and installed() == []


def test_a_model_without_an_lm_head_is_refused_with_a_sentence():
    with pytest.raises(TypeError, match="needs a transformers causal LM"):
        hf.inject_head(torch.nn.Linear(3, 4))


# ------------------------------------------------------------------ under FSDP2's fully_shard, 2 gloo ranks
SHARDINGS = {"layers-and-model": False, "lm_head-too": True}
BATCH = 4  # each of the 2 ranks takes half: data parallel, FSDP2 averages the gradients


def _batch():
    ids = torch.randint(3, 97, (BATCH, 9), generator=torch.Generator().manual_seed(2))
    return ids, lr.next_token_labels(ids)


def _sharded_program(rank, world):
    """Each sharding: the injected head's loss on this rank's half of the batch, backward; the full
    parameter gradients (``p.grad.full_tensor()``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    ids, labels = _batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = {}
    for name, head_too in SHARDINGS.items():
        model = _model("llama").train()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if head_too:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with hf.inject_head(model, outputs=("logprobs",), backend="chunked"):
            stats = model(ids[rows], labels=labels[rows], return_token_stats=True)
            (-stats.logprobs.sum()).backward()
        out[name] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def sharded():
    from logprob_registry.distributed import launch

    return [r.unwrap() for r in launch.run(2, _sharded_program, timeout=240)]


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_under_fully_shard_the_parameter_gradients_equal_the_single_process_ones(sharded, sharding):
    model = _model("llama").train()
    ids, labels = _batch()
    with hf.inject_head(model, outputs=("logprobs",), backend="chunked"):
        (-model(ids, labels=labels, return_token_stats=True).logprobs.sum() / 2).backward()  # FSDP2's mean
    want = {n: p.grad for n, p in model.named_parameters()}
    for rank, got in enumerate(sharded):
        assert set(got[sharding]) == set(want)
        for name, grad in want.items():
            torch.testing.assert_close(got[sharding][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}")
