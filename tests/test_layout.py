"""The package's layout rules: the request path's rooms, pure modules free of I/O, the layout tree
in docs/architecture.md matching the code, and source-level guards a functional test cannot show
on every path."""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"

# Modules that decide or translate without I/O: they must not import an I/O library, even
# through another module (checked in a fresh interpreter, so every transitive import counts).
PURE = [
    "proxy.styles.base", "proxy.styles.openai", "proxy.styles.served", "proxy.styles.anthropic",
    "proxy.styles.ollama", "proxy.styles.wire", "proxy.policy.tiers", "proxy.credits.pricing",
    "proxy.headers", "proxy.http.sse", "proxy.http.ranges", "proxy.errors", "proxy.validate",
    "proxy.outcome", "proxy.ids", "proxy.families.tts", "proxy.families.asr",
    "proxy.families.generation", "proxy.families.languages", "proxy.media.audio",
    "proxy.media.wav", "proxy.media.containers", "proxy.media.matroska", "proxy.media.measure",
    "proxy.media.visual",
    "proxy.upstream.quorum", "proxy.upstream.routing",
]
IO_LIBRARIES = ("aiohttp", "redis", "limits", "asyncio", "socket", "ssl")
# The top level holds the entry points, the wiring and the vocabulary every package shares.
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "admin_cli.py", "app.py", "appkeys.py",
             "errors.py", "headers.py", "pipeline.py", "validate.py", "outcome.py", "ids.py"}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found = {}
    for path in PROXY.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The package's modules `name` imports: anywhere in it (inside functions and under
    TYPE_CHECKING too: an import that is only deferred is still a dependency). `from p import m`
    is an import of the module p.m when there is one, else of p."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    yield f"{base}.{alias.name}"
                elif base in modules:
                    yield base


