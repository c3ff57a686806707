"""The parity check against generation (logprob_registry.parity, ``logprob-registry parity``) on the
tiny Llama and Gemma-2: with the truncation replayed, the registry's teacher-forced logprobs equal
the processed logprobs Hugging Face's generate() sampled from, to within what fp32 rounding
explains; without it, the mean ratio is the mean kept mass, as predicted. Small settings: CI runs
this on two CPU cores."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[test]" (or ".[parity]")')

import logprob_registry as lr  # noqa: E402
from logprob_registry import parity  # noqa: E402
from logprob_registry.cli import main  # noqa: E402

SETTINGS = parity.Settings(temperature=0.7, top_k=50, top_p=0.8, new_tokens=8, prompts=2, prompt_length=6, seed=0)
# fp32 rounding of logits of |z| <= 20 at T = 0.7 is ~1e-6 per token; the bound parity derives adds
# worst-case dot-product rounding over H = 64 and stays below this. A missing softcap or a full-
# vocabulary normaliser costs 1e-2 or more.
FP32_SCALE = 1e-3


@pytest.fixture(scope="module")
def models():
    return parity.tiny_models(seed=0)


@pytest.fixture(scope="module")
def reports(models):
    out = {name: parity.check_model(m, name, SETTINGS) for name, m in models.items()}
    for r in out.values():
        print("\n" + parity.format_report(r))
    return out


def test_both_tiny_models_are_built_with_gemmas_softcap(models):
    assert sorted(models) == ["tiny-gemma2", "tiny-llama"]
    assert parity.model_softcap(models["tiny-gemma2"]) == 30.0
    assert parity.model_softcap(models["tiny-llama"]) is None
    again = parity.tiny_models(seed=0)["tiny-llama"]
    assert all(torch.equal(a, b) for a, b in zip(models["tiny-llama"].parameters(), again.parameters()))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_with_replay_teacher_forced_equals_generation_within_rounding(reports, name):
    r = reports[name]
    assert r.source == "hidden"  # through logprobs_from_hidden, the softcap replayed as a keyword
    assert r.replay.tokens == SETTINGS.prompts * SETTINGS.new_tokens and r.replay.outside_kept == 0
    assert 0 < r.bound_replay < FP32_SCALE, r.bound_replay
    assert r.replay.max_abs <= r.bound_replay, (r.replay.max_abs, r.bound_replay)
    assert abs(r.replay.mean_ratio - 1) <= r.bound_replay
    assert r.replay.outside_band == 0 and r.replay.pearson > 1 - 1e-9
    assert r.within_rounding


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_without_replay_the_mean_ratio_is_the_kept_mass(reports, name):
    r = reports[name]
    assert r.predicted_mean_ratio < 0.95, "top_k/top_p removed too little mass for the test to mean anything"
    assert abs(r.observed_mean_ratio - r.predicted_mean_ratio) <= r.bound_full
    assert r.max_mass_error <= r.bound_full < FP32_SCALE
    d = r.data
    assert torch.allclose((d.full - d.generation).exp(), d.kept_mass, rtol=r.bound_full, atol=0)
    assert r.full.max_abs > 100 * r.bound_replay and r.full.outside_band > 0.5


def _replay_backends():
    from logprob_registry.registry import Key, get_registry

    key = Key("logprobs_from_hidden", "cpu", torch.float32, False, frozenset({"softcap", "top_k", "top_p"}))
    # every backend that can run it (naive too, which the automatic choice passes over for memory)
    return [v.name for v in get_registry().verdicts(key) if v.reason is None and v.broken is None]


def test_replay_backends_found():
    assert {"naive", "chunked"} <= set(_replay_backends())


@pytest.mark.parametrize("backend", _replay_backends())
def test_every_backend_that_replays_matches_the_generation(models, reports, backend):
    """The report ran through the automatic choice; each eligible backend replays the same tokens
    to within the same bound."""
    for name, r in reports.items():
        d, model = r.data, models[name]
        got = []
        for seq in d.sequences:
            with torch.no_grad():
                hidden = model.get_decoder()(input_ids=seq[None, :-1]).last_hidden_state[0, d.prompt_length - 1:]
                got.append(lr.logprobs_from_hidden(hidden, model.lm_head.weight, seq[d.prompt_length:],
                                                   temperature=0.7, top_k=50, top_p=0.8,
                                                   softcap=parity.model_softcap(model), backend=backend))
        m = parity.metrics(torch.cat(got), d.generation)
        assert m.outside_kept == 0 and m.max_abs <= r.bound_replay, (name, m)


def test_a_replay_without_the_softcap_is_caught(models, reports):
    """Gemma-2's softcap, left out of the replay, moves the logprobs far beyond the bound."""
    model, r = models["tiny-gemma2"], reports["tiny-gemma2"]
    d = r.data
    got = []
    for seq in d.sequences:
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=seq[None, :-1]).last_hidden_state[0, d.prompt_length - 1:]
            got.append(lr.logprobs_from_hidden(hidden, model.lm_head.weight, seq[d.prompt_length:],
                                               temperature=0.7, top_k=50, top_p=0.8))
    wrong = parity.metrics(torch.cat(got), d.generation)
    assert wrong.max_abs > 100 * r.bound_replay, wrong


