"""Measured, size-aware selection: vocabulary buckets, min_vocab, the tuning ranking (its file, its
validity, how selection and explain follow it), `logprob-registry tune`, and batch invariance of
the automatic choice."""

import json
import os
import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry.cli import main
from logprob_registry.environment import Environment
from logprob_registry.registry import Key, vocab_bucket
from logprob_registry.registry.key import bucket_range
from logprob_registry.tuning import cache


def _op(logits, labels=None, **kw):
    return torch.zeros(logits.shape[:-1])


class Three:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="fast-big", ops={"logprobs": _op}, priority=20, min_vocab=4096))
        register(lr.Backend(name="middle", ops={"logprobs": _op}, priority=10))
        register(lr.Backend(name="slow", ops={"logprobs": _op}, priority=0))


ENV = Environment.fake(torch="2.6.0")


def _tuned(make_registry, tmp_path, monkeypatch, plugin, name):
    """A registry of ``plugin`` alone whose ranking is a tuning file in ``tmp_path``."""
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(tmp_path / "tuning.json"))
    return make_registry((name, plugin), environment=ENV, ranking=cache.Tuning())


@pytest.fixture
def registry(make_registry, tmp_path, monkeypatch):
    return _tuned(make_registry, tmp_path, monkeypatch, Three(), "three")


def _write(path, entries, torch_version="2.6.0", versions=None, machine=None):
    ranking = cache.Ranking(torch_version, {"cpu": machine or cache.machine("cpu", ("fake CPU",))},
                            versions or {}, {k: cache.Entry(**v) for k, v in entries.items()})
    ranking.save(str(path))


def test_buckets():
    assert [vocab_bucket(v) for v in (1, 256, 257, 1000, 2048, 32000, 50257, 151936, 262144, 262145, 0)] == \
        [256, 256, 2048, 2048, 2048, 65536, 65536, 262144, 262144, -1, 0]
    assert bucket_range(2048) == (257, 2048) and bucket_range(-1) == (262145, None)


def test_min_vocab_passes_a_backend_over_for_small_vocabularies_only(registry):
    small = registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=vocab_bucket(1000)))
    assert small.chosen == "middle"
    assert small["fast-big"].status == "skipped"
    assert small["fast-big"].why == ("not worth it for vocabularies of 257 to 2048 (declares min_vocab=4096); "
                                     "choose it explicitly to use it anyway")
    big = registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=vocab_bucket(32000)))
    assert big.chosen == "fast-big"
    # unknown size (select() without a shape): no size rule applies
    assert registry.explain(Key("logprobs", "cpu", torch.float32, False)).chosen == "fast-big"
    # an explicit choice is never passed over
    assert registry.select(Key("logprobs", "cpu", torch.float32, False, vocab=2048), backend="fast-big").name == "fast-big"


def test_a_ranking_orders_what_it_measured_and_explain_shows_the_times(registry, tmp_path):
    key = cache.key_string("logprobs", "cpu", torch.float32, False, 65536)
    _write(tmp_path / "tuning.json", {key: dict(times={"slow": 0.002, "middle": 0.004}, vocab=32000)})
    report = registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=65536))
    assert report.chosen == "slow"
    assert [c.name for c in report.candidates] == ["slow", "middle", "fast-big"]  # measured first, then priority
    text = str(report)
    assert "measured" in text and "2 ms" in text and "4 ms" in text
    # other keys keep the priority order
    assert registry.explain(Key("logprobs", "cpu", torch.float32, True, vocab=65536)).chosen == "fast-big"


def test_a_measurement_beats_a_min_vocab_declaration_and_a_failed_smoke_check_is_passed_over(registry, tmp_path):
    key = cache.key_string("logprobs", "cpu", torch.float32, False, 2048)
    _write(tmp_path / "tuning.json", {key: dict(times={"fast-big": 0.001, "middle": 0.003},
                                               failed={"slow": "logprobs output 0: max error 0.3 exceeds ..."})})
    report = registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=2048))
    assert report.chosen == "fast-big"
    assert report["slow"].why == "failed the tuning smoke check: logprobs output 0: max error 0.3 exceeds ..."


