"""The documentation keeps up with the code (cheap checks, in the manner of datasette's
tests/test_docs.py): a new op, option, configuration variable or built-in backend without docs
fails CI, and so does a broken link or a README that outgrew five minutes of reading."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import logprob_registry as lr
from logprob_registry import config, hookspecs
from logprob_registry.opspec import OPS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 12288  # bytes: what a newcomer reads in five minutes
CHANGELOG = ROOT / "CHANGELOG.md"
UNRELEASED_BULLETS = 50  # one line per change a user would notice; details belong in docs/
BULLET_LIMIT = 150       # characters of one CHANGELOG line
SETUP_COMMAND = "pip install torch==2.13.0 && pip install -e . && logprob-registry info"

# [text](target) and [text](target "title"); images too.
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _markdown_files() -> list:
    files = [README, CHANGELOG, *sorted(DOCS.rglob("*.md"))]
    files += sorted((ROOT / "plugins").glob("*/README.md"))
    return files


def _without_code_blocks(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def _relative_links(path: Path) -> list:
    """Link targets that are files of this repository (``#anchor`` kept; ``#anchor`` alone: this page)."""
    return [t for t in _LINK.findall(_without_code_blocks(path))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto: ...


def _anchors(path: Path) -> set:
    """The anchors GitHub makes of a page's headings: lowercase, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", _without_code_blocks(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_readme_fits_in_five_minutes():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, more than {README_LIMIT}: move details to docs/ and link them")


def test_readme_has_the_setup_command():
    assert SETUP_COMMAND in _readme().splitlines()


def test_readme_test_command_is_what_ci_runs():
    ci_last = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    commands = [line.strip() for line in _readme().splitlines() if '".[test]"' in line]
    assert commands, "README.md shows no test command (a line with pip install -e \".[test]\")"
    assert all(c == ci_last for c in commands), (
        f"README.md's test command {commands} differs from the last line of .ci/run: {ci_last!r}")


def _unreleased() -> str:
    """CHANGELOG.md's ``## [Unreleased]`` section, up to the next ``## [`` heading."""
    text = CHANGELOG.read_text(encoding="utf-8")
    assert "\n## [Unreleased]" in text, "CHANGELOG.md has no ## [Unreleased] section"
    return text.split("\n## [Unreleased]", 1)[1].split("\n## [", 1)[0]


def test_changelog_unreleased_is_one_short_line_per_change():
    """Keep a Changelog's form; at most 50 bullets of at most 150 characters, each one line (the
    details are in the linked docs)."""
    section = _unreleased()
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert bullets, "CHANGELOG.md's [Unreleased] section lists no change"
    assert len(bullets) <= UNRELEASED_BULLETS, (
        f"CHANGELOG.md's [Unreleased] section has {len(bullets)} bullets, more than {UNRELEASED_BULLETS}: "
        "merge related changes into one line and leave the details to docs/")
    long = [f"{len(b)}: {b[:60]}..." for b in bullets if len(b) > BULLET_LIMIT]
    assert not long, f"CHANGELOG.md lines longer than {BULLET_LIMIT} characters: {long}"
    continued = [line for line in section.splitlines() if line.startswith("  ")]
    assert not continued, f"CHANGELOG.md's [Unreleased] bullets continue on other lines: {continued[:3]}"
    headings = re.findall(r"^### (.+)$", section, flags=re.M)
    assert set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, headings


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_signature_is_documented(op):
    """A backend's call for every op, as the op table says, in the hook's docs and docs/plugins.md,
    and for every public op in README.md (the shard ops of the distributed path are in
    docs/distributed.md, linked from there)."""
    signature = OPS[op].signature()
    hook_docs = (hookspecs.__doc__ or "") + (inspect.getdoc(hookspecs.register_backends) or "")
    assert signature in hook_docs, f"hookspecs.register_backends' docstring does not show {signature}"
    assert signature in (ROOT / "docs" / "plugins.md").read_text(), f"docs/plugins.md does not show {signature}"
    if OPS[op].function is not None:
        assert signature in _readme(), f"README.md does not show {signature}"
    else:
        assert signature in (ROOT / "docs" / "distributed.md").read_text(), \
            f"docs/distributed.md does not show {signature}"


def test_markdown_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in _markdown_files()}
    assert {"README.md", "CHANGELOG.md", "docs/architecture.md", "docs/plugins.md"} <= names


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(path):
    missing = []
    for target in _relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part) if file_part else path
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            missing.append(f"{target} (no such heading)")
    assert not missing, f"{path.relative_to(ROOT)} links to missing files or headings: {missing}"


