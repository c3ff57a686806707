"""The statistics section: ``token_stats``, every statistic of a position in one pass (DESIGN,
round 4), for every backend that implements it.

Each field is compared with the float64 ground truth of the op table (``spec.ground_truth``) for
fp32 and bf16 logits and for hidden states with a bias, plain and with truncation, softcap and
temperature together; the gradients of the differentiable fields (logprobs, entropy, raw_logprobs,
raw_entropy) with float64 autograd, to the logits and to hidden, weight and bias; the fields the op
table marks not differentiable come without a grad_fn; a field that duplicates an existing op is
bitwise that op's result for the same call; ``ignore_index`` positions give 0 (False); ``is_argmax``
is exact away from ties (and the first maximum wins an exact tie). Shapes are small.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import pytest
import torch

import logprob_registry as lr
from logprob_registry.numerics import assert_close, hidden_magnitude, tolerances
from logprob_registry.opspec import OPS

from ..harness import Harness
from ._common import autocast
from ._coverage import covers

OP = "token_stats"
FIELDS = lr.TokenStats._fields
#: The fields with a gradient (DESIGN, round 4).
DIFFERENTIABLE = ("logprobs", "entropy", "raw_logprobs", "raw_entropy")
V = 300          # above chunked's min_vocab, no power of two
LEAD = (3, 5)
H = 24
TEMPERATURE = 0.8
#: Keyword sets: plain; truncation, softcap and temperature together; softcap and temperature alone.
OPTIONS = {
    "plain": ({}, ()),
    "sampler": (dict(top_k=40, top_p=0.9, softcap=12.0, temperature=TEMPERATURE), ("top_k", "top_p", "softcap")),
    "softcap": (dict(softcap=12.0, temperature=TEMPERATURE), ("softcap",)),
}
FORMS = ["float32", "bfloat16", "hidden-bias"]
#: The features of the cases by parameter (the suite's coverage, :func:`covers`' ``by_param``).
SAMPLER_CASES = {name: features for name, (_, features) in OPTIONS.items() if features}
HIDDEN_CASES = {"hidden-bias": ("stats_hidden",)}


def _spec():
    return OPS[OP]


def _logits(lp: Harness, dtype=torch.float32, lead=LEAD, vocab=V, seed=0) -> torch.Tensor:
    return lp.logits(tuple(lead) + (vocab,), dtype, seed=seed)


def _hidden(lp: Harness, dtype=torch.float32, lead=LEAD, vocab=V, seed=0):
    hidden = lp.logits(tuple(lead) + (H,), dtype, scale=2.0, seed=seed)
    weight = lp.logits((vocab, H), dtype, scale=3.0 / math.sqrt(H), seed=seed + 1)
    bias = lp.logits((vocab,), dtype, scale=1.0, seed=seed + 2)
    return hidden, weight, bias


def _labels(lp: Harness, z: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """Random labels, every third on the row's argmax of ``z`` (the logits), so that ``is_argmax``
    and a label kept by any truncation are both checked."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, z.shape[-1], tuple(z.shape[:-1]), generator=g)
    top = z.detach().double().cpu().argmax(-1)
    y.view(-1)[::3] = top.reshape(-1)[::3]
    return y.to(lp.device)


def _case(lp: Harness, form: str, seed: int = 0):
    """``(inputs, labels, options, z64)``: logits or hidden states (with weight and bias in
    ``options``), labels, and the float64 logits they reduce (for the tolerance and the labels)."""
    if form == "hidden-bias":
        h, w, b = _hidden(lp, seed=seed)
        z = h.double().cpu() @ w.double().cpu().T + b.double().cpu()
        return h, _labels(lp, z), dict(weight=w, bias=b), z
    x = _logits(lp, getattr(torch, form), seed=seed)
    return x, _labels(lp, x), {}, x.double().cpu()


def _require(lp: Harness, dtype=torch.float32, grad: bool = False, features: Sequence[str] = (),
             form: str = "logits") -> None:
    if not lp.backend.supports(OP):
        pytest.skip(f"{lp.name} does not implement {OP}")
    hidden = ("stats_hidden",) if form == "hidden-bias" else ()
    lp.require(OP, dtype, grad=grad, features=tuple(features) + hidden, vocab=V)


def _call(lp: Harness, x, labels, **options) -> lr.TokenStats:
    return lr.token_stats(x, labels, backend=lp.name, **options)


