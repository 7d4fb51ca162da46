"""The "Which mode?" page's figures: every mode's predicted step against P, from `sim.plan.study` run at build.

One figure per profile, one panel per head configuration; each mode's line is its best candidate at each P, the
winner of each P ringed, the crossovers (where the winner changes) marked with a dotted line and the two modes'
names, and the step of perfect scaling (every FLOP of the batch split evenly, at the profile's peak rate) as a grey
reference. The page's table prints the same `curves`, so the two cannot disagree.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from docs import figures as base
from sim.plan.profile import load_profile
from sim.plan.study import MODELS, MODES_SHOWN, curves, study_batch

MODE_COLORS = {mode: base.rank_color(i) for i, mode in enumerate(MODES_SHOWN)}
MODE_MARKERS = {"a2a": "o", "a2a+p2p": "s", "p2p": "^", "all_gather": "v"}


def ideal_seconds(profile: str, heads: tuple[int, int, int, int], P: int) -> float:
    """Every FLOP of the study's batch (causal work per document, forward and backward) split over `P` ranks at the
    profile's bf16 peak: the step no mode can beat."""
    hq, _, d, dv = heads
    work = sum(n * (n + 1) // 2 for n in study_batch())
    return 2 * work * hq * ((d + dv) + (3 * d + 2 * dv)) / P / load_profile(profile).kernel("bfloat16").peak


def draw_study(profile: str) -> Figure:
    """Step time (ms, log) against P (log 2) for every mode, one panel per model of `MODELS`."""
    fig = base.plt.figure(figsize=(base.WIDTH, 4.6), constrained_layout=True)
    axes = base.panel_grid(fig, len(MODELS), cols=2)
    for ax, (model, heads) in zip(axes, MODELS.items()):
        c = curves(profile, heads)
        ax.plot(c.Ps, [ideal_seconds(profile, heads, P) * 1e3 for P in c.Ps], color="0.6", linestyle="--",
                label="all FLOPs / P at peak")  # fmt: skip
        for mode in MODES_SHOWN:
            pts = [(p.P, p.step * 1e3) for p in c.points[mode] if p is not None]
            ax.plot(*zip(*pts), color=MODE_COLORS[mode], marker=MODE_MARKERS[mode], markersize=4, label=mode)
        for P, mode in zip(c.Ps, c.winners):  # the winner of each P, ringed
            step = next(p.step for p in c.points[mode] if p is not None and p.P == P) * 1e3
            ax.plot([P], [step], marker="o", markersize=11, markerfacecolor="none", markeredgecolor="0.1")
        for p0, p1, w0, w1 in c.crossovers:
            x = (p0 * p1) ** 0.5
            ax.axvline(x, color="0.3", linestyle=":", linewidth=1)
            ax.annotate(f"{w0}\n→ {w1}", (x, 0.97), xycoords=("data", "axes fraction"), ha="left", va="top",
                        xytext=(3, 0), textcoords="offset points")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c.Ps, [str(P) for P in c.Ps], rotation=90)
        ax.set_xlabel("CP size P")
        ax.set_ylabel("step of one layer, ms")
        ax.set_title(f"{model}: Hq = {heads[0]}, Hkv = {heads[1]}", loc="left")
    axes[0].legend(frameon=False, loc="lower left")
    fig.suptitle(f"{load_profile(profile).name}: 128k tokens packed, bf16, forward + backward (ringed: the winner)")
    return fig


FIGURES = {
    "figures/study_h100.png": lambda: draw_study("h100-sxm"),
    "figures/study_910b.png": lambda: draw_study("ascend-910b"),
}
