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
