"""The vocabulary-parallel path (process_group=) on one CUDA device: the checks the CPU cannot make.

Run from the checkout (nothing installed; about 2-4 minutes on an H200):

    PYTHONPATH=$PWD python scripts/gpu_distributed.py            # results also in $OUT/distributed.json

1. An NCCL group of one rank (file:// rendezvous): every shard-op backend eligible on CUDA
   (triton, compiled, chunked, naive) through the public functions with process_group=, bf16 and
   fp32, temperature and ignore_index, at a real vocabulary (151552 = 37 tiles), forward and
   backward: against float64 (the suite's tolerances) and against the backend's unsharded call.
2. Group-size invariance of each backend's CUDA tile kernel, in one process: the backend's
   shard_stats on 1, 2, 4, 37 and an uneven split of the columns, merged by the core: the same
   bits (what makes groups of any size agree).
3. The fused op (hidden_shard_stats/grad) in the NCCL group against float64, and the weight
   gradient's bits across splits.
4. Time of the process_group= call (NCCL, one rank) beside the backend's unsharded call.

Exit status 1 if a check failed. For groups of 2 and 4 processes on one GPU (gloo carrying the
statistics through the CPU), run the suite's distributed section:
``logprob-registry check --backend triton --device cuda -k distributed``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.distributed.merge import merge
from logprob_registry.distributed.tiles import TILE
from logprob_registry.numerics import tolerance

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_proof import RESULTS, attempt, record  # noqa: E402 - this folder's sibling script

V = 37 * TILE
N = 256
DEV = torch.device("cuda")  # --device cpu: a dry run of this script with gloo (small sizes)


def logits_case(backend: str, dtype: torch.dtype, group) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, V, generator=g, dtype=torch.float64) * 4).to(dtype)
    x[1, TILE:2 * TILE] = float("-inf")
    y = torch.randint(0, V, (N,), generator=g)
    y[1], y[3] = 5, -100
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    leaf = x.to(DEV, copy=True).requires_grad_(True)
    lp, ent = lr.logprobs_and_entropy(leaf, y.to(DEV), temperature=0.7, ignore_index=-100, process_group=group,
                                      backend=backend)
    ((lp * up[0].to(DEV)).sum() + (ent * up[1].to(DEV)).sum()).backward()
    x64 = x.double().requires_grad_(True)
    rl, re = ref.logprobs_and_entropy(x64, y, temperature=0.7, ignore_index=-100)
    ((rl * up[0]).sum() + (re * up[1]).sum()).backward()
    tol = tolerance(x, 0.7)
    err_lp = float((lp.double().cpu() - rl).abs().max())
    err_ent = float((ent.double().cpu() - re).abs().max())
    gtol = 4 * tolerance(x, 0.7, output="entropy") * float(up.abs().max()) / 0.7
    eps = max(torch.finfo(dtype).eps, 4 * torch.finfo(torch.float32).eps)
    gerr = float(((leaf.grad.double().cpu() - x64.grad).abs() - eps * x64.grad.abs()).max())
    with torch.no_grad():
        ul, ue = lr.logprobs_and_entropy(x.to(DEV), y.to(DEV), temperature=0.7, ignore_index=-100, backend=backend)
    diff = max(float((lp - ul).abs().max()), float((ent - ue).abs().max()))
    record(f"nccl-1 {backend} {dtype} logprobs_and_entropy", err_lp <= tol and err_ent <= 10 * tol and gerr <= gtol,
           err_logprobs=err_lp, tol=tol, err_entropy=err_ent, grad_excess=gerr, grad_tol=gtol,
           max_diff_unsharded=diff)


def invariance(backend: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(N, V, generator=g) * 4).to(dtype).to(DEV)
    x[2, :TILE] = float("-inf")
    stats = lr.get_registry().get(backend).ops["shard_stats"]
    splits = {"1": [0, V], "2": [0, 18 * TILE, V], "4": [0, 9 * TILE, 18 * TILE, 27 * TILE, V],
              "37": list(range(0, V + 1, TILE)), "uneven": [0, 36 * TILE, V]}
    merged = {}
    for name, bounds in splits.items():
        parts = [stats(x[:, a:b], None, vocab_start=a, tile=TILE, temperature=0.7, ignore_index=None,
                       with_entropy=True) for a, b in zip(bounds, bounds[1:])]
        merged[name] = merge(*(torch.cat([p[i] for p in parts], dim=1) for i in range(3)))
    same = all(torch.equal(m[0], merged["1"][0]) and torch.equal(m[1], merged["1"][1]) for m in merged.values())
    rows = all(torch.equal(merge(*stats(x[i:i + 1], None, vocab_start=0, tile=TILE, temperature=0.7,
                                        ignore_index=None, with_entropy=True)[:3])[0], merged["1"][0][i:i + 1])
               for i in (0, 2, N - 1))
    declared = lr.get_registry().get(backend).group_invariant
    record(f"split-invariance {backend} {dtype}", same or not declared, bitwise_across_splits=same,
           row_alone_same=rows, declared_group_invariant=declared)


def hidden_case(backend: str, dtype: torch.dtype, group) -> None:
    g = torch.Generator().manual_seed(2)
    n = 64
    h0 = torch.randn(n, 512, generator=g).to(dtype)
    w0 = (torch.randn(V, 512, generator=g) * 0.05).to(dtype)
    y = torch.randint(0, V, (n,), generator=g)
    h, w = h0.to(DEV, copy=True).requires_grad_(True), w0.to(DEV, copy=True).requires_grad_(True)
    lp, ent = lr.logprobs_from_hidden(h, w, y.to(DEV), return_entropy=True, process_group=group, backend=backend)
    (lp.sum() + ent.sum()).backward()
    h64, w64 = h0.double().requires_grad_(True), w0.double().requires_grad_(True)
    rl, re = ref.logprobs_from_hidden(h64, w64, y, return_entropy=True)
    (rl.sum() + re.sum()).backward()
    bound = float((h0.double().abs() @ w0.double().abs().T).max())
    tol = tolerance(torch.empty(1, V), 1.0, bound)
    err = float((lp.double().cpu() - rl).abs().max())
    gh = float((h.grad.double().cpu() - h64.grad).abs().max() / h64.grad.abs().max())
    gw = float((w.grad.double().cpu() - w64.grad).abs().max() / w64.grad.abs().max())
    grad_w = {}
    for name, bounds in {"1": [0, V], "4": [0, 9 * TILE, 18 * TILE, 27 * TILE, V]}.items():
        op = lr.get_registry().get(backend).ops["hidden_shard_grad"]
        lse = torch.logsumexp((h0.to(DEV).float() @ w0.to(DEV).float().T), -1)  # any fixed lse will do
        parts = [op(h0.to(DEV), w0.to(DEV)[a:b], y.to(DEV), lse, None, torch.ones(n, device=DEV), None, bias=None,
                    vocab_start=a, tile=TILE, temperature=1.0, needs_grad=(False, True, False))[1]
                 for a, b in zip(bounds, bounds[1:])]
        grad_w[name] = torch.cat(parts)
    record(f"nccl-1 {backend} {dtype} logprobs_from_hidden", err <= tol and gh < 1e-2 and gw < 1e-2,
           err_logprobs=err, tol=tol, rel_err_grad_hidden=gh, rel_err_grad_weight=gw,
           weight_grad_bitwise_across_splits=bool(torch.equal(grad_w["1"], grad_w["4"])))


def timing(backend: str, group) -> None:
    rows = 4096 if DEV.type == "cuda" else 64
    x = (torch.randn(rows, 151936, device=DEV) * 4).bfloat16()
    y = torch.randint(0, 151936, (rows,), device=DEV)
    out = {}
    for name, kw in (("unsharded", {}), ("process_group", {"process_group": group})):
        for _ in range(3):
            lr.logprobs_and_entropy(x, y, backend=backend, **kw)
        sync()
        start = time.perf_counter()
        for _ in range(10):
            lr.logprobs_and_entropy(x, y, backend=backend, **kw)
        sync()
        out[name] = (time.perf_counter() - start) / 10 * 1e3
    record(f"time {backend} bf16 {rows}x151936 logprobs_and_entropy forward", True,
           unsharded_ms=out["unsharded"], process_group_ms=out["process_group"])


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def main(argv) -> int:
    global DEV, N
    path = tempfile.mktemp(prefix="logprob-nccl-")
    if argv[1:] == ["--device", "cpu"]:
        DEV, N = torch.device("cpu"), 8
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    elif not torch.cuda.is_available():
        print("no CUDA device here (--device cpu: a dry run with gloo)", file=sys.stderr)
        return 2
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    backends = [b.name for b in lr.backends() if "shard_stats" in b.ops and
                lr.explain("shard_stats", device=DEV.type)[b.name].reason is None]
    print(f"shard-op backends eligible on {DEV.type}:", backends, flush=True)
    for backend in backends:
        for dtype in (torch.bfloat16, torch.float32):
            attempt(f"nccl-1 {backend} {dtype} logprobs_and_entropy",
                    lambda b=backend, d=dtype: logits_case(b, d, group))
            attempt(f"split-invariance {backend} {dtype}", lambda b=backend, d=dtype: invariance(b, d))
        attempt(f"nccl-1 {backend} logprobs_from_hidden", lambda b=backend: hidden_case(b, torch.bfloat16, group))
        attempt(f"time {backend}", lambda b=backend: timing(b, group))
    dist.destroy_process_group()
    out = os.environ.get("OUT", "gpu_results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "distributed.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
