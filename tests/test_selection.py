"""Selection driven by fake environments: the chosen backend and the exact reasons of the rest."""

import pytest
import torch

import logprob_registry as lr
from logprob_registry.environment import Environment
from logprob_registry.registry import Key, NoEligibleBackendError


def _op(*args, **kwargs):
    raise AssertionError("selection tests never run an op")


class LikeBuiltins:
    """Backends with the shapes of the built-ins, registered as a plugin would register them."""

    @lr.hookimpl
    def register_backends(self, register):
        ops = {"logprobs": _op, "entropy": _op}
        register(lr.Backend(name="portable", ops=ops, devices={"cpu", "cuda", "npu"}, priority=0))
        register(lr.Backend(name="chunky", ops=ops, devices={"cpu", "cuda", "npu", "xpu", "mps"}, priority=10))
        register(lr.Backend(name="kernel", ops=ops, devices={"cuda"}, priority=30, torch=">=2.4",
                            requires=("triton>=3.0",), dtypes={torch.float16, torch.bfloat16, torch.float32}))
        register(lr.Backend(name="ascend", ops={"logprobs": _op}, devices={"npu"}, priority=15,
                            requires=("torch_npu",), autograd=False))
        register(lr.Backend(name="modern", ops=ops, devices={"cpu", "cuda"}, priority=20, torch=">=2.5"))


def _torch_2_6():
    """The fake environment a test registry starts in (its ``install_env`` replaces it)."""
    return Environment.fake(torch="2.6.0")


@pytest.fixture
def registry(make_registry):
    """The built-in-like backends alone, in a fake environment: no global is touched."""
    return make_registry(LikeBuiltins(), environment=_torch_2_6())


def verdicts(reg, key):
    report = reg.explain(key)
    return report.chosen, {c.name: c.reason for c in report.candidates if c.reason}


def test_cpu_only(registry):
    registry.install_env(Environment.fake(torch="2.6.0", triton="3.1.0"))
    chosen, why = verdicts(registry, Key("logprobs", "cpu", torch.float32, False))
    assert chosen == "modern"
    assert why == {"kernel": "runs on cuda, not cpu", "ascend": "runs on npu, not cpu"}
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.float32, False))
    assert chosen is None
    assert why["kernel"] == "no CUDA device"
    assert why["chunky"] == "no CUDA device"


def test_cuda_with_triton(registry):
    registry.install_env(Environment.fake(torch="2.6.0", devices={"cuda": 2}, triton="3.1.0"))
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.bfloat16, True))
    assert chosen == "kernel"
    assert why == {"ascend": "runs on npu, not cuda"}
    # fp64 is not among the kernel's dtypes: the next one takes it, and the reason says why.
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.float64, False))
    assert chosen == "modern"
    assert why["kernel"] == "does not accept float64 input (accepts bfloat16, float16, float32)"


def test_cuda_without_triton(registry):
    registry.install_env(Environment.fake(torch="2.6.0", devices={"cuda": 1}, triton=None))
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.float32, False))
    assert chosen == "modern"
    assert why["kernel"] == "needs triton>=3.0, triton is not installed"


def test_cuda_with_old_triton(registry):
    registry.install_env(Environment.fake(torch="2.6.0", devices={"cuda": 1}, triton="2.3.1"))
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.float32, False))
    assert chosen == "modern"
    assert why["kernel"] == "needs triton>=3.0, found 2.3.1"


def test_npu_with_torch_npu(registry):
    registry.install_env(Environment.fake(torch="2.1.0", devices={"npu": 8}, torch_npu="2.1.0"))
    chosen, why = verdicts(registry, Key("logprobs", "npu", torch.bfloat16, False))
    assert chosen == "ascend"
    assert why == {"kernel": "runs on cuda, not npu", "modern": "runs on cpu, cuda, not npu"}
    # The NPU backend has no backward: with gradients the portable one runs.
    chosen, why = verdicts(registry, Key("logprobs", "npu", torch.bfloat16, True))
    assert chosen == "chunky"
    assert why["ascend"] == "has no backward, and gradients are needed"
    # It implements logprobs only.
    chosen, why = verdicts(registry, Key("entropy", "npu", torch.float32, False))
    assert chosen == "chunky"
    assert why["ascend"] == "does not implement entropy"


