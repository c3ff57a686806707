"""logprob_registry.integrations.trl against TRL 1.16 (the [test] extra installs it): install and
uninstall restore TRL's functions exactly, installing twice is harmless, the replaced functions
give this library's results (fp32 agreement with TRL's own, bf16 accuracy TRL's own lacks), and
the fused head and the distillation divergence go through token_stats and kl_divergence."""

import sys
import types

import pytest
import torch

import logprob_registry as lr
from logprob_registry.integrations import installed

trl_utils = pytest.importorskip("trl.trainer.utils", reason="needs trl (the [test] extra)")
distillation = pytest.importorskip("trl.trainer.distillation_trainer", reason="needs trl (the [test] extra)")
from logprob_registry.integrations import trl as integration  # noqa: E402 - after the skip

NAMES = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy",
         "_ChunkedLogProbFunction")


def _originals():
    return {name: getattr(trl_utils, name) for name in NAMES} | {"div": distillation.ChunkedDivergenceFunction}


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 7, 120, generator=g) * 3).to(dtype), torch.randint(0, 120, (3, 7), generator=g)


def test_install_twice_then_uninstall_restores_every_attribute():
    before = _originals()
    handle = integration.install()
    try:
        assert integration.install() is handle and installed() == ["trl"]
        assert all(getattr(trl_utils, n) is not before[n] for n in NAMES)
        with handle:  # a context manager too
            pass
        assert installed() == []
        handle.uninstall()  # harmless when already out
    finally:
        handle.uninstall()
    after = _originals()
    assert all(after[k] is before[k] for k in before)


def test_a_module_imported_while_installed_gets_the_original_back(monkeypatch):
    original = trl_utils.selective_log_softmax
    with integration.install():
        late = types.ModuleType("trl._imported_while_installed")  # as `from trl.trainer.utils import ...`
        late.selective_log_softmax = trl_utils.selective_log_softmax
        monkeypatch.setitem(sys.modules, late.__name__, late)
        assert late.selective_log_softmax is not original
    assert late.selective_log_softmax is original


def test_fp32_agrees_with_trl_and_bf16_is_accurate_where_trl_is_not():
    x, y = _data()
    mask = torch.ones_like(y)
    mask[0, :3] = 0
    theirs = trl_utils.selective_log_softmax_and_entropy(x, y, temperature=0.7, row_mask=mask)
    with integration.install():
        ours = trl_utils.selective_log_softmax_and_entropy(x, y, temperature=0.7, row_mask=mask)
        ent = trl_utils.entropy_from_logits(x)
        bf = trl_utils.selective_log_softmax(x.bfloat16(), y, temperature=0.7)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, trl_utils.entropy_from_logits(x), atol=1e-5, rtol=0)
    exact = torch.log_softmax(x.bfloat16().double() / 0.7, -1).gather(-1, y[..., None])[..., 0]
    trl_error = (trl_utils.selective_log_softmax(x.bfloat16(), y, temperature=0.7).double() - exact).abs().max()
    assert (bf.double() - exact).abs().max() < 1e-4 < trl_error


def test_the_fused_head_as_grpo_calls_it():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(9, 16, generator=g), torch.randn(50, 16, generator=g)
    args = (hidden, weight, None, torch.randint(0, 50, (9,), generator=g), 0.7, 32768, None, 1.0,
            ("log_probs", "entropy"))  # what GRPOTrainer's add_fused_lm_head passes
    theirs = trl_utils._ChunkedLogProbFunction.apply(*args)
    with integration.install():
        ours = trl_utils._ChunkedLogProbFunction.apply(*args)
    assert ours[2:] == (None, None, None) == theirs[2:]
    for a, b in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    leaf = hidden.clone().requires_grad_()
    with integration.install(), torch.autocast("cpu", dtype=torch.bfloat16):  # GRPOConfig's default bf16=True
        under = trl_utils._ChunkedLogProbFunction.apply(leaf, *args[1:])
        under[0].sum().backward()
    assert under[2:] == (None, None, None) and leaf.grad is not None
    torch.testing.assert_close(under[0], ours[0], atol=1e-5, rtol=0)  # fp32 products: autocast does not reach it


def test_the_fused_head_through_token_stats():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(20, 32, generator=g), torch.randn(300, 32, generator=g) * 0.4
    targets = torch.randint(0, 300, (20,), generator=g)
    args = (hidden, weight, None, targets, 0.8, 4096, 30.0, 0.5, ("entropy", "log_sum_sq_probs", "mean_logits",
                                                               "is_top1"))
    theirs = trl_utils._ChunkedLogProbFunction.apply(*args)
    with integration.install():
        ours = trl_utils._ChunkedLogProbFunction.apply(*args)
    for name, a, b in zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), ours, theirs):
        if name == "is_top1":
            assert torch.equal(a.bool(), b.bool()), name
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_distillation_divergence_through_kl_divergence(beta):
    g = torch.Generator().manual_seed(2)
    hs, ht = torch.randn(6, 16, generator=g), torch.randn(6, 24, generator=g)
    ws, wt = torch.randn(200, 16, generator=g) * 0.5, torch.randn(200, 24, generator=g) * 0.5
    theirs = distillation.ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta, 0.9)
    with integration.install():
        ours = distillation.ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta, 0.9)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=0)


def test_an_unsupported_version_names_the_range(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "0.9.0")
    with pytest.raises(ImportError, match=r"trl>=1.16,<1.17"):
        integration.install()
    assert installed() == [] and lr.integrations.installed() == []
