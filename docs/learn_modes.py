"""The Learn path's figures of the modes and the home page's (pages 6 to 9), drawn from real runs.

Each function runs cpref on the simulated cluster (`docs/learn_runs.py`) and draws what the run did,
byte counts from the trace, costs from cpref's cost model; `docs/learn_figures.py` registers them.
"""

from __future__ import annotations

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch

import cpref
from docs import figures as base
from docs.learn_runs import example, flows, ops_text, run, split_trace
from docs.learn_text import traffic

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n % 1024 else f"{n // 1024} KiB"


# ---------------------------------------------------------------------------------------------------------------
# Home page: what each mode moves between ranks.

HOME_CU, HOME_P, HOME_HEADS = [0, 64], 4, (8, 4, 16, 16)  # one document of 64 tokens, GQA G = 2, bf16
CORNERS = [(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]  # rank r's place: the ring runs clockwise


def _flow_panel(ax: Axes, sent: torch.Tensor, scale: float) -> None:
    """Ranks on the corners of a square; an arrow from i to j as wide as the bytes i sent j."""
    P = sent.shape[0]
    for i in range(P):
        for j in range(P):
            if sent[i, j] == 0:
                continue
            arrow = FancyArrowPatch(CORNERS[i], CORNERS[j], connectionstyle="arc3,rad=0.18", arrowstyle="-|>",
                                    mutation_scale=12, shrinkA=17, shrinkB=17, color=rank_color(i),
                                    linewidth=0.6 + 7 * float(sent[i, j]) / scale, alpha=0.85)  # fmt: skip
            ax.add_patch(arrow)
    for r, (x, y) in enumerate(CORNERS[:P]):
        ax.add_patch(plt.Circle((x, y), 0.13, color=rank_color(r), zorder=3))
        ax.text(x, y, f"r{r}", ha="center", va="center", color="white", fontweight="bold", zorder=4)
    ax.set_ylim(-0.3, 1.3)  # x as wide as the slot: the axes fills it (a long title starts at the slot's left)
    ax.set_aspect("equal", adjustable="datalim")
    ax.axis("off")


def home_movement() -> Figure:
    """`figures/learn/movement.png`: every mode's forward + backward on 4 ranks, the bytes each rank sent each other."""
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 6.6), constrained_layout=True)
    runs = {mode: run(mode, HOME_CU, HOME_P, "zigzag", HOME_HEADS, dtype=torch.bfloat16,
                      **cpref.MODES[mode].example_options(HOME_P)) for mode in cpref.MODES}  # fmt: skip
    sent = {mode: flows(r.trace, HOME_P) for mode, r in runs.items()}
    scale = max(float(s.max()) for s in sent.values())
    for ax, (mode, r) in zip(axes.flat, runs.items()):
        _flow_panel(ax, sent[mode], scale)
        fwd, bwd = split_trace(r.trace)
        a, b = (int(flows(part, HOME_P).sum(1)[0]) for part in (fwd, bwd))
        extra = "".join(f", {k} = {v}" for k, v in cpref.MODES[mode].example_options(HOME_P).items())
        ax.set_title(f"{mode}{extra}: {_kib(a + b)} per rank\nforward {ops_text(fwd)}\nbackward {ops_text(bwd)}",
                     loc="left")  # fmt: skip
    hq, hkv, d, _ = HOME_HEADS
    fig.suptitle(f"What each rank sends each other rank, forward + backward (arrow width: bytes)\n"
                 f"P = {HOME_P}, one document of {HOME_CU[-1]} tokens, Hq = {hq}, Hkv = {hkv}, D = Dv = {d}, bf16")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 6. Layouts: who computes which scores of a packed batch, and each rank's work.

LAYOUT_MAX_WORK = 187  # the bars' common scale: contiguous's slowest rank (the figure asserts it is no more)


