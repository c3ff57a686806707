"""verl (``pip install --no-deps verl==0.9.1``, its pins clash; it needs ray and tensordict):
its log-probability and entropy functions, its FSDP engine's temperature division and its fused
heads replaced by this library's, wherever verl binds them.

``install()`` replaces, in ``verl.utils.torch_functional`` and in every ``verl`` module that bound
the same function (the FSDP, automodel and torchtitan engines, the naive rollout, the prefix
grouper; one imported while installed binds the replacement, and uninstall restores it too):
``logprobs_from_logits`` (signature kept, ``inplace_backward`` has nothing to do),
``entropy_from_logits`` and ``entropy_from_logits_with_chunking``. In the FSDP engine (``verl.workers.engine.fsdp.
transformer_impl``), ``_scale_logits_by_temperature``: verl divides bf16 logits by the temperature
in bf16; the replacement divides in float32 and keeps the float32 quotient. The fused path
(``model.use_fused_kernels``) takes the hidden states and the temperature itself: with
``impl_backend`` "torch" or "liger", ``verl.utils.experimental.torch_functional.FusedLinearForPPO``
is replaced by a subclass whose forward is :func:`lr.token_stats` (log-probabilities and entropy);
with "triton", ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (a call with a
reduction or a process group runs verl's own). The models' fused forwards import both at call
time, so every model verl patches is covered.

Install before verl builds its engines (an engine picks its entropy function when it is built),
in every process that runs one: verl's workers are Ray actors, e.g. through verl's
``VERL_USE_EXTERNAL_MODULES`` naming a module of yours that calls ``install()``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

import logprob_registry as lr

from ._handle import Handle, in_package, require
from ._handle import install as _install

TESTED = ">=0.9.1,<0.10"
NAME = "verl"
_FSDP = "verl.workers.engine.fsdp.transformer_impl"


def install(backend: Optional[str] = None) -> Handle:
    """Replace verl's functions (module docstring); ``backend`` forces a backend for them. Raises
    ImportError naming the supported range when verl is missing or another version."""
    verl = importlib.import_module("verl")
    require("verl", verl.__version__, TESTED)
    return _install(NAME, lambda: _patches(backend), backend, package="verl")


def _functions(backend: Optional[str]) -> dict:
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        return lr.logprobs_from_logits(logits, labels, backend=backend)

    def entropy_from_logits(logits):
        return lr.entropy_from_logits(logits, backend=backend)

    def entropy_from_logits_with_chunking(logits, chunk_size=2048):
        return lr.entropy_from_logits(logits, backend=backend)

    for f in (logprobs_from_logits, entropy_from_logits, entropy_from_logits_with_chunking):
        f.__doc__ = f"logprob_registry's replacement of verl.utils.torch_functional.{f.__name__} (integrations.verl)"
    return {f.__name__: f for f in (logprobs_from_logits, entropy_from_logits, entropy_from_logits_with_chunking)}


def _scale_logits_by_temperature(logits, temperature, *, is_unit_temperature: bool):
    """verl's FSDP engine's division, in float32: bf16/fp16 logits give float32 logits."""
    if is_unit_temperature:
        return logits
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits / temperature.clamp(min=1e-8).to(logits.dtype)


def _fused(hidden, weight, labels, temperature, backend):
    """(log-probabilities, entropy), float32, of the labels' shape, from the hidden states."""
    stats = lr.token_stats(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long(), weight=weight,
                           outputs=("logprobs", "entropy"), temperature=temperature, backend=backend)
    return stats.logprobs.view(labels.shape), stats.entropy.view(labels.shape)


def _fused_linear(original: type, backend: Optional[str]) -> type:
    class FusedLinearForPPO(original):  # verl's constructor (chunk_size, impl_backend) and attributes kept
        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            return _fused(hidden_states, vocab_weights, input_ids, temperature, backend)

    FusedLinearForPPO.__doc__ = "logprob_registry's replacement of verl's FusedLinearForPPO (integrations.verl)"
    FusedLinearForPPO.__module__ = original.__module__
    return FusedLinearForPPO


def _linear_cross_entropy(original, backend: Optional[str]):
    def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        if reduction != "none" or dist_process_group is not None:  # not what the HF models' forwards ask
            return original(hidden, weight, labels, temperature, reduction, dist_process_group)
        logprobs, entropy = _fused(hidden, weight, labels, temperature, backend)
        return logprobs.reshape(-1), entropy.reshape(-1)  # as verl's kernel: one value per token

    linear_cross_entropy.__doc__ = "logprob_registry's replacement of verl's Triton linear_cross_entropy"
    return linear_cross_entropy


def _patches(backend: Optional[str]):
    try:  # its division is replaced where it is defined: imported first
        importlib.import_module(_FSDP)
    except ImportError:  # its own dependencies (peft, codetiming, ...) are missing: it cannot be in use
        pass
    functional = importlib.import_module("verl.utils.torch_functional")
    patches = []
    for name, replacement in _functions(backend).items():
        original = getattr(functional, name)
        for module in list(sys.modules.values()):  # wherever verl bound the same function
            if in_package(module, "verl") and getattr(module, name, None) is original:
                patches.append((module, name, replacement))
    fsdp = sys.modules.get(_FSDP)
    if fsdp is not None:
        patches.append((fsdp, "_scale_logits_by_temperature", _scale_logits_by_temperature))
    experimental = importlib.import_module("verl.utils.experimental.torch_functional")
    patches.append((experimental, "FusedLinearForPPO", _fused_linear(experimental.FusedLinearForPPO, backend)))
    kernel = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    patches.append((kernel, "linear_cross_entropy", _linear_cross_entropy(kernel.linear_cross_entropy, backend)))
    return patches


__all__ = ["TESTED", "install"]
