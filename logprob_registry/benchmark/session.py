"""The bench engine: from what is asked (:class:`Options`) to the settings, the checks that they
can run here (device, memory, backends), the methods of each setting, and their measurement.

``logprob-registry bench`` is a thin command over it; from Python::

    from logprob_registry.benchmark import bench
    doc = bench(ops=["logprobs_from_hidden"], device="cpu", shape=(2, 64, 512), hidden_size=32)
    print(render(doc))   # logprob_registry.benchmark.render.render

Nothing is measured before every check has passed: a usage problem raises :class:`BenchError`
with one sentence saying what to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..dtypes import DTYPE_NAMES
from ..opspec import OPS
from . import fit
from .settings import (
    DEFAULT_HIDDEN_SIZE,
    DEFAULT_PRESET,
    PRESETS,
    Setting,
    bench_ops,
    canonical_dtype,
    output_choices,
    parse_list,
    parse_shape,
    takes_hidden_size,
    uses_hidden_size,
)

Progress = Callable[[str, bool], None]  # (text, end of line)


class BenchError(Exception):
    """A usage problem: reported in one sentence (the command exits with status 2)."""


@dataclass
class Options:
    """What a bench run measures; each field is the ``bench`` option of the same name.

    Lists accept comma-separated items too (``ops=["logprobs,entropy"]``); ``shape`` a tuple or
    ``"B,T,V"``. Without ``shape``, the ``preset`` (default ``"small"``) gives shape, dtype,
    slicing and hidden size.
    """

    ops: Sequence[str] = ("logprobs",)
    dtypes: Sequence[str] = ()            # default: float32, or the preset's
    shape: Union[None, str, Tuple[int, int, int]] = None
    preset: Optional[str] = None
    hidden_size: Optional[int] = None     # ops with hidden states; default: the preset's (2048 with a shape)
    sliced: bool = False
    backward: bool = False
    inplace_backward: bool = False
    backends: Sequence[str] = ()          # default: every eligible backend
    undeclared: bool = False              # also backends whose only "no" is the dtype they declare
    repeat: int = 5
    rounds: int = 1
    warmup: int = 2
    threads: Optional[int] = None         # torch threads in each child; default: torch's
    plugins: Sequence[str] = ()           # MODULE[:ATTR], registered for this run
    timeout: Optional[float] = 1800.0     # seconds per measurement; None: no limit
    device: Optional[str] = None          # default: the machine's main device
    peak_bandwidth: Optional[float] = None  # the device's memory bandwidth in GB/s; default: from its name
    outputs: Sequence[str] = ()           # token_stats' outputs (comma-separated too); default: the op's

    def check(self) -> None:
        """Raise BenchError when a number is out of range or options contradict each other."""
        _at_least("--repeat", self.repeat, 1)
        _at_least("--rounds", self.rounds, 1)
        _at_least("--warmup", self.warmup, 0)
        if self.threads is not None:
            _at_least("--threads", self.threads, 1)
        if self.hidden_size is not None:
            _at_least("--hidden-size", self.hidden_size, 1)
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not math.isfinite(self.timeout) or self.timeout <= 0):
            raise BenchError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.shape is not None and self.preset is not None:
            raise BenchError("give --shape or --preset, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise BenchError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if self.peak_bandwidth is not None and (isinstance(self.peak_bandwidth, bool) or not isinstance(
                self.peak_bandwidth, (int, float)) or not 0 < self.peak_bandwidth < math.inf):
            raise BenchError(f"--peak-bandwidth must be a positive number of GB/s, got {self.peak_bandwidth!r}")
        if self.inplace_backward and not self.backward:
            raise BenchError("--inplace-backward only makes sense with --backward")


def _at_least(flag: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BenchError(f"{flag} must be an integer of at least {low}, got {value!r}")


def settings(options: Options, default_device: str) -> List[Setting]:
    """The settings ``options`` ask for, one per (op, dtype), after :meth:`Options.check`."""
    options.check()
    known = bench_ops()
    try:
        ops = parse_list(list(options.ops), known, "op") or ["logprobs"]
        dtypes = [canonical_dtype(d) for d in parse_list(list(options.dtypes), DTYPE_NAMES, "dtype")]
        if options.shape is not None:
            shape = parse_shape(options.shape) if isinstance(options.shape, str) else tuple(options.shape)
            if len(shape) != 3 or not all(isinstance(d, int) and d >= 1 for d in shape):
                raise ValueError(f"shape {options.shape!r} is not three positive integers B,T,V")
            preset, sliced, dtype, hidden = None, options.sliced, "float32", None
        else:
            preset = options.preset or DEFAULT_PRESET
            p = PRESETS[preset]
            shape, sliced, dtype, hidden = p.shape, p.sliced or options.sliced, p.dtype, p.hidden_size
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    hidden_ops = [op for op in ops if takes_hidden_size(op)]
    if options.hidden_size is not None and not hidden_ops:
        with_h = [op for op in known if takes_hidden_size(op)]
        raise BenchError(f"--hidden-size only applies to ops with hidden states ({', '.join(with_h)}), "
                         f"not to {', '.join(ops)}")
    hidden = options.hidden_size or hidden or DEFAULT_HIDDEN_SIZE

    def hidden_size(op: str) -> Optional[int]:
        # always hidden states (logprobs_from_hidden): the hidden size; optionally (kl_divergence):
        # hidden states only when --hidden-size is given, logits otherwise
        if uses_hidden_size(op):
            return hidden
        return options.hidden_size if op in hidden_ops else None

    inplace_ops = [op for op in ops if "inplace_backward" in OPS[op].option_index]
    if options.inplace_backward and not inplace_ops:
        with_inplace = [op for op in known if "inplace_backward" in OPS[op].option_index]
        raise BenchError(f"--inplace-backward: {', '.join(ops)} has no inplace_backward option "
                         f"(ops that have it: {', '.join(with_inplace)})")
    if sliced and shape[1] < 2:
        raise BenchError("slicing [:, :-1] needs a sequence length T of at least 2")
    asked = None
    if options.outputs:
        selecting = [op for op in ops if output_choices(op)]
        if not selecting:
            with_outputs = [op for op in known if output_choices(op)]
            raise BenchError(f"--outputs only applies to ops whose outputs are chosen ({', '.join(with_outputs)}), "
                             f"not to {', '.join(ops)}")
        choices = tuple(dict.fromkeys(n for op in selecting for n in output_choices(op)))
        try:
            names = parse_list(list(options.outputs), choices, "output")
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        asked = tuple(n for n in choices if n in names)  # in the record's order

    def outputs_of(op: str):
        return asked if asked is not None and output_choices(op) else None

    device = options.device or default_device
    return [
        Setting(op=op, device=device, dtype=d, shape=shape, hidden_size=hidden_size(op),
                sliced=sliced, backward=options.backward,
                inplace_backward=options.inplace_backward and op in inplace_ops, repeat=options.repeat,
                warmup=options.warmup, threads=options.threads, preset=preset, outputs_asked=outputs_of(op))
        for op in ops for d in (dtypes or [dtype])
    ]


def check_device(device: str) -> str:
    """The device type of ``device``, or BenchError when this machine has none."""
    import torch

    from ..environment import get_environment

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise BenchError(f"--device {device!r} is not a device such as cpu, cuda or cuda:1") from None
    env = get_environment()
    if not env.has_device(kind):
        here = ", ".join(d for d in env.devices if env.has_device(d))
        raise BenchError(f"there is no {kind} device on this machine; devices here: {here}")
    return kind


def check_memory(todo: List[Setting], plugins: Sequence[str], timeout: Optional[float],
                 progress: Progress) -> Optional[str]:
    """Refuse settings that cannot fit (BenchError with a shape that would); returns the
    accelerator's name when one was probed."""
    from . import measure

    s0 = todo[0]
    name = None
    answer: dict = {}
    if s0.device_type == "cpu":
        available, source = fit.cpu_available_bytes(), "MemAvailable in /proc/meminfo"
    else:
        answer = measure.probe(s0, plugins, timeout)
        available, source, name = answer.get("free_bytes"), f"free memory of {s0.device}", answer.get("name")
    if available is None:
        why = "" if s0.device_type == "cpu" else f" ({answer.get('error') or 'it has no mem_get_info'})"
        progress(f"bench: cannot tell how much memory {s0.device} has{why}; not checking that the shape fits", True)
        return name
    for s in todo:
        problem = fit.refusal(s, available, source)
        if problem:
            raise BenchError(problem)
    return name


