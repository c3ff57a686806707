"""TRL (``pip install trl``, 1.16): its log-probability, entropy and divergence functions replaced
by this library's, wherever TRL binds them.

``install()`` replaces, in ``trl.trainer.utils`` (and in every ``trl`` module that bound the same
function, e.g. the experimental trainers; one imported while installed binds the replacement, and
uninstall restores it too): ``selective_log_softmax``, ``entropy_from_logits``,
``selective_log_softmax_and_entropy`` (the temperature applied inside, in fp32, instead of TRL's
division of bf16 logits), and ``_ChunkedLogProbFunction``, the fused head that
``add_fused_lm_head`` (GRPO, RLOO, DPO, KTO, SFT trainers) calls, through :func:`lr.token_stats`
with its five outputs; in ``trl.trainer.distillation_trainer``, ``ChunkedDivergenceFunction``
through :func:`lr.kl_divergence` (forward, reverse or generalized JSD by TRL's ``beta``). A
divergence call this library does not express (a bias, or sides scaled or softcapped differently)
runs TRL's own function.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

import torch

import logprob_registry as lr

from ._handle import Handle, in_package, require
from ._handle import install as _install

TESTED = ">=1.16,<1.17"
NAME = "trl"
_OUTPUTS = {"entropy": "entropy", "log_sum_sq_probs": "log_sum_p2", "mean_logits": "mean_logit",
            "is_top1": "is_argmax"}


def install(backend: Optional[str] = None) -> Handle:
    """Replace TRL's functions (module docstring); ``backend`` forces a backend for them. Raises
    ImportError naming the supported range when TRL is missing or another version."""
    trl = importlib.import_module("trl")
    require("trl", trl.__version__, TESTED)
    return _install(NAME, lambda: _patches(backend), backend, package="trl")


def _masked(x: torch.Tensor, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return x if row_mask is None else x.masked_fill(row_mask == 0, 0.0)


def _functions(backend: Optional[str]) -> dict:
    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        return _masked(lr.logprobs_from_logits(logits, index, temperature=temperature, backend=backend), row_mask)

    def entropy_from_logits(logits, chunk_size=128):
        return lr.entropy_from_logits(logits, backend=backend)

    def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None):
        logp, entropy = lr.logprobs_and_entropy(logits, index, temperature=temperature, backend=backend)
        entropy = entropy if entropy_requires_grad else entropy.detach()
        return _masked(logp, row_mask), _masked(entropy, row_mask)

    for f in (selective_log_softmax, entropy_from_logits, selective_log_softmax_and_entropy):
        f.__doc__ = f"logprob_registry's replacement of trl.trainer.utils.{f.__name__} (integrations.trl)"
    return {f.__name__: f for f in (selective_log_softmax, entropy_from_logits, selective_log_softmax_and_entropy)}


class _FusedHead:
    """Stands for ``trl.kernels.ChunkedLogProbFunction``: ``apply(hidden, weight, bias, targets,
    temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`` -> (log_probs, entropy,
    log_sum_sq_probs, mean_logits, is_top1), None where not asked."""

    def __init__(self, backend: Optional[str]) -> None:
        self.backend = backend

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size=None, final_logit_softcapping=None,
              logit_scale=1.0, outputs=tuple(_OUTPUTS)):
        # the log-probabilities are always computed; GRPOTrainer names them ("log_probs", "entropy")
        wanted = ("logprobs",) + tuple(_OUTPUTS[name] for name in outputs if name in _OUTPUTS)
        stats = lr.token_stats(hidden, targets, weight=weight, bias=bias, outputs=wanted, temperature=temperature,
                               softcap=final_logit_softcapping, logit_scale=logit_scale or None,
                               backend=self.backend)
        return (stats.logprobs,) + tuple(getattr(stats, _OUTPUTS[name]) if name in outputs else None
                                         for name in _OUTPUTS)


class _Divergence:
    """Stands for TRL's ``ChunkedDivergenceFunction``: ``apply(student_hidden, student_weight,
    student_bias, teacher_hidden, teacher_weight, teacher_bias, beta, temperature, ...)`` ->
    (per-token divergence, the student's entropy without gradient)."""

    def __init__(self, original: Any, backend: Optional[str]) -> None:
        self.original, self.backend = original, backend

    def apply(self, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
              beta, temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None,
              teacher_logit_scale=1.0, teacher_final_logit_softcapping=None):
        scale = student_logit_scale or 1.0
        if (student_bias is not None or teacher_bias is not None or scale != (teacher_logit_scale or 1.0)
                or student_final_logit_softcapping is not None or teacher_final_logit_softcapping is not None):
            return self.original.apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                       teacher_bias, beta, temperature, student_logit_scale,
                                       student_final_logit_softcapping, teacher_logit_scale,
                                       teacher_final_logit_softcapping)
        beta = float(beta)
        direction = "forward" if beta <= 0.0 else "reverse" if beta >= 1.0 else "jsd"
        kl = lr.kl_divergence(student_hidden, teacher_hidden, student_weight=student_weight,
                              teacher_weight=teacher_weight, direction=direction, beta=beta,
                              temperature=temperature, logit_scale=None if scale == 1.0 else scale,
                              backend=self.backend)
        with torch.no_grad():
            entropy = lr.token_stats(student_hidden, weight=student_weight, outputs=("entropy",),
                                     temperature=temperature, logit_scale=None if scale == 1.0 else scale,
                                     backend=self.backend).entropy
        return kl, entropy


def _patches(backend: Optional[str]):
    utils = importlib.import_module("trl.trainer.utils")
    functions = _functions(backend)
    patches = []
    for name, replacement in functions.items():
        original = getattr(utils, name)
        for module in list(sys.modules.values()):  # wherever TRL bound the same function
            if in_package(module, "trl") and getattr(module, name, None) is original:
                patches.append((module, name, replacement))
    patches.append((utils, "_ChunkedLogProbFunction", _FusedHead(backend)))
    distillation = importlib.import_module("trl.trainer.distillation_trainer")
    patches.append((distillation, "ChunkedDivergenceFunction",
                    _Divergence(distillation.ChunkedDivergenceFunction, backend)))
    return patches


__all__ = ["TESTED", "install"]
