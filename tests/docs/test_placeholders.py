"""Every hand-written page with a placeholder (`{{ figure PATH }}`, `{{ output FILE }}`, `{{ name }}`) is one the
build fills (`docs/gen_pages.py`'s `filled_pages`: the home page, the Learn path, the pages of `HAND_FIGURES`).

The variants page was not, and showed its figure's marker as text; the browser check now fails on a placeholder
left in a page's prose too (`docs/check_site.py`). `gen_pages` is read as source: importing it needs mkdocs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = re.compile(r"\{\{\s*[\w ./-]+\}\}")


def filled() -> set[str]:
    """gen_pages' own `filled_pages()`, run on its `LEARN` and `HAND_FIGURES` as written there."""
    source = (DOCS / "gen_pages.py").read_text()
    names: dict = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("LEARN", "HAND_FIGURES"):
            names[node.targets[0].id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "filled_pages":
            function = ast.get_source_segment(source, node)
    exec(function, names)  # noqa: S102 (the repository's own source)
    return set(names["filled_pages"]())


def marked(text: str) -> list[str]:
    """The placeholders of a page's prose (code blocks may quote one)."""
    return MARKER.findall(re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S))


def test_every_page_with_a_placeholder_is_filled_by_the_build():
    pages = sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("learn/*.md"))
    unfilled = [(str(p.relative_to(DOCS)), marked(p.read_text())) for p in pages
                if marked(p.read_text()) and str(p.relative_to(DOCS)) not in filled()]  # fmt: skip
    assert unfilled == []
    assert "variants.md" in filled() and "learn/ring.md" in filled()


def test_a_placeholder_in_code_is_not_one():
    assert marked("a {{ figure x.png }} b `{{ figure y.png }}`\n```\n{{ output z.py }}\n```") == ["{{ figure x.png }}"]
