"""``logprob-registry check --against MODULE:FUNCTION --signature NAME``: the suite as the judge of
foreign functions. A correct function (this library's ``naive`` op called as verl calls its
``logprobs_from_logits``) conforms; each planted bug departs on the peer case named after it; TRL's
``selective_log_softmax`` departs on the bf16 temperature case.

The planted functions live in this module, which the suite's process imports by name
(``test_against:FUNCTION``, from this folder)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import logprob_registry as lr
from logprob_registry.cli import main
from logprob_registry.testing.against import (
    CONVENTIONS,
    Convention,
    NotExpressible,
    backend_for,
    check_against,
    import_target,
    register_convention,
)

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------- foreign functions
def naive_logprobs(logits, labels):
    """Correct: verl's ``logprobs_from_logits(logits, labels)`` convention over the ``naive`` op."""
    return lr.logprobs_from_logits(logits, labels, backend="naive")


def _lse_logprobs(x, labels, lse):
    return x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse


def planted_vocab_1024(logits, labels):
    """Bug: the log-sum-exp covers whole blocks of 1024 columns only (the tail is dropped)."""
    x = logits.float()
    vocab = x.shape[-1]
    covered = vocab // 1024 * 1024 or vocab
    return _lse_logprobs(x, labels, x[..., :covered].logsumexp(-1))


def planted_positive(logits, labels):
    """Bug: an offset of 1e-6 nats, within the tolerance but positive where p rounds to 1."""
    return naive_logprobs(logits, labels) + 1e-6


def planted_last_row(logits, labels):
    """Bug: the last row of the flattened batch reads the row before it (its own label)."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    y = labels.reshape(-1)
    if x.shape[0] > 1:
        rows = torch.arange(x.shape[0], device=x.device)
        rows[-1] = x.shape[0] - 2
        x = x[rows]
    return x.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1).reshape(labels.shape)


def planted_nondeterministic(logits, labels):
    """Bug: the log-sum-exp adds per-block partial sums in a random order at each call (as atomics
    from blocks that finish in any order do)."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    parts = [(block - m).exp().sum(-1) for block in x.split(256, dim=-1)]
    total = torch.zeros_like(m.squeeze(-1))
    for i in torch.randperm(len(parts)).tolist():
        total = total + parts[i]
    return _lse_logprobs(x, labels, m.squeeze(-1) + total.log())


def planted_bf16_temperature(logits, index, temperature=1.0):
    """Bug (TRL's convention): the temperature divides the logits in their own dtype (bf16), then
    everything is float32."""
    x = logits / temperature if temperature != 1.0 else logits
    return x.float().log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


PLANTED = {
    "planted_vocab_1024": ("verl-logprobs", "test_peer_vocab_not_multiple_of_1024"),
    "planted_positive": ("verl-logprobs", "test_peer_logprob_not_positive"),
    "planted_last_row": ("verl-logprobs", "test_peer_last_row"),
    "planted_nondeterministic": ("verl-logprobs", "test_peer_repeated_runs"),
    "planted_bf16_temperature": ("trl-selective", "test_peer_bf16_temperature"),
}


def _departed(result) -> set:
    return {d.case.split("[")[0] for d in result.departures}


