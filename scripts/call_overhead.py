"""What the public function adds to a small call (issue #16): validation, key, selection, dispatch.

For one logits shape (default 8x128x1000 float32), forward and forward+backward, the median time
per call of

* ``log_softmax`` + ``gather`` (the textbook formula, what a user would write by hand),
* ``lr.logprobs_from_logits`` with the automatic choice (a cached key), and with ``backend=`` set to
  that same backend explicitly,
* that backend's op called directly (``Backend.ops["logprobs"]``): the kernel alone,

and the difference "automatic - direct": the cost of the path from the public function to the
kernel, also measured alone with a backend that returns at once (free of the kernel's noise).
Timings interleave the methods in rounds, so that a busy machine's drift hits all alike.

    python scripts/call_overhead.py                      # 8x128x1000 float32
    python scripts/call_overhead.py --shape 1,64,1000 --calls 2000 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import logprob_registry as lr


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def methods(logits: torch.Tensor, labels: torch.Tensor, backward: bool):
    name = lr.select("logprobs", device=logits.device.type, dtype=logits.dtype, requires_grad=backward,
                     shape=logits.shape).name
    kernel = lr.get_registry().get(name).ops["logprobs"]

    def run(f):
        def call():
            x = logits.detach().requires_grad_(True) if backward else logits
            out = f(x)
            if backward:
                out.sum().backward()
        return call

    return name, {
        "log_softmax + gather": run(lambda x: torch.log_softmax(x.float(), -1).gather(-1, labels.unsqueeze(-1))
                                    .squeeze(-1)),
        "automatic": run(lambda x: lr.logprobs_from_logits(x, labels)),
        f"backend={name!r}": run(lambda x: lr.logprobs_from_logits(x, labels, backend=name)),
        # the backend's op with what the public function passes it: the same tensors, the op table's options
        f"{name}'s op directly": run(lambda x: kernel(x, labels, temperature=1.0, ignore_index=None,
                                                      inplace_backward=False)),
    }


class _Instant:
    """A plugin whose backend returns a preallocated result at once: timing the public function with
    it measures the path alone (validation, key, selection, dispatch), free of any kernel's noise."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="overhead-instant", ops={"logprobs": lambda logits, labels, **options: self.out},
                            dtypes={torch.float32, torch.bfloat16}, priority=1000))


def path_alone(logits: torch.Tensor, labels: torch.Tensor, calls: int, rounds: int) -> None:
    registry = lr.get_registry()
    plugin = _Instant(torch.empty(labels.shape))
    registry.add_plugin(plugin, name="overhead-instant")
    try:
        op = registry.get("overhead-instant").ops["logprobs"]
        ms = {"automatic": lambda: lr.logprobs_from_logits(logits, labels),
              "backend='overhead-instant'": lambda: lr.logprobs_from_logits(logits, labels, backend="overhead-instant"),
              "the op directly": lambda: op(logits, labels, temperature=1.0, ignore_index=None,
                                            inplace_backward=False)}
        times = {k: [] for k in ms}
        for _ in range(rounds):
            for k, f in ms.items():
                times[k].append(per_call(f, calls))
        med = {k: statistics.median(x) * 1e6 for k, x in times.items()}
        print("\nthe path alone (a backend that returns at once; forward, the logits not needing gradients)")
        for k, us in med.items():
            print(f"  {k:<28} {us:9.1f} us")
        direct, explicit = med["the op directly"], med["backend='overhead-instant'"]
        print(f"  path: automatic {med['automatic'] - direct:.1f} us, explicit {explicit - direct:.1f} us")
    finally:
        registry.remove_plugin("overhead-instant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8,128,1000", help="B,T,V of the logits (default 8,128,1000)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=500, help="calls per timing (default 500)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    b, t, v = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, logits {b}x{t}x{v} {args.dtype}; "
          f"median of {args.rounds} rounds of {args.calls} calls")
    for backward in (False, True):
        name, ms = methods(logits, labels, backward)
        for f in ms.values():  # warm up: compile, cache the key
            for _ in range(20):
                f()
        times = {k: [] for k in ms}
        for _ in range(args.rounds):
            for k, f in ms.items():
                times[k].append(per_call(f, args.calls))
        med = {k: statistics.median(x) * 1e6 for k, x in times.items()}
        base = med["log_softmax + gather"]
        print(f"\n{'forward+backward' if backward else 'forward'} (automatic choice: {name})")
        for k, us in med.items():
            print(f"  {k:<28} {us:9.1f} us  {us / base:5.2f}x log_softmax + gather")
        direct = med[f"{name}'s op directly"]
        print(f"  path (automatic - direct)    {med['automatic'] - direct:9.1f} us; "
              f"explicit - direct {med[f'backend={name!r}'] - direct:.1f} us")
    path_alone(logits, labels, args.calls * 4, args.rounds)


if __name__ == "__main__":
    main()