# The bf16 Gemma-2's replay (softcap=30, logits_dtype=bf16): the registry softcaps the bf16 logits
# in bf16, three rounded ops as the model's forward, so only the fp32 log-softmax's rounding is left:
# measured 2.4e-7 (chunked; naive 0), where the softcap computed in fp32 was off by 0.048.
BF16_REPLAY = 1e-6


@pytest.fixture(scope="module")
def gemma2_bf16(models):
    model = copy.deepcopy(models["tiny-gemma2"]).to(torch.bfloat16)  # = tiny_models(dtype=torch.bfloat16)'s
    return model, parity.check_model(model, "tiny-gemma2", SETTINGS)


def test_bf16_gemma2_replay_softcaps_in_bf16_as_the_model(gemma2_bf16):
    """In bf16 the model softcaps its bf16 logits with three bf16 ops; the replay
    (``logits_dtype=torch.bfloat16``) does the same and matches to fp32 rounding, in every backend
    that replays; the same replay with the softcap on the model's bf16 logits computed in float32
    (0.1's rule) is off by ~1e-2."""
    model, r = gemma2_bf16
    assert r.dtype == "bfloat16" and r.softcap == 30.0 and r.source == "hidden"
    assert r.replay.outside_kept == 0 and r.replay.tokens == SETTINGS.prompts * SETTINGS.new_tokens
    assert r.replay.max_abs <= BF16_REPLAY, r.replay
    assert abs(r.observed_mean_ratio - r.predicted_mean_ratio) <= BF16_REPLAY
    d = r.data
    weight = model.lm_head.weight
    for backend in _replay_backends():
        got, fp32_softcap = [], []
        for seq in d.sequences:
            with torch.no_grad():
                hidden = model.get_decoder()(input_ids=seq[None, :-1]).last_hidden_state[0, d.prompt_length - 1:]
                kw = dict(temperature=0.7, top_k=50, top_p=0.8, softcap=30.0, backend=backend)
                got.append(lr.logprobs_from_hidden(hidden, weight, seq[d.prompt_length:], logits_dtype=torch.bfloat16,
                                                   **kw))
                logits = torch.nn.functional.linear(hidden, weight).float()  # bf16 products, softcap in fp32
                fp32_softcap.append(lr.logprobs_from_logits(logits, seq[d.prompt_length:], **kw))
        m = parity.metrics(torch.cat(got), d.generation)
        assert m.outside_kept == 0 and m.max_abs <= BF16_REPLAY, (backend, m)
        assert parity.metrics(torch.cat(fp32_softcap), d.generation).max_abs > 1e-2, backend


def test_metrics_by_hand():
    gen = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    trainer = gen + torch.tensor([0.0, 0.2, -0.05, float("-inf")])
    m = parity.metrics(trainer, gen)
    d = torch.tensor([0.0, 0.2, -0.05], dtype=torch.float64)
    assert m.tokens == 3 and m.outside_kept == 1
    assert m.mean_abs == pytest.approx(0.25 / 3) and m.max_abs == pytest.approx(0.2)
    assert m.mult_prob_error == pytest.approx(float(d.abs().exp().mean()))
    assert m.k3_kl == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert m.outside_band == pytest.approx(1 / 3)  # exp(0.2) = 1.22
    assert m.pearson == pytest.approx(float(torch.corrcoef(torch.stack([trainer[:3], gen[:3]]))[0, 1]))


def test_the_models_own_generation_config_is_left_out_and_restored(models):
    """A repetition penalty in the model's generation_config would change the scores; the check
    samples with only temperature, top_k and top_p, and puts the model's config back."""
    model = models["tiny-llama"]
    saved = model.generation_config
    model.generation_config.repetition_penalty = 1.5
    try:
        r = parity.check_model(model, "penalised", parity.Settings(new_tokens=4, prompts=1))
        assert r.within_rounding and model.generation_config is saved
    finally:
        model.generation_config.repetition_penalty = None


