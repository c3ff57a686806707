"""``logprob-registry tune``'s engine: for each (op, device, dtype, gradients, vocabulary bucket),
a smoke check of every eligible backend against the float64 reference, then its time at a few row
counts; the result is a :class:`~.cache.Ranking`.

A backend's time for a key is the geometric mean over the row counts measured, so that every row
count weighs the same and the ranking depends on the bucket alone (the choice must never depend on
the number of rows: a row's result would then depend on its batch).

The inputs are the op table's example inputs (:meth:`~logprob_registry.opspec.OpSpec.example`), the
smoke check judges by the op's ground truth and the accuracy contract (:mod:`logprob_registry.numerics`),
and a time is the median of ``bench``'s timing engine (:func:`logprob_registry.benchmark.timing.time_workload`)
run in this process.
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
from .cache import Entry, Ranking, key_string, machine

#: The vocabulary size measured for each bucket (typical sizes: GPT-2, Llama-2, Qwen-2).
VOCABS = (128, 1000, 8000, 32000, 151936)
ROWS = (16, 256, 2048)
#: Largest number of logits one measured call gets (fp32: 256 MiB), so a tune stays affordable.
MAX_ELEMENTS = 1 << 26
TUNED_OPS = ("logprobs", "logprobs_and_entropy", "entropy")


@dataclass
class Plan:
    """What to measure."""

    device: str = "cpu"
    ops: Sequence[str] = ("logprobs", "logprobs_and_entropy")
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)
    grads: Sequence[bool] = (False, True)
    vocabs: Sequence[int] = VOCABS
    rows: Sequence[int] = ROWS
    backends: Sequence[str] = ()
    repeat: int = 5
    warmup: int = 2
    max_elements: int = MAX_ELEMENTS
    seed: int = 0
    quick: bool = False  # one row count per vocabulary: the largest that fits max_elements
    results: List[Tuple[Key, Entry]] = field(default_factory=list)

    def rows_for(self, vocab: int) -> List[int]:
        """The row counts measured at ``vocab``: those of :attr:`rows` whose logits fit
        :attr:`max_elements` (else as many rows as fit, at least one); with :attr:`quick`, the
        largest of them only."""
        fitting = [r for r in sorted(self.rows) if r * vocab <= self.max_elements]
        fitting = fitting or [max(1, self.max_elements // vocab)]
        return fitting[-1:] if self.quick else fitting

    def keys(self) -> List[Tuple[Key, int]]:
        return [(key_for(op, device=self.device, dtype=dtype, requires_grad=grad, vocab=v), v)
                for op in self.ops for dtype in self.dtypes for grad in self.grads for v in self.vocabs]


def smoke(op: str, name: str, vocab: int, dtype: torch.dtype, device: str, grad: bool) -> Optional[str]:
    """None when ``name`` agrees with the float64 reference (values, and gradients when ``grad``)
    on a few rows, else what went wrong."""
    from ..numerics import assert_close, gradient_rounding, tolerances

    spec = OPS[op]
    example = spec.example((4, vocab), dtype, device, requires_grad=grad, seed=12345)
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
    want = spec.ground_truth(*exact.values(), **example.options)
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


def time_call(op: str, name: str, rows: int, vocab: int, dtype: torch.dtype, device: str, grad: bool,
              repeat: int, warmup: int, seed: int) -> float:
    """Median seconds of one call (with its backward when ``grad``) after ``warmup`` calls, timed in
    this process by ``bench``'s engine on ``bench``'s workload (the op's example inputs, ``rows``
    positions of ``vocab`` logits; each call's gradients fresh)."""
    from ..benchmark.settings import Setting
    from ..benchmark.timing import time_workload
    from ..benchmark.workload import Workload

    s = Setting(op=op, device=device, dtype=dtype_name(dtype), shape=(1, rows, vocab), backward=grad,
                repeat=repeat, warmup=warmup, seed=seed)
    times, _ = time_workload(Workload(s, name))
    return statistics.median(times)


def run(plan: Plan, progress: Callable[[str], None] = lambda text: None) -> Ranking:
    """Measure ``plan``; the ranking of every key measured."""
    registry = get_registry()
    env = registry.environment()
    versions = registry.plugins_set.versions()
    entries: Dict[str, Entry] = {}
    measured_backends = set()
    for key, vocab in plan.keys():
        verdicts = [v for v in registry.verdicts(key) if v.reason is None and v.broken is None]
        names = [v.name for v in verdicts if not plan.backends or v.name in plan.backends]
        entry = Entry(times={}, vocab=vocab)
        for name in names:
            problem = smoke(key.op, name, vocab, key.dtype, key.device, key.requires_grad)
            if problem:
                entry.failed[name] = problem
                progress(f"  {name}: failed the smoke check: {problem}")
                continue
            per_rows = {}
            for rows in plan.rows_for(vocab):
                per_rows[str(rows)] = time_call(key.op, name, rows, vocab, key.dtype, key.device,
                                                key.requires_grad, plan.repeat, plan.warmup, plan.seed)
            if not per_rows:
                continue
            entry.rows[name] = per_rows
            entry.times[name] = math.exp(statistics.fmean(math.log(t) for t in per_rows.values()))
            measured_backends.add(name)
        entries[key_string(key.op, key.device, key.dtype, key.requires_grad, key.vocab)] = entry
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
        return f"{key.describe()} (V={entry.vocab}): nothing measured"
    best = entry.times[order[0]]
    parts = [f"{name} {entry.times[name] * 1e3:.3g} ms ({entry.times[name] / best:.2f}x)" for name in order]
    failed = "".join(f"; {name} failed the smoke check" for name in entry.failed)
    return f"{key.op} {dtype_name(key.dtype)} {'fwd+bwd' if key.requires_grad else 'fwd'} V={entry.vocab}: " \
           + ", ".join(parts) + failed
