"""The row loops behind the ``chunked`` backend: softmax statistics forward, gradient backward.

Rows of the logits are visited in chunks of a fixed number of rows, each upcast (when needed) into
a small workspace that stays in cache, so no tensor of the logits' size is ever made besides the
gradient the caller asked for. Each chunk goes through torch's own softmax kernel (one fused pass
per row, the fastest exp torch has on the CPU), ``p = softmax(y)`` with ``y = logits / T``. That
kernel's internal sum is a plain running sum, so ``p`` is off by a factor ``norm = sum(p)`` (1 up to
that rounding); torch's row sum of ``p`` is accurate to fp32 rounding and undoes it. Per row:

* log-probabilities alone: ``logprob = log(p[label] / norm)``; a row whose ``p[label]`` is so small
  that it lost precision (under ``2**24`` times the smallest normal number) or underflowed to zero
  is redone by the exact path below;
* otherwise ``m = max(y)`` and ``logz = log(sum(exp(y - m))) = log(norm / max(p))`` (the maximum's
  probability is ``exp(0) / s``), so ``logprob = (y[label] - m) - logz`` and
  ``entropy = logz - sum(p * (y - m)) / norm``, both without cancellation.

The backward keeps only ``norm`` (and ``m``, ``E_q[y - m]`` for the entropy) and recomputes
``softmax(y)`` chunk by chunk.

Batch invariance: every op on a chunk is row-wise (softmax, a row max, a row sum, elementwise),
and torch runs each of them row by row whatever the number of rows, except a row sum over a single
row, which torch may split across threads; a single-row sum is therefore done on the row repeated
twice. On accelerators, whose reductions pick their strategy from the tensor's shape and alignment,
every chunk is copied into a workspace of one fixed shape (zero rows pad the last one), so every
kernel sees the same shape whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from logprob_registry import kit
from logprob_registry.kit import result_dtype as compute_dtype


@dataclass
class Plan:
    """What one call computes, and the constants of its loop."""

    temperature: float
    want_logprobs: bool
    want_entropy: bool
    rows_per_chunk: int
    fixed_shape: bool


@dataclass
class Stats:
    """Per-row results of the forward loop (flat, one entry per row of the logits).

    ``norm`` is always there (the backward needs it). The log-probabilities alone need only the
    label's probability ``plabel``; the entropy (and a label too improbable for ``plabel`` to be
    accurate) needs ``m`` and ``logz``.
    """

    norm: torch.Tensor
    m: Optional[torch.Tensor] = None
    logz: Optional[torch.Tensor] = None
    mean_z: Optional[torch.Tensor] = None  # E_q[y - m], for the entropy and its gradient
    plabel: Optional[torch.Tensor] = None


def rows_per_chunk(vocab: int, dtype: torch.dtype, workspace_bytes: int) -> int:
    """Rows per chunk so that the two workspaces fit ``workspace_bytes``; at least two rows."""
    itemsize = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    return max(2, workspace_bytes // max(1, 2 * vocab * itemsize))


def blocks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """2-D views ``(rows, V)`` of ``x`` covering its rows in C order, without copying.

    Leading dimensions are merged where the strides allow (``view``); otherwise the first one is
    unbound, so ``logits[:, :-1]`` of a contiguous ``(B, T, V)`` gives ``B`` views of ``T - 1`` rows.
    """
    if x.dim() <= 2:
        yield x.reshape(-1, x.shape[-1]) if x.dim() == 1 else x
        return
    try:
        yield x.view(-1, x.shape[-1])
    except RuntimeError:
        for sub in x.unbind(0):
            yield from blocks(sub)


def chunks(x: torch.Tensor, rows: int) -> Iterator[Tuple[int, torch.Tensor]]:
    """``(first row, view of at most rows rows)`` over every row of ``x``."""
    start = 0
    for block in blocks(x):
        for lo in range(0, block.shape[0], rows):
            view = block[lo:lo + rows]
            yield start + lo, view
        start += block.shape[0]


class _Workspace:
    """The two chunk-sized buffers of a call: ``y`` (the upcast, scaled chunk) and ``p``."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device, fixed: bool):
        self.shape = (rows, vocab)
        self.dtype, self.device, self.fixed = dtype, device, fixed
        self._y: Optional[torch.Tensor] = None
        self.p = torch.empty(self.shape, dtype=dtype, device=device)

    @property
    def y(self) -> torch.Tensor:
        if self._y is None:
            self._y = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._y

    def load(self, chunk: torch.Tensor, temperature: float) -> torch.Tensor:
        """``chunk / temperature`` in the compute dtype: the chunk itself when nothing changes."""
        r = chunk.shape[0]
        if not self.fixed and temperature == 1.0 and chunk.dtype == self.dtype and chunk.is_contiguous():
            return chunk  # (softmax would copy a non-contiguous chunk anyway, outside the budget)
        if self.fixed:
            y = self.y
            y[:r].copy_(chunk)
            if r < y.shape[0]:
                y[r:].zero_()
        else:
            y = self.y[:r]
            y.copy_(chunk)
        if temperature != 1.0:
            y.div_(temperature)
        return y


