"""The GPU proofs that `logprob-registry check` and `bench` do not make (run by scripts/gpu_check.sh).

    python scripts/gpu_proof.py [--device cuda] [--quick] [--json FILE]   # the checks; exit 1 if one failed
    python scripts/gpu_proof.py merge OUT.json PART.json...              # bench documents into one
    python scripts/gpu_proof.py summary DIR                              # markdown from DIR/bench.json, proof.json

The checks, each on every backend eligible for bf16 logits with gradients on the device:

1. past_int32: logits (8, 4096, 151936) bf16, 4.98e9 elements (2.3 x 2**31, 9.3 GiB), the last
   row's label the last column (whose logit is raised so that it matters): log-probabilities against
   float64 (in blocks of rows), the last one by name, and the gradients of the first, a middle and
   the last row; triton's gradient over the logits (inplace_backward) too. An int32 offset overflows
   past 2**31 elements (trl #7266's kernel did, exactly there).
2. cuda_graph: a forward+backward step through lr.logprobs_from_logits (its gradient by
   torch.autograd.grad) captured in a CUDA graph with static shapes (4, 1024, 32768) bf16, replayed
   on new inputs copied into the captured ones: the bits of the eager step on those inputs.
3. batch_invariance: (4096, 151936) bf16; logprobs, entropy and the gradient of one row alone,
   in a batch of 64 and in the batch of 4096: the same bits (rows 0 and 63). A backend that does not
   promise batch invariance is reported, not failed.

--quick: small shapes (any device; on the CPU the graph capture is reported as not run), to try
this script. Exit status 1 if a check failed. Needs nothing but torch and this checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

import logprob_registry as lr
from logprob_registry.numerics import tolerance

RESULTS: list = []
BF16 = torch.bfloat16


def record(name: str, ok, **details) -> None:
    """One check's verdict: ok True/False, or None for a check that did not run (``skipped``)."""
    RESULTS.append(dict(check=name, ok=ok, **details))
    extra = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items())
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name} {extra}", flush=True)


