"""Labels of a next-token objective in the layouts of distributed training: ``next_token_labels``.

``labels[t] = input_ids[t + offset]`` (``offset`` 1: the next token; more for a multi-token-prediction
head) when ``t + offset`` is in the same sequence, else ``ignore_index``, so
``lr.logprobs_from_logits(logits, labels, ignore_index=-100)`` (any op, with or without
``process_group=``) needs no ``logits[:, :-1]`` slice and no hand-made shift (docs/layouts.md).

Sequences are the rows of a ``(B, T)`` batch, or the sequences of a packed stream ``(T,)`` /
``(1, T)`` cut by ``cu_seqlens`` or by ``position_ids`` (0 starts a sequence). With ``cp_group``
(context parallel) this rank holds only part of the sequence dimension, in the "contiguous" or the
"zigzag" layout (TransformerEngine's THD layout); ``cu_seqlens`` / ``position_ids`` then describe
the global stream, the same on every rank.

How a context-parallel call runs:

1. every rank validates its input and works out, from the global sequence boundaries alone, which
   global positions it holds (:func:`_positions`), which of its positions need the next token from
   another rank, and which of its tokens another rank needs (one per chunk boundary and row);
2. one small int64 all-gather (the header): every rank's error, if it met one, and what must agree
   (layout, shape, ``ignore_index``, a checksum of the boundaries); every rank raises the same
   error, or none, before anything could hang (the convention of :mod:`.distributed.header`);
3. one point-to-point exchange (``batch_isend_irecv``) with the ranks holding the tokens: those
   within ``offset`` of the chunk boundaries, ``offset`` int64 per boundary and row, nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Union

import torch

from .distributed.header import ERRORS, MESSAGE_BYTES, GroupMismatchError, checksums

LAYOUTS = ("contiguous", "zigzag")
_MAGIC = 0x6C70_7267_4E55  # "lprg" "NU": the next_token_labels header, protocol version 2 (with the offset)
(_MAGIC_, _ERROR, _LENGTH, _LAYOUT, _ROWS, _LOCAL, _IGNORE, _MODE, _SUM1, _SUM2, _OFFSET, _MESSAGE) = range(12)
_WIDTH = _MESSAGE + MESSAGE_BYTES // 8
_MODES = ("rows", "cu_seqlens", "position_ids")

_exchanged = [0]  # bytes this process received through the boundary exchange (see exchanged())


def exchanged(reset: bool = False) -> int:
    """Bytes this process has received through the boundary exchange of context-parallel calls (the
    header not counted: ``_WIDTH * 8`` bytes per other rank and call); ``reset`` sets it back to 0."""
    value = _exchanged[0]
    if reset:
        _exchanged[0] = 0
    return value


def next_token_labels(input_ids: torch.Tensor, *, cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                      position_ids: Optional[torch.Tensor] = None, ignore_index: int = -100,
                      cp_group: object = None, cp_layout: str = "contiguous", offset: int = 1) -> torch.Tensor:
    """The labels of a next-token objective: int64, of ``input_ids``' shape and device.

    ``labels[t] = input_ids[t + offset]`` when ``t + offset`` is in the same sequence, else
    ``ignore_index`` (the last ``offset`` positions of every sequence, never a token of the next
    sequence). ``offset``: an int >= 1; 1 is the next token, ``k`` the token a multi-token-prediction
    head's ``k``-th depth scores.

    - ``input_ids``: integer ``(B, T)`` (each row a sequence, unless ``position_ids`` cut it), or a
      packed stream ``(T,)`` / ``(1, T)``.
    - ``cu_seqlens``: integer ``(S + 1,)``: 0, then non-decreasing (empty sequences allowed), ending
      at the stream's global length. Packed streams only.
    - ``position_ids``: integers of the stream's (global) shape, ``(T,)`` / ``(1, T)`` or ``(B, T)``;
      a 0 starts a sequence. Not together with ``cu_seqlens``.
    - ``cp_group``: a process group over which the sequence dimension is split; this rank passes its
      part of ``input_ids``, and ``cu_seqlens`` / ``position_ids`` of the global stream (the same on
      every rank). ``cp_layout``: "contiguous" (rank r holds the r-th of cp equal pieces) or
      "zigzag" (each sequence, of a length that is a multiple of 2 cp, cut into 2 cp equal chunks;
      rank r holds chunks r and 2 cp - 1 - r, in that order, sequence after sequence). A ``(B, T)``
      batch is cut along T, each row like one sequence. Without ``cp_group`` the layout is not used.

    Bad input raises a clear error (TypeError, ValueError); with ``cp_group`` on every rank, the
    same, before any exchange.
    """
    if cp_group is None:
        return _labels(_plan(input_ids, cu_seqlens, position_ids, ignore_index, cp_layout, 1, 0, False, offset), None)
    from .distributed.group import resolve

    group = resolve(cp_group)  # raises at once, on this rank only: a non-member takes part in nothing
    try:
        plan: Union[_Plan, BaseException] = _plan(input_ids, cu_seqlens, position_ids, ignore_index, cp_layout,
                                                  group.size, group.rank, True, offset)
    except Exception as exc:  # raised on every rank after the header
        plan = exc
    device = group.device_for(input_ids if isinstance(input_ids, torch.Tensor) else None)
    _agree(group, plan, device)
    assert isinstance(plan, _Plan)
    return _labels(plan, group, device)


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class _Plan:
    """What this rank knows before any communication (all index tensors on the CPU)."""

    ids: torch.Tensor             # (B, T_local) view of input_ids
    shape: tuple                  # input_ids' shape
    ignore_index: int
    layout: int                   # index in LAYOUTS
    mode: int                     # index in _MODES
    description: torch.Tensor     # cu_seqlens or position_ids (int64, CPU), for the checksum
    next_local: torch.Tensor      # (T_local,) bool: the token offset ahead is this rank's
    next_index: torch.Tensor      # (T_local,) int64: its local position there
    ignore: torch.Tensor          # (1 or B, T_local) bool: a sequence starts within offset ahead, or the end
    offset: int = 1
    recv: Dict[int, torch.Tensor] = field(default_factory=dict)  # peer -> local positions whose next token it holds
    send: Dict[int, torch.Tensor] = field(default_factory=dict)  # peer -> local positions of tokens it needs


def _integer(x: object, name: str) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
            raise TypeError(f"{name} must hold integers, got {x!r}")
        return torch.tensor(list(x), dtype=torch.int64)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x.detach().to("cpu", torch.int64)


def _plan(input_ids, cu_seqlens, position_ids, ignore_index, cp_layout, cp: int, rank: int, grouped: bool,
          offset: int = 1) -> _Plan:
    ids = input_ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"input_ids must be an integer tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"input_ids must be an integer tensor (token ids), got dtype {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be (T,) (a packed stream), (1, T) or (B, T), got shape {tuple(ids.shape)}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"offset must be an int >= 1 (how many tokens ahead the label is), got "
                        f"{type(offset).__name__}")
    if offset < 1:
        raise ValueError(f"offset must be >= 1 (1: the next token; k: the token k positions ahead, as a "
                         f"multi-token-prediction head scores), got {offset}")
    if cp_layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {', '.join(map(repr, LAYOUTS))}, got {cp_layout!r}")
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give cu_seqlens or position_ids, not both: each alone says where the sequences start")
    rows2 = ids.reshape(1, -1) if ids.dim() == 1 else ids
    batch, local = rows2.shape
    total = cp * local  # the global length of each row (of the stream)
    where = (f"the global stream ({cp} ranks x {local} tokens on this rank = {total})" if grouped
             else f"the stream ({total} tokens)")
    zigzag = grouped and cp_layout == "zigzag"

    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens cuts a packed stream, (T,) or (1, T); input_ids has shape "
                             f"{tuple(ids.shape)}: pass the rows of a batch without cu_seqlens, or pack them")
        cu = _integer(cu_seqlens, "cu_seqlens")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"cu_seqlens must be 1-D (S + 1,), got shape {tuple(cu.shape)}")
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
        steps = cu.diff()
        if bool((steps < 0).any()):
            i = int((steps < 0).nonzero()[0, 0])
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = {int(cu[i + 1])} < "
                             f"cu_seqlens[{i}] = {int(cu[i])}")
        if int(cu[-1]) != total:
            hint = ("; cu_seqlens describes the global stream, the same on every rank"
                    if grouped and int(cu[-1]) == local and cp > 1 else "")
            raise ValueError(f"cu_seqlens must end at the length of {where}, got {int(cu[-1])}{hint}")
        mode, description, segments = 1, cu, cu
        boundary = torch.zeros(1, total + 1, dtype=torch.bool)
        boundary[0, cu] = True
    elif position_ids is not None:
        pos = _integer(position_ids, "position_ids")
        shapes = [(total,), (1, total)] if batch == 1 else [(batch, total)]
        if tuple(pos.shape) not in shapes:
            hint = ""
            if grouped and cp > 1 and pos.shape[-1:] == (local,):
                hint = (f"; with cp_group, position_ids describe the global stream (the same on every rank), of "
                        f"length {total}, not this rank's {local} positions")
            raise ValueError(f"position_ids must have the shape {' or '.join(map(str, shapes))} of {where}, "
                             f"got {tuple(pos.shape)}{hint}")
        pos = pos.reshape(-1, total)
        mode, description = 2, pos
        boundary = torch.ones(pos.shape[0], total + 1, dtype=torch.bool)
        boundary[:, :total] = pos == 0
        if batch == 1:  # a packed stream: its sequences are also the layout's segments
            starts = (pos[0] == 0).nonzero().flatten()
            segments = torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([total])]).unique()
        else:
            segments = torch.tensor([0, total])
    else:
        mode, description = 0, torch.zeros(0, dtype=torch.int64)
        segments = torch.tensor([0, total])
        boundary = torch.zeros(1, total + 1, dtype=torch.bool)
        boundary[0, segments] = True

    lengths = segments.diff()
    if zigzag and bool((lengths % (2 * cp)).any()):
        i = int((lengths % (2 * cp) != 0).nonzero()[0, 0])
        what = f"sequence {i}" if mode and batch == 1 else "each row"
        raise ValueError(f"the zigzag layout cuts each sequence into 2 * cp = {2 * cp} equal chunks, but {what} "
                         f"has {int(lengths[i])} tokens, not a multiple of {2 * cp}; pad each sequence to a multiple "
                         f"of {2 * cp} (as TransformerEngine's THD layout requires), or use cp_layout='contiguous'")

    gpos = _positions(segments, lengths, cp, rank, local, zigzag)
    segment = torch.searchsorted(segments, gpos, right=True) - 1  # the layout segment of each position
    seg_start, seg_end = segments[segment], segments[(segment + 1).clamp(max=segments.numel() - 1)]
    ahead, behind = gpos + offset, gpos - offset
    index = torch.searchsorted(gpos, ahead).clamp(max=max(local - 1, 0))
    next_local = (ahead < seg_end) & (gpos[index] == ahead) if local else torch.zeros(0, dtype=torch.bool)
    held_behind = torch.searchsorted(gpos, behind).clamp(max=max(local - 1, 0))
    prev_local = (behind >= seg_start) & (gpos[held_behind] == behind) if local else next_local
    marks = boundary.to(torch.int64).cumsum(1)  # a sequence start (or the end) within (g, g + offset]: ignored
    ignore = marks[:, ahead.clamp(max=total)] - marks[:, gpos] > 0
    plan = _Plan(rows2, tuple(ids.shape), ignore_index, LAYOUTS.index(cp_layout), mode, description,
                 next_local, index, ignore, offset)
    if cp > 1:
        recv = (~next_local & (ahead < seg_end)).nonzero().flatten()
        send = (~prev_local & (behind >= seg_start)).nonzero().flatten()
        source = _owner(ahead[recv], segments, lengths, cp, local, zigzag)
        target = _owner(behind[send], segments, lengths, cp, local, zigzag)
        for peer in sorted(set(source.tolist())):
            plan.recv[peer] = recv[source == peer]
        for peer in sorted(set(target.tolist())):
            plan.send[peer] = send[target == peer]
    return plan


def _positions(segments: torch.Tensor, lengths: torch.Tensor, cp: int, rank: int, local: int,
               zigzag: bool) -> torch.Tensor:
    """The global positions of this rank's ``local`` positions (int64, increasing)."""
    if not zigzag:
        return rank * local + torch.arange(local)
    chunk = lengths // (2 * cp)
    which = torch.tensor([rank, 2 * cp - 1 - rank])
    starts = (segments[:-1, None] + which[None, :] * chunk[:, None]).flatten()
    sizes = chunk.repeat_interleave(2)
    offsets = torch.cumsum(sizes, 0) - sizes
    return torch.repeat_interleave(starts - offsets, sizes, output_size=local) + torch.arange(local)


