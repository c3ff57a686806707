"""Every bad input in the contract gets a clear error before any backend runs."""

import math

import pytest
import torch

import logprob_registry as lr

ran = []


class Spy:
    @lr.hookimpl
    def register_backends(self, register):
        def op(*args, **kwargs):
            ran.append(True)
            raise AssertionError("validation should have stopped this call")
        register(lr.Backend(name="test-spy", ops={k: op for k in (
            "logprobs", "entropy", "logprobs_and_entropy", "logprobs_from_hidden")}, priority=999))


@pytest.fixture(autouse=True)
def spy():
    ran.clear()
    reg = lr.get_registry()
    reg.add_plugin(Spy(), name="test-spy-plugin")
    yield
    reg.remove_plugin("test-spy-plugin")
    assert ran == [], "a backend ran on bad input"


logits = torch.randn(2, 3, 5)
labels = torch.randint(0, 5, (2, 3))


@pytest.mark.parametrize("fn", [lr.logprobs_from_logits, lr.logprobs_and_entropy])
def test_label_out_of_range_names_value_and_position(fn):
    bad = labels.clone()
    bad[1, 2] = 7
    with pytest.raises(ValueError, match=r"label 7 at position \(1, 2\) is out of range for a vocabulary of 5 \(valid labels: 0..4"):
        fn(logits, bad)
    bad[0, 1] = -3
    with pytest.raises(ValueError, match=r"label -3 at position \(0, 1\)"):
        fn(logits, bad)


def test_ignore_index_may_be_out_of_range_but_nothing_else():
    bad = labels.clone()
    bad[0, 0] = -100
    bad[1, 1] = 5
    with pytest.raises(ValueError, match=r"label 5 at position \(1, 1\).*or ignore_index=-100"):
        lr.logprobs_from_logits(logits, bad, ignore_index=-100)


def test_label_of_a_one_dimensional_row():
    with pytest.raises(ValueError, match=r"label 9 at position \(\) is out of range"):
        lr.logprobs_from_logits(torch.randn(5), torch.tensor(9))


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"labels shape \(3, 2\) does not match logits shape \(2, 3, 5\)"):
        lr.logprobs_from_logits(logits, labels.T.contiguous())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_logits(dtype):
    with pytest.raises(TypeError, match=r"logits must be a floating-point tensor .* got torch\.\w+; convert with logits.float\(\)"):
        lr.logprobs_from_logits(torch.zeros(2, 5, dtype=dtype), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        lr.entropy_from_logits(torch.zeros(2, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int16])
def test_label_dtype(dtype):
    with pytest.raises(TypeError, match="labels must be int64 or int32"):
        lr.logprobs_from_logits(logits, labels.to(dtype))


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan])
def test_temperature_must_be_finite_and_positive(temperature):
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0"):
        lr.logprobs_from_logits(logits, labels, temperature=temperature)
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0"):
        lr.entropy_from_logits(logits, temperature=temperature)


@pytest.mark.parametrize("temperature", ["1", None, True])
def test_temperature_must_be_a_number(temperature):
    with pytest.raises(TypeError, match="temperature must be a positive number"):
        lr.logprobs_from_logits(logits, labels, temperature=temperature)


def test_device_mismatch():
    meta_labels = labels.to("meta")
    with pytest.raises(ValueError, match=r"logits are on cpu but labels on meta; move them with labels.to\(logits.device\)"):
        lr.logprobs_from_logits(logits, meta_labels)


def test_other_arguments():
    with pytest.raises(TypeError, match="ignore_index must be an int or None"):
        lr.logprobs_from_logits(logits, labels, ignore_index=1.5)
    with pytest.raises(TypeError, match="inplace_backward must be True or False"):
        lr.logprobs_from_logits(logits, labels, inplace_backward="yes")
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        lr.logprobs_from_logits([[1.0]], labels)
    with pytest.raises(ValueError, match="logits must have a vocabulary dimension"):
        lr.logprobs_from_logits(torch.tensor(1.0), torch.tensor(0))


