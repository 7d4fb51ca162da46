"""A Learn page's figures and the output it prints beside them come from one run, so they cannot disagree.

The all-gather figure once said 3072 B beside an output of 6144 B (its run had half the head dim), Ulysses' 12288 B
beside 4 x 6144 B (a sum beside each call), and the collectives figure drew `x = 10 r` where the example sent
`x = r`: each figure ran its own configuration. Now each draws from its page's example (`docs.learn_runs.example`:
its sizes, its batch, its results), and this test reads every text a page's figures draw: every byte count and every
balance ratio in them must be one the page's output prints, and the layouts' bars are the work the example printed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from docs import figures, learn_figures, learn_text  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
BYTES = re.compile(r"(\d[\d,]*) (?:B|bytes)\b")
RATIO = re.compile(r"slowest / mean = (\d+\.\d+)")


def hand_figures() -> dict[str, list[str]]:
    """`docs/gen_pages.py`'s `HAND_FIGURES`, read as source (importing it needs mkdocs): page -> its figure paths."""
    for node in ast.parse((DOCS / "gen_pages.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "HAND_FIGURES":
            return {page: [path for path, _ in entries] for page, entries in ast.literal_eval(node.value).items()}
    raise AssertionError("docs/gen_pages.py has no HAND_FIGURES")


def texts(path: str) -> list[str]:
    """Every text the figure at `path` draws (titles, labels, annotations, bar labels; every frame of an animation)."""
    drawn = learn_figures.FIGURES[path]()
    frames = drawn if isinstance(drawn, list) else [drawn]
    found = [t.get_text() for fig in frames for t in fig.findobj(Text) if t.get_visible()]
    for fig in frames:
        figures.plt.close(fig)
    return found


PAGES = {page: paths for page, paths in hand_figures().items()
         if page.startswith("learn/") and (DOCS / page).exists() and "{{ output" in (DOCS / page).read_text()
         and all(path in learn_figures.FIGURES for path in paths)}  # fmt: skip


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_byte_count_and_ratio_a_figure_shows_is_one_its_page_prints(page):
    outputs = re.findall(r"\{\{ output ([\w/.-]+) \}\}", (DOCS / page).read_text())
    printed = "\n".join(learn_text.output(name) for name in outputs)
    shown = "\n".join(text for path in PAGES[page] for text in texts(path))
    for pattern in (BYTES, RATIO):
        assert set(pattern.findall(shown)) <= set(pattern.findall(printed)), (page, pattern.pattern)


def test_the_layouts_bars_are_the_work_the_example_prints():
    printed = learn_text.output("examples/learn/layouts.py")
    work = [[int(n) for n in re.findall(r"\d+", line.split("[")[1].split("]")[0])]
            for line in printed.splitlines() if "scores per rank" in line]  # fmt: skip
    bars = [int(t) for t in texts("figures/learn/layouts.png") if t.isdigit()]
    assert len(work) == 2 and bars == work[0] + work[1]


def test_the_check_finds_a_figure_that_disagrees():
    """A figure of its own run (half the head dim) shows bytes the output does not print."""
    assert not set(BYTES.findall("forward: 2 all-gathers, 3072 B each")) <= set(BYTES.findall("6144 bytes sent"))
    assert BYTES.findall("1,024 B and 8 bytes") == ["1,024", "8"]
