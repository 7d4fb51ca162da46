"""Browsable source pages, generated into the site at build time (never committed).

The project has no public repository URL, so the site carries its own copy of the code: one
highlighted page per Python file of `src/cpref` and `sim` (with line numbers that are links),
and an index. The header's repository link and the "Source:" footers of the guide and API
pages point here. Source pages are left out of the search index: the guide and the API
reference already say what the code does.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = [ROOT / "src" / "cpref", ROOT / "sim", ROOT / "bench"]
INDEX = "source/index.md"

# A line pymdownx.snippets would expand even inside a code fence (it runs before fences are
# parsed), e.g. a docstring's `--8<-- "src/cpref/batch/layout.py:chunks"`. Its escape is a `;`.
SNIPPET_LINE = re.compile(r"^(\s*)(-+8<-+)")
# Out of the search index; no table of contents, so the code gets the width.
FRONT_MATTER = "---\nsearch:\n  exclude: true\nhide:\n  - toc\n---\n\n"


def source_files() -> list[Path]:
    """Every Python file of the documented packages, in path order."""
    return sorted(f for d in SOURCE_DIRS for f in d.rglob("*.py") if "__pycache__" not in f.parts)


def page_of(file: Path) -> str:
    """The site page of a source file: `src/cpref/batch/layout.py` -> `source/src/cpref/layout.py.md`."""
    return f"source/{file.relative_to(ROOT).as_posix()}.md"


def link_from(doc_path: str, file: Path) -> str:
    """A Markdown link from the page `doc_path` to the source page of `file`."""
    up = "../" * doc_path.count("/")
    rel = file.relative_to(ROOT).as_posix()
    return f"[`{rel}`]({up}{page_of(file)})"


def source_page(file: Path) -> str:
    """One file as a page: its path as the title, the code highlighted with linked line numbers."""
    text = file.read_text()
    code = [SNIPPET_LINE.sub(r"\1;\2", line) for line in text.splitlines()]
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)  # longer than any backtick run in the file
    rel = file.relative_to(ROOT).as_posix()
    up = "../" * page_of(file).count("/")
    lines = [
        FRONT_MATTER + f"# `{rel}`",
        f"[All source files]({up}{INDEX}) · {len(code)} lines",
        f'{fence}python linenums="1"',
        *code,
        fence,
    ]
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n"


def index_page(reference: dict[Path, tuple[str, str]]) -> str:
    """The list of source files, each with a link to its API page: `reference[file] = (module, page)`."""
    rows = ["| file | lines | API reference |", "| --- | --- | --- |"]
    for file in source_files():
        name, api = reference.get(file, (None, None))
        api_link = f"[`{name}`](../{api})" if api else ""
        rows.append(f"| {link_from(INDEX, file)} | {len(file.read_text().splitlines())} | {api_link} |")
    intro = (
        "# Source code\n\n"
        "The code of `src/cpref` (the library) and `sim` (the oracle and the simulated cluster) "
        "as of this build, one page per file."
    )
    return FRONT_MATTER + intro + "\n\n" + "\n".join(rows) + "\n"
