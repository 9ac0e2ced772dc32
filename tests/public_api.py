"""Which reasonctl names a piece of code uses that are not public (an AST scan).

Public means a name in ``reasonctl.__all__`` reached as ``import reasonctl`` /
``reasonctl.<name>`` or ``from reasonctl import <name>``; ``allowed_modules`` adds whole
submodules (the guide's tests use ``reasonctl.testing``, the testing kit for plugin
authors). Everything else under ``reasonctl.*`` is internal and may change without notice,
so the examples a plugin author copies must not use it.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator

import reasonctl

PUBLIC_NAMES = frozenset(reasonctl.__all__)


def private_uses(source: str, *, filename: str = "<source>",
                 allowed_modules: Collection[str] = ()) -> list[str]:
    """``filename:line: what`` for each use of a non-public reasonctl name in ``source``."""
    tree = ast.parse(source, filename=filename)
    aliases = {"reasonctl"} | _module_aliases(tree)
    return [f"{filename}:{line}: {what}"
            for line, what in _findings(tree, aliases, set(allowed_modules))]


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names bound to the ``reasonctl`` package itself (``import reasonctl as rc``)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.Import) for alias in node.names if alias.name == "reasonctl"}


def _findings(tree: ast.AST, aliases: set[str], allowed: set[str]) -> Iterator[tuple[int, str]]:
    def internal(module: str) -> bool:
        return module.startswith("reasonctl.") and not any(
            module == m or module.startswith(m + ".") for m in allowed)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if internal(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if internal(node.module):
                yield node.lineno, f"from {node.module} import ..."
            elif node.module == "reasonctl":
                for alias in node.names:
                    if alias.name != "*" and alias.name not in PUBLIC_NAMES:
                        yield node.lineno, f"from reasonctl import {alias.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id in aliases and node.attr not in PUBLIC_NAMES
                    and f"reasonctl.{node.attr}" not in allowed):
                yield node.lineno, f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            target = node.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                if internal(target.value):
                    yield node.lineno, f"dynamic import of {target.value}"


def _is_dynamic_import(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")