def _owner(g: torch.Tensor, segments: torch.Tensor, lengths: torch.Tensor, cp: int, local: int,
           zigzag: bool) -> torch.Tensor:
    """The rank that holds each global position in ``g``."""
    if not zigzag:
        return g // local
    i = torch.searchsorted(segments[1:], g, right=True)
    k = (g - segments[i]) // (lengths[i] // (2 * cp))
    return torch.where(k < cp, k, 2 * cp - 1 - k)


# ---------------------------------------------------------------------------------------------- header
def _row(plan: Union[_Plan, BaseException]) -> torch.Tensor:
    values = [0] * _WIDTH
    values[_MAGIC_] = _MAGIC
    if isinstance(plan, BaseException):
        code = next((c for c, kind in ERRORS.items() if type(plan) is kind), None)
        if code is None:
            code = next((c for c, kind in ERRORS.items() if isinstance(plan, kind)), 5)
        text = str(plan) or type(plan).__name__
        if not isinstance(plan, tuple(ERRORS.values())):
            text = f"{type(plan).__name__}: {text}"
        raw = text.encode("utf-8")[:MESSAGE_BYTES]
        values[_ERROR], values[_LENGTH] = code, len(raw)
        values[_MESSAGE:] = struct.unpack(f"<{MESSAGE_BYTES // 8}q", raw + b"\0" * (MESSAGE_BYTES - len(raw)))
        return torch.tensor(values, dtype=torch.int64)
    values[_LAYOUT], values[_ROWS], values[_LOCAL] = plan.layout, plan.ids.shape[0], plan.ids.shape[1]
    values[_IGNORE], values[_MODE], values[_OFFSET] = plan.ignore_index, plan.mode, plan.offset
    if plan.description.numel():
        values[_SUM1], values[_SUM2] = checksums(plan.description).tolist()
    return torch.tensor(values, dtype=torch.int64)


