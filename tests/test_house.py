"""The package's structure, guarded in CI: no import circles among genfn's modules, no module over
600 lines.

These are the two checks of the project's ``house_check`` tool (``../shared/tools/house_check.py``
beside a checkout that has it), implemented here so that CI, which has only the repository, runs
them too; where the tool exists, its findings must equal these. As in the tool, every import of a
genfn module is an arrow, at module level or inside a function (a lazy import hides a circle from
Python, not from the design), and a package's ``__init__`` re-exporting its own modules is not.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import genfn

LINE_LIMIT = 600
PACKAGE_DIR = Path(genfn.__file__).resolve().parent
HOUSE_CHECK_TOOL = PACKAGE_DIR.parent.parent / "shared" / "tools" / "house_check.py"

# Circles known when this test was written, each being broken by its owner. Listed so that CI
# catches every new one now; an entry that no longer exists fails the test too, so the list only
# shrinks.
KNOWN_CIRCLES: set = set()


# ---- the two checks ------------------------------------------------------------------------------


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def owning_module(name: str, modules: set[str]) -> str | None:
    """The module ``name`` lives in: itself, or the nearest enclosing module (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(tree: ast.AST, package: str) -> list[str]:
    """Every dotted name an import statement anywhere in ``tree`` may refer to (relative ones resolved)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
    return names


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    files = {module_name(path, package_dir): path for path in package_dir.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in files.items():
        is_init = path.name == "__init__.py"
        package = name if is_init else name.rpartition(".")[0]
        for target in imported_names(ast.parse(path.read_text(encoding="utf-8"), str(path)), package):
            hit = owning_module(target, modules)
            if hit is None or hit == name or name.startswith(hit + "."):
                continue  # outside genfn, itself, or a module importing a package it is part of
            if is_init and hit.startswith(name + "."):
                continue  # a package's __init__ re-exporting its own modules
            edges[name].add(hit)
    return edges


def import_circles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: set[frozenset[str]] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.add(frozenset(component))
    return circles


def oversized_modules(package_dir: Path, limit: int = LINE_LIMIT) -> dict[str, int]:
    sizes = {
        module_name(path, package_dir): len(path.read_text(encoding="utf-8").splitlines())
        for path in package_dir.rglob("*.py")
    }
    return {name: lines for name, lines in sizes.items() if lines > limit}


# ---- genfn itself ------------------------------------------------------------------------------------


def test_no_new_import_circles_and_no_stale_known_ones():
    circles = import_circles(import_graph(PACKAGE_DIR))
    new = circles - KNOWN_CIRCLES
    assert not new, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    gone = KNOWN_CIRCLES - circles
    assert not gone, f"these circles are broken now: remove them from KNOWN_CIRCLES: {gone}"


def test_no_module_over_the_line_limit():
    assert oversized_modules(PACKAGE_DIR) == {}


def test_findings_equal_the_house_check_tool_where_it_exists():
    # Without the tool (a bare checkout, CI) there is nothing to compare with: the checks above and
    # the synthetic-package test below still run.
    if not HOUSE_CHECK_TOOL.is_file():
        pytest.skip(f"no {HOUSE_CHECK_TOOL} beside this checkout")
    run = subprocess.run(
        [sys.executable, str(HOUSE_CHECK_TOOL), str(PACKAGE_DIR)], capture_output=True, text=True, timeout=120
    )
    tool_circles = {frozenset(line[len("circle: "):].split(" <-> ")) for line in run.stdout.splitlines()
                    if line.startswith("circle: ")}
    tool_big = {m.group(1): int(m.group(2)) for m in re.finditer(r"module over \d+ lines: (\S+) \((\d+)\)", run.stdout)}
    assert tool_circles == import_circles(import_graph(PACKAGE_DIR))
    assert tool_big == oversized_modules(PACKAGE_DIR)
    assert run.returncode == (1 if tool_circles or tool_big else 0)


# ---- the checks find what they should ------------------------------------------------------------


def test_checks_find_circles_lazy_and_relative_imports_and_long_modules(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\nfrom .sub import g\n",  # re-exports: no arrows
        "a.py": "from .b import h\n\ndef f():\n    return h()\n",
        "b.py": "def h():\n    from pkg.a import f  # lazy, still an arrow\n    return f\n",
        "c.py": "import pkg.sub.deep\n",
        "sub/__init__.py": "from .deep import g\n",
        "sub/deep.py": "from ..c import x\n\ndef g():\n    return 1\n",  # deep -> c -> deep
        "plain.py": "import os\nfrom . import b\n",  # an arrow into a circle, not part of it
        "long.py": "x = 1\n" * (LINE_LIMIT + 1),
        "limit.py": "x = 1\n" * LINE_LIMIT,
    }
    for name, text in files.items():
        (package / name).write_text(text)
    edges = import_graph(package)
    assert edges["pkg"] == set() and edges["pkg.sub"] == set()
    assert edges["pkg.plain"] == {"pkg.b"}
    assert import_circles(edges) == {frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.sub.deep"})}
    assert oversized_modules(package) == {"pkg.long": LINE_LIMIT + 1}
    (package / "b.py").write_text("def h():\n    return 1\n")
    assert import_circles(import_graph(package)) == {frozenset({"pkg.c", "pkg.sub.deep"})}
