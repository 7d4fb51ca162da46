"""Figures of the docs, drawn at build time from cpref itself so that they cannot drift.

Every function takes no input, computes what it draws with cpref's public API (a batch's
`cpref.Sharding`: its `global_index`, `local_chunks` and `attention_work`; and
`get_thd_load_balanced_cp_metadata`) and returns a matplotlib `Figure`; `docs/gen_pages.py`
saves it as PNG into the site.

Readable at the column width: the site's content column is about `COLUMN_PX` CSS pixels wide
at a 1280 px window (`make docs-check` screenshots it), and a figure wider than that is scaled
down to fit. Every figure is `WIDTH` inches wide, so one point of font size in the figure is
about one point on screen; `check_readable` fails the build if any text would show below
`MIN_PT`, or if any panel has no data drawn (`check_drawn`: an empty or hidden panel of a grid
leaves a blank hole on the page; `panel_grid` centres an odd last panel instead).
"""

from __future__ import annotations

import functools

import matplotlib

matplotlib.use("Agg")  # no display: figures are only ever saved

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import cpref  # noqa: E402

COLUMN_PX = 688  # content column at a 1280 px window (material: 61rem grid, two 12.1rem sidebars)
DPI = 130  # saved resolution: sharper than the screen, scaled down by the browser
WIDTH = 7.0  # inches: every figure
MIN_PT = 10.0  # smallest text size on screen
FONT = 10.5  # default text size in the figure, in points

plt.rcParams.update({"font.size": FONT, "axes.titlesize": FONT, "legend.fontsize": FONT,
                     "xtick.labelsize": FONT, "ytick.labelsize": FONT, "figure.titlesize": FONT + 1})

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


def sharding(cu: list[int], cp_size: int, layout: str) -> cpref.Sharding:
    """A figure's batch as cpref shards it: one `cpref.Sharding` per batch, `P` and layout, built once."""
    return _sharding(tuple(cu), cp_size, layout)


@functools.cache
def _sharding(cu: tuple[int, ...], cp_size: int, layout: str) -> cpref.Sharding:
    return cpref.Sharding(list(cu), cp_size=cp_size, layout=layout)


def display_pt(fig: Figure, fontsize: float) -> float:
    """A font size of `fig`, in points as shown in the content column (96 CSS px per inch)."""
    natural_px = fig.get_figwidth() * DPI
    scale = min(1.0, COLUMN_PX / natural_px)  # the browser shrinks a wider image to the column
    return fontsize * DPI / 72 * scale * 72 / 96


def check_readable(fig: Figure, name: str) -> None:
    """Raise if any visible text of `fig` would show below MIN_PT at the column width, or if a panel is empty
    (`check_drawn`): what `docs/gen_pages.py` checks of every figure before it saves it."""
    check_drawn(fig, name)
    fig.canvas.draw()  # tick labels exist only once drawn
    small = {
        t.get_text(): round(display_pt(fig, t.get_fontsize()), 1)
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and display_pt(fig, t.get_fontsize()) < MIN_PT
    }
    if small:
        raise RuntimeError(f"{name}: text below {MIN_PT} pt at the column width (shown size in pt): {small}")
    check_inside(fig, name)


def check_inside(fig: Figure, name: str) -> None:
    """Raise if any visible text of `fig` reaches past its canvas: the saved image would cut it (a subtitle clipped
    on both sides, a label with its first letters gone). Call after `fig.canvas.draw()`."""
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    cut = [t.get_text()[:40] for t in _drawn_texts(fig) for e in [t.get_window_extent(renderer)]
           if e.x0 < box.x0 - 1 or e.x1 > box.x1 + 1 or e.y0 < box.y0 - 1 or e.y1 > box.y1 + 1]  # fmt: skip
    if cut:
        raise RuntimeError(f"{name}: text past the figure's edge, cut in the saved image: {cut}; shorten it, wrap it "
                           "or widen the figure")  # fmt: skip


def _drawn_texts(fig: Figure) -> list[Text]:
    """The visible, non-empty texts `fig` draws: a tick label only where its tick is inside the axis' view (the
    others exist but are not drawn)."""
    ticks = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis) if ax.axison else ():  # axis("off"): no tick label is drawn
            ticks |= {label for tick in axis._update_ticks() for label in (tick.label1, tick.label2)} if axis.get_visible() else set()
    every_tick = {label for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
                  for tick in axis.get_major_ticks() + axis.get_minor_ticks() for label in (tick.label1, tick.label2)}  # fmt: skip
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and (t in ticks or t not in every_tick)]


