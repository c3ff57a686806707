"""logprob_registry.integrations.verl against verl 0.9.1 (installed with --no-deps, its pins clash;
it needs ray and the [test] extra's tensordict, omegaconf, peft, codetiming): through verl's own call
sites, its FSDP engine's output step (temperature division included) and the fused forward verl
patches into a model (torch and triton backends), this library's results after install() and
verl's after uninstall(), the originals restored by identity; installing twice is harmless; another
verl version raises."""

import os
import subprocess
import sys
import types

import pytest
import torch

import logprob_registry as lr

verl = pytest.importorskip("verl", reason="needs verl==0.9.1 (pip install --no-deps verl==0.9.1, and ray)")
import transformers  # noqa: E402 - after the skip
import verl.utils.experimental.torch_functional as experimental  # noqa: E402
import verl.utils.kernel.linear_cross_entropy as kernel  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402
import verl.workers.engine.fsdp.transformer_impl as fsdp  # noqa: E402
import verl.workers.rollout.naive.naive_rollout as naive  # noqa: E402
from verl.models.transformers.monkey_patch import patch_forward_with_backends  # noqa: E402

from logprob_registry.integrations import installed  # noqa: E402
from logprob_registry.integrations import verl as integration  # noqa: E402

PLACES = [(verl_F, "logprobs_from_logits"), (verl_F, "entropy_from_logits"),
          (verl_F, "entropy_from_logits_with_chunking"), (fsdp, "logprobs_from_logits"),
          (naive, "logprobs_from_logits"), (fsdp, "_scale_logits_by_temperature"),
          (experimental, "FusedLinearForPPO"), (kernel, "linear_cross_entropy")]


def _originals():
    return [getattr(module, name) for module, name in PLACES]


BEFORE = _originals()


def test_install_twice_then_uninstall_restores_every_attribute():
    before = _originals()
    handle = integration.install()
    try:
        assert integration.install() is handle and installed() == ["verl"]
        assert all(now is not then for now, then in zip(_originals(), before))
        assert fsdp.logprobs_from_logits is verl_F.logprobs_from_logits is naive.logprobs_from_logits
        assert "verl.workers.engine.fsdp.transformer_impl._scale_logits_by_temperature" in handle.replaced
    finally:
        handle.uninstall()
    handle.uninstall()  # harmless when already out
    assert installed() == [] and all(now is then for now, then in zip(_originals(), before))


def test_a_module_imported_while_installed_gets_the_original_back(monkeypatch):
    with integration.install():
        late = types.ModuleType("verl._imported_while_installed")  # as `from verl.utils.torch_functional import`
        late.logprobs_from_logits = verl_F.logprobs_from_logits
        monkeypatch.setitem(sys.modules, late.__name__, late)
        assert late.logprobs_from_logits is not BEFORE[0]
    assert late.logprobs_from_logits is BEFORE[0]


class _Engine:
    """What FSDPEngineWithLMHead.prepare_model_outputs reads of its engine (no FSDP, no sequence parallelism);
    built like an engine, so it picks verl_F.entropy_from_logits when it is built."""

    use_ulysses_sp = False
    engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    _gather_and_unpad_packed = fsdp.FSDPEngine._gather_and_unpad_packed
    prepare_model_outputs = fsdp.FSDPEngineWithLMHead.prepare_model_outputs

    def __init__(self):
        self.compute_entropy_from_logits = verl_F.entropy_from_logits


def _engine_step(logits, labels, lengths, temperature):
    """verl's FSDP engine's output step, remove-padding path: the model's (1, tokens, V) logits to
    per-token log-probabilities and entropy (nested, one row per sequence)."""
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    input_ids = torch.nested.nested_tensor_from_jagged(labels, offsets)
    output_args = {"input_ids_rmpad_rolled": labels, "pad_size": 0, "temperature_is_one": temperature == 1.0,
                   "temperature_rmpad": torch.full(labels.shape, temperature)}
    micro_batch = {"input_ids": input_ids, "use_remove_padding": True, "calculate_entropy": True}
    out = _Engine().prepare_model_outputs(types.SimpleNamespace(logits=logits[None]), output_args, micro_batch, None)
    return out["log_probs"].values(), out["entropy"].values()