@pytest.mark.parametrize("stale, why", [
    (dict(torch_version="2.5.0"), "it was measured with torch 2.5.0, this is torch 2.6.0"),
    (dict(versions={"middle": "other-plugin 0.9"}), "backend middle was other-plugin 0.9 when measured, now "),
    (dict(machine={"cpu": "another CPU", "cpu_count": 1, "platform": "x", "device": "cpu",
                   "device_names": ["fake CPU"]}), "it was measured on another machine (cpu: 'another CPU'"),
])
def test_a_ranking_from_another_machine_or_version_is_ignored_with_one_warning(registry, tmp_path, stale, why):
    key = cache.key_string("logprobs", "cpu", torch.float32, False, 65536)
    _write(tmp_path / "tuning.json", {key: dict(times={"slow": 0.001})}, **stale)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            registry.reset()
            assert registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=65536)).chosen == "fast-big"
    messages = [str(w.message) for w in record if issubclass(w.category, cache.TuningWarning)]
    assert len(messages) == 1 and why in messages[0], messages
    assert "logprob-registry tune" in messages[0]
    assert "ignored for cpu" in registry.tuning_status()


def test_tuning_off_and_a_broken_file(registry, tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    key = cache.key_string("logprobs", "cpu", torch.float32, False, 65536)
    _write(path, {key: dict(times={"slow": 0.001})})
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
    assert registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=65536)).chosen == "fast-big"
    assert registry.tuning_status().startswith("tuning: off")
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path))
    path.write_text("{not json")
    with pytest.warns(cache.TuningWarning, match="cannot read"):
        assert registry.explain(Key("logprobs", "cpu", torch.float32, False, vocab=65536)).chosen == "fast-big"


def test_tune_measures_writes_and_selection_follows(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ranking.json"
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path))
    assert main(["tune", "--op", "logprobs", "--dtype", "float32", "--grad", "no", "--vocab", "100",
                 "--rows", "4", "--repeat", "1", "--backend", "naive", "--backend", "chunked"]) == 0
    out = capsys.readouterr().out
    assert "logprobs float32 fwd V=100:" in out and f"wrote 1 keys to {path}" in out
    doc = json.loads(path.read_text())
    entry = doc["entries"]["logprobs|cpu|float32|nograd|256"]
    assert set(entry["times"]) == {"naive", "chunked"} and entry["rows"]["naive"].keys() == {"4"}
    fastest = min(entry["times"], key=entry["times"].get)
    try:
        assert lr.select("logprobs", device="cpu", shape=(3, 100)).name == fastest
        assert "measured" in str(lr.explain("logprobs", device="cpu", shape=(3, 100)))
        assert main(["info"]) == 0
        assert f"tuning: {path}, 1 keys measured, in use for cpu" in capsys.readouterr().out
    finally:
        monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
        lr.get_registry().reset()


def test_tune_usage_errors(capsys):
    assert main(["tune", "--op", "nope"]) == 2
    assert "--op takes logprobs" in capsys.readouterr().err
    assert main(["tune", "--backend", "chunkd"]) == 2
    assert "unknown backend 'chunkd'; the registered ones are" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--vocab", "0"])


def _ranking(entries, versions, torch_version="2.6.0", cpu="fake CPU"):
    return cache.Ranking(torch_version, {"cpu": {"cpu": cpu}}, versions,
                         {k: cache.Entry(**v) for k, v in entries.items()})


