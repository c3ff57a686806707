"""``--plot FILE.png``: time and peak memory per method as bar charts, one row per setting."""

from __future__ import annotations

import os
from typing import List

INSTALL_HINT = "--plot needs matplotlib: pip install 'logprob-registry[plot]'"

BASELINE_COLOR = "#9e9e9e"
CHOSEN_COLOR = "#d62728"
OTHER_COLOR = "#1f77b4"


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(INSTALL_HINT) from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def check_available() -> None:
    """Raise RuntimeError with the install hint before any measurement, not after."""
    _pyplot()


def formats() -> List[str]:
    """The file extensions matplotlib writes (png, svg, pdf, ...)."""
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_path(path: str) -> None:
    """Raise RuntimeError (no matplotlib) or ValueError (an extension matplotlib does not write)
    before any measurement, so that a run is never lost at the end."""
    known = formats()
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in known:
        said = f"extension .{ext}" if ext else "no extension"
        raise ValueError(f"--plot {path}: {said}; name a file matplotlib can write: "
                         f"{', '.join('.' + k for k in known)}")


def plot(doc: dict, path: str) -> None:
    plt = _pyplot()
    runs: List[dict] = doc["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.2 * len(runs) + 0.6), squeeze=False)
    for row, run in zip(axes, runs):
        results = run["results"]
        names = [r["name"] for r in results]
        colors = [BASELINE_COLOR if r["kind"] == "baseline" else CHOSEN_COLOR if r.get("automatic_choice")
                  else OTHER_COLOR for r in results]
        ok = [r["status"] == "ok" for r in results]
        times = [r["time_median_s"] * 1e3 if good else 0.0 for r, good in zip(results, ok)]
        low = [t - r["time_min_s"] * 1e3 if good else 0.0 for t, r, good in zip(times, results, ok)]
        high = [r["time_max_s"] * 1e3 - t if good else 0.0 for t, r, good in zip(times, results, ok)]
        mems = [(r["peak_bytes"] or 0) / 2**20 if good else 0.0 for r, good in zip(results, ok)]
        panels = ((row[0], times, high, "time, median (ms); whiskers: min to max", "speedup"),
                  (row[1], mems, [0.0] * len(mems), "peak memory above the inputs (MiB)", "memory_ratio"))
        for ax, values, above, label, ratio in panels:
            bars = ax.bar(range(len(names)), values, color=colors,
                          yerr=[low, high] if values is times else None, capsize=3)
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(run["title"], fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            top = max([v + a for v, a in zip(values, above)] + [1e-3])
            for bar, value, extra, good, r in zip(bars, values, above, ok, results):
                text = "failed" if not good else f"{value:.4g}"
                if good and r.get(ratio) is not None:
                    text += f"\n{r[ratio]:.2f}x"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, value + extra + 0.02 * top),
                            ha="center", va="bottom", fontsize=7, color="black" if good else CHOSEN_COLOR)
            ax.set_ylim(0, top * 1.35)
    env = doc["environment"]
    fig.suptitle(f"logprob-registry bench: {env.get('device_name') or env['cpu']}, torch {env['torch']} "
                 "(grey: the baseline, red: the backend a call uses here)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
