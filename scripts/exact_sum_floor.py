"""The cost of exact tile sums (issue #33): what group invariance on any split costs per tile.

A tile's statistics must be the same bits whether its columns come whole or in pieces from two
ranks, so its sums must not depend on their order: each term rounded to a fixed grid and added
without rounding (``kit.exact_sum``). This times, on one ``(rows, 4096)`` block of bf16 logits
(the shape of ``compiled``'s CPU tile kernel), inductor kernels computing the tile's max, ``sum e``
and ``sum e (z - m)``:

* ``float32 sum``: a plain float32 reduction (before #33; not invariant: its bits depend on the
  order, so on where a shard cuts the tile);
* ``round, float64``: terms rounded to ``2**-40`` and added in float64 (#33's first kernel);
* ``float32 parts``: each term split into three float32 parts (``kit.exact_parts``) whose float32
  sums never round, the parts added in float64 in the kernel (a second pass over the rows);
* ``float64 magic``: terms rounded by adding ``1.5 * 2**16`` in float64;
* ``compiled shard_stats (shipped)``: ``compiled``'s own shard op on the block as one aligned
  shard, reached through the registry as any caller would: its tile kernel returns the float32 parts
  and adds them outside, ``exp2`` inlined (plus the op's small per-call work).

The methods interleave in rounds (a busy machine's drift hits all alike); the fastest of the
rounds is reported, with its ratio to the float32 sum: the floor an exact sum costs on this CPU.

    python scripts/exact_sum_floor.py                 # 8192 x 4096, one thread
    python scripts/exact_sum_floor.py --rows 2048 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

import logprob_registry as lr
from logprob_registry import kit


def _stats(x, inv_t: float, exact):
    z = x.float() * inv_t
    m = z.amax(-1, keepdim=True)
    d = z - m
    e = torch.exp(d)
    return m, exact(e), exact(torch.where(e == 0, 0.0, e * d))


def _plain(v):
    return v.sum(-1, keepdim=True)


def _round64(v):
    return torch.round(v * 2.0 ** 40).to(torch.float64).sum(-1, keepdim=True) * 2.0 ** -40


def _parts(v):
    hi, mid, lo = kit.exact_parts(v)
    return hi.sum(-1, keepdim=True).double() + mid.sum(-1, keepdim=True).double() + lo.sum(-1, keepdim=True).double()


def _magic64(v):
    w = v.double()
    return ((w + 98304.0) - 98304.0).sum(-1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = (torch.randn(args.rows, 4096, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    methods = {
        "float32 sum": lambda x, k: _stats(x, k, _plain),
        "round, float64": lambda x, k: _stats(x, k, _round64),
        "float32 parts": lambda x, k: _stats(x, k, _parts),
        "float64 magic": lambda x, k: _stats(x, k, _magic64),
    }
    compiled = {name: torch.compile(fn, dynamic=False, fullgraph=True) for name, fn in methods.items()}
    shard_stats = lr.get_registry().get("compiled").ops["shard_stats"]
    compiled["compiled shard_stats (shipped)"] = lambda x, k: shard_stats(
        x, None, vocab_start=0, tile=kit.TILE, temperature=1 / k, ignore_index=None, with_entropy=True)
    for fn in compiled.values():
        fn(x, 1 / 0.7)
    best = dict.fromkeys(compiled, float("inf"))
    for _ in range(args.rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            fn(x, 1 / 0.7)
            best[name] = min(best[name], time.perf_counter() - start)
    base = best["float32 sum"]
    print(f"{args.rows} x 4096 bf16, {args.threads} thread(s), fastest of {args.rounds}:")
    for name, t in best.items():
        print(f"  {name:<32} {t * 1e3:8.1f} ms  {t / base:5.2f}x")


if __name__ == "__main__":
    main()