def methods(s: Setting, only: Sequence[str], undeclared: bool = False) -> Tuple[List[dict], object]:
    """The baseline and every eligible backend of ``s`` (or those in ``only``, each of which must
    be eligible), and the explanation they come from. ``undeclared``: also the backends that could
    run ``s`` but for the dtype, which they do not declare (a peer claiming float32 only), named
    with :data:`~.workload.UNDECLARED` after their name."""
    import logprob_registry as lr

    from ..call import key_for
    from ..registry import get_registry
    from .workload import BASELINE, UNDECLARED, baseline_description, external_methods

    # the call's shape: its vocabulary bucket can matter (min_vocab, a tuning ranking); every backend
    # that can run it is measured, also one the automatic choice passes over for this size; the
    # features its options need (kl_divergence's weights: kl_hidden) narrow the backends
    features = s.spec.features_used({n: True for n in s.hidden_weights})
    registry = get_registry()
    expl = registry.explain(key_for(s.op, device=s.device_type, dtype=s.torch_dtype, requires_grad=s.backward,
                                    features=features, vocab=s.logits_shape[-1], hidden_size=s.hidden_size))
    backends = {b.name: b for b in lr.backends()}
    names = [c.name for c in expl.candidates if c.reason is None and c.broken is None]
    beyond = [c.name for c in expl.candidates if undeclared and c.reason is not None
              and _only_the_dtype(backends[c.name], expl.key, registry.environment())]
    external = external_methods(s)
    for name in only:
        if name not in names and name not in beyond and name not in dict(external):
            try:
                why = expl[name].reason or expl[name].broken or "not eligible"
            except KeyError as exc:
                raise BenchError(str(exc).strip("'\"")) from None
            hint = ("; --undeclared measures it anyway" if _only_the_dtype(backends[name], expl.key,
                                                                          registry.environment()) else "")
            raise BenchError(f"--backend {name} cannot run {expl.key.describe()}: {why}{hint}")
    if only:  # the named backends and external methods; the baseline always runs
        names, beyond = [n for n in names if n in only], [n for n in beyond if n in only]
        external = [(n, doc) for n, doc in external if n in only]
    found = [dict(name=BASELINE, kind="baseline", description=baseline_description(s), priority=None,
                  origin=None, automatic_choice=False)]
    found += [dict(name=n, kind="external", description=doc, priority=None, origin=None, automatic_choice=False)
              for n, doc in external]
    for n in names:
        b = backends[n]
        found.append(dict(name=n, kind="backend", description=b.description, priority=b.priority,
                          origin=b.origin, automatic_choice=n == expl.chosen))
    for n in beyond:
        b = backends[n]
        found.append(dict(name=n + UNDECLARED, kind="undeclared", description=f"{b.description} ({expl[n].reason})",
                          priority=b.priority, origin=b.origin, automatic_choice=False))
    return found, expl


