"""The conformance section of the peers' known failures: each case is a way a kernel in the field
has departed from the contract, named after the issue it comes from (:data:`PEER_ISSUES`), and
kept small (a few rows) so that the CPU run stays quick.

``check --against`` runs these against foreign functions; every backend runs them too.
"""

from __future__ import annotations

import math

import pytest
import torch

from logprob_registry.numerics import assert_close, tolerances

from ..harness import LABEL_OPS, LOGITS_OPS, Harness
from ._coverage import covers
from .hidden import OP as HIDDEN
from .hidden import check_hidden
from .logits import _compare_gradients

#: The issue each ``test_peer_*`` case comes from (``check --against`` prints it with a departure).
#: Cases of no one issue cite this project's #35 with the failure class.
PEER_ISSUES = {
    "test_peer_vocab_not_multiple_of_1024": "verl#2899",
    "test_peer_hidden_vocab_not_multiple_of_1024": "verl#2899",
    "test_peer_logprob_not_positive": "verl#2656",
    "test_peer_hidden_logprob_not_positive": "verl#2656",
    "test_peer_all_negative_rows": "#35: rows of only negative logits",
    "test_peer_all_equal_rows": "#35: rows of equal logits",
    "test_peer_bf16_temperature": "#35: temperature divided in bf16 before the kernel",
    "test_peer_row_shards": "verl#3723",
    "test_peer_hidden_row_shards": "verl#3723",
    "test_peer_offset_views": "#35: non-contiguous and offset views",
    "test_peer_ignored_then_active": "#35: an ignored row followed by active ones",
    "test_peer_hidden_ignored_then_active": "#35: an ignored row followed by active ones",
    "test_peer_last_row": "#35: the last row of a tile (off by one)",
    "test_peer_repeated_runs": "#35: nondeterministic reductions",
}
#: Vocabularies that are no multiple of 256 nor 1024 (Qwen2's 151936, a 129920 of padded heads).
ODD_VOCABS = (129920, 151936)
ROWS = 3


def _check(lp: Harness, op: str, x: torch.Tensor, y: torch.Tensor, what: str, **options) -> tuple:
    got = lp.call(op, x, y, **options)
    want = lp.reference(op, x, y, **options)
    temperature = options.get("temperature", 1.0)
    for i, (g, w, tol) in enumerate(zip(got, want, tolerances(op, x, temperature))):
        assert g.dtype == lp.result_dtype(x.dtype), f"{op} output {i}, {what}: {g.dtype}"
        assert_close(g, w, tol, f"{op} output {i}, {what}")
    return got


def _hidden_inputs(lp: Harness, rows: int, vocab: int, h: int = 16, seed: int = 0, bias: bool = False):
    hidden = lp.logits((rows, h), scale=2.0, seed=seed)
    weight = lp.logits((vocab, h), scale=3.0 / math.sqrt(h), seed=seed + 1)
    b = lp.logits((vocab,), scale=1.0, seed=seed + 2) if bias else None
    labels = lp.labels((rows,), vocab, seed=seed + 3)
    return hidden, weight, b, labels


