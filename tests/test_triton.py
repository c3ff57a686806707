"""The ``triton`` backend, on the CPU through triton's interpreter, against the float64 reference.

TRITON_INTERPRET must be set before triton is imported and before the backend registers, so the
kernel cases cannot share the main pytest process: ``test_kernels_under_the_interpreter`` runs this
same file again in a subprocess with TRITON_INTERPRET=1, where the cases below the
``if INTERPRETED`` line are defined and run. Run them directly with
``TRITON_INTERPRET=1 python -m pytest tests/test_triton.py``. ``test_kernels_compile_for_gpus``
compiles the kernels for an H100/H200 (sm_90) and an MI300 (gfx942) without a GPU, which catches
what the interpreter does not (types, constexpr branches, lowering).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import logprob_registry as lr
from logprob_registry import reference as ref
from logprob_registry.environment import Environment
from logprob_registry.kernels import triton as triton_plugin
from logprob_registry.registry import Key

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = triton_plugin.interpreter_requested()
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -e '.[test]' installs it on Linux)",
)


def _subprocess_env(interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(cmd, interpret: bool, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_subprocess_env(interpret), capture_output=True, text=True, timeout=timeout
    )


# ----------------------------------------------------------------- in the main (normal) process
if not INTERPRETED:

    def test_kernels_under_the_interpreter():
        proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], True)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
        assert " passed" in proc.stdout

    def test_conformance_suite_under_the_interpreter():
        """`TRITON_INTERPRET=1 logprob-registry check --backend triton --device cpu` passes."""
        cmd = [sys.executable, "-m", "logprob_registry", "check", "--backend", "triton", "--device", "cpu"]
        proc = _run(cmd, True)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
        row = next(line for line in proc.stdout.splitlines() if line.startswith("triton "))
        assert row.split()[-1] == "pass" and row.split()[3] == "0", proc.stdout

    def test_kernels_compile_for_gpus():
        proc = _run([sys.executable, "-c", COMPILE_SCRIPT], False)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "compiled 38 kernels for cuda sm_90 and 8 for hip gfx942" in proc.stdout, proc.stdout

    def test_cpu_tensors_refused_without_the_interpreter():
        verdict = lr.explain("logprobs", device="cpu")["triton"]
        assert verdict.reason == "runs on cuda, not cpu"
        logits, labels = torch.randn(2, 5), torch.tensor([0, 1])
        with pytest.raises(lr.NoEligibleBackendError, match="runs on cuda, not cpu"):
            lr.logprobs_from_logits(logits, labels, backend="triton")
        assert "TRITON_INTERPRET=1" in lr.get_registry().get("triton").description

    def test_import_does_not_import_triton():
        code = ("import sys, logprob_registry as lr; lr.explain('logprobs', device='cpu'); "
                "print('triton' in sys.modules)")
        proc = _run([sys.executable, "-c", code], False, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "False"


def test_registration_follows_the_interpreter_setting():
    normal, interpret = triton_plugin.make_backend(False), triton_plugin.make_backend(True)
    assert normal.devices == {"cuda"} and normal.priority == 30
    assert interpret.devices == {"cuda", "cpu"} and interpret.priority < 0  # below naive: never automatic
    assert normal.inplace_backward and normal.batch_invariant and normal.deterministic
    assert set(normal.ops) == {"logprobs", "entropy", "logprobs_and_entropy", "token_stats", "shard_stats",
                               "shard_grad", "hidden_shard_stats", "hidden_shard_grad"}
    assert "stats_hidden" not in normal.features  # token_stats over logits only: hidden states go elsewhere
    assert normal.group_invariant


@pytest.mark.parametrize(
    "env_kwargs, reason",
    [
        (dict(torch="2.13.0", devices={"cuda": 1}, triton="3.9.0"), None),
        (dict(torch="2.13.0", devices={"cuda": 1}, triton="3.9.0", hip="6.2"), None),
        (dict(torch="2.13.0", devices={"cuda": 1}, triton="3.0.0"), "needs triton>=3.6, found 3.0.0"),
        (dict(torch="2.4.0", devices={"cuda": 1}, triton="3.9.0"), "needs torch>=2.13, found 2.4.0"),
        (dict(torch="2.13.0", devices={"cuda": 1}), "needs triton>=3.6, triton is not installed"),
        (dict(torch="2.13.0", devices={"cuda": 1}, triton="3.9.0", capability=(6, 1)),
         "needs CUDA compute capability 7.0 or newer (triton), found 6.1"),
        (dict(torch="2.13.0", triton="3.9.0"), "no CUDA device"),
    ],
)
def test_eligibility_on_cuda(env_kwargs, reason, make_registry):
    registry = make_registry(builtins="all", environment=Environment.fake(**env_kwargs))
    verdict = registry.explain(Key("logprobs", "cuda", torch.bfloat16, True))["triton"]
    assert verdict.reason == reason
    if reason is None:  # the highest built-in priority wins where it is eligible; not the interpreter
        assert verdict.chosen is not INTERPRETED


COMPILE_SCRIPT = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logprob_registry.kernels.triton import _kernels as k
assert not k.INTERPRETED

def sig(fn, types, consts):
    names = fn.arg_names
    out = {n: types.get(n, "i32") for n in names}
    out.update({n: "constexpr" for n in consts})
    return out

jobs = []
for x, acc in (("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
    ACC = tl.float64 if acc == "fp64" else tl.float32
    ptrs = {n: "*" + acc for n in ("lp_ptr", "ent_ptr", "m_ptr", "ls_ptr", "pm_ptr", "ps_ptr", "pt_ptr",
                                   "glp_ptr", "gent_ptr", "zs_ptr", "q_ptr", "pz_ptr", "pq_ptr")}
    ptrs.update(x_ptr="*" + x, g_ptr="*" + x, lab_ptr="*i64", t_hi="fp32", t_lo="fp32",
                xs0="i64", xs1="i64", ignore_index="i64", f_ptr="*i64", pf_ptr="*i64")
    block = 2048 if acc == "fp64" else 4096
    for split, rows in ((False, 1), (True, 1), (False, 4)):
        c = dict(ROWS=rows, BLOCK=block // rows, ACC=ACC, SPLIT=split, LABELS=True, IGNORE=True, ENTROPY=True,
                 STATS=False)
        jobs.append((k._forward_kernel, ptrs, c, 8))
    c = dict(ROWS=256, PARTS=16, ACC=ACC, LABELS=True, IGNORE=True, ENTROPY=True, STATS=False)
    jobs.append((k._combine_kernel, ptrs, c, 8))
    for split in (False, True):  # token_stats' STATS branch
        c = dict(ROWS=1, BLOCK=block, ACC=ACC, SPLIT=split, LABELS=True, IGNORE=True, ENTROPY=True, STATS=True)
        jobs.append((k._forward_kernel, ptrs, c, 8))
    c = dict(ROWS=256, PARTS=16, ACC=ACC, LABELS=True, IGNORE=True, ENTROPY=True, STATS=True)
    jobs.append((k._combine_kernel, ptrs, c, 8))
hip_jobs = list(jobs)
for x, acc in (("bf16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
    ACC = tl.float64 if acc == "fp64" else tl.float32
    ptrs = {n: "*" + acc for n in ("m_ptr", "ls_ptr", "glp_ptr", "gent_ptr", "ent_ptr")}
    ptrs.update(x_ptr="*" + x, g_ptr="*" + x, lab_ptr="*i32", t_hi="fp32", t_lo="fp32", xs0="i64")
    for rows in (1, 8):
        c = dict(ROWS=rows, BLOCK=4096 // rows, ACC=ACC, IGNORE=True, GRAD_LP=True, GRAD_ENT=True)
        jobs.append((k._backward_kernel, ptrs, c, 8))
ptrs = {n: "*fp32" for n in ("lp_ptr", "ent_ptr", "m_ptr", "ls_ptr", "pm_ptr", "ps_ptr", "pt_ptr",
                              "glp_ptr", "gent_ptr", "x_ptr", "g_ptr")}
ptrs.update(lab_ptr="*i64", t_hi="fp32", t_lo="fp32")
for labels, ignore, entropy in ((True, False, False), (False, False, True)):  # the other constexpr branches
    c = dict(ROWS=1, BLOCK=1024, ACC=tl.float32, SPLIT=False, LABELS=labels, IGNORE=ignore, ENTROPY=entropy,
             STATS=False)
    jobs.append((k._forward_kernel, ptrs, c, 2))
for grad_lp, grad_ent in ((True, False), (False, True)):
    c = dict(ROWS=1, BLOCK=1024, ACC=tl.float32, IGNORE=False, GRAD_LP=grad_lp, GRAD_ENT=grad_ent)
    jobs.append((k._backward_kernel, ptrs, c, 2))
counts = {}
for target, todo in ((GPUTarget("cuda", 90, 32), jobs), (GPUTarget("hip", "gfx942", 64), hip_jobs[:8])):
    for fn, types, consts, warps in todo:
        compiled = triton.compile(ASTSource(fn, sig(fn, types, consts), consts), target=target,
                                  options={"num_warps": warps, "enable_fp_fusion": True})
        assert compiled.asm.get("cubin") or compiled.asm.get("hsaco")
        counts[target.backend] = counts.get(target.backend, 0) + 1
print(f"compiled {counts['cuda']} kernels for cuda sm_90 and {counts['hip']} for hip gfx942")
"""


