"""The Learn path's first figures (pages 1 to 4: the problem, collectives, the merge, all-gather), drawn from real runs.

Each function runs cpref on the simulated cluster (`docs/learn_runs.py`), or the page's own example
(`example`), and draws what the run did; `docs/learn_figures.py` registers them.
"""

from __future__ import annotations

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from docs import figures as base
from docs.learn_runs import example, ops_text, run, split_trace

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color
FAINT = 0.22  # alpha of what is held but not used


# ---------------------------------------------------------------------------------------------------------------
# 1. The problem: a split sequence needs keys from other ranks.


def _mask_by_key_owner(ax: Axes, owner: list[int], visible) -> tuple[int, int]:
    """The causal mask, each visible score in the colour of the rank holding its key: faint where that is the
    query's own rank, full where the key must come from another. Returns `(local, remote)` score counts."""
    T = len(owner)
    image, counts = torch.ones(T, T, 3), [0, 0]
    for x in range(T):
        for y in range(T):
            if visible(x, y):
                remote = owner[y] != owner[x]
                counts[remote] += 1
                color = torch.tensor(rank_color(owner[y]))
                image[x, y] = color if remote else 1 - FAINT * 1.6 * (1 - color)
    ax.imshow(image.numpy(), interpolation="nearest", extent=(0, T, T, 0))
    bounds = [t for t in range(1, T) if owner[t] != owner[t - 1]]
    for b in bounds:
        ax.axhline(b, color="0.3", linewidth=0.8)
        ax.axvline(b, color="0.3", linewidth=0.8)
    return counts[0], counts[1]


def problem() -> Figure:
    """`figures/learn/problem.png`: which scores need a key from another rank, and what attending alone gets wrong
    (the page's example's errors, from the run that printed them)."""
    g = example("problem")  # the page's example: its sizes
    T, P, H, D = g["T"], g["P"], g["H"], g["D"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.9), constrained_layout=True, width_ratios=[1.1, 1])
    r = run("all_gather", [0, T], P, "contiguous", (H, H, D, D))
    owner = r.owner()
    local, remote = _mask_by_key_owner(left, owner, r.visible)
    c = T // P
    left.set_xticks([c * (j + 0.5) for j in range(P)], [f"r{j}" for j in range(P)])
    left.set_yticks([c * (j + 0.5) for j in range(P)], [f"r{j}" for j in range(P)])
    left.set_xlabel("keys, by the rank holding them")
    left.set_anchor("S")  # the square image on its slot's bottom: the layout's first pass leaves its xlabel room
    left.set_ylabel("queries, by rank")
    left.set_title(f"{remote} of {local + remote} scores need a key\nfrom another rank (full colour)", loc="left")
    alone, with_cp = g["errors"]["alone"], g["errors"]["with CP"]  # what the example printed
    floor = 1e-17  # an exact answer, drawn at the bottom of the log scale
    xs = list(range(P))
    right.semilogy(xs, [max(e, floor) for e in alone], "o", color="0.3", markersize=8, label="alone: own keys only")
    right.semilogy(xs, [max(e, floor) for e in with_cp], "s", color=rank_color(2), markersize=8, label="with CP (all_gather)")
    right.set_xticks(xs, [f"rank {j}" for j in xs])
    right.set_ylim(floor / 3, 1e2)
    right.set_ylabel("largest error vs FP64")
    right.set_title("each rank's output, float64", loc="left")
    right.legend(frameon=False, loc="center right")
    right.spines[["top", "right"]].set_visible(False)
    fig.suptitle(f"Causal attention over one document of {T} tokens, split over P = {P} ranks (contiguous)")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 2. Collectives: what each moves, from a run of all four on 4 ranks.

def _collectives_run():
    """The page's example, run once: `({rank: {op: (its input, what it got)}}, P, the trace)`."""
    g = example("collectives")
    x_or_c = {"all_gather": 0, "send_recv": 0, "reduce_scatter": 1, "all_to_all": 1}  # which input each op takes
    results = {r: {op: (g["inputs"](r)[x_or_c[op]], got) for op, got in g["results"][r].items()} for r in range(g["P"])}
    return results, g["P"], g["cluster"].trace


