"""The performance pages' figures, drawn from what the last `make bench` kept in `bench/results/*.json`.

Each `draw_*` function takes one benchmark's results (`bench.all.load(name)["results"]`, the
dict its `main()` returned) and returns a matplotlib `Figure`; `FIGURES` binds them to the kept
files, and `docs/gen_pages.py` checks every one for readable labels like the other figures. A
figure plots the numbers the tables print from the same file, so the two cannot
disagree; `tests/test_bench.py` draws each from made-up results and reads the numbers back.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from bench.all import load
from docs import figures as base

LAYOUT_COLORS = {"contiguous": base.rank_color(0), "zigzag": base.rank_color(1), "stream": base.rank_color(2),
                 "balanced": base.rank_color(3)}  # fmt: skip


def _bars(ax, groups: list[str], series: dict[str, list[float]], colors: dict[str, object], fmt: str | None = "{:.2f}",
          rotation: int = 90, label_y: float | None = None) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series, each labelled with its value (unless `fmt`
    is None), above the bar or, with `label_y`, inside it at that height (below lines drawn across the bars)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, color=colors[name], label=name)
        if fmt is not None and label_y is None:
            ax.bar_label(bars, [fmt.format(v) for v in values], padding=2, rotation=rotation)
        for x, v in zip(xs, values) if fmt is not None and label_y is not None else ():
            ax.text(x, min(label_y, v / 2), fmt.format(v), ha="center", va="center", rotation=rotation)
    ax.set_xticks(range(len(groups)), groups)


def draw_kernel(results: dict) -> Figure:
    """Each mix's time of the fast and the explicit path over SDPA called once per document, with the targets."""
    rows = results["rows"]
    mixes = [r["mix"] for r in rows]
    fig, ax = base.plt.subplots(figsize=(base.WIDTH, 3.8), constrained_layout=True)
    series = {"fast (TorchKernel)": [r["fast"] / r["sdpa"] for r in rows],
              "explicit (TorchKernel(fast=False))": [r["explicit"] / r["sdpa"] for r in rows]}  # fmt: skip
    _bars(ax, mixes, series, dict(zip(series, (base.rank_color(1), base.rank_color(7)))), rotation=0, label_y=0.45)
    ax.axhline(1.0, color="0.2", linewidth=1.2, label="SDPA per document")
    for i, mix in enumerate(mixes):  # the target of each mix, a short dashed line over its group
        ax.hlines(results["targets"][mix], i - 0.45, i + 0.45, color="0.1", linestyles="dashed", linewidth=1.2,
                  label="target" if i == 0 else None)  # fmt: skip
    ax.set_ylim(0, 1.45 * max(max(v) for v in series.values()))
    ax.set_ylabel("time over SDPA's")
    ax.set_xlabel("documents in the batch")
    ax.legend(frameon=False, loc="upper left", ncols=2)
    ax.set_title(f"Forward + backward, {results['dtype']}: time over SDPA called per document (lower is faster)", loc="left")
    return fig


