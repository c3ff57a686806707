#!/usr/bin/env python3
"""Fused linear logprobs against forming the logits, on the CPU: time and extra peak memory.

Compares, at one shape (N tokens, hidden size H, vocabulary V):
  fused          logprob_registry.kernels.chunked_hidden.logprobs_from_hidden (the chunked op itself)
  fused:NAME     lr.logprobs_from_hidden(..., backend=NAME), e.g. fused:chunked, fused:naive
  logits         hidden @ weight.T, then lr.logprobs_from_logits (automatic choice, or --backend)
  logits:NAME    the same with that logprobs backend forced
in two modes: fwd (no gradients) and fwdbwd (hidden and weight require grad; sum().backward()).

Method (as /work/shared/tools/peer_bench.py): each (impl, mode) runs in its own subprocesses. One
times --n calls after --warmup (median; not pinned, glibc defaults). The other measures memory:
with glibc's mmap threshold pinned (MALLOC_MMAP_THRESHOLD_=65536, so resident memory follows live
memory), the peak RSS is reset (/proc/self/clear_refs 5) before a call and the extra peak over the
resident baseline (hidden, weight, labels already allocated) is read from VmHWM. Impls run
interleaved, round by round, so that machine drift hits all alike.

The table gives the extra peak as a fraction of the N x V fp32 logits the fused op avoids and of
the weight; for fwdbwd also (extra peak - weight gradient) / logits, the figure the fused op
promises to keep at or below 0.1. "cpu s" is the process CPU time of a call: with --threads 1 it
is the work done, hardly touched by other jobs on the machine, where wall time on shared cores is
not. maxerr is the largest error of the first 64 tokens' logprobs against a float64 reference.

  flock /tmp/bench.lock python scripts/bench_hidden.py --shape 4096,2048,32768 --dtype float32
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import gc, json, sys, time, torch
N, H, V, dtname, mode, impl, backend, n, warmup, what, chunk, threads = sys.argv[1:13]
N, H, V, n, warmup, threads = int(N), int(H), int(V), int(n), int(warmup), int(threads)
if threads:
    torch.set_num_threads(threads)
chunk = int(chunk) if chunk != "-" else None
dt = getattr(torch, dtname)
torch.manual_seed(0)
import logprob_registry as lr
from logprob_registry.kernels import chunked_hidden as ch
hidden = torch.randn(N, H, dtype=torch.float32).to(dt)
weight = (torch.randn(V, H, dtype=torch.float32) * H ** -0.5 * 4).to(dt)
labels = torch.randint(0, V, (N,))
kind, _, name = impl.partition(":")
if kind == "fused" and not name:
    fn = lambda h, w, y: ch.logprobs_from_hidden(h, w, y, bias=None, temperature=1.0, ignore_index=None,
                                                 return_entropy=False, chunk_bytes=chunk)
elif kind == "fused":
    fn = lambda h, w, y: lr.logprobs_from_hidden(h, w, y, backend=name)
elif kind == "logits":
    name = name or (backend if backend != "-" else None)
    fn = lambda h, w, y: lr.logprobs_from_logits(h @ w.t(), y, backend=name)
else:
    raise SystemExit(f"unknown impl {impl!r}")
def prepare():
    hidden.grad = weight.grad = None
    if mode == "fwd":
        return hidden.detach(), weight.detach()
    return hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
def run(h, w):
    if mode == "fwd":
        with torch.no_grad():
            return fn(h, w, labels)
    out = fn(h, w, labels)
    out.sum().backward()
    return (h.grad, w.grad)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
for _ in range(warmup):
    out = run(*prepare()); del out
err = None
if what == "time":
    k = min(N, 64)
    with torch.no_grad():
        got = fn(hidden[:k], weight, labels[:k]).double()
        ref = torch.log_softmax(hidden[:k].double() @ weight.double().t(), -1).gather(1, labels[:k, None]).squeeze(1)
    err = (got - ref).abs().max().item()
ts, cs, peak = [], [], 0
for _ in range(n if what == "time" else 2):
    h, w = prepare(); gc.collect()
    with open("/proc/self/clear_refs", "w") as f: f.write("5")
    base = status("VmRSS:")
    t, c = time.perf_counter(), time.process_time()
    out = run(h, w)
    ts.append(time.perf_counter() - t); cs.append(time.process_time() - c)
    peak = max(peak, status("VmHWM:") - base)
    del out, h, w
ts.sort(); cs.sort()
print(json.dumps(dict(impl=impl, median_s=ts[len(ts) // 2], cpu_s=cs[len(cs) // 2], extra_peak_bytes=peak, maxerr=err,
                      threads=torch.get_num_threads(), torch=torch.__version__)))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096,2048,32768", help="N,H,V")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--impls", default="fused,logits")
    ap.add_argument("--backend", default=None, help="logprobs backend for the logits impl (default: automatic)")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="tile budget of the fused impl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's default)")
    ap.add_argument("--what", default="time,mem", help="time, mem or both")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    N, H, V = (int(x) for x in a.shape.split(","))
    impls, modes = a.impls.split(","), a.modes.split(",")
    res = {(m, i): [] for m in modes for i in impls}
    for _ in range(a.rounds):
        for mode in modes:
            for impl in impls:
                got = {}
                for what in a.what.split(","):
                    env = dict(os.environ)
                    if what == "mem":
                        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
                    argv = [a.python, "-c", CHILD, str(N), str(H), str(V), a.dtype, mode, impl, a.backend or "-",
                            str(a.n), str(a.warmup), what, str(a.chunk_bytes) if a.chunk_bytes else "-", str(a.threads)]
                    p = subprocess.run(argv, capture_output=True, text=True, env=env)
                    line = [x for x in p.stdout.splitlines() if x.startswith("{")]
                    if p.returncode or not line:
                        got = dict(error=((p.stderr or p.stdout).strip().splitlines() or ["no output"])[-1])
                        break
                    got[what] = json.loads(line[-1])
                if "error" in got:
                    res[(mode, impl)].append(got)
                    continue
                r = dict(got.get("time") or dict(got["mem"], median_s=float("nan"), cpu_s=float("nan")))
                r["extra_peak_bytes"] = got["mem"]["extra_peak_bytes"] if "mem" in got else float("nan")
                res[(mode, impl)].append(r)
    logits_bytes, weight_bytes = N * V * 4, V * H * torch_size(a.dtype)
    summary = {}
    for key, rs in res.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            summary[key] = dict(error=rs[-1]["error"])
            continue
        summary[key] = dict(median_s=sorted(r["median_s"] for r in ok)[len(ok) // 2],
                            cpu_s=sorted(r["cpu_s"] for r in ok)[len(ok) // 2],
                            extra_peak_bytes=max(r["extra_peak_bytes"] for r in ok), maxerr=ok[0]["maxerr"],
                            threads=ok[0]["threads"], torch=ok[0]["torch"])
    if a.json:
        print(json.dumps({f"{m} {i}": s for (m, i), s in summary.items()}))
        return
    any_ok = next((s for s in summary.values() if "error" not in s), {})
    print(f"N={N} H={H} V={V} {a.dtype}; N x V fp32 logits {logits_bytes / 2**20:.0f} MiB, weight "
          f"{weight_bytes / 2**20:.0f} MiB; rounds {a.rounds} x n {a.n}; torch {any_ok.get('torch')}, "
          f"{any_ok.get('threads')} threads; load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':7s} {'impl':18s} {'median s':>9s} {'vs logits':>9s} {'cpu s':>8s} {'vs logits':>9s} {'extra peak MiB':>15s} "
          f"{'/logits':>8s} {'/weight':>8s} {'(-wgrad)/logits':>16s} {'maxerr':>8s}")
    for (mode, impl), s in summary.items():
        if "error" in s:
            print(f"{mode:7s} {impl:18s} ERROR {s['error']}")
            continue
        base = next((summary[(mode, i)] for i in impls if i.startswith("logits") and "error" not in summary[(mode, i)]), None)
        rel = f"{s['median_s'] / base['median_s']:8.2f}x" if base else f"{'':9s}"
        crel = f"{s['cpu_s'] / base['cpu_s']:8.2f}x" if base else f"{'':9s}"
        extra = s["extra_peak_bytes"]
        minus = f"{(extra - weight_bytes) / logits_bytes:16.3f}" if mode == "fwdbwd" else f"{'':16s}"
        err = f"{s['maxerr']:.1e}" if s["maxerr"] is not None else ""
        print(f"{mode:7s} {impl:18s} {s['median_s']:9.3f} {rel} {s['cpu_s']:8.3f} {crel} {extra / 2**20:15.1f} "
              f"{extra / logits_bytes:8.3f} {extra / weight_bytes:8.3f} {minus} {err:>8s}")


def torch_size(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[dtype]


if __name__ == "__main__":
    main()
