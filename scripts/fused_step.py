#!/usr/bin/env python3
"""The fused op's RL-step scenarios (issue #24), every ratio from one run of one process:

- ``ignored``: 90% of the rows' labels ``ignore_index`` (scattered at random), forward+backward
  against the all-active call; the active rows' log-probabilities compared bitwise;
- ``frozen``: a weight with ``requires_grad=False`` (LoRA, a reference model), forward+backward
  against the trainable weight's call and against the frozen logits path (``hidden @ W.T``,
  textbook ``log_softmax`` + gather, backward to the hidden);
- ``torch``: against ``-torch.nn.functional.linear_cross_entropy(reduction="none")``, its default
  path (which holds the ``(N, V)`` logits) and its chunked path
  (``options=torch.nn.LinearCrossEntropyOptions()``), forward (``torch.no_grad()``) and
  forward+backward with a trainable weight;
- ``bf16``: from bf16 inputs, the mean and max error of the library's and of torch's
  log-probabilities against float64 (the rounded inputs, upcast).

Time: the median of ``--repeat`` rounds (each scenario once a round, so that a busy machine's
load falls on all alike) after one warm-up call each on 64 rows (which compiles what needs
compiling: the kernels take any shape); wall time and the process's CPU time (the steadier
figure on shared cores). Peak: the growth of resident memory over
the call (``logprob_registry.benchmark.memory.peak_extra_bytes``: glibc's mmap threshold pinned,
``VmHWM``), gradients included. The inputs: hidden ``N(0, 1)``, weight ``N(0, 1/H)`` (logits of
unit scale), labels uniform, seed 0.

  python scripts/fused_step.py [--tokens 4096] [--hidden 1024] [--vocab 32768]
                               [--backend compiled,chunked,naive] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import logprob_registry as lr
from logprob_registry.benchmark.memory import peak_extra_bytes

IGNORE = -100
MiB = float(1 << 20)


class Timed:
    """One scenario: its call, its warm-up call (the same on 64 rows: it compiles what needs
    compiling, the kernels take any shape) and its readings, one per round."""

    def __init__(self, call: Callable[[], object], warm: Callable[[], object]) -> None:
        self.call, self.warm = call, warm
        self.wall: List[float] = []
        self.cpu: List[float] = []
        self.peak: List[int] = []
        self.out: object = None

    def once(self) -> None:
        def timed():
            w0, c0 = time.perf_counter(), time.process_time()
            result = self.call()
            return time.perf_counter() - w0, time.process_time() - c0, result

        (wall, cpu, self.out), peak = peak_extra_bytes(timed, torch.device("cpu"))
        self.wall.append(wall)
        self.cpu.append(cpu)
        self.peak.append(peak)

    def reading(self) -> Tuple[float, float, float]:
        """``(median wall seconds, median process CPU seconds, largest peak bytes)``."""
        return statistics.median(self.wall), statistics.median(self.cpu), max(self.peak)


def step(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden, weight, labels,
         frozen: bool = False, backward: bool = True) -> Callable[[], torch.Tensor]:
    """A call of ``fn(h, w)`` on fresh leaves (gradients dropped before it), summed and
    back-propagated (``backward``), else under ``torch.no_grad()``; returns the detached result."""

    def call():
        if not backward:
            with torch.no_grad():
                return fn(hidden, weight, labels)
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(not frozen)
        out = fn(h, w, labels)
        out.sum().backward()
        return out.detach()

    return call


def library(backend: Optional[str]):
    def fn(h, w, y):
        return lr.logprobs_from_hidden(h, w, y, ignore_index=IGNORE, backend=backend)
    return fn


def logits_path(h, w, y):
    """What a trainer writes without the fused op."""
    logp = (h @ w.t()).log_softmax(-1)
    out = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return out.masked_fill(y == IGNORE, 0.0)


def torch_lce(chunked: bool):
    def fn(h, w, y):
        options = torch.nn.LinearCrossEntropyOptions() if chunked else None
        return -F.linear_cross_entropy(h, w, y, reduction="none", ignore_index=IGNORE, options=options)
    return fn


def reference_logp(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """float64 log-probabilities of the given (rounded) inputs, ``rows`` rows at a time."""
    w = weight.double()
    out = []
    for r0 in range(0, hidden.shape[0], rows):
        z = hidden[r0:r0 + rows].double() @ w.t()
        out.append(z.log_softmax(-1).gather(-1, labels[r0:r0 + rows].unsqueeze(-1)).squeeze(-1))
    return torch.cat(out)


def errors(got: torch.Tensor, want: torch.Tensor) -> str:
    d = (got.double() - want).abs()
    return f"mean {d.mean().item():.1e}, max {d.max().item():.1e}"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--backend", default="auto", help="comma-separated backends; 'auto': the automatic choice")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ignored", type=float, default=0.9, help="fraction of rows ignored in the 'ignored' scenario")
    args = ap.parse_args(argv)
    n, hdim, v = args.tokens, args.hidden, args.vocab
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, hdim, generator=g)
    weight = torch.randn(v, hdim, generator=g) / hdim ** 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    sparse = labels.clone()
    sparse[torch.rand(n, generator=g) < args.ignored] = IGNORE
    active = sparse != IGNORE
    logits_mib = n * v * 4 / MiB
    print(f"N={n} H={hdim} V={v} float32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.1f} (1 min) at start; (N, V) fp32 logits: {logits_mib:.0f} MiB; "
          f"{int(active.sum())} of {n} rows active in 'ignored'")
    scenarios: Dict[str, Timed] = {}

    def add(name: str, fn, y=labels, frozen=False, backward=True) -> None:
        scenarios[name] = Timed(step(fn, hidden, weight, y, frozen, backward),
                                step(fn, hidden[:64], weight, y[:64], frozen, backward))

    add("logits path, frozen weight, fwd+bwd", logits_path, frozen=True)
    add("torch lce default, fwd", torch_lce(False), backward=False)
    add("torch lce chunked, fwd", torch_lce(True), backward=False)
    add("torch lce default, fwd+bwd", torch_lce(False))
    add("torch lce chunked, fwd+bwd", torch_lce(True))
    names = [None] if args.backend == "auto" else args.backend.split(",")
    labels_of = {}
    for backend in names:
        label = backend or f"auto ({lr.select('logprobs_from_hidden', hidden, weight, labels).name})"
        labels_of[backend] = label
        add(f"{label} all active, fwd+bwd", library(backend))
        add(f"{label} {args.ignored:.0%} ignored, fwd+bwd", library(backend), y=sparse)
        add(f"{label} frozen, fwd+bwd", library(backend), frozen=True)
        add(f"{label} fwd", library(backend), backward=False)
    for t in scenarios.values():
        t.warm()
    for r in range(args.repeat):  # rounds: every scenario once a round, so that the load is shared alike
        for name, t in scenarios.items():
            t.once()
            print(f"  round {r + 1}: {name:<40} {t.wall[-1] * 1e3:9.1f} ms wall, {t.cpu[-1] * 1e3:9.1f} ms CPU, "
                  f"extra peak {t.peak[-1] / MiB:8.1f} MiB", flush=True)
    rows = {name: t.reading() for name, t in scenarios.items()}
    print(f"medians of {args.repeat} rounds:")
    for name, (wall, cpu, peak) in rows.items():
        print(f"  {name:<40} {wall * 1e3:9.1f} ms wall, {cpu * 1e3:9.1f} ms CPU, extra peak {peak / MiB:8.1f} MiB")
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    want = reference_logp(hb, wb, labels)
    with torch.no_grad():
        torch_err = errors(-F.linear_cross_entropy(hb, wb, labels, reduction="none").float(), want)

    def pair(a: str, b: str, i: Optional[int] = None) -> str:
        if i is not None:
            return f"{rows[a][i] / rows[b][i]:.2f}x"
        return f"{rows[a][0] / rows[b][0]:.2f}x wall ({rows[a][1] / rows[b][1]:.2f}x CPU)"

    for backend in names:
        label = labels_of[backend]
        print(f"{label}:")
        with torch.no_grad():
            lib_err = errors(lr.logprobs_from_hidden(hb, wb, labels, backend=backend), want)
        full, sparse_out = (scenarios[f"{label} {k}, fwd+bwd"].out
                            for k in ("all active", f"{args.ignored:.0%} ignored"))
        bitwise = torch.equal(full[active], sparse_out[active])
        mine = {k: f"{label} {k}" for k in ("all active, fwd+bwd", f"{args.ignored:.0%} ignored, fwd+bwd",
                                             "frozen, fwd+bwd", "fwd")}
        trainable, ignored, frozen, fwd = mine.values()
        print(f"  {args.ignored:.0%} ignored / all active: {pair(ignored, trainable)} "
              f"(active rows bitwise equal: {bitwise})")
        print(f"  frozen / trainable: {pair(frozen, trainable)}; frozen / frozen logits path: "
              f"{pair(frozen, 'logits path, frozen weight, fwd+bwd')}; frozen extra peak / (N, V) fp32 logits: "
              f"{rows[frozen][2] / (n * v * 4):.3f}x")
        for kind in ("default", "chunked"):
            print(f"  vs torch {kind}: fwd {pair(fwd, f'torch lce {kind}, fwd')}, fwd+bwd "
                  f"{pair(trainable, f'torch lce {kind}, fwd+bwd')}, extra peak "
                  f"{pair(trainable, f'torch lce {kind}, fwd+bwd', 2)}")
        print(f"  from bf16 vs float64: library {lib_err}; torch default {torch_err}")
    print(f"load {os.getloadavg()[0]:.1f} (1 min) at end")


if __name__ == "__main__":
    main()
