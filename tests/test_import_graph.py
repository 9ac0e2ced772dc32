"""The package's import graph: no circles, counting every import (a module's top, inside
functions, under ``if TYPE_CHECKING``), and ``reasonctl.core`` imports nothing above it.

A circle makes the order in which modules can be loaded depend on who imports first, and
hides which module owns a concept; a lazy or typing-only import is still a dependency.
The core is the contract every other package builds on, so it must not know them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = "reasonctl.core"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package`` (a package is its __init__)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source.

    ``from a.b import c`` points at ``a.b.c`` when that is a module, else at ``a.b``; an
    import of a name that is not a module points at the nearest enclosing module.
    """
    names = module_names(package)
    root = package.name

    def known(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        home = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = home.split(".")[: len(home.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base
                           for a in node.names]
            for target in targets:
                if target == root or target.startswith(root + "."):
                    module = known(target)
                    if module is not None and module != name:
                        graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_through(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One concrete circle inside a component, to show which imports to cut."""
    inside = set(members)
    path = [members[0]]
    seen = {members[0]: 0}
    while True:
        following = sorted(graph[path[-1]] & inside)[0]
        if following in seen:
            return [*path[seen[following]:], following]
        seen[following] = len(path)
        path.append(following)


def test_reasonctl_has_no_import_circles() -> None:
    graph = import_graph(ROOT / "reasonctl")
    found = [" -> ".join(cycle_through(graph, c)) + f"  ({len(c)} modules)"
             for c in circles(graph)]
    assert not found, "import circles (lazy and typing-only imports count):\n" + "\n".join(found)


def test_the_core_imports_nothing_above_it() -> None:
    graph = import_graph(ROOT / "reasonctl")
    above = sorted(f"{module} imports {target}" for module, targets in graph.items()
                   if module == CORE or module.startswith(CORE + ".")
                   for target in targets if not target.startswith(CORE))
    assert not above, "reasonctl.core must import only reasonctl.core:\n" + "\n".join(above)


def test_lazy_and_typing_only_imports_count(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.data import Row\n")
    (package / "data.py").write_text(
        "def load():\n    from pkg.core import types\n    from .model import tiny\n")
    (package / "model.py").write_text("from pkg.data import load\ntiny = 1\n")
    graph = import_graph(package)
    assert graph["pkg.core.types"] == {"pkg.data"}
    assert graph["pkg.data"] == {"pkg.core.types", "pkg.model"}
    assert sorted(map(sorted, circles(graph))) == [["pkg.core.types", "pkg.data", "pkg.model"]]
    assert cycle_through(graph, ["pkg.core.types", "pkg.data", "pkg.model"]) == [
        "pkg.core.types", "pkg.data", "pkg.core.types"]
