"""The figure and numbers of Learn 11, "CP beside DP, TP and PP", from cpref's own group construction.

`cpref_grid()` runs one real training step of DP 2 x CP 8 on 16 simulated ranks: the page's example's
`one_step` (`examples/learn/grid.py`: `cpref.train.training.train_step` on a tiny model), on the topology
`sim.tools.train.topology` builds, the function `python -m sim train` splits its CP groups with. The groups and
what ran on each come from the cluster's trace. `tp_grid()` lays TP beside it as a user would: cpref has no TP,
so its TP groups are this module's (consecutive ranks, TP innermost), and on each TP slice (the ranks of one TP
rank) the same `topology` builds the CP groups. `head_budget()` asks the check cpref's all-to-all modes run,
`cpref.modes.ulysses.check_a2a_heads`, about the heads one TP rank holds.
"""

from __future__ import annotations

import contextlib
import functools
import io
import runpy
from collections import Counter
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

import cpref
from docs import figures as base

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color

NODE = 8  # ranks (GPUs) per node in the drawing: a definition, not a measurement
GRID_DP, GRID_CP = 2, 8  # panel (a): cpref's DP x CP, run
TP_TP, TP_CP, TP_DP = 2, 4, 2  # panel (b): TP beside it, the same 16 ranks
BUDGET_LAYER = "GQA: Hq = 32, Hkv = 8, D = Dv = 128"  # the which-mode page's GQA layer (docs.tables.REFERENCE)
BUDGET_A = (1, 2, 4, 8, 16, 32)  # Ulysses group sizes: P for `a2a`, a2a_size for `a2a+p2p`
LINE = 0.62  # text line height in the panels' units (a box is 1 high)
OP_WORDS = {"send_recv": "ring shifts", "all_to_all": "all-to-alls", "all_gather": "all-gathers",
            "reduce_scatter": "reduce-scatters"}  # fmt: skip