def check_drawn(fig: Figure, name: str) -> None:
    """Raise if any axes of `fig` has no data drawn (no line, patch, image, collection or table) or is hidden:
    either shows as a blank panel, a hole in the figure."""
    empty = [f"axes {i} ({ax.get_title(loc='left') or ax.get_title() or 'untitled'!r})"
             for i, ax in enumerate(fig.axes)
             if not ax.get_visible() or not (ax.lines or ax.patches or ax.images or ax.collections or ax.tables)]
    if empty:
        raise RuntimeError(f"{name}: {len(empty)} panel(s) with no data drawn (empty or hidden): {', '.join(empty)}; "
                           "make only as many panels as there is data for (panel_grid centres an odd last one)")


def panel_grid(fig: Figure, n: int, cols: int = 2, **gridspec) -> list:
    """`n` axes on `fig`, `cols` a row, the last row's fewer panels centred: no empty panel fills the row."""
    grid = fig.add_gridspec(-(-n // cols), 2 * cols, **gridspec)  # each panel two half-columns wide
    axes = []
    for i in range(n):
        row, col = divmod(i, cols)
        offset = cols - min(cols, n - row * cols)  # half-columns left free on each side of a short last row
        axes.append(fig.add_subplot(grid[row, offset + 2 * col : offset + 2 * col + 2]))
    return axes


def owner_of_tokens(cu: list[int], cp_size: int, layout: str) -> list[int]:
    """`owner[t]`: the rank that holds global token `t` (from `Sharding.global_index`)."""
    if layout == "striped":  # not a cpref layout: token t on rank t mod P, for comparison only
        return [t % cp_size for t in range(cu[-1])]
    owner, batch = [-1] * cu[-1], sharding(cu, cp_size, layout)
    for r in range(cp_size):
        for t in batch.global_index(r).tolist():
            owner[t] = r
    assert -1 not in owner, "every token has exactly one owner"
    return owner


def _rank_legend(fig: Figure, cp_size: int, label: str = "rank {r}") -> None:
    handles = [Patch(color=rank_color(r), label=label.format(r=r)) for r in range(cp_size)]
    fig.legend(handles=handles, loc="outside lower center", ncols=cp_size, frameon=False)


def _draw_stream(ax, cu: list[int], cp_size: int, layout: str) -> None:
    """One layout: the token stream as a bar, each chunk coloured by its owner rank."""
    owner = owner_of_tokens(cu, cp_size, layout)
    for t, r in enumerate(owner):
        ax.add_patch(Rectangle((t, 0), 1, 1, facecolor=rank_color(r), edgecolor=rank_color(r), linewidth=0.5))
    # Chunk numbers: chunk j of document i, as rank r holds it (Sharding.local_chunks); stream: the rank's pieces.
    for r in range(cp_size):
        for doc, start, end in sharding(cu, cp_size, layout).local_chunks(r):
            c = end - start
            label = str(r) if layout not in cpref.batch.layout.CHUNKED_LAYOUTS else str((start - cu[doc]) // c)
            ax.add_patch(Rectangle((start, 0), c, 1, fill=False, edgecolor="0.25", linewidth=0.8))
            ax.text((start + end) / 2, 0.5, label, ha="center", va="center", color="white", fontweight="bold")
    # Document boundaries and names.
    for i in range(len(cu) - 1):
        ax.axvline(cu[i], color="black", linewidth=2.5)
        ax.text((cu[i] + cu[i + 1]) / 2, 1.12, f"doc {i}: {cu[i + 1] - cu[i]}", ha="center", va="bottom")
    ax.axvline(cu[-1], color="black", linewidth=2.5)
    if layout == "stream":
        ax.set_title(f"stream: the batch in {cp_size} equal pieces, cut at document boundaries (number: rank)", loc="left")
    elif layout == "balanced":
        ax.set_title("balanced: whole documents, the heaviest cut in symmetric pairs (number: rank)", loc="left")
    else:
        mult = cpref.batch.layout.layout_multiple(layout, cp_size)
        ax.set_title(f"{layout}: every document in {mult} chunks (number: chunk j)", loc="left")
    ax.set_xlim(-0.5, cu[-1] + 0.5)
    ax.set_ylim(-0.1, 1.7)
    ax.set_yticks([])
    ax.set_xticks(cu)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)


def layouts() -> Figure:
    """`figures/layouts.png`: which rank holds which chunk, in every layout."""
    fig, axes = plt.subplots(len(cpref.LAYOUTS), 1, figsize=(WIDTH, 1.95 * len(cpref.LAYOUTS)), constrained_layout=True)
    for ax, layout in zip(axes, cpref.LAYOUTS):
        _draw_stream(ax, LAYOUT_CU, LAYOUT_P, layout)
    axes[-1].set_xlabel("global token index (doc i: its length in tokens)")
    _rank_legend(fig, LAYOUT_P)
    fig.suptitle(f"cu_seqlens = {LAYOUT_CU}, P = {LAYOUT_P}")
    return fig


def work() -> Figure:
    """`figures/work.png`: causal attention work per rank under both metrics, contiguous vs zigzag."""
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.6), sharey=True, constrained_layout=True)
    width = 0.8 / len(cpref.LAYOUTS)
    metrics = [("block metric: sum(q_len * kv_len)", False), ("exact count of visible scores", True)]
    for ax, (title, exact) in zip(axes, metrics):
        for k, (layout, hatch) in enumerate(zip(cpref.LAYOUTS, ("", "//", "..", "xx"), strict=True)):
            batch = sharding(LAYOUT_CU, LAYOUT_P, layout)
            w = [batch.attention_work(r, exact=exact) for r in range(LAYOUT_P)]
            xs = [r + (k - (len(cpref.LAYOUTS) - 1) / 2) * width for r in range(LAYOUT_P)]
            bars = ax.bar(xs, w, width, color=[rank_color(r) for r in range(LAYOUT_P)], hatch=hatch,
                          edgecolor="0.2", label=f"{layout}: max/mean {max(w) / (sum(w) / len(w)):.2f}")
            ax.bar_label(bars, rotation=90, padding=2)
        ax.set_xticks(range(LAYOUT_P), [f"rank {r}" for r in range(LAYOUT_P)])
        ax.set_title(title)
        ax.legend(frameon=False, loc="upper left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("scores per head")
    axes[0].set_ylim(0, 1.6 * axes[0].get_ylim()[1])  # room for the legend above the bars
    fig.suptitle(f"causal attention work per rank, cu_seqlens = {LAYOUT_CU}, P = {LAYOUT_P}")
    return fig


def _long_tail(n: int = 24, seed: int = 0) -> list[int]:
    """`n` document lengths drawn lognormal (median about 55 tokens, a heavy tail), between 4 and 1000."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randn(n, generator=g).mul(1.1).add(4.0).exp().round().clamp(4, 1000)]


def _owner_bar(ax, batch: cpref.Sharding, title: str) -> None:
    """The padded stream as a bar, each token in its owner's colour (padding hatched), documents as black lines."""
    owner = torch.full((batch.total,), -1)
    for r in range(batch.cp_size):
        owner[batch.global_index(r)] = r
    image = torch.tensor([rank_color(int(r)) for r in owner])[None]  # (1, T, 3)
    ax.imshow(image.numpy(), aspect="auto", interpolation="nearest", extent=(0, batch.total, 0, 1))
    for i, (a, z) in enumerate(zip(batch.cu_seqlens_padded, batch.cu_seqlens_padded[1:])):
        ax.axvline(a, color="black", linewidth=0.8)
        real = a + batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]
        if z > real:
            ax.add_patch(Rectangle((real, 0), z - real, 1, fill=False, hatch="////", edgecolor="white", linewidth=0))
    ax.set_yticks([])
    ax.set_title(title, loc="left")


