"""A module docstring's doctest example renders as a code block on its guide page, not as one run-on paragraph."""

from __future__ import annotations

import importlib
import inspect

from docs.docstring_examples import fence_examples
from tests.docs.test_code_blocks import guide_modules


def test_an_example_section_becomes_a_pycon_block_and_the_text_after_it_stays_text():
    lines = ["Some prose.", "", "Example:", "    >>> x = 1", "    >>> x + 1", "    2", "", "More prose."]
    assert fence_examples(lines) == ["Some prose.", "", "**Example:**", "", "```pycon", ">>> x = 1", ">>> x + 1", "2",
                                     "```", "", "More prose."]  # fmt: skip


def test_no_guide_page_shows_a_doctest_outside_a_code_block():
    """Every guide module's docstring, as its page shows it: each `>>>` line inside a fence (the planner's, the
    simulated cluster's, the trace's examples ran into one paragraph before)."""
    bare = []
    for name in guide_modules():
        lines, fenced = fence_examples(inspect.cleandoc(importlib.import_module(name).__doc__).splitlines()), False
        for line in lines:
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif line.lstrip().startswith(">>>") and not fenced:
                bare.append(f"{name}: {line.strip()}")
    assert bare == []
