"""Configuration through environment variables: one parser, parsed before dispatch, loud errors
naming the variable, never taken for a backend failure."""

import warnings

import pytest
import torch

import logprob_registry as lr
from logprob_registry import config


@pytest.mark.parametrize("text, value", [
    ("4194304", 4194304), ("4MiB", 4 << 20), ("4M", 4 << 20), ("4mb", 4 << 20), ("512K", 512 << 10),
    ("512 KiB", 512 << 10), ("1G", 1 << 30), ("16MiB", 16 << 20), (" 7 ", 7),
])
def test_one_byte_size_parser(text, value):
    assert config.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["garbage", "0", "-5", "4.5M", "4 parsecs", ""])
def test_byte_sizes_refused(text):
    with pytest.raises(ValueError, match="not a positive size in bytes"):
        config.parse_bytes(text)


@pytest.mark.parametrize("variable", ["LOGPROB_REGISTRY_CHUNKED_WORKSPACE", "LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES"])
@pytest.mark.parametrize("text", ["garbage", "0", "-5"])
def test_a_bad_variable_fails_every_call_loudly_and_marks_nothing(monkeypatch, variable, text):
    """The call raises ConfigError naming the variable before any backend runs: no fallback to
    naive (which would build the full logits the fused op exists to avoid), nothing marked broken."""
    monkeypatch.setenv(variable, text)
    logits, labels = torch.randn(3, 7), torch.randint(0, 7, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", lr.BackendFallbackWarning)
        with pytest.raises(config.ConfigError, match=f"{variable}={text!r} is not a positive size in bytes"):
            lr.logprobs_from_logits(logits, labels)
        with pytest.raises(config.ConfigError, match=variable):
            lr.logprobs_from_hidden(torch.randn(3, 4), torch.randn(7, 4), labels)
    assert lr.get_registry().broken() == {}
    monkeypatch.delenv(variable)
    lr.logprobs_from_logits(logits, labels)  # fixed: calls work again


def test_the_same_syntax_for_both_variables(monkeypatch):
    from logprob_registry.kernels import chunked
    from logprob_registry.kernels.chunked import _hidden

    monkeypatch.setenv("LOGPROB_REGISTRY_CHUNKED_WORKSPACE", "16MiB")
    monkeypatch.setenv("LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES", "16MiB")
    assert chunked.workspace_bytes() == 16 << 20
    assert _hidden.resolve_chunk_bytes(torch.device("cpu")) == 16 << 20


def test_info_lists_the_variables_and_says_which_is_invalid(monkeypatch, capsys):
    from logprob_registry.cli import main

    monkeypatch.setenv("LOGPROB_REGISTRY_CHUNKED_WORKSPACE", "lots")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "LOGPROB_REGISTRY_CHUNKED_WORKSPACE   lots (INVALID)" in out
    assert "INVALID: LOGPROB_REGISTRY_CHUNKED_WORKSPACE='lots' is not a positive size in bytes" in out
    assert "LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES  unset" in out


def test_plugins_declare_their_own_variables(monkeypatch):
    var = config.declare(config.Variable("LOGPROB_REGISTRY_TEST_KNOB", int, 3, "a test knob"))
    try:
        assert config.get(var.name) == 3
        monkeypatch.setenv(var.name, "5")
        assert config.get(var.name) == 5
        monkeypatch.setenv(var.name, "five")
        with pytest.raises(config.ConfigError, match="LOGPROB_REGISTRY_TEST_KNOB='five' is invalid literal"):
            config.get(var.name)
    finally:
        config._declared.pop(var.name)
        config._parsed.pop(var.name, None)