# ------------------------------------------------------- kernel cases (only under the interpreter)
if INTERPRETED:
    from logprob_registry.kernels.triton import _kernels as K

    EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
    DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    VOCABS = [1, 7, 100, 1000, 5000]

    @pytest.fixture(autouse=True)
    def small_blocks(request):
        """Blocks of 64 and chunks of 256 columns: loops and the vocabulary split run on small V
        (the interpreter takes milliseconds per block, so smaller blocks would be slow)."""
        saved = dict(K.TUNING)
        K.TUNING.update(block=64, chunk=256)
        yield
        K.TUNING.clear()
        K.TUNING.update(saved)

    def _tol(dtype, scale=1.0):
        """A small multiple of the accumulation's rounding at the inputs' magnitude ``scale``."""
        base, eps = (1e-12, 2.0**-52) if dtype == torch.float64 else (2e-6, 2.0**-23)
        return dict(rtol=base, atol=base + 4 * eps * scale)

    def _close(got, want, dtype, scale=1.0):
        assert got.dtype == ref.result_dtype(dtype)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, equal_nan=True, **_tol(dtype, scale))

    def _inputs(shape, vocab, dtype, seed=0, scale=3.0):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
        labels = torch.randint(0, vocab, shape, generator=g)
        return logits, labels

    @pytest.mark.parametrize("vocab", VOCABS)
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_values(vocab, dtype):
        logits, labels = _inputs((2, 3), vocab, dtype, seed=vocab)
        before = logits.clone()
        lp, ent = K.logprobs_and_entropy(logits, labels, 1.0, None, False)
        _close(lp, ref.logprobs(logits, labels), dtype)
        _close(ent, ref.entropy(logits), dtype)
        _close(K.logprobs(logits, labels, 1.0, None, False), ref.logprobs(logits, labels), dtype)
        _close(K.entropy(logits, 1.0), ref.entropy(logits), dtype)
        assert torch.equal(logits, before)

    @pytest.mark.parametrize(
        "block, chunk, rows", [(None, None, None), (32, 32, 1), (32, 1024, 4), (128, 128, 2), (64, 256, 1)]
    )
    def test_launch_shapes_agree(block, chunk, rows):
        """Blocks, chunks (the vocabulary split) and row tiles: same answers, gradients included."""
        K.TUNING.update(block=block, chunk=chunk, rows=rows)
        logits, labels = _inputs((5,), 1500, torch.float32, seed=1)
        labels[2] = -100
        lp, ent = K.logprobs_and_entropy(logits, labels, 0.7, -100, False)
        _close(lp, ref.logprobs(logits, labels, temperature=0.7, ignore_index=-100), torch.float32)
        _close(ent, ref.entropy(logits, temperature=0.7), torch.float32)
        weights = [torch.linspace(-1, 1, 5), torch.linspace(2, 0, 5)]
        grad, _ = _grads(lambda t: K.logprobs_and_entropy(t, labels, 0.7, -100, False), logits, weights)
        want, _ = _grads(lambda t: ref.logprobs_and_entropy(t, labels, temperature=0.7, ignore_index=-100),
                         logits.double(), [w.double() for w in weights])
        torch.testing.assert_close(grad.double(), want, rtol=2e-6, atol=2e-6)

    def _grads(fn, logits, weights):
        x = logits.detach().clone().requires_grad_(True)
        outs = fn(x)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        (grad,) = torch.autograd.grad(loss, x)
        return grad, x

    @pytest.mark.parametrize("op", ["logprobs", "entropy", "logprobs_and_entropy"])
    @pytest.mark.parametrize("inplace", [False, True])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_gradients(op, inplace, dtype):
        logits, labels = _inputs((2, 3), 300, dtype, seed=7)
        g = torch.Generator().manual_seed(3)
        weights = tuple(torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(2))
        kw = dict(temperature=0.8, ignore_index=None)
        if op == "logprobs":
            ours = lambda x: K.logprobs(x, labels, 0.8, None, inplace)
            theirs = lambda x: ref.logprobs(x, labels, **kw)
        elif op == "entropy":
            ours = lambda x: K.entropy(x, 0.8)
            theirs = lambda x: ref.entropy(x, temperature=0.8)
        else:
            ours = lambda x: K.logprobs_and_entropy(x, labels, 0.8, None, inplace)
            theirs = lambda x: ref.logprobs_and_entropy(x, labels, **kw)
        grad, x = _grads(ours, logits, [w.to(ref.result_dtype(dtype)) for w in weights])
        want, _ = _grads(theirs, logits.double(), weights)
        assert grad.dtype == dtype
        eps = max(EPS[dtype], 1e-12)  # bf16/fp16 gradients are rounded to the logits' dtype
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(grad.double(), want, rtol=eps, atol=8 * eps * scale)
        if inplace and op != "entropy":
            assert grad.data_ptr() == x.data_ptr()  # the gradient took the logits' memory
        else:
            assert torch.equal(x.detach(), logits)  # inputs unmodified

    def test_inplace_on_a_slice_writes_only_the_slice():
        base, ids = _inputs((2, 6), 50, torch.float32, seed=5)
        x = base.clone().requires_grad_(True)
        view = x[:, :-1]
        lp = K.logprobs(view, ids[:, 1:], 1.0, None, True)
        (grad,) = torch.autograd.grad(lp.sum(), x)
        want, _ = _grads(lambda t: ref.logprobs(t[:, :-1], ids[:, 1:]), base.double(),
                         [torch.ones(2, 5, dtype=torch.float64)])
        torch.testing.assert_close(grad.double(), want, rtol=2e-6, atol=2e-6)
        assert torch.equal(x.detach()[:, -1], base[:, -1])  # the row outside the slice is untouched

    def test_inplace_on_overlapping_memory_falls_back_to_out_of_place():
        row, _ = _inputs((1,), 40, torch.float32, seed=2)
        x = row.expand(3, 40).detach().requires_grad_(True)
        labels = torch.tensor([0, 5, 39])
        (grad,) = torch.autograd.grad(K.logprobs(x, labels, 1.0, None, True).sum(), x)
        want, _ = _grads(lambda t: ref.logprobs(t, labels), row.expand(3, 40).double(),
                         [torch.ones(3, dtype=torch.float64)])
        torch.testing.assert_close(grad.double(), want, rtol=2e-6, atol=2e-6)
        assert torch.equal(x.detach()[0], row[0])

    def test_strided_leading_dims_and_labels():
        base, ids = _inputs((3, 7), 130, torch.bfloat16, seed=11)
        logits, labels = base[:, :-1], ids[:, 1:]  # the shifted-by-one case
        assert not logits.is_contiguous() and not labels.is_contiguous()
        lp, ent = K.logprobs_and_entropy(logits, labels.to(torch.int32), 1.0, None, False)
        _close(lp, ref.logprobs(logits, labels), torch.bfloat16)
        _close(ent, ref.entropy(logits), torch.bfloat16)
        perm = base.permute(1, 0, 2)  # leading dims in a transposed order
        _close(K.logprobs(perm, ids.t(), 1.0, None, False), ref.logprobs(perm, ids.t()), torch.bfloat16)

    def test_vocabulary_stride_and_many_leading_dims():
        base, _ = _inputs((90,), 4, torch.float32, seed=4)
        logits = base.t()  # (4, 90) with a vocabulary stride of 4
        labels = torch.arange(4) * 7
        _close(K.logprobs(logits, labels, 1.0, None, False), ref.logprobs(logits, labels), torch.float32)
        big, big_labels = _inputs((3, 4, 5, 6), 30, torch.float32, seed=6)
        logits5 = big[:, ::2, 1:, ::3]  # four leading dims that cannot be merged: one launch per outer index
        labels5 = big_labels[:, ::2, 1:, ::3]
        grad, _ = _grads(lambda t: K.logprobs_and_entropy(t, labels5, 1.3, None, False), logits5,
                         [torch.ones(3, 2, 4, 2)] * 2)
        want, _ = _grads(lambda t: ref.logprobs_and_entropy(t, labels5, temperature=1.3), logits5.double(),
                         [torch.ones(3, 2, 4, 2, dtype=torch.float64)] * 2)
        _close(K.logprobs(logits5, labels5, 1.3, None, False), ref.logprobs(logits5, labels5, temperature=1.3),
               torch.float32)
        torch.testing.assert_close(grad.double(), want, rtol=2e-6, atol=2e-6)

    @pytest.mark.parametrize("ignore_index", [-100, 3, 2**40])
    def test_ignore_index(ignore_index):
        logits, labels = _inputs((4, 5), 200, torch.float32, seed=8)
        labels[0, :3] = ignore_index
        labels[2, 4] = ignore_index
        ignored = labels == ignore_index
        grad, _ = _grads(lambda t: K.logprobs(t, labels, 1.0, ignore_index, False), logits, [torch.ones(4, 5)])
        lp = K.logprobs(logits, labels, 1.0, ignore_index, False)
        _close(lp, ref.logprobs(logits, labels, ignore_index=ignore_index), torch.float32)
        assert torch.all(lp[ignored] == 0)
        assert torch.all(grad[ignored] == 0)
        assert torch.all(grad[~ignored].abs().sum(-1) > 0)
        _, ent = K.logprobs_and_entropy(logits, labels, 1.0, ignore_index, False)
        _close(ent, ref.entropy(logits), torch.float32)  # entropy of ignored positions as usual

    def test_minus_inf_entries():
        logits, labels = _inputs((4,), 300, torch.float32, seed=9)
        logits[:, ::3] = float("-inf")
        labels[0] = 3  # a label on a -inf logit gives -inf
        logits[3, 256:512] = float("-inf")  # a whole chunk of -inf
        lp, ent = K.logprobs_and_entropy(logits, labels, 1.0, None, False)
        assert lp[0] == float("-inf")
        _close(lp, ref.logprobs(logits, labels), torch.float32)
        _close(ent, ref.entropy(logits), torch.float32)
        keep = torch.tensor([1, 2, 3])
        grad, _ = _grads(lambda t: K.logprobs_and_entropy(t[keep], labels[keep], 1.0, None, False), logits,
                         [torch.ones(3)] * 2)
        want, _ = _grads(lambda t: ref.logprobs_and_entropy(t[keep], labels[keep]), logits.double(),
                         [torch.ones(3, dtype=torch.float64)] * 2)
        torch.testing.assert_close(grad.double(), want, rtol=2e-6, atol=2e-6)
        assert torch.isfinite(grad).all()

    def test_nan_propagates_to_its_row_only():
        logits, labels = _inputs((3,), 500, torch.float32, seed=10)
        logits[1, 77] = float("nan")
        lp, ent = K.logprobs_and_entropy(logits, labels, 1.0, None, False)
        assert torch.isnan(lp[1]) and torch.isnan(ent[1])
        assert torch.isfinite(lp[[0, 2]]).all() and torch.isfinite(ent[[0, 2]]).all()
        _close(lp, ref.logprobs(logits, labels), torch.float32)

    @pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0) inside the interpreter
    def test_all_minus_inf_row_matches_the_reference():
        logits, labels = _inputs((2,), 100, torch.float32, seed=12)
        logits[1] = float("-inf")
        lp, ent = K.logprobs_and_entropy(logits, labels, 1.0, None, False)
        _close(lp, ref.logprobs(logits, labels), torch.float32)
        _close(ent, ref.entropy(logits), torch.float32)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_large_magnitudes(dtype):
        logits, labels = _inputs((3,), 1000, dtype, seed=13, scale=1.0)
        logits[:, ::2] = 1e4
        logits[:, 1::4] = -1e4
        logits = logits.to(dtype)
        lp, ent = K.logprobs_and_entropy(logits, labels, 1.0, None, False)
        _close(lp, ref.logprobs(logits, labels), dtype, scale=1e4)
        _close(ent, ref.entropy(logits), dtype, scale=1e4)

    @pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5, 1e-3, 1e3])
    def test_temperature(temperature):
        logits, labels = _inputs((2, 2), 700, torch.float64, seed=14)
        lp, ent = K.logprobs_and_entropy(logits, labels, temperature, None, False)
        _close(lp, ref.logprobs(logits, labels, temperature=temperature), torch.float64, scale=1 / temperature)
        _close(ent, ref.entropy(logits, temperature=temperature), torch.float64, scale=1 / temperature)

    @pytest.mark.parametrize("rows", [None, 1, 4])
    def test_deterministic_and_batch_invariant(rows):
        K.TUNING.update(rows=rows)  # a row alone, or at another place in a tile of rows
        logits, labels = _inputs((6,), 3000, torch.bfloat16, seed=15)
        one = K.logprobs_and_entropy(logits, labels, 0.9, None, False)
        two = K.logprobs_and_entropy(logits, labels, 0.9, None, False)
        assert all(torch.equal(a, b) for a, b in zip(one, two))
        for i in (0, 3, 5):
            alone = K.logprobs_and_entropy(logits[i:i + 1], labels[i:i + 1], 0.9, None, False)
            assert torch.equal(alone[0][0], one[0][i]) and torch.equal(alone[1][0], one[1][i])
            alone = K.logprobs_and_entropy(logits[i:], labels[i:], 0.9, None, False)
            assert torch.equal(alone[0][0], one[0][i]) and torch.equal(alone[1][0], one[1][i])

    @pytest.mark.parametrize("inplace", [False, True])
    def test_backward_never_reads_rows_without_upstream_gradient(inplace):
        """Rows whose label is ignored, or whose upstream gradient is 0 (a GRPO prompt row), get exact
        zeros without their logits being read (NaN there would spread); the other rows' gradients are
        bitwise those of a call on them alone."""
        logits, labels = _inputs((8,), 300, torch.float32, seed=18)
        labels[:3] = -100
        logits[:4] = math.nan
        up = torch.linspace(1, 2, 8)
        up[3] = 0.0
        x = logits.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad((K.logprobs(x, labels, 0.8, -100, inplace) * up).sum(), x)
        assert torch.equal(grad[:4], torch.zeros(4, 300))
        alone = logits[4:].clone().requires_grad_(True)
        (want,) = torch.autograd.grad((K.logprobs(alone, labels[4:], 0.8, -100, False) * up[4:]).sum(), alone)
        assert torch.equal(grad[4:], want)
        x = logits.clone().requires_grad_(True)
        lp, ent = K.logprobs_and_entropy(x, labels, 0.8, -100, inplace)
        (grad,) = torch.autograd.grad((lp * up).sum() + (ent * up).sum(), x)
        assert torch.isnan(grad[:3]).all()  # ignored labels still get the entropy's gradient: their logits are read
        assert torch.equal(grad[3], torch.zeros(300)) and torch.isfinite(grad[4:]).all()

    def _wide(rows, vocab, stride, seed):
        """bf16 logits (rows, vocab) whose row r starts at element r * stride of one allocation that is
        never written elsewhere (its untouched pages take address space, not memory): with a stride of
        2**30 the third row starts at element 2**31 (byte 2**32), past what an int32 offset reaches."""
        base = torch.empty(stride * (rows - 1) + vocab, dtype=torch.bfloat16)
        wide = base.as_strided((rows, vocab), (stride, 1))
        logits, _ = _inputs((rows,), vocab, torch.bfloat16, seed=seed)
        wide.copy_(logits)
        return wide

    @pytest.mark.parametrize("stride", [2**30, 2**31 + 64])  # a stride in int32 times a row; one past it
    @pytest.mark.parametrize("chunk", [256, None])  # the vocabulary split (with the combine kernel), or not
    def test_offsets_past_int32(stride, chunk):
        """Row offsets beyond 2**31 elements (trl #7266's kernel overflowed there): every kernel
        (forward, combine, backward out of place and over the logits, the shard tile statistics)
        gives the bits of the same rows laid out contiguously; the labels sit in the last column."""
        K.TUNING.update(chunk=chunk)
        rows, vocab = (3 if stride < 2**31 else 2), 1000
        wide = _wide(rows, vocab, stride, seed=17)
        dense = wide.contiguous()
        labels = torch.full((rows,), vocab - 1)
        labels[0] = 0
        got = K.logprobs_and_entropy(wide, labels, 0.9, None, False)
        want = K.logprobs_and_entropy(dense, labels, 0.9, None, False)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        _close(got[0], ref.logprobs(dense, labels, temperature=0.9), torch.bfloat16)
        weights = [torch.linspace(-1, 1, rows), torch.linspace(2, 0, rows)]
        want_grad, _ = _grads(lambda t: K.logprobs_and_entropy(t, labels, 0.9, None, False), dense, weights)
        x = wide.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(sum((o * w).sum() for o, w in
                                          zip(K.logprobs_and_entropy(x, labels, 0.9, None, False), weights)), x)
        assert torch.equal(grad, want_grad) and torch.equal(wide, dense)  # out of place: the logits kept
        x = wide.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad((K.logprobs(x, labels, 0.9, None, True) * weights[0]).sum(), x)
        want_grad, _ = _grads(lambda t: K.logprobs(t, labels, 0.9, None, False), dense, weights[:1])
        assert grad.data_ptr() == wide.data_ptr() and torch.equal(wide, want_grad)  # written over the logits
        from logprob_registry.kernels.triton import _shards

        wide.copy_(dense)
        kw = dict(vocab_start=0, tile=256, temperature=0.9, ignore_index=None, with_entropy=True)
        got, want = _shards.shard_stats(wide, labels, **kw), _shards.shard_stats(dense, labels, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    def test_through_the_registry():
        explanation = lr.explain("logprobs", device="cpu", dtype=torch.bfloat16, requires_grad=True)
        assert explanation["triton"].eligible and not explanation["triton"].chosen  # never automatic on CPU
        logits, labels = _inputs((2, 3), 64, torch.bfloat16, seed=16)
        x = logits.clone().requires_grad_(True)
        lp = lr.logprobs_from_logits(x, labels, temperature=0.5, ignore_index=-100, backend="triton")
        assert lp.grad_fn is not None and "LogprobsEntropy" in type(lp.grad_fn).__name__
        _close(lp.detach(), ref.logprobs(logits, labels, temperature=0.5), torch.bfloat16)
        with lr.use_backend("triton"):
            ent = lr.entropy_from_logits(logits)
        _close(ent, ref.entropy(logits), torch.bfloat16)

    def test_cpu_without_interpreted_kernels_is_a_clear_error(monkeypatch):
        monkeypatch.setattr(K, "INTERPRETED", False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            K.logprobs(torch.randn(2, 3), torch.tensor([0, 1]), 1.0, None, False)

    # --------------------------------------------------------------------------------- token_stats
    STATS = lr.TokenStats._fields

    def _stats_case(shape, vocab, dtype, seed):
        """Logits with a masked column, every third label on its row's argmax, one ignored (-100)."""
        logits, labels = _inputs(shape, vocab, dtype, seed=seed)
        logits[..., 5] = float("-inf")
        labels.view(-1)[::3] = logits.double().argmax(-1).view(-1)[::3]
        labels.view(-1)[1] = -100
        return logits, labels

    @pytest.mark.parametrize("block, chunk", [(64, 256), (32, 64), (None, None)])  # split and combined, or not
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
    @pytest.mark.parametrize("softcap", [None, 12.0])
    def test_token_stats(block, chunk, dtype, softcap):
        """Every field in the forward kernel's pass: logprobs and entropy bitwise triton's
        logprobs_from_logits / logprobs_and_entropy (all fields or a subset), the others against
        float64; raw = processed without truncation."""
        K.TUNING.update(block=block, chunk=chunk)
        logits, labels = _stats_case((2, 3), 700, dtype, seed=20)
        kw = dict(temperature=0.8, ignore_index=-100, softcap=softcap)
        got = lr.token_stats(logits, labels, outputs=STATS, backend="triton", **kw)
        lp = lr.logprobs_from_logits(logits, labels, backend="triton", **kw)
        _, ent = lr.logprobs_and_entropy(logits, labels, backend="triton", **kw)
        assert torch.equal(got.logprobs, lp) and torch.equal(got.entropy, ent)
        assert torch.equal(got.raw_logprobs, lp) and torch.equal(got.raw_entropy, ent)
        some = lr.token_stats(logits, labels, outputs=("logprobs", "is_argmax"), backend="triton", **kw)
        assert torch.equal(some.logprobs, lp) and torch.equal(some.is_argmax, got.is_argmax)
        assert some.entropy is None and some.mean_logit is None
        want = dict(zip(STATS, lr.opspec.OPS["token_stats"].ground_truth(logits.double(), labels, outputs=STATS, **kw)))
        for name in ("log_sum_p2", "mean_logit", "max_logit"):
            _close(getattr(got, name), want[name], dtype, scale=4.0)
        assert torch.equal(got.is_argmax, want["is_argmax"])
        assert bool(got.is_argmax.view(-1)[::3].all()) and not bool(got.is_argmax.view(-1)[1])

    def test_token_stats_gradient_ties_and_no_labels():
        """The four differentiable fields' gradient is the ops' kernel's with the summed upstream
        gradients (bitwise); an exact tie goes to the first maximum, also across chunks; without
        labels, the label-free fields."""
        K.TUNING.update(block=32, chunk=64)
        logits, labels = _stats_case((4,), 300, torch.float32, seed=21)
        up = torch.linspace(-1, 1, 4)
        x = logits.clone().requires_grad_(True)
        got = lr.token_stats(x, labels, outputs=STATS, ignore_index=-100, backend="triton")
        assert all(getattr(got, n).grad_fn is None for n in ("log_sum_p2", "mean_logit", "max_logit", "is_argmax"))
        finite = torch.isfinite(got.logprobs)
        loss = (torch.where(finite, got.logprobs + 2 * got.raw_logprobs, 0.0) * up + got.entropy - got.raw_entropy * up)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        y = logits.clone().requires_grad_(True)
        lp, ent = lr.logprobs_and_entropy(y, labels, ignore_index=-100, backend="triton")
        (want,) = torch.autograd.grad((torch.where(finite, 3 * lp, 0.0) * up + ent * (1 - up)).sum(), y)
        assert torch.equal(grad, want)
        tied = logits.clone()
        tied[:, 40] = tied[:, 250] = tied.amax(-1) + 1.0  # in different chunks of 64
        tied[1, 20] = tied[1, 40]  # the same chunk, an earlier block
        first = torch.tensor([40, 20, 40, 40])
        assert bool(lr.token_stats(tied, first, outputs=("is_argmax",), backend="triton").is_argmax.all())
        assert not bool(lr.token_stats(tied, torch.full((4,), 250), outputs=("is_argmax",),
                                       backend="triton").is_argmax.any())
        free = ("entropy", "log_sum_p2", "mean_logit", "max_logit")
        got = lr.token_stats(logits, None, outputs=free, backend="triton")
        want = lr.token_stats(logits, None, outputs=free, backend="naive")
        for name in free:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=2e-5)
