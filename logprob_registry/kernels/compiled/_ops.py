"""The ops of the ``compiled`` backend: layout handling, the forward, and the autograd Function
whose backward runs the compiled gradient kernel (or, should it fail late, the same math eagerly)."""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from typing import Dict, NamedTuple, Optional

import torch

import logprob_registry as lr
from logprob_registry import kit
from logprob_registry.kit import backward_without_autocast, result_dtype, second_order_gradient
from logprob_registry.kit import overlapping as _overlapping

from . import _aot
from ._kernels import LN2, LOG2E, CompileError, _grad_math, _run

#: Bytes of float32 temporaries (8 per logit) per block of the eager backward used when a backward
#: kernel cannot be compiled: a block is EAGER_BLOCK_BYTES // (8 * V) rows.
EAGER_BLOCK_BYTES = 64 << 20
#: Bytes of the active rows per call of the in-place row kernel (:func:`_grad_rows`): 2 MiB, 16 rows
#: of 32768 float32 logits, measured at 4096x32768 (its backward 31 ms against 52 ms in one call).
INPLACE_BLOCK_BYTES = 2 << 20
_lock = threading.RLock()

# --------------------------------------------------------------------------- layout
def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed with its leading dims merged wherever the strides allow: usually ``(N, V)``;
    ``(B, T, V)`` for a slice such as ``logits[:, :-1]``. Same storage, nothing copied; detached and
    no view, so that the compiled kernels do not specialise on autograd state or a base tensor."""
    sizes, strides = [], []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if not sizes:
        sizes, strides = [1], [x.shape[-1] * x.stride(-1)]
    return x.detach().as_strided(sizes + [x.shape[-1]], strides + [x.stride(-1)]).detach()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and detached, no view of another tensor: what the kernels specialise on least."""
    return t.contiguous().detach()


def _layout(rows: torch.Tensor) -> tuple:
    """What a compiled kernel specialises on besides shapes: rank, contiguity, single rows, dtype."""
    return (rows.dim(), rows.is_contiguous(), rows.stride(-1) == 1, tuple(s == 1 for s in rows.shape[:-1]),
            rows.device.type, rows.dtype)


def _planes(rows: torch.Tensor):
    """``(index, plane)`` for the 2-D ``(R, V)`` views making up ``rows`` (one when it is 2-D)."""
    for index in itertools.product(*map(range, rows.shape[:-2])):
        yield index, rows[index].detach()


def _take(args: tuple, index) -> tuple:
    return tuple(a[index].detach() if isinstance(a, torch.Tensor) else a for a in args)


# --------------------------------------------------------------------------- forward
class _Forward(NamedTuple):
    """What one forward computed, all N-sized: outputs, and what backward needs."""

    rows: torch.Tensor
    idx: torch.Tensor
    ignored: Optional[torch.Tensor]
    m: torch.Tensor
    log_s: torch.Tensor
    logp: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    extra: tuple = ()  # token_stats' kernel: sum z, sum exp2(2 a); the raw max, label value, its count


def _forward(logits, labels, inv_t, ignore_index, want_logp, want_entropy, cap=None, stats=False) -> _Forward:
    """The forward kernel's statistics and the outputs asked; ``stats``: token_stats' kernel, the
    entropy's statistics by the same expressions plus its extra sums (:func:`._math._stats_math`)."""
    rows = _rows(logits)
    lead = rows.shape[:-1] + (1,)
    ignored = None
    if labels is None:
        idx = torch.zeros(lead, dtype=torch.int64, device=logits.device)
    else:
        idx = _plain(labels.reshape(lead).to(torch.int64))
        if ignore_index is not None:
            ignored = idx == ignore_index
            idx = idx.masked_fill(ignored, 0)
    k = inv_t * LOG2E
    extra = () if cap is None else (cap,)
    suffix = "" if cap is None else "_softcap"
    more = ()
    if stats:
        m, s, u, picked, *more = _row_stats("fwd_stats" + suffix, rows, idx, k, *extra)
    elif want_entropy:
        m, s, u, picked = _row_stats("fwd_entropy" + suffix, rows, idx, k, *extra)
    else:
        m, s, picked = (_active_row_stats("fwd_logprobs" + suffix, rows, idx, ignored, k, *extra)
                        or _row_stats("fwd_logprobs" + suffix, rows, idx, k, *extra))
    log_s = s.log()
    logp = entropy = None
    if want_logp:
        logp = (picked.to(m.dtype) - m) * inv_t - log_s
        if ignored is not None:
            logp = logp.masked_fill(ignored, 0.0)
    if want_entropy:
        entropy = log_s + u * LN2 / s
    return _Forward(rows, idx, ignored, m, log_s, logp, entropy, tuple(more))


