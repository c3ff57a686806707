"""The kernels of the ``compiled`` backend as plain functions of a 2-D (or 3-D) block of logits,
and the inductor options they are compiled with: what :mod:`._kernels` compiles and :mod:`._aot`
exports into prebuilt packages (whose key hashes this module's source). Imports nothing of the
backend, so that both can import it."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

# split_reductions off: a row is reduced inside one program, so that its result never depends on
# the batch around it, on CUDA as on CPU. cpp.dynamic_threads on: a CPU kernel always has a parallel
# loop and lets OpenMP size it at run time; otherwise a kernel first compiled for a few rows (in this
# process or, through inductor's on-disk cache, in another) stays single-threaded for any size.
INDUCTOR_OPTIONS = {"split_reductions": False, "cpp.dynamic_threads": True}

# --------------------------------------------------------------------------- kernels (compiled)
# A row is scaled as a = (x - max(x)) * k with k = log2(e) / t, and exponentiated with exp2, which
# inductor's CPU code computes faster than exp (docs/backends/compiled.md has the numbers). max(x / t) is
# max(x) / t, so the max pass reads the logits unscaled; subtracting the max before scaling keeps
# a row of large logits (1e4) accurate, and a log-probability (x[label] - max) / t - log(sum) never
# subtracts two large numbers.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _fwd_logprobs(x, idx, k: float):
    """Row max of x, sum of exp2(a), and the label's logit."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    s = torch.exp2((xf - m) * k).sum(-1, keepdim=True)
    return m, s, x.gather(-1, idx)


def _fwd_entropy(x, idx, k: float):
    """As :func:`_fwd_logprobs`, plus the sum of -a * exp2(a) (0 where x is -inf)."""
    xf = _upcast(x)
    m = xf.amax(-1, keepdim=True)
    a = (xf - m) * k
    e = torch.exp2(a)
    s = e.sum(-1, keepdim=True)
    u = torch.where(torch.isneginf(xf), 0.0, -e * a).sum(-1, keepdim=True)
    return m, s, u, x.gather(-1, idx)


def _softcap(xf, cap: float):
    """``cap * tanh(xf / cap)``; -inf stays -inf (a masked token stays masked)."""
    return torch.where(torch.isneginf(xf), xf, torch.tanh(xf / cap) * cap)


def _fwd_logprobs_softcap(x, idx, k: float, cap: float):
    """:func:`_fwd_logprobs` of the softcapped logits (the label's logit softcapped, in fp32)."""
    xf = _softcap(_upcast(x), cap)
    m = xf.amax(-1, keepdim=True)
    s = torch.exp2((xf - m) * k).sum(-1, keepdim=True)
    return m, s, _softcap(_upcast(x.gather(-1, idx)), cap)


def _fwd_entropy_softcap(x, idx, k: float, cap: float):
    xf = _softcap(_upcast(x), cap)
    m = xf.amax(-1, keepdim=True)
    a = (xf - m) * k
    e = torch.exp2(a)
    s = e.sum(-1, keepdim=True)
    u = torch.where(torch.isneginf(xf), 0.0, -e * a).sum(-1, keepdim=True)
    return m, s, u, _softcap(_upcast(x.gather(-1, idx)), cap)


def _stats_math(x, idx, k: float, cap: Optional[float] = None):
    """:func:`_fwd_entropy` (``cap``: :func:`_fwd_entropy_softcap`), the same expressions, plus in the
    same pass the row's sum of the (softcapped) logits (for the mean), the sum of exp2(2 a) (the sum
    of squared probabilities times s**2), and for ``is_argmax``, from the logits before any softcap
    (softcap and temperature are increasing, so their argmax is that of z, without the ties their
    rounding could make): the row's max, the label's value and how many columns hold that value
    (a count against a per-row value is far cheaper here than a first-index reduction: the label is
    the first maximum where it is at the max and alone there; a tie is decided by the caller). The
    count is an int32 sum: a float one costs inductor's cascade summation, 5% of the kernel."""
    raw = _upcast(x)
    xf = raw if cap is None else _softcap(raw, cap)
    m = xf.amax(-1, keepdim=True)
    top = m if cap is None else raw.amax(-1, keepdim=True)
    at = raw.gather(-1, idx)
    same = (raw == at).sum(-1, keepdim=True, dtype=torch.int32)
    a = (xf - m) * k
    e = torch.exp2(a)
    s = e.sum(-1, keepdim=True)
    u = torch.where(torch.isneginf(xf), 0.0, -e * a).sum(-1, keepdim=True)
    total = xf.sum(-1, keepdim=True)
    q = (e * e).sum(-1, keepdim=True)
    picked = x.gather(-1, idx) if cap is None else _softcap(_upcast(x.gather(-1, idx)), cap)
    return m, s, u, picked, total, q, top, at, same


