"""The validated call (logprob_registry.call) and the sampler value (logprob_registry.sampler): one
validation for every path, the only place a selection key is made, and one list of the sampler's
keywords that the op table and the checks read."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import logprob_registry as lr
from logprob_registry import sampler
from logprob_registry.call import key_for, validate
from logprob_registry.opspec import OPS, TRUNCATION
from logprob_registry.registry.key import vocab_bucket

PACKAGE = pathlib.Path(lr.__file__).parent


def _logits(*shape, grad=False):
    return torch.randn(*shape, requires_grad=grad)


def test_a_call_holds_what_its_backend_receives_and_its_key():
    x, y = _logits(2, 3, 300, grad=True), torch.randint(0, 300, (2, 3))
    call = validate("logprobs", dict(logits=x, labels=y, temperature=0.5, top_k=0, top_p=0.9))
    assert call.inputs[0] is x and call.inputs[1] is y
    assert call.options["temperature"] == 0.5 and call.options["top_k"] is None  # 0: keeps everything
    assert call.sampler.top_p == 0.9 and call.sampler.truncates and call.sampler.used
    assert call.features == frozenset({"top_p"})
    assert call.key == key_for("logprobs", device="cpu", dtype=torch.float32, requires_grad=True,
                               features={"top_p"}, vocab=300)
    assert call.key.vocab == vocab_bucket(300) == 2048
    with torch.no_grad():
        assert not validate("logprobs", dict(logits=x, labels=y)).grad


def test_candidates_functorch_and_the_fused_ops_features():
    x = _logits(4, 50)
    assert validate("logprobs", dict(logits=x, labels=torch.randint(0, 50, (4, 3)))).features == {"candidates"}
    h, w = torch.randn(4, 8), torch.randn(50, 8, requires_grad=True)
    call = validate("logprobs_from_hidden", dict(hidden=h, weight=w, labels=torch.randint(0, 50, (4,)),
                                                 logits_dtype=torch.bfloat16, softcap=30.0))
    assert call.features == {"logits_dtype", "softcap"} and call.needs_grad == (False, True, False)
    assert call.key.vocab == vocab_bucket(50) and call.key.dtype == torch.float32


def test_a_shard_defers_the_label_range_and_top_k_to_the_whole_vocabulary():
    x, y = _logits(2, 8), torch.tensor([3, 100])  # 100: beyond this shard, maybe not beyond the vocabulary
    with pytest.raises(ValueError, match="label 100 at position"):
        validate("logprobs", dict(logits=x, labels=y))
    call = validate("logprobs", dict(logits=x, labels=y, top_k=20, process_group=object(), vocab_start=8))
    assert call.sharded and call.vocab_start == 8 and call.sampler.top_k == 20  # not "keeps all 8 columns"
    assert validate("logprobs", dict(logits=x, labels=torch.tensor([3, 4]), top_k=20)).sampler.top_k is None
    with pytest.raises(ValueError, match="vocab_start=8 was given without process_group"):
        validate("logprobs", dict(logits=x, labels=y, vocab_start=8))


def test_the_sampler_fields_are_one_list():
    """Sampler's dataclass fields, the op table's sampler options (each the feature of its name) and
    the truncation set all follow sampler.FIELDS, in its order."""
    assert tuple(f.name for f in dataclasses.fields(sampler.Sampler)) == sampler.NAMES
    for op in ("logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden", "topk_logprobs"):
        options = [o for o in OPS[op].options if o.name in sampler.NAMES]
        assert tuple(o.name for o in options) == sampler.NAMES
        assert all(o.feature == o.name and o.default is None for o in options)
    assert TRUNCATION == sampler.TRUNCATION == {"top_k", "top_p", "min_p", "keep"}
    assert not sampler.OFF.used and sampler.OFF.features() == frozenset()
    keep = torch.ones(2, 5, dtype=torch.bool)
    s = sampler.Sampler.of(dict(softcap=2.0, keep=keep, temperature=0.3))
    assert s.softcap == 2.0 and s.keep is keep and s.features() == {"softcap", "keep"}
    assert sampler.Sampler(softcap=2.0).used and not sampler.Sampler(softcap=2.0).truncates


def test_keys_are_made_in_one_module():
    """Only call.py makes a Key (registry/key.py defines it): what goes into one cannot drift."""
    makers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if re.search(r"(?<![\w.])Key\(", p.read_text()))
    assert makers == ["call.py", "registry/key.py"], makers


def test_nothing_outside_the_kernels_imports_them():
    """The core, the suite and the commands reach a backend only through the registry (and the kit)."""
    pattern = re.compile(r"^\s*(from|import) \S*kernels", re.M)
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "kernels" not in p.relative_to(PACKAGE).parts and pattern.search(p.read_text())]
    scripts = PACKAGE.parent / "scripts"
    offenders += [p.name for p in scripts.glob("*") if p.is_file() and "logprob_registry.kernels" in p.read_text()]
    assert offenders == []


PLAIN = [
    ("logprobs", dict(logits=_logits(8, 128), labels=torch.randint(0, 128, (8,)))),
    ("logprobs", dict(logits=_logits(2, 3, 50, grad=True), labels=torch.randint(0, 50, (2, 3), dtype=torch.int32),
                      temperature=0.7, ignore_index=-100, inplace_backward=True, sampler="vllm", backend="naive")),
    ("logprobs", dict(logits=_logits(5, 300).double()[:, :-1], labels=torch.tensor([0, -100, 7, -100, 298]),
                      ignore_index=-100)),  # out-of-range values that are all the ignored one
    ("logprobs", dict(logits=_logits(7), labels=torch.tensor(3))),
    ("logprobs", dict(logits=_logits(0, 9), labels=torch.zeros(0, dtype=torch.long))),
    ("logprobs", dict(logits=_logits(9, 10), labels=torch.randint(0, 10, (9, 10)).t()[0])),  # strided labels
    ("logprobs", dict(logits=_logits(100, 16), labels=torch.randint(0, 16, (100,)))),  # above SMALL_LABELS
    ("logprobs_and_entropy", dict(logits=_logits(4, 20, grad=True).bfloat16(), labels=torch.randint(0, 20, (4,)))),
    ("entropy", dict(logits=_logits(3, 4, 11), temperature=2.0)),
]


@pytest.mark.parametrize("op,given", PLAIN, ids=[f"{op}-{i}" for i, (op, _) in enumerate(PLAIN)])
def test_a_plain_call_is_the_call_the_full_validation_makes(monkeypatch, op, given):
    """The plain path (no sampler keyword, logit_scale or group: call._plain) makes exactly the
    Call of the full validation, field by field, with and without gradients."""
    from logprob_registry import call as call_module

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            fast = validate(op, given)
            assert call_module._plain(call_module.OPS[op], given) is not None
            with monkeypatch.context() as m:
                m.setattr(call_module, "_plain", lambda spec, given: None)
                full = validate(op, given)
        assert type(fast) is type(full) and fast._fields == full._fields
        for name, a, b in zip(full._fields, fast, full):
            if name == "inputs":
                assert all(x is y for x, y in zip(a, b)) and len(a) == len(b)
            else:
                assert a == b and type(a) is type(b), (name, a, b)
        assert list(fast.options) == list(full.options) and fast.sampler is full.sampler


def test_a_backend_receiving_every_option_gets_the_calls_own_options():
    """backend_options: a validated call's options as they are for a backend declaring every
    feature (no copy on the hot path), those it declares for another, defaults for what is missing."""
    spec = OPS["logprobs"]
    call = validate("logprobs", dict(logits=_logits(3, 40), labels=torch.randint(0, 40, (3,)), temperature=0.5))
    every = frozenset(o.feature for o in spec.options if o.feature is not None)
    assert spec.backend_options(every, call.options) is call.options
    plain = spec.backend_options(frozenset(), call.options)
    assert plain == {o.name: call.options[o.name] for o in spec.options if o.feature is None}
    assert spec.backend_options(every, {"temperature": 0.5}) == {o.name: 0.5 if o.name == "temperature" else o.default
                                                                  for o in spec.options}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_naives_plain_call_is_the_reference_bitwise(monkeypatch, dtype):
    """naive's branch for a plain call (the reference's three torch ops, without its layers: issue
    #36) gives the reference's values and gradients bitwise, and is taken (the reference is not asked)."""
    from logprob_registry import kit, reference
    from logprob_registry.kernels import naive

    logits, labels = _logits(4, 5, 33, grad=True).to(dtype), torch.randint(0, 33, (4, 5))
    slow = reference.logprobs(logits, labels, dtype=dtype)
    (slow_grad,) = torch.autograd.grad(slow.sum(), logits)
    monkeypatch.setattr(kit, "reference_function", lambda op: pytest.fail("naive's plain call asked the reference"))
    fast = naive.logprobs(logits, labels, temperature=1.0, ignore_index=None, inplace_backward=False)
    (fast_grad,) = torch.autograd.grad(fast.sum(), logits)
    assert fast.dtype == dtype and torch.equal(fast, slow) and torch.equal(fast_grad, slow_grad)