def test_a_run_merges_backend_by_backend_and_drops_what_it_makes_stale():
    key, other = "logprobs|cpu|float32|nograd|65536", "logprobs|cpu|float32|grad|65536"
    rows = {"16": 1.0, "256": 2.0}
    old = _ranking({key: dict(times={"a": 1.0, "b": 2.0}, rows={"a": rows, "b": rows}, vocab=32000),
                    other: dict(times={"a": 3.0, "b": 4.0}, rows={"a": rows, "b": rows}, vocab=32000)},
                   {"a": "pkg 1", "b": "pkg 1"})
    # tune --backend b: b's time replaced, a's kept (the same row counts), the other key untouched
    new = _ranking({key: dict(times={"b": 0.5}, rows={"b": rows}, vocab=32000)}, {"b": "pkg 1"})
    merged = old.merged(new)
    assert merged.entries[key].times == {"a": 1.0, "b": 0.5} and merged.entries[key].order() == ["b", "a"]
    assert merged.entries[other].times == {"a": 3.0, "b": 4.0}
    # b upgraded: its old times elsewhere go, a's stay
    upgraded = old.merged(_ranking({key: dict(times={"b": 0.5}, rows={"b": rows}, vocab=32000)}, {"b": "pkg 2"}))
    assert upgraded.entries[other].times == {"a": 3.0} and upgraded.versions == {"a": "pkg 1", "b": "pkg 2"}
    # other row counts: the key is the new run's alone
    fewer = old.merged(_ranking({key: dict(times={"b": 0.5}, rows={"b": {"16": 1.0}}, vocab=32000)}, {"b": "pkg 1"}))
    assert fewer.entries[key].times == {"b": 0.5}
    # another machine for the device, or another torch: nothing old survives
    moved = old.merged(_ranking({key: dict(times={"b": 0.5}, rows={"b": rows}, vocab=32000)}, {"b": "pkg 1"},
                                cpu="another CPU"))
    assert set(moved.entries) == {key} and moved.entries[key].times == {"b": 0.5}
    upgraded_torch = old.merged(_ranking({}, {}, torch_version="2.7.0"))
    assert upgraded_torch.entries == {} and upgraded_torch.torch == "2.7.0"


def test_rows_measured_fit_the_cap_and_quick_keeps_the_largest():
    from logprob_registry.tuning.measure import MAX_ELEMENTS, Plan

    plan = Plan(rows=(2048, 16, 256))
    assert plan.rows_for(1000) == [16, 256, 2048]
    assert plan.rows_for(151936) == [16, 256]   # 2048 x 151936 exceeds the cap
    assert plan.rows_for(MAX_ELEMENTS) == [1]   # not even 16 rows fit: as many as fit
    plan.quick = True
    assert plan.rows_for(1000) == [2048] and plan.rows_for(151936) == [256]


@pytest.mark.parametrize("tuned", [False, True])
def test_the_automatic_choice_is_batch_invariant(tmp_path, monkeypatch, tuned):
    """The same row alone and inside batches of 64 and 4096 rows gives the same bits, with and
    without a tuning ranking (selection depends on the vocabulary's bucket, never on the rows)."""
    path = tmp_path / "ranking.json"
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path) if tuned else "off")
    if tuned:  # a ranking that prefers naive for this bucket, the others another order; naive copies the
        # logits, so only speed over memory lets the ranking choose it
        monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "speed")
        key = cache.key_string("logprobs_and_entropy", "cpu", torch.float32, False, 2048)
        env = lr.get_registry().environment()
        versions = lr.get_registry().versions()
        ranking = cache.Ranking(str(env.torch_version), {"cpu": cache.machine("cpu", env.devices["cpu"].names)},
                                {n: versions[n] for n in ("naive", "chunked")},
                                {key: cache.Entry({"naive": 0.001, "chunked": 0.002})})
        ranking.save(str(path))
    lr.get_registry().reset()
    try:
        g = torch.Generator().manual_seed(0)
        big = torch.randn(4096, 1000, generator=g) * 3
        labels = torch.randint(0, 1000, (4096,), generator=g)
        rows = {n: lr.logprobs_and_entropy(big[:n], labels[:n]) for n in (1, 64, 4096)}
        chosen = lr.select("logprobs_and_entropy", device="cpu", shape=big.shape).name
        assert chosen == ("naive" if tuned else lr.select("logprobs_and_entropy", device="cpu").name)
        for n in (64, 4096):
            for alone, inside in zip(rows[1], rows[n]):
                assert torch.equal(alone[0], inside[0]), f"row 0 alone differs from row 0 of {n} ({chosen})"
    finally:
        monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
        lr.get_registry().reset()