def test_hidden_inputs():
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"weight shape \(5, 3\) does not fit hidden shape \(2, 3, 4\)"):
        lr.logprobs_from_hidden(hidden, weight[:, :3], labels)
    with pytest.raises(TypeError, match=r"hidden is torch.bfloat16 but weight is torch.float32; give them one dtype"):
        lr.logprobs_from_hidden(hidden.bfloat16(), weight, labels)
    with pytest.raises(ValueError, match=r"bias shape \(4,\) does not match weight shape \(5, 4\)"):
        lr.logprobs_from_hidden(hidden, weight, labels, bias=torch.randn(4))
    with pytest.raises(ValueError, match=r"labels shape \(2,\) does not match hidden shape \(2, 3, 4\)"):
        lr.logprobs_from_hidden(hidden, weight, labels[:, 0])
    with pytest.raises(ValueError, match=r"label 5 at position \(0, 0\) is out of range for a vocabulary of 5"):
        lr.logprobs_from_hidden(hidden, weight, torch.full((2, 3), 5))
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        lr.logprobs_from_hidden(hidden, weight.long(), labels)


def test_good_input_reaches_the_backend():
    with pytest.raises(AssertionError, match="validation should have stopped"):
        lr.logprobs_from_logits(logits, labels, backend="test-spy")
    ran.clear()


def test_select_and_explain_arguments():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype such as torch.bfloat16, got 'float32'"):
        lr.select(dtype="float32")
    with pytest.raises(ValueError, match="unknown op 'logprob'; ops: logprobs, entropy"):
        lr.explain("logprob")
    with pytest.raises(ValueError, match="device must be a device type such as 'cpu'"):
        lr.explain(device="GPU zero")
    # device types this machine lacks, even ones torch cannot parse without their extension
    assert lr.explain(device="npu:3").key.device == "npu"
    assert lr.explain(device="hpu").chosen is None
    assert lr.explain(device=torch.device("cpu")).key.device == "cpu"


@pytest.mark.parametrize("call", ["logprobs", "entropy", "both"])
def test_an_empty_vocabulary_is_refused_before_dispatch(call):
    """V = 0 used to reach every backend in turn, each raising, each marked broken: from then on
    every valid call of the process raised NoEligibleBackendError."""
    logits, labels = torch.randn(3, 0), torch.full((3,), -100)
    with pytest.raises(ValueError, match=r"logits of shape \([03], 0\) have an empty vocabulary \(V = 0\)"):
        if call == "logprobs":
            lr.logprobs_from_logits(logits, labels, ignore_index=-100)
        elif call == "entropy":
            lr.entropy_from_logits(logits)
        else:
            lr.logprobs_and_entropy(torch.randn(0, 0), torch.zeros(0, dtype=torch.long))
    assert lr.get_registry().broken() == {}


def test_hidden_size_or_vocabulary_of_zero_is_refused_before_dispatch():
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden size is 0 \(hidden \(4, 0\), weight \(9, 0\)\)"):
        lr.logprobs_from_hidden(torch.randn(4, 0), torch.randn(9, 0), labels)
    with pytest.raises(ValueError, match=r"weight of shape \(0, 8\) has an empty vocabulary"):
        lr.logprobs_from_hidden(torch.randn(4, 8), torch.randn(0, 8), labels - 100, ignore_index=-100)
    assert lr.get_registry().broken() == {}


