"""The conformance suite itself, run with pytester: each deliberately wrong backend fails the tests
that guard against its bug (and only those), and correct backends pass the same tests."""

import re
from pathlib import Path

import pytest

from logprob_registry.testing.sections.distill import CASES as KL_CASES
from logprob_registry.testing.sections.hidden import VARIANTS as HIDDEN_VARIANTS
from logprob_registry.testing.sections.logits import STRIDED

pytest_plugins = ["pytester"]

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "plugins" / "template"

HEADER = '''
import math
import sys

import pytest
import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry import reference as ref
from logprob_registry.testing import BackendConformance

sys.path.insert(0, {template!r})
import logprob_registry_template as template


def good(logits, labels, temperature, ignore_index):
    return ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                        dtype=kit.result_dtype(logits.dtype))


OPS = None  # a case that registers other ops than logprobs sets it
'''

FOOTER = '''

class Plugin:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name={name!r}, ops=OPS or {{"logprobs": logprobs}}, devices={{"cpu"}},
                            batch_invariant=True, {extra}))


@pytest.fixture(scope="module", autouse=True)
def registered():
    registry = lr.get_registry()
    registry.add_plugin(Plugin(), name="test-plugin-" + {name!r})
    yield
    registry.remove_plugin("test-plugin-" + {name!r})


class TestIt(BackendConformance):
    backend = {name!r}
'''

