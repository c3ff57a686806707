"""The module tree keeps its floors (docs/architecture.md): the built-in backends import the library
only through ``logprob_registry.kit``, as a third-party plugin would; the core never leans on kit;
and no imports form a cycle, at module level or counting the imports inside functions
(``scripts/import_cycles.py``). Cheap: the files are parsed, nothing is imported but the package."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import logprob_registry as lr

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "logprob_registry"
KERNELS = PACKAGE / "kernels"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, name: str, is_package: bool = False) -> Iterator[Tuple[int, str, List[str]]]:
    """``(line, module, names)`` of every import in ``source``, the code of module ``name``, inside
    functions too: ``module`` made absolute, ``names`` those of a ``from module import names`` (empty
    for ``import module``)."""
    package = name if is_package else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module, [alias.name for alias in node.names]


def _imports_of(path: Path) -> Iterator[Tuple[int, str, List[str]]]:
    return _imports(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _python_files(folder: Path) -> List[Path]:
    return sorted(folder.rglob("*.py"))


def _kernel_violations(source: str, name: str, is_package: bool = False) -> List[str]:
    """What module ``name`` of logprob_registry.kernels imports from the library besides
    ``logprob_registry.kit``, the public face (``import logprob_registry as lr``: ``lr.Backend``,
    ``lr.hookimpl``, a name of ``lr.__all__``) and the built-ins' own package
    (``logprob_registry.kernels``: a backend's sibling modules, the shard ops the built-ins share)."""
    found = []
    for line, module, names in _imports(source, name, is_package):
        if module != "logprob_registry" and not module.startswith("logprob_registry."):
            continue  # torch, triton, the standard library
        if module == "logprob_registry.kit" or module == "logprob_registry.kernels" \
                or module.startswith("logprob_registry.kernels."):
            continue
        if module == "logprob_registry":
            wrong = [n for n in names if n != "kit" and n not in lr.__all__]
            if not wrong:
                continue
            module = ", ".join(f"logprob_registry.{n}" for n in wrong)
        else:  # from a package import a submodule: name the submodule
            submodules = [n for n in names if _is_module(f"{module}.{n}")]
            module = ", ".join(f"{module}.{n}" for n in submodules) if submodules else module
        found.append(f"{name}:{line} imports {module}")
    return found


@pytest.mark.parametrize("path", _python_files(KERNELS), ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernel_imports_the_library_only_through_kit(path):
    wrong = _kernel_violations(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")
    assert not wrong, ("a built-in backend imports the library only through logprob_registry.kit, as a "
                       "plugin would (export what it needs there):\n  " + "\n  ".join(wrong))


def test_the_kernel_import_check_names_the_module_and_the_import():
    """Module-level and lazy imports alike, relative or absolute."""
    source = ("import logprob_registry as lr\n"
              "from logprob_registry import Backend, kit, reference\n"
              "from logprob_registry.kit import result_dtype\n"
              "from . import _rows\n"
              "def f():\n"
              "    from ...distributed import tiles\n"
              "    import logprob_registry.opspec\n")
    assert _kernel_violations(source, "logprob_registry.kernels.chunked._probe") == [
        "logprob_registry.kernels.chunked._probe:2 imports logprob_registry.reference",
        "logprob_registry.kernels.chunked._probe:6 imports logprob_registry.distributed.tiles",
        "logprob_registry.kernels.chunked._probe:7 imports logprob_registry.opspec",
    ]


# The shipped suite (testing/) is written for plugin authors and may use their façade, as they do.
CORE = [p for p in _python_files(PACKAGE)
        if KERNELS not in p.parents and PACKAGE / "testing" not in p.parents and p.name != "kit.py"]


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_does_not_import_kit(path):
    """kit re-exports the core's helpers for backends; the core imports them where they live."""
    wrong = [f"{path.relative_to(ROOT)}:{line}" for line, module, names in _imports_of(path)
             if module == "logprob_registry.kit" or (module == "logprob_registry" and "kit" in names)]
    assert not wrong, "a core module imports logprob_registry.kit (import from the module behind it): " + \
        ", ".join(wrong)


def _import_cycles():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "lazy"])
def test_no_import_cycle(lazy):
    """``python scripts/import_cycles.py [--lazy]`` finds no cycle (with ``--lazy``, the imports
    inside functions count too, an upward one into a package face included)."""
    ic = _import_cycles()
    edges = ic.graph(str(PACKAGE), lazy)
    found = ic.cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(
        f"  among {', '.join(c)}\n    e.g. {' -> '.join(ic._path(edges, c))}" for c in found)


def test_lazy_mode_counts_an_upward_import(tmp_path):
    """A lazy ``from .. import name`` (no submodule) inside ``pkg.sub.mod`` is an edge to ``pkg.sub``
    with ``--lazy`` only; a lazy ``from . import submodule`` is an edge to the submodule only."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import mod\n", encoding="utf-8")
    (pkg / "sub" / "__init__.py").write_text("from .mod import f\n", encoding="utf-8")
    (pkg / "sub" / "mod.py").write_text("def f():\n    from . import g, other\n", encoding="utf-8")
    (pkg / "sub" / "other.py").write_text("", encoding="utf-8")
    ic = _import_cycles()
    assert "pkg.sub" not in ic.graph(str(pkg))["pkg.sub.mod"]
    lazy = ic.graph(str(pkg), lazy=True)
    assert lazy["pkg.sub.mod"] == {"pkg.sub", "pkg.sub.other"}
    assert ic.cycles(lazy) == [["pkg.sub", "pkg.sub.mod"]]
