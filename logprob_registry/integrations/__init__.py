"""Trainer integrations: one module per trainer, each importing its trainer lazily (none is a
dependency of this package), each with ``install(backend=None)`` returning a :class:`Handle`
(``.uninstall()``, a context manager; installing twice is harmless; uninstalling restores every
replaced attribute exactly). :func:`installed` names what is installed now. docs/integrations.md
says what each replaces. The modules: ``trl`` (TRL 1.16), ``verl`` (verl 0.9.1), ``hf`` (any
transformers causal LM: ``inject_head``) and ``megatron``, whose ``output_processor`` replaces
nothing (Megatron-Core's ``GPTModel.forward`` takes it as an argument), so it has no ``install()``.

    from logprob_registry.integrations import trl
    with trl.install():
        trainer.train()
"""

from __future__ import annotations

from typing import List

from ._handle import Handle, installed

__all__: List[str] = ["Handle", "installed"]