def _room(module: str) -> str:
    """A subpackage is one room (proxy.credits.meter -> proxy.credits); a top-level module is
    a room of its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PROXY / parts[1]).is_dir() else module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first node repeated at its end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    modules = _modules()
    edges = {name: set(_imports(name, path, modules)) - {name}
             for name, path in modules.items()}
    rooms: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for name, targets in edges.items():
        for target in targets:
            a, b = _room(name), _room(target)
            if a != b:
                rooms.setdefault(a, set()).add(b)
                why.setdefault((a, b), []).append(f"{name} -> {target}")
    return rooms, why


def test_no_import_cycle_between_packages() -> None:
    """Each package (and each top-level module) sits above what it imports: the request path's
    rooms can be read, tested and changed from the bottom up."""
    rooms, why = _import_graph()
    cycle = _cycle(rooms)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle) + "\n" + \
        "\n".join(f"  {edge}" for a, b in itertools.pairwise(cycle) for edge in why[(a, b)])


def test_no_import_cycle_between_modules_of_a_package() -> None:
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, modules) if t != name}
             for name, path in modules.items()}
    for room in sorted({_room(name) for name in modules}):
        inside = {name: {t for t in targets if _room(t) == room}
                  for name, targets in graph.items() if _room(name) == room}
        cycle = _cycle(inside)
        assert cycle is None, f"import cycle inside {room}: " + " -> ".join(cycle)


# Where a request takes its one policy snapshot (`app[LIVE].current`): the entry points. Below
# them everything reads the snapshot it was handed, so a reload mid-request changes nothing for
# it. (module -> the functions that may take it; None: any, a route handler or a loop per read)
SNAPSHOT_TAKERS: dict[str, set[str] | None] = {
    "proxy/pipeline.py": {"chat", "task", "queued"},
    "proxy/app.py": None,
    **{f"proxy/api/{p.name}": None for p in (PROXY / "api").glob("*.py")},
}


def _key_reads(tree: ast.AST, key: str, attr: str) -> Iterator[tuple[str, int]]:
    """(enclosing function, line) of every `<x>[KEY].attr` in `tree`, directly or through a
    name the same function bound to `<x>[KEY]`."""
    def is_key(node: ast.AST) -> bool:
        return isinstance(node, ast.Subscript) and key in {
            getattr(node.slice, "id", None), getattr(node.slice, "attr", None)}

    def walk(node: ast.AST, function: str, bound: set[str]) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(child, child.name, set())
                continue
            if isinstance(child, ast.Assign) and is_key(child.value):
                bound |= {t.id for t in child.targets if isinstance(t, ast.Name)}
            if isinstance(child, ast.Attribute) and child.attr == attr and (
                    is_key(child.value)
                    or (isinstance(child.value, ast.Name) and child.value.id in bound)):
                yield function, child.lineno
            yield from walk(child, function, bound)

    yield from walk(tree, "<module>", set())


def test_policies_come_from_one_snapshot_taken_at_the_entry_point() -> None:
    """`[LIVE].current` only where a request (or a background loop) begins, once per function;
    a policy value never from the boot-time config (`[CONFIG].policies`) but in app.py's
    start-up."""
    stale = []
    for path in sorted(PROXY.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        reads: dict[str, int] = {}
        for function, line in _key_reads(tree, "LIVE", "current"):
            allowed = SNAPSHOT_TAKERS.get(name, set())
            if allowed is not None and function not in allowed:
                stale.append(f"{name}:{line} in {function}(): [LIVE].current below the entry")
            reads[function] = reads.get(function, 0) + 1
            if reads[function] > 1:
                stale.append(f"{name}:{line} in {function}(): a second snapshot")
        if name != "proxy/app.py":
            stale += [f"{name}:{line} in {function}(): the boot-time config's policies"
                      for function, line in _key_reads(tree, "CONFIG", "policies")]
    assert not stale, "\n".join(stale)


def test_the_snapshot_check_sees_a_stale_read(tmp_path: Path) -> None:
    source = ("async def produce(ctx):\n    return ctx.app[LIVE].current.policies\n"
              "def cap(app):\n    return app[appkeys.CONFIG].policies.requests\n"
              "async def chat(request):\n    config = request.app[CONFIG]\n"
              "    return config.policies.requests.chat.max_body_bytes\n")
    tree = ast.parse(source)
    assert list(_key_reads(tree, "LIVE", "current")) == [("produce", 2)]
    assert list(_key_reads(tree, "CONFIG", "policies")) == [("cap", 4), ("chat", 7)]


MAX_MODULE_LINES = 450  # style.md: 100-400 a module; one past ~400 is split


def test_no_module_is_too_long_to_read() -> None:
    long = {str(path.relative_to(ROOT)): n for path in sorted(PROXY.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these (over {MAX_MODULE_LINES} lines): {long}"


def test_pure_modules_import_no_io_even_transitively() -> None:
    probe = (
        "import importlib, sys\n"
        f"for name in {PURE!r}:\n"
        "    importlib.import_module(name)\n"
        f"io = sorted(m for m in sys.modules if m.split('.')[0] in {IO_LIBRARIES!r})\n"
        "print(','.join(io))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "", f"pure modules pull in I/O: {out}"


def test_top_level_holds_only_entry_points_and_wiring() -> None:
    modules = {p.name for p in PROXY.glob("*.py")}
    assert modules <= TOP_LEVEL, sorted(modules - TOP_LEVEL)
    assert len(TOP_LEVEL) <= 12  # the rest lives in packages, one room of the path each


def test_docs_layout_names_every_package_and_module() -> None:
    # The "## Layout" tree of docs/architecture.md (it was the README's until the docs moved).
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page[page.index("## Layout"):]
    tree = layout[layout.index("```"):layout.index("```", layout.index("```") + 3)]
    for package in sorted(p.parent for p in PROXY.glob("*/__init__.py")):
        name = package.name
        assert re.search(rf"^\s+{name}/", tree, re.M), f"docs layout lacks {name}/"
        for module in sorted(package.glob("*.py")):
            if module.name != "__init__.py" and package.name != "simulators":
                assert module.stem in tree, f"docs layout lacks {name}/{module.name}"
    for module in sorted(PROXY.glob("*.py")):
        if module.name not in ("__init__.py", "__main__.py"):
            assert module.name in tree, f"docs layout lacks {module.name}"


def test_rate_limits_only_hit_never_test_then_hit() -> None:
    # reliability.md R1: `test()` then `hit()` is a race; admission must use the atomic hit.
    source = (PROXY / "credits" / "admission.py").read_text()
    assert ".hit(" in source and ".test(" not in source