def balanced() -> Figure:
    """`figures/balanced.png`: zigzag against balanced on a long-tailed pack: who holds what, and the work."""
    lengths, P = _long_tail(), 4
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 5.6), constrained_layout=True, gridspec_kw={"height_ratios": [1, 1, 2.2]})
    work = {}
    for ax, layout in zip(axes, ("zigzag", "balanced")):
        batch = cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout)
        pad = batch.total - cu[-1]
        _owner_bar(ax, batch, f"{layout}: {batch.total} tokens, {pad} of them padding (hatched)")
        work[layout] = [batch.attention_work(r, exact=True) for r in range(P)]
    axes[1].set_xlabel("token of the padded stream (black lines: documents)")
    width = 0.4
    for k, (layout, hatch) in enumerate(zip(work, ("//", ""))):
        w = work[layout]
        axes[2].bar([r + (k - 0.5) * width for r in range(P)], w, width, color=[rank_color(r) for r in range(P)],
                    hatch=hatch, edgecolor="0.2", label=f"{layout}: max/mean {max(w) / (sum(w) / len(w)):.3f}")  # fmt: skip
    axes[2].set_xticks(range(P), [f"rank {r}" for r in range(P)])
    axes[2].set_ylabel("causal scores per head")
    axes[2].set_ylim(0, 1.35 * max(max(w) for w in work.values()))
    axes[2].legend(frameon=False, loc="upper left", ncols=2)
    axes[2].spines[["top", "right"]].set_visible(False)
    fig.suptitle(f"{len(lengths)} documents of {min(lengths)} to {max(lengths)} tokens (lognormal), P = {P}")
    return fig