# ----------------------------------------------------------------------- tests
def test_correct_function_passes_clean(monkeypatch, capsys):
    """The CLI on the naive op wrapped as a verl-logprobs function: every expressible case
    conforms, the rest are listed as not expressible, exit status 0."""
    monkeypatch.chdir(HERE)  # the suite's process imports test_against from the working directory
    status = main(["check", "--against", "test_against:naive_logprobs", "--signature", "verl-logprobs"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "0 depart" in out and "departures from the contract" not in out
    assert "not expressible by the convention" in out
    assert "verl-logprobs takes no temperature" in out
    assert "stands for no op entropy" in out


@pytest.mark.parametrize("function", list(PLANTED))
def test_planted_bug_departs_on_its_case(function):
    signature, case = PLANTED[function]
    result = check_against(f"test_against:{function}", signature, path=[HERE])
    assert not result.ok and result.verdict == "FAIL", result.output[-3000:]
    assert case in _departed(result), (
        f"{function} should depart on {case}; departures: {sorted(d.case for d in result.departures)}")
    # the correct function passes the same case: the case names the bug, not the convention
    d = next(d for d in result.departures if d.case.startswith(case))
    assert d.error and d.shows


def test_cli_prints_departures_and_fails(monkeypatch, capsys):
    monkeypatch.chdir(HERE)
    status = main(["check", "--against", "test_against:planted_positive", "--signature", "verl-logprobs",
                   "-k", "peer"])
    out = capsys.readouterr().out
    assert status == 1
    assert "departures from the contract:" in out
    assert "test_peer_logprob_not_positive[logprobs] (verl#2656)" in out
    assert "positive log-probability" in out


def test_usage_errors(capsys):
    assert main(["check", "--against", "no_such_module_xyz:f", "--signature", "verl-logprobs"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["check", "--against", "test_against:naive_logprobs", "--signature", "no-such"]) == 2
    assert "unknown calling convention" in capsys.readouterr().err
    assert main(["check", "--against", "test_against:naive_logprobs"]) == 2
    assert main(["check", "--against", "os:getcwd", "--signature", "verl-logprobs", "--declare", "deterministic"]) == 2


def test_conventions_table_is_public_and_extensible():
    for name in ("verl-logprobs", "verl-fused", "trl-selective", "trl-selective-entropy", "trl-chunked-head",
                 "torch-lce", "liger-flce", "liger-flsce"):
        assert name in CONVENTIONS, name
        assert CONVENTIONS[name].doc and CONVENTIONS[name].ops
    mine = Convention("test-doubled", ("logprobs",),
                      lambda fn: {"logprobs": lambda logits, labels, *, temperature, ignore_index, inplace_backward:
                                  fn(logits / temperature, labels)},
                      "doubled(logits, labels) -> logprobs")
    register_convention(mine)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_convention(mine)
        backend = backend_for(naive_logprobs, mine, "against-test-doubled")
        assert backend.ops.keys() == {"logprobs"} and backend.deterministic and backend.copies_logits
    finally:
        CONVENTIONS.pop("test-doubled")


def test_not_expressible_is_raised_by_the_adapter():
    ops = CONVENTIONS["verl-logprobs"].adapt(naive_logprobs)
    x, y = torch.randn(2, 5), torch.tensor([1, -100])
    out = ops["logprobs"](x, y, temperature=1.0, ignore_index=-100, inplace_backward=False)
    assert out[1] == 0 and torch.allclose(out[0], x.log_softmax(-1)[0, 1])
    with pytest.raises(NotExpressible, match="takes no temperature"):
        ops["logprobs"](x, y, temperature=0.5, ignore_index=-100, inplace_backward=False)
    assert import_target("trl.kernels:ChunkedLogProbFunction.apply" if importlib.util.find_spec("trl")
                         else "torch.nn.functional:linear_cross_entropy")


# ------------------------------------------------------------------- the field
requires_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                  reason="trl is not installed (pip install 'logprob-registry[peers]')")


@requires_trl
def test_trl_selective_log_softmax_bf16_temperature_departs():
    """TRL 1.16's selective_log_softmax divides bf16 logits by the temperature in bf16 (and takes the
    bf16 log_softmax): the peer case names it."""
    result = check_against("trl.trainer.utils:selective_log_softmax", "trl-selective", keyword="peer")
    assert "test_peer_bf16_temperature" in _departed(result), [d.case for d in result.departures]
    d = next(d for d in result.departures if d.case.startswith("test_peer_bf16_temperature"))
    assert "temperature" in d.issue and "tolerance" in d.error


def test_torch_linear_cross_entropy_conforms_where_expressible():
    """torch 2.13's F.linear_cross_entropy (reduction='none', log p = -loss) on the fused-head cases
    it can express: the peer cases of the fused head."""
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
    result = check_against("torch.nn.functional:linear_cross_entropy", "torch-lce", keyword="peer_hidden")
    assert result.passed, result.output[-3000:]
    assert not [d for d in result.departures if "float32" in d.shows], [d.case for d in result.departures]


def test_liger_conventions_name_the_missing_package(capsys):
    backend = backend_for(lambda *a, **k: None, CONVENTIONS["liger-flce"], "against-liger")
    assert "liger-kernel" in backend.requires
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed: nothing is missing to name")
    for signature in ("liger-ce", "liger-flce", "liger-flsce"):
        assert main(["check", "--against", "liger_kernel.transformers.functional:liger_fused_linear_cross_entropy",
                     "--signature", signature]) == 2
        assert "pip install 'liger-kernel'" in capsys.readouterr().err


def _flsce_like(hidden, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy):
    """Liger's FLSCE calling convention (nll, and the entropy), in float64."""
    logp = torch.log_softmax((hidden.double() @ weight.double().T) / temperature, dim=-1)
    nll = -logp.gather(-1, target[:, None])[:, 0]
    nll = nll.masked_fill(target == ignore_index, 0.0).float()
    return (nll, -(logp.exp() * logp).sum(-1).float()) if return_entropy else nll


def test_liger_flsce_convention_maps_temperature_entropy_and_ignored_rows():
    """liger-flsce hands Liger's fused linear *scaled* cross-entropy the temperature and asks for its
    entropy; ignored rows get label 0 (the entropy is the row's) and log-probability 0; a bias is refused."""
    op = backend_for(_flsce_like, CONVENTIONS["liger-flsce"], "against-flsce").ops["logprobs_from_hidden"]
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(40, 8, generator=g)
    labels = torch.randint(0, 40, (2, 3), generator=g)
    labels[0, 1] = -100
    logp, ent = op(hidden, weight, labels, bias=None, temperature=0.7, ignore_index=-100, return_entropy=True)
    z = torch.log_softmax((hidden.double() @ weight.double().T) / 0.7, dim=-1)
    expected = z.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(labels == -100, 0.0)
    torch.testing.assert_close(logp.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(z.exp() * z).sum(-1), rtol=0, atol=1e-5)
    assert logp[0, 1] == 0 and ent[0, 1] != 0
    with pytest.raises(NotExpressible, match="takes no bias"):
        op(hidden, weight, labels, bias=torch.zeros(40), temperature=1.0, ignore_index=-100, return_entropy=False)
