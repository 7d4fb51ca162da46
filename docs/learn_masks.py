"""The figures of Learn CP page 12, "Masks under CP", drawn from the page's own example.

`example()` runs `examples/learn/masks.py` once (its output swallowed) and keeps what it computed: its masks
(`cpref.Mask`, drawn from their normalised slices and `dense()`), each rank's work under each mask (from the
slices) and the bytes each rank sent in every mode (from the simulated cluster's trace). The figures draw
those values and nothing else, so the page's pictures and the table it prints are one run's.
`FIGURES` maps each site path to its function; `docs/gen_pages.py` draws them at build time and checks them.
"""

from __future__ import annotations

import contextlib
import functools
import io
import runpy
from typing import Any

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

import cpref
from docs import figures as base

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color

KIND_COLORS = {"full": "#4c72b0", "causal": "#dd8452", "inv_causal": "#55a868", "bi_causal": "#8172b3"}
MASK_COLORS = {"no mask": "#b0b0b0", "causal": "#4c72b0", "prefix-LM": "#dd8452", "spans": "#55a868",
               "shared": "#c44e52"}  # fmt: skip


@functools.cache
def example() -> dict[str, Any]:
    """The globals of `examples/learn/masks.py` after one run (what it prints is the page's output block)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runpy.run_module("examples.learn.masks", run_name="__main__")


def _cells(ax: Axes, rgb: torch.Tensor) -> None:
    """`rgb (rows, cols, 3)` as cells with thin white grid lines; x: keys, y: queries (downwards)."""
    rows, cols, _ = rgb.shape
    ax.imshow(rgb.numpy(), interpolation="nearest", extent=(0, cols, rows, 0))
    ax.set_xticks(range(0, cols + 1, max(1, cols // 4)))
    ax.set_yticks(range(0, rows + 1, max(1, rows // 4)))


def _rgb(hex_color: str) -> torch.Tensor:
    return torch.tensor([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])


# ---------------------------------------------------------------------------------------------------------------
# The four kinds, on a wide and a tall rectangle.


def kinds() -> Figure:
    """`figures/learn/mask_kinds.png`: one slice of each kind over `Lq x Lk` and `Lk x Lq` cells, from
    `Mask.from_slices(...).dense()`, with the diagonals through the corners the kinds are aligned to."""
    ex = example()
    shapes = [(ex["Lq"], ex["Lk"]), (ex["Lk"], ex["Lq"])]
    fig, axes = plt.subplots(2, 4, figsize=(WIDTH, 4.6), constrained_layout=True)
    for row, (n_q, n_k) in enumerate(shapes):
        for col, kind in enumerate(ex["KINDS"]):
            mask = cpref.Mask.from_slices([(0, n_q, 0, n_k, kind)], total=max(n_q, n_k))
            seen = mask.dense()[:n_q, :n_k]  # (Lq, Lk)
            rgb = torch.ones(n_q, n_k, 3)
            rgb[seen] = _rgb(KIND_COLORS[kind])
            ax = axes[row, col]
            _cells(ax, rgb)
            for x in range(n_k + 1):
                ax.axvline(x, color="white", linewidth=0.8)
            for y in range(n_q + 1):
                ax.axhline(y, color="white", linewidth=0.8)
            ax.add_patch(Rectangle((0, 0), n_k, n_q, fill=False, edgecolor="black", linewidth=1.0))
            if kind in ("causal", "bi_causal"):  # j = i + Lk - Lq: through the bottom-right corner
                ax.plot([n_k - n_q, n_k], [0, n_q], color="black", linewidth=1.4, linestyle="--")
                ax.plot([n_k], [n_q], "o", color="black", markersize=5, clip_on=False)
            if kind in ("inv_causal", "bi_causal"):  # j = i: through the top-left corner
                ax.plot([0, n_q], [0, n_q], color="black", linewidth=1.4, linestyle=":")
                ax.plot([0], [0], "o", color="black", markersize=5, clip_on=False)
            if not seen.any():  # bi_causal with Lq > Lk: no key is both on or below and on or above
                ax.text(n_k / 2, n_q / 2, "no pair", ha="center", va="center")
            ax.set_xlim(0, n_k)
            ax.set_ylim(n_q, 0)
            ax.set_xticks([0, n_k])
            ax.set_yticks([0, n_q])
            if row == 0:
                ax.set_title(kind)
        axes[row, 0].set_ylabel(f"Lq = {n_q}, Lk = {n_k}\nquery i")
    for ax in axes[1]:
        ax.set_xlabel("key j")
    fig.suptitle("One slice of each kind (coloured: the pairs it shows); dashed: the diagonal through the\n"
                 "bottom-right corner (causal), dotted: through the top-left one (inv_causal)")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The usual masks, as slices over one small packed batch.


def slices() -> Figure:
    """`figures/learn/mask_slices.png`: each mask of the example's small batch, every pair coloured by the kind of
    the normalised slice that shows it, every slice outlined."""
    ex = example()
    drawn = ex["masks"](ex["SMALL"], window=3)
    fig = plt.figure(figsize=(WIDTH, 5.6), constrained_layout=True)
    axes = base.panel_grid(fig, len(drawn), cols=3)
    for ax, (name, mask) in zip(axes, drawn.items()):
        T = mask.total
        rgb, counted = torch.ones(T, T, 3), 0
        for sl in mask.slices:
            own = cpref.Mask.from_slices([sl], total=T).dense()  # (T, T): this slice's pairs
            assert not (own & (rgb != 1).any(-1)).any(), "normalised slices are disjoint"
            rgb[own] = _rgb(KIND_COLORS[sl[4]])
            counted += int(own.sum())
        assert counted == mask.visible_pairs() == int(mask.dense().sum()), name
        _cells(ax, rgb)
        for q0, q1, k0, k1, _ in mask.slices:
            ax.add_patch(Rectangle((k0, q0), k1 - k0, q1 - q0, fill=False, edgecolor="black", linewidth=0.9))
        ax.set_xticks(range(0, T + 1, 8))
        ax.set_yticks(range(0, T + 1, 8))
        ax.set_title(f"{name}\n{len(mask.slices)} slices, {mask.visible_pairs()} pairs")
    handles = [Patch(facecolor=c, label=k) for k, c in KIND_COLORS.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, title="the kind of each slice (outlined)")
    fig.suptitle(f"The usual masks over documents of {', '.join(map(str, ex['SMALL']))} tokens, as normalised "
                 "slices\n(x: key, y: query); the shared prompt reads them as a prompt and three answers")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Work per rank under each mask: contiguous against zigzag.


def balance() -> Figure:
    """`figures/learn/mask_balance.png`: each rank's pairs under each mask over the mean, contiguous, zigzag and the
    layout balanced by the mask, from the example's `works` (the tests hold them to the kernel's)."""
    ex = example()
    P, names, works = ex["P"], list(ex["MASKS"]), ex["works"]
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 8.2), constrained_layout=True, sharey=True)
    top = max(max(w) * P / sum(w) for w in works.values())
    for ax, layout in zip(axes, ("contiguous", "zigzag", "by mask")):
        for m, name in enumerate(names):
            w = works[name, layout]
            mean = sum(w) / P
            for r in range(P):
                ax.bar(m + (r - (P - 1) / 2) * 0.2, w[r] / mean, width=0.19, color=rank_color(r))
            ax.text(m, max(w) / mean + 0.05, f"{max(w) / mean:.2f}", ha="center", va="bottom")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1.0)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, top + 0.35)
        ax.set_ylabel("work / mean")
        title = "balanced by the mask" if layout == "by mask" else layout
        ax.set_title(f"{title}: each rank's pairs over the mean (above: slowest / mean)", loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=rank_color(r), label=f"rank {r}") for r in range(P)]
    fig.legend(handles=handles, loc="outside lower center", ncols=P)
    fig.suptitle(f"Each rank's work under each mask: P = {P}, {len(ex['LENGTHS'])} documents, "
                 f"{sum(ex['LENGTHS'])} tokens")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# What each mode moves under each mask, from the trace.


def traffic() -> Figure:
    """`figures/learn/mask_traffic.png`: the bytes the busiest rank sent in one forward + backward of each mode,
    under each mask, zigzag and stream, from the example's `moved` (the simulated cluster's trace)."""
    ex = example()
    moved, shown, modes = ex["moved"], list(ex["SHOWN"]), list(cpref.MODES)
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 6.0), constrained_layout=True, sharey=True)
    n = len(shown)
    for ax, layout in zip(axes, ("zigzag", "stream")):
        for m, mode in enumerate(modes):
            for s, name in enumerate(shown):
                kib = max(moved[layout, mode, name]) / 1024
                ax.bar(m + (s - (n - 1) / 2) * 0.16, kib, width=0.15, color=MASK_COLORS[name])
        ax.set_xticks(range(len(modes)), modes)
        ax.set_ylabel("KiB per rank")
        ax.set_title(f"{layout}: every document cut over every rank" if layout == "zigzag" else
                     f"{layout}: the batch cut into {ex['P']} pieces, documents whole but at the cuts",
                     loc="left")  # fmt: skip
        ax.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=MASK_COLORS[name], label=name) for name in shown]
    fig.legend(handles=handles, loc="outside lower center", ncols=n)
    fig.suptitle(f"Bytes the busiest rank sends in one forward + backward, read from the trace\n"
                 f"(bf16, {ex['cu'][-1]} tokens, Hq = {ex['q'].shape[1]}, Hkv = {ex['k'].shape[1]}, "
                 f"D = Dv = {ex['q'].shape[2]}, P = {ex['P']})")
    return fig


FIGURES = {
    "figures/learn/mask_kinds.png": kinds,
    "figures/learn/mask_slices.png": slices,
    "figures/learn/mask_balance.png": balance,
    "figures/learn/mask_traffic.png": traffic,
}
