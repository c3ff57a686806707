"""The header: one small int64 all-gather that makes every rank raise the same error, or none,
before any collective that could hang.

Each rank writes what it was asked and what it found into a fixed row of int64 (:class:`Local`),
including an error it met before this point (bad input, a backend that failed), encoded as a type
code and the message's bytes instead of being raised. After the gather every rank checks the same
``(W, LENGTH)`` table with the same code (:func:`check`), so every rank raises the same exception
with the same message, or learns the layout of the vocabulary (:class:`Layout`). Then the stats
gather follows, which every rank reaches.

What is compared across ranks: the op and its flags, the rows and the leading shape, the labels (two
position-weighted modular checksums), the temperature's bits, ``ignore_index``, the tile, the input
dtype and, for ``logprobs_from_hidden``, the hidden size, bias presence and which gradients are
needed. The shards must tile ``[0, V)`` without gap or overlap.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .. import config
from ..dtypes import FLOAT_DTYPES, dtype_name
from ..opspec import op_of_code, wire_code
from ..registry.errors import NoEligibleBackendError
from .tiles import grid_slots

MAGIC = 0x6C70_7267_0003  # "lprg", protocol version 3: ranks running another version are told so
MESSAGE_BYTES = 400
(MAGIC_, OP, FLAGS, ROWS, SHAPE, WIDTH, START, TILE, TEMPERATURE, IGNORE, LABELS1, LABELS2, DTYPE, HIDDEN,
 SOFTCAP, TOP_K, KEEP, LOGITS_DTYPE, MIN_P, TOP_P, ERROR, MESSAGE_LENGTH, MESSAGE) = range(23)
#: The sampler's columns, what each holds, for the message of a disagreement.
SAMPLER_COLUMNS = ((SOFTCAP, "softcap (its float64 bits; 0: none)"),
                   (TOP_K, "top_k (the number; for a per-row tensor a checksum of its values; 0: none)"),
                   (KEEP, "keep (a checksum of the global ids; -1: a mask, whose shards differ; 0: none)"),
                   (LOGITS_DTYPE, "logits_dtype (0: none, 1: bfloat16, 2: float16), candidate labels' K or "
                                  "topk_logprobs' k (times 4); all times 3 plus the sampler's order (0: vllm, 1: hf, "
                                  "2: sglang)"),
                   (MIN_P, "min_p (its float64 bits; for a per-row tensor a checksum of its bits; 0: none)"),
                   (TOP_P, "top_p (its float64 bits; for a per-row tensor a checksum of its bits; 0: none)"))
LENGTH = MESSAGE + MESSAGE_BYTES // 8

# flags
(WANT_LOGPROBS, WANT_ENTROPY, HAS_LABELS, START_GIVEN, HAS_BIAS, GRAD, GRAD_HIDDEN,
 HAS_IGNORE) = (1 << i for i in range(8))
# kl_divergence's (HAS_LABELS: a mask, whose checksum is compared; HIDDEN: the student's hidden size)
KL_REVERSE, TEACHER_HIDDEN = 1 << 8, 1 << 9

_DTYPES = (None,) + tuple(FLOAT_DTYPES)  # code 0: not known (the input was not a float tensor)

#: Exception types carried through the header, by code; any other exception travels as RuntimeError.
ERRORS = {1: TypeError, 2: ValueError, 3: config.ConfigError, 4: NoEligibleBackendError, 5: RuntimeError,
          6: NotImplementedError}
_PRIMES = ((2147483629, 40503, 2654435761 % 2147483629), (2147483587, 69069, 362437))


class GroupMismatchError(ValueError):
    """The ranks of a group disagree about a call (labels, shapes, options) or their shards do not
    tile the vocabulary."""


@dataclass
class Local:
    """One rank's side of a call, as written into its header row."""

    op: str
    flags: int = 0
    rows: int = 0
    shape: tuple = ()
    width: int = 0
    start: int = 0
    tile: int = 0
    temperature: float = 1.0
    ignore_index: int = 0
    dtype: Optional[torch.dtype] = None
    hidden: int = 0
    labels: Optional[torch.Tensor] = None  # validated labels, for the checksum
    error: Optional[BaseException] = None
    labels_name: str = "labels"  # what ``labels`` is, for the message (kl_divergence: its mask)
    sampler: tuple = (0, 0, 0, 0, 0, 0)  # the SAMPLER_COLUMNS' values (see sampled.header_values)


