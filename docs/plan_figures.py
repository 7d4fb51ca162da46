"""The page "The modes from 8 to 1024 ranks"'s figures: every mode's predicted step against P, from `sim.plan.study` run at build.

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
from sim.plan.study import MODELS, MODES_SHOWN, curves, study_batch, whole_curves


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


def draw_whole(profile: str, model: str = "Llama-3-8B-like") -> Figure:
    """Each mode's best step (ms, log) against P (log 2) over the layouts that keep documents whole (solid) beside its
    best over the chunked ones (dotted, faint): `whole_curves` against `curves`."""
    from sim.plan.figures import MODE_MARKERS, mode_color

    heads = MODELS[model]
    fig = base.plt.figure(figsize=(base.WIDTH, 4.2), constrained_layout=True)
    ax = fig.add_subplot()
    whole, chunked = whole_curves(profile, heads), curves(profile, heads)
    ax.plot(whole.Ps, [ideal_seconds(profile, heads, P) * 1e3 for P in whole.Ps], color="0.6", linestyle="--",
            label="all FLOPs / P at peak")  # fmt: skip
    for mode in MODES_SHOWN:
        for c, style, alpha, label in ((whole, "-", 1.0, mode), (chunked, ":", 0.55, None)):
            pts = [(p.P, p.step * 1e3) for p in c.points[mode] if p is not None]
            ax.plot(*zip(*pts), linestyle=style, alpha=alpha, color=mode_color(mode), marker=MODE_MARKERS[mode],
                    markersize=4, label=label)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(whole.Ps, [str(P) for P in whole.Ps])
    ax.set_xlabel("CP size P")
    ax.set_ylabel("step of one layer, ms")
    ax.legend(frameon=False, loc="lower left")
    ax.set_title(f"{load_profile(profile).name}, {model}: solid, documents kept whole; dotted, chunked", loc="left")
    return fig


FIGURES = {
    "figures/study_h100.png": lambda: draw_study("h100-sxm"),
    "figures/study_910b.png": lambda: draw_study("ascend-910b"),
    "figures/study_whole_h100.png": lambda: draw_whole("h100-sxm"),
}