# name: (backend code, Backend keywords, -k selection, tests expected to fail)
BUGS = {
    "bad-sign": (
        '''
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return -good(logits, labels, temperature, ignore_index)
''', "", "test_dtypes or test_shapes",
        {f"test_dtypes[logprobs-{d}]" for d in ("float32", "bfloat16", "float16", "float64")}
        | {f"test_shapes[logprobs-{s}]" for s in ("1d", "2d", "3d", "4d", "vocab-7", "vocab-50257")}),
    "bad-bf16-arithmetic": (
        '''
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    # computes in the logits' own dtype and only then casts the result up
    out = ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=logits.dtype)
    return out.to(kit.result_dtype(logits.dtype))
''', "", "test_dtypes", {"test_dtypes[logprobs-bfloat16]", "test_dtypes[logprobs-float16]"}),
    "bad-copies-strided": (
        '''
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    # the template's blockwise computation, after a .contiguous() that copies strided logits
    return template.logprobs(logits.contiguous(), labels, temperature=temperature,
                             ignore_index=ignore_index, inplace_backward=inplace_backward)
''', "", "test_no_copy or test_forward_keeps or test_strided",
        {"test_no_copy_of_strided_logits[logprobs]", "test_forward_keeps_no_copy_for_backward[logprobs]"}),
    "bad-ignores-temperature": (
        '''
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return good(logits, labels, 1.0, ignore_index)
''', "", "test_temperature or test_dtypes",
        {"test_temperature[logprobs-0.5]", "test_temperature[logprobs-2.0]", "test_temperature[logprobs-0.05]"}),
    "bad-gradient": (
        '''
class LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index):
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index = ignore_index
        return good(logits, labels, temperature, ignore_index)

    @staticmethod
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            out = good(x, labels, 1.0, ctx.ignore_index)  # forgets the temperature
        return torch.autograd.grad(out, x, grad)[0], None, None, None


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return LogProbs.apply(logits, labels, temperature, ignore_index)
''', "", "test_gradients or test_dtypes",
        {f"test_gradients[logprobs-temperature-{d}]" for d in ("float32", "bfloat16", "float16", "float64")}
        | {"test_gradients_of_shapes[logprobs-1d]", "test_gradients_of_shapes[logprobs-vocab-7]"}
        | {f"test_gradients_strided[logprobs-{layout}]" for layout in STRIDED}),
    "bad-mutates-input": (
        '''
def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    with torch.no_grad():
        logits.sub_(logits.amax(-1, keepdim=True))  # "stabilises" the caller's logits in place
    return good(logits, labels, temperature, ignore_index)
''', "", "test_inputs_unmodified or test_dtypes[logprobs-float32]", {"test_inputs_unmodified[logprobs]"}),
    "bad-hidden-low-precision-logits": (
        '''
def hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    # forms the logits in the inputs' own dtype (bf16 or fp16 rounding), then an fp32 softmax
    logits = torch.nn.functional.linear(hidden, weight, bias)
    kw = dict(temperature=temperature, ignore_index=ignore_index, dtype=kit.result_dtype(hidden.dtype))
    return ref.logprobs_and_entropy(logits, labels, **kw) if return_entropy else ref.logprobs(logits, labels, **kw)


OPS = {"logprobs_from_hidden": hidden}
''', "", "test_hidden_values",
        {f"test_hidden_values[{v}-{d}]" for v in HIDDEN_VARIANTS for d in ("bfloat16", "float16")}),
    "bad-hidden-entropy-gradient": (
        '''
def hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy):
    dtype = kit.result_dtype(hidden.dtype)
    logits = ref.hidden_logits(hidden, weight, bias, dtype)
    logprobs = ref.logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, dtype=dtype)
    if not return_entropy:
        return logprobs
    return logprobs, ref.entropy(logits.detach(), temperature=temperature, dtype=dtype)  # no gradient through it


OPS = {"logprobs_from_hidden": hidden}
''', "", "test_hidden_gradients and float32 or test_hidden_gradient_of_one_output",
        {"test_hidden_gradients[entropy-float32]", "test_hidden_gradients[all-options-float32]",
         "test_hidden_gradient_of_one_output[entropy]"}),
    "bad-drops-second-order": (
        '''
class LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index):
        ctx.save_for_backward(logits, labels)
        ctx.options = (temperature, ignore_index)
        return good(logits, labels, temperature, ignore_index)

    @staticmethod
    @torch.autograd.function.once_differentiable  # runs under no_grad: under create_graph=True the
    def backward(ctx, grad):                       # gradient silently loses its second-order term
        logits, labels = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            out = good(x, labels, *ctx.options)
        return torch.autograd.grad(out, x, grad)[0], None, None, None


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return LogProbs.apply(logits, labels, temperature, ignore_index)
''', "", "test_double_backward or test_gradients and float32", {"test_double_backward[logprobs]"}),
    "bad-kl-swapped-direction": (
        '''
def kl(student, teacher, *, direction, temperature, mask, tail, student_weight=None, teacher_weight=None,
       support=None):
    swapped = "reverse" if direction == "forward" else "forward"  # KL(student || teacher) for "forward"
    return ref.kl_divergence(student, teacher, dtype=kit.result_dtype(student.dtype), direction=swapped,
                             temperature=temperature, mask=mask, tail=tail, student_weight=student_weight,
                             teacher_weight=teacher_weight, support=support)


OPS = {"kl_divergence": kl}
''', 'features={"kl_hidden", "kl_support"}', "test_kl_values or test_kl_teacher",
        {f"test_kl_values[{case}-{d}]" for case in KL_CASES for d in ("float32", "bfloat16", "float64")}),
    "bad-kl-tail-as-one-minus-sum": (
        '''
def kl(student, teacher, *, direction, temperature, mask, tail, support=None):
    dtype = kit.result_dtype(student.dtype)
    if support is None or not tail:
        return ref.kl_divergence(student, teacher, dtype=dtype, direction=direction, temperature=temperature,
                                 mask=mask, tail=tail, support=support)

    def buckets(x):
        inside = (x.to(dtype) / temperature).log_softmax(-1).gather(-1, support.long())
        return torch.cat([inside, torch.log(1 - inside.exp().sum(-1, keepdim=True))], -1)  # the tail: log(1 - sum p)

    log_s, log_t = buckets(student), buckets(teacher.detach())
    log_p, log_q = (log_t, log_s) if direction == "forward" else (log_s, log_t)
    out = ref.kl_terms(log_p, log_q).sum(-1)
    return out if mask is None else torch.where(mask, out, torch.zeros_like(out))


OPS = {"kl_divergence": kl}
''', 'features={"kl_support"}', "test_kl_support or test_kl_values[forward-float32]",
        {f"test_kl_support_tail_accuracy[{d}]" for d in ("forward", "reverse")}  # the tail of mass 1e-9
        | {f"test_kl_support[{d}-tail-{t}]" for d in ("forward", "reverse") for t in ("float32", "bfloat16")}),  # K = V
    "bad-jsd-mixture-weights-swapped": (
        '''
def kl(student, teacher, *, direction, temperature, mask, tail, beta=None):
    beta = None if beta is None else 1 - beta  # M = (1 - beta) T + beta S: the same at beta 1/2 only
    return ref.kl_divergence(student, teacher, dtype=kit.result_dtype(student.dtype), direction=direction,
                             temperature=temperature, mask=mask, tail=tail, beta=beta)


OPS = {"kl_divergence": kl}
''', 'features={"kl_jsd"}', "test_kl_jsd or test_kl_values[forward-float32]",
        {f"test_kl_jsd[{b}-{d}]" for b in ("0.25", "0.75") for d in ("float32", "bfloat16")}),
}