@dataclass(frozen=True)
class Layout:
    """What the header told every rank: where each shard lies, and the global vocabulary."""

    starts: tuple     # per rank
    widths: tuple     # per rank
    order: tuple      # ranks sorted by their shard's start
    vocab: int        # sum of the widths
    rows: int
    tile: int

    @property
    def slots(self) -> tuple:
        """Tiles of the global grid each rank's shard meets."""
        return tuple(grid_slots(s, w, self.tile) for s, w in zip(self.starts, self.widths))

    @property
    def aligned(self) -> bool:
        """Whether every shard starts at a multiple of the tile: no grid tile is shared."""
        return all(s % self.tile == 0 for s in self.starts)

    def shared(self, rank: int) -> tuple:
        """Whether the first and the last grid tile of ``rank``'s shard are shared with another rank."""
        start, end = self.starts[rank], self.starts[rank] + self.widths[rank]
        return start % self.tile != 0, end % self.tile != 0 and end != self.vocab

    def first_tile(self, rank: int) -> int:
        """The global index of the first grid tile of ``rank``'s shard."""
        return self.starts[rank] // self.tile


def checksums(labels: torch.Tensor) -> torch.Tensor:
    """Two position-weighted modular checksums of ``labels`` (int64, on their device): exact
    integer arithmetic, so equal labels give equal sums on any device, and a single changed label
    or two swapped ones change them."""
    lab = labels.reshape(-1).long()
    i = torch.arange(lab.numel(), device=lab.device, dtype=torch.int64)
    out = []
    for p, a, b in _PRIMES:
        weight = (i * a + b) % p
        out.append((((lab % p) * weight) % p).sum() % p)
    return torch.stack(out)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def temperature_code(temperature) -> int:
    """The header's temperature column: a number's float64 bits (>= 0: validation keeps it positive),
    or for a per-row tensor ``-1 - `` a position-weighted checksum of its float32 bits
    (:func:`checksums`: one cheap pass; a single changed or two swapped rows change it)."""
    if isinstance(temperature, torch.Tensor):
        bits = temperature.detach().to(torch.float32).contiguous().view(torch.int32)
        return -1 - int(checksums(bits)[0])
    return _float_bits(temperature)


def _temperature_shown(code: int):
    if code < 0:
        return f"<per-row tensor, checksum {-1 - code}>"
    return struct.unpack("<d", struct.pack("<q", code))[0]


def _shape_code(shape: Sequence[int]) -> int:
    code = 1469598103934665603  # FNV-1a over the sizes, kept in int64
    for size in (len(shape), *shape):
        code = ((code ^ int(size)) * 1099511628211) % (1 << 63)
    return code


def row(local: Local, device: torch.device) -> torch.Tensor:
    """This rank's header row (int64, ``LENGTH``) on ``device``."""
    values = [0] * LENGTH
    values[MAGIC_] = MAGIC
    values[OP] = wire_code(local.op)
    values[FLAGS] = local.flags
    values[ROWS] = local.rows
    values[SHAPE] = _shape_code(local.shape)
    values[WIDTH] = local.width
    values[START] = local.start
    values[TILE] = local.tile
    values[TEMPERATURE] = temperature_code(local.temperature)
    values[IGNORE] = local.ignore_index
    values[DTYPE] = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else 0
    values[HIDDEN] = local.hidden
    for (column, _), value in zip(SAMPLER_COLUMNS, local.sampler):
        values[column] = int(value)
    if local.error is not None:
        code = next((c for c, kind in ERRORS.items() if type(local.error) is kind), None)
        if code is None:
            code = next((c for c, kind in ERRORS.items() if isinstance(local.error, kind)), 5)
        text = _error_text(local.error).encode("utf-8")[:MESSAGE_BYTES]
        values[ERROR] = code
        values[MESSAGE_LENGTH] = len(text)
        padded = text + b"\0" * (MESSAGE_BYTES - len(text))
        values[MESSAGE:] = list(struct.unpack(f"<{MESSAGE_BYTES // 8}q", padded))
    h = torch.tensor(values, dtype=torch.int64).to(device)
    if local.error is None and local.labels is not None and local.labels.numel():
        h[LABELS1:LABELS2 + 1] = checksums(local.labels).to(device)
    return h