def _fwd_stats(x, idx, k: float):
    """token_stats' forward: see :func:`_stats_math`."""
    return _stats_math(x, idx, k)


def _fwd_stats_softcap(x, idx, k: float, cap: float):
    return _stats_math(x, idx, k, cap)


def _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: Optional[float] = None):
    """d/dx of g_lp * logp[idx] + g_ent * entropy, in x's dtype (g_lp is 0 where ignored). The terms
    of an op's missing output are skipped (``g_lp`` or ``g_ent`` None): lean for ``logprobs``. With
    ``cap``, of the softcapped logits: the gradient of z = cap * tanh(x / cap) times 1 - tanh**2."""
    xf = _upcast(x)
    if cap is not None:
        t = torch.tanh(xf / cap)
        dz = torch.where(torch.isneginf(xf), 0.0, 1.0 - t * t)
        xf = torch.where(torch.isneginf(xf), xf, t * cap)
    log2p = (xf - m) * k - log2_s
    p = torch.exp2(log2p)
    grad = 0.0
    if g_lp is not None:
        hit = torch.arange(x.shape[-1], device=x.device) == idx
        grad = torch.where(hit, g_lp, 0.0) - g_lp * p
    if g_ent is not None:
        grad = grad - g_ent * torch.where(torch.isneginf(xf), 0.0, p * (log2p * LN2 + h))
    if cap is not None:
        grad = grad * dz
    return (grad * inv_t).to(x.dtype)


# kit.QUANTUM_BITS and kit.PART_CONSTANTS, written out: this module's source is the prebuilt packages'
# key (tests/test_compiled.py checks that they are the kit's). The kernels write them (and log2 e) as
# literals: a module-level float is an input of the compiled graph (dynamo does not specialise
# floats), and the extra reads make inductor store the parts in buffers of their own, a second loop
# over each row at half the vector width.
_QUANTUM = float(2 ** 36)
_PARTS = (1.5 * 2.0 ** 11, 1.5 * 2.0 ** -1, 1.5 * 2.0 ** -13)


def _part_sums(x) -> tuple:
    """``kit.exact_sum`` over the last dim of x, kept dim, as the sums of its parts: for float32
    terms, the three float32 parts of ``kit.exact_parts`` (constants ``_PARTS``), each summed in
    float32 without rounding (twice as fast as float64 adds on a CPU; the same bits); float64 terms
    rounded to multiples of ``1 / _QUANTUM`` and added as they are (one part). A kernel returns the
    parts as they are and :func:`_add_parts` adds them outside it: adding them inside is a pass of its
    own over the rows, which inductor does not fuse with the reduction, so that the block would be
    read twice from memory."""
    if x.dtype == torch.float64:
        return (torch.round(x * 68719476736.0).sum(-1, keepdim=True) * 1.4551915228366852e-11,)
    hi = (x + 3072.0) - 3072.0
    r = x - hi
    mid = (r + 0.75) - 0.75
    lo = ((r - mid) + 0.00018310546875) - 0.00018310546875
    return hi.sum(-1, keepdim=True), mid.sum(-1, keepdim=True), lo.sum(-1, keepdim=True)


def _add_parts(parts) -> torch.Tensor:
    """The float64 sum of :func:`_part_sums`' parts: exact, so the same bits in any order."""
    total = parts[0].to(torch.float64)
    for part in parts[1:]:
        total = total + part.to(torch.float64)
    return total


def _exact(x):
    """``kit.exact_sum`` over the last dim of x, kept dim (:func:`_part_sums`, added)."""
    return _add_parts(_part_sums(x))


def parts_of(dtype: torch.dtype) -> int:
    """How many parts :func:`_part_sums` gives for logits of ``dtype``."""
    return 1 if dtype == torch.float64 else len(_PARTS)


