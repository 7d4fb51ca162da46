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


def target(page: Path, link: str) -> str:
    """The page a link names, relative to docs/ (a Learn page's `../x.md` is `x.md`)."""
    parts = [*page.relative_to(DOCS).parent.parts]
    for part in link.split("#")[0].split("/"):
        if part == "..":
            parts = parts[:-1]
        else:
            parts.append(part)
    return "/".join(parts)


def reference_page(page: str) -> bool:
    """`reference/sim/cluster/trace.md` is the API reference of a module the build documents (gen_pages)."""
    if not page.startswith("reference/"):
        return False
    stem = page.removeprefix("reference/").removesuffix(".md").removesuffix("/index")
    return any((root / f"{stem}{end}").exists() for root in (DOCS.parent, DOCS.parent / "src")
               for end in (".py", "/__init__.py"))  # fmt: skip


def test_every_relative_link_names_a_page_that_exists():
    sources = sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("learn/*.md"))
    pages = generated_pages() | {str(p.relative_to(DOCS)) for p in sources}
    assert {"hf.md", "hf-batch.md", "hf-guard.md", "hf-admit.md", "your-model.md", "learn/ring.md"} <= pages
    broken = [(str(p.relative_to(DOCS)), t) for p in sources for t in links(p)
              if t.split("#")[0].endswith(".md") and target(p, t) not in pages and not reference_page(target(p, t))]  # fmt: skip
    assert broken == []


def test_a_learn_pages_link_up_resolves_from_its_folder():
    assert target(DOCS / "learn" / "ring.md", "../merge.md#a") == "merge.md"
    assert target(DOCS / "glossary.md", "learn/ring.md") == "learn/ring.md"
    assert target(DOCS / "learn" / "ring.md", "merge.md") == "learn/merge.md"
    assert reference_page("reference/sim/cluster/trace.md") and reference_page("reference/cpref/index.md")
    assert not reference_page("reference/sim/cluster/nowhere.md") and not reference_page("sim/cluster/trace.md")


def test_a_link_to_a_missing_page_is_found(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("see [the page](nowhere.md#a), [site](https://x.org/a.md), [here](#b) and ```[no](in-code.md)```")
    assert links(page) == ["nowhere.md#a"]