def _row_stats(name: str, rows: torch.Tensor, idx: torch.Tensor, k: float, *extra) -> tuple:
    """Forward kernel ``name``'s per-row outputs, shaped like ``idx``.

    Rows of more than two dims go plane by plane: on 2-D planes inductor keeps each row's passes,
    and entropy's per-element intermediates, within the row (on 3-D it would write a float32 copy
    of the logits). A single row goes as two views of itself: a dim of size 1 would get a kernel of
    its own that sums a row in another order than a batch's kernel does.
    """
    if rows.shape[:-1].numel() == 1:
        pair = _run(name, rows.reshape(1, -1).expand(2, -1).detach(), idx.reshape(1, 1).expand(2, 1).contiguous(), k,
                    *extra)
        return tuple(t[:1].reshape(idx.shape) for t in pair)
    if rows.dim() == 2:
        return _run(name, rows, idx, k, *extra)
    parts = [_run(name, plane, *_take((idx, k) + extra, index)) for index, plane in _planes(rows)]
    return tuple(torch.stack(outs).view(idx.shape) for outs in zip(*parts))


def _active_row_stats(name: str, rows: torch.Tensor, idx: torch.Tensor, ignored: Optional[torch.Tensor], k: float,
                      *extra) -> Optional[tuple]:
    """:func:`_row_stats` of the log-probabilities' kernel on the rows whose label is not ignored
    (GRPO's prompt rows cost a copy of the others, not a softmax), scattered into N-sized outputs:
    ``m = 0, s = 1`` at an ignored row, whose log-probability is 0 and whose upstream gradient is
    made 0 (so backward skips it: :func:`_on_active_rows`, the same layout condition). The row
    kernel reads the active rows where they lie (no copy of them), unless a prebuilt package of the
    kernel is built (:func:`._aot.built`) or a softcap is asked: then the kernel runs on their copy.
    The kernel is per row: an active row's results are bitwise the call's over every row. None (run
    every row) when no row is ignored, the rows are not one contiguous plane, or a CUDA graph is
    being captured (no host read of the count)."""
    if ignored is None or rows.dim() != 2 or not rows.is_contiguous() or kit.capturing(ignored):
        return None
    active = ~ignored.view(-1)
    index = active.nonzero().flatten()
    n = active.numel()
    if index.numel() == n:
        return None
    acc = result_dtype(rows.dtype)
    m = torch.zeros(n, 1, dtype=acc, device=rows.device)
    s = torch.ones(n, 1, dtype=acc, device=rows.device)
    if not index.numel():
        return m, s, torch.zeros(n, 1, dtype=rows.dtype if not extra else acc, device=rows.device)
    if extra or _aot.built(name, rows):  # the softcap: see _math._fwd_logprobs_rows
        part = _row_stats(name, rows.index_select(0, index), idx.index_select(0, index), k, *extra)
    else:
        pick = _pair(index)
        part = _run("fwd_logprobs_rows", rows, pick, idx.index_select(0, pick), k, *extra)
        part = tuple(t[:index.numel()] for t in part)
    picked = part[2].new_zeros(n, 1)
    return tuple(full.index_copy_(0, index, p.to(full.dtype)) for full, p in zip((m, s, picked), part))


def _pair(index: torch.Tensor) -> torch.Tensor:
    """``index``, a single row twice: one row would get a kernel of its own (a dim of size 1), which
    sums a row in another order than a batch's kernel does (as :func:`_row_stats` does)."""
    return index.expand(2).contiguous() if index.numel() == 1 else index


def _outputs(f: _Forward, shape: torch.Size) -> tuple:
    return tuple(t.view(shape) for t in (f.logp, f.entropy) if t is not None)


