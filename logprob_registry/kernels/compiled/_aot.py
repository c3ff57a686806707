"""Prebuilt kernels of the ``compiled`` backend: AOTInductor packages, built by
``logprob-registry warmup`` (through :func:`prepare`, the backend's ``prepare``) and loaded by a later process with
torch's C++ package loader, so that its first call neither imports dynamo and inductor (2-3 s on a
small CPU) nor compiles (15-25 s cold).

A package holds one kernel of :mod:`._math` (the forward with or without entropy, the backward
of an op, out of place or in place) for one dtype and one vocabulary class, exported with dynamic
rows and vocabulary. :func:`run` uses it only when the call fits what it was exported for,
checked here in Python (the package itself checks nothing: wrong strides would give wrong numbers,
int32 labels would abort the process); any other call, and every kernel without a package (the
softcap and tile kernels), takes the torch.compile path. Packages give the same bits as the
torch.compile kernels (tests/test_warmup.py checks it), so a call's result never depends on which
path it took.

A package's file name carries a key of what it is valid for: torch's version and git hash (the
package links libtorch), the machine and the CPU's instruction sets (a package built for AVX512
dies of SIGILL elsewhere), the kernels' source (:mod:`._math`) and the code here that exports
them, the inductor options, the kernel, dtype and vocabulary class. A package of another key is
never looked at: after an upgrade the first call compiles again, and says so, until
``logprob-registry warmup`` builds anew.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import inspect
import itertools
import json
import logging
import os
import platform
import threading
import time
import warnings
from functools import lru_cache
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from logprob_registry import kit
from logprob_registry.kit import FLOAT_DTYPES, dtype_name, result_dtype

from . import _math

log = logging.getLogger("logprob_registry")

FORMAT = 1
#: Inductor sums a row of more than this many elements with its cascade sum and a shorter one
#: with a plain sum; a package is exported for one side (its vocabulary class), as torch.compile
#: compiles one kernel for each.
SMALL_VOCAB = 4096
#: The vocabulary of the examples a package is exported with, per class.
EXAMPLE_VOCAB = {True: 8192, False: 1024}
FORWARD = ("fwd_logprobs", "fwd_entropy")
BACKWARD = ("bwd", "bwd_inplace")
#: The op's outputs, (logprobs, entropy), by op name.
WANT = {"logprobs": (True, False), "entropy": (False, True), "logprobs_and_entropy": (True, True)}
WANT_NAMES = {want: op for op, want in WANT.items()}

KERNEL_CACHE = kit.declare_variable(kit.Variable(
    "LOGPROB_REGISTRY_KERNEL_CACHE", str, "",
    "folder of the compiled backend's prebuilt kernels written by `logprob-registry warmup` "
    "(default ~/.cache/logprob_registry/kernels), or off to load and build none"))


def default_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "logprob_registry", "kernels")


def folder() -> Optional[str]:
    """The package folder in force, or None when ``LOGPROB_REGISTRY_KERNEL_CACHE=off``."""
    text = kit.variable_value(KERNEL_CACHE.name).strip()
    if text.lower() == "off":
        return None
    return os.path.abspath(os.path.expanduser(text)) if text else default_folder()


def _loader_class():
    """torch's C++ package loader (a private API, tested with torch 2.13), or None without it."""
    aoti = getattr(torch._C, "_aoti", None)
    return getattr(aoti, "AOTIModelPackageLoader", None)


# --------------------------------------------------------------------------- what a package is
class Spec(NamedTuple):
    """One package: a kernel of :mod:`._math` for one dtype and vocabulary class; a backward's
    ``want`` is its op's outputs (logprobs, entropy), whose gradient terms it computes."""

    kernel: str
    dtype: torch.dtype
    large: bool  # vocabulary > SMALL_VOCAB
    want: Optional[Tuple[bool, bool]] = None

    def label(self) -> str:
        op = f"[{WANT_NAMES[self.want]}]" if self.want else ""
        vocab = f"V>{SMALL_VOCAB}" if self.large else f"V<={SMALL_VOCAB}"
        return f"{self.kernel}{op} {dtype_name(self.dtype)} {vocab}"

    def stem(self) -> str:
        op = f"-{WANT_NAMES[self.want]}" if self.want else ""
        return f"{self.kernel}{op}-{dtype_name(self.dtype)}-{'large' if self.large else 'small'}"


