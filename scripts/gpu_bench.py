"""Verify and benchmark the ``triton`` backend on a CUDA GPU (written for an H200; ~5 minutes).

    python3 scripts/gpu_bench.py --out DIR                 # on the GPU machine (scripts/gpu_check.sh)
    TRITON_INTERPRET=1 python3 scripts/gpu_bench.py --device cpu --smoke   # a dry run of this script

1. verify: the triton ops on CUDA against the float64 reference, for the shapes the CPU tests
   cannot afford (vocabularies of 32K, 152K, 256K; split and unsplit; bf16, fp16, fp32; strided;
   ignore_index; gradients out of place and in place).
2. bench: logprobs at 16x1024x32768 in fp32 and bf16, forward and forward+backward, for ``triton``
   (and ``triton`` in place), the registered ``compiled``, ``chunked`` and ``naive`` backends, and
   the seed's compiled cross-entropy (``torch.compile`` of fp32 ``F.cross_entropy``, reduction
   none). Reports the median time, the bandwidth achieved on the bytes that must move (the logits
   read once forward; read again and the gradient written backward) as a fraction of the H200's
   4.8 TB/s, and the peak memory beyond the inputs (``torch.cuda.max_memory_allocated``).
3. sweep (optional): the forward kernel's block size and warps, to pick better defaults.

Backends are called directly (``backend.ops[...]``), so a version specifier that excludes this
machine's torch or triton does not stop the measurement; ``logprob-registry info`` shows the
verdicts. Results go to DIR/bench.json and DIR/bench.md as they come.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logprob_registry as lr  # noqa: E402
from logprob_registry import reference as ref  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
RESULTS: dict = {"verify": [], "bench": [], "sweep": [], "notes": []}


def log(*parts) -> None:
    print(*parts, flush=True)


def save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / "bench.md").write_text(markdown())


def markdown() -> str:
    lines = ["# triton backend on " + RESULTS.get("device_name", "?"), ""]
    lines += [f"- {k}: {RESULTS[k]}" for k in ("torch", "triton", "shape") if k in RESULTS]
    lines += [f"- note: {n}" for n in RESULTS["notes"]]
    lines += ["", "## verify", "", "| case | max abs error | allowed | ok |", "| --- | --- | --- | --- |"]
    lines += [f"| {v['case']} | {v['err']:.3g} | {v['tol']:.3g} | {v['ok']} |" for v in RESULTS["verify"]]
    lines += ["", "## bench", "",
              "| dtype | pass | backend | median ms | GB/s | of 4.8 TB/s | peak extra MiB | max err vs fp64 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b in RESULTS["bench"]:
        if "error" in b:
            lines.append(f"| {b['dtype']} | {b['mode']} | {b['backend']} | failed: {b['error']} | | | | |")
            continue
        lines.append(
            f"| {b['dtype']} | {b['mode']} | {b['backend']} | {b['ms']:.3f} | {b['gbps']:.0f} | "
            f"{b['fraction']:.1%} | {b['extra_mib']} | {b['err']:.2e} |")
    if RESULTS["sweep"]:
        lines += ["", "## forward-kernel sweep", "", "| dtype | block | warps | ms | of 4.8 TB/s |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['dtype']} | {s['block']} | {s['warps']} | {s['ms']:.3f} | {s['fraction']:.1%} |"
                  for s in RESULTS["sweep"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ timing
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_extra_mib(fn, device: str):
    """Peak memory allocated while ``fn()`` runs, beyond what was allocated before it, in MiB."""
    if device != "cuda":
        return None
    sync(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated()
    del result
    return round((peak - base) / 2**20)


# ------------------------------------------------------------------------------------------ verify
def verify(device: str, smoke: bool) -> None:
    from logprob_registry.kernels import _triton_kernels as K

    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(4, 7, torch.float32), (64, 32768, torch.bfloat16), (64, 32768, torch.float32),
             (16, 151936, torch.bfloat16), (8, 262144, torch.bfloat16), (8, 262144, torch.float32),
             (8, 50257, torch.float16), (2, 262144, torch.float64)]
    if smoke:
        cases = [(4, 7, torch.float32), (3, 300, torch.bfloat16)]
    for rows, vocab, dtype in cases:
        name = f"{rows}x{vocab} {str(dtype)[6:]}"
        try:
            x = (torch.randn(rows, vocab + 3, generator=g, dtype=torch.float64) * 4).to(dtype).to(device)[:, 1:-2]
            x[0, ::5] = float("-inf")
            y = torch.randint(0, vocab, (rows,), generator=g).to(device)
            y[1 % rows] = -100
            lp, ent = K.logprobs_and_entropy(x, y, 0.9, -100, False)
            want_lp = ref.logprobs(x, y, temperature=0.9, ignore_index=-100)
            want_ent = ref.entropy(x, temperature=0.9)
            tol = 1e-11 if dtype == torch.float64 else 2e-5
            err = max(_err(lp, want_lp), _err(ent, want_ent))
            record_verify(name + " values", err, tol)
            for inplace in (False, True):
                xg = x.detach().clone().requires_grad_(True)
                w = torch.randn(rows, generator=g, dtype=torch.float64).to(device)
                lp, ent = K.logprobs_and_entropy(xg, y, 0.9, -100, inplace)
                (grad,) = torch.autograd.grad((lp * w.to(lp.dtype)).sum() + (ent * w.to(lp.dtype)).sum(), xg)
                xr = x.detach().double().requires_grad_(True)
                rl, re_ = ref.logprobs_and_entropy(xr, y, temperature=0.9, ignore_index=-100)
                (want,) = torch.autograd.grad((rl * w).sum() + (re_ * w).sum(), xr)
                eps = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dtype, 1e-6 if dtype == torch.float32 else 1e-12)
                gerr = ((grad.double() - want).abs() - eps * want.abs()).max().item()
                record_verify(name + (" grad in place" if inplace else " grad"), gerr, 8 * eps)
            again = K.logprobs_and_entropy(x, y, 0.9, -100, False)
            record_verify(name + " deterministic", 0.0 if torch.equal(again[0], K.logprobs_and_entropy(x, y, 0.9, -100, False)[0]) else 1.0, 0.0)
            del x
        except Exception as exc:  # record and go on: one failure should not hide the rest
            RESULTS["verify"].append({"case": name, "err": float("nan"), "tol": 0, "ok": f"error {type(exc).__name__}: {exc}"})
            traceback.print_exc()
        if device == "cuda":
            torch.cuda.empty_cache()


def _err(got, want) -> float:
    finite = torch.isfinite(want)
    same_inf = torch.equal(torch.isinf(got), torch.isinf(want))
    return (got.double()[finite] - want[finite]).abs().max().item() if same_inf else float("inf")


def record_verify(case: str, err: float, tol: float) -> None:
    ok = err <= tol
    RESULTS["verify"].append({"case": case, "err": err, "tol": tol, "ok": ok})
    log(f"verify {case}: {err:.3g} (allowed {tol:.3g}) {'ok' if ok else 'FAIL'}")


# ------------------------------------------------------------------------------------------- bench
def candidates(registry_names):
    """(label, fn(logits, labels, inplace)) for every backend to time."""
    out = []
    for name in ("triton", "compiled", "chunked", "naive"):
        if name not in registry_names:
            RESULTS["notes"].append(f"backend {name!r} is not registered in this checkout; not timed")
            continue
        op = lr.get_registry().get(name).ops["logprobs"]
        out.append((name, lambda x, y, inplace, op=op: op(x, y, temperature=1.0, ignore_index=None, inplace_backward=inplace)))
        if name == "triton":
            out.append(("triton (inplace)", lambda x, y, inplace, op=op: op(x, y, temperature=1.0, ignore_index=None, inplace_backward=True)))

    seed = torch.compile(_seed_ce, dynamic=False)
    out.append(("seed compiled CE (fp32)", lambda x, y, inplace: seed(x, y)))
    return out


def _seed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return -F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1), reduction="none").view(labels.shape)


def bench(device: str, shape, dtypes, warmup: int, reps: int, out: Path) -> None:
    b, t, v = shape
    names = {x.name for x in lr.backends()}
    cands = candidates(names)
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(1)
        logits = torch.randn(b, t, v, device=device, dtype=dtype, generator=g)
        labels = torch.randint(0, v, (b, t), device=device, generator=g)
        es = logits.element_size()
        check_rows = logits[0, :64]
        want = ref.logprobs(check_rows, labels[0, :64])
        for mode in ("forward", "forward+backward"):
            ideal = b * t * v * es * (1 if mode == "forward" else 3)
            for label, fn in cands:
                if label == "triton (inplace)" and mode == "forward":
                    continue
                entry = {"dtype": str(dtype)[6:], "mode": mode, "backend": label}
                leaf = None
                try:
                    if mode == "forward":
                        def run():
                            with torch.no_grad():
                                return fn(logits, labels, False)
                    else:
                        # a copy per backend: the in-place backward overwrites its logits
                        leaf = logits.detach().clone().requires_grad_(True)
                        inplace = "inplace" in label

                        def run(leaf=leaf, inplace=inplace):
                            res = fn(leaf, labels, inplace)
                            return torch.autograd.grad(res, leaf, torch.ones_like(res))[0]
                    t0 = time.perf_counter()
                    ms = timed(run, device, warmup, reps)
                    entry.update(ms=ms, gbps=ideal / ms / 1e6, fraction=ideal / (ms * 1e-3) / HBM_BYTES_PER_S,
                                 extra_mib=peak_extra_mib(run, device), wall_s=round(time.perf_counter() - t0, 1))
                    with torch.no_grad():
                        entry["err"] = (fn(check_rows, labels[0, :64], False).double() - want).abs().max().item()
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    traceback.print_exc()
                del leaf
                RESULTS["bench"].append(entry)
                log("bench", json.dumps(entry, default=str))
                save(out)
                if device == "cuda":
                    torch.cuda.empty_cache()
        del logits, labels


def sweep(device: str, shape, dtypes, reps: int, out: Path) -> None:
    from logprob_registry.kernels import _triton_kernels as K

    b, t, v = shape
    for dtype in dtypes:
        logits = torch.randn(b, t, v, device=device, dtype=dtype)
        labels = torch.randint(0, v, (b, t), device=device)
        ideal = logits.numel() * logits.element_size()
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                K.TUNING.update(block=block, num_warps=warps)
                try:
                    ms = timed(lambda: K.logprobs(logits, labels, 1.0, None, False), device, 2, reps)
                except Exception as exc:
                    log("sweep", block, warps, "failed", exc)
                    continue
                RESULTS["sweep"].append({"dtype": str(dtype)[6:], "block": block, "warps": warps, "ms": ms,
                                         "fraction": ideal / (ms * 1e-3) / HBM_BYTES_PER_S})
                log("sweep", RESULTS["sweep"][-1])
        K.TUNING.update(block=None, num_warps=None)
        save(out)
        del logits, labels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_results")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, to check this script anywhere")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing measured")
        return 2
    import triton

    RESULTS.update(torch=torch.__version__, triton=triton.__version__,
                   device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)")
    shape = (2, 8, 256) if args.smoke else (16, 1024, 32768)
    RESULTS["shape"] = "x".join(map(str, shape))
    log("torch", torch.__version__, "triton", triton.__version__, RESULTS["device_name"])
    t0 = time.perf_counter()
    verify(device, args.smoke)
    save(args.out)
    log(f"verify done in {time.perf_counter() - t0:.0f}s")
    bench(device, shape, (torch.float32, torch.bfloat16), 1 if args.smoke else 3, 2 if args.smoke else args.reps, args.out)
    log(f"bench done in {time.perf_counter() - t0:.0f}s")
    if not args.no_sweep and not args.smoke:
        sweep(device, shape, (torch.bfloat16, torch.float32), 5, args.out)
    save(args.out)
    log(markdown())
    failed = [v for v in RESULTS["verify"] if v["ok"] is not True]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
