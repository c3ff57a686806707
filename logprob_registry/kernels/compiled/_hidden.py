"""``compiled``'s fused op ``logprobs_from_hidden``: log-probabilities (and entropy) of
``hidden @ weight.T + bias`` without forming the ``(N, V)`` logits, one compiled region per tile;
and ``token_stats`` given hidden states over the same tiles (:func:`_fwd_stats_step`: every field
in the one pass, the fused op's expressions for its log-probabilities and entropy).

The logits are formed a tile at a time (a block of tokens against a block of the vocabulary). Per
tile, one function compiled by ``torch.compile`` (inductor) does the matmul and reduces its result
at once: the online log-sum-exp (a running max and a running sum of ``exp2``), for the entropy a
running sum of ``-a * exp2(a)``, and the label's logit. Backward recomputes each tile in a second
compiled function (matmul, then the gradient of the logits of the tile), whose result meets the
weight and hidden in two in-place matmuls; the weight gradient accumulates block by block. No
``(N, V)`` tensor exists in either pass.

- **Precision**: bf16/fp16 inputs are upcast to fp32 one block at a time, outside the compiled
  functions, so every dtype but fp64 shares one compiled kernel and the logits are exact fp32
  products (a bf16 matmul would round them to bf16, ~1e-2 nats). fp64 is computed in fp64.
- **Tiles** (:func:`plan`): ``cols`` vocabulary entries a block, a constant of the device type that
  does not depend on the number of tokens, so that a row's log-sum-exp adds up in the same order
  whatever the batch; ``rows`` tokens a tile (:data:`TILES`).
- **Batch invariance**: on the CPU every tile has at least :data:`MIN_GEMM_ROWS` rows (fewer
  tokens are padded with zero rows, and the last tile borrows rows from the one before rather than
  being short), since the CPU matmul takes another path for a handful of rows; on other devices,
  whose matmul libraries choose kernels by shape, every row tile is padded to the full tile height,
  so that each matmul has one shape. Inductor reduces each row in one program
  (``split_reductions=False``).
- **RL steps**: rows whose label is ``ignore_index`` never reach the tiles (``kit.on_active_rows``;
  not with the entropy, an output of every row). With a frozen weight (and bias) a plain call
  accumulates the hidden gradient in the forward (``fwd_acc_step``: ``softmax @ W`` with online
  rescaling), so that its backward is one scale: two matmuls over the step instead of four
  (docs/fused-linear.md, "RL steps").
- **Compilation**: :data:`KERNELS` (``fwd_step``, ``bwd_step``) are compiled on first use with
  dynamic shapes: one compile per kind of call (compute dtype fp32 or fp64, bias or not, entropy or
  not, softcap or not, ``logits_dtype``), whatever the tokens, vocabulary, hidden size or
  temperature. A failure raises :class:`~._kernels.CompileError` from the forward, so that the
  registry falls back: the backward kernel of the usual kind (gradients through every output the
  call returns) is compiled during the first forward that needs gradients. Another kind (a loss
  that uses only one of logprobs and entropy) compiles in its backward, where no fallback is
  possible: a failure there, or of any backward kernel later, runs the same function eagerly,
  with one warning.
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import (
    MIN_GEMM_ROWS,
    backward_without_autocast,
    first_max,
    label_minus_mean,
    on_active_rows,
    result_dtype,
    second_order_gradient,
)

from ._kernels import INDUCTOR_OPTIONS, LN2, LOG2E, RECOMPILE_LIMIT, CompileError, _notice, compile_error

__all__ = ["KERNELS", "TILES", "Plan", "compile_counts", "logprobs_from_hidden", "plan", "reset", "row_tiles",
           "token_stats", "vocab_blocks"]

#: ``(rows, cols)`` of a tile by device type ("default" for the others). CPU: 4096 x 1024 (16 MiB
#: of fp32): at least as fast as one large matmul, and few enough tiles (32 at 4096 x 32768) that
#: the threads meet at few barriers (1024 x 1024 tiles ran 1.4x slower on 2 busy cores;
#: docs/backends/compiled.md). Accelerators (not measured here): 1024 x 8192, 32 MiB, every row tile
#: padded to 1024 rows.
TILES = {"cpu": (4096, 1024), "default": (1024, 8192)}
#: Bytes of the fp32 copy of a tile of bf16/fp16 hidden rows; rows per tile are capped to fit.
UPCAST_BYTES = 16 << 20
#: Device types whose matmul gives a row the same bits in any tile of at least MIN_GEMM_ROWS rows.
ROW_INVARIANT_MATMUL = frozenset({"cpu"})
_INF = math.inf
#: Inductor options of the fused op's kernels: the backend's, and emulate_precision_casts, without
#: which inductor drops the rounding of ``logits_dtype`` (a cast to bf16 and back inside one kernel).
OPTIONS = {**INDUCTOR_OPTIONS, "emulate_precision_casts": True}


class Plan(NamedTuple):
    """How the ``(N, V)`` logits are cut: ``rows`` tokens by ``cols`` vocabulary entries a tile;
    ``fixed_rows``: every row tile padded to ``rows`` (one matmul shape), else to MIN_GEMM_ROWS."""

    rows: int
    cols: int
    fixed_rows: bool = False


def plan(v: int, h: int, dtype: torch.dtype, device_type: str) -> Plan:
    """The tiles for a vocabulary of ``v``, hidden size ``h`` and input ``dtype`` on ``device_type``;
    never depends on the number of tokens. A bf16/fp16 tile of hidden rows, upcast to fp32, holds
    at most :data:`UPCAST_BYTES`."""
    rows, cols = TILES.get(device_type, TILES["default"])
    if dtype in (torch.float16, torch.bfloat16):
        rows = min(rows, max(MIN_GEMM_ROWS, UPCAST_BYTES // (4 * max(h, 1))))
    return Plan(rows, max(1, min(cols, v)), device_type not in ROW_INVARIANT_MATMUL)


def vocab_blocks(v: int, p: Plan) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each vocabulary block: blocks of ``p.cols``, except that a last block of
    one column starts one column earlier (a dim of size 1 would cost a compile of its own)."""
    bounds = [(v0, min(v, v0 + p.cols)) for v0 in range(0, v, p.cols)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], v - 2), (v - 2, v)]
    return bounds