# --------------------------------------------------------------------------- backward
_warm: set = set()
_eager_backward: Dict[tuple, str] = {}
#: The kinds of backward whose row kernel failed to compile: they gather the active rows for the
#: backward's own kernel (:func:`_grad_rows`).
_gathered_backward: Dict[tuple, str] = {}


def _grad_args(want: tuple, idx, ignored, m, log_s, h, g_lp, g_ent, inv_t, cap=None) -> tuple:
    """The backward kernel's arguments after the logits, each its own contiguous N-sized tensor (the
    compiled kernel specialises on aliasing and strides; the log-sum in base 2), then the scales. ``want`` is the op's
    (logprobs, entropy): the parts of an output it lacks are None, of one it has, zeros if absent."""
    def given(t):
        return torch.zeros_like(m) if t is None else _plain(t.reshape(m.shape).to(m.dtype))

    want_logp, want_entropy = want
    if want_logp:
        g_lp = given(g_lp)
        if ignored is not None:
            g_lp = g_lp.masked_fill(ignored, 0.0)
    else:
        idx = g_lp = None
    h, g_ent = (given(h), given(g_ent)) if want_entropy else (None, None)
    args = (idx, m, _plain(log_s * LOG2E), h, g_lp, g_ent, inv_t * LOG2E, inv_t)
    return args if cap is None else args + (cap,)


def _warm_backward(rows: torch.Tensor, want: tuple, inv_t: float, inplace: bool, cap=None) -> None:
    """Compile now, on a few rows of the same layout class, the backward kernel that this forward's
    backward will use: a failure then raises from the forward, where the registry can fall back."""
    target = next(_planes(rows))[1] if inplace else rows
    key = (_backward_name(inplace, cap), want) + _layout(target)
    if key in _warm:
        return
    # 2 rows (1 if the input has one), of unequal sizes per dim so that none is taken for another
    sample = target[tuple(slice(0, min(n, 2 + i)) for i, n in enumerate(target.shape[:-1]))].detach()
    if inplace:  # the real logits must not be written: a scratch of the same layout class
        sample = _scratch(sample, target)
    lead = sample.shape[:-1] + (1,)
    m = torch.zeros(lead, dtype=result_dtype(rows.dtype), device=rows.device)
    idx = torch.zeros(lead, dtype=torch.int64, device=rows.device)
    _run(key[0], sample, *_grad_args(want, idx, None, m, torch.zeros_like(m), None, None, None, inv_t, cap))
    with _lock:
        _warm.add(key)