def attempt(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # one check's failure must not hide the others
        record(name, False, error=f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


ONLY_BACKENDS: list = []  # --backend: these alone


def eligible(dev: torch.device, op: str = "logprobs") -> list:
    names = lr.explain(op, device=dev.type, dtype=BF16, requires_grad=True).eligible
    return [n for n in names if n in ONLY_BACKENDS] if ONLY_BACKENDS else names


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------ 1. past int32
def past_int32(dev: torch.device, shape) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(shape, generator=g, device=dev, dtype=BF16).mul_(4)
    vocab = shape[-1]
    labels = torch.randint(0, vocab, shape[:-1], generator=g, device=dev)
    labels[-1, -1] = vocab - 1
    x[-1, -1, -1] = 20.0  # the last element of all: a large logit, so that a wrong read shows
    flat, flat_labels = x.view(-1, vocab), labels.view(-1)
    n = flat.shape[0]
    want = torch.empty(n, dtype=torch.float64, device=dev)
    for a in range(0, n, 1024):  # float64 in blocks of rows: 1.2 GiB at a time
        want[a:a + 1024] = flat[a:a + 1024].double().log_softmax(-1).gather(1, flat_labels[a:a + 1024, None])[:, 0]
    tol = tolerance(flat)
    rows = (0, n // 2 + 1, n - 1)
    print(f"past_int32: {tuple(shape)} bf16, {x.numel():.3g} elements ({x.numel() / 2**31:.2f} x 2**31), "
          f"label {vocab - 1} in the last row", flush=True)

    def row_grads(grad) -> float:
        worst = 0.0
        for r in rows:
            p = flat[r].double().softmax(-1)
            p[flat_labels[r]] -= 1.0  # d(logprob)/dx = onehot - p, for an upstream gradient of 1
            worst = max(worst, float((grad.view(-1, vocab)[r].double() + p).abs().max()))
        return worst

    for backend in eligible(dev):
        def case(b=backend):
            with torch.no_grad():
                lp = lr.logprobs_from_logits(x, labels, backend=b)
            err = float((lp.view(-1).double() - want).abs().max())
            last = float(lp[-1, -1])
            del lp
            leaf = x.detach().requires_grad_(True)
            out = lr.logprobs_from_logits(leaf, labels, backend=b)
            (grad,) = torch.autograd.grad(out.sum(), leaf)
            del out
            gerr = row_grads(grad)
            del grad
            gtol = torch.finfo(BF16).eps  # the gradient rounded to bf16: half a unit at 1, its largest size
            record(f"past_int32 {b}", err <= tol and gerr <= gtol, max_err=err, tol=tol,
                   last=last, last_want=float(want[-1]), grad_err_rows=gerr, grad_tol=gtol)

        attempt(f"past_int32 {backend}", case)
    if "triton" in eligible(dev):
        def inplace():
            leaf = x.detach().clone().requires_grad_(True)
            out = lr.logprobs_from_logits(leaf, labels, backend="triton", inplace_backward=True)
            (grad,) = torch.autograd.grad(out.sum(), leaf)
            gerr, over = row_grads(grad), grad.data_ptr() == leaf.data_ptr()
            record("past_int32 triton inplace_backward", over and gerr <= torch.finfo(BF16).eps,
                   grad_err_rows=gerr, wrote_over_logits=over)

        attempt("past_int32 triton inplace_backward", inplace)


# ------------------------------------------------------------------------------ 2. CUDA graph
def cuda_graph(dev: torch.device, shape) -> None:
    if dev.type != "cuda":
        record("cuda_graph", None, skipped=f"CUDA graphs need a CUDA device, not {dev.type}")
        return
    for backend in eligible(dev):
        def case(b=backend):
            g = torch.Generator(device=dev).manual_seed(1)
            fresh = lambda: (torch.randn(shape, generator=g, device=dev, dtype=BF16) * 4,  # noqa: E731
                             torch.randint(0, shape[-1], shape[:-1], generator=g, device=dev),
                             torch.randn(shape[:-1], generator=g, device=dev))
            x0, y0, up0 = fresh()
            x, y, up = x0.clone().requires_grad_(True), y0.clone(), up0.clone()

            def step():
                lp = lr.logprobs_from_logits(x, y, ignore_index=-100, backend=b)
                (grad,) = torch.autograd.grad(lp, x, up)
                return lp, grad

            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up: compiles, caches, the autograd engine's streams
                    step()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lp_static, grad_static = step()
            x1, y1, up1 = fresh()
            y1[0, :7] = -100  # ignored positions in the replayed inputs
            with torch.no_grad():
                x.copy_(x1)
            y.copy_(y1)
            up.copy_(up1)
            graph.replay()
            sync(dev)
            lp_eager, grad_eager = step()
            same = torch.equal(lp_static, lp_eager) and torch.equal(grad_static, grad_eager)
            changed = not torch.equal(lp_static, lr.logprobs_from_logits(x0, y0, ignore_index=-100, backend=b))
            record(f"cuda_graph {b}", same and changed, replay_bitwise_eager=same, replay_saw_new_inputs=changed)

        attempt(f"cuda_graph {backend}", case)


# ------------------------------------------------------------------------- 3. batch invariance
def batch_invariance(dev: torch.device, rows: int, vocab: int) -> None:
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(rows, vocab, generator=g, device=dev, dtype=BF16) * 4
    y = torch.randint(0, vocab, (rows,), generator=g, device=dev)
    sizes = (1, 64, rows)
    for backend in eligible(dev):
        def case(b=backend):
            got = {}
            for n in sizes:
                leaf = x[:n].detach().clone().requires_grad_(True)
                lp, ent = lr.logprobs_and_entropy(leaf, y[:n], backend=b)
                (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), leaf)
                got[n] = (lp.detach(), ent.detach(), grad)
            same = all(torch.equal(got[n][k][r], got[rows][k][r]) for n in sizes for k in range(3)
                       for r in (0, min(n, 64) - 1))
            promised = lr.get_registry().get(b).batch_invariant
            record(f"batch_invariance {b}", same or not promised, bitwise=same, promises_batch_invariance=promised,
                   sizes="1,64," + str(rows))

        attempt(f"batch_invariance {backend}", case)


# ----------------------------------------------------------------------------------- merging
def merge(out: str, parts: list) -> int:
    """The bench documents ``parts`` (one per bench command) as one: their runs in order, and the
    first one's environment."""
    docs = []
    for p in parts:
        try:
            with open(p) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"merge: {p}: {exc}", file=sys.stderr)
    if not docs:
        return 1
    merged = dict(docs[0], runs=[r for d in docs for r in d["runs"]], commands=[d.get("options") for d in docs])
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    return 0


SEED = dict(shape=[16, 1024, 32768], dtype="float32", compiled_ms=1.566, naive_ms=5.1)  # on an H100


def summary(folder: str) -> int:
    """The tables for docs/hardware.md: every bench row, the seed's comparison, the proofs."""
    import os

    from logprob_registry.benchmark.render import fmt_bytes, fmt_err, fmt_fraction, fmt_time

    lines = []
    path = os.path.join(folder, "bench.json")
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        env = doc["environment"]
        lines += [f"{env.get('device_name')}, torch {env.get('torch')}, triton {env.get('triton')}, "
                  f"python {env.get('python')}, {doc.get('created')}", "",
                  "| op | B x T x V (H) | dtype | pass | method | time | GB/s | % of peak | peak memory | "
                  "max abs err | max abs grad err |", "|" + " --- |" * 11]
        for run in doc["runs"]:
            s = run["settings"]
            shape = "x".join(map(str, s["shape"])) + (f" ({s['hidden_size']})" if s.get("hidden_size") else "")
            for r in run["results"]:
                kind = ("fwd+bwd" + (" in place" if s.get("inplace_backward") else "")) if s["backward"] else "fwd"
                if r["status"] != "ok":
                    lines.append(f"| {s['op']} | {shape} | {s['dtype']} | {kind} | {r['name']} | "
                                 f"FAILED: {r['error'][:80]} |" + " |" * 5)
                    continue
                bw = r.get("bandwidth_bytes_per_s")
                grad = r.get("max_abs_diff_grad")
                if grad is None and r.get("max_abs_diff_grads"):
                    grad = max(v for v in r["max_abs_diff_grads"].values() if v is not None)
                lines.append(
                    f"| {s['op']} | {shape} | {s['dtype']} | {kind} | "
                    f"{r['name']}{' *' if r.get('automatic_choice') else ''} | {fmt_time(r['time_median_s'])} | "
                    f"{'-' if bw is None else f'{bw / 1e9:.0f}'} | {fmt_fraction(r.get('bandwidth_fraction'))} | "
                    f"{fmt_bytes(r['peak_bytes'])} | {fmt_err(r['max_abs_diff'])} | {fmt_err(grad)} |")
            if s["op"] == "logprobs" and list(s["shape"]) == SEED["shape"] and s["dtype"] == SEED["dtype"] \
                    and not s["backward"]:
                base = next((r for r in run["results"] if r["kind"] == "baseline" and r["status"] == "ok"), None)
                for r in run["results"]:
                    if base and r["status"] == "ok" and r["kind"] == "backend":
                        lines.append(f"seed comparison: {r['name']} {r['time_median_s'] * 1e3:.3f} ms, "
                                     f"{base['time_median_s'] / r['time_median_s']:.2f}x the textbook baseline "
                                     f"(the seed on an H100: compiled {SEED['compiled_ms']} ms, "
                                     f"{SEED['naive_ms'] / SEED['compiled_ms']:.2f}x naive)")
    path = os.path.join(folder, "proof.json")
    if os.path.exists(path):
        with open(path) as f:
            proofs = json.load(f)
        lines += ["", "| check | verdict | details |", "| --- | --- | --- |"]
        for r in proofs:
            details = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                if k not in ("check", "ok"))
            verdict = "not run" if r["ok"] is None else "pass" if r["ok"] else "FAIL"
            lines.append(f"| {r['check']} | {verdict} | {details} |")
    print("\n".join(lines) if lines else f"nothing to summarise in {folder}")
    return 0 if lines else 1


