"""Installable-looking distributions made at test time: a module plus its ``.dist-info`` with an
entry point in the ``logprob_registry`` group, which importlib.metadata finds on ``sys.path``."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_dist(where: Path, dist: str, module: str, source: str, version: str = "0.1") -> Path:
    """Write ``module.py`` and ``dist-version.dist-info/`` into ``where``; return ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{module}.py").write_text(source)
    info = where / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[logprob_registry]\n{module} = {module}\n")
    return where


def run_python(args, *paths, timeout=600):
    """``python args...`` with ``paths`` then the repository root first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), str(ROOT)]))
    env.pop("LOGPROB_REGISTRY_BACKEND", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