def _scratch(sample: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``sample`` with ``target``'s strides, or, where those would span much more
    memory than the sample (a vocabulary-strided layout), dense in ``target``'s stride order."""
    strides = list(target.stride())
    span = 1 + sum((n - 1) * st for n, st in zip(sample.shape, strides))
    if span > 4 * sample.numel():
        size = 1
        for d in sorted(range(sample.dim()), key=lambda d: strides[d]):
            strides[d], size = size, size * sample.shape[d]
        span = size
    return torch.zeros(span, dtype=target.dtype, device=target.device).as_strided(sample.shape, strides).detach()


def _backward_name(inplace: bool, cap) -> str:
    return ("bwd_inplace" if inplace else "bwd") + ("" if cap is None else "_softcap")


def _grad(rows: torch.Tensor, want: tuple, args: tuple, inplace: bool) -> Optional[torch.Tensor]:
    """The gradient for ``rows`` (written into them when ``inplace``, and None returned); ``args``
    end with the softcap (a ninth argument) for the softcap kernels."""
    name = _backward_name(inplace, args[8] if len(args) > 8 else None)
    key = (name, want) + _layout(rows)
    if key not in _eager_backward:
        try:
            return _run(name, rows, *args)
        except CompileError as exc:
            with _lock:
                _eager_backward[key] = str(exc)
            warnings.warn(
                f"logprob_registry: backend 'compiled': {exc}; this backward, and later ones of its "
                "kind, run the same math eagerly, a block of rows at a time, for the rest of this process.",
                lr.BackendFallbackWarning,
                stacklevel=3,
            )
    out = None if inplace else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    for index, plane in _planes(rows):
        sub = _take(args, index)
        step = max(1, EAGER_BLOCK_BYTES // max(1, 8 * plane.shape[-1]))
        for start in range(0, plane.shape[0], step):
            block = slice(start, start + step)
            grad = _grad_math(plane[block], *_take(sub, block))
            (plane if inplace else out[index])[block].copy_(grad)
    return out


def _on_active_rows(rows: torch.Tensor, want: tuple, args: tuple, inplace: bool) -> Optional[torch.Tensor]:
    """The gradient computed on the rows whose upstream gradients are not all zero (ignored labels,
    GRPO's prompt rows), the others exact zeros without reading their logits: None when every row
    is active (or the rows are not one plane). The row kernel reads the active rows where they lie
    and writes their gradient into the zeros (:func:`_grad_rows`); with a prebuilt package of the
    backward, the package runs on a copy of them. The kernel is per row, so an active row's gradient
    is bitwise the one of the call over every row. In place: written over ``rows`` (and ``rows``
    returned). Contiguous rows only: a strided call keeps the kernel its layout warmed."""
    if rows.dim() != 2 or not rows.is_contiguous():
        return None
    n = rows.shape[0]
    ups = [a for a in args[4:6] if isinstance(a, torch.Tensor)]  # g_lp, g_ent
    active = functools.reduce(torch.logical_or, [u.reshape(n) != 0 for u in ups])
    if kit.capturing(active) or bool(active.all()):
        return None
    index = active.nonzero().flatten()
    if inplace:
        rows.index_fill_(0, (~active).nonzero().flatten(), 0.0)
        if index.numel() and not _grad_rows(rows, rows, index, want, args, inplace=True):
            part = rows.index_select(0, index)
            _grad(part, want, _take_rows(args, index, n), inplace=True)
            rows.index_copy_(0, index, part)
        return rows
    grad = rows.new_zeros(rows.shape)  # one fill: the zeros of the skipped rows
    if index.numel() and not _grad_rows(grad, rows, index, want, args, inplace=False):
        grad.index_copy_(0, index, _grad(rows.index_select(0, index), want, _take_rows(args, index, n), inplace=False))
    return grad


def _take_rows(args: tuple, index: torch.Tensor, n: int) -> tuple:
    """The N-sized arguments of ``args`` at the rows ``index``; the others as they are."""
    return tuple(a.reshape(n, *a.shape[1:])[index] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n
                 else a for a in args)


def _grad_rows(out, rows, index, want: tuple, args: tuple, inplace: bool) -> bool:
    """The row kernel: the gradient of the rows ``index`` of ``rows`` written into those rows of
    ``out`` (``rows`` itself in place), no copy of them made. False, nothing written, where the
    backward's prebuilt package is built (the caller gathers the rows for it) or the row kernel
    failed to compile for this kind of call (the caller's path, remembered for the process)."""
    name = _backward_name(inplace, args[8] if len(args) > 8 else None)
    key = (name, want) + _layout(rows)
    if key in _gathered_backward or _aot.built(name, rows, want):
        return False
    # in place, the kernel forms the rows' gradient in a scratch of their size before storing it: a
    # block of them at a time, so that the scratch is reused (no page faults) and stays in cache
    step = max(2, INPLACE_BLOCK_BYTES // (rows.element_size() * rows.shape[1])) if inplace else index.numel()
    try:
        for start in range(0, index.numel(), step):
            pick = _pair(index[start:start + step])
            _run("bwd_rows", out, rows, pick, *_take_rows(args, pick, rows.shape[0]))
    except CompileError as exc:
        with _lock:
            _gathered_backward[key] = str(exc)
        return False
    return True


def _reference_outputs(logits, idx, ignored, inv_t, want_logp, want_entropy, cap) -> tuple:
    """The op's outputs by the reference formulas in the result dtype, differentiable (for a
    double backward): ``idx`` and ``ignored`` as the forward made them; ``cap``, the softcap."""
    lead = logits.shape[:-1]
    outs = kit.reference_outputs(logits, idx.view(lead) if want_logp else None, temperature=1.0 / inv_t,
                                 ignore_index=None, want_logprobs=want_logp, want_entropy=want_entropy, softcap=cap)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if want_logp and ignored is not None:
        outs[0] = outs[0].masked_fill(ignored.view(lead), 0.0)
    return tuple(outs) if want_logp else (None,) + tuple(outs)


def _backward(ctx, g_lp, g_ent) -> Optional[torch.Tensor]:
    """The gradient to the logits of ``g_lp * logprobs + g_ent * entropy`` (either None) from what the
    forward saved: the compiled one-pass kernel (rows of zero upstream gradients skipped), or under
    ``create_graph=True`` a gradient autograd can differentiate again."""
    inv_t, want_logp, want_entropy, inplace, cap = ctx.options
    logits, idx, ignored, m, log_s, h = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
        outputs = lambda: _reference_outputs(logits, idx, ignored, inv_t, want_logp, want_entropy, cap)
        return second_order_gradient(outputs, (logits,), (g_lp, g_ent))[0]
    rows = _rows(logits)
    want = (want_logp, want_entropy)
    args = _grad_args(want, idx, ignored, m, log_s, h, g_lp, g_ent, inv_t, cap)
    skipped = _on_active_rows(rows, want, args, inplace)
    if skipped is not None:
        return logits.detach() if inplace else skipped.view(logits.shape)
    if inplace:
        for index, plane in _planes(rows):
            _grad(plane, want, _take(args, index), inplace=True)
        return logits.detach()  # a fresh alias: autograd keeps it as .grad without a copy
    return _grad(rows, want, args, inplace=False).view(logits.shape)


class _LogSoftmaxOps(torch.autograd.Function):
    """Log-probabilities and/or entropy of logits, backward through the compiled gradient kernel."""

    @staticmethod
    def forward(ctx, logits, labels, inv_t, ignore_index, want_logp, want_entropy, inplace, cap):
        f = _forward(logits, labels, inv_t, ignore_index, want_logp, want_entropy, cap)
        _warm_backward(f.rows, (want_logp, want_entropy), inv_t, inplace, cap)
        ctx.options = (inv_t, want_logp, want_entropy, inplace, cap)
        ctx.save_for_backward(logits, f.idx, f.ignored, f.m, f.log_s, f.entropy)
        outputs = _outputs(f, logits.shape[:-1])
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        _, want_logp, want_entropy, _, _ = ctx.options
        g_lp = grads[0] if want_logp else None
        g_ent = grads[-1] if want_entropy else None
        return (_backward(ctx, g_lp, g_ent),) + (None,) * 7


# --------------------------------------------------------------------------- token_stats
FIELDS = lr.TokenStats._fields
#: The fields only token_stats' own kernel computes (the others come from the ops' kernels).
EXTRA = frozenset({"log_sum_p2", "mean_logit", "is_argmax"})


def _stats_fields(f: _Forward, want: frozenset, inv_t: float, vocab: int) -> dict:
    """The fields asked, flat per row, from one forward: logprobs and entropy exactly as the ops
    compute them (the same tensors), the raw ones their copies."""
    out = {"logprobs": f.logp, "entropy": f.entropy, "max_logit": f.m * inv_t}
    if f.extra:
        total, q, top, at, same = f.extra
        out["mean_logit"] = total * inv_t / vocab
        out["log_sum_p2"] = q.log() - 2.0 * f.log_s
        if "is_argmax" in want:
            first = _first_maximum(f.rows, f.idx, top, at, same)
            out["is_argmax"] = first if f.ignored is None else first & ~f.ignored
    return kit.asked_stats(out, want)


def _first_maximum(rows, idx, top, at, same) -> torch.Tensor:
    """Whether each row's label is torch.argmax of its row (the first maximum; NaN the largest): its
    value ``at`` is the row's max ``top`` and no other column holds it (``same == 1``); the rows
    where it is at a tied max, or NaN, are decided by torch.argmax on those rows alone (exact ties
    are rare, and a NaN label rarer)."""
    first = (at == top) & (same == 1)
    unsure = ((at == top) & (same > 1)) | torch.isnan(at)
    if kit.capturing(unsure):  # no row count on the host: every row
        return torch.where(unsure, rows.argmax(-1, keepdim=True) == idx, first)
    if bool(unsure.any()):
        where = unsure.reshape(-1).nonzero().squeeze(-1)
        picked = rows[torch.unravel_index(where, tuple(rows.shape[:-1]))]  # those rows only, (k, V)
        hit = picked.argmax(-1) == idx.reshape(-1).index_select(0, where)
        first = first.reshape(-1).index_put((where,), hit).view(first.shape)
    return first


def _stats_forward(logits, labels, inv_t, ignore_index, want: frozenset, cap) -> _Forward:
    want_logp, want_entropy = kit.stats_asked(want)
    return _forward(logits, labels, inv_t, ignore_index, want_logp, want_entropy, cap, stats=bool(want & EXTRA))


class _TokenStats(torch.autograd.Function):
    """token_stats' fields (all eight, None where not asked), backward through the ops' gradient kernel."""

    @staticmethod
    def forward(ctx, logits, labels, inv_t, ignore_index, want, cap):
        f = _stats_forward(logits, labels, inv_t, ignore_index, want, cap)
        want_logp, want_entropy = f.logp is not None, f.entropy is not None
        _warm_backward(f.rows, (want_logp, want_entropy), inv_t, False, cap)
        ctx.options = (inv_t, want_logp, want_entropy, False, cap)
        ctx.save_for_backward(logits, f.idx, f.ignored, f.m, f.log_s, f.entropy)
        ctx.set_materialize_grads(False)
        lead = logits.shape[:-1]
        named = _stats_fields(f, want, inv_t, logits.shape[-1])
        outs = tuple(None if n not in named else named[n].view(labels.shape if n in kit.LABEL_STATS else lead)
                     for n in FIELDS)
        ctx.mark_non_differentiable(*kit.fixed_stats(outs))
        return outs

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        g_lp, g_ent = kit.stats_gradients(grads)
        if g_lp is None and g_ent is None:
            return (None,) * 6
        return (_backward(ctx, g_lp, g_ent),) + (None,) * 5


def token_stats(logits, labels, outputs, temperature, ignore_index, softcap=None) -> "lr.TokenStats":
    """compiled's token_stats over logits: one forward kernel per block of rows (the entropy's, or
    with mean_logit, log_sum_p2 or is_argmax token_stats' own, which computes the entropy's
    statistics by the same expressions); the gradient through the ops' one-pass kernel."""
    want = frozenset(outputs) - (kit.LABEL_STATS if labels is None else frozenset())
    if logits.numel() == 0:  # nothing to compile for
        got = kit.reference_function("token_stats")(logits, labels, outputs=tuple(want), temperature=temperature,
                                                    ignore_index=ignore_index, softcap=softcap,
                                                    dtype=result_dtype(logits.dtype))
        return lr.TokenStats(**{k: v for k, v in got.items() if k in want})
    inv_t = 1.0 / temperature
    if torch.is_grad_enabled() and logits.requires_grad and want & kit.DIFFERENTIABLE_STATS:
        return lr.TokenStats(*_TokenStats.apply(logits, labels, inv_t, ignore_index, want, softcap))
    f = _stats_forward(logits, labels, inv_t, ignore_index, want, softcap)
    lead = logits.shape[:-1]
    named = _stats_fields(f, want, inv_t, logits.shape[-1])
    return lr.TokenStats(**{n: v.view(labels.shape if n in kit.LABEL_STATS else lead) for n, v in named.items()})


def apply(logits, labels, temperature, ignore_index, want_logp, want_entropy, inplace, softcap=None):
    if logits.numel() == 0:  # nothing to compile for
        return kit.reference_outputs(logits, labels, temperature=temperature, ignore_index=ignore_index,
                           want_logprobs=want_logp, want_entropy=want_entropy, softcap=softcap)
    inv_t = 1.0 / temperature
    if torch.is_grad_enabled() and logits.requires_grad:
        inplace = inplace and not _overlapping(logits)  # then honoured out of place
        return _LogSoftmaxOps.apply(logits, labels, inv_t, ignore_index, want_logp, want_entropy, inplace, softcap)
    outputs = _outputs(_forward(logits, labels, inv_t, ignore_index, want_logp, want_entropy, softcap),
                       logits.shape[:-1])
    return outputs if len(outputs) > 1 else outputs[0]


def reset() -> None:
    """Forget every warm-up and eager-backward decision (with :func:`._kernels.reset`)."""
    with _lock:
        _warm.clear()
        _eager_backward.clear()
        _gathered_backward.clear()
