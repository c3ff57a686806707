"""``logprob-registry bench --process-group N``: the vocabulary-parallel path over N local gloo
processes, beside the alternative it replaces, gathering the full logits to one rank and computing
there.

Each of the N spawned processes (one torch thread each) holds a ``(B, T, V / N)`` shard of random
logits and the same labels. Two methods run, each a warm-up and then ``repeat`` timed calls (with
``--backward``: forward and backward of the sum of the result; :func:`.timing.time_calls`), every
call after a barrier:

- ``process_group``: the public op with ``process_group=`` (tile statistics gathered and merged);
- ``gather to rank 0``: ``torch.distributed.gather`` of the shards to rank 0, the op there on the
  full logits, the result broadcast back (and, with ``--backward``, the gradient scattered back).

With ``--sampler top_p=0.9,top_k=50`` (``softcap``, ``top_k``, ``top_p``, ``min_p``) both methods
replay that sampler: the shards merge their top-k lists and statistics (docs/distributed.md), the
gather computes on the full logits.

Reported per method: the median over calls of the slowest rank's time, and of the busiest rank's
CPU time (this process's, all its threads: what other work on shared cores does not inflate); the largest peak memory a
call adds on a rank (on the CPU through the peak resident set size; see
:mod:`logprob_registry.benchmark.memory`); the bytes the ranks receive together, per row of logits (measured
for ``process_group`` by :func:`logprob_registry.distributed.group.traffic`, counted from the
tensor sizes for the gather); and the largest difference between the
two methods' results, that is from the unsharded call.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

DEFAULT_SHAPE = (1, 1024, 65536)
METHODS = ("process_group", "gather to rank 0")


@dataclass(frozen=True)
class Plan:
    """One measurement: an op on (B, T, V) logits of a dtype, split over ``world`` processes."""

    op: str
    world: int
    shape: tuple
    dtype: str
    backward: bool = False
    repeat: int = 5
    warmup: int = 2
    backend: Optional[str] = None
    sampler: tuple = ()  # (keyword, value) pairs: softcap, top_k, top_p, min_p

    @property
    def rows(self) -> int:
        return self.shape[0] * self.shape[1]

    def describe(self) -> str:
        what = "forward + backward" if self.backward else "forward"
        sampler = "".join(f", {k}={v}" for k, v in self.sampler)
        return (f"{self.op}{sampler}, {self.dtype} logits {tuple(self.shape)} split over {self.world} gloo "
                f"processes (CPU, 1 thread each), {what}")


def _call(plan: Plan, logits, labels, **kw):
    """The op's public function (the op table's) on the logits (and the labels, if it takes them)."""
    from ..opspec import OPS

    spec = OPS[plan.op]
    out = spec.public()(*(logits, labels)[: len(spec.inputs)], **dict(plan.sampler), **kw)
    return out if isinstance(out, tuple) else (out,)


def _loss(outs) -> torch.Tensor:
    """The sum of the results, a label outside the sampler's kept set (-inf) counted as 0."""
    return sum(torch.where(torch.isfinite(o), o, torch.zeros_like(o)).sum() for o in outs)