def test_the_ranking_source_is_the_registrys_parameter(tmp_path, monkeypatch, make_registry):
    """A registry made without one follows priority whatever file is in force; one given a Tuning
    of a path reads that file even with LOGPROB_REGISTRY_TUNING=off; the process-wide registry reads
    the file in force, which the test suite turns off (tests/conftest.py), in its subprocesses too."""
    assert os.environ["LOGPROB_REGISTRY_TUNING"] == "off"  # inherited by every subprocess a test starts
    path = tmp_path / "tuning.json"
    key = cache.key_string("logprobs", "cpu", torch.float32, False, 65536)
    _write(path, {key: dict(times={"slow": 0.001})})
    wide = Key("logprobs", "cpu", torch.float32, False, vocab=65536)
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path))
    plain = make_registry(("three", Three()), environment=ENV)
    assert plain.ranking is None and plain.explain(wide).chosen == "fast-big"
    assert plain.tuning_status().startswith("tuning: none")
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
    given = make_registry(("three", Three()), environment=ENV, ranking=cache.Tuning(path))
    assert given.explain(wide).chosen == "slow"
    assert isinstance(lr.get_registry().ranking, cache.Tuning)
    assert lr.get_registry().tuning_status().startswith("tuning: off")


# ---------------------------------------------------------------- the fused op: hidden-size buckets

def _fused(hidden, weight, labels, **kw):
    return torch.zeros(labels.shape)


class Fused:
    """Three fused-op backends: one declaring a minimum V x H, two plain."""

    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="fused-big", ops={"logprobs_from_hidden": _fused}, priority=20,
                            min_size={"logprobs_from_hidden": 1 << 23}))
        register(lr.Backend(name="fused-any", ops={"logprobs_from_hidden": _fused}, priority=10))
        register(lr.Backend(name="fused-slow", ops={"logprobs_from_hidden": _fused}, priority=0))


@pytest.fixture
def fused(make_registry, tmp_path, monkeypatch):
    return _tuned(make_registry, tmp_path, monkeypatch, Fused(), "fused")


def test_hidden_buckets_and_the_key_of_the_fused_op():
    from logprob_registry.call import key_for, validate
    from logprob_registry.registry.key import hidden_bucket, hidden_range, key_size

    assert [hidden_bucket(h) for h in (0, 1, 256, 257, 1024, 2048, 4096, 8192, 16385)] == \
        [0, 256, 256, 1024, 1024, 4096, 4096, 16384, -1]
    assert hidden_range(1024) == (257, 1024) and hidden_range(-1) == (16385, None)
    assert key_for("logprobs_from_hidden", device="cpu", vocab=4096, hidden_size=2048).hidden == 4096
    # the other ops' keys never hold a hidden bucket, whatever is passed
    assert key_for("logprobs", device="cpu", vocab=4096, hidden_size=2048) == key_for("logprobs", device="cpu", vocab=4096)
    assert key_size("logprobs", 65536, 0) == 65536 and key_size("logprobs_from_hidden", 16384, 256) == 1 << 22
    assert key_size("logprobs_from_hidden", 16384, 0) is None  # H not known: no size rule
    assert key_size("logprobs_from_hidden", -1, 256) == float("inf")
    # the key a call makes: the V and H buckets, never the rows
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 40, generator=g)
    keys = set()
    for rows in (1, 64):
        call = validate("logprobs_from_hidden", dict(hidden=torch.randn(rows, 40, generator=g), weight=weight,
                                                     labels=torch.zeros(rows, dtype=torch.long)))
        keys.add(call.key)
    assert keys == {key_for("logprobs_from_hidden", device="cpu", vocab=300, hidden_size=40)}
    assert "hidden sizes of 1 to 256" in next(iter(keys)).describe()
    logits_call = validate("logprobs", dict(logits=torch.randn(3, 300), labels=torch.zeros(3, dtype=torch.long)))
    assert logits_call.key.hidden == 0


def test_min_size_passes_a_backend_over_for_small_v_times_h_only(fused):
    from logprob_registry.registry.key import hidden_bucket

    def key(v, h):
        return Key("logprobs_from_hidden", "cpu", torch.float32, False, vocab=vocab_bucket(v),
                   hidden=hidden_bucket(h))

    small = fused.explain(key(4096, 256))  # at most 16384 x 256 = 2^22 per row
    assert small.chosen == "fused-any" and small["fused-big"].status == "skipped"
    assert small["fused-big"].why == (
        "not worth it for vocabularies of 2049 to 16384 and hidden sizes of 1 to 256 (V x H at most 4194304; "
        "declares min_size['logprobs_from_hidden']=8388608); choose it explicitly to use it anyway")
    assert fused.explain(key(4096, 1024)).chosen == "fused-big"      # 16384 x 1024 = 2^24
    assert fused.explain(key(151936, 256)).chosen == "fused-big"
    # H not known (explain without hidden_size): no size rule applies, and the explanation says what
    # a real call (whose size is known) smaller than the declaration runs on
    unknown = fused.explain(Key("logprobs_from_hidden", "cpu", torch.float32, False, vocab=16384))
    assert unknown.chosen == "fused-big"
    assert unknown.notes == ("size rule: fused-big declares min_size['logprobs_from_hidden']=8388608: a call whose "
                             "V x H is smaller runs on fused-any; explain(..., shape=..., hidden_size=...) shows the "
                             "choice for a size",)
    assert unknown.notes[0] in str(unknown) and not fused.explain(key(151936, 256)).notes
    assert fused.select(key(4096, 256), backend="fused-big").name == "fused-big"