def layouts() -> Figure:
    """`figures/learn/layouts.png`: the causal mask of a packed batch coloured by the computing rank, contiguous
    against zigzag, and each rank's work as its kernel calls counted it in a real ring forward."""
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 6.2), constrained_layout=True, height_ratios=[3.2, 1.3])
    g = example("layouts")  # the page's example: its batch, whose work per rank it prints
    cu, P = g["cu_seqlens"], g["P"]
    T = cu[-1]
    for col, layout in enumerate(("contiguous", "zigzag")):
        r = run("p2p", cu, P, layout, (2, 2, 8, 8))
        owner = r.owner()
        image = torch.ones(T, T, 3)
        for x in range(T):
            for y in range(T):
                if r.visible(x, y):
                    image[x, y] = torch.tensor(rank_color(owner[x]))
        ax = axes[0, col]
        ax.imshow(image.numpy(), interpolation="nearest", extent=(0, T, T, 0))
        for b in cu[1:-1]:
            ax.axhline(b, color="black", linewidth=1.2)
            ax.axvline(b, color="black", linewidth=1.2)
        ax.set_xticks(cu)
        ax.set_yticks(cu)
        ax.set_title(f"{layout}: each score in its query's rank", loc="left")
        ax.set_xlabel("key token")
        work = [sum(c.work for c in r.calls(rank)) for rank in range(P)]  # scores per head
        assert work == [r.sharding.attention_work(rank, exact=True) for rank in range(P)]
        assert max(work) <= LAYOUT_MAX_WORK, work
        bars = axes[1, col].bar(range(P), work, color=[rank_color(rank) for rank in range(P)])
        axes[1, col].bar_label(bars, padding=2)
        axes[1, col].set_xticks(range(P), [f"r{rank}" for rank in range(P)])
        axes[1, col].set_ylim(0, 1.3 * LAYOUT_MAX_WORK)
        axes[1, col].set_title(f"scores per rank:\nslowest / mean = {max(work) * P / sum(work):.2f}", loc="left")
        axes[1, col].spines[["top", "right"]].set_visible(False)
    axes[0, 0].set_ylabel("query token")
    axes[1, 0].set_ylabel("scores")
    fig.suptitle(f"A packed batch (THD): documents of {cu[1]} and {cu[2] - cu[1]} tokens, "
                 f"P = {P}, causal;\nthe work counted from a real ring forward's kernel calls")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 7. Ulysses: tokens for heads.


def _cells_panel(ax: Axes, grid: torch.Tensor, title: str) -> None:
    """`grid (H, T)`: the rank holding each (head, token) of q."""
    H, T = grid.shape
    assert (grid >= 0).all(), "every (head, token) is held by one rank"
    colors = torch.tensor([rank_color(int(x)) for x in grid.flatten()]).reshape(H, T, 3)
    ax.imshow(colors.numpy(), aspect="auto", interpolation="nearest", extent=(0, T, H, 0))
    ax.set_yticks([h + 0.5 for h in range(H)], [f"h{h}" for h in range(H)])
    ax.set_xticks(range(0, T + 1, 8))
    ax.set_title(title, loc="left")


def ulysses() -> Figure:
    """`figures/learn/ulysses.png`: which rank holds which (token, head) of q before the all-to-all and after it,
    read from what each rank's kernel call was given."""
    g = example("ulysses")  # the page's example: its sizes, so that the figure's bytes are those it prints
    T, P, H, D = g["T"], g["P"], g["H"], g["D"]
    r = run("a2a", [0, T], P, "contiguous", (H, H, D, D))
    before, after = torch.full((H, T), -1), torch.full((H, T), -1)
    for rank in range(P):
        before[:, r.sharding.global_index(rank)] = rank
        (call,) = r.calls(rank)
        for row in call.q_cells:
            for t, h in row:
                after[h, t] = rank
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 5.2), constrained_layout=True, sharex=True)
    _cells_panel(top, before, f"before: every rank holds T/P = {T // P} tokens of all {H} heads")
    _cells_panel(bottom, after, f"after the all-to-all: every rank holds all {T} tokens of H/P = {H // P} heads")
    bottom.set_xlabel("token")
    for ax in (top, bottom):
        ax.set_ylabel("head of q")
    fwd, bwd = split_trace(r.trace)
    fig.legend(handles=[Patch(color=rank_color(rank), label=f"rank {rank}") for rank in range(P)],
               loc="outside lower center", ncols=P, frameon=False)  # fmt: skip
    (each,) = {ev.bytes_sent[0] for ev in fwd}
    fig.suptitle(f"a2a, P = {P}, one document of {T} tokens, MHA: forward {ops_text(fwd)}\n(q, k, v in; out back), "
                 f"{each} B each per rank; one kernel call per rank")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 8. The hierarchy: Ulysses inside groups of a ranks, a ring across them.