def test_scores_changed_by_another_processor_are_refused():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(parity.ParityError, match="repetition penalty"):
        parity._check_scores(logits, logits / 0.7 - 0.1, 0.7, "m")
    assert parity._check_scores(logits, torch.tensor([[-float("inf"), 2 / 0.7, 3 / 0.7]]), 0.7, "m").tolist() == [
        [False, True, True]]


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=0.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.5), "min_p"), (dict(new_tokens=0), "new_tokens"),
])
def test_bad_settings_say_what_is_wrong(bad, message):
    with pytest.raises(parity.ParityError, match=message):
        parity.Settings(**bad).check()


def test_cli_prints_the_report(capsys, tmp_path):
    out = tmp_path / "parity.json"
    rc = main(["parity", "--tiny", "--prompts", "1", "--new-tokens", "4", "--device", "cpu", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("tiny-llama", "tiny-gemma2"):
        assert name in text
    assert text.count("with replay") >= 2 and "without replay" in text and "mean exp|Δ|" in text
    assert "predicted by the mean kept mass" in text and "softcap 30" in text
    doc = json.loads(out.read_text())
    assert [r["model"] for r in doc["reports"]] == ["tiny-llama", "tiny-gemma2"]
    assert all(r["within_rounding"] and r["settings"]["top_k"] == 50 for r in doc["reports"])


def test_cli_loads_a_saved_model(models, capsys, tmp_path):
    models["tiny-llama"].save_pretrained(tmp_path / "llama")
    rc = main(["parity", "--model", str(tmp_path / "llama"), "--prompts", "1", "--new-tokens", "4", "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"{tmp_path / 'llama'} (float32, V=1024, no softcap)" in text and "within what rounding explains" in text


def test_cli_usage_errors(capsys, tmp_path):
    assert main(["parity", "--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["parity", "--tiny", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["parity", "--tiny", "--min-p", "-0.1"]) == 2
    assert "min_p must be in [0, 1]" in capsys.readouterr().err


def test_cli_replays_min_p(capsys, tmp_path):
    out = tmp_path / "parity.json"
    rc = main(["parity", "--tiny", "--prompts", "1", "--new-tokens", "4", "--device", "cpu", "--min-p", "0.05",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    reports = json.loads(out.read_text())["reports"]
    assert all(r["settings"]["min_p"] == 0.05 and r["within_rounding"] for r in reports)


def test_transformers_is_imported_only_by_the_parity_check():
    code = ("import sys, logprob_registry, logprob_registry.parity, logprob_registry.cli; "
            "from logprob_registry.cli import build_parser; build_parser(); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_an_unknown_backend_is_a_usage_error_before_any_model_is_built(capsys):
    assert main(["parity", "--tiny", "--backend", "nope"]) == 2
    assert "logprob-registry parity: no backend named 'nope' is registered" in capsys.readouterr().err


def test_the_backend_named_is_the_one_that_ran_whatever_the_vocabulary():
    """The report names the backend selected for the very call the replay makes (its key from
    validate, the vocabulary's bucket included): at V <= 256 compiled and chunked declare
    min_vocab=257, so naive runs there, and a key without the bucket named another backend."""
    seen = []

    def recording(name):
        op = lr.get_registry().get(name).ops["logprobs"]

        def run(*args, **kw):
            seen.append(name)
            return op(*args, **kw)

        return run

    logits, ids = torch.randn(5, 200), torch.randint(0, 200, (5,))
    names = {b.name for b in lr.backends() if "logprobs" in b.ops}
    registry = lr.get_registry()
    originals = {n: registry.get(n).ops["logprobs"] for n in names}
    try:
        for n in names:
            registry.get(n).ops["logprobs"] = recording(n)
        parity._registry((logits, ids, {}), 0.7, None, {"top_k": 5})
    finally:
        for n, op in originals.items():
            registry.get(n).ops["logprobs"] = op
    named = parity._selected_backend((logits, ids, {}), 0.7, {"top_k": 5})
    assert seen == [named]
    assert named == lr.select("logprobs", shape=logits.shape).name


def test_the_replay_follows_generates_order_and_the_report_shows_vllms_would_differ(models, reports):
    """generate() applies min_p after top_k and top_p: the replay uses sampler="hf", which keeps
    generate's tokens exactly on the constructed case where vLLM's order (min_p first) does not."""
    for r in reports.values():
        assert r.order["hf_differs"] == 0 and r.order["vllm_differs"] > 0, r.order
        text = parity.format_report(r)
        assert 'replayed as sampler="hf"' in text and f'than "vllm" (min_p first) at {r.order["vllm_differs"]}' in text
        assert r.to_dict()["order"]["case"]["min_p"] == parity.ORDER_CASE["min_p"]
    settings = parity.Settings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, new_tokens=6, prompts=1,
                               prompt_length=6, seed=1)
    r = parity.check_model(models["tiny-llama"], "tiny-llama", settings)
    assert r.within_rounding and r.replay.outside_kept == 0, parity.format_report(r)
    assert "min_p 0.05" in parity.format_report(r)