def test_min_size_is_checked_when_declared():
    with pytest.raises(ValueError, match="min_size names 'logprobs', which it does not implement"):
        lr.Backend(name="x", ops={"logprobs_from_hidden": _fused}, min_size={"logprobs": 10})
    with pytest.raises(ValueError, match=r"min_size\['logprobs_from_hidden'\] must be an int >= 0"):
        lr.Backend(name="x", ops={"logprobs_from_hidden": _fused}, min_size={"logprobs_from_hidden": -1})
    with pytest.raises(ValueError, match=r"min_size\['token_stats'\] maps the kinds of inputs 'logits' and 'hidden' "
                                         r"to sizes, got 'weight'"):
        lr.Backend(name="x", ops={"token_stats": _fused}, min_size={"token_stats": {"weight": 10}})
    with pytest.raises(ValueError, match=r"min_size\['token_stats'\] must be an int >= 0 .* or a mapping"):
        lr.Backend(name="x", ops={"token_stats": _fused}, min_size={"token_stats": {"hidden": 1.5}})


def test_min_size_by_kind_of_inputs_passes_over_hidden_calls_only(make_registry):
    """token_stats takes logits or hidden states: a size for "hidden" passes the backend over for
    small V x H calls given hidden states, never for its logits calls."""
    from logprob_registry.call import key_for

    class Stats:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="stats-big", ops={"token_stats": _fused}, priority=20,
                                features={"stats_hidden"}, min_size={"token_stats": {"hidden": 1 << 23}}))
            register(lr.Backend(name="stats-any", ops={"token_stats": _fused}, priority=10, features={"stats_hidden"}))

    reg = make_registry(Stats())
    assert reg.get("stats-big").least_size("token_stats") is None  # logits: no rule
    assert reg.explain(key_for("token_stats", device="cpu", vocab=4096)).chosen == "stats-big"
    small = reg.explain(key_for("token_stats", device="cpu", vocab=4096, hidden_size=256))
    assert small.chosen == "stats-any" and small["stats-big"].why == (
        "not worth it for vocabularies of 2049 to 16384 and hidden sizes of 1 to 256 (V x H at most 4194304; "
        "declares min_size['token_stats']={'hidden': 8388608}); choose it explicitly to use it anyway")
    assert reg.explain(key_for("token_stats", device="cpu", vocab=4096, hidden_size=1024)).chosen == "stats-big"
    unknown = reg.explain(key_for("token_stats", device="cpu", vocab=4096, features={"stats_hidden"}))
    assert unknown.chosen == "stats-big" and unknown.notes[0].startswith(
        "size rule: stats-big declares min_size['token_stats']={'hidden': 8388608}: a call whose V x H is smaller "
        "runs on stats-any")


