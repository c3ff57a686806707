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
of place or over the logits (``inplace_backward``). A row whose upstream gradients are 0 (an ignored
label) gets zeros without its logits being read. Nothing of size N x V is kept between the passes.
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

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import backward_without_autocast, overlapping, result_dtype, second_order_gradient

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton: the variable is read the same way
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")

# Launch shape: chosen from the vocabulary size and dtype only (never from the number of rows, which
# would break batch invariance). A program takes a tile of ROWS rows x BLOCK columns; ROWS > 1 only
# when the vocabulary is shorter than the widest block (each row is still reduced on its own).
# Tests shrink BLOCK and CHUNK to exercise the loop and the split.
TUNING: dict = {"block": None, "chunk": None, "rows": None, "num_warps": None}
CHUNK = 32768  # vocabulary columns per program in the forward pass
MAX_PARTS = 1024  # most chunks the combine kernel takes in one row
INTERPRETER_TILE = 2**17  # elements per program under the interpreter: it pays per program, and its
# numpy temporaries (a dozen tiles) count in the peak memory the conformance suite measures


def _widest(dtype: torch.dtype) -> int:
    if INTERPRETED:  # the interpreter pays per operation, not per element: one block per chunk
        return CHUNK
    return {torch.float64: 2048, torch.float32: 4096}.get(dtype, 8192)


def _block(vocab: int, dtype: torch.dtype) -> int:
    if TUNING["block"]:
        return int(TUNING["block"])
    return max(16, min(triton.next_power_of_2(max(vocab, 1)), _widest(dtype)))