def _box(ax: Axes, x: float, y: float, origin: int, label: str, summed: int = 0) -> None:
    """A chunk of data at (x, y) in the colour of the rank it came from (or, `summed` ranks', in their stripes)."""
    width = 1.5 if summed else 0.9
    if summed:
        for s in range(summed):
            w = width / summed
            ax.add_patch(Rectangle((x + s * w, y + 0.1), w, 0.8, facecolor=rank_color(s), edgecolor="none"))
    else:
        ax.add_patch(Rectangle((x, y + 0.1), width, 0.8, facecolor=rank_color(origin), edgecolor="none"))
    ax.text(x + width / 2, y + 0.5, label, ha="center", va="center", color="white", fontweight="bold")


def collectives() -> Figure:
    """`figures/learn/collectives.png`: the four collectives on 4 ranks, each rank's data before and after."""
    results, P, trace = _collectives_run()
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 5.4), constrained_layout=True)
    for ax, event in zip(axes.flat, trace):
        op = event.op
        for r in range(P):
            before, after = (t.tolist() for t in results[r][op])
            if op in ("all_gather", "send_recv"):  # one x per rank: x of rank r is [r, r]
                _box(ax, 0, r, int(before[0]), "x")
                for s, value in enumerate(after[:: len(before)]):
                    _box(ax, P + 1 + s, r, int(value), "x")
            else:  # chunk j of rank r's c is 10 r + j
                for j, value in enumerate(before):
                    _box(ax, j, r, int(value) // 10, f"c{j}")
                if op == "reduce_scatter":
                    _box(ax, P + 1, r, -1, f"Σc{r}", summed=P)
                else:
                    for s, value in enumerate(after):
                        _box(ax, P + 1 + s, r, int(value) // 10, f"c{int(value) % 10}")
        ax.annotate("", xy=(P + 0.85, P / 2), xytext=(P - 0.1 if op in ("reduce_scatter", "all_to_all") else 1.05, P / 2),
                    arrowprops={"arrowstyle": "-|>", "color": "0.4"})  # fmt: skip
        ax.set_xlim(-0.1, 2 * P + 1)
        ax.set_ylim(P, -0.5)
        ax.text(0, -0.2, "before", va="bottom")
        ax.text(P + 1, -0.2, "after", va="bottom")
        ax.set_yticks([r + 0.5 for r in range(P)], [f"rank {r}" for r in range(P)])
        ax.set_xticks([])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"{op}: {event.bytes_sent[0]} B sent per rank", loc="left")
    fig.suptitle(f"The four collectives on P = {P} ranks, run on the simulated cluster\n"
                 "(colour: the rank the data came from; c0..c3: the chunks of a rank's input)")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 3. The merge: two partial softmaxes, reweighted by their lse, are the whole row's.


def merge() -> Figure:
    """`figures/learn/merge.png`: query 0 of the merge example: each half's softmax, then both reweighted."""
    ns = example("merge")
    q, k, scale, Tk = ns["q"], ns["k"], ns["scale"], ns["Tk"]
    half = Tk // 2
    _, lse = ns["attend"](slice(0, Tk))  # the whole row, one kernel call
    (_, lse_a), (_, lse_b) = ns["attend"](slice(0, half)), ns["attend"](slice(half, Tk))
    s = scale * (k[:, 0] @ q[0, 0])  # (Tk,): query 0's scores, head 0
    la, lb, whole = lse_a[0, 0], lse_b[0, 0], lse[0, 0]
    merged = torch.logaddexp(la, lb)
    p_a, p_b, p = (s[:half] - la).exp(), (s[half:] - lb).exp(), (s - whole).exp()  # each block's softmax; the row's
    w_a, w_b = (la - merged).exp(), (lb - merged).exp()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 5.0), constrained_layout=True, sharex=True)
    xs_a, xs_b = list(range(half)), list(range(half, Tk))
    top.bar(xs_a, p_a.tolist(), color=rank_color(0), label=f"block a: keys 0-{half - 1}, lse_a = {la:.3f}")
    top.bar(xs_b, p_b.tolist(), color=rank_color(1), label=f"block b: keys {half}-{Tk - 1}, lse_b = {lb:.3f}")
    top.set_title("each block's own softmax (each sums to 1), from its own kernel call", loc="left")
    bottom.bar(xs_a, (w_a * p_a).tolist(), color=rank_color(0), label=f"block a x {w_a:.3f}")
    bottom.bar(xs_b, (w_b * p_b).tolist(), color=rank_color(1), label=f"block b x {w_b:.3f}")
    bottom.plot(range(Tk), p.tolist(), "o", color="black", label=f"one call over all keys, lse = {whole:.3f}")
    bottom.set_title(f"reweighted by exp(lse_block - lse'), lse' = log(exp(lse_a) + exp(lse_b)) = {merged:.3f}",
                     loc="left")  # fmt: skip
    bottom.set_xlabel("key")
    bottom.set_xticks(range(Tk))
    for ax in (top, bottom):
        ax.set_ylabel("attention weight")
        ax.legend(frameon=False, loc="upper right")
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_ylim(0, (1.45 if ax is top else 1.75) * ax.get_ylim()[1])
    fig.suptitle("Query 0 of the example: two partial softmaxes, merged by their lse")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 4. All-gather CP: every rank gathers every key, its kernel reads the causal prefix.