def test_a_ranking_of_the_fused_op_applies_to_its_v_and_h_buckets(fused, tmp_path):
    from logprob_registry.registry.key import hidden_bucket

    name = cache.key_string("logprobs_from_hidden", "cpu", torch.float32, True, 65536, 1024)
    assert name == "logprobs_from_hidden|cpu|float32|grad|65536|h1024"
    _write(tmp_path / "tuning.json", {name: dict(times={"fused-slow": 0.001, "fused-big": 0.003}, vocab=32768,
                                                hidden=1024)})
    measured = Key("logprobs_from_hidden", "cpu", torch.float32, True, vocab=65536, hidden=hidden_bucket(1024))
    report = fused.explain(measured)
    assert report.chosen == "fused-slow" and [c.name for c in report.candidates][:2] == ["fused-slow", "fused-big"]
    assert "measured" in str(report) and "1 ms" in str(report)
    # another hidden bucket of the same vocabulary: not measured, priority decides
    other = fused.explain(measured._replace(hidden=hidden_bucket(2048)))
    assert other.chosen == "fused-big" and "measured" not in str(other)
    # a measurement beats a min_size declaration
    small = cache.key_string("logprobs_from_hidden", "cpu", torch.float32, False, 16384, 256)
    _write(tmp_path / "tuning.json", {small: dict(times={"fused-big": 0.001, "fused-any": 0.002}, vocab=4096,
                                                 hidden=256)})
    fused.reset()
    assert fused.explain(Key("logprobs_from_hidden", "cpu", torch.float32, False, vocab=16384, hidden=256)).chosen \
        == "fused-big"
    assert cache.load(str(tmp_path / "tuning.json")).entries[small].hidden == 256


def test_tune_of_the_fused_op_writes_v_and_h_buckets_and_explain_shows_them(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ranking.json"
    monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", str(path))
    assert main(["tune", "--op", "logprobs_from_hidden", "--dtype", "float32", "--grad", "no", "--vocab", "100",
                 "--hidden", "16,300", "--rows", "4", "--repeat", "1", "--backend", "naive", "--backend",
                 "chunked", "--no-memory"]) == 0  # memory: tests/test_memory_promise.py
    out = capsys.readouterr().out
    assert "logprobs_from_hidden float32 fwd V=100 H=16:" in out and f"wrote 2 keys to {path}" in out
    doc = json.loads(path.read_text())
    assert set(doc["entries"]) == {"logprobs_from_hidden|cpu|float32|nograd|256|h256",
                                   "logprobs_from_hidden|cpu|float32|nograd|256|h1024"}
    entry = doc["entries"]["logprobs_from_hidden|cpu|float32|nograd|256|h256"]
    assert set(entry["times"]) == {"naive", "chunked"} and entry["hidden"] == 16 and entry["vocab"] == 100
    fastest = min(entry["times"], key=entry["times"].get)
    monkeypatch.setenv("LOGPROB_REGISTRY_MEMORY", "speed")  # naive forms the logits: only speed lets it win
    try:
        lr.get_registry().reset()
        assert lr.select("logprobs_from_hidden", device="cpu", shape=(3, 100), hidden_size=16).name == fastest
        text = str(lr.explain("logprobs_from_hidden", device="cpu", shape=(3, 100), hidden_size=16))
        assert "measured" in text and "hidden sizes of 1 to 256" in text
        # without the hidden size the key is another one: nothing measured shows
        assert "measured" not in str(lr.explain("logprobs_from_hidden", device="cpu", shape=(3, 100)))
    finally:
        monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", "off")
        lr.get_registry().reset()


def test_tune_covers_every_op_of_the_table_with_examples():
    from logprob_registry.opspec import OPS
    from logprob_registry.tuning.measure import TUNED_OPS, Plan

    assert {"logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden", "topk_logprobs",
            "kl_divergence"} <= set(TUNED_OPS)
    assert all(OPS[op].examples is not None for op in TUNED_OPS)
    plan = Plan(ops=("logprobs", "logprobs_from_hidden"), dtypes=(torch.float32,), grads=(False,),
                vocabs=(1000,), hiddens=(256, 2048))
    keys = plan.keys()
    assert [(k.op, k.hidden, h) for k, _, h in keys] == [("logprobs", 0, None), ("logprobs_from_hidden", 256, 256),
                                                         ("logprobs_from_hidden", 4096, 2048)]
    # rows of a hidden op fit both caps: V=151936, H=2048 leaves 220 rows
    assert Plan(rows=(16, 256, 2048)).rows_for(151936, 2048) == [16]
    assert Plan(rows=(256,)).rows_for(151936, 2048) == [220]


@pytest.mark.parametrize("op", ["topk_logprobs", "kl_divergence", "entropy"])
def test_the_smoke_check_and_timing_work_from_the_op_table_alone(op):
    from logprob_registry.tuning.measure import smoke, time_call

    assert smoke(op, "naive", 50, torch.float32, "cpu", True) is None
    assert time_call(op, "naive", 3, 50, torch.float32, "cpu", True, repeat=1, warmup=0, seed=0) > 0
