"""The code a page shows by snippet region reads as the reader will copy it: it fits the code block, and an example
shown outside the Learn path runs as shown, every name it uses defined or imported in what the page shows.

The site's code blocks are 81 characters wide; a longer line wraps and reads as if it were indented (the
quickstart's region had eleven such lines). The "Your model" snippets used `torch`, `F`, `islice` and
`transformers` without importing them: copied, they failed with a NameError. Learn pages show their example in
parts, the later parts using what the earlier ones made, so there every region is held to the width only.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 81  # the characters a code block shows on one row: measured on the site, 81 fit and 82 wrap (the quickstart)
INCLUDE = re.compile(r'--8<-- "([^":]+\.py):([\w-]+)"')


def region(path: str, name: str) -> list[str]:
    lines = (ROOT / path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [start:{name}]")
    end = next(i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [end:{name}]")
    return lines[start + 1 : end]


def shown() -> list[tuple[str, str, str]]:
    """(page, file, region) for every region a hand-written page includes."""
    pages = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "learn").glob("*.md")]
    return sorted({(str(page.relative_to(ROOT / "docs")), path, name) for page in pages
                   for path, name in INCLUDE.findall(page.read_text())})  # fmt: skip


def free_names(source: str) -> set[str]:
    """The names `source` reads that it neither binds (assigns, imports, defines, takes as arguments) nor gets
    from Python's builtins: what it needs from somewhere the reader cannot see."""
    tree = ast.parse(source)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


@pytest.mark.parametrize("page, path, name", shown())
def test_every_line_a_page_shows_fits_its_code_block(page, path, name):
    assert [line for line in region(path, name) if len(line) > WIDTH] == []


@pytest.mark.parametrize("page, path, name", [s for s in shown() if s[1].startswith("examples/")
                                              and not s[0].startswith("learn/")])  # fmt: skip
def test_an_example_a_page_shows_runs_as_shown(page, path, name):
    import textwrap

    assert free_names(textwrap.dedent("\n".join(region(path, name)))) == set()


def test_a_snippet_that_uses_an_import_it_does_not_show_is_found():
    assert free_names("x = torch.ones(2)\nF.relu(x)") == {"torch", "F"}
    assert free_names("import torch\nimport torch.nn.functional as F\n"
                      "def f(a):\n    return F.relu(torch.ones(a))") == set()  # fmt: skip
