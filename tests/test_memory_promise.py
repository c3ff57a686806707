"""Memory is part of "best": each op's memory promise (the op table), each backend's verdict
(declared by copies_logits, or measured by tune), the automatic choice among the backends keeping
it, with or without a ranking, the explicit speed-over-memory setting, and explain's verdicts."""

import pytest
import torch

import logprob_registry as lr
from logprob_registry.config import ConfigError
from logprob_registry.opspec import MEMORY_NOISE, NO_LOGITS, OPS
from logprob_registry.registry import Key
from logprob_registry.tuning import cache

SKIP_HEAD = "breaks the memory promise of logprobs_from_hidden (never the (N, V) logits)"


def _ranking(path, entries):
    """A ranking file as tune writes it, for this process's machine, torch and backend versions."""
    registry = lr.get_registry()
    env, versions = registry.environment(), registry.versions()
    names = {n for e in entries.values() for n in e.times}
    ranking = cache.Ranking(str(env.torch_version), {"cpu": cache.machine("cpu", env.devices["cpu"].names)},
                            {n: versions[n] for n in names}, entries)
    ranking.save(str(path))


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """``tuned(entries)``: the process-wide registry following a ranking of ``entries`` (by key string)."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path))
    monkeypatch.delenv("LOGPROB_REGISTRY_MEMORY", raising=False)

    def write(entries):
        _ranking(path, entries)
        lr.get_registry().reset()
        return lr.get_registry()

    yield write
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
    monkeypatch.delenv("LOGPROB_REGISTRY_MEMORY", raising=False)
    lr.get_registry().reset()


def _fused_inputs(rows=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 40, generator=g), torch.randn(300, 40, generator=g) * 0.3, \
        torch.randint(0, 300, (rows,), generator=g)


FUSED = cache.key_string("logprobs_from_hidden", "cpu", torch.float32, True, 2048, 256)  # V=300, H=40


def test_the_op_table_declares_each_ops_promise_once():
    for op in ("logprobs_from_hidden",):
        assert OPS[op].promise() is NO_LOGITS
    for op in ("kl_divergence", "token_stats"):
        assert OPS[op].promise(hidden=256) is NO_LOGITS and OPS[op].promise(lowest_vocab=257) is None
    assert OPS["kl_divergence"].promise(features=frozenset({"kl_hidden"})) is NO_LOGITS
    for op in ("logprobs", "entropy", "logprobs_and_entropy", "topk_logprobs"):  # given logits: none
        assert OPS[op].promise(lowest_vocab=2049) is None and OPS[op].promise(lowest_vocab=1) is None
    assert OPS["shard_stats"].promise() is None
    # a reading: growth beyond the gradients against the float32 logits' growth, MEMORY_NOISE forgiven
    logits = (4096 - 16) * 32768 * 4
    assert NO_LOGITS.judge({"16": 0, "4096": MEMORY_NOISE + 0.05 * logits}, 32768)[:2] == (True, pytest.approx(0.05))
    assert NO_LOGITS.judge({"16": 0, "4096": MEMORY_NOISE + 2 * logits}, 32768)[0] is False
    assert NO_LOGITS.judge({"16": 5.0}, 32768)[0] is None  # one row count: no verdict


def test_a_ranking_putting_naive_first_no_longer_makes_the_fused_ops_choice_naive(tuned):
    registry = tuned({FUSED: cache.Entry({"naive": 0.001, "chunked": 0.002, "compiled": 0.003}, vocab=300,
                                         hidden=40)})
    hidden, weight, labels = _fused_inputs()
    args = dict(device="cpu", shape=(3, 300), hidden_size=40, requires_grad=True)
    assert lr.select("logprobs_from_hidden", **args).name == "chunked"  # the fastest keeping the promise
    report = lr.explain("logprobs_from_hidden", **args)
    assert report["naive"].status == "skipped" and report["naive"].keeps is False
    assert report["naive"].why.startswith(SKIP_HEAD + ": it declares copies_logits")
    assert "LOGPROB_REGISTRY_MEMORY=speed, or choose it explicitly" in report["naive"].why
    assert report["chunked"].memory == "keeps (declared)" and report["naive"].memory == "breaks (declared)"
    text = str(report)
    assert "memory" in text.splitlines()[1] and "memory promise of logprobs_from_hidden: never forms" in text
    # the call runs what explain names: chunked's bits, the gradient included
    h = hidden.clone().requires_grad_(True)
    out = lr.logprobs_from_hidden(h, weight, labels)
    out.sum().backward()
    h2 = hidden.clone().requires_grad_(True)
    ref = lr.logprobs_from_hidden(h2, weight, labels, backend="chunked")
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(h.grad, h2.grad)
    assert registry.select(Key("logprobs_from_hidden", "cpu", torch.float32, True, vocab=2048, hidden=256)).name \
        == "chunked"


def test_speed_over_memory_is_explicit(tuned, monkeypatch):
    tuned({FUSED: cache.Entry({"naive": 0.001, "chunked": 0.002}, vocab=300, hidden=40)})
    args = dict(device="cpu", shape=(3, 300), hidden_size=40, requires_grad=True)
    assert lr.select("logprobs_from_hidden", **args).name == "chunked"
    monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "speed")  # read at each call: cached choices follow it
    assert lr.select("logprobs_from_hidden", **args).name == "naive"
    report = lr.explain("logprobs_from_hidden", **args)
    assert report.chosen == "naive" and report["naive"].memory == "breaks (declared)"
    assert "LOGPROB_REGISTRY_MEMORY=speed: a backend breaking it is not passed over" in str(report)
    monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "fast")
    with pytest.raises(ConfigError, match="LOGPROB_REGISTRY_MEMORY='fast' is neither \"promise\""):
        lr.logprobs_from_hidden(*_fused_inputs())
    monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "promise")
    assert lr.select("logprobs_from_hidden", **args).name == "chunked"


def test_an_explicit_choice_is_the_users_decision(tuned, monkeypatch):
    tuned({FUSED: cache.Entry({"naive": 0.001, "chunked": 0.002}, vocab=300, hidden=40)})
    hidden, weight, labels = _fused_inputs()
    expected = lr.logprobs_from_hidden(hidden, weight, labels, backend="naive")
    with lr.use_backend("naive"):
        assert torch.equal(lr.logprobs_from_hidden(hidden, weight, labels), expected)
        report = lr.explain("logprobs_from_hidden", device="cpu", shape=(3, 300), hidden_size=40, requires_grad=True)
        assert report.chosen == "naive" and report.forced == "naive (use_backend())"
    monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "naive")
    assert lr.select("logprobs_from_hidden", device="cpu", shape=(3, 300), hidden_size=40, requires_grad=True).name \
        == "naive"
    assert torch.equal(lr.logprobs_from_hidden(hidden, weight, labels), expected)


def test_without_a_ranking_and_for_the_other_ops_given_hidden_states(tuned):
    tuned({})
    # kl_divergence from hidden states and token_stats with a weight: naive forms the logits
    for op in ("kl_divergence", "token_stats"):
        key = lr.explain(op, device="cpu", shape=(3, 4096), hidden_size=64)
        assert key.chosen == "chunked" and key["naive"].status == "skipped"
        assert key["naive"].why.startswith(f"breaks the memory promise of {op} (never the (N, V) logits)")
    # token_stats with a weight, a ranking preferring naive (V=300, H=40): still chunked
    tuned({cache.key_string("token_stats", "cpu", torch.float32, False, 2048, 256):
           cache.Entry({"naive": 0.001, "chunked": 0.002}, vocab=300, hidden=40)})
    assert lr.explain("token_stats", device="cpu", shape=(3, 300), hidden_size=40).chosen == "chunked"


def test_the_logits_ops_rule_and_where_nothing_keeps_it(tuned):
    # given logits there is no promise: a ranking preferring naive (which copies them) is followed
    tuned({cache.key_string("logprobs", "cpu", torch.float32, False, 2048):
           cache.Entry({"naive": 0.001, "chunked": 0.002, "compiled": 0.003}, vocab=1000)})
    report = lr.explain("logprobs", device="cpu", shape=(3, 1000))
    assert report.chosen == "naive" and "memory promise" not in str(report)
    # the fused op at V <= 256: the backends keeping it declare min_vocab, so nothing keeping it is
    # eligible and naive runs, explain saying so
    tiny = lr.explain("logprobs_from_hidden", device="cpu", shape=(3, 100), hidden_size=40)
    assert tiny.chosen == "naive" and tiny["naive"].keeps is False
    assert "the backends keeping it are passed over here (why not): the choice is made as without it" in str(tiny)


def test_a_measurement_overrides_the_declaration(make_registry, tmp_path, monkeypatch):
    def fused(hidden, weight, labels, **kw):
        return torch.zeros(labels.shape)

    class Two:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="copier", ops={"logprobs_from_hidden": fused}, priority=20, copies_logits=True))
            register(lr.Backend(name="tiler", ops={"logprobs_from_hidden": fused}, priority=10))

    from logprob_registry.environment import Environment

    path = tmp_path / "tuning.json"
    reg = make_registry(("two", Two()), environment=Environment.fake(torch="2.6.0"), ranking=cache.Tuning(path))
    key = Key("logprobs_from_hidden", "cpu", torch.float32, True, vocab=65536, hidden=1024)
    assert reg.explain(key).chosen == "tiler"  # declared: the copier breaks the promise
    grows = {"16": 0.0, "2048": float(MEMORY_NOISE + 2 * 2032 * 32768 * 4)}  # twice the logits' growth
    flat = {"16": 0.0, "2048": 1e6}
    ranking = cache.Ranking("2.6.0", {"cpu": cache.machine("cpu", ("fake CPU",))}, {}, {
        cache.string_of(key): cache.Entry({"copier": 0.001, "tiler": 0.002}, vocab=32768, hidden=1024,
                                          memory={"copier": flat, "tiler": grows})})
    ranking.save(str(path))
    reg.reset()
    report = reg.explain(key)
    assert report.chosen == "copier" and report["copier"].memory == "keeps (measured: 0.00x)"
    assert report["tiler"].memory == "breaks (measured: 2.00x)"
    assert "measured from 16 to 2048 rows at V=32768, its extra peak beyond the gradients grew by 2.00x" \
        in report["tiler"].why
    assert cache.load(str(path)).entries[cache.string_of(key)].memory["tiler"] == grows  # the file keeps it
    # tune --backend tiler again: its reading replaced, the copier's kept
    again = cache.Ranking("2.6.0", ranking.machines, {}, {cache.string_of(key): cache.Entry(
        {"tiler": 0.002}, vocab=32768, hidden=1024, memory={"tiler": flat})})
    merged = ranking.merged(again).entries[cache.string_of(key)]
    assert merged.memory == {"copier": flat, "tiler": flat}


def test_tune_measures_peak_memory_beside_time():
    from logprob_registry.tuning.measure import Plan, run

    # V=1000, H=64: the memory rows fit 2^23 logits (32 MiB of fp32, as much again for the gradient)
    plan = Plan(ops=("logprobs_from_hidden",), dtypes=(torch.float32,), grads=(True,), vocabs=(1000,), hiddens=(64,),
                rows=(16,), backends=("naive", "chunked"), repeat=1, warmup=0, max_elements=1 << 23)
    assert plan.memory_rows(1000, 64) == [16, 8388]
    ranking = run(plan)
    entry = next(iter(ranking.entries.values()))
    assert set(entry.memory) == {"naive", "chunked"} and set(entry.memory["naive"]) == {"16", "8388"}
    assert NO_LOGITS.judge(entry.memory["naive"], 1000)[0] is False, entry.memory
    assert NO_LOGITS.judge(entry.memory["chunked"], 1000)[0] is True, entry.memory