def row_tiles(n: int, p: Plan) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each row tile of ``n`` rows: tiles of ``p.rows``; unless the tiles have
    fixed rows, a short last tile (fewer than MIN_GEMM_ROWS) starts earlier, taking rows from the
    one before, so that only a call of fewer than MIN_GEMM_ROWS rows needs padding."""
    bounds = [(r0, min(n, r0 + p.rows)) for r0 in range(0, n, p.rows)]
    if not p.fixed_rows and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < MIN_GEMM_ROWS:
        cut = n - MIN_GEMM_ROWS
        bounds[-2:] = [(bounds[-2][0], cut), (cut, n)]
    return bounds


# --------------------------------------------------------------------------- kernels (compiled)
# As in ._kernels: a logit x is scaled as a = (x - max) * k with k = log2(e) / T and exponentiated
# with exp2; the sums are relative to the running max of the unscaled (processed) logits.
def _matmul(h, w, b):
    """The tile's logits as the lm_head gives them: ``h @ w.T + b``."""
    return torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())


def _logits(h, w, b, cap: Optional[float], logits_dtype: Optional[torch.dtype], z=None):
    """The tile's logits, processed as the sampler does before the temperature: rounded to
    ``logits_dtype`` (if given), then softcapped (if ``cap``); and d processed / d logits (None
    without a softcap; the rounding passes the gradient straight through). With ``logits_dtype`` the
    softcap is the engine's three ops, ``z / cap``, ``tanh``, ``* cap``, each rounded to that dtype
    (:func:`logprob_registry.truncation.softcapped`), its derivative taken at the rounded ``z / cap``.
    ``z``: the tile's :func:`_matmul`, if the caller made it already."""
    z = _matmul(h, w, b) if z is None else z

    def rounded(x):
        return x if logits_dtype is None else x.to(logits_dtype).to(h.dtype)

    z = rounded(z)
    if cap is None:
        return z, None
    masked = torch.isneginf(z)
    t = torch.tanh(rounded(z / cap))
    return torch.where(masked, z, rounded(rounded(t) * cap)), torch.where(masked, 0.0, 1.0 - t * t)


def _online(x, local, m, s, u, zl, k: float):
    """The online log-sum-exp of :func:`_fwd_step` over a tile of processed logits ``x``: the new
    ``(m, s, u, zl)`` (``u`` None without entropy), then ``e = exp2(a)`` and ``alpha``, the
    rescaling of the old sums (token_stats' extra running sums use them)."""
    m_new = torch.maximum(m, x.amax(1, keepdim=True))
    base = torch.where(m_new == -_INF, 0.0, m_new)  # rows whose logits are all -inf so far
    a = (x - base) * k
    e = torch.exp2(a)
    d = torch.where(m == -_INF, 0.0, (base - m) * k)  # rescales the old sums (none: m was -inf)
    alpha = torch.exp2(-d)
    s_new = s * alpha + e.sum(1, keepdim=True)
    inside = (local >= 0) & (local < x.shape[1])
    zl_new = torch.where(inside, x.gather(1, local.clamp(0, x.shape[1] - 1)), zl)
    if u is None:
        return (m_new, s_new, None, zl_new), e, alpha
    # -a exp2(a) is 0 where exp2(a) is (a masked logit would give -inf * 0)
    u_new = (u + d * s) * alpha + torch.where(e == 0, 0.0, -a * e).sum(1, keepdim=True)
    return (m_new, s_new, u_new, zl_new), e, alpha