def _reduce_into(op, t: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """``op(t, -1)`` (a row reduction) of the first ``len(dest)`` rows of ``t``, into ``dest``."""
    r = dest.shape[0]
    if t.shape[0] == r and r > 1:
        return op(t, -1, out=dest)
    if t.shape[0] == 1:  # torch may split a lone row's reduction across threads; two rows it never splits
        t = t.expand(2, t.shape[1])
    return dest.copy_(op(t, -1)[:r])


def _z_times_p(y: torch.Tensor, m: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``p * (y - m)`` into ``out`` (which may be ``y``), with ``0 * -inf = 0`` for masked entries."""
    torch.sub(y, m.unsqueeze(-1), out=out)
    out.clamp_(min=torch.finfo(out.dtype).min)
    return out.mul_(p)


def forward(logits: torch.Tensor, plan: Plan, index: Optional[torch.Tensor] = None) -> Stats:
    """The per-row statistics of ``softmax(logits / temperature)``, in one pass over the logits.

    Given ``index`` (the labels, flat) and no entropy wanted, only the label's probability and the
    normaliser are kept (two passes fewer per chunk); otherwise the full statistics.
    """
    vocab = logits.shape[-1]
    n = logits.numel() // vocab
    cdt = compute_dtype(logits.dtype)
    dev = logits.device
    full = plan.want_entropy or index is None
    norm = torch.empty(n, dtype=cdt, device=dev)
    m = torch.empty(n, dtype=cdt, device=dev) if full else None
    pmax = torch.empty(n, dtype=cdt, device=dev) if full else None
    pz = torch.empty(n, dtype=cdt, device=dev) if plan.want_entropy else None
    plabel = None if full else torch.empty(n, dtype=cdt, device=dev)
    if n:
        rows = plan.rows_per_chunk if plan.fixed_shape else min(plan.rows_per_chunk, n)
        ws = _Workspace(rows, vocab, cdt, dev, plan.fixed_shape)
        index2 = None if full else index.view(-1, 1)
        plabel2 = None if full else plabel.view(-1, 1)
        for start, chunk in chunks(logits, plan.rows_per_chunk):
            end = start + chunk.shape[0]
            y = ws.load(chunk, plan.temperature)
            p = torch.softmax(y, -1, out=ws.p if y.shape[0] == rows else ws.p[: y.shape[0]])
            _reduce_into(torch.sum, p, norm[start:end])
            if not full:
                torch.gather(p[: end - start], 1, index2[start:end], out=plabel2[start:end])
                continue
            _reduce_into(torch.amax, y, m[start:end])
            _reduce_into(torch.amax, p, pmax[start:end])
            if pz is not None:
                z = _z_times_p(y, _pad(m[start:end], y.shape[0]), p, out=ws.y[: y.shape[0]])
                _reduce_into(torch.sum, z, pz[start:end])
    if not full:
        return Stats(norm, plabel=plabel)
    logz = torch.log(norm / pmax)
    mean_z = None if pz is None else pz / norm
    return Stats(norm, m, logz, mean_z)


def logprobs(logits: torch.Tensor, plan: Plan, index: torch.Tensor, valid: Optional[torch.Tensor],
             stats: Stats) -> torch.Tensor:
    """Flat log-probabilities of the labels from the forward statistics; 0 where not ``valid``."""
    if stats.plabel is not None:
        lp = torch.log(stats.plabel / stats.norm)
        # below this the label's probability has lost precision (or underflowed): redo those rows
        rare = stats.plabel < torch.finfo(stats.norm.dtype).tiny * 2.0 ** 24
        if valid is not None:
            rare &= valid
        if kit.capturing(rare):  # no row count on the host: every row's full statistics (the same bits)
            full = forward(logits, plan)
            exact = (_picked(logits, index, plan, stats.norm.dtype) - full.m) - full.logz
            lp = torch.where(rare, exact, lp)
            return lp if valid is None else lp.masked_fill_(~valid, 0.0)
        rows = rare.nonzero().squeeze(-1)
        if rows.numel():
            full = forward(_take_rows(logits, rows), plan)
            lp[rows] = (_picked(logits, index, plan, stats.norm.dtype)[rows] - full.m) - full.logz
    else:
        lp = (_picked(logits, index, plan, stats.norm.dtype) - stats.m) - stats.logz
    return lp if valid is None else lp.masked_fill_(~valid, 0.0)


def _picked(logits: torch.Tensor, index: torch.Tensor, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
    """``y[label]`` for every row, rounded exactly as the chunk loop rounds ``y``."""
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits
    picked = rows.gather(-1, index.view(*rows.shape[:-1], 1)).reshape(-1).to(dtype)
    return picked / plan.temperature if plan.temperature != 1.0 else picked


def _take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of the given flat rows of ``logits``, shape ``(len(rows), V)``."""
    if logits.dim() == 1:
        return logits.unsqueeze(0)[rows]
    return logits[torch.unravel_index(rows, logits.shape[:-1])]


def backward(
    logits: torch.Tensor,
    plan: Plan,
    stats: Stats,
    index: Optional[torch.Tensor],
    grad_logprobs: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    out: torch.Tensor,
    inplace: bool,
) -> torch.Tensor:
    """Write the gradient with respect to ``logits`` into ``out``: an alias of ``logits`` when
    ``inplace``, else a contiguous tensor of the logits' shape.

    With ``q = softmax(y)`` and ``z = y - m`` the gradient of a row is
    ``(g_lp * (onehot(label) - q) + g_ent * q * (E_q[z] - z)) / temperature``, formed in the
    compute dtype and rounded to ``out``'s dtype once. ``grad_logprobs`` is already zero at ignored
    positions and ``index`` is a safe label there.
    """
    vocab = logits.shape[-1]
    n = stats.norm.shape[0]
    if n == 0:
        return out
    cdt = stats.norm.dtype
    scale = 1.0 / (plan.temperature * stats.norm)  # q = p / norm, and d/dlogits = d/dy / T
    a = torch.zeros(n, dtype=cdt, device=logits.device)  # coefficient of p
    b = None  # coefficient of p * z
    onehot = None  # added at the label
    if grad_logprobs is not None:
        g = grad_logprobs.to(cdt)
        a -= g * scale
        onehot = g / plan.temperature
    if grad_entropy is not None:
        h = grad_entropy.to(cdt) * scale
        a += h * stats.mean_z
        b = -h
    rows = plan.rows_per_chunk if plan.fixed_shape else min(plan.rows_per_chunk, n)
    ws = _Workspace(rows, vocab, cdt, logits.device, plan.fixed_shape)
    flat_out = None if inplace else out.view(-1, vocab)
    live = _live_rows(grad_logprobs, plan.rows_per_chunk) if b is None else None
    for start, chunk in chunks(out if inplace else logits, plan.rows_per_chunk):
        r = chunk.shape[0]
        dest = chunk if inplace else flat_out[start:start + r]
        if live is not None and not bool(live[start:start + r].any()):  # all ignored: zeros, logits unread
            dest.zero_()
            continue
        y = ws.load(chunk, plan.temperature)
        p = torch.softmax(y, -1, out=ws.p[: y.shape[0]])
        p_rows = p[:r]
        sl = slice(start, start + r)
        # Written straight into dest when it has the compute dtype; otherwise formed in the
        # workspace and copied (an out= of another dtype would allocate a chunk-sized temporary).
        direct = dest.dtype == cdt
        if b is None:  # log-probabilities only: grad = a * (p - norm * onehot)
            p_rows.scatter_add_(1, index[sl].unsqueeze(-1), -stats.norm[sl].unsqueeze(-1))
            if direct:
                torch.mul(p_rows, a[sl].unsqueeze(-1), out=dest)
            else:
                dest.copy_(p_rows.mul_(a[sl].unsqueeze(-1)))
            continue
        z = _z_times_p(y, _pad(stats.m[sl], y.shape[0]), p, out=ws.y[: y.shape[0]])[:r]
        p_rows.mul_(a[sl].unsqueeze(-1))
        if onehot is not None:
            p_rows.scatter_add_(1, index[sl].unsqueeze(-1), onehot[sl].unsqueeze(-1))
        if direct:
            torch.addcmul(p_rows, z, b[sl].unsqueeze(-1), out=dest)
        else:
            dest.copy_(p_rows.addcmul_(z, b[sl].unsqueeze(-1)))
    return out


def _live_rows(grad: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """On the CPU, whether each row's upstream gradient ``grad`` is nonzero; a chunk with none live
    (its rows all ignored, or given a zero upstream gradient: a GRPO batch's prompt rows) gets zeros
    without its logits being read or their softmax taken. None (no check) when one chunk holds every
    row. One device synchronisation for the whole backward; none (and None) while a CUDA graph is
    captured."""
    return None if grad.shape[0] <= rows or kit.capturing(grad) else (grad != 0).cpu()


def _pad(v: torch.Tensor, rows: int) -> torch.Tensor:
    """``v`` with zeros appended up to ``rows`` entries (the padded rows of a fixed-shape chunk)."""
    return v if v.shape[0] == rows else torch.cat([v, v.new_zeros(rows - v.shape[0])])