def hierarchy() -> Figure:
    """`figures/learn/hierarchy.png`: the (token, head) cells of K each rank's kernel saw at each ring step of a
    real a2a+p2p forward, coloured by the rank that held the token before the exchange."""
    g = example("hierarchy")  # the page's example: its sizes and a2a_size
    T, P, a, H, D = g["T"], g["P"], g["A"], g["H"], g["D"]
    p = P // a
    r = run("a2a+p2p", [0, T], P, "zigzag", (H, H, D, D), a2a_size=a)
    owner = r.owner()
    fig, axes = plt.subplots(P, p, figsize=(WIDTH, 6.4), constrained_layout=True, sharex=True, sharey=True)
    for rank in range(P):
        seen = {}
        for call in r.calls(rank):
            (group,) = {owner[t] // a for t in call.k_tokens}  # a ring block: one a2a group's tokens
            seen.setdefault((rank // a - group) % p, set()).update(cell for row in call.k_cells for cell in row)
        for step in range(p):
            grid = torch.ones(H, T, 3)
            for t, h in seen[step]:
                grid[h, t] = torch.tensor(rank_color(owner[t]))
            ax = axes[rank, step]
            ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", extent=(0, T, H, 0))
            ax.set_yticks([h + 0.5 for h in range(H)], [f"h{h}" for h in range(H)])
            ax.set_xticks(range(0, T + 1, 8))
            groups = sorted({owner[t] // a for t, _ in seen[step]})
            ax.set_title(f"rank {rank}, ring step {step}: keys of a2a group {groups[0]}", loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("key token")
    fwd, _ = split_trace(r.trace)
    mine = [ev for ev in fwd if 0 in ev.group]
    by_group = sorted({(ev.op, ev.group) for ev in mine})
    what = "; ".join(f"{ops_text([ev for ev in mine if ev.group == g])} in {g}" for _, g in by_group)
    fig.legend(handles=[Patch(color=rank_color(x), label=f"rank {x}") for x in range(P)], ncols=P, frameon=False,
               loc="outside lower center", title="colour: the rank that held the key before the exchange")  # fmt: skip
    a2a_groups, rings = (ev.param.removeprefix("groups=") for ev in r.trace if ev.op == "split")
    fig.suptitle(f"a2a+p2p, P = {P}, a2a_size = {a}: a2a groups {a2a_groups[1:-1]}, rings {rings[1:-1]}.\n"
                 f"The keys (and heads) each rank's kernel saw at each ring step of a real forward;\n"
                 f"rank 0 took part in {what}")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# 9. Which mode: forward + backward traffic, the cost model against the simulated cluster.

WHICH_P = (2, 4, 8, 16)
WHICH_D, WHICH_TL = 4, 16  # the simulated runs: head dim and tokens per rank (scaled up to the reference layer)
MODE_STYLE = {"all_gather": ("o", 0), "p2p": ("s", 1), "a2a": ("^", 2), "a2a+p2p": ("D", 3)}


def measured(mode: str, P: int, heads: tuple[int, int, int, int]) -> int:
    """Forward + backward bytes rank 0 sent in a real bf16 run on the simulated cluster, with head dim WHICH_D and
    WHICH_TL tokens per rank."""
    from sim.cluster.harness import mode_trace as without_host
    from sim.cluster.harness import run_attention, trace_split

    hq, hkv = heads[:2]
    T, g = WHICH_TL * P, torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, hq, WHICH_D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(T, hkv, WHICH_D, generator=g).bfloat16() for _ in range(2))
    _, cluster = run_attention(q, k, v, dout, cpref.Sharding([0, T], cp_size=P, layout="zigzag"), mode=mode,
                               check_ranks=False, between=lambda comm: comm.barrier(),
                               **cpref.MODES[mode].example_options(P))  # fmt: skip
    (fwd, _), (bwd, _) = trace_split(without_host(cluster), 0)
    return fwd + bwd


def _mode_name(mode: str) -> str:
    """The mode with the options its figures and tables run it with."""
    return mode + "".join(f" ({k} {v})" for k, v in cpref.MODES[mode].example_options(2).items())


def which_mode() -> Figure:
    """`figures/learn/which_mode.png`: every mode's forward + backward traffic per rank against P, for the which-mode
    page's two reference layers: the cost model's lines, and dots measured on the simulated cluster."""
    from docs.tables import REFERENCE, REFERENCE_T

    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.1), constrained_layout=True, sharey=True)
    for ax, (title, heads) in zip(axes, REFERENCE.items()):
        hq, hkv, d, dv = heads
        assert d == dv, "the runs scale D and Dv alike"
        for mode in cpref.MODES:
            marker, color = MODE_STYLE[mode]
            points = [(P, traffic(mode, P, heads, REFERENCE_T)) for P in WHICH_P]  # the cost model's
            points = [(P, b) for P, b in points if b is not None]
            ax.plot([P for P, _ in points], [b / 2**30 for _, b in points], "-", color=rank_color(color))
            # the same layer at T/P = WHICH_TL and D = WHICH_D, run: bytes scale with T/P and D exactly
            runs = [(P, measured(mode, P, (hq, hkv, WHICH_D, WHICH_D)) * (REFERENCE_T // (WHICH_TL * P)) * (d // WHICH_D))
                    for P, _ in points]  # fmt: skip
            assert runs == points, f"{mode}: the simulated cluster's bytes, scaled, {runs} != the cost model's {points}"
            ax.plot([P for P, _ in runs], [b / 2**30 for _, b in runs], marker, color=rank_color(color), linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks(WHICH_P, [str(P) for P in WHICH_P])
        ax.set_xlabel("P")
        ax.set_title(title.replace("D = Dv", "D"), loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("GiB per rank and layer")
    axes[0].legend(handles=[Line2D([], [], color=rank_color(MODE_STYLE[m][1]), marker=MODE_STYLE[m][0], label=_mode_name(m))
                            for m in cpref.MODES], frameon=False, loc="upper left")  # fmt: skip
    fig.suptitle(f"Forward + backward traffic per rank and layer, T = {REFERENCE_T:,} tokens, bf16\n"
                 f"lines: cpref's cost model\n"
                 f"dots: real runs on the simulated cluster (T/P = {WHICH_TL}, D = {WHICH_D}), scaled")
    return fig
