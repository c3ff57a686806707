#!/usr/bin/env python3
"""Peak memory per rank of a packed, context-parallel log-probability call against gathering the
sequence to one rank, and the bytes exchanged per chunk boundary (docs/layouts.md).

Each rank of a spawned gloo group (``logprob_registry.distributed.launch``) holds T / cp rows of a
packed stream's logits (T x V, float32) and its token ids, in the given layout.

- ``cp``: ``lr.next_token_labels(ids, cu_seqlens=..., cp_group=..., cp_layout=...)``, then
  ``lr.logprobs_from_logits(logits, labels, ignore_index=-100)`` on the rank's own rows;
- ``gather``: every rank's rows gathered to rank 0 (``dist.gather`` into one T x V buffer), where
  ``next_token_labels`` and ``logprobs_from_logits`` run on the whole stream.

Memory, as the project's peer benchmarks measure it: glibc's mmap threshold pinned
(``MALLOC_MMAP_THRESHOLD_=65536``, so that resident memory follows live memory), the peak reset
(``/proc/self/clear_refs`` 5) before the call, and the peak's growth over the resident baseline read
from ``VmHWM``. The logits a rank holds before the call are not counted in the growth; the table
shows them beside it.

  python scripts/cp_memory.py [--tokens 8192] [--vocab 32000] [--cp 2,4] [--backend chunked]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the ranks spawn: they inherit it

LENGTHS = (512, 1536, 2048, 256, 768, 3072)  # 8192 tokens, each a multiple of 2 * cp for cp <= 128


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _lengths(tokens: int) -> list:
    scale = tokens / sum(LENGTHS)
    lengths = [int(n * scale) // 8 * 8 for n in LENGTHS]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def _rank(rank: int, world: int, method: str, layout: str, tokens: int, vocab: int, backend: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    import logprob_registry as lr

    lengths = _lengths(tokens)
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = torch.Generator().manual_seed(rank)
    if layout == "contiguous":
        index = torch.arange(rank * tokens // world, (rank + 1) * tokens // world)
    else:
        parts, start = [], 0
        for n in lengths:
            c = n // (2 * world)
            parts += [torch.arange(start + k * c, start + (k + 1) * c) for k in (rank, 2 * world - 1 - rank)]
            start += n
        index = torch.cat(parts)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    mine_ids = ids[index]
    logits = torch.randn(index.numel(), vocab, generator=g)  # this rank's rows, as its model made them

    def call():
        if method == "cp":
            labels = lr.next_token_labels(mine_ids, cu_seqlens=cu, cp_group=dist.group.WORLD, cp_layout=layout)
            return lr.logprobs_from_logits(logits, labels, ignore_index=-100, backend=backend)
        full = torch.empty(tokens, vocab) if rank == 0 else None
        dist.gather(logits, list(full.chunk(world)) if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        labels = lr.next_token_labels(ids, cu_seqlens=cu)
        return lr.logprobs_from_logits(full, labels, ignore_index=-100, backend=backend)

    call()  # warm-up: the backend's first call, the group's first exchange
    gc.collect()
    dist.barrier()
    lr.layouts.exchanged(reset=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    t = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - t
    peak = _status("VmHWM:") - base
    del out
    return dict(rank=rank, held=logits.numel() * 4, extra_peak=peak, seconds=seconds,
                exchanged=lr.layouts.exchanged())


def main(argv=None) -> int:
    from logprob_registry.distributed import launch
    from logprob_registry.layouts import _WIDTH

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--layouts", default="contiguous,zigzag")
    ap.add_argument("--backend", default="chunked")
    a = ap.parse_args(argv)
    mb = 2 ** 20
    print(f"packed stream of {a.tokens} tokens {_lengths(a.tokens)}, V = {a.vocab}, float32 logits "
          f"({a.tokens * a.vocab * 4 / mb:.0f} MiB in all), backend {a.backend}")
    print(f"{'cp':>3} {'layout':10} {'method':7} {'rank':>4} {'held MiB':>9} {'extra peak MiB':>15} "
          f"{'held+extra MiB':>15} {'seconds':>8} {'p2p bytes in':>13}")
    for cp in (int(x) for x in a.cp.split(",")):
        for layout in a.layouts.split(","):
            for method in ("cp", "gather"):
                if method == "gather" and layout != "contiguous":
                    continue  # gathering does not depend on the layout
                results = [r.unwrap() for r in launch.run(cp, _rank, method, layout, a.tokens, a.vocab, a.backend,
                                                          timeout=900, collective_timeout=600)]
                for r in results:
                    print(f"{cp:>3} {layout if method == 'cp' else '-':10} {method:7} {r['rank']:>4} "
                          f"{r['held'] / mb:9.1f} {r['extra_peak'] / mb:15.1f} "
                          f"{(r['held'] + r['extra_peak']) / mb:15.1f} "
                          f"{r['seconds']:8.3f} {r['exchanged']:>13}")
                sys.stdout.flush()
    print("p2p bytes in: received through next_token_labels' boundary exchange (8 bytes per chunk boundary and "
          f"row), besides its header all-gather ({8 * _WIDTH} bytes from each other rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
