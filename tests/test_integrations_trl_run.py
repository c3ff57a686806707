"""A real TRL run under logprob_registry.integrations.trl: GRPOTrainer and RLOOTrainer (trl 1.16),
2 optimizer steps each on a tiny random 2-layer Llama with a tokenizer made here (no download), on
CPU, with and without ``install()``. Both trainers score completions through the fused head
``add_fused_lm_head`` patches in (``_ChunkedLogProbFunction``), which the integration replaces.

Shown: at fp32 the per-token log-probabilities the trainer computes agree within 1e-5 between the
two runs (same seed); in bf16 (bf16 weights, bf16 autocast) the integration's are within 1e-4 of a
float64 recomputation from the inputs the head received, where TRL's own are not; both runs train
to the end with a finite loss."""

import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="needs trl (the [test] extra)")
pytest.importorskip("datasets", reason="needs datasets (installed with trl)")
import datasets  # noqa: E402 - after the skip
import transformers  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

from logprob_registry.integrations import installed  # noqa: E402
from logprob_registry.integrations import trl as integration  # noqa: E402

WORDS = 300


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(WORDS - 3)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random tiny Llama saved once: each run loads the same weights (RLOO builds its reference
    model from the path)."""
    config = transformers.LlamaConfig(vocab_size=WORDS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


def _reward(completions, **kwargs):
    return [float(len(c.split()) % 3) + 0.1 * i for i, c in enumerate(completions)]


def _run(kind, bf16, install, tmp_path, model_path):
    """Train 2 steps; return (the trainer, its per-token log-probabilities, the head's calls)."""
    trainer_class, config_class = {"grpo": (trl.GRPOTrainer, trl.GRPOConfig),
                                   "rloo": (trl.RLOOTrainer, trl.RLOOConfig)}[kind]
    args = config_class(output_dir=str(tmp_path / f"{kind}-{bf16}-{install}"), per_device_train_batch_size=4,
                        num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2,
                        temperature=0.7, logging_steps=1, report_to="none", use_cpu=True, bf16=bf16, seed=0,
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32})
    dataset = datasets.Dataset.from_dict({"prompt": [f"w{i} w{i + 5} w{i + 9}" for i in range(3, 11)]})
    handle = integration.install() if install else None
    try:
        inner, calls, logps = trl_utils._ChunkedLogProbFunction, [], []

        class Recorder:  # the head the trainer calls, whichever it is (TRL's, or the integration's)
            @staticmethod
            def apply(*a):
                out = inner.apply(*a)
                calls.append(([x.detach().clone() if torch.is_tensor(x) else x for x in a[:8]],
                              out[0].detach().clone()))
                return out

        trl_utils._ChunkedLogProbFunction = Recorder
        try:
            trainer = trainer_class(model=model_path, reward_funcs=_reward,
                                    args=args, train_dataset=dataset, processing_class=_tokenizer())
            method = trainer._get_per_token_logps_and_entropies

            def recorded(*a, **k):
                out = method(*a, **k)
                logps.append(out[0].detach().clone())
                return out

            trainer._get_per_token_logps_and_entropies = recorded
            trainer.train()
        finally:
            trl_utils._ChunkedLogProbFunction = inner
    finally:
        if handle is not None:
            handle.uninstall()
    return trainer, logps, calls


def _float64_error(calls):
    """The largest distance of the head's log-probabilities from float64 on the same inputs."""
    worst = 0.0
    for (hidden, weight, bias, targets, temperature, _, softcap, scale), logp in calls:
        assert bias is None and softcap is None and scale == 1.0
        logits = hidden.double() @ weight.double().T / temperature
        exact = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        worst = max(worst, (logp.double() - exact).abs().max().item())
    return worst


def _trained(trainer):
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 2 and len(losses) == 2, trainer.state.log_history
    assert all(math.isfinite(loss) for loss in losses), losses


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_real_run_agrees_at_fp32_and_is_accurate_in_bf16(kind, tmp_path, model_path):
    theirs, trl_logps, _ = _run(kind, False, False, tmp_path, model_path)
    ours, our_logps, our_calls = _run(kind, False, True, tmp_path, model_path)
    assert installed() == [] and trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    assert our_calls and all(isinstance(c[0][0], torch.Tensor) for c in our_calls)
    assert len(trl_logps) == len(our_logps) >= 2
    for a, b in zip(our_logps, trl_logps):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    _trained(theirs)
    _trained(ours)

    theirs, _, trl_calls = _run(kind, True, False, tmp_path, model_path)
    ours, _, our_calls = _run(kind, True, True, tmp_path, model_path)
    assert our_calls[0][0][0].dtype == torch.bfloat16 and our_calls[0][0][1].dtype == torch.bfloat16
    assert _float64_error(our_calls) < 1e-4 < _float64_error(trl_calls)
    _trained(theirs)
    _trained(ours)