def _fwd_step(h, w, b, local, m, s, u, zl, k: float, cap: Optional[float], logits_dtype: Optional[torch.dtype]):
    """One tile of the forward: the running max ``m`` (of the processed logits), sum ``s`` of
    ``exp2((x - m) k)``, sum ``u`` of ``-a exp2(a)`` (None: no entropy) and label logit ``zl``
    (where ``0 <= local < cols``) of ``h``'s rows, updated with the block ``w`` (and ``b``)."""
    x, _ = _logits(h, w, b, cap, logits_dtype)
    (m_new, s_new, u_new, zl_new), _, _ = _online(x, local, m, s, u, zl, k)
    return (m_new, s_new, zl_new) if u is None else (m_new, s_new, u_new, zl_new)


def _fwd_stats_step(h, w, b, local, m, s, u, zl, zsum, q, top, at, before, k: float, cap: Optional[float]):
    """One tile of token_stats' forward: :func:`_fwd_step` with entropy (the same expressions, so
    its log-probabilities and entropy are the fused op's bits), and in the same pass the running
    sum ``zsum`` of the processed logits (the mean), ``q``, the sum of ``exp2(2 a)`` rescaled by
    ``alpha**2`` as the max moves (the sum of squared probabilities times ``s**2``), and for
    ``is_argmax``, of the logits before any softcap (softcap and temperature are increasing, so their
    argmax is theirs, without the ties rounding could make): the running max ``top``, the label's
    value ``at`` and ``before``, the max of the columns before the label (``kit.first_max``)."""
    z = _matmul(h, w, b)
    x, _ = _logits(h, w, b, cap, None, z)
    (m_new, s_new, u_new, zl_new), e, alpha = _online(x, local, m, s, u, zl, k)
    zsum_new = zsum + x.sum(1, keepdim=True)
    q_new = q * (alpha * alpha) + (e * e).sum(1, keepdim=True)
    cols = z.shape[1]
    top_new = torch.maximum(top, z.amax(1, keepdim=True))
    inside = (local >= 0) & (local < cols)
    at_new = torch.where(inside, z.gather(1, local.clamp(0, cols - 1)), at)
    early = torch.where(torch.arange(cols, device=z.device) < local, z, -_INF).amax(1, keepdim=True)
    before_new = torch.where(local >= cols, top_new, torch.where(inside, torch.maximum(top, early), before))
    return m_new, s_new, u_new, zl_new, zsum_new, q_new, top_new, at_new, before_new


def _fwd_acc_step(h, w, b, local, m, s, zl, k: float):
    """:func:`_fwd_step` of a plain call (no entropy, softcap or ``logits_dtype``) whose hidden
    gradient is accumulated in the forward (a frozen weight): also ``e = exp2((x - m_new) k)``, the
    tile's unnormalised probabilities, and ``alpha``, the rescaling of the old sums, so that the
    caller updates the running ``acc = sum e w`` as ``acc * alpha + e @ w`` (online softmax, as in
    flash attention)."""
    x = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    m_new = torch.maximum(m, x.amax(1, keepdim=True))
    base = torch.where(m_new == -_INF, 0.0, m_new)
    e = torch.exp2((x - base) * k)
    alpha = torch.exp2(-torch.where(m == -_INF, 0.0, (base - m) * k))
    s_new = s * alpha + e.sum(1, keepdim=True)
    inside = (local >= 0) & (local < x.shape[1])
    zl_new = torch.where(inside, x.gather(1, local.clamp(0, x.shape[1] - 1)), zl)
    return m_new, s_new, zl_new, e, alpha


def _bwd_step(h, w, b, local, m, log2_s, ent, g_lp, g_ent, k: float, inv_t: float, cap: Optional[float],
              logits_dtype: Optional[torch.dtype]):
    """The gradient of ``g_lp * logp[label] + g_ent * entropy`` with respect to the tile's logits
    (``m`` the row max, finite; ``log2_s`` the base-2 log-sum; ``ent`` the entropy). The terms of a
    missing output are skipped (``g_lp`` or ``g_ent`` None). A row with ``log2_s = inf`` (padding)
    gets zeros."""
    x, dx = _logits(h, w, b, cap, logits_dtype)
    log2p = (x - m) * k - log2_s
    p = torch.exp2(log2p)
    grad = torch.zeros_like(p)
    if g_lp is not None:
        hit = torch.arange(x.shape[1], device=x.device) == local
        grad = torch.where(hit, g_lp, 0.0) - g_lp * p
    if g_ent is not None:
        grad = grad - g_ent * torch.where(p == 0, 0.0, p * (log2p * LN2 + ent))
    if dx is not None:
        grad = grad * dx
    return grad * inv_t


KERNELS: Dict[str, Callable] = {"fwd_step": _fwd_step, "bwd_step": _bwd_step, "fwd_acc_step": _fwd_acc_step,
                                "fwd_stats_step": _fwd_stats_step}
_compiled: Dict[str, Callable] = {}
_eager: Dict[tuple, str] = {}   # kinds of backward that failed to compile: run eagerly
_warm: set = set()
_lock = threading.RLock()


def _kernel(name: str) -> Callable:
    with _lock:
        if name not in _compiled:
            kwargs = dict(dynamic=True, fullgraph=True, options=dict(OPTIONS))
            if "recompile_limit" in inspect.signature(torch.compile).parameters:
                kwargs["recompile_limit"] = RECOMPILE_LIMIT
            _compiled[name] = torch.compile(KERNELS[name], **kwargs)
        return _compiled[name]