def test_the_link_check_sees_links():
    """Guards the regular expression: README.md links to docs/, and the check finds those links."""
    assert "docs/plugins.md" in _relative_links(README)
    assert not any(t.startswith("http") for t in _relative_links(README))
    assert "the-ops" in _anchors(DOCS / "plugins.md")


# Read at collection, before any test declares a variable of its own; this package's variables only.
VARIABLES = sorted(v.name for v in config.declared() if v.name.startswith("LOGPROB_REGISTRY_"))


def test_variables_found():
    assert {"LOGPROB_REGISTRY_BACKEND", "LOGPROB_REGISTRY_CHUNKED_WORKSPACE"} <= set(VARIABLES)


@pytest.mark.parametrize("name", VARIABLES)
def test_configuration_variable_is_in_the_readme(name):
    assert name in _readme(), f"README.md's configuration section does not name {name}"


def _readme_backend_rows() -> dict:
    """Backend name -> its row in the first table of README.md's "## Backends" section."""
    section = _readme().split("\n## Backends", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("|"):
            match = re.search(r"`([a-z0-9-]+)`", line.split("|")[1])
            if match:
                rows[match.group(1)] = line
    return rows


BUILTINS = sorted(b.name for b in lr.backends() if b.origin.startswith("builtin:"))


def test_builtins_found():
    assert {"naive", "chunked"} <= set(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_backend_is_documented(name):
    assert (DOCS / "backends" / f"{name}.md").is_file(), f"docs/backends/{name}.md is missing"
    row = _readme_backend_rows().get(name)
    assert row is not None, f"README.md's backend table has no row for {name}"
    assert f"docs/backends/{name}.md" in row, f"README.md's row for {name} does not link its page"
    priority = lr.get_registry().get(name).priority
    assert f"| {priority} |" in row, f"README.md's row for {name} does not give its priority {priority}"


def test_every_capability_flag_is_in_the_readme():
    from logprob_registry.backend import CAPABILITIES

    missing = [c for c in CAPABILITIES if f"`{c}`" not in _readme()]
    assert not missing, f"README.md's plugin section does not name the capability flags {missing}"


PACKAGE = ROOT / "logprob_registry"


def _architecture_tree() -> set:
    """The modules docs/architecture.md's module tree names under ``logprob_registry/``, by their path
    in the package (``distributed/sharded.py``, ``kernels/chunked/__init__.py``): a name at the
    start of a tree line (indented two spaces a level, before the description column), a
    folder ending in ``/``."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    block = text.split("\n## Modules", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    found, folders = set(), []
    for line in block.splitlines():
        match = re.match(r"^( *)([A-Za-z_][\w.]*/|[A-Za-z_]\w*\.py)(?:\s|$)", line)
        if not match or len(match.group(1)) >= 24:  # a description's continuation line
            continue
        depth = len(match.group(1)) // 2
        del folders[depth:]
        if match.group(2).endswith("/"):
            folders.append(match.group(2))
        else:
            found.add("".join(folders) + match.group(2))
    prefix = "logprob_registry/"
    return {path[len(prefix):] for path in found if path.startswith(prefix)}


def _modules() -> set:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}


def test_the_module_tree_sees_modules():
    """Guards the parser: the tree is read, nested folders included."""
    tree = _architecture_tree()
    assert {"__init__.py", "ops.py", "registry/__init__.py", "kernels/chunked/__init__.py"} <= tree


def test_every_module_is_in_the_architecture_tree():
    """Every module of the package, each subpackage's __init__.py included, has its line in
    docs/architecture.md's module tree (a new module without one fails), and the tree names no
    module that is gone."""
    tree, modules = _architecture_tree(), _modules()
    missing, gone = sorted(modules - tree), sorted(tree - modules)
    assert not missing, f"docs/architecture.md's module tree does not list {missing}: add a line each"
    assert not gone, f"docs/architecture.md's module tree lists modules that do not exist: {gone}"


def test_every_backend_field_is_in_the_plugin_docs():
    import dataclasses

    from logprob_registry.backend import Backend

    text = (DOCS / "plugins.md").read_text(encoding="utf-8")
    deprecated = {"triton", "available_on"}
    missing = [f.name for f in dataclasses.fields(Backend) if f"`{f.name}`" not in text]
    assert not missing, f"docs/plugins.md does not document the Backend fields {missing}"
    assert all(f"{d}=" in text for d in deprecated), "docs/plugins.md does not list the deprecated keywords"
