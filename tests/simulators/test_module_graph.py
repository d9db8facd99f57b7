"""The simulators' modules, and the media readers they share with the gateway, import each other
without cycles and stay small (style.md: one job a module, at most 400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy.simulators", "proxy.media")
MAX_LINES = 400


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package.replace(".", "/")).glob("*.py")):
        found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of `known` that `path` imports, wherever the import stands (inside a
    function or under TYPE_CHECKING too). `from pkg import name` imports pkg, and pkg.name too
    when that is a module."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return (found & known) - {name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the path that closes it; None when there is none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, pending = [start], [iter(sorted(graph[start]))]
        while pending:
            child = next(pending[-1], None)
            if child is None:
                pending.pop()
                done.add(path.pop())
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                pending.append(iter(sorted(graph[child])))
    return None


def test_no_import_cycles() -> None:
    found = {name: path for package in PACKAGES for name, path in modules(package).items()}
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    assert sum(map(len, graph.values())) > 50  # the walk sees the imports at all
    assert cycle(graph) is None


def test_the_check_sees_lazy_imports_and_closes_cycles(tmp_path: Path) -> None:
    module = tmp_path / "b.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.c\n"
                      "def f() -> None:\n    from p import a\n")
    assert imports("p.b", module, {"p", "p.a", "p.b", "p.c"}) == {"p", "p.a", "p.c"}
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_stay_small(package: str) -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules(package).items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