def _run(name: str, *args):
    """Run compiled kernel ``name``; a failure to compile or run becomes a :class:`CompileError`."""
    _notice(f"logprobs_from_hidden {name}", args[0])
    try:
        with torch.no_grad():
            return _kernel(name)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise compile_error(f"its logprobs_from_hidden {name} kernel", args[0], "tiles", exc) from exc


def compile_counts() -> Dict[str, Optional[int]]:
    """How many compiled variants each kernel of the fused op holds (None where torch can't say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return {name: None for name in KERNELS}
    return {name: len(_debug_get_cache_entry_list(f.__code__)) for name, f in KERNELS.items()}


def reset() -> None:
    """Forget the compiled kernels, warm-ups and eager-backward decisions of the fused op."""
    with _lock:
        _compiled.clear()
        _eager.clear()
        _warm.clear()
        for f in KERNELS.values():
            torch._dynamo.reset_code(f.__code__)


# --------------------------------------------------------------------------- the tiled passes
class _Call(NamedTuple):
    """A call's inputs, flattened and resolved: what both passes need."""

    hidden: torch.Tensor            # (N, H), detached
    weight: torch.Tensor            # (V, H) as given, detached
    bias: Optional[torch.Tensor]
    idx: torch.Tensor               # (N, 1) int64, 0 where ignored
    tiles: Plan
    cd: torch.dtype                 # compute dtype
    k: float                        # log2(e) / T
    inv_t: float
    cap: Optional[float]
    logits_dtype: Optional[torch.dtype]

    def kind(self, want_logp: bool, want_entropy: bool) -> tuple:
        """What the backward kernel specialises on besides shapes."""
        return (self.cd, self.hidden.device.type, self.bias is not None, want_logp, want_entropy,
                self.cap is not None, self.logits_dtype)


class _Tile(NamedTuple):
    """Rows ``r0:r1`` of the call, computed as ``rows`` rows (the rest zero padding)."""

    r0: int
    r1: int
    rows: int

    def pad(self, t: Optional[torch.Tensor], value: float = 0.0) -> Optional[torch.Tensor]:
        """Rows ``r0:r1`` of ``t`` (N-sized), padded with ``value`` to ``rows``; no view."""
        if t is None:
            return None
        part = t[self.r0:self.r1].detach()
        short = self.rows - (self.r1 - self.r0)
        if short == 0:
            return part
        return torch.cat([part, part.new_full((short,) + tuple(part.shape[1:]), value)])


def _tiles(n: int, p: Plan) -> List[_Tile]:
    """The row tiles of ``n`` rows: see :func:`row_tiles`; a tile shorter than the matmul needs
    (MIN_GEMM_ROWS, or the full tile height with ``p.fixed_rows``) is padded."""
    least = p.rows if p.fixed_rows else MIN_GEMM_ROWS
    return [_Tile(r0, r1, max(r1 - r0, least)) for r0, r1 in row_tiles(n, p)]