def main(argv) -> int:
    if argv[:1] == ["merge"] and len(argv) >= 3:
        return merge(argv[1], argv[2:])
    if argv[:1] == ["summary"] and len(argv) == 2:
        return summary(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes, to try this script")
    parser.add_argument("--json", help="write the verdicts here")
    parser.add_argument("--only", default="past_int32,cuda_graph,batch_invariance", help="comma-separated checks")
    parser.add_argument("--backend", default="", help="comma-separated backends (default: every eligible one)")
    args = parser.parse_args(argv)
    ONLY_BACKENDS[:] = [b for b in args.backend.split(",") if b]
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here (--device cpu --quick: a dry run)", file=sys.stderr)
        return 2
    print(f"eligible on {dev.type} for bf16 logits with gradients: {eligible(dev)}", flush=True)
    only = set(args.only.split(","))
    if "past_int32" in only:
        past_int32(dev, (2, 64, 4096) if args.quick else (8, 4096, 151936))
    if "cuda_graph" in only:
        cuda_graph(dev, (2, 64, 4096) if args.quick else (4, 1024, 32768))
    if "batch_invariance" in only:
        batch_invariance(dev, *((128, 4096) if args.quick else (4096, 151936)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    failed = [r["check"] for r in RESULTS if r["ok"] is False]
    print(f"{sum(r['ok'] is True for r in RESULTS)} passed, {len(failed)} failed, "
          f"{sum(r['ok'] is None for r in RESULTS)} not run: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