class PeersSection:
    """The peers' known failures (a mixin of :class:`~logprob_registry.testing.BackendConformance`)."""

    # ----------------------------------------------------------- verl#2899
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("vocab", ODD_VOCABS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_vocab_not_multiple_of_1024(self, lp: Harness, op: str, vocab: int) -> None:
        """verl#2899: a vocabulary that is no multiple of 256 or 1024 (129920, 151936), few rows; the
        labels include the last column and the tail of the last block holds the row's maximum."""
        lp.require(op, vocab=vocab)
        x = lp.logits((ROWS, vocab), scale=3.0, seed=5)
        x[:, -7:] += 4.0  # the tail past the last multiple of 1024 carries the mass
        y = lp.labels((ROWS,), vocab, seed=6)
        y[0], y[-1] = vocab - 1, vocab - 1000
        _check(lp, op, x, y, f"V={vocab} (V % 1024 = {vocab % 1024})")

    @covers(HIDDEN)
    @pytest.mark.parametrize("vocab", ODD_VOCABS)
    def test_peer_hidden_vocab_not_multiple_of_1024(self, lp: Harness, vocab: int) -> None:
        """verl#2899 for the fused head: V = 129920 and 151936 rows of the weight."""
        lp.require(HIDDEN, vocab=vocab)
        h, w, b, y = _hidden_inputs(lp, ROWS, vocab)
        y[0] = vocab - 1
        check_hidden(lp, h, w, b, y, grads=False, what=f"{HIDDEN} V={vocab} (V % 1024 = {vocab % 1024})")

    # ----------------------------------------------------------- verl#2656
    @covers(LABEL_OPS)
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_peer_logprob_not_positive(self, lp: Harness, op: str) -> None:
        """verl#2656: a log-probability is never positive, also where the label's probability rounds
        to 1 (a label logit 30 above the rest, and above a row of equal logits)."""
        lp.require(op, vocab=1000)
        x = lp.logits((4, 1000), scale=1.0, seed=7)
        y = lp.labels((4,), 1000, seed=8)
        x[torch.arange(4), y] = 30.0
        x[3] = 0.0
        x[3, y[3]] = 40.0
        logp = _check(lp, op, x, y, "the label's probability rounds to 1")[0]
        worst = logp.max()
        assert bool((logp <= 0).all()), (
            f"{op}: positive log-probability {worst.item():.3g} at row {int(logp.argmax())} (logits where the "
            "label's probability rounds to 1): a log-probability must stay <= 0")

    @covers(HIDDEN)
    def test_peer_hidden_logprob_not_positive(self, lp: Harness) -> None:
        """verl#2656 for the fused head: the label's probability rounds to 1, the result stays <= 0."""
        lp.require(HIDDEN, vocab=500)
        h, w, b, y = _hidden_inputs(lp, 4, 500, seed=9)
        w[y] = h * (30.0 / h.norm(dim=-1, keepdim=True) ** 2)  # the label's logit is 30, the others a few units
        logp = lp.call_hidden(h, w, y)[0]
        check_hidden(lp, h, w, b, y, grads=False, what=f"{HIDDEN}, label's probability near 1")
        assert bool((logp <= 0).all()), (
            f"{HIDDEN}: positive log-probability {logp.max().item():.3g} at row {int(logp.argmax())}: "
            "a log-probability must stay <= 0")

    # ------------------------------------------------------- special rows
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_all_negative_rows(self, lp: Harness, op: str) -> None:
        """Rows whose logits are all negative: around -1, around -80 and around -1e4 (a kernel that
        starts its running maximum at 0 instead of -inf underflows every exp)."""
        lp.require(op, vocab=3000)
        x = lp.logits((3, 3000), scale=1.0, seed=10).abs().neg()
        x[1] -= 80.0
        x[2] = x[2] * 3.0 - 1e4
        y = lp.labels((3,), 3000, seed=11)
        _check(lp, op, x, y, "rows of all-negative logits (max -1e-4, -80, -1e4)")

    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("value", [0.0, -7.5, 1e4])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_all_equal_rows(self, lp: Harness, op: str, value: float) -> None:
        """Rows of equal logits (0, -7.5, 1e4): log p = -log V and the entropy log V, to the bit's worth."""
        lp.require(op, vocab=1536)
        x = torch.full((2, 1536), value, device=lp.device)
        y = lp.labels((2,), 1536, seed=12)
        _check(lp, op, x, y, f"rows of equal logits {value}")

    # ---------------------------------------------- temperature in bf16
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_bf16_temperature(self, lp: Harness, op: str) -> None:
        """bf16 logits with a temperature (0.7), against the reference of the same bf16 values
        divided exactly: a kernel (or its caller) that divides in bf16 before the softmax rounds
        every logit to 8 bits again (about 1e-2 nats) and departs."""
        if torch.bfloat16 not in lp.backend.dtypes:
            pytest.skip(f"{lp.name} does not accept bfloat16")
        lp.require(op, torch.bfloat16, vocab=4096)
        x = lp.logits((4, 4096), torch.bfloat16, scale=4.0, seed=13)
        y = lp.labels((4,), 4096, seed=14)
        plain = [(g.double().cpu() - w).abs().max().item() for g, w in zip(lp.call(op, x, y), lp.reference(op, x, y))]
        _check(lp, op, x, y, f"bf16 logits, temperature 0.7 (the reference divides them exactly; the same logits "
               f"at temperature 1 err by {max(plain):.3g})", temperature=0.7)

    # ----------------------------------------------------------- verl#3723
    @covers(LOGITS_OPS, capability="batch_invariant", declared=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_row_shards(self, lp: Harness, op: str) -> None:
        """verl#3723: rows split in two calls, as sequence parallelism splits them (at an odd row,
        the shards as views of the whole), give bitwise what one call gives."""
        lp.require(op, vocab=5000)
        lp.require_capability("batch_invariant", "bitwise equality of row shards")
        x = lp.logits((2, 9, 5000), seed=15)
        y = lp.labels((2, 9), 5000, seed=16)
        whole = lp.call(op, x, y)
        for split in (4, 5):
            parts = [lp.call(op, x[:, :split], y[:, :split]),
                     lp.call(op, x[:, split:], y[:, split:])]
            for i, full in enumerate(whole):
                joined = torch.cat([parts[0][i], parts[1][i]], dim=1)
                assert torch.equal(joined, full), (
                    f"{op} output {i}: rows [:{split}] and [{split}:] in two calls differ from one call "
                    f"(max difference {(joined - full).abs().max().item():.3g})")

    @covers(HIDDEN, capability="batch_invariant", declared=True)
    def test_peer_hidden_row_shards(self, lp: Harness) -> None:
        """verl#3723 for the fused head: the hidden states' rows in two calls, bitwise as in one."""
        lp.require(HIDDEN, vocab=3000)
        lp.require_capability("batch_invariant", "bitwise equality of row shards")
        h, w, b, y = _hidden_inputs(lp, 11, 3000, seed=17)
        whole = lp.call_hidden(h, w, y)[0]
        joined = torch.cat([lp.call_hidden(h[:5], w, y[:5])[0], lp.call_hidden(h[5:], w, y[5:])[0]])
        assert torch.equal(joined, whole), (
            f"{HIDDEN}: rows [:5] and [5:] in two calls differ from one call "
            f"(max difference {(joined - whole).abs().max().item():.3g})")

    # ------------------------------------------------------------- layouts
    @covers(LOGITS_OPS)
    @pytest.mark.parametrize("view", ["column-offset", "row-offset", "batch-transposed"])
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_offset_views(self, lp: Harness, op: str, view: str) -> None:
        """Views that start inside their storage and skip columns between rows (a slice of a padded
        vocabulary), rows from an offset, a transposed batch: read where they lie."""
        lp.require(op, vocab=1000)
        base = lp.logits((3, 7, 1040), seed=18)
        labels = lp.labels((3, 8), 1000, seed=19)
        if view == "column-offset":
            x, y = base[:, :, 24:1024], labels[:, 1:]
        elif view == "row-offset":
            x, y = base[1:, 2:, :1000], labels[1:, 3:]
        else:
            x, y = base[:, :, 8:1008].transpose(0, 1), labels[:, :7].t()
        assert x.storage_offset() > 0 or not x.is_contiguous()
        _check(lp, op, x, y, f"{view} view of strides {x.stride()}, offset {x.storage_offset()}",
               temperature=1.0)

    # --------------------------------------------------------- ignored rows
    @covers(LABEL_OPS)
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_peer_ignored_then_active(self, lp: Harness, op: str) -> None:
        """An ignored row followed by active ones (and ignored rows between them): the ignored give
        0, the active their value, and with autograd the gradients agree (zero on ignored rows)."""
        lp.require(op, vocab=800)
        x = lp.logits((6, 800), seed=20)
        y = lp.labels((6,), 800, seed=21)
        y[0], y[3] = -100, -100
        _check(lp, op, x, y, "rows 0 and 3 ignored", ignore_index=-100)
        if not lp.backend.autograd:
            return
        _compare_gradients(lp, op, x, y, 1.0, -100, f"{op}, rows 0 and 3 ignored", y == -100)

    @covers(HIDDEN, grad=True)
    def test_peer_hidden_ignored_then_active(self, lp: Harness) -> None:
        """The fused head with an ignored row followed by active ones: values and gradients."""
        lp.require(HIDDEN, grad=True, vocab=600)
        h, w, b, y = _hidden_inputs(lp, 6, 600, seed=23, bias=False)
        y[0], y[3] = -100, -100
        check_hidden(lp, h, w, b, y, ignore_index=-100, what=f"{HIDDEN}, rows 0 and 3 ignored")

    # ------------------------------------------------------------ last row
    @covers(LABEL_OPS)
    @pytest.mark.parametrize("rows", [1, 2, 17, 129])
    @pytest.mark.parametrize("op", LABEL_OPS)
    def test_peer_last_row(self, lp: Harness, op: str, rows: int) -> None:
        """1, 2, 17 and 129 rows, the last with its own label and logits: a kernel whose last tile is
        off by one row (drops it, or reads the row before) departs on the last row."""
        lp.require(op, vocab=512)
        x = lp.logits((rows, 512), seed=24)
        y = lp.labels((rows,), 512, seed=25)
        x[-1] += torch.linspace(-2, 2, 512, device=lp.device)
        _check(lp, op, x, y, f"{rows} rows (the last row is row {rows - 1})")

    # ---------------------------------------------------------- determinism
    @covers(LOGITS_OPS, capability="deterministic", declared=True)
    @pytest.mark.parametrize("op", LOGITS_OPS)
    def test_peer_repeated_runs(self, lp: Harness, op: str) -> None:
        """Five runs of the same call (32 rows of V = 32000: enough rows that a reduction in a varying
        order changes the bits of one of them) give bitwise the same results."""
        lp.require(op, vocab=32000)
        lp.require_capability("deterministic", "bitwise reproducibility")
        x = lp.logits((32, 32000), seed=26)
        y = lp.labels((32,), 32000, seed=27)
        rows = torch.arange(0, 32, 2, device=lp.device)  # every other row: a label of probability near 1/2,
        x[rows, y[rows]] = x[rows].amax(-1) + 1.0       # where the last bits of the log-sum-exp show
        first = lp.call(op, x, y, temperature=1.0)
        for run in range(1, 5):
            again = lp.call(op, x, y, temperature=1.0)
            for i, (a, b) in enumerate(zip(first, again)):
                assert torch.equal(a, b), (
                    f"{op} output {i}: run {run + 1} of the same call differs from run 1 "
                    f"(max difference {(a - b).abs().max().item():.3g})")
