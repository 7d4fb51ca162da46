"""Links in the hand-written Markdown pages resolve as written: to a page in docs/ or one the build generates.

The built site's links are checked in a browser (`docs/check_site.py`); this reads the sources, so a link to
a page that no longer exists (a guide page renamed in `docs/gen_pages.py`, a typo) fails `make test` too,
without the docs toolchain. `GUIDE` is read from `gen_pages.py` as text: importing it needs mkdocs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def generated_pages() -> set[str]:
    tree = ast.parse((DOCS / "gen_pages.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GUIDE" for t in node.targets):
            return {page for page, _, _ in ast.literal_eval(node.value)}
    raise AssertionError("docs/gen_pages.py has no GUIDE")


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_names_a_page_that_exists():
    pages = generated_pages() | {p.name for p in DOCS.glob("*.md")}
    assert {"hf.md", "hf-batch.md", "hf-guard.md", "hf-admit.md", "your-model.md"} <= pages
    broken = [(p.name, t) for p in sorted(DOCS.glob("*.md")) for t in links(p)
              if t.split("#")[0].endswith(".md") and t.split("#")[0] not in pages]  # fmt: skip
    assert broken == []


def test_a_link_to_a_missing_page_is_found(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("see [the page](nowhere.md#a), [site](https://x.org/a.md), [here](#b) and ```[no](in-code.md)```")
    assert links(page) == ["nowhere.md#a"]
