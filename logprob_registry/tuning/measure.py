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

Beside the time, each backend's peak memory is measured at two row counts (:meth:`Plan.memory_rows`:
the fewest timed and the most affordable), in one child process (:class:`MemoryProbe`) started with glibc's mmap
threshold pinned (``MALLOC_MMAP_THRESHOLD_=65536``: every large buffer mapped, and unmapped when
freed) where each call's peak is read from ``VmHWM`` after a reset (:mod:`logprob_registry.benchmark.memory`);
what is recorded is the extra peak beyond the gradients the call returns, by which selection judges
the op's memory promise (``opspec.MemoryPromise.judge``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..call import key_for
from ..dtypes import dtype_name
from ..opspec import OPS
from ..registry import Key, get_registry
from ..registry.key import ALWAYS_HIDDEN
from ..registry.ranking import promise_of
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
    memory: bool = True  # measure each backend's peak memory beside its time (MemoryProbe)
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

    def memory_rows(self, vocab: int, hidden: Optional[int] = None) -> List[int]:
        """The row counts memory is measured at: the fewest timed, and the most that fit
        :attr:`max_elements` (logits, and hidden states) and :attr:`max_work`: a promise is judged by
        how memory grows with the rows, and a workspace capped at a few tiles must not weigh against
        the logits' growth."""
        most = self.max_elements // vocab
        if hidden:
            most = min(most, self.max_elements // hidden, self.max_work // (vocab * hidden))
        low = min(self.rows_for(vocab, hidden))
        most = max(most, 1)
        return sorted({min(low, max(1, most // 8)), most})

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

    example = OPS[op].example((rows, vocab), dtype, device, requires_grad=grad, seed=seed, hidden_size=hidden)
    call, leaves = _caller(op, name, example, grad)

    def prepare() -> None:
        for leaf in leaves:
            leaf.grad = None

    times, _ = time_calls(lambda _: call(), prepare, repeat=repeat, warmup=warmup, sync=synchronizer(device),
                          release=prepare)
    return statistics.median(times)


def _caller(op: str, name: str, example: Any, grad: bool) -> Tuple[Callable[[], None], List[torch.Tensor]]:
    """One call of ``op`` through backend ``name`` on ``example`` (with its backward, the sum of its
    float outputs, when ``grad``), and the leaves whose gradients it makes."""
    public = OPS[op].public()
    leaves = [x for x in list(example.inputs.values()) + list(example.options.values())
              if isinstance(x, torch.Tensor) and x.requires_grad]

    def call() -> None:
        with torch.set_grad_enabled(grad):
            out = public(*example.args, backend=name, **example.options)
            if grad:
                outs = out if isinstance(out, tuple) else (out,)
                sum(o.float().sum() for o in outs if o.is_floating_point()).backward()

    return call, leaves




def memory_job(op: str, name: str, rows: Sequence[int], vocab: int, dtype: str, device: str, grad: bool,
               seed: int, hidden: Optional[int] = None) -> Dict[str, float]:
    """In the measuring process: ``{rows: extra peak bytes beyond the gradients}`` of one call of
    ``name`` (with its backward when ``grad``) at each row count, each after one call to warm up."""
    from ..benchmark.memory import peak_extra_bytes

    out = {}
    for n in rows:
        example = OPS[op].example((n, vocab), getattr(torch, dtype), device, requires_grad=grad, seed=seed,
                                  hidden_size=hidden)
        call, leaves = _caller(op, name, example, grad)
        call()  # warm-up: lazy initialisation, compilation
        for leaf in leaves:
            leaf.grad = None
        _, extra = peak_extra_bytes(call, torch.device(device))
        grads = sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in leaves if leaf.grad is not None)
        out[str(n)] = float(max(extra - grads, 0))
        del example, call, leaves
    return out


def memory_child() -> None:
    """The measuring process of :class:`MemoryProbe`: one JSON job per line in, one JSON answer
    per line out (``{"memory": ...}`` or ``{"error": ...}``)."""
    from ..benchmark.memory import pin_mmap_threshold

    pin_mmap_threshold()
    for line in sys.stdin:
        try:
            answer: Dict[str, Any] = {"memory": memory_job(**json.loads(line))}
        except Exception as exc:  # reported, never fatal: that backend's memory is then declared
            answer = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class MemoryProbe:
    """One child process measuring peak memory for ``tune``, started on first use with
    ``MALLOC_MMAP_THRESHOLD_=65536`` (so that freed buffers leave the resident set and a peak is the
    call's own), restarted if it dies (out of memory, say)."""

    def __init__(self) -> None:
        self._child: Optional[subprocess.Popen] = None

    def measure(self, **job: Any) -> Tuple[Optional[Dict[str, float]], str]:
        """``(memory, "")`` for one :func:`memory_job`, or ``(None, why not)``."""
        try:
            if self._child is None or self._child.poll() is not None:
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
                self._child = subprocess.Popen(
                    [sys.executable, "-c", "from logprob_registry.tuning.measure import memory_child; memory_child()"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            self._child.stdin.write(json.dumps(job) + "\n")
            self._child.stdin.flush()
            line = self._child.stdout.readline()
            while line and not line.startswith("{"):  # a library's own output
                line = self._child.stdout.readline()
        except OSError as exc:
            return None, f"the measuring process failed: {exc}"
        if not line:
            self.close()
            return None, "the measuring process died (out of memory?)"
        answer = json.loads(line)
        return answer.get("memory"), answer.get("error", "")

    def close(self) -> None:
        if self._child is not None:
            try:
                self._child.stdin.close()
                self._child.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._child.kill()
            self._child = None


def run(plan: Plan, progress: Callable[[str], None] = lambda text: None) -> Ranking:
    """Measure ``plan``; the ranking of every key measured."""
    probe = MemoryProbe() if plan.memory else None
    try:
        return _run(plan, progress, probe)
    finally:
        if probe is not None:
            probe.close()


def _run(plan: Plan, progress: Callable[[str], None], probe: Optional[MemoryProbe]) -> Ranking:
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
            if probe is not None and promise_of(key) is not None:
                memory, problem = probe.measure(op=key.op, name=name, rows=plan.memory_rows(vocab, hidden),
                                                vocab=vocab, dtype=dtype_name(key.dtype), device=key.device,
                                                grad=key.requires_grad, seed=plan.seed, hidden=hidden)
                if memory:
                    entry.memory[name] = memory
                else:
                    progress(f"  {name}: memory not measured ({problem}); its declaration stands")
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
    return f"{kind} V={entry.vocab}{_h(entry)}: " + ", ".join(parts) + failed + _memory(key, entry)


def _memory(key: Key, entry: Entry) -> str:
    """The memory verdicts measured, for the progress line: "; memory: naive breaks (2.10x), ..."."""
    promise = promise_of(key)
    if promise is None or not entry.memory:
        return ""
    verdicts = []
    for name in sorted(entry.memory):
        keeps, ratio, _ = promise.judge(entry.memory[name], entry.vocab)
        if keeps is not None:
            verdicts.append(f"{name} {'keeps' if keeps else 'breaks'} ({ratio:.2f}x)")
    return f"; memory ({promise.name}, at most {promise.share:g}x): " + ", ".join(verdicts) if verdicts else ""


def _h(entry: Entry) -> str:
    return f" H={entry.hidden}" if entry.hidden else ""