def test_npu_without_torch_npu(registry):
    registry.install_env(Environment.fake(torch="2.6.0", devices={"npu": 8}, torch_npu=None))
    chosen, why = verdicts(registry, Key("logprobs", "npu", torch.float32, False))
    assert chosen == "chunky"
    assert why["ascend"] == "torch_npu is not installed"


def test_torch_below_specifier(registry):
    registry.install_env(Environment.fake(torch="2.1.0", devices={"cuda": 1}, triton="3.1.0"))
    chosen, why = verdicts(registry, Key("logprobs", "cuda", torch.float32, False))
    assert chosen == "chunky"
    assert why["kernel"] == "needs torch>=2.4, found 2.1.0"
    assert why["modern"] == "needs torch>=2.5, found 2.1.0"


def test_ties_broken_by_name_not_registration_order(make_registry):
    names = []
    for order in (("b-twin", "a-twin"), ("a-twin", "b-twin")):
        reg = make_registry(environment=_torch_2_6())
        for name in order:
            plugin = type("P", (), {"register_backends": lr.hookimpl(
                lambda self, register, name=name: register(lr.Backend(name=name, ops={"logprobs": _op}, priority=5)))})()
            reg.add_plugin(plugin, name=name)
        names.append(reg.select(Key("logprobs", "cpu", torch.float32, False)).name)
    assert names == ["a-twin", "a-twin"]


def test_availability_check_reason(make_registry):
    def needs_hopper(env, device_type):
        assert device_type == "cuda"
        return None if env.cuda_capability >= (9, 0) else f"needs CUDA capability 9.0, found {env.cuda_capability[0]}.{env.cuda_capability[1]}"

    class P:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="hopper", ops={"logprobs": _op}, devices={"cuda"}, priority=9, available=needs_hopper))
            register(lr.Backend(name="any", ops={"logprobs": _op}, devices={"cuda"}))

    reg = make_registry(P(), environment=Environment.fake(torch="2.6.0", devices={"cuda": 1}, capability=(7, 0)))
    chosen, why = verdicts(reg, Key("logprobs", "cuda", torch.float32, False))
    assert (chosen, why) == ("any", {"hopper": "needs CUDA capability 9.0, found 7.0"})


def test_selection_is_cached_per_key_and_environment(registry):
    key = Key("logprobs", "cpu", torch.float32, False)
    calls = []
    original = registry.verdicts
    registry.verdicts = lambda k, *strict: calls.append(k) or original(k, *strict)
    assert registry.select(key) is registry.select(key)
    assert calls == [key]
    registry.install_env(Environment.fake(torch="2.1.0"))  # a new environment: chosen again
    assert registry.select(key).name == "chunky"
    assert calls == [key, key]


def test_a_transient_availability_failure_is_not_cached(make_registry):
    """An availability check that raises (say, a module half imported by another thread) says so in
    explain, and the next selection asks again instead of keeping the answer for the process."""
    state = {"raise": True}

    def flaky(env, device_type):
        if state["raise"]:
            raise AttributeError("module 'torch._dynamo' has no attribute 'config'")
        return None

    class P:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="flaky", ops={"logprobs": _op}, priority=9, available=flaky))
            register(lr.Backend(name="steady", ops={"logprobs": _op}, priority=1))

    reg = make_registry(P(), environment=_torch_2_6())
    key = Key("logprobs", "cpu", torch.float32, False)
    assert reg.explain(key)["flaky"].reason == (
        "its availability check raised AttributeError: module 'torch._dynamo' has no attribute 'config'")
    assert reg.select(key).name == "steady"
    state["raise"] = False
    assert reg.select(key).name == "flaky"
    assert reg.select(key, backend="flaky").name == "flaky"