def _block(t: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """``t`` in the compute dtype, contiguous (a copy only if it is not already), and no view of
    another tensor: a compiled kernel would specialise on the size of the base."""
    return t.to(cd).contiguous().detach()


class _Rows:
    """The hidden rows of each tile in the compute dtype: padded tiles copied once per pass, the
    others taken (and, for bf16/fp16, upcast) at each use, so that no fp32 copy of the whole hidden
    exists."""

    def __init__(self, c: _Call, tiles: List[_Tile]) -> None:
        self.c = c
        self.padded = {i: _block(t.pad(c.hidden), c.cd) for i, t in enumerate(tiles) if t.rows > t.r1 - t.r0}
        self.tiles = tiles

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.padded:
            return self.padded[i]
        t = self.tiles[i]
        return _block(self.c.hidden[t.r0:t.r1], self.c.cd)


def _blocks(c: _Call):
    """``(v0, weight block, bias block)`` of each vocabulary block, in the compute dtype."""
    for v0, v1 in vocab_blocks(c.weight.shape[0], c.tiles):
        yield v0, _block(c.weight[v0:v1], c.cd), None if c.bias is None else _block(c.bias[v0:v1], c.cd)


def _forward(c: _Call, entropy: bool, accumulate: bool = False, stats: bool = False):
    """``(m, s, u, zl, acc, extra)`` per row, each ``(N, 1)`` but ``acc``: the max of the processed
    logits, the sum of ``exp2((x - m) k)``, of ``-a exp2(a)`` (None without entropy), the label's
    logit and, with ``accumulate`` (a plain call: :func:`_accumulates`), ``sum exp2((x - m) k) w``
    ``(N, H)`` (else None), so that ``acc / s`` is ``softmax @ weight``: the hidden gradient with a
    frozen weight, formed here with one matmul a tile rather than recomputing the tile in backward.
    ``stats`` (token_stats' tiles, :func:`_fwd_stats_step`; entropy too): ``extra`` is
    ``(zsum, q, top, at, before)``, else ``()``."""
    tiles = _tiles(c.hidden.shape[0], c.tiles)
    rows = _Rows(c, tiles)
    idx = [t.pad(c.idx) for t in tiles]
    opts = dict(device=c.hidden.device, dtype=c.cd)

    def state(t: _Tile) -> tuple:
        def col(value: float = 0.0):
            return torch.full((t.rows, 1), value, **opts)

        first = (col(-_INF), col(), col() if entropy or stats else None, col())
        # zsum, q; the running max before any softcap, the label's value, the max before the label
        return first + ((col(), col(), col(-_INF), col(), col(-_INF)) if stats else ())

    states = [state(t) for t in tiles]
    accs = [torch.zeros(t.rows, c.hidden.shape[1], **opts) for t in tiles] if accumulate else None
    for v0, w, b in _blocks(c):
        for i in range(len(tiles)):
            if accumulate:
                m, s, zl, e, alpha = _run("fwd_acc_step", rows[i], w, b, idx[i] - v0, states[i][0], states[i][1],
                                          states[i][3], c.k)
                accs[i].mul_(alpha).addmm_(e, w)
                states[i] = (m, s, None, zl)
                del e
                continue
            if stats:
                states[i] = _run("fwd_stats_step", rows[i], w, b, idx[i] - v0, *states[i], c.k, c.cap)
                continue
            out = _run("fwd_step", rows[i], w, b, idx[i] - v0, *states[i], c.k, c.cap, c.logits_dtype)
            states[i] = out if entropy else (out[0], out[1], None, out[2])
    found = tuple(None if states[0][j] is None else torch.cat([st[j][: t.r1 - t.r0] for st, t in zip(states, tiles)])
                  for j in range(len(states[0])))
    acc = None if accs is None else torch.cat([a[: t.r1 - t.r0] for a, t in zip(accs, tiles)])
    return found[:4] + (acc, found[4:])


def _accumulates(c: _Call, entropy: bool, need: Tuple[bool, bool, bool]) -> bool:
    """Whether the forward accumulates the hidden gradient (:func:`_forward`): only the hidden
    needs a gradient (a frozen lm_head: LoRA, a reference model), and the call is plain (no entropy,
    softcap or ``logits_dtype``, whose gradients would need more running sums). Then forward and
    backward together cost two ``N x V x H`` matmuls, as the logits path's do, not four."""
    return need[0] and not need[1] and not need[2] and not entropy and c.cap is None and c.logits_dtype is None


def _backward_plan(p: Plan) -> Plan:
    """The backward's tiles: half the forward's rows where a row's matmul bits do not depend on its
    tile (not ``fixed_rows``), so that the one tile of logits' gradients alive beside the weight
    gradient holds 8 MiB rather than 16 on the CPU (an extra peak at most that of torch's chunked
    ``linear_cross_entropy``). A row's hidden gradient still sums the vocabulary blocks in the same
    order; only the weight gradient's sum over row tiles is cut differently (deterministically)."""
    return p if p.fixed_rows else p._replace(rows=max(MIN_GEMM_ROWS, p.rows // 2))


def _backward(c: _Call, m, log2_s, ent, g_lp, g_ent, need) -> tuple:
    """Gradients of hidden, weight and bias (None where not needed): each tile recomputed by the
    compiled ``bwd_step``; its gradient of the logits meets the weight block and the hidden rows in
    two in-place matmuls. ``m``, ``log2_s``, ``ent``, ``g_lp``, ``g_ent``: ``(N, 1)`` or None."""
    need_h, need_w, need_b = need
    n, hdim = c.hidden.shape
    tiles = _tiles(n, _backward_plan(c.tiles))
    rows = _Rows(c, tiles)
    # per tile: label, max, log-sum (inf on padding rows: they get zero gradients), entropy, upstream
    per_tile = [(t.pad(c.idx), t.pad(m), t.pad(log2_s, _INF), t.pad(ent), t.pad(g_lp), t.pad(g_ent)) for t in tiles]
    opts = dict(device=c.hidden.device, dtype=c.cd)
    gh = torch.zeros(n, hdim, **opts) if need_h else None
    gh_tiles = [gh[t.r0:t.r1] if t.rows == t.r1 - t.r0 else torch.zeros(t.rows, hdim, **opts) for t in tiles] \
        if need_h else None
    low_w = c.weight.dtype != c.cd
    gw = torch.zeros(c.weight.shape, device=c.weight.device, dtype=c.weight.dtype) if need_w else None
    gb = torch.zeros(c.weight.shape[0], **opts) if need_b else None
    step = _backward_step(c.kind(g_lp is not None, g_ent is not None))
    for v0, w, b in _blocks(c):
        v1 = v0 + w.shape[0]
        gw_blk = None
        if need_w:
            gw_blk = torch.zeros(w.shape, **opts) if low_w else gw[v0:v1]
        for i in range(len(tiles)):
            idx, m_i, l2s, ent_i, glp, gent = per_tile[i]
            h = rows[i]
            grad = step(h, w, b, idx - v0, m_i, l2s, ent_i, glp, gent, c.k, c.inv_t, c.cap, c.logits_dtype)
            if need_h:
                gh_tiles[i].addmm_(grad, w)
            if need_w:
                gw_blk.addmm_(grad.t(), h)
            if need_b:
                gb[v0:v1] += grad.sum(0)
            del grad
        if need_w and low_w:
            gw[v0:v1].copy_(gw_blk)
    if need_h:
        for t, acc in zip(tiles, gh_tiles):
            if t.rows > t.r1 - t.r0:
                gh[t.r0:t.r1] = acc[: t.r1 - t.r0]
    return gh, gw, gb


def _backward_step(kind: tuple) -> Callable:
    """The backward tile function: compiled, or, for a kind of call whose compile failed after its
    forward warmed it up, the same function run eagerly (one warning per kind and process)."""

    def step(*args):
        if kind not in _eager:
            try:
                return _run("bwd_step", *args)
            except CompileError as exc:
                with _lock:
                    _eager[kind] = str(exc)
                warnings.warn(
                    f"logprob_registry: backend 'compiled': {exc}; this backward of logprobs_from_hidden, "
                    "and later ones of its kind, run the same tile function eagerly for the rest of this process.",
                    lr.BackendFallbackWarning, stacklevel=5)
        with torch.no_grad():
            return _bwd_step(*args)

    return step


def _warm_backward(c: _Call, want_logp: bool, want_entropy: bool) -> None:
    """Compile now, on one small tile, the backward kernel this forward's backward will use, so that
    a failure raises from the forward, where the registry can fall back."""
    kind = c.kind(want_logp, want_entropy)
    if kind in _warm:
        return
    rows, cols, hdim = MIN_GEMM_ROWS, min(2, c.weight.shape[0]), c.hidden.shape[1]
    opts = dict(device=c.hidden.device, dtype=c.cd)

    def col(wanted: bool = True):
        return torch.zeros(rows, 1, **opts) if wanted else None

    b = None if c.bias is None else torch.zeros(cols, **opts)
    _run("bwd_step", torch.zeros(rows, hdim, **opts), torch.zeros(cols, hdim, **opts), b,
         torch.zeros(rows, 1, dtype=torch.int64, device=c.hidden.device), col(), col(), col(want_entropy),
         col(want_logp), col(want_entropy), c.k, c.inv_t, c.cap, c.logits_dtype)
    with _lock:
        _warm.add(kind)


class _Stats(NamedTuple):
    """What backward needs besides the inputs, per row ``(N, 1)``: the max (finite), the base-2
    log-sum, the entropy (its own copy: the caller may overwrite the output), ignored labels."""

    m: torch.Tensor
    log2_s: torch.Tensor
    ent: Optional[torch.Tensor]
    ignored: Optional[torch.Tensor]


def _outputs(c: _Call, ignored: Optional[torch.Tensor], entropy: bool, accumulate: bool = False,
             stats: bool = False):
    """``(logp (N,), entropy (N,) or None, stats, dh, extra)``; ``dh`` (with ``accumulate``, else
    None): ``d logp / d hidden`` per row, ``(W[label] - softmax @ W) / T`` ``(N, H)``: a frozen
    weight's backward is then one scale by the upstream gradient. ``stats``: token_stats' tiles
    (entropy too), ``extra`` its fields ``log_sum_p2``, ``mean_logit``, ``max_logit`` and
    ``is_argmax`` by name (N,), else ``{}``."""
    m, s, u, zl, acc, more = _forward(c, entropy, accumulate, stats)
    dh = None if acc is None else label_minus_mean(acc.div_(s), c.weight, c.idx[:, 0], c.inv_t)
    base = torch.where(m == -_INF, 0.0, m)
    log_s = s.log()
    logp = ((zl - base) * c.inv_t - log_s)[:, 0]
    if ignored is not None:
        logp = logp.masked_fill(ignored, 0.0)
    ent = None if u is None else log_s + u * LN2 / s
    out_ent = None if ent is None else ent[:, 0].clone()
    extra = {}
    if stats:  # log sum q**2 = log sum exp2(2 a) - 2 log s; the argmax from the maxima before any softcap
        zsum, q, top, at, before = (t[:, 0] for t in more)
        first = first_max(at, top, before, c.idx[:, 0])
        extra = {"log_sum_p2": q.log() - 2.0 * log_s[:, 0], "mean_logit": zsum * c.inv_t / c.weight.shape[0],
                 "max_logit": m[:, 0] * c.inv_t, "is_argmax": first if ignored is None else first & ~ignored}
    return logp, out_ent, _Stats(base, log_s * LOG2E, ent, ignored), dh, extra


class _FusedCompiled(torch.autograd.Function):
    """Forward through the compiled forward tiles; backward recomputes them (compiled too)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, c: _Call, ignored, entropy, labels, options):
        accumulate = _accumulates(c, entropy, tuple(ctx.needs_input_grad[:3]))
        logp, ent, stats, dh, _ = _outputs(c, ignored, entropy, accumulate)
        if not accumulate:
            _warm_backward(c, True, entropy)
        _keep(ctx, c, stats, labels, options, hidden, weight, bias, dh)
        return (logp, ent) if entropy else logp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        def outputs(hidden, weight, bias):
            out = kit.reference_function("logprobs_from_hidden")(hidden, weight, ctx.labels, bias=bias,
                                                                 dtype=ctx.call.cd, **ctx.options)
            return out if isinstance(out, tuple) else (out,)

        return _fused_backward(ctx, g_lp, g_ent, outputs)


def _keep(ctx, c: _Call, stats, labels, options: dict, hidden, weight, bias, dh=None) -> None:
    """What both fused Functions' backward reads (:func:`_fused_backward`). ``c`` holds hidden,
    weight and bias detached; saving them too makes autograd check that nobody modified them in
    place before backward."""
    ctx.set_materialize_grads(False)
    ctx.call, ctx.stats, ctx.labels, ctx.options = c, stats, labels, options
    if dh is not None:
        ctx.dh = dh
    ctx.save_for_backward(hidden, weight, bias)


def _fused_backward(ctx, g_lp, g_ent, outputs: Callable) -> tuple:
    """The backward of both fused Functions (8 inputs: hidden, weight, bias, then 5 without
    gradients): the compiled backward tiles; a frozen weight's hidden gradient formed in forward
    (``ctx.dh``) scaled; with create_graph=True, through ``outputs(hidden, weight, bias)`` (the
    reference's differentiable outputs), a gradient autograd can differentiate again."""
    hidden, weight, bias = ctx.saved_tensors
    c, st = ctx.call, ctx.stats
    need = tuple(ctx.needs_input_grad[:3])
    if (g_lp is None and g_ent is None) or not any(need):
        return (None,) * 8
    if torch.is_grad_enabled():
        inputs = tuple(t if n else None for t, n in zip((hidden, weight, bias), need))
        return second_order_gradient(lambda: outputs(hidden, weight, bias), inputs, (g_lp, g_ent)) + (None,) * 5
    with torch.no_grad():
        if getattr(ctx, "dh", None) is not None:  # a frozen weight: the hidden gradient was formed in forward
            return (_scaled(ctx.dh, g_lp, st.ignored, hidden.dtype), None, None) + (None,) * 5
        return _first_order(hidden, bias, c, st, need, g_lp, g_ent) + (None,) * 5


def _scaled(dh: torch.Tensor, g_lp: Optional[torch.Tensor], ignored: Optional[torch.Tensor],
            dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The hidden gradient of a frozen weight's call: ``dh`` scaled by each row's upstream gradient
    (zero on ignored rows)."""
    if g_lp is None:
        return None
    g = g_lp.reshape(-1, 1).to(dh.dtype)
    if ignored is not None:
        g = g.masked_fill(ignored.reshape(-1, 1), 0.0)
    return (dh * g).to(dtype)


def _first_order(hidden, bias, c: _Call, st, need, g_lp, g_ent) -> tuple:
    """The gradients of hidden, weight and bias: the compiled backward tiles."""

    def per_row(g):  # contiguous: an upstream gradient is often expanded (of a sum), stride 0
        return None if g is None else g.reshape(-1, 1).to(c.cd).contiguous()

    a = per_row(g_lp)
    if a is not None and st.ignored is not None:
        a = a.masked_fill(st.ignored.reshape(-1, 1), 0.0)
    e = per_row(g_ent)
    gh, gw, gb = _backward(c, st.m, st.log2_s, st.ent if e is not None else None, a, e, need)
    gh = None if gh is None else gh.to(hidden.dtype)
    gb = None if gb is None else gb.to(bias.dtype)
    return gh, gw, gb


def _make_call(flat, weight, bias, idx, temperature: float, softcap, logits_dtype) -> _Call:
    """The :class:`_Call` of hidden rows ``flat`` ``(N, H)`` and labels ``idx`` ``(N,)`` (0 where ignored)."""
    n, hdim = flat.shape
    tiles = plan(weight.shape[0], hdim, flat.dtype, flat.device.type)
    return _Call(flat.detach(), weight.detach(), None if bias is None else bias.detach(), idx.reshape(n, 1), tiles,
                 result_dtype(flat.dtype), LOG2E / temperature, 1.0 / temperature, softcap, logits_dtype)


def logprobs_from_hidden(hidden, weight, labels, *, bias, temperature, ignore_index, return_entropy,
                         softcap=None, logits_dtype=None):
    """The backend op behind :func:`logprob_registry.logprobs_from_hidden` for ``compiled``
    (inputs validated: one dtype for hidden, weight and bias; labels ``(...)``)."""
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    n = lead.numel()
    if n == 0 or hdim == 0:  # nothing to compile for
        return kit.reference_function("logprobs_from_hidden")(
            hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy, dtype=result_dtype(hidden.dtype), softcap=softcap,
            logits_dtype=logits_dtype)
    flat = hidden.reshape(n, hdim)
    y = labels.reshape(n).long()
    if not return_entropy:  # every row's entropy is an output; without it, only active rows cost
        def active(h, lab):
            return logprobs_from_hidden(h, weight, lab, bias=bias, temperature=temperature, ignore_index=None,
                                        return_entropy=False, softcap=softcap, logits_dtype=logits_dtype)

        out = on_active_rows(active, flat, y, ignore_index)
        if out is not None:
            return out.view(lead)
    ignored = None if ignore_index is None else y == ignore_index
    idx = y if ignored is None else y.masked_fill(ignored, 0)
    c = _make_call(flat, weight, bias, idx, temperature, softcap, logits_dtype)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        options = dict(temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
                       softcap=softcap, logits_dtype=logits_dtype)
        out = _FusedCompiled.apply(flat, weight, bias, c, ignored, return_entropy, y, options)
    else:
        logp, ent, _, _, _ = _outputs(c, ignored, return_entropy)
        out = (logp, ent) if return_entropy else logp
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)


# --------------------------------------------------------------------------- token_stats
FIELDS = lr.TokenStats._fields


def _stats_fields(logp, ent, extra: dict, want: frozenset) -> dict:
    """The fields asked, flat per row: logprobs and entropy as the fused op computes them (the same
    tensors), the raw ones their copies."""
    return kit.asked_stats(dict(extra, logprobs=logp, entropy=ent), want)


class _FusedStats(torch.autograd.Function):
    """token_stats' fields (all eight, None where not asked) through :func:`_fwd_stats_step`'s tiles;
    backward through the fused op's (the summed upstream gradients of the processed and raw fields)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, c: _Call, ignored, want, labels, options):
        logp, ent, stats, _, extra = _outputs(c, ignored, True, stats=True)
        if labels is None:
            logp = None
        want_logp, want_entropy = kit.stats_asked(want)
        _warm_backward(c, want_logp, want_entropy)
        _keep(ctx, c, stats, labels, options, hidden, weight, bias)
        named = _stats_fields(logp, ent, extra, want)
        outs = tuple(named.get(name) for name in FIELDS)
        ctx.mark_non_differentiable(*kit.fixed_stats(outs))
        return outs

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        g_lp, g_ent = kit.stats_gradients(grads)

        def outputs(hidden, weight, bias):
            names = ("entropy",) if ctx.labels is None else ("logprobs", "entropy")
            out = kit.reference_function("token_stats")(hidden, ctx.labels, weight=weight, bias=bias,
                                                        outputs=names, dtype=ctx.call.cd, **ctx.options)
            return (out.get("logprobs"), out["entropy"])

        return _fused_backward(ctx, g_lp, g_ent, outputs)


def token_stats(hidden, weight, labels, *, bias, outputs, temperature, ignore_index, softcap=None):
    """token_stats given hidden states (inputs validated; labels ``(...)`` or None). Only logprobs
    and entropy (and their raw copies) with labels: the fused op itself (its bits by construction,
    its RL-step paths: ignored rows skipped, a frozen weight's hidden gradient formed in forward).
    Any other field: :func:`_fwd_stats_step`'s tiles, every field in the one pass."""
    want = frozenset(outputs) - (kit.LABEL_STATS if labels is None else frozenset())
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    n = lead.numel()
    if n == 0 or hdim == 0:  # nothing to compile for
        got = kit.reference_function("token_stats")(hidden, labels, weight=weight, bias=bias, outputs=tuple(want),
                                                    temperature=temperature, ignore_index=ignore_index,
                                                    softcap=softcap, dtype=result_dtype(hidden.dtype))
        return lr.TokenStats(**{k: v for k, v in got.items() if k in want})

    def shaped(named: dict) -> "lr.TokenStats":
        return lr.TokenStats(**{k: v.view(labels.shape if k in kit.LABEL_STATS else lead) for k, v in named.items()})

    if labels is not None and want <= kit.DIFFERENTIABLE_STATS:
        entropy = kit.stats_asked(want)[1]
        out = logprobs_from_hidden(hidden, weight, labels, bias=bias, temperature=temperature,
                                   ignore_index=ignore_index, return_entropy=entropy, softcap=softcap)
        logp, ent = out if entropy else (out, None)
        return shaped(_stats_fields(logp.reshape(n), None if ent is None else ent.reshape(n), {}, want))
    flat = hidden.reshape(n, hdim)
    y = torch.zeros(n, dtype=torch.int64, device=hidden.device) if labels is None else labels.reshape(n).long()
    ignored = None if ignore_index is None or labels is None else y == ignore_index
    c = _make_call(flat, weight, bias, y if ignored is None else y.masked_fill(ignored, 0), temperature, softcap, None)
    if torch.is_grad_enabled() and want & kit.DIFFERENTIABLE_STATS and \
            any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        options = dict(temperature=temperature, ignore_index=ignore_index, softcap=softcap)
        outs = _FusedStats.apply(flat, weight, bias, c, ignored, want, None if labels is None else y, options)
        return shaped({name: o for name, o in zip(FIELDS, outs) if o is not None})
    logp, ent, _, _, extra = _outputs(c, ignored, True, stats=True)
    return shaped(_stats_fields(None if labels is None else logp, ent, extra, want))