def specs(op: str, dtype: torch.dtype, large: bool, backward: bool, inplace: bool) -> List[Spec]:
    """The packages that cover op ``op``'s calls of one dtype and vocabulary class: its forward
    kernel, and with ``backward`` / ``inplace`` its backward out of place / in place (``entropy``
    has no in-place backward)."""
    want = WANT[op]
    found = [Spec("fwd_entropy" if want[1] else "fwd_logprobs", dtype, large)]
    if backward:
        found.append(Spec("bwd", dtype, large, want))
    if inplace and op != "entropy":
        found.append(Spec("bwd_inplace", dtype, large, want))
    return found


@lru_cache(maxsize=None)
def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), hashed: inductor picks the instruction sets at build time."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    return hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


@lru_cache(maxsize=None)
def _source_hash() -> str:
    """The kernels' module, and the code here that exports them (not the rest of this module)."""
    h = hashlib.sha256()
    with open(_math.__file__, "rb") as f:
        h.update(f.read())
    for part in (_Forward, _Backward, _example, _program):
        h.update(inspect.getsource(part).encode())
    h.update(repr((SMALL_VOCAB, EXAMPLE_VOCAB)).encode())
    return h.hexdigest()[:16]


def identity() -> Dict[str, object]:
    """What every package of this process must have been built with (see the module docstring)."""
    return {
        "format": FORMAT, "torch": torch.__version__, "torch_git": torch.version.git_version,
        "system": platform.system(), "machine": platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(), "cpu_flags": _cpu_flags(),
        "source": _source_hash(), "inductor_options": sorted(_math.INDUCTOR_OPTIONS.items()),
    }


def key(spec: Spec) -> Dict[str, object]:
    """A package's full key: :func:`identity` and the spec."""
    return dict(identity(), kernel=spec.kernel, dtype=dtype_name(spec.dtype), large=spec.large,
                want=list(spec.want) if spec.want else None, device="cpu")


