"""The hook a plugin implements, and the markers it uses.

A plugin module (or object) implements :func:`register_backends` with ``@hookimpl`` and is found
either as a built-in (``logprob_registry.kernels``) or through the entry-point group
``logprob_registry``.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "logprob_registry"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register: Callable[..., None]) -> None:
    """Register backends by calling ``register(Backend(...))`` once for each.

    Keep the module that implements this light: it is imported by ``import logprob_registry``.
    Import kernel libraries inside the op functions, and name them in ``Backend.requires``.
    """
