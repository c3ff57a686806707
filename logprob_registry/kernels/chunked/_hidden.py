"""Fused linear logprobs for the ``chunked`` backend: from hidden states to log-probabilities
without ever forming the ``(N, V)`` logits.

The logits ``hidden @ weight.T + bias`` exist only to be reduced to one number per token, yet they
are the largest activation of an RL step. Here they are formed one tile at a time (a block of
tokens against a block of the vocabulary), in fp32 (fp64 for fp64 inputs), and reduced at once
with an online log-sum-exp across vocabulary blocks. Backward recomputes each tile to form the
gradients of hidden, weight and bias; the weight gradient accumulates tile by tile, so no
``N x V`` buffer exists in either pass.

Chunk budget: a tile of logits holds at most ``chunk_bytes`` bytes (fp32). The working set of a
tile is about twice that (logits and probabilities), plus, for bf16/fp16 weights, an fp32 copy of
one vocabulary block of the weight (also capped at ``chunk_bytes``). The budget is, in order: the
``chunk_bytes=`` keyword, the environment variable ``LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES``, or
:data:`DEFAULT_CHUNK_BYTES` for the device type.

bf16/fp16 inputs are upcast to fp32 one block at a time (a bf16 matmul would round the logits to
bf16, an error of about 1e-2 nats that the numerical contract forbids). Their gradients are
accumulated in fp32 and rounded once at the end: the hidden gradient through an ``N x H`` fp32
buffer, the weight gradient one vocabulary block at a time.

RL steps: rows whose label is ``ignore_index`` never reach the tiles (``kit.on_active_rows``; not
with the entropy, an output of every row); with a frozen weight (and bias) and no entropy the
forward also accumulates ``softmax @ W`` (online rescaling, as flash attention does), so that the
backward is one scale of ``(W[label] - softmax @ W) / T`` and recomputes no tile.

Saved for backward: the inputs (hidden flattened to ``(N, H)``, a copy only if its leading dims
cannot be flattened as a view), the labels, and per token the log-sum-exp and the entropy.
Batch invariance: the vocabulary blocks do not depend on ``N`` and short tiles are padded to
:data:`MIN_GEMM_ROWS` rows, so a row's results are bitwise the same whatever the batch, as far as
the matmul library gives a row the same result for any tile of at least that many rows (true of
the CPU build tested; not promised by GPU libraries, which pick kernels by shape).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from logprob_registry import kit
from logprob_registry.kit import (
    MIN_GEMM_ROWS,
    add_matmul,
    backward_without_autocast,
    label_minus_mean,
    on_active_rows,
    pad_rows,
    second_order_gradient,
)
from logprob_registry.kit import result_dtype as _compute_dtype

#: Bytes of one fp32 tile of logits, by device type ("default" for the others). Small on the CPU,
#: where a 1024 x 1024 tile already keeps the matmuls as fast as one big matmul; larger on
#: accelerators (not measured here), where fewer, larger launches matter more than a few hundred MB.
DEFAULT_CHUNK_BYTES = {"cpu": 4 << 20, "default": 256 << 20}
CHUNK_BYTES = kit.declare_variable(kit.Variable(
    "LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES", kit.parse_bytes, None,
    "bytes of one fp32 tile of logits in chunked's logprobs_from_hidden (default 4MiB on CPU, 256MiB elsewhere)"))
CHUNK_BYTES_ENV = CHUNK_BYTES.name


__all__ = [
    "CHUNK_BYTES_ENV", "DEFAULT_CHUNK_BYTES", "MIN_GEMM_ROWS", "Plan", "logprobs_from_hidden", "plan",
    "resolve_chunk_bytes",
]


class Plan(NamedTuple):
    """How the ``(N, V)`` logits are cut: ``rows`` tokens by ``cols`` vocabulary entries a tile."""

    rows: int
    cols: int


def resolve_chunk_bytes(device: torch.device, override: Optional[int] = None) -> int:
    """The tile budget in bytes: ``override``, else the environment variable, else the default."""
    if override is not None:
        return kit.positive_bytes(override, "chunk_bytes")
    configured = kit.variable_value(CHUNK_BYTES.name)
    if configured is not None:
        return configured
    return DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["default"])


def plan(n: int, v: int, h: int, dtype: torch.dtype, budget: int) -> Plan:
    """Tile shape for ``n`` tokens, a vocabulary of ``v``, hidden size ``h`` and a byte budget.

    Tiles are as square as the budget allows: a square tile reads the fewest bytes of hidden and
    weight per logit formed (a 32 x 32768 tile ran 3x slower than a 1024 x 1024 one of the same
    size on the CPU). The vocabulary block does not depend on ``n``, so that a row's log-sum-exp
    adds up in the same order whatever the batch. For bf16/fp16 weights a vocabulary block is
    also capped so that its fp32 copy fits the budget.
    """
    elem = 8 if dtype == torch.float64 else 4
    cells = max(1, budget // elem)
    cols = min(max(v, 1), max(1, math.isqrt(cells)))
    if dtype in (torch.float16, torch.bfloat16):
        cols = min(cols, max(1, budget // (4 * max(h, 1))))
    rows = min(max(n, 1), max(1, cells // cols))
    return Plan(rows, cols)


def _block(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _tile(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], inv_t: float) -> torch.Tensor:
    """``(h @ w.T + b) / T`` for one tile, in the compute dtype of ``h`` and ``w``."""
    rows = h.shape[0]
    h = pad_rows(h)
    z = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z[:rows]


class Grads:
    """The gradients of hidden, weight and bias, accumulated tile by tile in the compute dtype ``cd``
    (a weight of another dtype one vocabulary block at a time, rounded once per block) and rounded
    to the inputs' dtypes at the end; ``need``: which of the three are wanted."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cd: torch.dtype,
                 need: Tuple[bool, bool, bool]) -> None:
        (n, hdim), v = hidden.shape, weight.shape[0]
        self.cd, self.dtypes = cd, (hidden.dtype, None if bias is None else bias.dtype)
        opts = dict(device=hidden.device, dtype=cd)
        self.gh = torch.zeros(n, hdim, **opts) if need[0] else None
        self.low_w = weight.dtype != cd
        self.gw = torch.zeros(v, hdim, device=weight.device, dtype=weight.dtype) if need[1] else None
        self.gb = torch.zeros(v, **opts) if need[2] else None
        self.block: Optional[torch.Tensor] = None

    def start_block(self, v0: int, v1: int) -> None:
        if self.gw is not None:
            self.block = (torch.zeros(v1 - v0, self.gw.shape[1], device=self.gw.device, dtype=self.cd)
                          if self.low_w else self.gw[v0:v1])

    def add(self, r0: int, r1: int, v0: int, v1: int, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """A tile's ``dz`` (rows r0:r1, vocabulary v0:v1) meets ``w`` (the block of the weight) and
        ``h`` (the rows of hidden)."""
        if self.gh is not None:
            add_matmul(self.gh[r0:r1], dz, w)
        if self.block is not None:
            self.block.addmm_(dz.t(), h)
        if self.gb is not None:
            self.gb[v0:v1] += dz.sum(0)

    def end_block(self, v0: int, v1: int) -> None:
        if self.gw is not None and self.low_w:
            self.gw[v0:v1].copy_(self.block)

    def result(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        gh = None if self.gh is None else self.gh.to(self.dtypes[0])
        gb = None if self.gb is None else self.gb.to(self.dtypes[1])
        return gh, self.gw, gb


class _Labels(NamedTuple):
    index: torch.Tensor     # int64, ignored positions replaced by 0
    keep: torch.Tensor      # bool, False at ignored positions


def _labels(labels: torch.Tensor, ignore_index: Optional[int]) -> _Labels:
    index = labels.long()
    if ignore_index is None:
        return _Labels(index, torch.ones_like(index, dtype=torch.bool))
    keep = index != ignore_index
    return _Labels(index.masked_fill(~keep, 0), keep)


def _forward(hidden, weight, bias, lab: _Labels, temperature, entropy, tiles: Plan, accumulate: bool = False,
             extras=None):
    """Log-sum-exp, label logit and (if asked) ``sum p z`` per token, tile by tile.
    ``extras`` (token_stats, :mod:`._stats`): ``extras.logits(r0, r1, v0, z, m_old, m_new)`` sees each
    tile of ``z`` with the running max before and after it, and ``extras.exps(r0, r1, e, alpha)`` its
    ``exp(z - running max)`` and the rescaling factor, read-only, in the same pass.

    Returns ``(logp, lse, ent, dh)`` in the compute dtype; ``ent`` is None unless asked; ``dh``
    (with ``accumulate``: a frozen weight, see :func:`_accumulates`; else None) is ``d logp / d
    hidden`` per row, ``(W[label] - softmax @ W) / T`` ``(N, H)``, its ``softmax @ W`` accumulated
    tile by tile with the running max (online softmax, as in flash attention): the backward is then
    one scale, and forward and backward cost two matmuls a tile, as the logits path's.
    """
    n, v = hidden.shape[0], weight.shape[0]
    cd = _compute_dtype(hidden.dtype)
    inv_t = 1.0 / temperature
    opts = dict(device=hidden.device, dtype=cd)
    m = torch.full((n,), float("-inf"), **opts)   # running max
    s = torch.zeros(n, **opts)                     # running sum of exp(z - m)
    t = torch.zeros(n, **opts) if entropy else None  # running sum of exp(z - m) * z
    zl = torch.zeros(n, **opts)                    # the label's logit
    acc = torch.zeros(n, hidden.shape[1], **opts) if accumulate else None  # sum exp(z - m) w
    # the entropy's exp(z - m), in one buffer for every tile: a fresh tile-sized tensor per tile costs
    # its page faults (4 ms a 4 MiB tile on the CPU, a quarter of the tile's matmul)
    ebuf = torch.empty(min(n, tiles.rows) * min(v, tiles.cols), **opts) if entropy else None
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        w = _block(weight[v0:v1], cd)
        b = None if bias is None else _block(bias[v0:v1], cd)
        for r0 in range(0, n, tiles.rows):
            r1 = min(n, r0 + tiles.rows)
            z = _tile(_block(hidden[r0:r1], cd), w, b, inv_t)
            idx = lab.index[r0:r1]
            inside = (idx >= v0) & (idx < v1) & lab.keep[r0:r1]
            got = z.gather(1, (idx - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            zl[r0:r1] = torch.where(inside, got, zl[r0:r1])
            m_old = m[r0:r1]
            m_new = torch.maximum(m_old, z.amax(1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = (m_old - m_safe).exp_()
            if extras is not None:
                extras.logits(r0, r1, v0, z, m_old, m_new)
            if t is None:
                e = z.sub_(m_safe.unsqueeze(1)).exp_()  # z is not needed any more
            else:
                e = torch.sub(z, m_safe.unsqueeze(1), out=ebuf[: z.numel()].view(z.shape)).exp_()
            if extras is not None:
                extras.exps(r0, r1, e, alpha)
            s[r0:r1] = s[r0:r1] * alpha + e.sum(1)
            if acc is not None:
                rows = acc[r0:r1]
                rows.mul_(alpha.unsqueeze(1))
                add_matmul(rows, e, w)
            if t is not None:
                # exp(-inf) * -inf is NaN for masked entries; their share is 0. A NaN logit makes
                # the whole row NaN through the max, so hiding the product's NaN hides nothing.
                e.mul_(z).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
                t[r0:r1] = t[r0:r1] * alpha + e.sum(1)
            m[r0:r1] = m_new
            del e, z
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    lse = m_safe + s.log()
    logp = (zl - lse).masked_fill_(~lab.keep, 0.0)
    ent = None if t is None else lse - t / s
    dh = None if acc is None else label_minus_mean(acc.div_(s.unsqueeze(1)), weight, lab.index, inv_t, tiles.rows)
    return logp, lse, ent, dh


def _accumulates(need: Tuple[bool, bool, bool], entropy: bool) -> bool:
    """Whether the forward forms the hidden gradient (:func:`_forward`): only the hidden needs one
    (a frozen lm_head: LoRA, a reference model) and no entropy is returned (its gradient would
    need another running sum)."""
    return need[0] and not need[1] and not need[2] and not entropy


def _backward(hidden, weight, bias, lab: _Labels, temperature, lse, sbar, g_lp, g_ent, need, tiles: Plan):
    """Gradients of hidden, weight and bias from per-token gradients of logp and entropy.

    With ``z = logits / T`` and ``p = softmax(z)``: ``d logp / dz = onehot - p`` and
    ``d ent / dz = -p (z - sum p z)`` (``sbar`` is ``sum p z`` per token); each tile's ``dz / T``
    then meets the weight and hidden.
    """
    n, v = hidden.shape[0], weight.shape[0]
    cd = _compute_dtype(hidden.dtype)
    inv_t = 1.0 / temperature
    opts = dict(device=hidden.device, dtype=cd)
    # Fold 1/T into the per-token gradients: dz is linear in them.
    a = None if g_lp is None else (g_lp.to(cd) * inv_t).masked_fill_(~lab.keep, 0.0)
    c = None if g_ent is None else g_ent.to(cd) * inv_t
    grads = Grads(hidden, weight, bias, cd, need)
    for v0 in range(0, v, tiles.cols):
        v1 = min(v, v0 + tiles.cols)
        w = _block(weight[v0:v1], cd)
        b = None if bias is None else _block(bias[v0:v1], cd)
        grads.start_block(v0, v1)
        for r0 in range(0, n, tiles.rows):
            r1 = min(n, r0 + tiles.rows)
            h = _block(hidden[r0:r1], cd)
            z = _tile(h, w, b, inv_t)
            if c is None:
                # d logp / dz = onehot - p: -a p here, +a at the label below
                dz = z.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(a[r0:r1].neg().unsqueeze(1))
            else:
                p = (z - lse[r0:r1].unsqueeze(1)).exp_()
                # coefficient of -p: a + c (z - sum p z); where p is 0 (masked entries) it is 0.
                z.masked_fill_(p == 0, 0.0)
                z.sub_(sbar[r0:r1].unsqueeze(1)).mul_(c[r0:r1].unsqueeze(1))
                if a is not None:
                    z.add_(a[r0:r1].unsqueeze(1))
                dz = p.mul_(z).neg_()
                del p
            del z
            if a is not None:
                idx = lab.index[r0:r1]
                inside = (idx >= v0) & (idx < v1)
                src = torch.where(inside, a[r0:r1], torch.zeros((), **opts))
                dz.scatter_add_(1, (idx - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1), src.unsqueeze(1))
            grads.add(r0, r1, v0, v1, dz, h, w)
            del dz
        grads.end_block(v0, v1)
    return grads.result()


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, ignore_index, entropy, tiles):
        lab = _labels(labels, ignore_index)
        accumulate = _accumulates(tuple(ctx.needs_input_grad[:3]), entropy)
        logp, lse, ent, ctx.dh = _forward(hidden, weight, bias, lab, temperature, entropy, tiles, accumulate)
        ctx.set_materialize_grads(False)
        # sum p z rather than the entropy output itself, which the caller may modify in place
        ctx.save_for_backward(hidden, weight, bias, labels, lse, None if ent is None else lse - ent)
        ctx.options = (temperature, ignore_index, tiles)
        return (logp, ent) if entropy else logp

    @staticmethod
    @backward_without_autocast
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, bias, labels, lse, sbar = ctx.saved_tensors
        temperature, ignore_index, tiles = ctx.options
        need = tuple(ctx.needs_input_grad[:3])
        if (g_lp is None and g_ent is None) or not any(need):
            return (None,) * 8
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            def outputs():
                out = kit.reference_function("logprobs_from_hidden")(
                    hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=ignore_index,
                    return_entropy=sbar is not None, dtype=_compute_dtype(hidden.dtype))
                return out if isinstance(out, tuple) else (out,)

            inputs = tuple(t if n else None for t, n in zip((hidden, weight, bias), need))
            return second_order_gradient(outputs, inputs, (g_lp, g_ent)) + (None,) * 5
        lab = _labels(labels, ignore_index)
        if ctx.dh is not None:  # a frozen weight: the hidden gradient was formed in forward
            gh = None
            if g_lp is not None:
                gh = (ctx.dh * g_lp.to(ctx.dh.dtype).masked_fill(~lab.keep, 0.0).unsqueeze(1)).to(hidden.dtype)
            return gh, None, None, None, None, None, None, None
        gh, gw, gb = _backward(hidden, weight, bias, lab, temperature, lse, sbar, g_lp, g_ent, need, tiles)
        return gh, gw, gb, None, None, None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor],
    temperature: float,
    ignore_index: Optional[int],
    return_entropy: bool,
    chunk_bytes: Optional[int] = None,
):
    """``log_softmax((hidden @ weight.T + bias) / T)[..., labels]`` (and the entropy), tile by tile.

    The backend op behind :func:`logprob_registry.logprobs_from_hidden` (inputs already
    validated: one dtype for hidden, weight and bias). Results are float32 (float64 for float64
    input); gradients flow to hidden, weight and bias. ``chunk_bytes`` overrides the tile budget.
    """
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    flat = hidden.reshape(-1, hdim)
    y = labels.reshape(-1)
    if not return_entropy:  # every row's entropy is an output; without it, only active rows cost
        def active(h, lab):
            return logprobs_from_hidden(h, weight, lab, bias=bias, temperature=temperature, ignore_index=None,
                                        return_entropy=False, chunk_bytes=chunk_bytes)

        out = on_active_rows(active, flat, y, ignore_index)
        if out is not None:
            return out.view(lead)
    budget = resolve_chunk_bytes(hidden.device, chunk_bytes)
    tiles = plan(flat.shape[0], weight.shape[0], hdim, hidden.dtype, budget)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if grad:
        out = _FusedLinearLogprobs.apply(flat, weight, bias, y, temperature, ignore_index, return_entropy, tiles)
    else:
        logp, _, ent, _ = _forward(flat, weight, bias, _labels(y, ignore_index), temperature, return_entropy, tiles)
        out = (logp, ent) if return_entropy else logp
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)
