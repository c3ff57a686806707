#!/usr/bin/env python3
"""The matmul floor of the fused op's forward+backward (issue #36), for bf16/fp16 inputs: the
matmuls alone of each formulation, tile by tile as each runs them, interleaved, the fastest of
``--rounds``.

* ``fp32 products`` (``chunked``, ``compiled``): a vocabulary block of the weight and a block of
  hidden upcast to fp32, four fp32 matmuls a tile over the step (forward: the tile; backward: the
  tile again, then the hidden and weight gradients), 1024 x 1024 tiles (chunked's CPU plan). The
  logits are exact fp32 products, which the numerical contract asks for (DESIGN.md: "never the
  1e-2 of bf16 arithmetic").
* ``bf16 tile`` (TRL 1.16's ``ChunkedLogProbFunction`` off CUDA): the tile multiplied in bf16 and
  rounded to bf16 (forward, and again in backward), the two gradient matmuls in fp32 on the
  upcast bf16 tile (``_addmm_fp32``), 4096 x 4096 tiles.

Torch's CPU matmul has no bf16 product with an fp32 result (``out_dtype`` is CUDA-only), so a bf16
matmul here rounds every logit to bf16 (about 1e-2 nats at logits of magnitude 10).

    python scripts/fused_matmul_floor.py                     # 1024 x 1024 x 32768 bf16, 1 thread
    python scripts/fused_matmul_floor.py --rows 4096 --hidden 1024 --vocab 32768 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch


def fp32_products(hidden, weight, rows=1024, cols=1024):
    n, v = hidden.shape[0], weight.shape[0]
    gh = torch.zeros(hidden.shape)
    for v0 in range(0, v, cols):
        w = weight[v0:v0 + cols].float()
        for r0 in range(0, n, rows):
            (hidden[r0:r0 + rows].float() @ w.t())  # forward
        gw = torch.zeros(w.shape)
        for r0 in range(0, n, rows):
            h = hidden[r0:r0 + rows].float()
            dz = h @ w.t()  # backward: the tile again
            gh[r0:r0 + rows].addmm_(dz, w)
            gw.addmm_(dz.t(), h)


def bf16_tile(hidden, weight, rows=4096, cols=4096):
    n, v = hidden.shape[0], weight.shape[0]
    for r0 in range(0, n, rows):
        h = hidden[r0:r0 + rows]
        for v0 in range(0, v, cols):
            (h @ weight[v0:v0 + cols].t())  # forward
    gh, gw = torch.zeros(hidden.shape), torch.zeros(weight.shape)
    for r0 in range(0, n, rows):
        h = hidden[r0:r0 + rows]
        for v0 in range(0, v, cols):
            w = weight[v0:v0 + cols]
            tile = h @ w.t()  # backward: the tile again, in bf16
            gh[r0:r0 + rows].addmm_(tile.float(), w.float())
            gw[v0:v0 + cols].addmm_(tile.t().float(), h.float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5).to(dtype)
    methods = {"fp32 products (ours)": fp32_products, "bf16 tile (TRL)": bf16_tile}
    best = {name: float("inf") for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn(hidden, weight)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"matmuls of forward+backward, {args.rows} x {args.hidden} x {args.vocab} {args.dtype}, "
          f"{args.threads} thread(s), fastest of {args.rounds} interleaved rounds")
    for name, seconds in best.items():
        print(f"  {name:<22} {seconds:8.3f} s")
    print(f"  ratio                  {best['fp32 products (ours)'] / best['bf16 tile (TRL)']:8.2f}x TRL's")


if __name__ == "__main__":
    main()
