"""Print the cycles among the module-level imports of a package (imports inside functions, and
those under ``if TYPE_CHECKING:``, are left out: they run after every module has loaded).

    python scripts/import_cycles.py [--lazy] [PACKAGE_DIR]   (default: logprob_registry)

``--lazy`` counts the imports inside functions too: a cycle only they close does not fail an
import, but it still ties the modules together.

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so an import of a submodule
counts as an import of each package above it too, except the packages above the importing module
itself (they started importing before it). Exits 1 when it finds a cycle.

With ``--lazy``, an import that asks a package above the importing module for one of its own
names (``import a`` or ``from a import name`` inside a function of ``a.b.c``, ``from .. import
name`` where ``name`` is no submodule) counts as an edge to that package: it needs the package's
``__init__`` run to its end, and that ``__init__`` (a package face importing everything) may
import the module back. At module level the skip stays right: the package is being imported.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set


def modules(root: str) -> Dict[str, str]:
    """Module name -> file, for every .py file under the package folder ``root``."""
    base = os.path.dirname(os.path.abspath(root))
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module, lazy: bool = False):
    """The import statements that run when the module is imported (not inside a def or a class
    body's methods, not under ``if TYPE_CHECKING:``); with ``lazy``, those inside functions too."""
    if lazy:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _type_checking(node):
                stack += node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack += child.body if isinstance(child, ast.ExceptHandler) else [child]


def graph(root: str, lazy: bool = False) -> Dict[str, Set[str]]:
    known = modules(root)
    edges: Dict[str, Set[str]] = {m: set() for m in known}

    def add(source: str, target: str, upward: bool = False) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the packages above run first
            name = ".".join(parts[:i])
            if name not in known or name == source:
                continue
            # a package above the importing module is already being imported: no edge, unless
            # (``upward``: a lazy import) the import asks that package itself for a name
            if source.startswith(name + ".") and not (upward and name == target):
                continue
            edges[source].add(name)

    for module, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        for node in _top_level_imports(tree, lazy):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(module, alias.name, upward=lazy)
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            # names that are no submodule are read from the package's __init__ (its face)
            add(module, target, upward=lazy and len(submodules) < len(node.names))
            for name in submodules:  # from package import submodule
                add(module, name)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _path(edges: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """One cycle through the component's first module, for the report."""
    start, members = component[0], set(component)
    previous = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                route = [v]
                while previous[route[-1]] is not None:
                    route.append(previous[route[-1]])
                return list(reversed(route)) + [start]
            if w not in previous:
                previous[w] = v
                queue.append(w)
    return component


def main(argv: List[str]) -> int:
    lazy = "--lazy" in argv
    argv = [a for a in argv if a != "--lazy"]
    root = argv[0] if argv else "logprob_registry"
    edges = graph(root, lazy)
    found = cycles(edges)
    for component in found:
        print(f"cycle among {len(component)} modules: {', '.join(component)}")
        print("  e.g. " + " -> ".join(_path(edges, component)))
    if not found:
        kind = "imports" if lazy else "module-level imports"
        print(f"no import cycle among the {kind} of {len(edges)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
