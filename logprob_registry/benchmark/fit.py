"""Whether a setting fits in the device's memory, decided in the parent before any tensor exists:
a generous estimate by part, the refusal that names the parts, and the largest shape that fits."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from .settings import REFERENCE_CHUNK_ELEMENTS, Setting


def estimate_bytes(s: Setting) -> Dict[str, int]:
    """A generous estimate of the memory one child needs, by part.

    The inputs, their gradients (and, in place, a fresh copy of them per call); for an op that
    takes hidden states, the baseline's own ``hidden @ weight.T`` logits in the input dtype (and
    their gradient); the workspace of the hungriest likely method, the float32 textbook one
    (``naive``), as measured: a float32 copy of the logits and their log-softmax, in backward one
    more float32 tensor of that size, for the entropy one more again, and float32 copies of
    half-precision weights; for ``kl_divergence`` (two sides) the textbook formula's log-softmax of
    each side, the teacher's probabilities, their difference and product (in backward, as many
    again); the float64 reference: a chunk of rows, plus a float64 copy of the weight (and, in
    backward, its gradient and one product of that size).
    """
    b, t, v = s.shape
    bl, tl, _ = s.logits_shape
    m = bl * tl * v  # elements of the logits the op reduces
    work_item = max(4, s.itemsize)
    grads = sum(s.input_bytes(n) for n in s.grad_inputs)
    shared = [n for n in s.tensors if not s.kind(n).per_token and not s.kind(n).integer]
    shared_elements = sum(s.input_bytes(n) // s.itemsize for n in shared)
    formed = sum(s.kind(n).dims == "...H" for n in s.spec.inputs)  # logits the baseline forms (one per side)
    kl = "kl" in s.outputs
    parts = {name: s.input_bytes(name) for name in s.tensors}
    parts.update({
        "gradients": grads,
        "in-place copy": grads if s.inplace_backward else 0,
        "baseline logits": m * s.itemsize * (formed + (1 if s.backward else 0)) if formed else 0,
        "workspace": m * work_item * ((10 if s.backward else 5) if kl else
                                      (3 if s.backward else 2) + ("entropy" in s.outputs)),
        "float32 copies": shared_elements * 4 * (2 if s.backward else 1) if s.itemsize < 4 else 0,
        "float64 reference": (min(m, max(v, REFERENCE_CHUNK_ELEMENTS)) * 8 * (12 if kl else 6)
                              + shared_elements * 8 * (3 if s.backward else 1)),
    })
    return parts


def refusal(s: Setting, available: int, source: str) -> Optional[str]:
    """None when ``s`` fits in ``available`` bytes; else the message that refuses it."""
    parts = estimate_bytes(s)
    need = sum(parts.values())
    if need <= available:
        return None
    detail = ", ".join(f"{k} {fmt_gib(x)}" for k, x in parts.items() if x >= 2**20)
    hint = suggest(s, available)
    smaller = "vocabulary or hidden size" if s.hidden_size else "vocabulary"
    hint = (f" Try --shape {','.join(map(str, hint))}." if hint else
            f" Even one row of this vocabulary does not fit; try a smaller {smaller}.")
    return (f"{s.describe()} needs about {fmt_gib(need)} ({detail}), but only {fmt_gib(available)} "
            f"is available on {s.device} ({source}).{hint}")


def suggest(s: Setting, available: int) -> Optional[Tuple[int, int, int]]:
    """The largest shape that fits, halving the batch first and then the sequence length."""
    b, t, v = s.shape
    shortest = 2 if s.sliced else 1
    while True:
        trial = dataclasses.replace(s, shape=(b, t, v))
        if sum(estimate_bytes(trial).values()) <= available:
            return (b, t, v)
        if b > 1:
            b = max(1, b // 2)
        elif t > shortest:
            t = max(shortest, t // 2)
        else:
            return None


def cpu_available_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo, or None where there is no /proc (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
