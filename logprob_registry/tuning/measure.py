"""``logprob-registry tune``'s engine: for each (op, device, dtype, gradients, vocabulary bucket and,
for an op given hidden states, hidden-size bucket), a smoke check of every eligible backend against
the float64 reference, then its time at a few row counts; the result is a :class:`~.cache.Ranking`.

A backend's time for a key is the geometric mean over the row counts measured, so that every row
count weighs the same and the ranking depends on the buckets alone (the choice must never depend on
the number of rows: a row's result would then depend on its batch).

Every op of the op table with a public function and example inputs is measured the same way, with
no per-op code here: the inputs are the op's example inputs (:meth:`~logprob_registry.opspec.OpSpec.example`,
with ``hidden_size`` for an op given hidden states), the call is the op's public function with
``backend=`` and the example's options, the smoke check judges by the op's ground truth and the
accuracy contract (:mod:`logprob_registry.numerics`), and a time is the median of ``bench``'s timing
engine (:func:`logprob_registry.benchmark.timing.time_calls`) run in this process.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..call import key_for
from ..dtypes import dtype_name
from ..opspec import OPS
from ..registry import Key, get_registry
from ..registry.key import ALWAYS_HIDDEN
from .cache import Entry, Ranking, machine, string_of

#: The vocabulary size measured for each bucket (typical sizes: GPT-2, Llama-2, Qwen-2).
VOCABS = (128, 1000, 8000, 32000, 151936)
#: The hidden size measured for each hidden-size bucket that matters (``registry.key.HIDDEN_BUCKETS``):
#: ops given hidden states are measured at each, as their work per row is V x H.
HIDDENS = (256, 1024, 2048)
ROWS = (16, 256, 2048)
#: Largest number of logits one measured call gets (fp32: 256 MiB), so a tune stays affordable.
MAX_ELEMENTS = 1 << 26
#: Largest V x H x rows of one measured call of an op given hidden states (2^36: 220 rows at
#: V=151936, H=2048, about 137 GFLOP per matmul), so a tune of the fused op stays affordable.
MAX_WORK = 1 << 36
#: Largest hidden size of the smoke check's inputs (its float64 reference holds the weight twice).
SMOKE_HIDDEN = 256
#: Every op tune can measure: the op table's public ops with example inputs.
TUNED_OPS = tuple(name for name, spec in OPS.items() if spec.function is not None and spec.examples is not None)
#: What ``tune`` measures without ``--op``.
DEFAULT_OPS = TUNED_OPS


@dataclass
class Plan:
    """What to measure."""

    device: str = "cpu"
    ops: Sequence[str] = DEFAULT_OPS
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)
    grads: Sequence[bool] = (False, True)
    vocabs: Sequence[int] = VOCABS
    hiddens: Sequence[int] = HIDDENS
    rows: Sequence[int] = ROWS
    backends: Sequence[str] = ()
    repeat: int = 5
    warmup: int = 2
    max_elements: int = MAX_ELEMENTS
    max_work: int = MAX_WORK
    seed: int = 0
    quick: bool = False  # one row count per vocabulary: the largest that fits max_elements
    results: List[Tuple[Key, Entry]] = field(default_factory=list)

    def rows_for(self, vocab: int, hidden: Optional[int] = None) -> List[int]:
        """The row counts measured at ``vocab`` (and ``hidden``): those of :attr:`rows` whose logits
        fit :attr:`max_elements` and, with hidden states, whose V x H x rows fits :attr:`max_work`
        (else as many rows as fit, at least one); with :attr:`quick`, the largest of them only."""
        most = self.max_elements // vocab
        if hidden:
            most = min(most, self.max_work // (vocab * hidden))
        fitting = [r for r in sorted(self.rows) if r <= most] or [max(1, most)]
        return fitting[-1:] if self.quick else fitting

    def hiddens_for(self, op: str) -> List[Optional[int]]:
        """The hidden sizes measured for ``op``: :attr:`hiddens` for an op always given hidden
        states, None (its logits form) for the others."""
        return list(self.hiddens) if op in ALWAYS_HIDDEN else [None]

    def keys(self) -> List[Tuple[Key, int, Optional[int]]]:
        """``(key, vocabulary size, hidden size or None)`` of every key measured."""
        return [(key_for(op, device=self.device, dtype=dtype, requires_grad=grad, vocab=v, hidden_size=h), v, h)
                for op in self.ops for dtype in self.dtypes for grad in self.grads for v in self.vocabs
                for h in self.hiddens_for(op)]


def smoke(op: str, name: str, vocab: int, dtype: torch.dtype, device: str, grad: bool,
          hidden: Optional[int] = None) -> Optional[str]:
    """None when ``name`` agrees with the float64 reference (values, and gradients when ``grad``)
    on a few rows, else what went wrong."""
    from ..numerics import assert_close, gradient_rounding, tolerances

    spec = OPS[op]
    # at most SMOKE_HIDDEN: the float64 reference copies the weight (V x H) and its gradient, 5 GB
    # at V=151936, H=2048; what the check catches (values, gradients, dtype) does not need the full H
    hidden = None if hidden is None else min(hidden, SMOKE_HIDDEN)
    example = spec.example((4, vocab), dtype, device, requires_grad=grad, seed=12345, hidden_size=hidden)
    try:
        with torch.set_grad_enabled(grad):
            out = spec.public()(*example.args, backend=name, **example.options)
            outs = out if isinstance(out, tuple) else (out,)
            if grad:
                sum(o.float().sum() for o in outs).backward()
    except Exception as exc:  # a backend that raises is not ranked
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    leaves = {n: x for n, x in example.inputs.items() if x.requires_grad}
    exact = {n: x.detach().cpu().double().requires_grad_(n in leaves) if x.is_floating_point() else x.cpu()
             for n, x in example.inputs.items()}
    x = exact[spec.dtype_input]
    want = spec.ground_truth(*exact.values(), **_double(example.options))
    try:
        for got, expected, tol in zip(outs, want, tolerances(op, x, options=example.options)):
            assert_close(got, expected, tol, f"{name} {op}")
        if grad:
            sum(w.sum() for w in want).backward()
            atol = 4 * max(tolerances(op, x, options=example.options))
            for n, leaf in leaves.items():
                assert_close(leaf.grad, exact[n].grad, atol, f"{name} {op} gradient", rtol=gradient_rounding(dtype))
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    return None


def _double(options: dict) -> dict:
    """An example's options for the float64 reference: its tensors (a ``*_weight``) in float64."""
    return {k: (o.detach().cpu().double() if isinstance(o, torch.Tensor) and o.is_floating_point() else o)
            for k, o in options.items()}


