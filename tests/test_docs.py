"""The README's links: every relative link points at a file of the repository (the docs pages
themselves are checked by `mkdocs build --strict` in scripts/test, which fails on a broken link,
a missing page or a page left out of the nav)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_links_point_at_files() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in LINK.findall(readme) if not re.match(r"[a-z]+:", t)]
    assert targets, "the README links to no page"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README links to missing files: {missing}"