def test_meta_tensors_and_huge_ignore_index_get_sentences():
    with pytest.raises(ValueError, match="logits is on the meta device, which holds no values"):
        lr.logprobs_from_logits(torch.empty(2, 5, device="meta"), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ignore_index=1180591620717411303424 does not fit in int64"):
        lr.logprobs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), ignore_index=2**70)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(softcap=0.0), ValueError, r"softcap must be finite and > 0 \(or None for no softcap\), got 0.0"),
    (dict(softcap="30"), TypeError, "softcap must be a positive number or None, got str"),
    (dict(top_k=-2), ValueError, r"top_k must be >= 1, or 0 or -1 \(disabled, as in vLLM\), got -2"),
    (dict(top_k=2.5), TypeError, "top_k must be an int or None, got float"),
    # per-row values: a tensor broadcastable to the positions (2, 3), of the right dtype, in range per row
    (dict(top_k=torch.tensor([1, 2])), ValueError,
     r"top_k has shape \(2,\), which does not broadcast to the positions' shape \(2, 3\).*such as \(2, 1\)"),
    (dict(top_k=torch.ones(2, 3)), TypeError, r"top_k is a tensor of dtype torch.float32; a per-row top_k must be an "
                                              r"int32/int64 tensor"),
    (dict(top_p=torch.ones(2, 3, dtype=torch.long)), TypeError, "a per-row top_p must be a floating-point tensor"),
    (dict(top_k=torch.tensor([[1, 2, -3], [0, 0, 0]])), ValueError,
     r"top_k = -3 at position \(0, 2\) \(of the positions' shape \(2, 3\)\) is out of range: top_k must be >= 1, "
     r"or 0 or -1 \(off for that row\)"),
    (dict(top_p=torch.tensor([[0.5], [0.0]])), ValueError,
     r"top_p = 0.0 at position \(1, 0\) .* is out of range: top_p must be in \(0, 1\]"),
    (dict(min_p=torch.full((3,), 1.5)), ValueError, r"min_p = 1.5 at position \(0, 0\)"),
    (dict(temperature=torch.tensor([[1.0], [-1.0]])), ValueError,
     r"temperature = -1.0 at position \(1, 0\) .* is out of range: every temperature must be finite and > 0"),
    (dict(temperature=torch.ones(2, 3, dtype=torch.long)), TypeError, "a per-row temperature must be a floating"),
    (dict(top_k=torch.ones(2, 3, dtype=torch.long, device="meta")), ValueError, r"logits are on cpu but top_k on meta"),
    (dict(top_k=2, sampler="sglang2"), ValueError, r"sampler must be one of 'vllm', 'hf', 'sglang'"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\] \(1 keeps every token\), got 0.0"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\] \(0 keeps every token\), got -0.1"),
    (dict(keep=torch.ones(2, 3, 4, dtype=torch.bool)), ValueError,
     r"keep is a bool mask of shape \(2, 3, 4\), but the logits have shape \(2, 3, 5\)"),
    (dict(keep=torch.zeros(2, 3, 2)), TypeError, "keep must be a bool mask or int64/int32 ids, got torch.float32"),
    (dict(keep=torch.tensor([[[0, 7]] * 3] * 2)), ValueError,
     r"keep id 7 at position \(0, 0, 1\) is out of range for a vocabulary of 5 \(ids are 0..4, or -1 for none\)"),
    (dict(keep=torch.zeros(2, 2, dtype=torch.long)), ValueError, r"ids must have shape \(2, 3, 'K'\)"),
])
def test_sampler_keywords(kwargs, error, message):
    with pytest.raises(error, match=message):
        lr.logprobs_from_logits(logits, labels, **kwargs)
    with pytest.raises(error, match=message):
        lr.entropy_from_logits(logits, **kwargs)


def test_candidates_and_topk_arguments():
    with pytest.raises(ValueError, match=r"expected labels of shape \(2, 3\) or \(2, 3, 'K'\) for K candidates"):
        lr.logprobs_from_logits(logits, labels[:, :, None, None])
    bad = labels[..., None].repeat(1, 1, 4)
    bad[1, 0, 3] = 9
    with pytest.raises(ValueError, match=r"label 9 at position \(1, 0, 3\) is out of range"):
        lr.logprobs_from_logits(logits, bad)
    with pytest.raises(ValueError, match="k must be between 1 and the vocabulary size 5, got 6"):
        lr.topk_logprobs(logits, 6)
    with pytest.raises(TypeError, match="k must be an int, got float"):
        lr.topk_logprobs(logits, 2.0)
    with pytest.raises(ValueError, match="logits_dtype must be torch.bfloat16, torch.float16 or None"):
        lr.logprobs_from_hidden(torch.randn(2, 4), torch.randn(5, 4), labels[0, :2], logits_dtype=torch.int8)


def test_keywords_that_keep_every_token_change_nothing_and_need_nothing():
    """top_k of 0, -1 or >= V, top_p = 1 and min_p = 0 keep every token: such a call is an ordinary
    one (same key, same backend, same bits)."""
    ran.clear()
    plain = lr.logprobs_from_logits(logits, labels, backend="naive")
    for kw in (dict(top_k=0), dict(top_k=-1), dict(top_k=5), dict(top_p=1.0), dict(min_p=0.0)):
        assert torch.equal(lr.logprobs_from_logits(logits, labels, backend="naive", **kw), plain), kw