def time_call(op: str, name: str, rows: int, vocab: int, dtype: torch.dtype, device: str, grad: bool,
              repeat: int, warmup: int, seed: int, hidden: Optional[int] = None) -> float:
    """Median seconds of one call (with its backward when ``grad``: the sum of its float outputs)
    after ``warmup`` calls, timed in this process by ``bench``'s engine on the op's example inputs
    (``rows`` positions of ``vocab`` logits, or of hidden states of ``hidden``; each call's
    gradients fresh)."""
    from ..benchmark.timing import synchronizer, time_calls

    spec = OPS[op]
    example = spec.example((rows, vocab), dtype, device, requires_grad=grad, seed=seed, hidden_size=hidden)
    public = spec.public()
    leaves = [x for x in list(example.inputs.values()) + list(example.options.values())
              if isinstance(x, torch.Tensor) and x.requires_grad]

    def prepare() -> None:
        for leaf in leaves:
            leaf.grad = None

    def call(_: None) -> None:
        with torch.set_grad_enabled(grad):
            out = public(*example.args, backend=name, **example.options)
            if grad:
                outs = out if isinstance(out, tuple) else (out,)
                sum(o.float().sum() for o in outs if o.is_floating_point()).backward()

    times, _ = time_calls(call, prepare, repeat=repeat, warmup=warmup, sync=synchronizer(device), release=prepare)
    return statistics.median(times)


def run(plan: Plan, progress: Callable[[str], None] = lambda text: None) -> Ranking:
    """Measure ``plan``; the ranking of every key measured."""
    registry = get_registry()
    env = registry.environment()
    versions = registry.versions()
    entries: Dict[str, Entry] = {}
    measured_backends = set()
    for key, vocab, hidden in plan.keys():
        verdicts = [v for v in registry.verdicts(key) if v.reason is None and v.broken is None]
        names = [v.name for v in verdicts if not plan.backends or v.name in plan.backends]
        entry = Entry(times={}, vocab=vocab, hidden=hidden or 0)
        for name in names:
            problem = smoke(key.op, name, vocab, key.dtype, key.device, key.requires_grad, hidden)
            if problem:
                entry.failed[name] = problem
                progress(f"  {name}: failed the smoke check: {problem}")
                continue
            per_rows = {}
            for rows in plan.rows_for(vocab, hidden):
                per_rows[str(rows)] = time_call(key.op, name, rows, vocab, key.dtype, key.device,
                                                key.requires_grad, plan.repeat, plan.warmup, plan.seed, hidden)
            if not per_rows:
                continue
            entry.rows[name] = per_rows
            entry.times[name] = math.exp(statistics.fmean(math.log(t) for t in per_rows.values()))
            measured_backends.add(name)
        entries[string_of(key)] = entry
        plan.results.append((key, entry))
        progress(describe(key, entry))
    info = env.devices.get(plan.device)
    return Ranking(
        torch=str(env.torch_version),
        machines={plan.device: machine(plan.device, tuple(info.names) if info else ())},
        versions={name: versions.get(name, "") for name in sorted(measured_backends)},
        entries=entries,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def describe(key: Key, entry: Entry) -> str:
    """One line per key: the measured backends fastest first, with their times."""
    order = entry.order()
    if not order:
        return f"{key.describe()} (V={entry.vocab}{_h(entry)}): nothing measured"
    best = entry.times[order[0]]
    parts = [f"{name} {entry.times[name] * 1e3:.3g} ms ({entry.times[name] / best:.2f}x)" for name in order]
    failed = "".join(f"; {name} failed the smoke check" for name in entry.failed)
    kind = f"{key.op} {dtype_name(key.dtype)} {'fwd+bwd' if key.requires_grad else 'fwd'}"
    return f"{kind} V={entry.vocab}{_h(entry)}: " + ", ".join(parts) + failed


def _h(entry: Entry) -> str:
    return f" H={entry.hidden}" if entry.hidden else ""