def _agree(group, plan: Union[_Plan, BaseException], device: torch.device) -> None:
    """The header: every rank raises the same error, or none."""
    table = group.all_gather(_row(plan), device).cpu().tolist()
    local_error = plan if isinstance(plan, BaseException) else None
    for r, row in enumerate(table):
        if row[_MAGIC_] == _MAGIC and row[_ERROR]:
            raw = struct.pack(f"<{MESSAGE_BYTES // 8}q", *row[_MESSAGE:])[:row[_LENGTH]]
            kind = ERRORS.get(row[_ERROR], RuntimeError)
            raise kind(f"rank {r} of cp_group: {raw.decode('utf-8', errors='replace')}") from local_error
    bad = [r for r, row in enumerate(table) if row[_MAGIC_] != _MAGIC]
    if bad:
        raise GroupMismatchError(f"ranks {bad} run another version of logprob-registry's next_token_labels "
                                 "protocol; install the same logprob-registry version on every rank")
    checks = ((_LAYOUT, "cp_layout", lambda v: LAYOUTS[v]), (_ROWS, "the number of rows of input_ids", str),
              (_LOCAL, "the number of positions per rank (every rank holds T / cp of the sequence dim)", str),
              (_IGNORE, "ignore_index", str), (_MODE, "how sequences are given", lambda v: _MODES[v]),
              (_OFFSET, "offset", str))
    for column, what, show in checks:
        others = [r for r, row in enumerate(table) if row[column] != table[0][column]]
        if others:
            raise GroupMismatchError(f"ranks {others} disagree with rank 0 on {what} (rank 0: "
                                     f"{show(table[0][column])}, rank {others[0]}: {show(table[others[0]][column])})"
                                     "; every rank of cp_group must make the same call")
    others = [r for r, row in enumerate(table) if row[_SUM1:_SUM2 + 1] != table[0][_SUM1:_SUM2 + 1]]
    if others:
        raise GroupMismatchError(f"ranks {others} pass other {_MODES[table[0][_MODE]]} than rank 0 (their checksums "
                                 "differ); with cp_group, pass those of the global stream, the same on every rank")


