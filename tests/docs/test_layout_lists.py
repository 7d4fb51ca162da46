"""A text that lists the layouts lists all four (`cpref.LAYOUTS`: contiguous, zigzag, stream, balanced).

`balanced` came last, and lists written before it kept naming three ("in every layout (contiguous,
zigzag, stream)"). Every sentence of the hand-written pages (README.md, docs/*.md) and of the
docstrings of `src/`, `sim/` and `examples/` (the API pages) that names at least three layouts must
name the fourth. A sentence is cut at its full stop; a list item, a table row and a Google-style
argument (`layout: ...`) are sentences of their own; code blocks are left out. "Balanced" as an
adjective ("the contiguous layout is balanced on its own") is not the layout.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cpref

ROOT = Path(__file__).resolve().parents[2]
NAMED = {name: re.compile(rf"\b{name}\b", re.I) for name in cpref.LAYOUTS}
ADJECTIVE = re.compile(r"\b(is|are|be|been|not|load|well|more|less|stays?|remains?)[- ]balanced\b", re.I)
# sentences in files that another change is editing now: fix them there, then take them out of here
PENDING: set[str] = set()  # texts known to list the layouts short, until they are fixed


def sentences(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    units = []
    for paragraph in re.split(r"\n\s*\n", text):
        # a list item, a table row, a Google-style argument ("    layout: ...") starts a unit of its own
        for item in re.split(r"\n(?=\s*(?:[*-]|\d+\.|\|)\s|\s+[A-Za-z_][\w ,()*`]*:\s)", paragraph):
            units += re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", " ".join(item.split()))
    return units


def layouts_named(sentence: str) -> list[str]:
    sentence = ADJECTIVE.sub("", sentence)
    return [name for name, word in NAMED.items() if word.search(sentence)]


def texts():
    """`(where, text)`: the Markdown pages, and every docstring of src/, sim/ and examples/."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(page.relative_to(ROOT)), page.read_text()
    for top in ("src", "sim", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}", doc


def incomplete(where: str, text: str) -> list[str]:
    return [f"{where}: {s[:160]} (names {', '.join(n)})" for s in sentences(text) if 3 <= len(n := layouts_named(s)) < 4]


def test_every_list_of_layouts_names_all_four():
    assert len(cpref.LAYOUTS) == 4
    found = [line for where, text in texts() if where not in PENDING for line in incomplete(where, text)]
    assert found == [], "\n".join(found)


def test_a_list_of_three_is_found_and_other_uses_of_the_words_are_not():
    text = """All modes run in every layout (contiguous, zigzag, stream), causal or not.

    Args:
        layout: `"zigzag"`, `"contiguous"` or `"balanced"`.
        rows: a contiguous run of the packed stream.

    The contiguous layout is balanced on its own; zigzag balances the rest. Each of
    `zigzag`, `contiguous`, `stream` and `balanced` is a layout.
    """
    found = incomplete("x", text)
    assert [line.split(": ", 1)[1][:12] for line in found] == ["All modes ru", 'layout: `"zi']
