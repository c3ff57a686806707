"""Threads against one process's registry, run in a fresh process by tests/test_robustness.py
(``python tests/stress.py first-calls automatic|explicit`` or ``python tests/stress.py faults``);
prints one JSON document: what each call did, and what the registry says at the end.

Every backend's ops are wrapped to record, per thread, which backend served the last call, so that
a test can compare it with what ``explain`` names for that kind of call.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import traceback
import warnings

import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.config import ConfigError
from logprob_registry.registry import Key, vocab_bucket
from logprob_registry.registry.key import hidden_bucket

_served = threading.local()


def _spy(name, fn):
    def run(*args, **kwargs):
        _served.name = name
        return fn(*args, **kwargs)

    return run


def spy_on_backends() -> None:
    """Record the backend of each call (``served()``), for every backend registered now."""
    for backend in lr.get_registry().backends():
        for op, fn in list(backend.ops.items()):
            backend.ops[op] = _spy(backend.name, fn)


def served():
    name, _served.name = getattr(_served, "name", None), None
    return name


def explained(op, dtype, grad, vocab, features=frozenset(), hidden=None):
    """What explain names for the kind of call (as ops.py builds its key: vocabulary bucket, features,
    and for the fused op the hidden size's bucket)."""
    return lr.get_registry().explain(Key(op, "cpu", dtype, grad, frozenset(features), vocab_bucket(vocab),
                                         hidden_bucket(hidden))).chosen


def close(got, want, what, tol=1e-4):
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if got.shape != want.shape or not err <= tol:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max error {err:.3g}")


# ------------------------------------------------------------------------------------ first calls
def first_calls(mode: str) -> dict:
    """Four threads make their first call at once (compiled: a torch._dynamo import under way)."""
    spy_on_backends()
    barrier = threading.Barrier(4)
    results = {}

    def work(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(5, 300, generator=g).requires_grad_(True)
        y = torch.randint(0, 300, (5,), generator=g)
        barrier.wait()
        try:
            out = lr.logprobs_from_logits(x, y, backend="compiled" if mode == "explicit" else None)
            name = served()
            out.sum().backward()
            x64 = x.detach().double().requires_grad_(True)
            want = ref.logprobs(x64, y)
            want.sum().backward()
            close(out, want, "logprobs")
            close(x.grad, x64.grad, "gradient")
            results[i] = {"served": name, "error": None}
        except Exception as exc:  # reported, not raised: the test says which thread failed and how
            results[i] = {"served": served(), "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"results": results, "explained": explained("logprobs", torch.float32, True, 300),
            "broken": {str(k): v for k, v in lr.get_registry().broken().items()}}


# ------------------------------------------------------------------------------------ faults
class _Gate:
    """Many valid calls at once (shared), or one process-wide change alone (exclusive): a bad
    environment variable fails every call in the process while it is set."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def shared(self):
        gate = self

        class _Shared:
            def __enter__(self):
                with gate._cond:
                    gate._cond.wait_for(lambda: not gate._exclusive)
                    gate._shared += 1

            def __exit__(self, *exc):
                with gate._cond:
                    gate._shared -= 1
                    gate._cond.notify_all()

        return _Shared()

    def exclusive(self):
        gate = self

        class _Exclusive:
            def __enter__(self):
                with gate._cond:
                    gate._cond.wait_for(lambda: not gate._exclusive and gate._shared == 0)
                    gate._exclusive = True

            def __exit__(self, *exc):
                with gate._cond:
                    gate._exclusive = False
                    gate._cond.notify_all()

        return _Exclusive()


def _faulty(*args, **kwargs):
    raise RuntimeError("kernel bug: a genuinely broken backend")


def _memory_hungry(logits, labels, *, temperature, ignore_index, inplace_backward):
    """Correct, except that 13 rows are 'too many' for this device (torch's out-of-memory error)
    and 17 rows for the host (the CPU allocator's RuntimeError)."""
    if logits.shape[0] == 13:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if logits.shape[0] == 17:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    return ref.logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index,
                                    dtype=ref.result_dtype(logits.dtype))


class FaultPlugin:
    @lr.hookimpl
    def register_backends(self, register):
        register(lr.Backend(name="fi-faulty", ops={"entropy": _faulty}, priority=1000,
                            description="raises on every call: it must end up marked broken, and only it"))
        register(lr.Backend(name="fi-memory", ops={"logprobs_and_entropy": _memory_hungry}, priority=999,
                            description="correct, but out of memory for some shapes: never marked broken"))


VOCAB = 300  # above the smallest vocabularies, where naive is the automatic choice (min_vocab)


def _data(seed, rows=6, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3, torch.randint(0, vocab, (rows,), generator=g)


def _valid_logprobs_grad(seed):
    x0, y = _data(seed)
    y[1] = -100
    x = x0.clone().requires_grad_(True)
    out = lr.logprobs_from_logits(x, y, temperature=0.8, ignore_index=-100)
    name = served()
    out.sum().backward()
    x64 = x0.double().requires_grad_(True)
    want = ref.logprobs(x64, y, temperature=0.8, ignore_index=-100)
    want.sum().backward()
    close(out, want, "logprobs")
    close(x.grad, x64.grad, "its gradient")
    return name, explained("logprobs", torch.float32, True, VOCAB)


def _valid_entropy(seed):
    x, _ = _data(seed)
    out = lr.entropy_from_logits(x)
    name = served()
    close(out, ref.entropy(x), "entropy", tol=1e-3)
    return name, explained("entropy", torch.float32, False, VOCAB)


def _valid_both(seed):
    x, y = _data(seed)
    lp, ent = lr.logprobs_and_entropy(x, y)
    name = served()
    want = ref.logprobs_and_entropy(x, y)
    close(lp, want[0], "logprobs")
    close(ent, want[1], "entropy", tol=1e-3)
    return name, explained("logprobs_and_entropy", torch.float32, False, VOCAB)


def _valid_hidden(seed):
    g = torch.Generator().manual_seed(seed)
    h0, w0 = torch.randn(5, 16, generator=g), torch.randn(VOCAB, 16, generator=g) * 0.3
    y = torch.randint(0, VOCAB, (5,), generator=g)
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    out = lr.logprobs_from_hidden(h, w, y)
    name = served()
    out.sum().backward()
    h64, w64 = h0.double().requires_grad_(True), w0.double().requires_grad_(True)
    want = ref.logprobs_from_hidden(h64, w64, y)
    want.sum().backward()
    close(out, want, "hidden logprobs")
    close(h.grad, h64.grad, "hidden's gradient")
    close(w.grad, w64.grad, "weight's gradient")
    return name, explained("logprobs_from_hidden", torch.float32, True, VOCAB, hidden=16)


def _valid_bf16(seed):
    x, y = _data(seed)
    x = x.bfloat16()
    out = lr.logprobs_from_logits(x, y)
    name = served()
    close(out, ref.logprobs(x, y), "bf16 logprobs")
    return name, explained("logprobs", torch.bfloat16, False, VOCAB)


def _valid_use_backend(seed):
    x, y = _data(seed)
    with lr.use_backend("naive"):  # this thread only: the others keep the automatic choice
        out = lr.logprobs_from_logits(x, y)
        name = served()
        chosen = explained("logprobs", torch.float32, False, VOCAB)
    close(out, ref.logprobs(x, y), "logprobs under use_backend")
    return name, chosen


def _valid_functorch(seed):
    x, y = _data(seed)
    got = torch.func.grad(lambda t: lr.logprobs_from_logits(t, y, temperature=0.7).sum())(x)
    name = served()
    x64 = x.double().requires_grad_(True)
    ref.logprobs(x64, y, temperature=0.7).sum().backward()
    close(got, x64.grad, "torch.func.grad")
    return name, explained("logprobs", torch.float32, True, VOCAB, {"functorch"})


VALID = [_valid_logprobs_grad, _valid_entropy, _valid_both, _valid_hidden, _valid_bf16, _valid_use_backend,
         _valid_functorch]


def _expect(error, fn):
    try:
        fn()
    except error:
        return
    except Exception as exc:
        raise AssertionError(f"expected {error.__name__}, got {type(exc).__name__}: {exc}") from None
    raise AssertionError(f"expected {error.__name__}, nothing was raised")


def _bad_calls(seed):
    x, y = _data(seed)
    h, w = torch.randn(5, 16), torch.randn(90, 16)
    yh = torch.randint(0, 90, (5,))
    return {
        "empty vocabulary": lambda: _expect(ValueError, lambda: lr.logprobs_from_logits(
            torch.randn(3, 0), torch.full((3,), -100), ignore_index=-100)),
        "hidden size 0": lambda: _expect(ValueError, lambda: lr.logprobs_from_hidden(
            torch.randn(5, 0), torch.randn(90, 0), yh)),
        "label out of range": lambda: _expect(ValueError, lambda: lr.logprobs_from_logits(x, y + 1000)),
        "float labels": lambda: _expect(TypeError, lambda: lr.logprobs_and_entropy(x, y.float())),
        "zero temperature": lambda: _expect(ValueError, lambda: lr.entropy_from_logits(x, temperature=0.0)),
        "meta tensors": lambda: _expect(ValueError, lambda: lr.logprobs_from_hidden(
            h.to("meta"), w.to("meta"), yh.to("meta"))),
        "huge ignore_index": lambda: _expect(ValueError, lambda: lr.logprobs_from_logits(x, y, ignore_index=2**70)),
        "unknown backend": lambda: _expect(lr.NoEligibleBackendError, lambda: lr.logprobs_from_logits(
            x, y, backend="no-such")),
        "device out of memory": lambda: _expect(torch.OutOfMemoryError, lambda: lr.logprobs_and_entropy(
            *_data(seed, rows=13))),
        "host out of memory": lambda: _expect(RuntimeError, lambda: lr.logprobs_and_entropy(*_data(seed, rows=17))),
        "functorch through a backend without it": lambda: _expect(lr.NoEligibleBackendError, lambda: torch.func.grad(
            lambda t: lr.logprobs_from_logits(t, y, backend="chunked").sum())(x)),
    }


BAD_VARIABLES = [("LOGPROB_REGISTRY_CHUNKED_WORKSPACE", "garbage"), ("LOGPROB_REGISTRY_HIDDEN_CHUNK_BYTES", "-5"),
                 ("LOGPROB_REGISTRY_CHUNKED_WORKSPACE", "0")]


def _bad_configuration(seed, gate):
    name, text = BAD_VARIABLES[seed % len(BAD_VARIABLES)]
    x, y = _data(seed)
    with gate.exclusive():  # process-wide: no other call runs while it is set
        os.environ[name] = text
        try:
            _expect(ConfigError, lambda: lr.logprobs_from_logits(x, y))
            _expect(ConfigError, lambda: lr.logprobs_from_hidden(torch.randn(5, 16), torch.randn(90, 16),
                                                                 torch.randint(0, 90, (5,))))
        finally:
            del os.environ[name]


def faults(calls_per_thread: int = 36) -> dict:
    """Four threads, each a shuffled sequence of valid calls and of every kind of bad call."""
    lr.get_registry().add_plugin(FaultPlugin(), name="fault-injection")
    spy_on_backends()
    gate = _Gate()
    records, problems = [], []
    lock = threading.Lock()
    fallbacks = []

    def work(t):
        rng = random.Random(t)
        bad = list(_bad_calls(t))
        plan = [("valid", f.__name__) for f in VALID] * 3 + [("bad", b) for b in bad] + [("config", "")] * 2
        plan = (plan * (calls_per_thread // len(plan) + 1))[:max(calls_per_thread, len(plan))]
        rng.shuffle(plan)
        for i, (kind, what) in enumerate(plan):
            seed = 100 * t + i
            try:
                if kind == "config":
                    _bad_configuration(seed, gate)
                    continue
                with gate.shared():
                    if kind == "bad":
                        _bad_calls(seed)[what]()
                        continue
                    name, chosen = {f.__name__: f for f in VALID}[what](seed)
                with lock:
                    records.append({"thread": t, "call": what, "served": name, "explained": chosen})
            except Exception as exc:
                with lock:
                    problems.append(f"thread {t}, {kind} call {what}: {type(exc).__name__}: {exc}\n"
                                    + "".join(traceback.format_exc(limit=-3)))

    def show(message, category, *args, **kwargs):  # catch_warnings is not thread-safe: one hook for all
        if issubclass(category, lr.BackendFallbackWarning):
            with lock:
                fallbacks.append(str(message))

    warnings.simplefilter("always", lr.BackendFallbackWarning)
    warnings.showwarning = show
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = {r["call"]: None for r in records}
    for f in VALID:  # what explain names at the end, for each kind of valid call (fresh data)
        if f.__name__ in final:
            final[f.__name__] = f(0)[1]
    return {"records": records, "problems": problems, "fallbacks": fallbacks, "final": final,
            "broken": {f"{k.op} {k.dtype} grad={k.requires_grad}": sorted(v) for k, v in
                       lr.get_registry().broken().items()}}


if __name__ == "__main__":
    what = sys.argv[1]
    result = first_calls(sys.argv[2]) if what == "first-calls" else faults()
    print(json.dumps(result))