def _max_over_mean(work: list) -> str:
    """The slowest rank's work over the mean, or "-" where there is no value."""
    if "-" in work:
        return "-"
    return f"{max(work) / (sum(work) / len(work)):.2f}"


def _mask_panel(ax, cu: list[int], cp_size: int, layout: str) -> None:
    """The T x T causal mask with EOD reset, each visible score in the colour of its query's rank."""
    T, owner = cu[-1], owner_of_tokens(cu, cp_size, layout)
    doc = [i for i in range(len(cu) - 1) for _ in range(cu[i], cu[i + 1])]
    image = [[(1.0, 1.0, 1.0)] * T for _ in range(T)]
    exact = [0] * cp_size  # visible scores per rank, counted from the mask itself
    for i in range(T):  # query row
        for j in range(i + 1):  # key column, causal: j <= i
            if doc[j] == doc[i]:
                image[i][j] = rank_color(owner[i])
                exact[owner[i]] += 1
    ax.imshow(image, interpolation="nearest", extent=(0, T, T, 0))
    for b in cu[1:-1]:  # document boundaries
        ax.axhline(b, color="black", linewidth=1.2)
        ax.axvline(b, color="black", linewidth=1.2)
    ax.set_xticks(cu)
    ax.set_yticks(cu)
    ax.xaxis.tick_top()  # keys on top: the work table goes below
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("key token")
    ax.set_title(layout if layout != "striped" else "striped (comparison)")

    # Per-rank work: the exact count, from the mask (cpref's own count is checked against such a
    # count by tests/cpref/test_layout.py), and cpref's block metric.
    if layout == "striped":
        block = ["-"] * cp_size  # cpref's block metric is defined for its chunked layouts only
    else:
        block = [sharding(cu, cp_size, layout).attention_work(r) for r in range(cp_size)]
    rows = [f"{'rank':>8} {'exact':>5} {'block':>5}"]
    rows += [f"{r:>8} {exact[r]:>5} {block[r]:>5}" for r in range(cp_size)]
    rows.append(f"{'max/mean':>8} {_max_over_mean(exact):>5} {_max_over_mean(block):>5}")
    ax.text(0.5, -0.04, "\n".join(rows), transform=ax.transAxes, ha="center", va="top", family="monospace")


