"""The results for people (a table per setting) and for machines (one JSON document)."""

from __future__ import annotations

import datetime
import math
import os
import platform
from typing import List, Optional

from ..report import table


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 10:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if abs(n) >= 10 * 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_err(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else f"{x:.1e}"


def fmt_bandwidth(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e9:.0f}"


#: Memory bandwidth by device name (vendors' datasheets, GB/s), most specific first: every word of a
#: rule must be in the lower-cased name; None marks a name whose memory differs between models.
PEAK_BANDWIDTH_GB_S = (
    (("gh200",), None), (("h200",), 4800),
    (("h100", "nvl"), 3900), (("h100", "pcie"), 2000), (("h100",), 3350),
    (("a100", "80gb", "pcie"), 1935), (("a100", "80gb"), 2039), (("a100",), 1555),
    (("b200",), 8000), (("mi300x",), 5300), (("l40s",), 864),
)


def peak_bandwidth(device_name: Optional[str]) -> Optional[float]:
    """The device's memory bandwidth in bytes per second, read from its name; None when unknown
    (``bench --peak-bandwidth`` gives it)."""
    name = (device_name or "").lower()
    for words, gb_s in PEAK_BANDWIDTH_GB_S:
        if all(w in name for w in words):
            return None if gb_s is None else gb_s * 1e9
    return None


def fmt_fraction(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render_run(run: dict) -> str:
    """One setting's table, with its heading, footnotes and the errors of failed methods."""
    s = run["settings"]
    grads = list(run.get("grad_inputs") or ([] if not s["backward"] else ["logits"]))
    bandwidth = s["device_type"] != "cpu" and any(r.get("bandwidth_bytes_per_s") for r in run["results"])
    header = ["method", "time", "IQR", "speed-up", "peak memory", "vs baseline", "max |diff|"]
    peak = run.get("peak_bandwidth_bytes_per_s") if bandwidth else None
    if bandwidth:
        header[3:3] = ["GB/s"] + (["% of peak"] if peak else [])
    header += ["max |grad diff|"] if len(grads) == 1 else [f"max |{g} grad diff|" for g in grads]
    rows = []
    for r in run["results"]:
        name = r["name"] + (" *" if r.get("automatic_choice") else "")
        if r["status"] != "ok":
            rows.append([name, "FAILED"] + ["-"] * (len(header) - 2))
            continue
        row = [name, fmt_time(r["time_median_s"]), fmt_time(r["time_iqr_s"]), fmt_ratio(r["speedup"]),
               fmt_bytes(r["peak_bytes"]), fmt_ratio(r["memory_ratio"]), fmt_err(r["max_abs_diff"])]
        if bandwidth:
            row[3:3] = [fmt_bandwidth(r.get("bandwidth_bytes_per_s"))] + (
                [fmt_fraction(r.get("bandwidth_fraction"))] if peak else [])
        diffs = r.get("max_abs_diff_grads") or ({grads[0]: r.get("max_abs_diff_grad")} if grads else {})
        row += [fmt_err(diffs.get(g)) for g in grads]
        rows.append(row)
    rounds = run.get("rounds", 1)
    calls = f"{s['repeat']} calls" + (f" x {rounds} interleaved rounds" if rounds > 1 else "")
    lines = [
        run["title"],
        f"time: median of {calls}, each process after {s['warmup']} warm-up calls",
        "speed-up and memory: against the baseline (" + run.get("baseline", "the textbook formula in the input dtype")
        + "); max |diff|: against float64",
        "",
        table(header, rows),
    ]
    if run.get("automatic_choice"):
        lines.append(f"* the backend a call like this uses here (lr.select): {run['automatic_choice']}")
    if any(r.get("kind") == "undeclared" for r in run["results"]):
        lines.append(f"! outside the dtypes the backend declares (--undeclared): its kernel on the validated call, "
                     f"{s['dtype']} in")
    for r in run["results"]:
        if r["status"] != "ok":
            lines.append(f"FAILED {r['name']}: {r['error']}")
    lines.append(f"peak memory: {run['memory_method']}")
    if bandwidth:
        lines.append("GB/s: the bytes the op must move (the logits read once; in backward read again and "
                     "the gradient written) per second of median time")
        if peak:
            lines.append(f"% of peak: of the device's memory bandwidth, {peak / 1e9:.0f} GB/s "
                         f"({run.get('peak_bandwidth_source')})")
    if s.get("hidden_size"):
        weights = [g for g in grads if g == "weight" or g.endswith("_weight")]
        weight_grad = sum((run.get("input_bytes") or {}).get(g, 0) for g in weights)
        also = (f"; the weight gradient, {fmt_bytes(weight_grad)}, is part of every backward's peak"
                if weight_grad else "")
        lines.append(f"the logits this op reduces, {'x'.join(map(str, s['logits_shape']))} in {s['dtype']}, "
                     f"take {fmt_bytes(run['logits_bytes'])}{also}")
    return "\n".join(lines)


def render(doc: dict) -> str:
    return "\n\n".join(render_run(run) for run in doc["runs"])


def environment(device_name: Optional[str]) -> dict:
    import torch

    from ..environment import get_environment

    env = get_environment()
    return dict(
        python=platform.python_version(),
        torch=str(env.torch_version),
        triton=str(env.triton_version) if env.triton_version else None,
        platform=platform.platform(),
        cpu=_cpu_name(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        device_name=device_name,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def document(runs: List[dict], device_name: Optional[str], options: dict) -> dict:
    from .. import __version__

    return dict(
        tool="logprob-registry bench",
        version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        options=options,
        environment=environment(device_name),
        runs=runs,
    )
