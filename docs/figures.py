"""Figures of the docs, drawn at build time from cpref itself so that they cannot drift.

Every function takes no input, computes what it draws with cpref's public functions
(`global_index`, `local_chunks`, `attention_work`, `get_thd_load_balanced_cp_metadata`) and
returns a matplotlib `Figure`; `docs/gen_pages.py` saves it as PNG into the site.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display: figures are only ever saved

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

import cpref  # noqa: E402

# One small packed batch for the layout figures: 3 documents of 16, 24 and 8 tokens, P = 4.
# Every length is a multiple of 2P = 8, so both layouts can split it.
LAYOUT_CU = [0, 16, 40, 48]
LAYOUT_P = 4

# The rank-major indexing figure: 2 documents of 8 and 16 tokens, P = 2, zigzag.
INDEX_CU = [0, 8, 24]
INDEX_P = 2

RANK_COLORS = plt.get_cmap("tab10").colors


def rank_color(rank: int):
    return RANK_COLORS[rank % len(RANK_COLORS)]


def owner_of_tokens(cu: list[int], cp_size: int, layout: str) -> list[int]:
    """`owner[t]`: the rank that holds global token `t` (from `cpref.global_index`)."""
    owner = [-1] * cu[-1]
    for r in range(cp_size):
        for t in cpref.global_index(cu, cp_size=cp_size, rank=r, layout=layout).tolist():
            owner[t] = r
    assert -1 not in owner, "every token has exactly one owner"
    return owner


def _draw_stream(ax, cu: list[int], cp_size: int, layout: str) -> None:
    """One layout: the token stream as a bar, each chunk coloured by its owner rank."""
    owner = owner_of_tokens(cu, cp_size, layout)
    for t, r in enumerate(owner):
        ax.add_patch(Rectangle((t, 0), 1, 1, facecolor=rank_color(r), edgecolor=rank_color(r), linewidth=0.5))
    # Chunk numbers: chunk j of document i, as rank r holds it (cpref.local_chunks).
    for r in range(cp_size):
        for doc, start, end in cpref.local_chunks(cu, cp_size=cp_size, rank=r, layout=layout):
            c = end - start
            j = (start - cu[doc]) // c
            ax.add_patch(Rectangle((start, 0), c, 1, fill=False, edgecolor="0.25", linewidth=0.8))
            ax.text((start + end) / 2, 0.5, str(j), ha="center", va="center", fontsize=8, color="white",
                    fontweight="bold")
    # Document boundaries and names.
    for i in range(len(cu) - 1):
        ax.axvline(cu[i], color="black", linewidth=2.5)
        ax.text((cu[i] + cu[i + 1]) / 2, 1.15, f"doc {i} ({cu[i + 1] - cu[i]} tokens)", ha="center",
                va="bottom", fontsize=9)
    ax.axvline(cu[-1], color="black", linewidth=2.5)
    mult = cpref.layout.layout_multiple(layout, cp_size)
    ax.set_title(f"{layout}: every document in {mult} chunks (numbers: chunk j)", fontsize=10, loc="left")
    ax.set_xlim(-0.5, cu[-1] + 0.5)
    ax.set_ylim(-0.1, 1.6)
    ax.set_yticks([])
    ax.set_xticks(cu)
    ax.set_xlabel("global token index")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)


def layouts() -> Figure:
    """`figures/layouts.png`: which rank holds which chunk, contiguous vs zigzag."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), constrained_layout=True)
    for ax, layout in zip(axes, cpref.LAYOUTS):
        _draw_stream(ax, LAYOUT_CU, LAYOUT_P, layout)
    handles = [Patch(color=rank_color(r), label=f"rank {r}") for r in range(LAYOUT_P)]
    fig.legend(handles=handles, loc="outside right center", frameon=False)
    fig.suptitle(f"cu_seqlens = {LAYOUT_CU}, P = {LAYOUT_P}", fontsize=11)
    return fig