def _only_the_dtype(backend, key, env) -> bool:
    """Whether ``backend`` could run ``key`` but for its dtype: it runs it in a dtype it declares."""
    from ..registry.ranking import why_not

    return why_not(backend, key, env)[0] is not None and any(
        why_not(backend, key._replace(dtype=d), env)[0] is None for d in backend.dtypes if d.is_floating_point)


def _quiet(text: str, end_line: bool) -> None:
    pass


@dataclass
class Session:
    """One bench run: :meth:`prepare` registers the plugins and makes every check, :meth:`run`
    measures and returns the JSON document, :meth:`close` unregisters the plugins. As a context
    manager it prepares on entry and closes on exit."""

    options: Options
    progress: Progress = _quiet
    plan: List[Tuple[Setting, List[dict], object]] = field(default_factory=list)
    device_name: Optional[str] = None
    _registered: List[str] = field(default_factory=list)

    def prepare(self) -> "Session":
        from ..environment import get_environment
        from .plugins import register_plugins

        todo = settings(self.options, get_environment().main_device)
        check_device(todo[0].device)
        try:
            try:
                self._registered = register_plugins(self.options.plugins)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            self.device_name = check_memory(todo, self.options.plugins, self.options.timeout, self.progress)
            self.plan = [(s, *methods(s, self.options.backends, self.options.undeclared)) for s in todo]
        except BaseException:
            self.close()
            raise
        return self

    def run(self) -> dict:
        """Measure every setting of the plan; the document :mod:`.render` prints."""
        from . import measure, render
        from .workload import baseline_description

        if not self.plan:
            self.prepare()
        runs = []
        peak, source = self._peak_bandwidth()
        for s, found, expl in self.plan:
            self.progress(f"bench: {s.describe()}: {len(found)} methods", True)
            results = measure.run_setting(s, found, self.options.plugins, self.options.timeout, self.progress,
                                          self.options.rounds)
            b, t, v = s.logits_shape
            runs.append(dict(
                title=s.describe(), settings=s.to_json(), rounds=self.options.rounds,
                memory_method=measure.memory_method(s.device_type), baseline=baseline_description(s, short=True),
                logits_bytes=b * t * v * s.itemsize, input_bytes={n: s.input_bytes(n) for n in s.tensors},
                grad_inputs=list(s.grad_inputs), eligible=expl.eligible, automatic_choice=expl.chosen,
                results=results,
            ))
            if peak and s.device_type != "cpu":
                runs[-1].update(peak_bandwidth_bytes_per_s=peak, peak_bandwidth_source=source)
                for r in results:
                    bandwidth = r.get("bandwidth_bytes_per_s")
                    r["bandwidth_fraction"] = bandwidth / peak if bandwidth else None
        options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self.options).items()}
        return render.document(runs, self.device_name, options)

    def _peak_bandwidth(self) -> Tuple[Optional[float], str]:
        """The device's memory bandwidth (bytes/s) and where it comes from."""
        from .render import peak_bandwidth

        if self.options.peak_bandwidth:
            return self.options.peak_bandwidth * 1e9, "--peak-bandwidth"
        return peak_bandwidth(self.device_name), f"the datasheet of {self.device_name}"

    def close(self) -> None:
        from .plugins import unregister_plugins

        unregister_plugins(self._registered)
        self._registered = []

    def __enter__(self) -> "Session":
        return self.prepare()

    def __exit__(self, *exc) -> None:
        self.close()


def bench(progress: Progress = _quiet, **options) -> dict:
    """Measure as ``logprob-registry bench`` does; keywords are the fields of :class:`Options`.
    Returns the JSON document (``render.render(doc)`` is the table); raises BenchError."""
    with Session(Options(**options), progress) as session:
        return session.run()