def _exact(logits, labels, temperature):
    z = logits.double() / temperature
    return torch.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0], torch.distributions.Categorical(logits=z).entropy()


def test_the_engine_step_gives_this_librarys_results_then_verls():
    g = torch.Generator().manual_seed(0)
    logits, labels = (torch.randn(11, 500, generator=g) * 4).bfloat16(), torch.randint(0, 500, (11,), generator=g)
    leaf = logits.clone().requires_grad_()
    with integration.install():
        logp, entropy = _engine_step(leaf, labels, [4, 7], 0.7)
    (logp.sum() + entropy.sum()).backward()  # through the float32 division to the bf16 logits
    wide = logits.double().requires_grad_()
    sum(_exact(wide, labels, 0.7)[i].sum() for i in (0, 1)).backward()
    torch.testing.assert_close(leaf.grad.double(), wide.grad, atol=1e-3, rtol=1e-2)
    logp, entropy = logp.detach(), entropy.detach()
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, lr.logprobs_from_logits(logits, labels, temperature=0.7), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, lr.entropy_from_logits(logits, temperature=0.7), atol=1e-5, rtol=0)
    theirs = _engine_step(logits, labels, [4, 7], 0.7)
    quotient = logits / torch.tensor(0.7).to(torch.bfloat16)  # verl's division, in bf16
    assert torch.equal(theirs[0], verl_F.logprobs_from_logits(quotient, labels))
    assert torch.equal(theirs[1], verl_F.entropy_from_logits(quotient))
    exact = _exact(logits, labels, 0.7)
    ours_error = max((a.double() - b).abs().max().item() for a, b in zip((logp, entropy), exact))
    verl_error = max((a.double() - b).abs().max().item() for a, b in zip(theirs, exact))
    assert ours_error < 1e-4 < verl_error


def _model():
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    # a subclass: verl's patch replaces the model's class's forward
    return type("TinyLlama", (transformers.LlamaForCausalLM,), {})(config).bfloat16().eval()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_fused_forward_gives_this_librarys_results_then_verls(impl):
    model, ids = _model(), torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=impl)
    labels = torch.roll(ids, -1, -1)
    hidden = model.model(input_ids=ids).last_hidden_state
    with integration.install():
        out = model(input_ids=ids, return_dict=True, temperature=0.7)
    expected = lr.token_stats(hidden.reshape(-1, 32), labels.reshape(-1), weight=model.lm_head.weight,
                              outputs=("logprobs", "entropy"), temperature=0.7)
    torch.testing.assert_close(out.log_probs.reshape(-1), expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.reshape(-1), expected.entropy, atol=1e-5, rtol=0)
    exact = _exact(hidden.reshape(-1, 32).double() @ model.lm_head.weight.double().T, labels.reshape(-1), 0.7)[0]
    assert (out.log_probs.reshape(-1).double() - exact).abs().max() < 1e-4
    if impl == "torch":  # verl's own again (its Triton kernel needs a GPU)
        theirs = model(input_ids=ids, return_dict=True, temperature=0.7)
        reference = experimental.FusedLinearForPPOFunction.apply(hidden, model.lm_head.weight, labels, 0.7, 512)
        assert torch.equal(theirs.log_probs, reference[0])
        assert (theirs.log_probs.reshape(-1).double() - exact).abs().max() > 1e-4
    assert all(now is then for now, then in zip(_originals(), BEFORE))


def test_an_unsupported_version_names_the_range(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.8.0")
    with pytest.raises(ImportError, match=r"verl>=0.9.1,<0.10"):
        integration.install()
    assert installed() == []


def test_a_worker_process_installs_through_verls_external_modules(tmp_path):
    """verl imports the modules VERL_USE_EXTERNAL_MODULES names in every process that imports it
    (its Ray workers too): one that calls install() puts the integration there."""
    (tmp_path / "lr_verl_hook.py").write_text("from logprob_registry.integrations import verl\nverl.install()\n")
    code = ("import verl.workers.engine.fsdp.transformer_impl as f, logprob_registry as lr; "
            "print(lr.integrations.installed(), f.logprobs_from_logits.__module__)")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="lr_verl_hook",
               PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['verl'] logprob_registry.integrations.verl", done.stdout