# ---------------------------------------------------------------------------------------------- labels
def _labels(plan: _Plan, group, device: Optional[torch.device] = None) -> torch.Tensor:
    ids = plan.ids
    out = torch.full(ids.shape, plan.ignore_index, dtype=torch.int64, device=ids.device)
    here = plan.next_local.nonzero().flatten()
    out[:, here.to(ids.device)] = ids[:, plan.next_index[here].to(ids.device)].long()
    if group is not None and (plan.recv or plan.send):
        import torch.distributed as dist

        operations, received = [], {}
        for peer, positions in plan.send.items():
            buffer = ids[:, positions.to(ids.device)].to(device, torch.int64).contiguous()
            operations.append(dist.P2POp(dist.isend, buffer, dist.get_global_rank(group.handle, peer), group.handle))
        for peer, positions in plan.recv.items():
            received[peer] = torch.empty((ids.shape[0], positions.numel()), dtype=torch.int64, device=device)
            operations.append(dist.P2POp(dist.irecv, received[peer], dist.get_global_rank(group.handle, peer),
                                         group.handle))
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        for peer, positions in plan.recv.items():
            out[:, positions.to(ids.device)] = received[peer].to(ids.device)
            _exchanged[0] += received[peer].numel() * 8
    out.masked_fill_(plan.ignore.to(ids.device), plan.ignore_index)
    return out.reshape(plan.shape)
