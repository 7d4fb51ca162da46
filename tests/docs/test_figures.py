"""docs/figures.py's checks, which `docs/gen_pages.py` runs on every figure before it saves it.

A panel with no data drawn (the attention mask's sixth panel once was) shows as a blank hole on
the page: `check_drawn` refuses it, hidden or empty, and every figure the site draws passes.
"""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("matplotlib")

figures = importlib.import_module("docs.figures")
plt = figures.plt

# every figure of the site: docs/gen_pages.py draws these four modules' FIGURES
SITE = {path: draw for name in ("figures", "mode_figures", "train_figures", "bench_figures")
        for path, draw in importlib.import_module(f"docs.{name}").FIGURES.items()}  # fmt: skip


def test_a_figure_with_an_empty_panel_is_refused():
    fig, axes = plt.subplots(1, 3, figsize=(figures.WIDTH, 2))
    axes[0].plot([0, 1], [0, 1])
    axes[1].imshow([[0, 1], [1, 0]])
    axes[2].set_title("nothing here")
    with pytest.raises(RuntimeError, match=r"bad\.png: 1 panel\(s\) with no data drawn.*axes 2 \('nothing here'\)"):
        figures.check_readable(fig, "bad.png")
    plt.close(fig)


def test_a_hidden_panel_is_refused_too():
    """Hiding the empty panel leaves the same hole in the grid."""
    fig, axes = plt.subplots(1, 2, figsize=(figures.WIDTH, 2))
    axes[0].bar([0, 1], [1, 2])
    axes[1].scatter([0], [0])
    axes[1].set_visible(False)
    with pytest.raises(RuntimeError, match="axes 1"):
        figures.check_drawn(fig, "hidden.png")
    plt.close(fig)


def test_a_title_wider_than_the_figure_is_refused():
    """Learn 9's key figure had its subtitle cut on both sides (`es: cpref's cost model ... scal`): a text that
    leaves the canvas fails the build, naming it; a tick outside the view (not drawn) and a hidden axis do not."""
    fig, ax = plt.subplots(figsize=(figures.WIDTH, 3))
    fig.subplots_adjust(bottom=0.2)
    ax.plot([0, 1], [0, 1])
    ax.set_xticks([-5, 0, 1, 50])  # ticks outside the view limits are not drawn
    ax.set_xlim(0, 1)
    fig.suptitle("a subtitle " * 20)
    with pytest.raises(RuntimeError, match=r"wide\.png: text past the figure's edge.*\['a subtitle a subtitle"):
        figures.check_readable(fig, "wide.png")
    fig.suptitle("fits")
    figures.check_readable(fig, "wide.png")
    fig.text(-0.02, 0.5, "left of the canvas")
    with pytest.raises(RuntimeError, match="left of the canvas"):
        figures.check_inside(fig, "left.png")
    plt.close(fig)


@pytest.mark.parametrize("n, rows", [(1, [1]), (2, [2]), (3, [2, 1]), (5, [2, 2, 1])])
def test_panel_grid_centres_an_odd_last_panel(n, rows):
    fig = plt.figure(figsize=(figures.WIDTH, 2 * len(rows)))
    axes = figures.panel_grid(fig, n)
    assert len(axes) == len(fig.axes) == n
    spans = [ax.get_subplotspec() for ax in axes]
    assert [sum(1 for s in spans if s.rowspan.start == r) for r in range(len(rows))] == rows
    last = spans[-1].colspan
    assert (last.start, last.stop) == ((1, 3) if n % 2 else (2, 4))  # alone in its row: the middle half-columns
    for ax in axes:
        ax.plot([0], [0])
    figures.check_drawn(fig, "grid.png")
    plt.close(fig)


# the parity figure trains two models (a minute and more in a test process): make test-all draws it, as the build does
SLOW = {"figures/parity.png"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.full) if p in SLOW else p for p in sorted(SITE)])
def test_every_figure_of_the_site_has_data_in_every_panel(path):
    fig = SITE[path]()
    figures.check_readable(fig, path)
    plt.close(fig)