def test_any_device_type_and_requirement_strings_with_reasons(make_registry):
    """A backend for a device type torch can name but the registry never heard of (hpu, a
    PrivateUse1 backend) registers and is ranked like any other; an unmet PEP 508 requirement is
    named in explain."""

    class P:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="gaudi", ops={"logprobs": _op}, devices={"hpu"}, priority=40,
                                requires=("habana_frameworks",)))
            register(lr.Backend(name="future", ops={"logprobs": _op}, devices={"cpu", "hpu"}, priority=30,
                                requires=("packaging>=999",)))
            register(lr.Backend(name="met", ops={"logprobs": _op}, devices={"cpu", "hpu"}, priority=20,
                                requires=("packaging>=20", "pluggy")))
            register(lr.Backend(name="custom", ops={"logprobs": _op}, devices={"my_accel"}, priority=10))

    reg = make_registry(P(), environment=Environment.fake(torch="2.6.0", devices={"hpu": 8},
                                                          distributions={"packaging": "24.1", "pluggy": "1.6.0"}))
    report = reg.explain(Key("logprobs", "hpu", torch.bfloat16, False))
    assert report.chosen == "met"
    assert report["gaudi"].reason == "habana_frameworks is not installed"
    assert report["future"].reason == "needs packaging>=999, found 24.1"
    assert report["custom"].reason == "runs on my_accel, not hpu"
    assert "needs packaging>=999, found 24.1" in str(report)
    assert reg.explain(Key("logprobs", "my_accel", torch.float32, False))["custom"].reason == "no MY_ACCEL device"
    # the real registry, on this machine: the real packaging is older than 999
    real = make_registry(("p", P()))
    assert real.explain(Key("logprobs", "cpu", torch.float32, False))["future"].reason.startswith(
        "needs packaging>=999, found ")


def test_untested_versions_can_be_waived_by_name(registry, monkeypatch):
    """LOGPROB_REGISTRY_UNTESTED_VERSIONS lets a named backend run outside the versions it declares
    (to test it there), never without what it requires."""
    registry.install_env(Environment.fake(torch="2.1.0", devices={"cuda": 1}, triton="2.3.1"))
    key = Key("logprobs", "cuda", torch.float32, False)
    assert verdicts(registry, key)[1]["kernel"] == "needs torch>=2.4, found 2.1.0"
    monkeypatch.setenv("LOGPROB_REGISTRY_UNTESTED_VERSIONS", "kernel, modern")
    assert verdicts(registry, key)[0] == "kernel"
    registry.install_env(Environment.fake(torch="2.1.0", devices={"cuda": 1}, triton=None))
    assert verdicts(registry, key)[1]["kernel"] == "triton is not installed"


def test_no_eligible_backend_error_lists_the_table(registry):
    registry.install_env(Environment.fake(torch="2.6.0"))
    with pytest.raises(NoEligibleBackendError, match=r"no registered backend can run logprobs on cuda") as info:
        registry.select(Key("logprobs", "cuda", torch.float32, False))
    assert "no CUDA device" in str(info.value)


def test_explicit_choice_must_be_eligible(registry, monkeypatch):
    registry.install_env(Environment.fake(torch="2.6.0"))
    key = Key("logprobs", "cpu", torch.float32, False)
    with pytest.raises(NoEligibleBackendError) as info:
        registry.select(key, backend="kernel")
    message = str(info.value)
    assert "backend 'kernel' (chosen by backend= argument) cannot run logprobs on cpu float32 tensors: runs on cuda, not cpu" in message
    assert "Eligible here: modern, chunky, portable" in message
    with pytest.raises(NoEligibleBackendError, match="no backend named 'nope' is registered; registered: "):
        registry.select(key, backend="nope")


def test_explicit_choice_precedence(registry, monkeypatch):
    registry.install_env(Environment.fake(torch="2.6.0"))
    key = Key("logprobs", "cpu", torch.float32, False)
    monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "portable")
    assert registry.select(key).name == "portable"
    with lr.use_backend("naive"):  # use_backend checks the name against the global registry
        assert registry.forced() == ("naive", "use_backend()")
        assert registry.forced("chunky") == ("chunky", "backend= argument")
    assert registry.forced() == ("portable", "LOGPROB_REGISTRY_BACKEND=portable")
    monkeypatch.setenv("LOGPROB_REGISTRY_BACKEND", "kernel")
    with pytest.raises(NoEligibleBackendError, match=r"chosen by LOGPROB_REGISTRY_BACKEND=kernel"):
        registry.select(key)


