"""The ``npu`` backend without Ascend hardware: detection, eligibility, and the logic around the op.

Three kinds of test, none of which pretends that an NPU computed anything:

- detection: the real :func:`logprob_registry.environment.detect` with a stand-in ``torch_npu``
  package on ``sys.path`` (an empty module: no op, no computation) and a fake ``torch.npu``
  namespace that only answers how many devices there are;
- eligibility: ``Environment.fake(devices={"npu": 8}, torch_npu="2.1.0")`` and friends;
- the gap-covering around ``torch_npu.npu_cross_entropy_loss`` (fp32 results, temperature,
  ignore_index, strides, int32 labels, the 200000-row limit): checked against ``_op_double``, a
  TEST DOUBLE of the op's documented semantics (shapes, dtypes, limits, outputs), computed with
  this package's float64 reference and rounded to the input's dtype as the op's outputs are. It
  shows that the wrapper hands the op only what its documentation allows and turns the op's
  answer into this library's contract; it says nothing about the real op's numerics.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import logprob_registry as lr
from logprob_registry import environment
from logprob_registry import reference as ref
from logprob_registry.environment import Environment, detect
from logprob_registry.kernels import npu
from logprob_registry.registry import Key

STAND_IN = '''"""Stand-in torch_npu for logprob-registry's tests: it computes nothing and has no ops."""
'''


@pytest.fixture
def isolated(monkeypatch):
    """No torch_npu module loaded, no cached import verdicts, no torch.npu; all restored after."""
    saved_module = sys.modules.pop("torch_npu", None)
    monkeypatch.setattr(environment, "_MODULE_PROBLEMS", {})
    monkeypatch.delattr(torch, "npu", raising=False)
    yield monkeypatch
    sys.modules.pop("torch_npu", None)
    if saved_module is not None:
        sys.modules["torch_npu"] = saved_module


def _install_stand_in(monkeypatch, tmp_path, *, version="2.1.0", body=STAND_IN):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(body)
    dist = tmp_path / f"torch_npu-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches


def _fake_torch_npu_namespace(monkeypatch, count):
    """What torch_npu adds to torch: device queries only."""
    names = [f"Ascend910B{i}" for i in range(count)]
    namespace = types.SimpleNamespace(
        is_available=lambda: count > 0, device_count=lambda: count, get_device_name=lambda i: names[i]
    )
    monkeypatch.setattr(torch, "npu", namespace, raising=False)


@pytest.fixture
def verdict(make_registry):
    """``verdict(env, op, device, dtype)``: what a registry of the built-in backends explains in
    ``env`` (a fresh one: no global)."""
    def explain(env, op="logprobs", device="npu", dtype=torch.float32):
        return make_registry(builtins="all", environment=env).explain(Key(op, device, dtype, True))

    return explain


# --------------------------------------------------------------------------------------- detection
def test_detect_without_torch_npu(isolated, verdict):
    real_find_spec = importlib.util.find_spec
    isolated.setattr(importlib.util, "find_spec",
                     lambda name, *a: None if name == "torch_npu" else real_find_spec(name, *a))
    env = detect()
    assert "npu" not in env.devices
    assert env.torch_npu_version is None
    assert env.device_count("npu") == 0
    assert verdict(env)["npu"].reason == "no NPU device"


def test_detect_torch_npu_without_a_device(isolated, tmp_path, verdict):
    _install_stand_in(isolated, tmp_path)
    _fake_torch_npu_namespace(isolated, 0)
    env = detect()
    assert env.devices["npu"].count == 0
    assert str(env.torch_npu_version) == "2.1.0"
    assert env.main_device == "cpu"
    assert verdict(env)["npu"].reason == "no NPU device"


def test_detect_torch_npu_with_devices(isolated, tmp_path, verdict):
    _install_stand_in(isolated, tmp_path)
    _fake_torch_npu_namespace(isolated, 8)
    env = detect()
    info = env.devices["npu"]
    assert info.count == 8 and info.names[0] == "Ascend910B0"
    assert env.main_device == "npu"
    assert str(env.torch_npu_version) == "2.1.0"
    explanation = verdict(env)
    # The stand-in is a real module without the fused op: the availability check says so.
    assert explanation["npu"].reason == "torch_npu 2.1.0 has no npu_cross_entropy_loss; upgrade torch_npu"
    assert explanation.chosen == explanation.eligible[0] != "npu"


def test_detect_torch_npu_that_fails_to_import(isolated, tmp_path, verdict):
    _install_stand_in(isolated, tmp_path, body='raise ImportError("stand-in: libascendcl.so not found")\n')
    _fake_torch_npu_namespace(isolated, 8)
    env = detect()
    assert env.devices["npu"].count == 0  # present but unusable: no NPU for us
    assert verdict(env)["npu"].reason == "no NPU device"


def test_detect_torch_npu_without_torch_npu_namespace(isolated, tmp_path):
    _install_stand_in(isolated, tmp_path)  # imports, but registers no torch.npu
    env = detect()
    assert env.devices["npu"].count == 0


# ------------------------------------------------------------------------------------- eligibility
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chosen_on_npu_when_torch_npu_has_devices(isolated, dtype, verdict):
    explanation = verdict(Environment.fake(devices={"npu": 8}, torch_npu="2.1.0"), dtype=dtype)
    assert explanation["npu"].eligible
    assert explanation.chosen == "npu"


@pytest.mark.parametrize(
    "env_kwargs, op, device, dtype, reason",
    [
        (dict(devices={"npu": 8}), "logprobs", "npu", torch.float32, "torch_npu is not installed"),
        (dict(torch_npu="2.1.0"), "logprobs", "npu", torch.float32, "no NPU device"),
        (dict(devices={"npu": 8}, torch_npu="2.1.0"), "logprobs", "npu", torch.float64,
         "does not accept float64 input (accepts bfloat16, float16, float32)"),
        (dict(devices={"npu": 8}, torch_npu="2.1.0"), "entropy", "npu", torch.float32,
         "does not implement entropy"),
        (dict(devices={"npu": 8}, torch_npu="2.1.0"), "logprobs", "cpu", torch.float32,
         "runs on npu, not cpu"),
    ],
)
def test_not_eligible(isolated, env_kwargs, op, device, dtype, reason, verdict):
    explanation = verdict(Environment.fake(**env_kwargs), op=op, device=device, dtype=dtype)
    assert explanation["npu"].reason == reason
    if "no NPU device" in reason:
        assert explanation.chosen is None
    else:  # the portable backends take over
        assert explanation.chosen == explanation.eligible[0] and "naive" in explanation.eligible


def test_declares_its_memory_and_priority():
    backend = lr.get_registry().get("npu")
    assert backend.priority == 15  # above chunked (10), below compiled (20) and triton (30)
    assert backend.memory.startswith("full-vocab buffer")
    assert not backend.inplace_backward
    assert "torch_npu" in backend.requires


def test_explicit_choice_on_cpu_says_why(isolated):
    with pytest.raises(lr.NoEligibleBackendError, match="runs on npu, not cpu"):
        lr.logprobs_from_logits(torch.randn(2, 4), torch.tensor([0, 1]), backend="npu")


# -------------------------------------------------------- the wrapper, against a double of the op
class _OpDouble:
    """TEST DOUBLE of ``torch_npu.npu_cross_entropy_loss`` (torch_npu docs): input [N, C] float16,
    bfloat16 or float32 with 0 < N <= 200000 and C > 0; target [N] int64 in [0, C); ignore_index
    < C, a negative one meaning none; returns (loss, log_prob, zloss, lse_for_zloss) with loss [N]
    and log_prob [N, C] in the input's dtype. Computed with the float64 reference, rounded to the
    input's dtype. Records what it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, input, target, weight=None, reduction="mean", ignore_index=-100,
                 label_smoothing=0.0, lse_square_scale_for_zloss=0.0, return_zloss=False):
        assert reduction == "none", "the wrapper asks for per-row losses"
        assert weight is None and label_smoothing == 0.0 and not return_zloss
        assert input.dim() == 2 and input.is_contiguous()
        assert input.dtype in (torch.float16, torch.bfloat16, torch.float32)
        n, c = input.shape
        assert 0 < n <= 200_000 and c > 0
        assert target.dtype == torch.int64 and target.shape == (n,)
        assert ignore_index < c
        ignored = target == ignore_index if ignore_index >= 0 else torch.zeros_like(target, dtype=torch.bool)
        assert bool(((target[~ignored] >= 0) & (target[~ignored] < c)).all()), "target outside [0, C)"
        self.calls.append((input.dtype, n, c))
        log_prob = ref.logprobs_and_entropy(input, target.masked_fill(ignored, 0))[0]
        loss = (-log_prob).masked_fill(ignored, 0.0).to(input.dtype)
        full = input.double().log_softmax(-1).to(input.dtype)
        return loss, full, input.new_empty(0), input.new_empty(0)


def _run(logits, labels, temperature=1.0, ignore_index=None):
    double = _OpDouble()
    out = npu.logprobs_with(double, logits, labels, temperature=temperature, ignore_index=ignore_index)
    return out, double


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp32_results_whatever_the_dtype(dtype):
    logits = (torch.randn(3, 5, 300, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, 300, (3, 5))
    out, double = _run(logits, labels)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    assert double.calls == [(torch.float32, 15, 300)]  # the op saw float32, so its loss is float32
    torch.testing.assert_close(out.double(), ref.logprobs(logits, labels), rtol=2e-6, atol=2e-6)


def test_temperature_without_touching_the_logits():
    logits = torch.randn(4, 50)  # contiguous float32: the wrapper's float32 view is the caller's memory
    before = logits.clone()
    labels = torch.randint(0, 50, (4,))
    out, _ = _run(logits, labels, temperature=0.6)
    torch.testing.assert_close(out.double(), ref.logprobs(logits, labels, temperature=0.6), rtol=2e-6, atol=2e-6)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("ignore_index", [-100, 3, 10_000])
def test_ignore_index_never_reaches_the_op(ignore_index):
    logits = torch.randn(2, 6, 40, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    labels[0, :2] = ignore_index
    ignored = labels == ignore_index
    out, double = _run(logits, labels, ignore_index=ignore_index)  # the double asserts every target in [0, C)
    assert torch.all(out[ignored] == 0)
    torch.testing.assert_close(out.detach().double(), ref.logprobs(logits.detach(), labels, ignore_index=ignore_index),
                               rtol=2e-6, atol=2e-6)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert torch.all(grad[ignored] == 0) and torch.all(grad[~ignored].abs().sum(-1) > 0)


def test_strided_input_and_int32_labels():
    base = torch.randn(3, 8, 70, dtype=torch.bfloat16)
    ids = torch.randint(0, 70, (3, 8), dtype=torch.int32)
    logits, labels = base[:, :-1], ids[:, 1:]
    out, double = _run(logits, labels, temperature=1.7)
    assert out.shape == (3, 7) and double.calls[0][1] == 21
    torch.testing.assert_close(out.double(), ref.logprobs(logits, labels, temperature=1.7), rtol=2e-6, atol=2e-6)
    wide = torch.randn(5, 90)[:, :64]  # rows with a stride wider than the vocabulary
    lab = torch.randint(0, 64, (5,))
    torch.testing.assert_close(_run(wide, lab)[0].double(), ref.logprobs(wide, lab), rtol=2e-6, atol=2e-6)


def test_gradients_with_temperature():
    logits = torch.randn(4, 33, dtype=torch.float64)
    labels = torch.randint(0, 33, (4,))
    x = logits.float().requires_grad_(True)
    out, _ = _run(x, labels, temperature=0.7)
    w = torch.randn(4)
    (grad,) = torch.autograd.grad((out * w).sum(), x)
    xr = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad((ref.logprobs(xr, labels, temperature=0.7) * w.double()).sum(), xr)
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)


def test_rows_beyond_the_ops_limit_go_through_in_slices():
    logits = torch.randn(200_003, 3)
    labels = torch.randint(0, 3, (200_003,))
    out, double = _run(logits, labels)
    assert [n for _, n, _ in double.calls] == [200_000, 3]
    torch.testing.assert_close(out.double(), ref.logprobs(logits, labels), rtol=2e-6, atol=2e-6)


def test_empty_input_does_not_call_the_op():
    out, double = _run(torch.randn(0, 7), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,) and out.dtype == torch.float32 and double.calls == []
