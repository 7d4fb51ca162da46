"""The home page's "Where to read next" names pages in the order of the navigation (`SECTIONS` of gen_pages).

A reader told "in the order of the navigation" who finds another order has two maps of the site. `SECTIONS`
is read from `docs/gen_pages.py` as source: importing it needs mkdocs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def navigation() -> list[str]:
    source = (DOCS / "gen_pages.py").read_text()
    names: dict = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("LEARN", "SECTIONS"):
            names[node.targets[0].id] = eval(ast.get_source_segment(source, node.value), {}, dict(names))
    return [page for _, pages in names["SECTIONS"] for page in pages]


def read_next(text: str) -> list[str]:
    section = text.split("## Where to read next", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"\]\(([\w/-]+\.md)(?:#[\w-]*)?\)", section)


def out_of_order(links: list[str], nav: list[str]) -> list[tuple[str, str]]:
    at = [nav.index(link) for link in links]
    return [(links[i], links[i + 1]) for i in range(len(at) - 1) if at[i + 1] < at[i]]


def test_where_to_read_next_follows_the_navigation():
    nav, links = navigation(), read_next((DOCS / "index.md").read_text())
    assert set(links) <= set(nav)
    assert [p for p in nav if p.startswith("learn/")] == [p for p in links if p.startswith("learn/")]  # all of them
    assert out_of_order(links, nav) == []


def test_an_order_that_differs_is_found():
    assert out_of_order(["b.md", "a.md", "c.md"], ["a.md", "b.md", "c.md"]) == [("b.md", "a.md")]


def test_the_home_page_counts_the_learn_pages_there_are():
    """"ten short pages" stayed after the path grew to twelve; every count the home page gives is the path's."""
    words = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}
    counts = re.findall(r"\b(\w+) short pages\b", (DOCS / "index.md").read_text())
    learn = [p for p in navigation() if p.startswith("learn/")]
    assert counts and {words[c] for c in counts} == {len(learn)}