def _truth(x, labels, **options) -> Dict[str, torch.Tensor]:
    """The float64 ground truth of every field asked, by name (on the CPU)."""
    def cpu64(t):  # a float64 leaf (autograd through it) is taken as it is
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_floating_point():
            return t.cpu()
        return t if t.requires_grad else t.detach().cpu().double()

    cpu = {k: cpu64(v) for k, v in options.items()}
    x64 = cpu64(x)
    y = None if labels is None else labels.cpu()
    names = _spec().output_names(cpu)
    return dict(zip(names, _spec().ground_truth(x64, y, **cpu)))


def _tolerances(z64: torch.Tensor, options, hidden_bound: Optional[float]) -> Dict[str, float]:
    names = _spec().output_names(options)
    tols = tolerances(OP, z64, options.get("temperature", 1.0), magnitude_bound=hidden_bound, options=options)
    return dict(zip(names, tols))


def _check_fields(got: lr.TokenStats, want: Dict[str, torch.Tensor], tols: Dict[str, float], x, what: str) -> None:
    spec = _spec()
    for name in FIELDS:
        value = getattr(got, name)
        if name not in want:
            assert value is None, f"{what}: {name} was not asked for, yet is not None"
            continue
        out = spec.result(name)
        assert value is not None, f"{what}: {name} was asked for and is None"
        expected = out.dtype_for(x.dtype)
        assert value.dtype == expected, f"{what}: {name} is {value.dtype}, expected {expected}"
        assert value.device.type == x.device.type, f"{what}: {name} is on {value.device}"
        if out.judged_as:
            assert_close(value, want[name], tols[name], f"{what}: {name}")
        else:
            assert torch.equal(value.cpu(), want[name].to(value.dtype)), f"{what}: {name} differs from the reference"


def _finite_sum(outputs, ups, truth) -> torch.Tensor:
    total = 0
    for name, u in ups.items():
        o = outputs[name]
        finite = torch.isfinite(truth[name].detach()).to(o.device)
        total = total + torch.where(finite, o * u.to(o.device, o.dtype), torch.zeros((), dtype=o.dtype,
                                                                                     device=o.device)).sum()
    return total


