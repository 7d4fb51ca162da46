"""The planner's answers drawn: `python -m sim plan --figure PATH` and the page "The modes from 8 to 1024 ranks"'s figures.

Two pictures, one panel per layer kind:

* **one P** ([`draw_ranking`][sim.plan.figures.draw_ranking]): the best candidates as horizontal bars of the slowest
  rank's step, split into compute and exposed communication, fastest on top, the winner's name in bold;
* **several P** ([`draw_curves`][sim.plan.figures.draw_curves], `--cp 8,16,32`): each mode's best step against P,
  log-log, the winner of each P ringed and each crossover (where the winner changes) marked with the two modes.

matplotlib is imported when a figure is drawn (`pip install matplotlib`; `make test` and `make docs` install it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODE_MARKERS", "mode_color", "draw_curves", "draw_ranking", "figure"]

MODE_MARKERS = {"a2a": "o", "a2a+p2p": "s", "p2p": "^", "all_gather": "v"}
_MODE_ORDER = ("a2a", "a2a+p2p", "p2p", "all_gather")


def mode_color(mode: str):
    """A mode's colour, the same in every figure (matplotlib's tab10, in `MODE_MARKERS` order)."""
    from matplotlib import colormaps

    return colormaps["tab10"](_MODE_ORDER.index(mode))


def draw_curves(ax, curves, ideal_ms: list[float] | None = None) -> None:
    """Each mode's best step (ms) against P on `ax` (`sim.plan.study.Curves`), the winners ringed, the crossovers
    marked; `ideal_ms`, a reference line (e.g. every FLOP split evenly at peak), dashed grey."""
    if ideal_ms is not None:
        ax.plot(curves.Ps, ideal_ms, color="0.6", linestyle="--", label="all FLOPs / P at peak")
    for mode in _MODE_ORDER:
        pts = [(p.P, p.step * 1e3) for p in curves.points[mode] if p is not None]
        if pts:
            ax.plot(*zip(*pts), color=mode_color(mode), marker=MODE_MARKERS[mode], markersize=4, label=mode)
    for P, mode in zip(curves.Ps, curves.winners):  # the winner of each P, ringed
        step = next(p.step for p in curves.points[mode] if p is not None and p.P == P) * 1e3
        ax.plot([P], [step], marker="o", markersize=11, markerfacecolor="none", markeredgecolor="0.1")
    for p0, p1, w0, w1 in curves.crossovers:
        x = (p0 * p1) ** 0.5
        ax.axvline(x, color="0.3", linestyle=":", linewidth=1)
        ax.annotate(f"{w0}\n→ {w1}", (x, 0.97), xycoords=("data", "axes fraction"), ha="left", va="top",
                    xytext=(3, 0), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(curves.Ps, [str(P) for P in curves.Ps], rotation=90)
    ax.set_xlabel("CP size P")
    ax.set_ylabel("step of one layer, ms")


def draw_ranking(ax, kind_plan, top: int) -> None:
    """The `top` fastest candidates of a `KindPlan` as bars of the slowest rank's step (ms), coloured by mode: compute
    solid, then exposed communication hatched, fastest on top, each labelled with its step."""
    from matplotlib.patches import Patch

    shown = kind_plan.ranked[:top]
    ys = list(range(len(shown)))[::-1]
    compute = [p.slowest.compute * 1e3 for p in shown]
    exposed = [p.slowest.exposed * 1e3 for p in shown]
    colors = [mode_color(p.candidate.mode) for p in shown]
    ax.barh(ys, compute, color=colors)
    ax.barh(ys, exposed, left=compute, color=colors, alpha=0.4, hatch="//")
    for y, p in zip(ys, shown):
        ax.annotate(f"{p.step * 1e3:.3f} ms", (p.step * 1e3, y), xytext=(3, 0), textcoords="offset points",
                    va="center")  # fmt: skip
    ax.set_xlim(0, max(p.step for p in shown) * 1e3 * 1.25)
    ax.set_yticks(ys, [p.name for p in shown])
    ax.get_yticklabels()[0].set_fontweight("bold")
    ax.set_xlabel("step of the slowest rank, ms")
    ax.legend(handles=[Patch(facecolor="0.5", label="compute"),
                       Patch(facecolor="0.5", alpha=0.4, hatch="//", label="exposed communication")],
              frameon=False, loc="upper right")  # fmt: skip


def figure(panels: dict[str, Any], title: str, top: int = 12):
    """A figure of one panel per layer kind: `panels` maps each kind to its `KindPlan` (one P: bars) or its
    `Curves` (several P: curves)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2 + 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (kind, what) in zip(axes, panels.items()):
        if hasattr(what, "winners"):
            draw_curves(ax, what)
            ax.legend(frameon=False, loc="lower left")
        else:
            draw_ranking(ax, what, top)
        ax.set_title(kind, loc="left")
    fig.suptitle(title)
    return fig