def test_dispatch_follows_the_tensor(fake_env):
    """A CPU tensor on a CUDA machine goes to a CPU backend; bf16 with gradients to an autograd one
    (through the public functions, so the process-wide environment is faked here)."""
    fake_env(Environment.fake(torch="2.6.0", devices={"cuda": 1}, triton="3.1.0"))
    calls = []

    def make(name):
        def op(logits, labels, **kw):
            calls.append(name)
            return torch.zeros(labels.shape)
        return op

    class P:
        @lr.hookimpl
        def register_backends(self, register):
            register(lr.Backend(name="test-gpu-only", ops={"logprobs": make("test-gpu-only")}, devices={"cuda"}, priority=900))
            register(lr.Backend(name="test-forward-only", ops={"logprobs": make("test-forward-only")}, devices={"cpu"},
                                priority=800, autograd=False))
            register(lr.Backend(name="test-cpu", ops={"logprobs": make("test-cpu")}, devices={"cpu"}, priority=700))

    reg = lr.get_registry()
    reg.add_plugin(P(), name="test-dispatch")
    try:
        assert lr.select(device="cuda").name == "test-gpu-only"
        logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
        labels = torch.zeros(2, 3, dtype=torch.long)
        lr.logprobs_from_logits(logits, labels)
        lr.logprobs_from_logits(logits.requires_grad_(), labels)
        assert calls == ["test-forward-only", "test-cpu"]
    finally:
        reg.remove_plugin("test-dispatch")


def test_public_select_and_explain_on_this_machine():
    report = lr.explain("logprobs", device="cpu")
    assert report.chosen == lr.select("logprobs", device="cpu").name
    table = str(report)
    assert table.splitlines()[0].startswith("logprobs on cpu float32 tensors: using ")
    for backend in lr.backends():
        assert backend.name in table
    assert "naive" in [b.name for b in lr.backends()]
    with pytest.raises(ValueError, match="unknown op 'logprob'"):
        lr.explain("logprob")


def test_import_resolves_the_default_for_the_main_device():
    reg = lr.get_registry()
    assert reg.default is not None
    assert reg.default.name == lr.select("logprobs").name


def test_the_fused_op_declarations_leave_the_fused_op_to_chunked():
    """compiled declares a min_size for logprobs_from_hidden above every bounded bucket (docs/tuning.md:
    chunked's fused op measured as fast or faster on the CPU): the automatic choice is chunked at
    every measured (V, H), compiled skipped with the reason; above the last vocabulary bucket
    compiled is not passed over; rows never matter."""
    for shape, h in (((256, 4096), 256), ((4096, 32768), 1024), ((4096, 151936), 2048)):
        report = lr.explain("logprobs_from_hidden", device="cpu", shape=shape, hidden_size=h)
        assert report.chosen == "chunked"
        if report["compiled"].reason is None:  # compiled needs a C++ compiler
            assert report["compiled"].status == "skipped"
            assert "min_size['logprobs_from_hidden']" in report["compiled"].why
    huge = lr.explain("logprobs_from_hidden", device="cpu", shape=(8, 300000), hidden_size=64)
    assert huge["compiled"].status != "skipped"
    for rows in (1, 7, 4096):
        assert lr.select("logprobs_from_hidden", device="cpu", shape=(rows, 4096), hidden_size=256).name == "chunked"
    # other ops keep their keys and choices: no hidden bucket, no size rule of the fused op
    assert lr.explain("logprobs", device="cpu", shape=(256, 4096), hidden_size=256).key == \
        lr.explain("logprobs", device="cpu", shape=(256, 4096)).key


def test_a_fused_call_runs_what_explain_names(monkeypatch):
    """The key a call makes holds its hidden bucket: the backend that runs is the one explain names
    for that shape and hidden size."""
    ran = []
    registry = lr.get_registry()
    chunked = registry.get("chunked").ops["logprobs_from_hidden"]
    monkeypatch.setitem(registry.get("chunked").ops, "logprobs_from_hidden",
                        lambda *a, **k: ran.append("chunked") or chunked(*a, **k))
    registry.reset()
    try:
        h, w, y = torch.randn(5, 16), torch.randn(4096, 16), torch.randint(0, 4096, (5,))
        lr.logprobs_from_hidden(h, w, y)
        assert ran == ["chunked"] == [lr.select("logprobs_from_hidden", device="cpu", shape=(5, 4096), hidden_size=16).name]
    finally:
        registry.reset()
