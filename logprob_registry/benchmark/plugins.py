"""``--plugin MODULE[:ATTR]``: register a plugin that is not installed through an entry point (a
kernel under development, a test's fake) for one bench run, in the parent and in every child."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Iterable, List

PREFIX = "bench:"


def register_plugins(specs: Iterable[str]) -> List[str]:
    """Import each ``MODULE[:ATTR]`` and register it; returns the plugin names used.

    Raises ValueError, saying why, when one cannot be imported or registers nothing usable.
    """
    from ..registry import get_registry

    registry = get_registry()
    names = []
    for spec in specs:
        module, _, attr = spec.partition(":")
        try:
            obj = _import(module)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as exc:
            raise ValueError(f"--plugin {spec}: cannot import it ({type(exc).__name__}: {exc})") from exc
        name = PREFIX + spec
        added = registry.add_plugin(obj, name=name, distribution=f"--plugin {spec}")
        failures = [f.error for f in registry.failures() if f.plugin == name]
        if failures:
            registry.remove_plugin(name)
            raise ValueError(f"--plugin {spec}: {failures[0]}")
        if not added:
            registry.remove_plugin(name)
            raise ValueError(f"--plugin {spec}: registers no backend; it needs a register_backends hook")
        names.append(name)
    return names


def _import(module: str):
    """Import ``module``, also from the working directory, as the children (``python -m``) will."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module)
    finally:
        if added:
            sys.path.remove(cwd)


def unregister_plugins(names: Iterable[str]) -> None:
    from ..registry import get_registry

    for name in names:
        get_registry().remove_plugin(name)