def parse_sampler(text: Optional[str]) -> tuple:
    """``"top_p=0.9,top_k=50"`` as ((keyword, value), ...): softcap, top_k (int), top_p, min_p."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("softcap", "top_k", "top_p", "min_p"):
            raise ValueError(f"--sampler takes KEY=VALUE pairs of softcap, top_k, top_p, min_p, got {item!r}")
        out.append((key, int(value) if key == "top_k" else float(value)))
    return tuple(out)


def rank_bench(rank: int, world: int, plan: Plan) -> dict:
    """Run on each rank: both methods, timed, measured; per method the times, memory and bytes."""
    import torch.distributed as dist

    from ..distributed import group as dgroup
    from .memory import MemoryMeasurementUnavailable, peak_extra_bytes, pin_mmap_threshold
    from .timing import time_calls

    pin_mmap_threshold()
    b, t, v = plan.shape
    width = v // world
    dtype = getattr(torch, plan.dtype)
    gen = torch.Generator().manual_seed(1000 + rank)
    shard = (torch.randn(b, t, width, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(1))
    group = dist.group.WORLD

    def sharded():
        x = shard.detach().requires_grad_(plan.backward)
        outs = _call(plan, x, labels, process_group=group, backend=plan.backend)
        if plan.backward:
            _loss(outs).backward()
        return outs

    def gathered():
        parts = [torch.empty_like(shard) for _ in range(world)] if rank == 0 else None
        dist.gather(shard.contiguous(), parts, dst=0)
        n_out = 2 if plan.op == "logprobs_and_entropy" else 1
        outs = [torch.empty(b, t) for _ in range(n_out)]
        grads = [torch.empty_like(shard) for _ in range(world)] if rank == 0 else None
        if rank == 0:
            full = torch.cat(parts, dim=-1).requires_grad_(plan.backward)
            outs = list(_call(plan, full, labels, backend=plan.backend))
            if plan.backward:
                _loss(outs).backward()
                grads = list(full.grad.split(width, dim=-1))
                grads = [g.contiguous() for g in grads]
            outs = [o.detach() for o in outs]
        for o in outs:
            dist.broadcast(o, src=0)
        if plan.backward:
            mine = torch.empty_like(shard)
            dist.scatter(mine, grads, src=0)
        return tuple(outs)

    shard_bytes = shard.numel() * shard.element_size()
    n_out = 2 if plan.op == "logprobs_and_entropy" else 1
    if rank == 0:  # what this rank receives: the other shards
        gather_bytes = (world - 1) * shard_bytes
    else:  # the broadcast result, and its gradient shard
        gather_bytes = n_out * plan.rows * 4 + (shard_bytes if plan.backward else 0)
    report: Dict[str, dict] = {}
    results = {}
    for name, fn in (("process_group", sharded), ("gather to rank 0", gathered)):
        cpu: List[float] = []

        def timed(_, fn=fn, cpu=cpu):  # this process's CPU time too: robust where other work shares the cores
            c0 = time.process_time()
            out = fn()
            cpu.append(time.process_time() - c0)
            return out

        times, _ = time_calls(timed, lambda: dist.barrier(group), repeat=plan.repeat, warmup=plan.warmup)
        dist.barrier(group)
        dgroup.traffic(reset=True)
        try:
            out, peak = peak_extra_bytes(fn, torch.device("cpu"))
        except MemoryMeasurementUnavailable:
            out, peak = fn(), None
        received = dgroup.traffic(reset=True) if name == "process_group" else gather_bytes
        results[name] = [o.detach() for o in out]
        report[name] = dict(times=times, cpu=cpu[-plan.repeat:], peak_bytes=peak, bytes_received=received)
    diff = max(float((a.double() - c.double()).abs().nan_to_num(0.0, 0.0, 0.0).max()) if a.numel() else 0.0
               for a, c in zip(results["process_group"], results["gather to rank 0"]))
    flips = sum(int((torch.isinf(a) != torch.isinf(c)).sum())
                for a, c in zip(results["process_group"], results["gather to rank 0"]))
    return dict(report=report, max_diff=diff, kept_differs=flips)


def run(plan: Plan, timeout: float = 1800) -> dict:
    """Spawn the group, measure, and summarise: one row per method."""
    from ..distributed import launch

    ranks = [r.unwrap() for r in launch.run(plan.world, rank_bench, plan, timeout=timeout,
                                              collective_timeout=max(60.0, timeout))]
    rows = []
    for name in METHODS:
        per_rank = [r["report"][name] for r in ranks]
        slowest = [max(p["times"][i] for p in per_rank) for i in range(plan.repeat)]
        busiest = [max(p["cpu"][i] for p in per_rank) for i in range(plan.repeat)]
        peaks = [p["peak_bytes"] for p in per_rank if p["peak_bytes"] is not None]
        received = sum(p["bytes_received"] for p in per_rank)
        rows.append(dict(method=name, time_ms=statistics.median(slowest) * 1e3, cpu_ms=statistics.median(busiest) * 1e3,
                         peak_bytes=max(peaks) if peaks else None, bytes_per_row=received / max(plan.rows, 1)))
    return dict(plan=asdict(plan), rows=rows, max_diff=max(r["max_diff"] for r in ranks),
                kept_differs=max(r.get("kept_differs", 0) for r in ranks))


def render(result: dict) -> str:
    plan = Plan(**{**result["plan"], "shape": tuple(result["plan"]["shape"]),
                   "sampler": tuple(tuple(p) for p in result["plan"].get("sampler", ()))})
    lines = [f"bench --process-group {plan.world}: {plan.describe()}",
             f"{'method':<18} {'time (ms)':>10} {'CPU (ms)':>9} {'peak memory/rank':>17} {'bytes/row (all ranks)':>22}"]
    for row in result["rows"]:
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.1f} MiB"
        lines.append(f"{row['method']:<18} {row['time_ms']:>10.1f} {row['cpu_ms']:>9.1f} {peak:>17} "
                     f"{row['bytes_per_row']:>22,.0f}")
    lines.append(f"largest difference between the two (from the unsharded call): {result['max_diff']:.3g}")
    if plan.sampler:
        lines.append(f"labels kept by one method and dropped by the other: {result.get('kept_differs', 0)}")
    return "\n".join(lines)


def run_cli(args) -> int:
    """``logprob-registry bench --process-group N`` (arguments parsed by :mod:`logprob_registry.cli.bench`)."""
    from ..dtypes import DTYPE_NAMES, dtype_name
    from .settings import parse_list, parse_shape

    ops_here = ("logprobs", "entropy", "logprobs_and_entropy")

    world = args.process_group
    try:
        if world < 1:
            raise ValueError(f"--process-group must be at least 1, got {world}")
        if args.device not in (None, "cpu"):
            raise ValueError("--process-group runs gloo processes on the CPU; for CUDA or NPU run your own "
                             "launcher (torchrun) with process_group= (docs/distributed.md)")
        ops = parse_list(args.op, ops_here, "op") if args.op else ["logprobs"]
        dtypes = [dtype_name(DTYPE_NAMES[d]) for d in parse_list(args.dtype, DTYPE_NAMES, "dtype")] or ["float32"]
        shape = parse_shape(args.shape) if args.shape else DEFAULT_SHAPE
        if shape[2] % world:
            raise ValueError(f"the vocabulary V={shape[2]} does not split evenly over {world} processes; "
                             "choose a V that is a multiple of --process-group")
        if args.repeat < 1 or args.warmup < 0:
            raise ValueError("--repeat must be at least 1 and --warmup at least 0")
        backend = args.backend[0] if args.backend else None
        sampler = parse_sampler(getattr(args, "sampler", None))
        if len(args.backend) > 1:
            raise ValueError("--process-group measures one backend (or the automatic choice): give --backend once")
    except ValueError as exc:
        print(f"logprob-registry bench: {exc}", file=sys.stderr)
        return 2
    docs: List[dict] = []
    for op in ops:
        for dtype in dtypes:
            plan = Plan(op, world, shape, dtype, args.backward, args.repeat, args.warmup, backend, sampler)
            print(f"bench: {plan.describe()} ...", file=sys.stderr, flush=True)
            result = run(plan, args.timeout)
            docs.append(result)
            print(render(result), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(docs, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(docs, f, indent=1)
    return 0