def _tile_sums(x, inv_t: float, m, with_entropy: bool) -> tuple:
    """The parts of the exact sums of a block against its max ``m`` (rows, 1): of e = exp(z - m),
    then with ``with_entropy`` of e * (z - m) (0 where z is -inf). ``e`` is ``exp2((z - m) * log2 e)``:
    inductor's CPU code realises a reused ``exp`` as a buffer of float32, which halves the vector
    width of the whole reduction (16 lanes where bfloat16 loads give 32); ``exp2`` stays inlined."""
    d = _upcast(x) * inv_t - torch.where(m == float("-inf"), 0.0, m)
    e = torch.exp2(d * 1.4426950408889634)  # LOG2E
    if not with_entropy:
        return _part_sums(e)
    return _part_sums(e) + _part_sums(torch.where(e == 0, 0.0, e * d))


def _tile_stats(x, inv_t: float):
    """Per row of a (rows, width) block of one grid tile (or a piece of it): with z = x * inv_t, the
    max of z and the parts of the exact sum of e = exp(z - max) (0 for a tile of nothing but -inf)."""
    m = (_upcast(x) * inv_t).amax(-1, keepdim=True)
    return (m,) + _tile_sums(x, inv_t, m, False)


def _tile_stats_entropy(x, inv_t: float):
    """As :func:`_tile_stats`, plus the parts of the exact sum of e * (z - max) (0 where z is -inf)."""
    m = (_upcast(x) * inv_t).amax(-1, keepdim=True)
    return (m,) + _tile_sums(x, inv_t, m, True)


def _tile_stats_ref(x, inv_t: float, ref):
    """:func:`_tile_stats` against at least ``ref`` (rows, 1): a piece of a tile two shards share,
    measured against the whole tile's max (a kernel of its own: the common call reads no ``ref``).
    ``ref`` joins the max's reduction elementwise (the same bits: a max is exact): a maximum after
    the reduction made inductor write the max out and read the block again for the sums."""
    m = torch.maximum(_upcast(x) * inv_t, ref).amax(-1, keepdim=True)
    return (m,) + _tile_sums(x, inv_t, m, False)


def _tile_stats_entropy_ref(x, inv_t: float, ref):
    """:func:`_tile_stats_entropy` against at least ``ref`` (see :func:`_tile_stats_ref`)."""
    m = torch.maximum(_upcast(x) * inv_t, ref).amax(-1, keepdim=True)
    return (m,) + _tile_sums(x, inv_t, m, True)


def _bwd(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float):
    return _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t)


def _bwd_inplace(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float):
    x.copy_(_grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t))


def _bwd_softcap(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: float):
    return _grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t, cap)


def _bwd_inplace_softcap(x, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: float):
    x.copy_(_grad_math(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t, cap))


# The row kernels of a call with skipped rows (ignored labels, zero upstream gradients): the kernels
# above on the rows ``index`` of x, the gather fused into their loads (and, backward, the scatter into
# their stores), so that no copy of the active rows is made. Per row the same code as over every row:
# an active row's results are bitwise those of the call over every row.
def _fwd_logprobs_rows(x, index, idx, k: float):
    """:func:`_fwd_logprobs` of the rows ``index`` of x. (None for the softcap: the label's softcapped
    logit, fused so, is not rounded as the kernel over every row rounds it.)"""
    return _fwd_logprobs(x.index_select(0, index), idx, k)


def _bwd_rows(out, x, index, idx, m, log2_s, h, g_lp, g_ent, k: float, inv_t: float, cap: Optional[float] = None):
    """The gradient of the rows ``index`` of x written into those rows of ``out`` (x itself in place)."""
    out.index_copy_(0, index, _grad_math(x.index_select(0, index), idx, m, log2_s, h, g_lp, g_ent, k, inv_t, cap))


KERNELS: Dict[str, Callable] = {
    f.__name__.lstrip("_"): f for f in (_fwd_logprobs, _fwd_entropy, _bwd, _bwd_inplace, _fwd_logprobs_softcap,
                                        _fwd_entropy_softcap, _bwd_softcap, _bwd_inplace_softcap, _fwd_stats,
                                        _fwd_stats_softcap, _tile_stats,
                                        _tile_stats_entropy, _tile_stats_ref, _tile_stats_entropy_ref,
                                        _fwd_logprobs_rows, _bwd_rows)
}