def path(spec: Spec, where: str) -> str:
    digest = hashlib.sha256(json.dumps(key(spec), sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(where, f"{spec.stem()}-{digest}.pt2")


# --------------------------------------------------------------------------- loading and running
class _Package:
    """A loaded package. One lock per loader: two threads in one loader deadlock (the runner
    waits for the GIL that the other thread holds while it waits for the runner)."""

    def __init__(self, file: str, key: tuple = ()):
        self.path = file
        self.key = key
        self._runner = _loader_class()(file, "model", False, 1, -1)
        self._lock = threading.Lock()

    def __call__(self, tensors: list) -> list:
        with self._lock:
            return self._runner.boxed_run(tensors)


_packages: Dict[Tuple[Spec, str], Optional[_Package]] = {}
_lock = threading.RLock()
#: Paths of the packages loaded since the last :func:`forget` (tests read it).
loaded: List[str] = []


def forget() -> None:
    """Drop every loaded package and every "not built" answer (a package built since is seen at
    the next call); a loader's extraction folder under the temp dir goes with it."""
    with _lock:
        _packages.clear()
        del loaded[:]


atexit.register(forget)  # a loader removes its extraction folder when destroyed


def _package(spec: Spec) -> Optional[_Package]:
    where = folder()
    if where is None:
        return None
    found = _packages.get((spec, where), False)
    if found is not False:
        return found
    with _lock:
        file = path(spec, where)
        package = None
        if os.path.exists(file) and _loader_class() is not None:
            try:
                package = _Package(file, (spec, where))
                loaded.append(file)
            except Exception as exc:  # a damaged or foreign file: torch.compile instead
                log.warning("logprob_registry: backend 'compiled': the prebuilt kernel %s could not be "
                            "loaded (%s: %s); using torch.compile for it. Run `logprob-registry warmup "
                            "--force` to build it again.", file, type(exc).__name__, exc)
        _packages[(spec, where)] = package
        return package


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: What :func:`run` returns when no package fits the call.
MISSING = _Missing()


def _column(t, lead: tuple, dtype: torch.dtype) -> bool:
    """Whether ``t`` is an N-sized argument a package takes: shape (..., 1), dtype, contiguous."""
    return t.dtype == dtype and t.shape == lead and t.is_contiguous() and t.device.type == "cpu"


def run(name: str, args: tuple):
    """Kernel ``name`` on ``args`` (as :func:`._kernels._run` takes them) through its package, or
    :data:`MISSING` when none is built for this kind of call or the call does not fit it."""
    if name not in FORWARD and name not in BACKWARD:
        return MISSING
    x = args[0]
    if x.device.type != "cpu" or x.dtype not in FLOAT_DTYPES or x.dim() < 2 or x.shape[-1] < 2:
        return MISSING
    large = x.shape[-1] > SMALL_VOCAB
    if name in FORWARD:
        if len(args) != 3 or x.dim() != 2:
            return MISSING
        spec = Spec(name, x.dtype, large)
    else:
        if len(args) != 9:
            return MISSING
        spec = Spec(name, x.dtype, large, (args[1] is not None, args[4] is not None))
    package = _package(spec)
    if package is None:
        return MISSING
    try:
        if name in FORWARD:
            return _forward(package, *args)
        return _backward(package, name == "bwd_inplace", *args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # not seen; should a package fail, torch.compile takes its calls
        log.warning("logprob_registry: backend 'compiled': the prebuilt kernel %s failed (%s: %s); "
                    "using torch.compile for its calls in this process.", package.path, type(exc).__name__, exc)
        with _lock:
            _packages[package.key] = None
        return MISSING



def built(name: str, x: torch.Tensor, want: Optional[Tuple[bool, bool]] = None) -> bool:
    """Whether kernel ``name``'s package (a backward's for an op's ``want``) is built for x's device,
    dtype and vocabulary class. A call with skipped rows then gathers them for the package, so that a
    process after ``warmup`` compiles nothing; without one it takes the row kernels (_ops)."""
    if name not in FORWARD and name not in BACKWARD:
        return False
    if x.device.type != "cpu" or x.dtype not in FLOAT_DTYPES or x.shape[-1] < 2:
        return False
    return _package(Spec(name, x.dtype, x.shape[-1] > SMALL_VOCAB, want if name in BACKWARD else None)) is not None

def _forward(package: _Package, x, idx, k):
    if x.shape[0] == 2 and x.stride(0) == 0 and x.stride(1) == 1:  # a row as two views of itself
        x = x.contiguous()  # 2 x V: the package's rows are V apart (_ops._row_stats makes the pair)
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) != x.shape[1]):
        return MISSING
    if not _column(idx, x.shape[:-1] + (1,), torch.int64) or not isinstance(k, float):
        return MISSING
    return tuple(package([x, idx, torch.tensor(k, dtype=torch.float64)]))


def _backward(package: _Package, inplace: bool, x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t):
    # rows of two dims or more whose 2-D planes are contiguous (logits[:, :-1] is such a 3-D view)
    if x.stride(-1) != 1 or (x.shape[-2] > 1 and x.stride(-2) != x.shape[-1]) or (inplace and x.dim() != 2):
        return MISSING
    lead = x.shape[:-1] + (1,)
    columns = [t for t in (idx, m, log2_s, h, g_lp, g_ent) if t is not None]
    dtypes = [torch.int64] * (idx is not None) + [result_dtype(x.dtype)] * (len(columns) - (idx is not None))
    if not all(_column(t, lead, d) for t, d in zip(columns, dtypes)):
        return MISSING
    if not isinstance(k, float) or not isinstance(inv_t, float):
        return MISSING
    scales = [torch.tensor(k, dtype=torch.float64), torch.tensor(inv_t, dtype=torch.float64)]
    if inplace:
        package([x, *columns, *scales])
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 2:
        package([x, out, *columns, *scales])
        return out
    for index in _indices(x.shape[:-2]):
        package([x[index], out[index], *(t[index] for t in columns), *scales])
    return out


def _indices(shape) -> Iterator[tuple]:
    return itertools.product(*map(range, shape))


# --------------------------------------------------------------------------- building
class BuildError(RuntimeError):
    """A package could not be built (its message says why and what to do)."""


class Built(NamedTuple):
    """What :func:`build` did for one spec: ``"built"`` (in ``seconds``) or ``"present"``."""

    spec: Spec
    path: str
    status: str
    seconds: float


class _Forward(torch.nn.Module):
    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = _math.KERNELS[kernel]

    def forward(self, x, idx, k):
        return self.kernel(x, idx, k)


class _Backward(torch.nn.Module):
    """Writes the gradient into ``out`` (out of place: the caller's fresh tensor, or one plane of
    it) or into ``x`` (in place); absent terms come in as None, which export drops."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace

    def forward(self, x, out, idx, m, log2_s, h, g_lp, g_ent, k, inv_t):
        if self.inplace:
            _math._bwd_inplace(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t)
        else:
            out.copy_(_math._bwd(x, idx, m, log2_s, h, g_lp, g_ent, k, inv_t))
        return ()


def _example(spec: Spec, rows: int, vocab: int, seed: int) -> tuple:
    """Example arguments of ``spec``'s program, as the package will take them (None: absent)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(spec.dtype)
    idx = torch.randint(0, vocab, (rows, 1), generator=gen)
    scale = torch.tensor(_math.LOG2E / 0.7, dtype=torch.float64)
    if spec.kernel in FORWARD:
        return (x, idx, scale)
    fd = result_dtype(spec.dtype)
    m = x.to(fd).amax(-1, keepdim=True)
    log2_s = torch.exp2((x.to(fd) - m) * scale).sum(-1, keepdim=True).log2()
    want_logp, want_entropy = spec.want

    def column():
        return torch.randn(rows, 1, generator=gen).to(fd)

    out = None if spec.kernel == "bwd_inplace" else torch.empty_like(x)
    return (x, out, idx if want_logp else None, m, log2_s, column() if want_entropy else None,
            column() if want_logp else None, column() if want_entropy else None, scale,
            torch.tensor(1 / 0.7, dtype=torch.float64))


def _program(spec: Spec):
    from torch.export import Dim

    n = Dim("n", min=1)
    v = Dim("v", min=SMALL_VOCAB + 1) if spec.large else Dim("v", min=2, max=SMALL_VOCAB)
    args = _example(spec, 8, EXAMPLE_VOCAB[spec.large], 0)
    if spec.kernel in FORWARD:
        return _Forward(spec.kernel), args, ({0: n, 1: v}, {0: n}, None)
    dims = tuple(None if a is None else ({0: n, 1: v} if i < 2 else {0: n}) for i, a in enumerate(args[:8]))
    return _Backward(spec.kernel == "bwd_inplace"), args, dims + (None, None)


def _check(spec: Spec, file: str) -> None:
    """Run the new package on another shape than it was exported with, against the eager kernel."""
    args = _example(spec, 5, EXAMPLE_VOCAB[spec.large] + 3 if spec.large else 37, 1)
    x, scales = args[0], args[-2:]
    package = _Package(file)
    if spec.kernel in FORWARD:
        got = package([x, args[1], args[2]])
        want = _math.KERNELS[spec.kernel](x, args[1], float(args[2]))
    else:
        columns = [t for t in args[2:8] if t is not None]
        want = [_math._bwd(x, *args[2:8], float(scales[0]), float(scales[1]))]
        target = x.clone() if spec.kernel == "bwd_inplace" else args[1]
        package(([] if spec.kernel == "bwd_inplace" else [x]) + [target, *columns, *scales])
        got = [target]
    try:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    except (AssertionError, ValueError) as exc:
        raise BuildError(f"the package built for {spec.label()} gives other numbers than the kernel it "
                         f"was built from ({exc}); it was not installed. Please report this with the "
                         "output of `logprob-registry info`.") from None


@contextlib.contextmanager
def _file_lock(file: str):
    """An exclusive lock on ``file``'s hidden lock file, across processes (POSIX; none elsewhere)."""
    try:
        import fcntl
    except ImportError:  # Windows: the temp name + os.replace still keep the package whole
        yield
        return
    lock = os.path.join(os.path.dirname(file), "." + os.path.basename(file) + ".lock")
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_build_lock = threading.Lock()


def build(spec: Spec, where: Optional[str] = None, force: bool = False) -> Built:
    """Build ``spec``'s package into folder ``where`` (default: :func:`folder`) unless it is there.
    Safe across threads and processes: one builder at a time per package, written under a temp
    name and moved into place, so that no process ever loads half a file."""
    where = where or folder()
    if where is None:
        raise BuildError("LOGPROB_REGISTRY_KERNEL_CACHE is off: set it to a folder (or unset it) to build "
                         "prebuilt kernels")
    if _loader_class() is None:
        raise BuildError(f"this torch ({torch.__version__}) has no AOTInductor package loader "
                         "(torch._C._aoti.AOTIModelPackageLoader); prebuilt kernels need torch 2.6 or newer")
    os.makedirs(where, exist_ok=True)
    file = path(spec, where)
    with _build_lock, _file_lock(file):
        if os.path.exists(file) and not force:
            return Built(spec, file, "present", 0.0)
        start = time.perf_counter()
        tmp = f"{file[:-4]}.{os.getpid()}.{threading.get_ident()}.tmp.pt2"  # AOTI wants .pt2
        try:
            _compile(spec, tmp)
            _check(spec, tmp)
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        seconds = time.perf_counter() - start
        _write_json(file[:-len(".pt2")] + ".json", dict(key(spec), built_seconds=round(seconds, 1),
                                                       built_at=time.strftime("%Y-%m-%dT%H:%M:%S")))
    with _lock:
        _packages.pop((spec, where), None)  # seen at the next call of this process
    return Built(spec, file, "built", seconds)


def _compile(spec: Spec, file: str) -> None:
    import torch._inductor

    module, args, dynamic_shapes = _program(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export's own deprecation notices
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
            torch._inductor.aoti_compile_and_package(program, package_path=file,
                                                     inductor_configs=dict(_math.INDUCTOR_OPTIONS))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise BuildError(f"building {spec.label()} failed ({type(exc).__name__}: {first}); building "
                             "needs a working C++ compiler (g++, or the one CXX names); the chained "
                             "exception has the details") from exc


def _write_json(file: str, data: dict) -> None:
    tmp = f"{file}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, file)


# --------------------------------------------------------------------------- prepare (warmup)
def plan(request) -> List[Spec]:
    """The packages a :class:`~logprob_registry.backend.Preparation` asks for, each once, in build
    order; a ValueError for a request this backend has nothing to build for."""
    ops = list(request.ops)
    bad = [op for op in ops if op not in WANT]
    if bad or not ops:
        raise ValueError(f"prebuilt kernels exist for {', '.join(WANT)}; got {ops!r}")
    if request.device.split(":")[0] != "cpu":
        raise ValueError(f"prebuilt kernels exist for the CPU only; on {request.device}, the compiled backend's "
                         "first call uses torch.compile and its caches (docs/backends/compiled.md)")
    bad = [d for d in request.dtypes if d not in FLOAT_DTYPES]
    if bad or not request.dtypes:
        raise ValueError(f"prebuilt kernels take floating dtypes, got {list(request.dtypes)!r}")
    classes = sorted({v > SMALL_VOCAB for v in request.vocab}, reverse=True)
    found: List[Spec] = []
    for dtype in request.dtypes:
        for large in classes:
            for op in ops:
                found += [s for s in specs(op, dtype, large, request.backward, request.inplace) if s not in found]
    return found


def prepare(request) -> list:
    """The backend's ``prepare`` (``logprob-registry warmup``): build the packages ``request`` asks
    for into ``request.folder`` (default :func:`folder`), keeping those already there unless
    ``request.force``; in a dry run, only name them. One record per package, its ``detail`` the
    :class:`Spec`."""
    wanted = plan(request)
    where = request.folder or folder()
    if where is None:
        raise ValueError("LOGPROB_REGISTRY_KERNEL_CACHE is off, so no prebuilt kernel would be loaded; unset it, "
                         "or set it to a folder")
    done = []
    for spec in wanted:
        file = path(spec, where)
        if request.dry_run:
            done.append(request.record(spec.label(), file, "planned", detail=spec))
            continue
        if request.force or not os.path.exists(file):
            request.say(f"building {spec.label()} ...")
        built = build(spec, where, force=request.force)
        done.append(request.record(spec.label(), built.path, built.status, built.seconds, detail=spec))
    return done