def draw_scaling(results: dict) -> Figure:
    """Per batch, every mode's speedup at CP = P (2 in `make bench`; the ranks each row has) in each layout, against
    the machine's P-process factor and the target (a fraction of it: the efficiency against the machine)."""
    batches = results["batches"]
    cols = 2
    fig = base.plt.figure(figsize=(base.WIDTH, 3.1 * -(-len(batches) // cols)), constrained_layout=True)
    axes = base.panel_grid(fig, len(batches), cols)  # an odd last batch centred: no empty panel
    for ax in axes[1:]:
        ax.sharey(axes[0])
    for ax, batch in zip(axes, batches):
        rows = [r for r in batch["rows"] if not r.get("path")]  # each mode's default path
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        layouts = list(dict.fromkeys(r["layout"] for r in rows))
        speed = {(r["mode"], r["layout"]): batch["t1"] / r["t2"] for r in rows}
        _bars(ax, modes, {lay: [speed[(m, lay)] for m in modes] for lay in layouts}, LAYOUT_COLORS, fmt=None)
        P = len(rows[0]["ranks"])
        n = "two" if P == 2 else str(P)
        factor = P * batch["t1"] / batch["t_pair"]
        ax.axhline(factor, color="0.1", linestyle="dashed", linewidth=1.2, label=f"{n} processes, no communication")
        ax.axhline(batch["target"] * factor, color="0.45", linestyle="dotted", linewidth=1.5,
                   label=f"target: {batch['target']} of that")  # fmt: skip
        window = "" if batch["window"] == [-1, -1] else f", window {batch['window'][0]}"
        ax.set_title(f"{batch['name']}{window}\n{n} processes: {factor:.2f}", loc="left")
        ax.set_ylim(0, 1.2 * P)
        ax.grid(axis="y", color="0.9")
        ax.set_axisbelow(True)
        ax.tick_params(axis="x", labelrotation=20)
    for ax in axes[::cols]:  # the first of each row
        ax.set_ylabel(f"speedup T(CP=1) / T(CP={P})")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False)
    return fig


def draw_memory(results: dict) -> Figure:
    """Per mode, the busiest rank's peak and saved bytes, measured, against `P`, and the saved-bytes formula's line."""
    modes = list(dict.fromkeys(r["mode"] for r in results["rows"]))
    fig, axes = base.plt.subplots(1, len(modes), figsize=(base.WIDTH, 3.6), sharey=True, constrained_layout=True)
    for ax, mode in zip(axes, modes):
        rows = [r for r in results["rows"] if r["mode"] == mode]
        Ps = [r["P"] for r in rows]
        mib = {key: [r[key] / 2**20 for r in rows] for key in ("formula", "saved", "peak")}
        ax.plot(Ps, mib["formula"], color="0.3", linewidth=1.5, label="saved, formula")
        ax.plot(Ps, mib["saved"], "o", color=base.rank_color(1), markersize=7, label="saved, measured")
        ax.plot(Ps, mib["peak"], "s--", color=base.rank_color(3), markersize=6, label="peak, measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ps, [str(P) for P in Ps])
        ax.set_xlim(Ps[0] / 1.4, Ps[-1] * 1.4)  # the end ticks clear of the next panel's
        ax.minorticks_off()
        ax.set_title(mode)
        ax.set_xlabel("P")
    axes[0].set_ylabel("MiB per rank (busiest)")
    axes[0].set_ylim(bottom=0)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, frameon=False)
    return fig


def draw_bytes(results: dict, pack: str = "lognormal 64k") -> Figure:
    """One pack: the busiest rank's MiB sent, forward + backward, per mode and layout, at every `P`."""
    runs = next(p for p in results["packs"] if p["name"] == pack)["runs"]
    fig, axes = base.plt.subplots(len(runs), 1, figsize=(base.WIDTH, 0.6 + 2.3 * len(runs)), sharex=True,
                                  constrained_layout=True, squeeze=False)  # fmt: skip
    for ax, run in zip(axes[:, 0], runs):
        layouts = run["layouts"]
        modes = list(next(iter(layouts.values()))["modes"])
        series = {lay: [layouts[lay]["modes"][m]["bytes"] / 2**20 for m in modes] for lay in layouts}
        _bars(ax, modes, series, LAYOUT_COLORS, fmt="{:.1f}")
        ax.set_ylim(0, 1.3 * max(max(v) for v in series.values()))
        ax.set_title(f"P = {run['P']}", loc="left")
        ax.set_ylabel("MiB sent")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=len(runs[0]["layouts"]),
               frameon=False)  # fmt: skip
    fig.suptitle(f"{pack}: bytes the busiest rank sends, forward + backward", x=0.0, ha="left")
    return fig


FIGURES = {
    "figures/bench_kernel.png": lambda: draw_kernel(load("kernel")["results"]),
    "figures/bench_scaling.png": lambda: draw_scaling(load("scaling")["results"]),
    "figures/bench_memory.png": lambda: draw_memory(load("memory")["results"]),
    "figures/bench_bytes.png": lambda: draw_bytes(load("layouts")["results"]),
}
