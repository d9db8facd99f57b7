"""The config package's shape: one import path for every name, no dependency on the rest of the
gateway, and PyJWT loaded only for a JWT policy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import proxy.config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "proxy" / "config"
# What the config may import of the gateway: the shared vocabulary, nothing above it.
ALLOWED = ("proxy.config", "proxy.headers", "proxy.validate", "proxy.errors")


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def test_every_public_name_is_importable_from_the_package() -> None:
    schema = ("vocabulary.py", "backends.py", "policies.py", "loader.py")
    public = set().union(*(_top_level_names(PACKAGE / name) for name in schema)) - {"S"}
    assert public <= set(proxy.config.__all__), sorted(public - set(proxy.config.__all__))
    assert all(hasattr(proxy.config, name) for name in proxy.config.__all__)


def test_imports_nothing_of_the_gateway_above_the_shared_vocabulary() -> None:
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] if not node.level else ["proxy.config"]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}: {m}" for m in modules
                      if m.split(".")[0] == "proxy" and not m.startswith(ALLOWED)]
    assert found == []


def _load_in_a_fresh_interpreter(folder: Path) -> tuple[str, bool]:
    """(the ConfigError's problems, or "", and whether PyJWT was imported) after importing the
    app and loading `folder`."""
    probe = ("import sys\nimport proxy.app\nfrom proxy.config import ConfigError, load_config\n"
             f"try:\n    load_config({str(folder)!r})\nexcept ConfigError as exc:\n"
             "    print(exc.problems)\nprint('jwt' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip().splitlines()
    return "\n".join(out[:-1]), out[-1] == "True"


def test_pyjwt_loads_only_where_jwts_are_configured(tmp_path: Path) -> None:
    assert _load_in_a_fresh_interpreter(ROOT) == ("", False)  # shipped policies: API keys only
    (tmp_path / "backends.toml").write_text("")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "auth.toml").write_text(
        "[jwt]\nalgorithms = ['RS256']\njwks_file = 'jwks.json'\n")
    (tmp_path / "jwks.json").write_text('{"keys": []}')
    problems, jwt_loaded = _load_in_a_fresh_interpreter(tmp_path)
    assert "has no usable key" in problems and jwt_loaded  # the key check ran, with PyJWT