def _rows(block: int, dtype: torch.dtype) -> int:
    """Rows per program: a power of two filling a tile of the widest block (or, under the
    interpreter, of INTERPRETER_TILE elements)."""
    if TUNING["rows"]:
        return int(TUNING["rows"])
    tile = INTERPRETER_TILE if INTERPRETED else _widest(dtype)
    return max(1, min(256 if INTERPRETED else 16, tile // block))


def _chunk(vocab: int, block: int) -> int:
    chunk = int(TUNING["chunk"] or CHUNK)
    chunk = max(block, chunk - chunk % block)
    while triton.cdiv(vocab, chunk) > MAX_PARTS:
        chunk *= 2
    return chunk


def _num_warps(elements: int) -> int:
    if TUNING["num_warps"]:
        return int(TUNING["num_warps"])
    return max(1, min(16, elements // 512))


# ----------------------------------------------------------------------------------------- kernels
@triton.jit
def _softcap(x, cap):
    """``cap * tanh(x / cap)`` (tanh from one exp, stable for any magnitude); -inf stays -inf."""
    u = x / cap
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0, -t, t)
    return tl.where(x == float("-inf"), x, t * cap)


@triton.jit
def _row_offset(rows, D1, D2, s0, s1, s2):
    """Offsets of rows ``rows`` (linear indices over three leading dims of sizes (., D1, D2))."""
    i2 = rows % D2
    rest = rows // D2
    return (rest // D1) * s0 + (rest % D1) * s1 + i2 * s2


@triton.jit
def _finish(
    rows, live, x_rows, m, s, t, temp, xsv,
    lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, D1, D2, ls0, ls1, ls2, ignore_index, cap,
    ACC: tl.constexpr, LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Write the rows' results from their (m, s, t), and save m and log(s) for the backward."""
    s = tl.where(live, s, 1.0)  # rows past the end: no log(0) to form
    log_s = tl.log(s)
    tl.store(m_ptr + rows, m, mask=live)
    tl.store(ls_ptr + rows, log_s, mask=live)
    if LABELS:
        label = tl.load(lab_ptr + _row_offset(rows, D1, D2, ls0, ls1, ls2), mask=live, other=0).to(tl.int64)
        if IGNORE:
            keep = live & (label != ignore_index)
            x_lab = tl.load(x_rows + label * xsv, mask=keep, other=0.0).to(ACC)
            if SOFTCAP:
                x_lab = _softcap(x_lab, cap)
            x_lab = x_lab / temp
            tl.store(lp_ptr + rows, tl.where(keep, (x_lab - m) - log_s, 0.0), mask=live)
        else:
            x_lab = tl.load(x_rows + label * xsv, mask=live, other=0.0).to(ACC)
            if SOFTCAP:
                x_lab = _softcap(x_lab, cap)
            x_lab = x_lab / temp
            tl.store(lp_ptr + rows, (x_lab - m) - log_s, mask=live)
    if ENTROPY:
        tl.store(ent_ptr + rows, log_s - t / s, mask=live)


@triton.jit
def _forward_kernel(
    x_ptr, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, pm_ptr, ps_ptr, pt_ptr,
    N, V, CHUNK, SPAN, D1, D2, xs0, xs1, xs2, xsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index, cap,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr, SPLIT: tl.constexpr,
    LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr = False,
    zs_ptr=None, q_ptr=None, f_ptr=None, pz_ptr=None, pq_ptr=None, pf_ptr=None, STATS: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < N
    part = tl.program_id(1).to(tl.int64)
    x_rows = x_ptr + _row_offset(rows, D1, D2, xs0, xs1, xs2)
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    lo = part * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    cols = lo + tl.arange(0, BLOCK).to(tl.int64)
    m = tl.full([ROWS], float("-inf"), ACC)
    s = tl.zeros([ROWS], ACC)
    t = tl.zeros([ROWS], ACC)
    # token_stats (STATS): sum z, sum exp(2 (z - m)) (rescaled by alpha**2), the first column at the
    # max (a chunk of nothing but -inf: its first column); defined outside the branch for the loop
    zs = tl.zeros([ROWS], ACC)
    q = tl.zeros([ROWS], ACC)
    first = tl.zeros([ROWS], tl.int64) + lo
    for start in range(0, SPAN, BLOCK):  # SPAN = min(CHUNK, V); the last chunk's tail is masked
        idx = start + cols
        mask = live[:, None] & (idx < hi)[None, :]
        x = tl.load(x_rows[:, None] + (idx * xsv)[None, :], mask=mask, other=float("-inf")).to(ACC)
        if SOFTCAP:
            x = _softcap(x, cap)
        x = x / temp
        m_new = tl.maximum(m, tl.max(x, 1))
        # -inf entries (and a running maximum still at -inf) are replaced by finite stand-ins
        # before any arithmetic, so that no inf - inf or 0 * inf is ever formed; NaN still spreads.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        masked = x == float("-inf")
        d = tl.where(masked, ref[:, None], x) - ref[:, None]
        e = tl.where(masked, 0.0, tl.exp(d))
        fresh = m == float("-inf")  # nothing but -inf so far: s and t are 0
        shift = tl.where(fresh, ref, m) - ref
        alpha = tl.where(fresh, 0.0, tl.exp(shift))
        if ENTROPY:
            t = alpha * (t + shift * s) + tl.sum(e * d, 1)
        if STATS:
            zs += tl.sum(tl.where(mask, x, 0.0), 1)
            q = q * (alpha * alpha) + tl.sum(e * e, 1)
            top = tl.max(x, 1)
            at_top = mask & (x == top[:, None])
            here = tl.min(tl.where(at_top, idx[None, :], V), 1)
            first = tl.where(top > m, here, first)  # a later block's equal maximum comes after
        s = s * alpha + tl.sum(e, 1)
        m = m_new
    if SPLIT:
        at = rows * tl.num_programs(1) + part
        tl.store(pm_ptr + at, m, mask=live)
        tl.store(ps_ptr + at, s, mask=live)
        if ENTROPY:
            tl.store(pt_ptr + at, t, mask=live)
        if STATS:
            tl.store(pz_ptr + at, zs, mask=live)
            tl.store(pq_ptr + at, q, mask=live)
            tl.store(pf_ptr + at, first, mask=live)
    else:
        if STATS:
            tl.store(zs_ptr + rows, zs, mask=live)
            tl.store(q_ptr + rows, q, mask=live)
            tl.store(f_ptr + rows, first, mask=live)
        _finish(rows, live, x_rows, m, s, t, temp, xsv, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr,
                D1, D2, ls0, ls1, ls2, ignore_index, cap, ACC, LABELS, IGNORE, ENTROPY, SOFTCAP)


@triton.jit
def _combine_kernel(
    x_ptr, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr, pm_ptr, ps_ptr, pt_ptr,
    N, n_parts, D1, D2, xs0, xs1, xs2, xsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index, cap,
    ROWS: tl.constexpr, PARTS: tl.constexpr, ACC: tl.constexpr,
    LABELS: tl.constexpr, IGNORE: tl.constexpr, ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr = False,
    zs_ptr=None, q_ptr=None, f_ptr=None, pz_ptr=None, pq_ptr=None, pf_ptr=None, STATS: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < N
    x_rows = x_ptr + _row_offset(rows, D1, D2, xs0, xs1, xs2)
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    k = tl.arange(0, PARTS)
    inb = live[:, None] & (k < n_parts)[None, :]
    at = rows[:, None] * n_parts + k[None, :]
    pm = tl.load(pm_ptr + at, mask=inb, other=float("-inf"))
    ps = tl.load(ps_ptr + at, mask=inb, other=0.0)
    m = tl.max(pm, 1)
    ref = tl.where(m == float("-inf"), 0.0, m)
    empty = pm == float("-inf")  # a chunk of nothing but -inf: its s and t are 0
    shift = tl.where(empty, ref[:, None], pm) - ref[:, None]
    w = tl.where(empty, 0.0, tl.exp(shift))
    s = tl.sum(ps * w, 1)
    t = tl.zeros([ROWS], ACC)
    if ENTROPY:
        pt = tl.load(pt_ptr + at, mask=inb, other=0.0)
        t = tl.sum(w * (pt + shift * ps), 1)
    if STATS:
        tl.store(zs_ptr + rows, tl.sum(tl.load(pz_ptr + at, mask=inb, other=0.0), 1), mask=live)
        tl.store(q_ptr + rows, tl.sum(tl.load(pq_ptr + at, mask=inb, other=0.0) * (w * w), 1), mask=live)
        pf = tl.load(pf_ptr + at, mask=inb, other=0)
        big = tl.max(tl.where(inb, pf, 0), 1) + 1
        tl.store(f_ptr + rows, tl.min(tl.where(inb & (pm == m[:, None]), pf, big[:, None]), 1), mask=live)
    _finish(rows, live, x_rows, m, s, t, temp, xsv, lab_ptr, lp_ptr, ent_ptr, m_ptr, ls_ptr,
            D1, D2, ls0, ls1, ls2, ignore_index, cap, ACC, LABELS, IGNORE, ENTROPY, SOFTCAP)


@triton.jit
def _backward_kernel(
    x_ptr, g_ptr, lab_ptr, glp_ptr, gent_ptr, ent_ptr, m_ptr, ls_ptr,
    N, V, D1, D2, xs0, xs1, xs2, xsv, gs0, gs1, gs2, gsv, ls0, ls1, ls2,
    t_hi, t_lo, ignore_index, cap,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr, IGNORE: tl.constexpr,
    GRAD_LP: tl.constexpr, GRAD_ENT: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = rows < N
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = live[:, None] & (cols < V)[None, :]
    temp = tl.cast(t_hi, ACC) + tl.cast(t_lo, ACC)
    # A row whose upstream gradients are all 0 (an ignored label, a GRPO prompt row) is not read: its
    # gradient is exactly 0 (also where its logits are NaN), written without loading them.
    active = rows < 0  # none yet
    if GRAD_LP:
        g = tl.load(glp_ptr + rows, mask=live, other=0.0).to(ACC)
        label = tl.load(lab_ptr + _row_offset(rows, D1, D2, ls0, ls1, ls2), mask=live, other=0).to(tl.int64)
        if IGNORE:
            g = tl.where(label == ignore_index, 0.0, g)
        active = active | (g != 0.0)
    if GRAD_ENT:
        g_ent = tl.load(gent_ptr + rows, mask=live, other=0.0).to(ACC)
        active = active | (g_ent != 0.0)
    x_rows = x_ptr + _row_offset(rows, D1, D2, xs0, xs1, xs2)
    x = tl.load(x_rows[:, None] + (cols * xsv)[None, :], mask=inb & active[:, None], other=float("-inf")).to(ACC)
    raw = x
    if SOFTCAP:
        x = _softcap(x, cap)
    x = x / temp
    masked = x == float("-inf")
    m = tl.load(m_ptr + rows, mask=active, other=0.0)
    log_s = tl.load(ls_ptr + rows, mask=active, other=0.0)
    logp = (tl.where(masked, 0.0, x) - m[:, None]) - log_s[:, None]
    p = tl.where(masked, 0.0, tl.exp(logp))
    grad = tl.zeros([ROWS, BLOCK], ACC)
    if GRAD_LP:
        grad = g[:, None] * (tl.where(cols[None, :] == label[:, None], 1.0, 0.0) - p)
    if GRAD_ENT:
        h = tl.load(ent_ptr + rows, mask=active, other=0.0)
        grad = grad - g_ent[:, None] * (p * (logp + h[:, None]))
    grad = tl.where(active[:, None], grad, 0.0)
    grad = grad / temp
    if SOFTCAP:  # d softcap(x) / dx = 1 - tanh(x / cap)**2, 0 at -inf
        tanh = x * temp / cap
        grad = grad * tl.where(raw == float("-inf"), 0.0, 1.0 - tanh * tanh)
    out = g_ptr + _row_offset(rows, D1, D2, gs0, gs1, gs2)
    tl.store(out[:, None] + (cols * gsv)[None, :], grad.to(g_ptr.dtype.element_ty), mask=inb)


# ------------------------------------------------------------------------------------------ launch
_acc = result_dtype

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


def _forward(logits, labels, temperature, ignore_index, want_lp, want_ent, softcap=None, stats=None):
    """(logprobs or None, entropy or None, m, log_s): m and log_s are flat per-row buffers. ``stats``:
    token_stats' flat per-row buffers (sum z, sum exp(2 (z - m)), the first column at the max),
    filled in the same pass."""
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
        _launch_forward(logits, labels if want_lp else None, lp, ent, m, log_s, temperature, ignore_index, softcap,
                        stats)
    return lp, ent, m, log_s


def _launch_forward(logits, labels, lp, ent, m, log_s, temperature, ignore_index, softcap=None, stats=None):
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
                m[sl], log_s[sl], temperature, ignore_index, softcap,
                None if stats is None else tuple(b[sl] for b in stats))
        return
    d1, d2, (xs, ls) = geometry
    n = math.prod(lead)
    acc = m.dtype
    block = _block(vocab, logits.dtype)
    rows = _rows(block, logits.dtype)
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
    extra = {}
    if stats is not None:
        zs, q, first = stats
        extra = dict(zs_ptr=zs, q_ptr=q, f_ptr=first, pz_ptr=zs, pq_ptr=q, pf_ptr=first, STATS=True)
        if split:
            extra.update(pz_ptr=torch.empty_like(pm), pq_ptr=torch.empty_like(pm),
                         pf_ptr=torch.empty(n * parts, dtype=torch.int64, device=logits.device))
    lab = labels if labels is not None else m
    lp_buf = lp if lp is not None else m
    ent_buf = ent if ent is not None else m
    common = dict(ACC=_TL[acc], LABELS=labels is not None, IGNORE=ignore_index is not None,
                  ENTROPY=ent is not None, SOFTCAP=softcap is not None)
    cap = 1.0 if softcap is None else float(softcap)
    ii = 0 if ignore_index is None else int(ignore_index)
    _forward_kernel[(triton.cdiv(n, rows), parts)](
        logits, lab, lp_buf, ent_buf, m, log_s, pm, ps, pt,
        n, vocab, chunk, min(chunk, vocab), d1, d2, *xs, logits.stride(-1), *ls, t_hi, t_lo, ii, cap,
        ROWS=rows, BLOCK=block, SPLIT=split, num_warps=_num_warps(rows * block), enable_fp_fusion=True,
        **common, **extra,
    )
    if split:
        padded = max(16, triton.next_power_of_2(parts))
        crows = max(1, min(256, (INTERPRETER_TILE if INTERPRETED else 4096) // padded))
        _combine_kernel[(triton.cdiv(n, crows),)](
            logits, lab, lp_buf, ent_buf, m, log_s, pm, ps, pt,
            n, parts, d1, d2, *xs, logits.stride(-1), *ls, t_hi, t_lo, ii, cap,
            ROWS=crows, PARTS=padded, num_warps=_num_warps(crows * padded), enable_fp_fusion=True, **common,
            **extra,
        )


def _backward(logits, labels, g_lp, g_ent, ent, m, log_s, temperature, ignore_index, inplace, softcap=None):
    if inplace and not overlapping(logits):
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
                         m, log_s, temperature, ignore_index, softcap)
    if grad.data_ptr() == logits.data_ptr() and hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(logits)  # its values are gone: stale readers must fail
    return grad


def _launch_backward(logits, grad, labels, g_lp, g_ent, ent, m, log_s, temperature, ignore_index, softcap=None):
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
                None if ent is None else ent[sl], m[sl], log_s[sl], temperature, ignore_index, softcap)
        return
    d1, d2, (xs, gs, ls) = geometry
    n = math.prod(lead)
    block = _block(vocab, logits.dtype) if INTERPRETED else min(_block(vocab, logits.dtype), 4096)
    rows = _rows(block, logits.dtype)
    t_hi, t_lo = _split_temperature(temperature)
    _backward_kernel[(triton.cdiv(n, rows), triton.cdiv(vocab, block))](
        logits, grad, labels if labels is not None else m,
        g_lp if g_lp is not None else m, g_ent if g_ent is not None else m,
        ent if ent is not None else m, m, log_s,
        n, vocab, d1, d2, *xs, logits.stride(-1), *gs, grad.stride(-1), *ls,
        t_hi, t_lo, 0 if ignore_index is None else int(ignore_index), 1.0 if softcap is None else float(softcap),
        ROWS=rows, BLOCK=block, ACC=_TL[m.dtype], IGNORE=ignore_index is not None,
        GRAD_LP=g_lp is not None, GRAD_ENT=g_ent is not None, SOFTCAP=softcap is not None,
        num_warps=_num_warps(rows * block), enable_fp_fusion=True,
    )


# ---------------------------------------------------------------------------------------- autograd
class _LogprobsEntropy(torch.autograd.Function):
    """Differentiable (logprobs, entropy); either may be skipped (``None``)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, inplace, want_lp, want_ent, softcap):
        lp, ent, m, log_s = _forward(logits, labels, temperature, ignore_index, want_lp, want_ent, softcap)
        ctx.save_for_backward(logits, labels, ent, m, log_s)
        ctx.options = (temperature, ignore_index, inplace, softcap)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @backward_without_autocast
    def backward(ctx, g_lp, g_ent):
        logits, labels, ent, m, log_s = ctx.saved_tensors
        temperature, ignore_index, inplace, softcap = ctx.options
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            def outputs():  # the reference formulas in the result dtype, differentiable
                kw = dict(temperature=temperature, softcap=softcap, want_entropy=True)
                if labels is None:
                    return None, kit.reference_outputs(logits, None, ignore_index=None, want_logprobs=False, **kw)
                return kit.reference_outputs(logits, labels, ignore_index=ignore_index, want_logprobs=True, **kw)

            return second_order_gradient(outputs, (logits,), (g_lp, g_ent)) + (None,) * 7
        grad = None
        if ctx.needs_input_grad[0] and (g_lp is not None or g_ent is not None):
            grad = _backward(logits, labels, g_lp, g_ent, ent if g_ent is not None else None,
                             m, log_s, temperature, ignore_index, inplace, softcap)
        return grad, None, None, None, None, None, None, None


def _run(logits, labels, temperature, ignore_index, inplace, want_lp, want_ent, softcap=None):
    if ignore_index is not None and not -2**63 <= ignore_index < 2**63:
        ignore_index = None  # no int64 label can equal it
    if logits.requires_grad and torch.is_grad_enabled():
        return _LogprobsEntropy.apply(logits, labels, temperature, ignore_index, inplace, want_lp, want_ent, softcap)
    lp, ent, _, _ = _forward(logits, labels, temperature, ignore_index, want_lp, want_ent, softcap)
    return lp, ent


def logprobs(logits, labels, temperature: float, ignore_index: Optional[int], inplace: bool,
             softcap: Optional[float] = None):
    return _run(logits, labels, temperature, ignore_index, inplace, True, False, softcap)[0]


def entropy(logits, temperature: float, softcap: Optional[float] = None):
    return _run(logits, None, temperature, None, False, False, True, softcap)[1]


def logprobs_and_entropy(logits, labels, temperature: float, ignore_index: Optional[int], inplace: bool,
                         softcap: Optional[float] = None):
    return _run(logits, labels, temperature, ignore_index, inplace, True, True, softcap)


# ------------------------------------------------------------------------------------- token_stats
FIELDS = lr.TokenStats._fields
#: The fields only the forward kernel's STATS branch computes.
EXTRA = frozenset({"log_sum_p2", "mean_logit", "is_argmax"})


def _stats_forward(logits, labels, temperature, ignore_index, want, softcap):
    """(fields by name, flat, those asked; what the backward needs: ent, m, log_s), one forward pass:
    logprobs and entropy as the ops' kernel computes them (STATS adds independent sums only)."""
    want_lp, want_ent = kit.stats_asked(want)
    n = math.prod(logits.shape[:-1])
    acc, dev = _acc(logits.dtype), logits.device
    stats = None
    if want & EXTRA and logits.shape[-1]:
        stats = (torch.empty(n, dtype=acc, device=dev), torch.empty(n, dtype=acc, device=dev),
                 torch.empty(n, dtype=torch.int64, device=dev))
    # the labels reach the kernel only for the log-probabilities; is_argmax compares here
    lp, ent, m, log_s = _forward(logits, labels if want_lp else None, temperature, ignore_index, want_lp, want_ent,
                                 softcap, stats)
    out = {"logprobs": None if lp is None else lp.view(-1), "entropy": None if ent is None else ent.view(-1),
           "max_logit": m.clone()}
    if stats is not None:
        zs, q, first = stats
        out["mean_logit"] = zs / logits.shape[-1]
        out["log_sum_p2"] = q.log() - 2.0 * log_s
        if labels is not None:
            flat = labels.reshape(-1).to(torch.int64)
            top = first == flat
            out["is_argmax"] = top if ignore_index is None else top & (flat != ignore_index)
    return kit.asked_stats(out, want), (ent, m, log_s)


def _shaped(named, labels, lead):
    return tuple(None if n not in named else named[n].view(labels.shape if n in kit.LABEL_STATS else lead)
                 for n in FIELDS)


class _TokenStats(torch.autograd.Function):
    """token_stats' eight fields (None where not asked); backward through the ops' gradient kernel
    with the summed upstream gradients (without truncation the raw fields are the processed ones)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, want, softcap):
        named, (ent, m, log_s) = _stats_forward(logits, labels, temperature, ignore_index, want, softcap)
        ctx.save_for_backward(logits, labels, ent, m, log_s)
        ctx.options = (temperature, ignore_index, softcap)
        ctx.set_materialize_grads(False)
        outs = _shaped(named, labels, logits.shape[:-1])
        ctx.mark_non_differentiable(*kit.fixed_stats(outs))
        return outs

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        logits, labels, ent, m, log_s = ctx.saved_tensors
        temperature, ignore_index, softcap = ctx.options
        g_lp, g_ent = kit.stats_gradients(grads)
        if g_lp is None and g_ent is None:
            return (None,) * 6
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            def outputs():
                kw = dict(temperature=temperature, softcap=softcap, want_entropy=True)
                if labels is None:
                    return None, kit.reference_outputs(logits, None, ignore_index=None, want_logprobs=False, **kw)
                return kit.reference_outputs(logits, labels, ignore_index=ignore_index, want_logprobs=True, **kw)

            return second_order_gradient(outputs, (logits,), (g_lp, g_ent)) + (None,) * 5
        grad = _backward(logits, labels if g_lp is not None else None, g_lp, g_ent, ent if g_ent is not None else None,
                         m, log_s, temperature, ignore_index, False, softcap)
        return (grad,) + (None,) * 5


def token_stats(logits, labels, outputs, temperature: float, ignore_index: Optional[int],
                softcap: Optional[float] = None) -> "lr.TokenStats":
    """triton's token_stats over logits: one forward pass of the ops' kernel with its STATS branch."""
    _check_device(logits)
    want = frozenset(outputs) - (kit.LABEL_STATS if labels is None else frozenset())
    if ignore_index is not None and not -2**63 <= ignore_index < 2**63:
        ignore_index = None  # no int64 label can equal it
    if logits.numel() == 0:
        got = kit.reference_function("token_stats")(logits, labels, outputs=tuple(want), temperature=temperature,
                                                    ignore_index=ignore_index, softcap=softcap,
                                                    dtype=result_dtype(logits.dtype))
        return lr.TokenStats(**{k: v for k, v in got.items() if k in want})
    if logits.requires_grad and torch.is_grad_enabled() and want & kit.DIFFERENTIABLE_STATS:
        return lr.TokenStats(*_TokenStats.apply(logits, labels, temperature, ignore_index, want, softcap))
    named, _ = _stats_forward(logits, labels, temperature, ignore_index, want, softcap)
    return lr.TokenStats(*_shaped(named, labels, logits.shape[:-1]))
