"""How an integration replaces a trainer's functions and puts them back (a leaf module)."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

_lock = threading.Lock()
_installed: Dict[str, "Handle"] = {}


class Handle:
    """What one ``install()`` did: the attributes it replaced (module, name, original), so that
    :meth:`uninstall` restores each one exactly (``is`` identity). A context manager too."""

    def __init__(self, name: str, patches: Sequence[Tuple[Any, str, Any]], backend: Optional[str],
                 package: Optional[str] = None) -> None:
        self.name, self.backend, self._package = name, backend, package
        # (owner, attribute, original, whether the owner itself held it: else it came from its class)
        self._originals = [(owner, attr, getattr(owner, attr), attr in getattr(owner, "__dict__", {attr: None}))
                           for owner, attr, _ in patches]
        # a module of ``package`` imported while installed binds the replacement: uninstall finds it
        self._late = [(attr, replacement, original) for (owner, attr, replacement), (_, _, original, _)
                      in zip(patches, self._originals) if isinstance(owner, types.ModuleType)]
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
            for module in list(sys.modules.values()) if self._package else ():
                if in_package(module, self._package):
                    for attr, replacement, original in self._late:
                        if getattr(module, attr, None) is replacement:  # bound while installed
                            setattr(module, attr, original)
            del _installed[self.name]

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<logprob_registry integration {self.name}: {', '.join(self.replaced)}>"


def install(name: str, patches: Callable[[], Sequence[Tuple[Any, str, Any]]], backend: Optional[str],
            package: Optional[str] = None) -> Handle:
    """The handle installed for ``name`` (the one already installed, when it is: idempotent);
    ``package``: the modules whose late bindings of a replaced module attribute uninstall restores."""
    with _lock:
        if name in _installed:
            return _installed[name]
        handle = _installed[name] = Handle(name, patches(), backend, package)
        return handle


def in_package(module: Any, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its submodules."""
    name = getattr(module, "__name__", None)
    return isinstance(name, str) and (name == package or name.startswith(package + "."))


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
