"""Triton kernels of the ``triton`` backend, and the autograd function around them.

Imported only when one of the backend's ops runs (never by ``import logprob_registry``), because
importing triton is slow and because ``TRITON_INTERPRET`` is read when the kernels are defined.

One pass over each row's vocabulary with an online log-sum-exp: for every block of ``BLOCK``
columns the running maximum ``m``, the sum ``s = sum(exp(x - m))`` and, for the entropy,
``t = sum(exp(x - m) * (x - m))`` are rescaled to the new maximum, so

    logprob = (x[label] - m) - log(s)        entropy = log(s) - t / s

with ``x = logits / temperature`` read in the logits' dtype and accumulated in float32 (float64 for
float64 logits). A vocabulary longer than ``CHUNK`` is split across programs, each writing its
partial ``(m, s, t)``, and a second kernel combines them. The split depends on the vocabulary size
only, never on the number of rows, so a row's result does not depend on its batch.

The backward kernel recomputes ``p = exp(x - m - log s)`` from the logits and the two saved
per-row floats, and writes ``(onehot - p) * grad / T - grad_entropy * p * (log p + H) / T``, out
of place or over the logits (``inplace_backward``). Nothing of size N x V is kept between the
passes.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton: the variable is read the same way
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")

# Launch shape: chosen from the vocabulary size and dtype only (never from the number of rows, which
# would break batch invariance). Tests shrink BLOCK and CHUNK to exercise the loop and the split.
TUNING = {"block": None, "chunk": None, "num_warps": None}
CHUNK = 32768  # vocabulary columns per program in the forward pass
MAX_PARTS = 1024  # most chunks the combine kernel takes in one row


def _block(vocab: int, dtype: torch.dtype) -> int:
    if TUNING["block"]:
        return int(TUNING["block"])
    widest = {torch.float64: 2048, torch.float32: 4096}.get(dtype, 8192)
    return max(16, min(triton.next_power_of_2(max(vocab, 1)), widest))


def _chunk(vocab: int, block: int) -> int:
    chunk = int(TUNING["chunk"] or CHUNK)
    chunk = max(block, chunk - chunk % block)
    while triton.cdiv(vocab, chunk) > MAX_PARTS:
        chunk *= 2
    return chunk


def _num_warps(block: int) -> int:
    if TUNING["num_warps"]:
        return int(TUNING["num_warps"])
    return max(1, min(16, block // 512))


# ----------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_offset(row, D1, D2, s0, s1, s2):
    """Offset of row ``row`` (a linear index over three leading dims of sizes (., D1, D2))."""
    i2 = row % D2
    rest = row // D2
    return (rest // D1) * s0 + (rest % D1) * s1 + i2 * s2


@triton.jit
def _finish(
    row, x_row, m, s, t, temp, xsv,
    lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, D1, D2, ls0, ls1, ls2, ignore_index,
    ACC: tl.constexpr, LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr,
):
    """Write a row's results from its (m, s, t), and save m and log(s) for the backward."""
    log_s = tl.log(s)
    tl.store(m_ptr + row, m)
    tl.store(ls_ptr + row, log_s)
    if LABELS:
        label = tl.load(lab_ptr + _row_offset(row, D1, D2, ls0, ls1, ls2)).to(tl.int64)
        if IGNORE:
            keep = label != ignore_index
            x_lab = tl.load(x_row + label * xsv, mask=keep, other=0.0).to(ACC) / temp
            tl.store(lp_ptr + row, tl.where(keep, (x_lab - m) - log_s, 0.0))
        else:
            x_lab = tl.load(x_row + label * xsv).to(ACC) / temp
            tl.store(lp_ptr + row, (x_lab - m) - log_s)
    if ENTROPY:
        tl.store(ent_ptr + row, log_s - t / s)


