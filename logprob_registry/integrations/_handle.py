"""How an integration replaces a trainer's functions and puts them back (a leaf module)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

_lock = threading.Lock()
_installed: Dict[str, "Handle"] = {}


class Handle:
    """What one ``install()`` did: the attributes it replaced (module, name, original), so that
    :meth:`uninstall` restores each one exactly (``is`` identity). A context manager too."""

    def __init__(self, name: str, patches: Sequence[Tuple[Any, str, Any]], backend: Optional[str]) -> None:
        self.name, self.backend = name, backend
        # (owner, attribute, original, whether the owner itself held it: else it came from its class)
        self._originals = [(owner, attr, getattr(owner, attr), attr in getattr(owner, "__dict__", {attr: None}))
                           for owner, attr, _ in patches]
        for owner, attr, replacement in patches:
            setattr(owner, attr, replacement)

    @property
    def replaced(self) -> List[str]:
        """``module.attribute`` of every replaced attribute."""
        return [f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}" for owner, attr, _, _ in self._originals]

    def uninstall(self) -> None:
        """Put every original back (harmless when already uninstalled)."""
        with _lock:
            if _installed.get(self.name) is not self:
                return
            for owner, attr, original, own in reversed(self._originals):
                if own:
                    setattr(owner, attr, original)
                else:  # it came from the class (a model's forward): the instance attribute goes
                    delattr(owner, attr)
            del _installed[self.name]

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<logprob_registry integration {self.name}: {', '.join(self.replaced)}>"


def install(name: str, patches: Callable[[], Sequence[Tuple[Any, str, Any]]], backend: Optional[str]) -> Handle:
    """The handle installed for ``name`` (the one already installed, when it is: idempotent)."""
    with _lock:
        if name in _installed:
            return _installed[name]
        handle = _installed[name] = Handle(name, patches(), backend)
        return handle


def installed() -> List[str]:
    """The names of the integrations installed now, e.g. ``["trl"]``."""
    with _lock:
        return sorted(_installed)


def require(distribution: str, version: str, tested: str) -> None:
    """Raise ImportError naming the tested range when ``version`` of ``distribution`` is outside it."""
    if Version(version) not in SpecifierSet(tested):
        raise ImportError(f"logprob_registry.integrations supports {distribution}{tested} (tested); "
                          f"{distribution} {version} is installed: install a supported version, or call the "
                          "library's functions yourself (docs/integrations.md)")
