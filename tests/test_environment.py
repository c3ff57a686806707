"""Environment detection on this machine and the fake environments tests use."""

from packaging.version import Version
import torch

import logprob_registry as lr
from logprob_registry import environment
from logprob_registry.environment import Environment


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
    assert lr.get_registry()._env() is env


def test_fake_cuda_capability_and_rocm():
    env = Environment.fake(devices={"cuda": 2}, capability=(8, 0), hip="6.1")
    assert env.cuda_capability == (8, 0) and env.is_rocm and env.main_device == "cuda"
    assert Environment.fake().cuda_capability is None


def test_setting_none_detects_again(fake_env):
    fake_env(Environment.fake(devices={"cuda": 1}))
    environment.set_environment(None)
    assert not environment.get_environment().is_fake
