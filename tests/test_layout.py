"""The package's layout rules: the request path's rooms, pure modules free of I/O, the layout tree
in docs/architecture.md matching the code, and source-level guards a functional test cannot show
on every path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"

# Modules that decide or translate without I/O: they must not import an I/O library, even
# through another module (checked in a fresh interpreter, so every transitive import counts).
PURE = [
    "proxy.styles.base", "proxy.styles.openai", "proxy.styles.served", "proxy.styles.anthropic",
    "proxy.styles.ollama", "proxy.policy.tiers", "proxy.credits.pricing", "proxy.headers",
    "proxy.http.sse", "proxy.errors", "proxy.validate", "proxy.upstream.wire", "proxy.outcome",
    "proxy.ids", "proxy.families.tts", "proxy.families.asr", "proxy.families.generation",
    "proxy.families.languages", "proxy.media.audio", "proxy.media.wav", "proxy.media.containers",
    "proxy.media.visual", "proxy.upstream.quorum",
    "proxy.upstream.routing",
]
IO_LIBRARIES = ("aiohttp", "redis", "limits", "asyncio", "socket", "ssl")
# The top level holds the entry points, the wiring and the vocabulary every package shares.
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "admin_cli.py", "app.py", "appkeys.py",
             "config.py", "reload.py", "errors.py", "headers.py", "pipeline.py", "validate.py",
             "outcome.py", "ids.py"}


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
    source = (PROXY / "policy" / "admission.py").read_text()
    assert ".hit(" in source and ".test(" not in source
