"""docs/bench_figures.py and bench/report.py: the performance pages draw and print what the benchmarks kept.

Each figure is drawn from made-up results whose numbers all differ, and the plotted numbers are
read back from the artists: a figure that swapped two series, divided by the wrong time,
dropped the two-process factor or plotted the measured bytes as the formula's fails here.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    return importlib.import_module(f"docs.{name}")


figs = load("bench_figures")
MODES, LAYOUTS = ["a2a", "a2a+p2p", "all_gather", "p2p"], ["contiguous", "zigzag"]


def heights(ax, label: str) -> list[float]:
    """The bar heights of the series `label` on `ax`, left to right."""
    container = next(c for c in ax.containers if c.get_label() == label)
    return [bar.get_height() for bar in container if isinstance(bar, Rectangle)]


def horizontal(ax, label: str) -> list[float]:
    """The y of every horizontal line (axhline or hlines) labelled `label`."""
    ys = [line.get_ydata()[0] for line in ax.lines if line.get_label() == label]
    for coll in ax.collections:
        if isinstance(coll, LineCollection) and coll.get_label() == label:
            ys += [seg[0][1] for seg in coll.get_segments()]
    return ys


def test_kernel_figure_plots_each_mix_over_sdpa_and_its_target():
    rows = [{"mix": f"m{i}", "fast": 1.0 + i, "explicit": 3.0 + 2 * i, "sdpa": 2.0 + i, "rounds": 3} for i in range(3)]
    targets = {"m0": 1.1, "m1": 1.1, "m2": 1.0}
    fig = figs.draw_kernel({"rows": rows, "targets": targets, "dtype": "fp32", "peak": 1.0, "flops": 1.0})
    ax = fig.axes[0]
    assert heights(ax, "fast (TorchKernel)") == pytest.approx([r["fast"] / r["sdpa"] for r in rows])
    assert heights(ax, "explicit (TorchKernel(fast=False))") == pytest.approx([r["explicit"] / r["sdpa"] for r in rows])
    assert horizontal(ax, "SDPA per document") == [1.0]
    # one dashed target over each group, the first drawn with the legend's label, the others unlabelled
    targets_drawn = [seg[0][1] for c in ax.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert targets_drawn == [1.1, 1.1, 1.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["m0", "m1", "m2"]


def _scaling_batch(name: str, t1: float, t_pair: float, P: int = 2) -> dict:
    ranks = [{"total": 1.0, "compute": 0.9, "comm": 0.05}] * P
    rows = [{"mode": m, "layout": lay, "t2": 1.0 + 0.1 * i + 0.05 * j, "ranks": ranks}
            for i, m in enumerate(MODES) for j, lay in enumerate(LAYOUTS)]  # fmt: skip
    return {"name": name, "window": [-1, -1], "t1": t1, "t_pair": t_pair, "rows": rows, "ring": [], "shift": {},
            "target": 0.95, "target_layouts": ["zigzag"]}


@pytest.mark.parametrize("P, n", [(2, "two"), (4, "4")])
def test_scaling_figure_plots_speedups_per_layout_and_the_p_process_factor(P, n):
    """The factor is P T(CP=1) / T(P at once), P the ranks every row was measured on (bench.scaling --cp)."""
    batches = [_scaling_batch("one", 2.0, 1.9, P), _scaling_batch("two", 3.0, 3.3, P), _scaling_batch("three", 1.5, 1.4, P)]
    fig = figs.draw_scaling({"batches": batches})
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 3
    for ax, batch in zip(visible, batches):
        for lay in LAYOUTS:
            want = [batch["t1"] / r["t2"] for r in batch["rows"] if r["layout"] == lay]
            assert heights(ax, lay) == pytest.approx(want), (batch["name"], lay)
        assert horizontal(ax, f"{n} processes, no communication") == pytest.approx([P * batch["t1"] / batch["t_pair"]])
        assert horizontal(ax, "target: 0.95 of that") == pytest.approx([0.95 * P * batch["t1"] / batch["t_pair"]])
        assert ax.get_title(loc="left").startswith(batch["name"] + f"\n{n} processes: ")
    assert visible[0].get_ylabel() == f"speedup T(CP=1) / T(CP={P})"


def test_memory_figure_plots_the_formula_as_a_line_and_the_measured_as_points():
    rows = [{"mode": m, "P": P, "peak": (10 + i) * 2**20 / P, "saved": (5 + i) * 2**20 / P + 1, "formula": (5 + i) * 2**20 / P}
            for i, m in enumerate(MODES) for P in (1, 2, 4)]  # fmt: skip
    fig = figs.draw_memory({"rows": rows})
    for ax, mode in zip(fig.axes, MODES):
        mine = [r for r in rows if r["mode"] == mode]
        lines = {line.get_label(): line for line in ax.lines}
        for label, key in (("saved, formula", "formula"), ("saved, measured", "saved"), ("peak, measured", "peak")):
            assert list(lines[label].get_xdata()) == [1, 2, 4]
            assert list(lines[label].get_ydata()) == pytest.approx([r[key] / 2**20 for r in mine]), (mode, label)
        assert lines["saved, formula"].get_linestyle() == "-" and lines["saved, measured"].get_linestyle() == "None"
        assert ax.get_title() == mode


def test_bytes_figure_plots_the_busiest_ranks_mib_per_mode_and_layout_at_every_P():
    def run(P):
        return {"P": P, "layouts": {lay: {"modes": {m: {"bytes": (1 + i + 10 * j) * P * 2**20} for i, m in enumerate(MODES)}}
                                    for j, lay in enumerate(["contiguous", "zigzag", "stream", "balanced"])}}  # fmt: skip

    packs = [{"name": "other", "runs": [run(16)]}, {"name": "lognormal 64k", "runs": [run(2), run(4)]}]
    fig = figs.draw_bytes({"packs": packs})
    assert len(fig.axes) == 2
    for ax, P in zip(fig.axes, (2, 4)):
        for j, lay in enumerate(["contiguous", "zigzag", "stream", "balanced"]):
            assert heights(ax, lay) == pytest.approx([(1 + i + 10 * j) * P for i in range(4)])
        assert ax.get_title(loc="left") == f"P = {P}"


def _guide() -> tuple[list[tuple[str, str, str]], dict[str, list]]:
    """`docs/gen_pages.py`'s `GUIDE` and `PAGE_FIGURES`, read as text (importing it needs mkdocs)."""
    found = {}
    for node in ast.parse((ROOT / "docs" / "gen_pages.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("GUIDE", "PAGE_FIGURES"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["GUIDE"], found["PAGE_FIGURES"]


def prose_words(page: str) -> int:
    """The words a reader reads on a page: tables, formulas and the closed blocks of long tables left out."""
    text = re.sub(r"\$\$.*?\$\$", "", page, flags=re.S)
    return sum(len(line.split()) for line in text.splitlines() if not line.startswith(("|", "    ")))


def test_every_kept_result_draws_and_the_pages_render_it():
    """The kept results of the last `make bench` draw (each figure's labels readable) and fill the pages: the overview
    (`bench/report.py`) has the summary and links every benchmark's page; each benchmark's page (its module's
    docstring) ends in its last run, headed by where and when it ran, with its figures; every figure is on the page
    `PAGE_FIGURES` says, and no page is longer than a reader reads (issue 59: the one page had 10,000 words)."""
    from bench.all import BENCHMARKS, RESULTS

    for name in BENCHMARKS:
        kept = json.loads((RESULTS / f"{name}.json").read_text())
        assert kept["measured"].startswith("Measured ") and isinstance(kept["results"], dict), name
    for path, draw in figs.FIGURES.items():
        fig = draw()
        figs.base.check_readable(fig, path)
        figs.base.plt.close(fig)
    from bench import report

    guide, page_figures = _guide()
    page_of = {module: page for page, _, module in guide}
    doc = report.__doc__
    assert "{{ results" not in doc and "## Last run" not in doc
    assert "{{ goals }}" not in doc and "{total_minutes}" not in doc and "{{ summary }}" not in doc
    summary = doc.split("## The last run in one screen")[1].split("## What limits each goal")[0]
    # header, rule, the kernel's goal, the CP path's at P = 1, the five of bench.scaling.goals, the planner's (from
    # the same run), memory, the balanced layout's goals, the attention variants', the planner at scale and make
    # bench's time
    assert summary.count("\n| ") == 2 + 13, summary
    assert "| **planner** (`python -m sim plan`, CP = 2 here)" in summary
    assert "All on the CPU, none on a GPU" in summary and "{{ figure figures/bench_scaling.png }}" in summary
    assert "[On a GPU](#on-a-gpu)" in summary and "\n## On a GPU\n" in doc
    pages = {"performance.md": doc}
    for name in BENCHMARKS:  # each page ends in its last run, headed by where it ran (CPU, gloo, simulated cluster) and when
        page = page_of[f"bench.{name}"]
        assert f"]({page})" in doc.split("## The benchmarks, one page each")[1].split("\n## ")[0], page
        module = importlib.import_module(f"bench.{name}")
        assert module.__doc__.rstrip().endswith(f"{{{{ results {name} }}}}"), name
        pages[page] = report.fill_results(module.__doc__)
        measured = json.loads((RESULTS / f"{name}.json").read_text())["measured"]
        assert pages[page].count("## Last run") == 1 and f"## Last run\n\n**{report.WHERE[name]}** · *{measured}" in pages[page]
        assert "{{ results" not in pages[page] and "```" not in pages[page].split("## Last run")[1], name
    for page, text in pages.items():  # every figure where PAGE_FIGURES places it, once
        assert sorted(re.findall(r"\{\{ figure (\S+) \}\}", text)) == sorted(p for p, _ in page_figures.get(page, [])), page
        assert prose_words(text) < 2000, (page, prose_words(text))
    assert sorted(p for page in pages for p, _ in page_figures.get(page, [])) == sorted(figs.FIGURES)


def test_every_benchmark_shows_its_last_run_on_exactly_one_page():
    """`docs/gen_pages.py` fills each guide page's `{{ results NAME }}` and fails the build unless every benchmark of
    `make bench` has its marker on one page: a benchmark left out, shown twice or unknown is named."""
    from bench import report
    from bench.all import BENCHMARKS

    guide, _ = _guide()
    docs = {module: importlib.import_module(module).__doc__ or "" for _, _, module in guide}
    report.check_shown(docs)
    assert sorted(m for m, d in docs.items() if "{{ results" in d) == sorted(f"bench.{name}" for name in BENCHMARKS)
    shown = {f"bench.{name}": f"{{{{ results {name} }}}}" for name in BENCHMARKS}
    for pages, wrong in ((dict(list(shown.items())[1:]), BENCHMARKS[0]), ({**shown, "x": shown["bench.plan"]}, "plan"),
                         ({**shown, "x": "{{ results nothing }}"}, "nothing")):  # fmt: skip
        with pytest.raises(RuntimeError, match=f"'{wrong}'"):
            report.check_shown(pages)