@triton.jit
def _forward_kernel(
    x_ptr, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, pm_ptr, ps_ptr, pt_ptr,
    V, CHUNK, SPAN, D1, D2, xs0, xs1, xs2, xsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index,
    BLOCK: tl.constexpr, ACC: tl.constexpr, SPLIT: tl.constexpr,
    LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + _row_offset(row, D1, D2, xs0, xs1, xs2)
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    cols = lo + tl.arange(0, BLOCK).to(tl.int64)
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    t = tl.zeros([], ACC)
    for start in range(0, SPAN, BLOCK):  # SPAN = min(CHUNK, V); the last chunk's tail is masked
        idx = start + cols
        x = tl.load(x_row + idx * xsv, mask=idx < hi, other=float("-inf")).to(ACC) / temp
        m_new = tl.maximum(m, tl.max(x, 0))
        # -inf entries (and a running maximum still at -inf) are replaced by finite stand-ins
        # before any arithmetic, so that no inf - inf or 0 * inf is ever formed; NaN still spreads.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        masked = x == float("-inf")
        d = tl.where(masked, ref, x) - ref
        e = tl.where(masked, 0.0, tl.exp(d))
        fresh = m == float("-inf")  # nothing but -inf so far: s and t are 0
        shift = tl.where(fresh, ref, m) - ref
        alpha = tl.where(fresh, 0.0, tl.exp(shift))
        if ENTROPY:
            t = alpha * (t + shift * s) + tl.sum(e * d, 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
    if SPLIT:
        parts = tl.num_programs(1)
        tl.store(pm_ptr + row * parts + part, m)
        tl.store(ps_ptr + row * parts + part, s)
        if ENTROPY:
            tl.store(pt_ptr + row * parts + part, t)
    else:
        _finish(row, x_row, m, s, t, temp, xsv, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr,
                D1, D2, ls0, ls1, ls2, ignore_index, ACC, LABELS, IGNORE, ENTROPY)


@triton.jit
def _combine_kernel(
    x_ptr, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, pm_ptr, ps_ptr, pt_ptr,
    n_parts, D1, D2, xs0, xs1, xs2, xsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index,
    PARTS: tl.constexpr, ACC: tl.constexpr,
    LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + _row_offset(row, D1, D2, xs0, xs1, xs2)
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    k = tl.arange(0, PARTS)
    inb = k < n_parts
    pm = tl.load(pm_ptr + row * n_parts + k, mask=inb, other=float("-inf"))
    ps = tl.load(ps_ptr + row * n_parts + k, mask=inb, other=0.0)
    m = tl.max(pm, 0)
    ref = tl.where(m == float("-inf"), 0.0, m)
    empty = pm == float("-inf")  # a chunk of nothing but -inf: its s and t are 0
    shift = tl.where(empty, ref, pm) - ref
    w = tl.where(empty, 0.0, tl.exp(shift))
    s = tl.sum(ps * w, 0)
    t = tl.zeros([], ACC)
    if ENTROPY:
        pt = tl.load(pt_ptr + row * n_parts + k, mask=inb, other=0.0)
        t = tl.sum(w * (pt + shift * ps), 0)
    _finish(row, x_row, m, s, t, temp, xsv, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr,
            D1, D2, ls0, ls1, ls2, ignore_index, ACC, LABELS, IGNORE, ENTROPY)


@triton.jit
def _backward_kernel(
    x_ptr, g_ptr, lab_ptr, glp_ptr, gent_ptr, ent_ptr, m_ptr, ls_ptr,
    V, D1, D2, xs0, xs1, xs2, xsv, gs0, gs1, gs2, gsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index,
    BLOCK: tl.constexpr, ACC: tl.constexpr, IGNORE: tl.constexpr,
    GRAD_LP: tl.constexpr, GRAD_ENT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = cols < V
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    x = tl.load(x_ptr + _row_offset(row, D1, D2, xs0, xs1, xs2) + cols * xsv,
                mask=inb, other=float("-inf")).to(ACC) / temp
    masked = x == float("-inf")
    logp = (tl.where(masked, 0.0, x) - tl.load(m_ptr + row)) - tl.load(ls_ptr + row)
    p = tl.where(masked, 0.0, tl.exp(logp))
    grad = tl.zeros([BLOCK], ACC)
    if GRAD_LP:
        g = tl.load(glp_ptr + row).to(ACC)
        label = tl.load(lab_ptr + _row_offset(row, D1, D2, ls0, ls1, ls2)).to(tl.int64)
        if IGNORE:
            g = tl.where(label == ignore_index, 0.0, g)
        grad = g * (tl.where(cols == label, 1.0, 0.0) - p)
    if GRAD_ENT:
        g_ent = tl.load(gent_ptr + row).to(ACC)
        h = tl.load(ent_ptr + row)
        grad = grad - g_ent * (p * (logp + h))
    grad = grad / temp
    out = g_ptr + _row_offset(row, D1, D2, gs0, gs1, gs2) + cols * gsv
    tl.store(out, grad.to(g_ptr.dtype.element_ty), mask=inb)


# ------------------------------------------------------------------------------------------ launch
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


def _split_temperature(temperature: float) -> Tuple[float, float]:
    """``temperature`` as two float32 numbers whose sum carries ~48 bits (triton passes floats as fp32)."""
    hi = _f32(temperature)
    return hi, _f32(temperature - hi)


def _f32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32: the temperature is infinite for float32 arithmetic
        return math.copysign(math.inf, value)


def _collapse(shape, *strides_list):
    """Leading dims as (sizes, [strides per tensor]) with size-1 dims dropped and mergeable
    neighbours merged (the same merge for every tensor), outermost first."""
    dims = [(size, [s[i] for s in strides_list]) for i, size in enumerate(shape) if size != 1]
    merged = []
    for size, strides in dims:
        if merged:
            psize, pstrides = merged[-1]
            if all(ps == st * size for ps, st in zip(pstrides, strides)):
                merged[-1] = (psize * size, strides)
                continue
        merged.append((size, strides))
    return merged


def _geometry(lead_shape, *strides_list):
    """(D1, D2, [(s0, s1, s2) per tensor]) when the leading dims fit in three, else None."""
    merged = _collapse(lead_shape, *strides_list)
    if len(merged) > 3:
        return None
    merged = [(1, [0] * len(strides_list))] * (3 - len(merged)) + merged
    sizes = [m[0] for m in merged]
    per_tensor = [tuple(m[1][j] for m in merged) for j in range(len(strides_list))]
    return sizes[1], sizes[2], per_tensor


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensor's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_device(logits: torch.Tensor) -> None:
    if logits.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "the triton backend runs on CPU tensors only through triton's interpreter: set "
            "TRITON_INTERPRET=1 before Python starts (before triton is imported), or use a CUDA tensor"
        )


def _forward(logits, labels, temperature, ignore_index, want_lp, want_ent):
    """(logprobs or None, entropy or None, m, log_s): m and log_s are flat per-row buffers."""
    _check_device(logits)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    acc = _acc(logits.dtype)
    dev = logits.device
    n = math.prod(lead)
    lp = torch.empty(lead, dtype=acc, device=dev) if want_lp else None
    ent = torch.empty(lead, dtype=acc, device=dev) if want_ent else None
    m = torch.empty(n, dtype=acc, device=dev)
    log_s = torch.empty(n, dtype=acc, device=dev)
    if n == 0:
        return lp, ent, m, log_s
    if vocab == 0:  # only possible when every label is ignored
        for out in (lp, ent):
            if out is not None:
                out.zero_()
        m.fill_(float("-inf"))
        log_s.fill_(float("-inf"))
        return lp, ent, m, log_s
    with _on(dev):
        _launch_forward(logits, labels if want_lp else None, lp, ent, m, log_s, temperature, ignore_index)
    return lp, ent, m, log_s


def _launch_forward(logits, labels, lp, ent, m, log_s, temperature, ignore_index):
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    label_strides = labels.stride() if labels is not None else (0,) * len(lead)
    geometry = _geometry(lead, logits.stride()[:-1], label_strides)
    if geometry is None:  # more than three unmergeable leading dims: one launch per outer index
        rows = math.prod(lead[1:])
        for i in range(lead[0]):
            sl = slice(i * rows, (i + 1) * rows)
            _launch_forward(
                logits[i], None if labels is None else labels[i],
                None if lp is None else lp[i], None if ent is None else ent[i],
                m[sl], log_s[sl], temperature, ignore_index)
        return
    d1, d2, (xs, ls) = geometry
    n = math.prod(lead)
    acc = m.dtype
    block = _block(vocab, logits.dtype)
    chunk = _chunk(vocab, block)
    parts = triton.cdiv(vocab, chunk)
    t_hi, t_lo = _split_temperature(temperature)
    split = parts > 1
    if split:
        pm = torch.empty(n * parts, dtype=acc, device=logits.device)
        ps = torch.empty_like(pm)
        pt = torch.empty_like(pm) if ent is not None else pm
    else:
        pm = ps = pt = m
    lab = labels if labels is not None else m
    lp_buf = lp if lp is not None else m
    ent_buf = ent if ent is not None else m
    common = dict(ACC=_TL[acc], LABELS=labels is not None, IGNORE=ignore_index is not None,
                  ENTROPY=ent is not None)
    ii = 0 if ignore_index is None else int(ignore_index)
    _forward_kernel[(n, parts)](
        logits, lab, lp_buf, ent_buf, m, log_s, pm, ps, pt,
        vocab, chunk, min(chunk, vocab), d1, d2, *xs, logits.stride(-1), *ls, t_hi, t_lo, ii,
        BLOCK=block, SPLIT=split, num_warps=_num_warps(block), enable_fp_fusion=True, **common,
    )
    if split:
        _combine_kernel[(n,)](
            logits, lab, lp_buf, ent_buf, m, log_s, pm, ps, pt,
            parts, d1, d2, *xs, logits.stride(-1), *ls, t_hi, t_lo, ii,
            PARTS=max(16, triton.next_power_of_2(parts)), num_warps=1, enable_fp_fusion=True, **common,
        )


def _non_overlapping(t: torch.Tensor) -> bool:
    """True when no two elements of ``t`` share memory (so it can take its gradient in place)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return False
        span += stride * (size - 1)
    return True


def _backward(logits, labels, g_lp, g_ent, ent, m, log_s, temperature, ignore_index, inplace):
    if inplace and _non_overlapping(logits):
        grad = logits.detach()  # the same memory, without the logits' autograd history
    else:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if grad.numel() == 0:
        return grad
    acc = m.dtype
    # Upstream gradients may be broadcast views (stride 0, as from .sum()): the kernel reads flat rows.
    g_lp = None if g_lp is None else g_lp.to(acc).contiguous().view(-1)
    g_ent = None if g_ent is None else g_ent.to(acc).contiguous().view(-1)
    with _on(logits.device):
        _launch_backward(logits, grad, labels, g_lp, g_ent, None if ent is None else ent.reshape(-1),
                         m, log_s, temperature, ignore_index)
    if grad.data_ptr() == logits.data_ptr() and hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(logits)  # its values are gone: stale readers must fail
    return grad


def _launch_backward(logits, grad, labels, g_lp, g_ent, ent, m, log_s, temperature, ignore_index):
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    label_strides = labels.stride() if labels is not None else (0,) * len(lead)
    geometry = _geometry(lead, logits.stride()[:-1], grad.stride()[:-1], label_strides)
    if geometry is None:
        rows = math.prod(lead[1:])
        for i in range(lead[0]):
            sl = slice(i * rows, (i + 1) * rows)
            _launch_backward(
                logits[i], grad[i], None if labels is None else labels[i],
                None if g_lp is None else g_lp[sl], None if g_ent is None else g_ent[sl],
                None if ent is None else ent[sl], m[sl], log_s[sl], temperature, ignore_index)
        return
    d1, d2, (xs, gs, ls) = geometry
    n = math.prod(lead)
    block = min(_block(vocab, logits.dtype), 4096)
    t_hi, t_lo = _split_temperature(temperature)
    _backward_kernel[(n, triton.cdiv(vocab, block))](
        logits, grad, labels if labels is not None else m,
        g_lp if g_lp is not None else m, g_ent if g_ent is not None else m,
        ent if ent is not None else m, m, log_s,
        vocab, d1, d2, *xs, logits.stride(-1), *gs, grad.stride(-1), *ls,
        t_hi, t_lo, 0 if ignore_index is None else int(ignore_index),
        BLOCK=block, ACC=_TL[m.dtype], IGNORE=ignore_index is not None,
        GRAD_LP=g_lp is not None, GRAD_ENT=g_ent is not None, num_warps=_num_warps(block),
        enable_fp_fusion=True,
    )


# ---------------------------------------------------------------------------------------- autograd
class _LogprobsEntropy(torch.autograd.Function):
    """Differentiable (logprobs, entropy); either may be skipped (``None``)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, inplace, want_lp, want_ent):
        lp, ent, m, log_s = _forward(logits, labels, temperature, ignore_index, want_lp, want_ent)
        ctx.save_for_backward(logits, labels, ent, m, log_s)
        ctx.options = (temperature, ignore_index, inplace)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, labels, ent, m, log_s = ctx.saved_tensors
        temperature, ignore_index, inplace = ctx.options
        grad = None
        if ctx.needs_input_grad[0] and (g_lp is not None or g_ent is not None):
            grad = _backward(logits, labels, g_lp, g_ent, ent if g_ent is not None else None,
                             m, log_s, temperature, ignore_index, inplace)
        return grad, None, None, None, None, None, None


def _run(logits, labels, temperature, ignore_index, inplace, want_lp, want_ent):
    if ignore_index is not None and not -2**63 <= ignore_index < 2**63:
        ignore_index = None  # no int64 label can equal it
    if logits.requires_grad and torch.is_grad_enabled():
        return _LogprobsEntropy.apply(logits, labels, temperature, ignore_index, inplace, want_lp, want_ent)
    lp, ent, _, _ = _forward(logits, labels, temperature, ignore_index, want_lp, want_ent)
    return lp, ent


def logprobs(logits, labels, temperature: float, ignore_index: Optional[int], inplace: bool):
    return _run(logits, labels, temperature, ignore_index, inplace, True, False)[0]


def entropy(logits, temperature: float):
    return _run(logits, None, temperature, None, False, False, True)[1]


def logprobs_and_entropy(logits, labels, temperature: float, ignore_index: Optional[int], inplace: bool):
    return _run(logits, labels, temperature, ignore_index, inplace, True, True)