def work() -> Figure:
    """`figures/work.png`: causal attention work per rank, contiguous vs zigzag."""
    fig, ax = plt.subplots(figsize=(7, 3.4), constrained_layout=True)
    width = 0.38
    for k, (layout, hatch) in enumerate(zip(cpref.LAYOUTS, ("", "//"))):
        w = [cpref.attention_work(LAYOUT_CU, cp_size=LAYOUT_P, rank=r, layout=layout) for r in range(LAYOUT_P)]
        xs = [r + (k - 0.5) * width for r in range(LAYOUT_P)]
        bars = ax.bar(xs, w, width, color=[rank_color(r) for r in range(LAYOUT_P)], hatch=hatch,
                      edgecolor="0.2", label=f"{layout} (max/mean = {max(w) / (sum(w) / len(w)):.2f})")
        ax.bar_label(bars, fontsize=8)
    ax.set_xticks(range(LAYOUT_P), [f"rank {r}" for r in range(LAYOUT_P)])
    ax.set_ylabel("work: sum(q_len * kv_len)")
    ax.set_title(f"causal attention work per rank, cu_seqlens = {LAYOUT_CU}, P = {LAYOUT_P}", fontsize=10)
    ax.legend(frameon=False, fontsize=9, loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def rank_major_index() -> Figure:
    """`figures/rank_major_index.png`: the rank-major K/V buffer and the rows `kv_index` selects."""
    cu, P, layout = INDEX_CU, INDEX_P, "zigzag"
    # Row k of the gathered buffer holds global token `rows[k]`, owned by rank `owner[k]`.
    rows = [t for r in range(P) for t in cpref.global_index(cu, cp_size=P, rank=r, layout=layout).tolist()]
    owner = [r for r in range(P) for _ in range(cu[-1] // P)]
    doc_of = {t: i for i in range(len(cu) - 1) for t in range(cu[i], cu[i + 1])}
    n = len(rows)

    fig, axes = plt.subplots(1, P + 1, figsize=(3.2 + 3.2 * P, 0.28 * n + 2.2), sharey=True,
                             gridspec_kw={"width_ratios": [1.2] + [2] * P}, constrained_layout=True)

    # Panel 0: the buffer itself.
    ax = axes[0]
    for k, (t, r) in enumerate(zip(rows, owner)):
        ax.add_patch(Rectangle((0, k), 1, 1, facecolor=rank_color(r), edgecolor="white"))
        ax.text(0.5, k + 0.5, f"token {t} (doc {doc_of[t]})", ha="center", va="center", fontsize=8, color="white")
    ax.set_xlim(0, 1)
    ax.set_xticks([])
    ax.set_yticks([k + 0.5 for k in range(n)], [f"row {k}" for k in range(n)], fontsize=8)
    ax.set_title("K/V after all_gather\n(rank-major)", fontsize=10)

    # Panels 1..P: for each local query chunk of rank r, the rows kv_index selects, numbered
    # by their position in the chunk's key sequence (natural order 0, 1, 2, ...).
    for r in range(P):
        ax = axes[r + 1]
        meta = cpref.get_thd_load_balanced_cp_metadata(cu, P, r, layout=layout)
        kv_index = meta["kv_index"].tolist()
        cu_kv = meta["seqs"].cu_kv
        chunks = cpref.local_chunks(cu, cp_size=P, rank=r, layout=layout)
        assert len(chunks) == len(meta["actual_seq_qlen"]), "one kv sequence per local query chunk"
        for col, (doc, start, end) in enumerate(chunks):
            for pos, row in enumerate(kv_index[cu_kv[col] : cu_kv[col + 1]]):
                ax.add_patch(Rectangle((col, row), 1, 1, facecolor=rank_color(owner[row]), edgecolor="white"))
                ax.text(col + 0.5, row + 0.5, str(pos), ha="center", va="center", fontsize=8, color="white")
        labels = [f"doc {d}\nchunk {(s - cu[d]) // (e - s)}\nq: tokens\n{s}-{e - 1}" for d, s, e in chunks]
        ax.set_xticks([c + 0.5 for c in range(len(chunks))], labels, fontsize=8)
        ax.set_xlim(0, len(chunks))
        for c in range(1, len(chunks)):  # one column per local query chunk
            ax.axvline(c, color="0.8", linewidth=0.8)
        ax.set_title(f"rank {r}: rows its kv_index picks\n(number: position in the chunk's keys)", fontsize=10)
        ax.tick_params(axis="x", length=0)

    for ax in axes:
        ax.set_ylim(n, 0)  # row 0 at the top
        for k in range(1, P):  # the boundary between ranks' blocks of the buffer
            ax.axhline(k * n // P, color="black", linewidth=2)
    handles = [Patch(color=rank_color(r), label=f"owned by rank {r}") for r in range(P)]
    fig.legend(handles=handles, loc="outside lower center", ncols=P, frameon=False)
    fig.suptitle(f"KV all-gather, zigzag, cu_seqlens = {cu}, P = {P}", fontsize=11)
    return fig


# path inside the site -> function drawing it
FIGURES = {
    "figures/layouts.png": layouts,
    "figures/work.png": work,
    "figures/rank_major_index.png": rank_major_index,
}
