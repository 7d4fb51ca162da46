"""The "Which mode?" page's figures: every mode's predicted step against P, from `sim.plan.study` run at build.

One figure per profile, one panel per head configuration, drawn by `sim.plan.figures.draw_curves` (as
`python -m sim plan --cp 8,16,... --figure` draws them): each mode's line is its best candidate at each P, the
winner of each P ringed, the crossovers marked, and the step of perfect scaling (every FLOP of the batch split
evenly, at the profile's peak rate) as a grey reference. The page's table prints the same `curves`, so the two
cannot disagree.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from docs import figures as base
from sim.plan.figures import draw_curves
from sim.plan.profile import load_profile
from sim.plan.study import MODELS, curves, study_batch


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
        draw_curves(ax, c, [ideal_seconds(profile, heads, P) * 1e3 for P in c.Ps])
        ax.set_title(f"{model}: Hq = {heads[0]}, Hkv = {heads[1]}", loc="left")
    axes[0].legend(frameon=False, loc="lower left")
    fig.suptitle(f"{load_profile(profile).name}: 128k tokens packed, bf16, forward + backward (ringed: the winner)")
    return fig


FIGURES = {
    "figures/study_h100.png": lambda: draw_study("h100-sxm"),
    "figures/study_910b.png": lambda: draw_study("ascend-910b"),
}
