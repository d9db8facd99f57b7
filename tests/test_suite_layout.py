"""No test module imports another: what tests share (helpers and fixtures) lives in tests/support/,
its fixtures loaded by `pytest_plugins` in tests/conftest.py, and nothing in tests/ or loadtests/
imports a test module (test_*.py, *_test.py) or a conftest.py. An AST scan: imports inside
functions and under TYPE_CHECKING count, relative ones too, and so do `importlib.import_module`
and `pytest_plugins` strings."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "loadtests")
TEST_FILES = ("test_*.py", "*_test.py")  # pytest's python_files (the default)


def is_test_or_conftest(path: Path) -> bool:
    return path.name == "conftest.py" or any(fnmatch(path.name, p) for p in TEST_FILES)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) for every module a statement of `source` may load: `from a import b` may
    load a.b, so both a and a.b are named."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and _names_import(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            yield node.lineno, node.args[0].value
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets):
            for item in ast.walk(node.value):
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    yield node.lineno, item.value


def _names_import(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def violations(root: Path) -> list[str]:
    files = [p for folder in SCANNED if (root / folder).is_dir()
             for p in sorted((root / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    modules = {module_name(root, p): p for p in files}
    found = []
    for path in files:
        here = module_name(root, path)
        for line, name in imported(path.read_text(), here, path.name == "__init__.py"):
            target = modules.get(name)
            if target is not None and name != here and is_test_or_conftest(target):
                found.append(f"{path.relative_to(root)}:{line} imports {name} "
                             f"({target.relative_to(root)}): move what it needs to tests/support/")
    return sorted(set(found))


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    assert violations(ROOT) == []


def test_the_scan_finds_each_kind_of_import(tmp_path: Path) -> None:
    files = {
        "tests/__init__.py": "",
        "tests/conftest.py": "pytest_plugins = ['tests.support.fixtures']\n",
        "tests/support/__init__.py": "",
        "tests/support/fixtures.py": "from tests.a import test_x\n",
        "tests/a/__init__.py": "",
        "tests/a/conftest.py": "",
        "tests/a/test_x.py": "from tests.conftest import thing\n",
        "tests/a/test_y.py": "def f():\n    from . import conftest\n",
        "tests/b/test_z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    import tests.a.test_y\n",
        "tests/b/helper.py": "import importlib\nimportlib.import_module('tests.a.test_x')\n"
                             "from ..a.test_y import f\n",
        "loadtests/run.py": "pytest_plugins = ['tests.a.conftest']\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [v.split(" (")[0] for v in violations(tmp_path)]
    assert found == [
        "loadtests/run.py:1 imports tests.a.conftest",
        "tests/a/test_x.py:1 imports tests.conftest",
        "tests/a/test_y.py:2 imports tests.a.conftest",
        "tests/b/helper.py:2 imports tests.a.test_x",
        "tests/b/helper.py:3 imports tests.a.test_y",
        "tests/b/test_z.py:3 imports tests.a.test_y",
        "tests/support/fixtures.py:1 imports tests.a.test_x",
    ]


def declares_plugins(source: str) -> bool:
    return any(isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets)
        for node in ast.walk(ast.parse(source)))


def test_shared_fixtures_are_plugins_of_the_root_conftest_only() -> None:
    """pytest reads `pytest_plugins` in the root conftest only; each names a tests/support
    module that exists."""
    declaring = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("*.py"))
                 if declares_plugins(p.read_text())]
    assert declaring == ["tests/conftest.py"]
    plugins = [name for _, name in imported((ROOT / "tests/conftest.py").read_text(),
                                            "tests.conftest") if name.startswith("tests.")]
    assert plugins and all(name.startswith("tests.support.") for name in plugins)
    assert all((ROOT / (name.replace(".", "/") + ".py")).is_file() for name in plugins)