@functools.cache
def example() -> dict[str, Any]:
    """The globals of `examples/learn/grid.py` after one run (what it prints is the page's output block)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runpy.run_module("examples.learn.grid", run_name="__main__")


@dataclass(frozen=True)
class Grid:
    """Who is in which group, on `size` ranks; `ops[group]`: the collectives the group ran (a Counter)."""

    size: int
    cp_groups: tuple[tuple[int, ...], ...]
    world_groups: tuple[tuple[int, ...], ...]  # the groups `Topology.world` is: losses and gradients summed there
    tp_groups: tuple[tuple[int, ...], ...] = ()
    ops: Any = None
    layers: int = 0
    reductions: frozenset = frozenset()  # the reduce ops of the all-reduces, as the trace names them (`op=sum`)


@functools.cache
def cpref_grid() -> Grid:
    """One real `train_step` of DP `GRID_DP` x CP `GRID_CP` on the simulated cluster: its groups and collectives."""
    from sim import SimCluster
    from sim.tools.train import RunSpec, topology

    one_step, spec = example()["one_step"], RunSpec(dp=GRID_DP, cp=GRID_CP)

    def rank(world):
        topo = topology(world, spec)
        one_step(topo, 1)
        return topo.cp.group, topo.world.group

    cluster = SimCluster(GRID_DP * GRID_CP)
    got = cluster.run(rank)
    ops: dict = {}
    for e in cluster.trace:
        if e.op != "split" and e.param != "host":  # the ranks' own agreement checks are not the algorithm
            ops.setdefault(e.group, Counter())[e.op] += 1
    reductions = frozenset(e.param for e in cluster.trace if e.op == "all_reduce" and e.param != "host")
    return Grid(len(got), tuple(sorted({c for c, _ in got})), tuple(sorted({w for _, w in got})), (), ops,
                example()["config"].num_layers, reductions)  # fmt: skip


@functools.cache
def tp_grid() -> Grid:
    """TP `TP_TP` x CP `TP_CP` x DP `TP_DP`: TP groups of consecutive ranks (not cpref's: it has no TP), and on the
    ranks of each TP rank, the CP groups `sim.tools.train.topology` builds."""
    from sim import SimCluster
    from sim.tools.train import RunSpec, topology

    spec, size = RunSpec(dp=TP_DP, cp=TP_CP), TP_TP * TP_CP * TP_DP

    def rank(world):
        tp = world.split([list(range(g, g + TP_TP)) for g in range(0, size, TP_TP)])  # innermost: consecutive
        tp_slice = world.split([list(range(t, size, TP_TP)) for t in range(TP_TP)])  # the ranks of one TP rank
        topo = topology(tp_slice, spec)
        return tp.group, topo.cp.group, topo.world.group

    got = SimCluster(size).run(rank)
    return Grid(size, tuple(sorted({c for _, c, _ in got})), tuple(sorted({w for *_, w in got})),
                tuple(sorted({t for t, _, _ in got})))  # fmt: skip


def _x(rank: int) -> float:
    return rank + 0.7 * (rank // NODE)  # a gap between nodes


def _boxes(ax: Axes, grid: Grid) -> None:
    """The ranks as boxes coloured by CP group, nodes framed, TP groups bracketed below."""
    colour = {r: rank_color(i) for i, g in enumerate(grid.cp_groups) for r in g}
    for r in range(grid.size):
        ax.add_patch(Rectangle((_x(r) + 0.06, 0), 0.88, 1, facecolor=colour[r], edgecolor="white"))
        ax.text(_x(r) + 0.5, 0.5, str(r), ha="center", va="center", color="white", fontweight="bold")
    for n in range(grid.size // NODE):
        left, right = _x(n * NODE) - 0.1, _x(n * NODE + NODE - 1) + 1.1
        ax.add_patch(Rectangle((left, -0.15), right - left, 1.3, fill=False, linestyle="--", edgecolor="0.35"))
        ax.text((left + right) / 2, 1.25, f"node {n}", ha="center", va="bottom")
    for g in grid.tp_groups:
        left, right = _x(min(g)) + 0.15, _x(max(g)) + 0.85
        ax.plot([left, left, right, right], [-0.3, -0.5, -0.5, -0.3], color="black", linewidth=1.5)
        ax.text((left + right) / 2, -0.55, "TP", ha="center", va="top")


def _panel(ax: Axes, grid: Grid, title: str, lines: list[str], bar: str | None = None) -> None:
    """One grid: the boxes, a bar under all the ranks where they form one group (`bar`: its label), text lines."""
    _boxes(ax, grid)
    top = -0.3
    if grid.tp_groups:
        top = -1.15
    if bar is not None:
        ax.add_patch(Rectangle((_x(0) - 0.1, -1.05), _x(grid.size - 1) + 1.2 - _x(0), 0.7, facecolor="0.85",
                               edgecolor="0.35"))  # fmt: skip
        ax.text((_x(0) + _x(grid.size - 1) + 1) / 2, -0.7, bar, ha="center", va="center")
        top = -1.25
    for i, line in enumerate(lines):
        ax.text(_x(0) - 0.1, top - LINE * i, line, ha="left", va="top")
    ax.set_xlim(_x(0) - 0.2, _x(grid.size - 1) + 1.2)
    ax.set_ylim(top - LINE * len(lines) - 0.05, 1.75)
    ax.set_title(title, loc="left")
    ax.axis("off")


def _spans_nodes(group: tuple[int, ...]) -> bool:
    return len({r // NODE for r in group}) > 1


def _short(group: tuple[int, ...]) -> str:
    """A group as `(0, 2, ..., 14)` when it is a stride, else in full."""
    step = group[1] - group[0] if len(group) > 1 else 1
    if len(group) > 4 and list(group) == list(range(group[0], group[-1] + 1, step)):
        return f"({group[0]}, {group[1]}, ..., {group[-1]})"
    return str(group)


def cp_ops_text(grid: Grid) -> str:
    """What one CP group ran per attention layer, e.g. `22 ring shifts`: the same in every CP group (checked)."""
    per_group = {g: dict(grid.ops[g]) for g in grid.cp_groups}
    (ops,) = {tuple(sorted(c.items())) for c in per_group.values()}
    return " and ".join(f"{n // grid.layers} {OP_WORDS.get(op, op)}" for op, n in ops)


def world_ops_text(grid: Grid) -> str:
    """What the DP x CP group ran per step, e.g. `3 all-reduces`."""
    (world,) = grid.world_groups
    assert set(grid.ops[world]) == {"all_reduce"}, grid.ops[world]
    (reduction,) = grid.reductions
    return f"{grid.ops[world]['all_reduce']} all-reduces ({reduction.removeprefix('op=')})"


def grid() -> Figure:
    """`figures/learn/grid.png`: 16 ranks on 2 nodes, as cpref's DP x CP training runs them (a real step's groups
    and collectives) and with TP laid beside it (TP groups this module's, CP groups cpref's topology on each slice)."""
    a, b = cpref_grid(), tp_grid()
    (world,) = a.world_groups
    where = "between nodes" if any(_spans_nodes(g) for g in a.cp_groups) else "inside a node"
    crossing = [g for g in a.ops if _spans_nodes(g)]
    lines_a = [f"colour: a CP group = a DP replica: {cp_ops_text(a)} ({example()['MODE']}) per attention layer, {where}",
               "grey: no DP-only group; one sum over DP and CP at once, of the loss tokens,",
               "the gradients and the loss" + (": the only traffic between the nodes" if crossing == [world] else "")]  # fmt: skip
    inside = {name: all(not _spans_nodes(g) for g in groups) for name, groups in (("tp", b.tp_groups),
                                                                                 ("cp", b.cp_groups))}  # fmt: skip
    (first, *_) = b.world_groups
    lines_b = [f"TP groups (yours: cpref has no TP): all-reduces in every layer{', inside a node' * inside['tp']}",
               f"colour: CP groups, cpref's topology on the {len(first)} ranks of one TP shard{', inside a node' * inside['cp']}",
               f"gradients summed over one TP shard's ranks, e.g. {_short(first)}"
               f"{', across the nodes' * _spans_nodes(first)}"]  # fmt: skip
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 5.2), constrained_layout=True, height_ratios=[1, 1])
    _panel(top, a, f"(a) cpref: DP {GRID_DP} x CP {GRID_CP}, one real training step", lines_a,
           bar=f"DP x CP group, all {len(world)} ranks: {world_ops_text(a)} per step")  # fmt: skip
    _panel(bottom, b, f"(b) TP {TP_TP} beside it: TP {TP_TP} x CP {TP_CP} x DP {TP_DP}", lines_b)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The head budget: TP splits the heads, then Ulysses splits what each TP rank holds.


def budget_layer() -> tuple[int, int, int, int]:
    from docs.tables import REFERENCE

    return REFERENCE[BUDGET_LAYER]


def budget_tp() -> tuple[int, ...]:
    """The TP sizes of the table: those that split both head counts (TP gives each rank Hq/TP and Hkv/TP heads)."""
    hq, hkv, _, _ = budget_layer()
    return tuple(t for t in range(1, hkv + 1) if hq % t == 0 and hkv % t == 0)


def per_rank_heads(hq: int, hkv: int, tp: int, a: int) -> tuple[int, int] | None:
    """`(query, key/value heads)` a rank computes with TP `tp` and a Ulysses group of `a`, or None where cpref's
    all-to-all refuses the heads a TP rank holds (`check_a2a_heads`, the check modes `a2a` and `a2a+p2p` run)."""
    from cpref.modes.shared import head_split
    from cpref.modes.ulysses import check_a2a_heads

    hq_tp, hkv_tp = hq // tp, hkv // tp  # what one TP rank holds
    try:
        check_a2a_heads(hq_tp, hkv_tp, a, a, "mode 'a2a'")
    except cpref.CPInputError:
        return None
    return hq_tp // a, hkv_tp * head_split(hq_tp, hkv_tp, a) // a  # key/value heads replicated where hkv_tp < a


def refusal() -> tuple[int, int, str]:
    """`(tp, a, message)`: the first refused cell of the table's largest TP, and what cpref says."""
    from cpref.modes.ulysses import check_a2a_heads

    hq, hkv, _, _ = budget_layer()
    tp = budget_tp()[-1]
    a = next(a for a in BUDGET_A if per_rank_heads(hq, hkv, tp, a) is None)
    try:
        check_a2a_heads(hq // tp, hkv // tp, a, a, "mode 'a2a'")
    except cpref.CPInputError as e:
        return tp, a, str(e)
    raise AssertionError("the cell is refused")


def head_budget_table() -> str:
    """Markdown: query / key-value heads per rank for every TP size and Ulysses group of the GQA layer."""
    hq, hkv, _, _ = budget_layer()
    out = [f"{BUDGET_LAYER.rsplit(',', 1)[0]}: query / key-value heads on each rank (`-`: refused).", "",
           "| TP | " + " | ".join(f"a = {a}" for a in BUDGET_A) + " |", "| --- |" + " --- |" * len(BUDGET_A)]  # fmt: skip
    for tp in budget_tp():
        cells = [per_rank_heads(hq, hkv, tp, a) for a in BUDGET_A]
        out.append(f"| {tp} | " + " | ".join("-" if c is None else f"{c[0]} / {c[1]}" for c in cells) + " |")
    return "\n".join(out)


def head_budget_refusal() -> str:
    tp, a, message = refusal()
    hq, hkv, _, _ = budget_layer()
    return (f"At TP = {tp} a rank holds {hq // tp} query heads and {hkv // tp} key/value head"
            f"{'s' * (hkv // tp != 1)}; a Ulysses group of {a} asks cpref for what it cannot do:\n\n"
            f"```text\n{message}\n```")


def grid_step() -> str:
    """The figure's run in words: what each group ran."""
    a = cpref_grid()
    (world,) = a.world_groups
    return (f"In the figure's step (panel a: mode {example()['MODE']}, a model of {a.layers} layers) each CP group "
            f"made {cp_ops_text(a)} per layer, and the {len(world)} ranks together {world_ops_text(a)}")


FIGURES = {"figures/learn/grid.png": grid}
TEXT = {"grid_head_budget": head_budget_table, "grid_refusal": head_budget_refusal, "grid_step": grid_step}