def attention_mask() -> Figure:
    """`figures/attention_mask.png`: who computes which score, contiguous vs zigzag vs striped."""
    layouts_drawn = [*cpref.LAYOUTS, "striped"]
    rows = -(-len(layouts_drawn) // 2)  # two panels a row, each with its work table below; an odd last one centred
    fig = plt.figure(figsize=(WIDTH, 5.0 * rows), constrained_layout=True)
    axes = panel_grid(fig, len(layouts_drawn))
    for ax, layout in zip(axes, layouts_drawn):
        _mask_panel(ax, LAYOUT_CU, LAYOUT_P, layout)
        ax.set_ylabel("query token")
    _rank_legend(fig, LAYOUT_P)
    fig.suptitle(f"causal mask with EOD reset, cu_seqlens = {LAYOUT_CU}, P = {LAYOUT_P}:\n"
                 "each score in the colour of the rank that computes it; work in scores per head")
    return fig


def rank_major_index() -> Figure:
    """`figures/rank_major_index.png`: the rank-major K/V buffer and the rows `kv_index` selects."""
    cu, P, layout = INDEX_CU, INDEX_P, "zigzag"
    batch = sharding(cu, P, layout)
    # Row k of the gathered buffer holds global token `rows[k]`, owned by rank `owner[k]`.
    rows = [t for r in range(P) for t in batch.global_index(r).tolist()]
    owner = [r for r in range(P) for _ in range(cu[-1] // P)]
    doc_of = {t: i for i in range(len(cu) - 1) for t in range(cu[i], cu[i + 1])}
    n = len(rows)

    fig, axes = plt.subplots(1, P + 1, figsize=(WIDTH, 0.3 * n + 2.4), sharey=True,
                             gridspec_kw={"width_ratios": [1.6] + [2] * P}, constrained_layout=True)

    # Panel 0: the buffer itself.
    ax = axes[0]
    for k, (t, r) in enumerate(zip(rows, owner)):
        ax.add_patch(Rectangle((0, k), 1, 1, facecolor=rank_color(r), edgecolor="white"))
        ax.text(0.5, k + 0.5, f"token {t} (doc {doc_of[t]})", ha="center", va="center", color="white")
    ax.set_xlim(0, 1)
    ax.set_xticks([])
    ax.set_yticks([k + 0.5 for k in range(n)], [f"row {k}" for k in range(n)])
    ax.set_title("K/V after all_gather\n(rank-major)")

    # Panels 1..P: for each local query chunk of rank r, the rows kv_index selects, numbered
    # by their position in the chunk's key sequence (natural order 0, 1, 2, ...).
    for r in range(P):
        ax = axes[r + 1]
        meta = cpref.get_thd_load_balanced_cp_metadata(cu, P, r, layout=layout)
        kv_index = meta["kv_index"].tolist()
        cu_kv = meta["seqs"].cu_kv
        chunks = batch.local_chunks(r)
        assert len(chunks) == len(meta["actual_seq_qlen"]), "one kv sequence per local query chunk"
        for col in range(len(chunks)):
            for pos, row in enumerate(kv_index[cu_kv[col] : cu_kv[col + 1]]):
                ax.add_patch(Rectangle((col, row), 1, 1, facecolor=rank_color(owner[row]), edgecolor="white"))
                ax.text(col + 0.5, row + 0.5, str(pos), ha="center", va="center", color="white")
        labels = [f"doc {d}\nch {(s - cu[d]) // (e - s)}\n{s}-{e - 1}" for d, s, e in chunks]
        ax.set_xticks([c + 0.5 for c in range(len(chunks))], labels)
        ax.set_xlim(0, len(chunks))
        for c in range(1, len(chunks)):  # one column per local query chunk
            ax.axvline(c, color="0.8", linewidth=0.8)
        ax.set_title(f"rank {r}: the rows\nits kv_index picks")
        ax.set_xlabel("its query chunks")
        ax.tick_params(axis="x", length=0)

    for ax in axes:
        ax.set_ylim(n, 0)  # row 0 at the top
        for k in range(1, P):  # the boundary between ranks' blocks of the buffer
            ax.axhline(k * n // P, color="black", linewidth=2)
    _rank_legend(fig, P, "owned by rank {r}")
    fig.suptitle(f"KV all-gather, zigzag, cu_seqlens = {cu}, P = {P}\n"
                 "(number in a cell: its position in the query chunk's keys)")
    return fig


def occurrence_layers() -> Figure:
    """`figures/occurrence_layers.png`: rank 0's `kv_index` of the rank-major figure, each entry coloured by its
    occurrence layer (`cpref.base.determinism`): one `index_add_` per layer, no row twice in one."""
    from cpref.base.determinism import occurrence_layers as layers_of

    meta = cpref.get_thd_load_balanced_cp_metadata(INDEX_CU, INDEX_P, 0, layout="zigzag")
    index = meta["kv_index"]
    layers = layers_of(index)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), constrained_layout=True)
    colors = plt.get_cmap("Set2").colors
    for j, positions in enumerate(layers):
        for p in positions.tolist():
            ax.add_patch(Rectangle((p, int(index[p])), 1, 1, facecolor=colors[j], edgecolor="white"))
    cu_kv = meta["seqs"].cu_kv
    for c in cu_kv[1:-1]:  # one key sequence per local query chunk
        ax.axvline(c, color="0.5", linewidth=0.8)
    ax.set_xlim(0, len(index))
    ax.set_ylim(INDEX_CU[-1], 0)
    ax.set_xlabel("entry of kv_index (the selected keys, one query chunk's after another)")
    ax.set_ylabel("row of the rank-major buffer")
    ax.legend(handles=[Patch(facecolor=colors[j], label=f"layer {j}: {len(x)} entries, one index_add_")
                       for j, x in enumerate(layers)], loc="lower left")  # fmt: skip
    ax.set_title(f"Rank 0's dK/dV row sums, zigzag, cu_seqlens = {INDEX_CU}, P = {INDEX_P}: a row read by both\n"
                 "query chunks is added once in layer 0 and once in layer 1, never twice in one call")
    return fig


# path inside the site -> function drawing it
FIGURES = {
    "figures/layouts.png": layouts,
    "figures/work.png": work,
    "figures/balanced.png": balanced,
    "figures/attention_mask.png": attention_mask,
    "figures/rank_major_index.png": rank_major_index,
    "figures/occurrence_layers.png": occurrence_layers,
}