@pytest.mark.parametrize("change", [
    dict(temperature=1), dict(temperature=torch.tensor(0.5)), dict(ignore_index=torch.tensor(-100)), dict(top_k=0),
    dict(softcap=30.0), dict(logit_scale=2.0), dict(sampler="hf"), dict(labels=torch.randint(0, 128, (8, 2))),
    dict(logits=torch.nn.Parameter(torch.randn(8, 128))),
])
def test_other_calls_take_the_full_validation(change):
    from logprob_registry import call as call_module

    given = dict(PLAIN[0][1], **change)
    assert call_module._plain(call_module.OPS["logprobs"], given) is None
    validate("logprobs", given)  # each is a valid call


@pytest.mark.parametrize("change,error", [
    (dict(labels=torch.tensor([0, 1, 2, 3, 4, 5, 6, 128])), "label 128 at position \\(7,\\) is out of range"),
    (dict(labels=torch.tensor([0, 1, 2, 3, -100, 5, 6, -1]), ignore_index=-100), "label -1 at position \\(7,\\)"),
    (dict(temperature=0.0), "temperature must be finite and > 0"), (dict(temperature=float("nan")), "finite"),
    (dict(ignore_index=2**63), "does not fit in int64"), (dict(inplace_backward=1), "True or False"),
    (dict(ignore_index=True), "got a bool"),
    (dict(labels=torch.zeros(8)), "labels must be int64 or int32"), (dict(labels=torch.zeros(7, dtype=torch.long)),
                                                                   "labels shape \\(7,\\) does not match"),
    (dict(logits=torch.zeros(8, 128, dtype=torch.long)), "floating-point"), (dict(vocab_start=3), "without process_group"),
])
def test_a_plain_looking_call_with_a_bad_argument_gets_the_full_validations_error(change, error):
    with pytest.raises((ValueError, TypeError), match=error):
        validate("logprobs", dict(PLAIN[0][1], **change))


def test_a_hidden_size_in_key_for_means_hidden_states_where_an_op_takes_either():
    """key_for(hidden_size=H) is the key a call given hidden states of width H makes: token_stats
    needs stats_hidden, kl_divergence kl_hidden; the logits ops' keys hold no hidden size."""
    h, w = torch.randn(4, 8), torch.randn(50, 8)
    logits = torch.randn(4, 50)
    stats = validate("token_stats", dict(inputs=h, labels=torch.randint(0, 50, (4,)), weight=w))
    assert stats.key == key_for("token_stats", device="cpu", vocab=50, hidden_size=8)
    kl = validate("kl_divergence", dict(student=h, teacher=logits, student_weight=w))
    assert kl.key == key_for("kl_divergence", device="cpu", vocab=50, hidden_size=8)
    assert "kl_hidden" in kl.key.features and "stats_hidden" in stats.key.features
    assert key_for("logprobs", device="cpu", hidden_size=8) == key_for("logprobs", device="cpu")
