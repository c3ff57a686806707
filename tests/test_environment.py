"""Environment detection on this machine and the fake environments tests use."""

import torch
from packaging.version import Version

import logprob_registry as lr
from logprob_registry import environment
from logprob_registry.environment import Environment, detect


def test_detects_this_machine():
    env = environment.detect()
    assert env.torch_version == Version(torch.__version__)
    assert env.has_device("cpu") and env.devices["cpu"].count == 1
    assert env.has_device("cuda") == torch.cuda.is_available()
    assert env.main_device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert env.module_problem("json") is None
    assert env.module_problem("surely_not_a_module_xyz") == "surely_not_a_module_xyz is not installed"


def test_fake_environment(fake_env):
    env = fake_env(Environment.fake(torch="2.1.0", devices={"npu": 8}, torch_npu="2.1.0"))
    assert environment.get_environment() is env
    assert env.main_device == "npu" and env.device_count("npu") == 8
    assert env.module_problem("torch_npu") is None
    assert env.module_problem("triton") == "triton is not installed"
    assert env.module_problem("json") == "json is not installed"  # fakes name every module they have
    assert lr.get_registry().environment() is env


def test_fake_distributions_and_requirements():
    env = Environment.fake(triton="3.1.0", distributions={"liger-kernel": "0.5.2", "gone": None})
    assert env.distribution_version("triton") == Version("3.1.0")
    assert env.distribution_version("liger_kernel") == Version("0.5.2")  # names are normalised
    assert env.requirement_problem("liger-kernel>=0.5") is None
    assert env.requirement_problem("liger-kernel>=0.6") == "needs liger-kernel>=0.6, found 0.5.2"
    assert env.requirement_problem("gone") == "gone is not installed"
    assert env.requirement_problem("gone>=1") == "needs gone>=1, gone is not installed"
    assert env.requirement_problem("triton; sys_platform == 'no-such-os'") is None  # marker not met


def test_real_distributions():
    env = detect()
    assert env.requirement_problem("packaging>=1") is None
    assert env.requirement_problem("packaging>=999").startswith("needs packaging>=999, found ")
    # a bare name that is no distribution must at least be a module that imports
    assert env.requirement_problem("surely-not-a-distribution-xyz") == "surely_not_a_distribution_xyz is not installed"
    assert env.requirement_problem("json") is None


def test_fake_cuda_capability_and_rocm():
    env = Environment.fake(devices={"cuda": 2}, capability=(8, 0), hip="6.1")
    assert env.cuda_capability == (8, 0) and env.is_rocm and env.main_device == "cuda"
    assert Environment.fake().cuda_capability is None
    old = Environment.fake(devices={"cuda": 1}, capability=(6, 1))
    assert old.triton_capability_problem() == "needs CUDA compute capability 7.0 or newer (triton), found 6.1"
    assert env.triton_capability_problem() is None


def test_setting_none_detects_again(fake_env):
    fake_env(Environment.fake(devices={"cuda": 1}))
    environment.set_environment(None)
    assert not environment.get_environment().is_fake