class StatsSection:
    """Tests of ``token_stats`` (a mixin of :class:`~logprob_registry.testing.BackendConformance`)."""

    @covers(OP, by_param=dict(options=SAMPLER_CASES, form=HIDDEN_CASES))
    @pytest.mark.parametrize("options", list(OPTIONS))
    @pytest.mark.parametrize("form", FORMS)
    def test_stats_values(self, lp: Harness, form: str, options: str) -> None:
        """Every field against float64: fp32 and bf16 logits, hidden states with a bias; plain, and
        with top_k, top_p, softcap and temperature together."""
        kw, features = OPTIONS[options]
        dtype = torch.float32 if form == "hidden-bias" else getattr(torch, form)
        _require(lp, dtype, features=features, form=form)
        x, labels, inputs, z64 = _case(lp, form)
        options_ = dict(inputs, outputs=FIELDS, **kw)
        got = _call(lp, x, labels, **options_)
        want = _truth(x, labels, **options_)
        bound = hidden_magnitude(x, inputs["weight"], inputs["bias"]) if form == "hidden-bias" else None
        _check_fields(got, want, _tolerances(z64, options_, bound), x, f"{OP} {form} {options}")

    @covers(OP, by_param=dict(form=HIDDEN_CASES))
    @pytest.mark.parametrize("form", ["logits", "hidden-bias"])
    def test_stats_subsets(self, lp: Harness, form: str) -> None:
        """Any subset of the fields: those asked are the full call's values, the others None; without
        labels, the label-free fields (with top_k and softcap where the backend declares them)."""
        _require(lp, form=form)
        x, labels, inputs, z64 = _case(lp, "float32" if form == "logits" else form)
        kw = dict(inputs, **{k: v for k, v in dict(top_k=30, softcap=15.0).items() if k in lp.backend.features})
        full = _call(lp, x, labels, outputs=FIELDS, **kw)
        for subset in [("logprobs",), ("entropy", "is_argmax"), ("raw_logprobs", "log_sum_p2"),
                       ("mean_logit", "max_logit", "raw_entropy")]:
            got = _call(lp, x, labels, outputs=subset, **kw)
            for name in FIELDS:
                value = getattr(got, name)
                if name not in subset:
                    assert value is None, f"{OP} outputs={subset}: {name} is not None"
                    continue
                want = getattr(full, name)
                assert_close(value, want.double(), 0.0 if name == "is_argmax" else 1e-6 * (1 + float(
                    want.double().nan_to_num(0, 0, 0).abs().max())), f"{OP} outputs={subset}: {name}")
        label_free = ("entropy", "raw_entropy", "log_sum_p2", "mean_logit", "max_logit")
        got = _call(lp, x, None, outputs=label_free, **kw)
        want = _truth(x, None, outputs=label_free, **kw)
        bound = hidden_magnitude(x, inputs["weight"], inputs["bias"]) if inputs else None
        _check_fields(got, want, _tolerances(z64, dict(outputs=label_free, **kw), bound), x,
                      f"{OP} without labels ({form})")

    @covers(OP, grad=True, by_param=dict(options=SAMPLER_CASES, form=HIDDEN_CASES))
    @pytest.mark.parametrize("options", list(OPTIONS))
    @pytest.mark.parametrize("form", ["logits", "hidden-bias"])
    def test_stats_gradients(self, lp: Harness, form: str, options: str) -> None:
        """Gradients of logprobs, entropy, raw_logprobs and raw_entropy (random upstream weights on
        all four, and on each alone) to the logits, or to hidden, weight and bias, against float64
        autograd of the reference."""
        kw, features = OPTIONS[options]
        _require(lp, grad=True, features=features, form=form)
        x, labels, inputs, z64 = _case(lp, "float32" if form == "logits" else form, seed=5)
        leaves = {"inputs": x, **inputs}
        bound = hidden_magnitude(x, inputs["weight"], inputs["bias"]) if inputs else None
        tol = max(_tolerances(z64, dict(outputs=DIFFERENTIABLE, **kw), bound).values())
        g = torch.Generator().manual_seed(7)
        for used in [DIFFERENTIABLE] + [(n,) for n in DIFFERENTIABLE]:
            mine = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
            ref = {k: v.detach().cpu().double().requires_grad_(True) for k, v in leaves.items()}
            got = _call(lp, mine["inputs"], labels, outputs=used, **{k: mine[k] for k in inputs}, **kw)
            want = _truth(ref["inputs"], labels, outputs=used, **{k: ref[k] for k in inputs}, **kw)
            ups = {n: torch.randn(tuple(want[n].shape), generator=g, dtype=torch.float64) for n in used}
            grads = torch.autograd.grad(_finite_sum(got._asdict(), ups, want), list(mine.values()))
            refs = torch.autograd.grad(_finite_sum(want, ups, want), list(ref.values()))
            for name, a, b in zip(mine, grads, refs):
                assert a.dtype == leaves[name].dtype and tuple(a.shape) == tuple(leaves[name].shape), (
                    f"{OP}: the gradient of {name} is {a.dtype} {tuple(a.shape)}")
                scale = float(b.abs().max()) if b.numel() else 0.0
                assert_close(a, b, 4 * tol * (1.0 + scale),
                             f"{OP} {form} {options}: the gradient of {name} with {', '.join(used)} in the loss")

    @covers(OP, grad=True, by_param=dict(form=HIDDEN_CASES))
    @pytest.mark.parametrize("form", ["logits", "hidden-bias"])
    def test_stats_autocast(self, lp: Harness, form: str) -> None:
        """Under ``torch.autocast`` (bf16, or fp16 on a CUDA device without bf16) the float32 inputs'
        fields and the gradients of the differentiable ones, the backward inside the region, are
        those without autocast: float32 results within the contract of float64."""
        _require(lp, grad=True, form=form)
        x, labels, inputs, z64 = _case(lp, "float32" if form == "logits" else form, seed=9)
        leaves = {"inputs": x, **inputs}
        mine = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
        ref = {k: v.detach().cpu().double().requires_grad_(True) for k, v in leaves.items()}
        kw = dict(temperature=TEMPERATURE)
        want = _truth(ref["inputs"], labels, outputs=FIELDS, **{k: ref[k] for k in inputs}, **kw)
        g = torch.Generator().manual_seed(11)
        ups = {n: torch.randn(tuple(want[n].shape), generator=g, dtype=torch.float64) for n in DIFFERENTIABLE}
        with autocast(lp):
            got = _call(lp, mine["inputs"], labels, outputs=FIELDS, **{k: mine[k] for k in inputs}, **kw)
            grads = torch.autograd.grad(_finite_sum(got._asdict(), ups, want), list(mine.values()))
        bound = hidden_magnitude(x, inputs["weight"], inputs["bias"]) if inputs else None
        tols = _tolerances(z64, dict(outputs=FIELDS, **kw), bound)
        _check_fields(got, {k: v.detach() for k, v in want.items()}, tols, x, f"{OP} {form} under autocast")
        refs = torch.autograd.grad(_finite_sum(want, ups, want), list(ref.values()))
        tol = max(tols[n] for n in DIFFERENTIABLE)
        for name, a, b in zip(mine, grads, refs):
            assert a.dtype == torch.float32, f"{OP} {form}: the gradient of {name} under autocast is {a.dtype}"
            scale = float(b.abs().max()) if b.numel() else 0.0
            assert_close(a, b, 4 * tol * (1.0 + scale), f"{OP} {form}: the gradient of {name} under autocast")

    @covers(OP, grad=True, by_param=dict(form=HIDDEN_CASES))
    @pytest.mark.parametrize("form", ["logits", "hidden-bias"])
    def test_stats_not_differentiable(self, lp: Harness, form: str) -> None:
        """With inputs requiring gradients, the differentiable fields have a grad_fn and those the op
        table marks not differentiable have none (nor requires_grad)."""
        _require(lp, grad=True, form=form)
        x, labels, inputs, _ = _case(lp, "float32" if form == "logits" else form)
        x = x.clone().requires_grad_(True)
        inputs = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        got = _call(lp, x, labels, outputs=FIELDS, **inputs)
        spec = _spec()
        for name in FIELDS:
            value = getattr(got, name)
            if not spec.result(name).differentiable:
                assert value.grad_fn is None and not value.requires_grad, (
                    f"{OP}: {name} is not differentiable, yet has a grad_fn ({form})")
            elif name in DIFFERENTIABLE:
                assert value.requires_grad, f"{OP}: {name} is differentiable, yet has no grad_fn ({form})"
        with torch.no_grad():
            quiet = _call(lp, x, labels, outputs=FIELDS, **inputs)
        assert all(getattr(quiet, n).grad_fn is None for n in FIELDS), f"{OP} under no_grad returned a grad_fn"

    @covers(OP, by_param=dict(options=SAMPLER_CASES, form=HIDDEN_CASES))
    @pytest.mark.parametrize("options", list(OPTIONS))
    @pytest.mark.parametrize("form", ["float32", "bfloat16", "hidden-bias"])
    def test_stats_bitwise_existing_ops(self, lp: Harness, form: str, options: str) -> None:
        """Where a field duplicates an op the backend also implements, it is that op's result for
        the same call, bitwise: logprobs as logprobs_from_logits (logprobs_from_hidden), entropy as
        logprobs_and_entropy (logprobs_from_hidden with return_entropy=True)."""
        kw, features = OPTIONS[options]
        dtype = torch.float32 if form == "hidden-bias" else getattr(torch, form)
        _require(lp, dtype, features=features, form=form)
        x, labels, inputs, _ = _case(lp, form)
        labels = labels.clone()
        labels.view(-1)[1] = 7
        kw = dict(kw, ignore_index=7)
        got = _call(lp, x, labels, outputs=FIELDS, **inputs, **kw)
        alone = _call(lp, x, labels, outputs=("logprobs",), **inputs, **kw)
        if inputs:
            if not lp.backend.supports("logprobs_from_hidden"):
                pytest.skip(f"{lp.name} does not implement logprobs_from_hidden")
            lp_op = lr.logprobs_from_hidden(x, inputs["weight"], labels, bias=inputs["bias"], backend=lp.name, **kw)
            _, ent_op = lr.logprobs_from_hidden(x, inputs["weight"], labels, bias=inputs["bias"], return_entropy=True,
                                                backend=lp.name, **kw)
            names = "logprobs_from_hidden"
        else:
            if not (lp.backend.supports("logprobs") and lp.backend.supports("logprobs_and_entropy")):
                pytest.skip(f"{lp.name} does not implement logprobs and logprobs_and_entropy")
            lp_op = lr.logprobs_from_logits(x, labels, backend=lp.name, **kw)
            _, ent_op = lr.logprobs_and_entropy(x, labels, backend=lp.name, **kw)
            names = "logprobs_from_logits / logprobs_and_entropy"
        for what, a, b in [("logprobs (all fields)", got.logprobs, lp_op), ("logprobs (alone)", alone.logprobs, lp_op),
                           ("entropy", got.entropy, ent_op)]:
            assert torch.equal(a, b), (f"{OP}'s {what} ({form} {options}) is not bitwise {names}'s for the same "
                                       f"call: max difference {float((a.double() - b.double()).abs().max()):.3g}")

    @covers(OP, grad=True)
    @pytest.mark.parametrize("ignore_index", [7, -100])
    def test_stats_ignore_index(self, lp: Harness, ignore_index: int) -> None:
        """At ignore_index positions logprobs and raw_logprobs are 0 (with a zero gradient) and
        is_argmax False; the label-free fields are computed there as anywhere."""
        _require(lp, grad=lp.backend.autograd)
        x, labels, _, z64 = _case(lp, "float32")
        labels = labels.clone()
        labels.view(-1)[::4] = ignore_index
        labels.view(-1)[0] = ignore_index
        ignored = (labels == ignore_index).cpu()
        leaf = x.clone().requires_grad_(lp.backend.autograd)
        got = _call(lp, leaf, labels, outputs=FIELDS, ignore_index=ignore_index)
        want = _truth(x, labels, outputs=FIELDS, ignore_index=ignore_index)
        _check_fields(got, want, _tolerances(z64, dict(outputs=FIELDS), None), x, f"{OP} ignore_index={ignore_index}")
        for name in ("logprobs", "raw_logprobs"):
            assert bool((getattr(got, name).detach().cpu()[ignored] == 0).all()), f"{OP}: {name} is not 0 where ignored"
        assert not bool(got.is_argmax.cpu()[ignored].any()), f"{OP}: is_argmax is True at an ignored position"
        plain = _call(lp, x, None, outputs=("entropy", "log_sum_p2", "mean_logit", "max_logit"))
        for name in ("entropy", "log_sum_p2", "mean_logit", "max_logit"):
            assert torch.equal(getattr(got, name).detach(), getattr(plain, name)), (
                f"{OP}: {name} changes with ignore_index (it needs no label)")
        if lp.backend.autograd:
            (grad,) = torch.autograd.grad((got.logprobs + got.raw_logprobs).sum(), leaf)
            assert bool((grad.cpu()[ignored] == 0).all()), f"{OP}: an ignored position got a gradient"

    @covers(OP, by_param=dict(form=HIDDEN_CASES))
    @pytest.mark.parametrize("form", ["logits", "hidden-bias"])
    def test_stats_is_argmax(self, lp: Harness, form: str) -> None:
        """is_argmax exactly: a label on the row's maximum is True, on the runner-up False (values
        apart by far more than rounding); in an exact tie the first maximum wins; under top_k (for a
        backend declaring it) the argmax is that of the kept tokens."""
        _require(lp, form=form)
        x, _, inputs, z64 = _case(lp, "float32" if form == "logits" else form, seed=9)
        order = z64.argsort(-1, descending=True)
        top, second = order[..., 0], order[..., 1]
        gap = z64.gather(-1, order[..., :1]).squeeze(-1) - z64.gather(-1, order[..., 1:2]).squeeze(-1)
        apart = (gap > 1e-3).to(lp.device)
        labels = torch.where(torch.arange(top.numel()).view(top.shape) % 2 == 0, top, second).to(lp.device)
        for kw in ({}, {"top_k": 5}) if "top_k" in lp.backend.features else ({},):
            got = _call(lp, x, labels, outputs=("is_argmax",), **inputs, **kw).is_argmax
            want = (labels.cpu() == top).to(lp.device)
            assert torch.equal(got[apart], want[apart]), f"{OP}: is_argmax wrong away from ties ({form}, {kw})"
        if form == "logits":  # an exact tie: the first maximum wins
            tied = x.clone()
            row = tied.view(-1, V)
            row[:, 10] = row.amax(-1) + 1.0
            row[:, 200] = row[:, 10]
            first = torch.full(tuple(x.shape[:-1]), 10, device=lp.device)
            last = torch.full(tuple(x.shape[:-1]), 200, device=lp.device)
            assert bool(_call(lp, tied, first, outputs=("is_argmax",)).is_argmax.all()), (
                f"{OP}: in a tie, the first maximum is not the argmax")
            assert not bool(_call(lp, tied, last, outputs=("is_argmax",)).is_argmax.any()), (
                f"{OP}: in a tie, a later maximum counts as the argmax")


__all__ = ["StatsSection"]