# A correct backend a sensible design gives: 64 rows at a time in float32 (three 8 MiB temporaries
# at V = 32768, a fixed 24 MiB: as much as the bf16 logits of the suite's smaller memory shape), a
# backward that recomputes them, and a clear refusal of double backward.
SIXTY_FOUR_ROWS = '''
ROWS = 64


def _blocks(x):
    """(first row, 2-D view of at most ROWS rows) over the rows of x, never a copy"""
    views = [x.unsqueeze(0)] if x.dim() == 1 else [x] if x.dim() == 2 else None
    if views is None:
        try:
            views = [x.view(-1, x.shape[-1])]
        except RuntimeError:  # logits[:, :-1]: one view per sequence
            views = [v for sub in x.unbind(0) for _, v in _blocks(sub)]
    start = 0
    for view in views:
        for r in range(0, view.shape[0], ROWS):
            yield start + r, view[r:r + ROWS]
        start += view.shape[0]


class LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index):
        keep = torch.ones_like(labels, dtype=torch.bool) if ignore_index is None else labels != ignore_index
        index = labels.masked_fill(~keep, 0).long().reshape(-1)
        dtype = kit.result_dtype(logits.dtype)
        lse = torch.empty(index.shape, dtype=dtype, device=logits.device)
        picked = torch.empty(index.shape, dtype=dtype, device=logits.device)
        for start, x in _blocks(logits):
            rows = slice(start, start + x.shape[0])
            y = x.to(dtype) / temperature                  # two 8 MiB temporaries at V = 32768
            lse[rows] = torch.logsumexp(y, -1)              # and a third inside logsumexp
            picked[rows] = y.gather(-1, index[rows, None])[:, 0]
        ctx.save_for_backward(logits, index, keep, lse)
        ctx.temperature = temperature
        return ((picked - lse) * keep.reshape(-1)).reshape(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError("backend 'good-64-rows' does not support double backward (create_graph=True)")
        logits, index, keep, lse = ctx.saved_tensors
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = out.view(-1, out.shape[-1])
        g = (grad * keep).reshape(-1).to(lse.dtype)
        for start, x in _blocks(logits):
            rows = slice(start, start + x.shape[0])
            d = (x.to(lse.dtype) / ctx.temperature - lse[rows, None]).exp_().mul_(-g[rows, None])
            d.scatter_add_(-1, index[rows, None], g[rows, None])
            flat[rows] = d / ctx.temperature
        return out, None, None, None


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward):
    return LogProbs.apply(logits, labels, temperature, ignore_index)
'''

# Correct backends, on the union of the selections above: everything passes.
GOOD = {
    "good-naive-copy": ('''
logprobs = lambda logits, labels, **kw: good(logits, labels, kw["temperature"], kw["ignore_index"])
''', "copies_logits=True"),
    "good-template": ('''
logprobs = template.logprobs
''', ""),
    "good-64-rows": (SIXTY_FOUR_ROWS, ""),
}
ALL_SELECTIONS = " or ".join(f"({sel})" for _, _, sel, _ in BUGS.values())


def _write(pytester, name, code, extra):
    source = HEADER.format(template=str(TEMPLATE_DIR)) + code + FOOTER.format(name=name, extra=extra)
    pytester.makepyfile(**{f"test_{name.replace('-', '_')}": source})


def _outcomes(result):
    """{test id: outcome} from the verbose (-v) report lines."""
    found = {}
    for line in result.outlines:
        match = re.search(r"::(test_\S+) (PASSED|FAILED|SKIPPED|ERROR)", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def _run(pytester, selection):
    return pytester.runpytest("-p", "no:cacheprovider", "-v", "-rs", "-k", selection)


@pytest.mark.parametrize("name", list(BUGS))
def test_a_wrong_backend_fails_the_tests_that_guard_against_its_bug(pytester, name):
    code, extra, selection, expected = BUGS[name]
    _write(pytester, name, code, extra)
    result = _run(pytester, selection)
    outcomes = _outcomes(result)
    failed = {t for t, o in outcomes.items() if o == "FAILED"}
    assert failed == expected, "\n".join(result.outlines[-40:])
    assert any(o == "PASSED" for o in outcomes.values()), "nothing passed: the selection tests nothing else"
    assert result.ret == 1


@pytest.mark.parametrize("name", list(GOOD))
def test_a_correct_backend_passes_the_same_tests(pytester, name):
    code, extra = GOOD[name]
    _write(pytester, name, code, extra)
    result = _run(pytester, ALL_SELECTIONS)
    outcomes = _outcomes(result)
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    assert "FAILED" not in outcomes.values()
    memory = {t: o for t, o in outcomes.items() if t.startswith("test_no_copy")}
    if extra == "copies_logits=True":
        # A backend that declares its copy is skipped there, with that reason, never passed.
        assert set(memory.values()) == {"SKIPPED"}
        assert "declares copies_logits=True" in result.stdout.str()
    else:
        assert memory["test_no_copy_of_strided_logits[logprobs]"] == "PASSED"


def test_the_naive_backend_passes_the_same_tests(pytester):
    pytester.makepyfile(test_naive='''
from logprob_registry.testing import BackendConformance

class TestNaive(BackendConformance):
    backend = "naive"
''')
    result = _run(pytester, ALL_SELECTIONS)
    outcomes = _outcomes(result)
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    assert sum(o == "PASSED" for o in outcomes.values()) >= 40