def _error_text(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if type(error) not in ERRORS.values() and not any(isinstance(error, k) for k in ERRORS.values()):
        text = f"{type(error).__name__}: {text}"
    return text


def _message(table: torch.Tensor, rank: int) -> str:
    length = int(table[rank, MESSAGE_LENGTH])
    raw = struct.pack(f"<{MESSAGE_BYTES // 8}q", *(int(x) for x in table[rank, MESSAGE:]))
    return raw[:length].decode("utf-8", errors="replace")


def check(table: torch.Tensor, local: Local) -> Layout:
    """Check the gathered header ``table`` (W, LENGTH) on the CPU: every rank runs this on the same
    table, so every rank raises the same exception, or returns the same :class:`Layout`.

    The first error wins, in this order: an error a rank met before the gather (the lowest rank's),
    another protocol version, a disagreement about the call, shards that do not tile the vocabulary.
    ``local`` is this rank's row, to chain its own exception as the cause on the rank that met it.
    """
    t = table.tolist()
    size = len(t)
    for r in range(size):
        if t[r][ERROR]:
            kind = ERRORS.get(t[r][ERROR], RuntimeError)
            text = f"rank {r} of the process group: {_message(table, r)}"
            raise kind(text) from (local.error if local.error is not None else None)
    bad = [r for r in range(size) if t[r][MAGIC_] != MAGIC]
    if bad:
        raise GroupMismatchError(f"ranks {bad} run another version of logprob-registry's distributed protocol "
                                 "than rank 0; install the same logprob-registry version on every rank")

    def disagree(column: int, what: str, show=lambda x: x, hint: str = "") -> None:
        others = [r for r in range(size) if t[r][column] != t[0][column]]
        if others:
            r = others[0]
            raise GroupMismatchError(
                f"ranks {others} disagree with rank 0 on {what} (rank 0: {show(t[0][column])}, rank {r}: "
                f"{show(t[r][column])}); every rank of process_group must make the same call{hint}")

    disagree(OP, "the op", op_of_code)
    given = [r for r in range(size) if t[r][FLAGS] & START_GIVEN]
    if given and len(given) < size:
        raise GroupMismatchError(
            f"vocab_start was given on ranks {given} but not on ranks "
            f"{[r for r in range(size) if r not in given]}; give it on every rank or on none")
    disagree(FLAGS, "the call's options (outputs, labels, vocab_start given or not, bias, gradients, "
                    "ignore_index given or not)", _describe_flags)
    disagree(ROWS, "the number of rows (positions)")
    disagree(SHAPE, "the shape of the leading dims", lambda _: "see that rank's input")
    disagree(DTYPE, "the input dtype", lambda code: dtype_name(_DTYPES[code]) if code else "?")
    disagree(HIDDEN, "the hidden size")
    disagree(TILE, "the tile size")
    disagree(TEMPERATURE, "the temperature", _temperature_shown)
    for column, what in SAMPLER_COLUMNS:
        disagree(column, f"the sampler's {what}")
    if t[0][FLAGS] & HAS_IGNORE:
        disagree(IGNORE, "ignore_index")
    for column in (LABELS1, LABELS2):
        others = [r for r in range(size) if t[r][column] != t[0][column]]
        if others:
            if local.labels_name != "labels":
                raise GroupMismatchError(
                    f"the {local.labels_name} differs across the group: ranks {others} hold another "
                    f"{local.labels_name} than rank 0 (their checksums differ); pass the same one on every rank")
            raise GroupMismatchError(
                f"the labels differ across the group: ranks {others} hold other labels than rank 0 (their "
                "checksums differ); pass the same global label ids (not shard-local ones) on every rank")
    return _layout(t, size)


def _describe_flags(flags: int) -> str:
    names = ("logprobs", "entropy", "labels", "vocab_start given", "bias", "gradients", "hidden gradient",
             "ignore_index given", "kl_divergence reverse", "kl_divergence teacher hidden")
    return "{" + ", ".join(n for i, n in enumerate(names) if flags & (1 << i)) + "}"


def _layout(t: List[list], size: int) -> Layout:
    widths = tuple(t[r][WIDTH] for r in range(size))
    starts = tuple(t[r][START] for r in range(size))
    vocab = sum(widths)
    if not t[0][FLAGS] & START_GIVEN and len(set(widths)) > 1:
        raise GroupMismatchError(
            f"the vocabulary shards have different widths ({', '.join(f'rank {r}: {w}' for r, w in enumerate(widths))})"
            " and vocab_start was not given, so each shard's place is unknown; pass vocab_start= (the global id of "
            "the shard's first column) on every rank")
    for r in range(size):
        if starts[r] >= vocab:
            raise GroupMismatchError(
                f"rank {r}: vocab_start={starts[r]} is outside the vocabulary of {vocab} columns (the sum of the "
                "shards' widths); give each rank the global id of its shard's first column")
    order = tuple(sorted(range(size), key=lambda r: (starts[r], r)))
    position = 0
    for r in order:
        if starts[r] != position:
            what = (f"leaves columns [{position}, {starts[r]}) to no rank" if starts[r] > position
                    else f"overlaps the columns [{starts[r]}, {position}) of another rank")
            raise GroupMismatchError(
                f"the vocabulary shards do not tile [0, {vocab}): rank {r}'s shard starts at {starts[r]} and "
                f"{what}; each rank's vocab_start must be the sum of the widths of the shards before it")
        position += widths[r]
    return Layout(starts, widths, order, vocab, t[0][ROWS], t[0][TILE])