def _token_bar(ax: Axes, y: float, tokens: dict[int, float], owner: list[int], height: float = 0.8) -> None:
    """A row of tokens at height y: token t in its owner's colour with opacity `tokens[t]` (absent: blank)."""
    for t, alpha in tokens.items():
        ax.add_patch(Rectangle((t, y), 1, height, facecolor=rank_color(owner[t]), alpha=alpha, edgecolor="none"))


def all_gather() -> Figure:
    """`figures/learn/all_gather.png`: the keys each rank holds before and after the all-gather, and those its
    kernel call read (identified from the call's inputs)."""
    g = example("all_gather")  # the page's example: its sizes, so that the figure's bytes are those it prints
    T, P, H, D = g["T"], g["P"], g["H"], g["D"]
    r = run("all_gather", [0, T], P, "contiguous", (H, H, D, D))
    owner = r.owner()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.6), constrained_layout=True)
    for rank in range(P):
        y = 3 * rank
        _token_bar(ax, y, {t: 1.0 for t in r.sharding.global_index(rank).tolist()}, owner)
        read = {t for call in r.calls(rank) for t in call.k_tokens}
        _token_bar(ax, y + 1, {t: 1.0 if t in read else FAINT for t in range(T)}, owner)
        ax.text(T + 0.5, y + 1.4, f"reads {len(read)} keys", va="center")
    ax.set_yticks([3 * rank + d + 0.4 for rank in range(P) for d in (0, 1)],
                  [f"rank {rank} {what}" for rank in range(P) for what in ("holds", "gathers")])  # fmt: skip
    ax.set_ylim(3 * P - 1, -0.3)
    ax.set_xlim(0, T + 6)
    ax.set_xticks(range(0, T + 1, T // P))
    ax.set_xlabel("key token (colour: the rank it came from; faint: gathered, not read: causal)")
    ax.tick_params(axis="y", length=0)
    ax.spines[["top", "right", "left"]].set_visible(False)
    fwd, bwd = split_trace(r.trace)
    each = fwd[0].bytes_sent[0]
    ax.set_title(f"forward: {ops_text(fwd)} (K, V), {each} B each per rank\n"
                 f"backward: {ops_text(bwd)}\n(K, V again; dK, dV to their owners)", loc="left")
    fig.suptitle(f"all_gather, P = {P}, one document of {T} tokens (contiguous): K and V from every rank")
    return fig
