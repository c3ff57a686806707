"""``triton``: fused Triton kernels, one pass over the vocabulary per row, on CUDA (and ROCm).

Logprobs, entropy or both in one read of the logits (online log-sum-exp), in the logits' own dtype
and any strides, accumulated in float32 (float64 for float64 logits); a backward kernel that
writes the gradient out of place or over the logits (``inplace_backward``). The kernels live in
:mod:`._kernels` and are imported only when an op runs: ``import logprob_registry`` never imports
triton. Details and measured numbers: docs/backends/triton.md.

On the CPU the kernels run only through triton's interpreter, a debugging and testing tool: with
``TRITON_INTERPRET=1`` in the environment when this plugin registers, the backend also accepts CPU
tensors, but with a priority below ``naive`` (and every other built-in), so it is never the
automatic choice there; it runs only when chosen explicitly, as
``TRITON_INTERPRET=1 logprob-registry check --backend triton --device cpu`` does. Without the
variable a CPU tensor gets "runs on cuda, not cpu".
"""

from __future__ import annotations

import os

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import FLOAT_DTYPES

PRIORITY = kit.Priority.KERNEL
INTERPRETER_PRIORITY = kit.Priority.EXPLICIT_ONLY  # below naive: never an automatic choice
# Versions tested: torch 2.13 (CPU, interpreter); triton 3.6 and 3.9 (interpreter, and compiled for
# sm_90 and gfx942 without a GPU). docs/hardware.md says what has run where.
TORCH_SPEC = ">=2.13"
TRITON_REQUIREMENT = "triton>=3.6"


def interpreter_requested() -> bool:
    """Whether TRITON_INTERPRET asks triton to interpret kernels (read as triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


def _load():
    """The kernel module, imported at the first op (a function named ``_kernels`` would shadow the
    submodule of that name: ``from . import _kernels`` would return the function)."""
    from . import _kernels

    return _kernels


def logprobs(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None):
    return _load().logprobs(logits, labels, temperature, ignore_index, inplace_backward, softcap)


def entropy(logits, *, temperature, softcap=None):
    return _load().entropy(logits, temperature, softcap)


def logprobs_and_entropy(logits, labels, *, temperature, ignore_index, inplace_backward, softcap=None):
    return _load().logprobs_and_entropy(logits, labels, temperature, ignore_index, inplace_backward, softcap)


def token_stats(inputs, labels, *, weight, bias, outputs, temperature, ignore_index, softcap=None):
    """Logits only: hidden states (a weight) need the feature stats_hidden, which this backend does not declare."""
    return _load().token_stats(inputs, labels, outputs, temperature, ignore_index, softcap)


def _shard_ops():
    """The vocabulary-parallel kernels' module, imported at the first such op."""
    from . import _shards

    return _shards


def shard_stats(logits, labels, *, vocab_start, tile, temperature, ignore_index, with_entropy, reference=None):
    return _shard_ops().shard_stats(logits, labels, vocab_start=vocab_start, tile=tile, temperature=temperature,
                                    ignore_index=ignore_index, with_entropy=with_entropy, reference=reference)


def shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, *, vocab_start, temperature,
               inplace_backward):
    return _shard_ops().shard_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy,
                                   vocab_start=vocab_start, temperature=temperature, inplace_backward=inplace_backward)


def hidden_shard_stats(hidden, weight, labels, *, bias, vocab_start, tile, temperature, ignore_index, with_entropy,
                       reference=None):
    return _shard_ops().hidden_shard_stats(hidden, weight, labels, bias=bias, vocab_start=vocab_start, tile=tile,
                                           temperature=temperature, ignore_index=ignore_index,
                                           with_entropy=with_entropy, reference=reference)


def hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy, *, bias, vocab_start,
                      tile, temperature, needs_grad):
    return _shard_ops().hidden_shard_grad(hidden, weight, labels, lse, entropy, grad_logprobs, grad_entropy,
                                          bias=bias, vocab_start=vocab_start, tile=tile, temperature=temperature,
                                          needs_grad=needs_grad)


def available(env, device_type: str) -> "str | None":
    """CUDA devices too old for triton are refused; ROCm is left to triton's own support."""
    return env.triton_capability_problem() if device_type == "cuda" else None


def make_backend(interpret: bool) -> lr.Backend:
    """The backend record; ``interpret`` adds CPU tensors, at a priority that never wins."""
    mode = (
        " TRITON_INTERPRET=1 is set: CPU tensors run through triton's interpreter (slow, for "
        "testing), only when chosen explicitly."
        if interpret else " CPU tensors only under TRITON_INTERPRET=1, when chosen explicitly."
    )
    return lr.Backend(
        name="triton",
        ops={
            "logprobs": logprobs,
            "entropy": entropy,
            "logprobs_and_entropy": logprobs_and_entropy,
            "token_stats": token_stats,
            "shard_stats": shard_stats,
            "shard_grad": shard_grad,
            "hidden_shard_stats": hidden_shard_stats,
            "hidden_shard_grad": hidden_shard_grad,
        },
        devices={"cuda", "cpu"} if interpret else {"cuda"},
        dtypes=set(FLOAT_DTYPES),
        priority=INTERPRETER_PRIORITY if interpret else PRIORITY,
        torch=TORCH_SPEC,
        requires=(TRITON_REQUIREMENT,),
        autograd=True,
        available=available,
        inplace_backward=True,
        batch_invariant=True,
        deterministic=True,
        features={"softcap"},
        group_invariant=True,
        description=(
            "fused Triton kernels: one pass over the vocabulary with an online log-sum-exp, in the "
            "logits' dtype and strides, fp32 accumulation; in-place backward." + mode
        ),
    )


@lr.hookimpl
def register_backends(register):
    register(make_backend(interpreter_requested()))
