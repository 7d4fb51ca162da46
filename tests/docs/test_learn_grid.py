"""Learn CP page 11, "CP beside DP, TP and PP" (`docs/learn/beside-dp-tp-pp.md`): its figure, numbers and example.

The page says: cpref's training loop knows a CP group and the DP x CP group, nothing else; it sums the gradients
over the DP x CP group in one all-reduce, normalised by the step's loss tokens; a step at DP 2 x CP 2 has the
gradient of the step on one device; TP and Ulysses split the heads one after the other, so a rank's heads are
those of a Ulysses group of TP x a ranks. These tests hold the figure (`docs/learn_grid.py`), the head budget
and the example (`examples/learn/grid.py`) to cpref's own code: its group construction, its trace, its checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import runpy
from pathlib import Path

import pytest
import torch
from matplotlib.text import Text

import cpref
from cpref.api import mode_costs
from cpref.modes.shared import head_split
from cpref.train.training import Topology
from docs import figures, learn_grid
from sim import SimCluster
from sim.tools.verify.cases import cp_groups

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "learn" / "beside-dp-tp-pp.md"


def partitions(groups, size: int) -> bool:
    """Every rank of `range(size)` in exactly one of `groups`."""
    ranks = [r for g in groups for r in g]
    return sorted(ranks) == list(range(size))


# ---- the figure --------------------------------------------------------------------------------------------------


def test_panel_a_draws_the_cp_groups_the_training_run_split_and_ran_attention_on():
    grid = learn_grid.cpref_grid()
    size = learn_grid.GRID_DP * learn_grid.GRID_CP
    # the groups `python -m sim train` makes, as sim's verifier numbers them too (consecutive ranks)
    assert [list(g) for g in grid.cp_groups] == cp_groups(size, learn_grid.GRID_CP, strided=False)
    assert grid.world_groups == (tuple(range(size)),)
    assert partitions(grid.cp_groups, size) and partitions(grid.world_groups, size)
    # what the trace shows ran: ring shifts on each CP group, only all-reduces (sum) on the world
    for g in grid.cp_groups:  # the CP mode's collectives, the same number in every layer
        assert set(grid.ops[g]) <= set(learn_grid.OP_WORDS) and all(n % grid.layers == 0 for n in grid.ops[g].values())
    (world,) = grid.world_groups
    assert dict(grid.ops[world]) == {"all_reduce": 3}
    assert set(grid.ops) == {*grid.cp_groups, world}  # no other group: no DP-only group


def test_panel_b_composes_tp_with_cprefs_topology_on_each_tp_shard():
    grid = learn_grid.tp_grid()
    size = learn_grid.TP_TP * learn_grid.TP_CP * learn_grid.TP_DP
    assert all(partitions(gs, size) for gs in (grid.tp_groups, grid.cp_groups, grid.world_groups))
    assert all(len(g) == learn_grid.TP_TP for g in grid.tp_groups)
    assert all(len(g) == learn_grid.TP_CP for g in grid.cp_groups)
    # a TP group and a CP group share exactly one rank; every CP group lies in one TP shard's DP x CP group
    assert all(len(set(t) & set(c)) <= 1 for t in grid.tp_groups for c in grid.cp_groups)
    assert all(sum(set(c) <= set(w) for w in grid.world_groups) == 1 for c in grid.cp_groups)
    # the DP x CP group of a TP shard holds the ranks of one TP rank: the same position in every TP group
    for w in grid.world_groups:
        assert len({t.index(r) for t in grid.tp_groups for r in w if r in t}) == 1
    # what the page says of the placement: TP and CP inside a node, the gradient sum across nodes
    assert not any(learn_grid._spans_nodes(g) for g in (*grid.tp_groups, *grid.cp_groups))
    assert all(learn_grid._spans_nodes(w) for w in grid.world_groups)


def test_the_figure_is_readable_and_names_the_collectives_its_run_made():
    fig = learn_grid.grid()
    figures.check_readable(fig, "figures/learn/grid.png")
    texts = " ".join(t.get_text() for t in fig.findobj(Text))
    grid = learn_grid.cpref_grid()
    (op, n), = grid.ops[grid.cp_groups[0]].items()
    assert f"{n // grid.layers} {learn_grid.OP_WORDS[op]}" in texts and "3 all-reduces (sum) per step" in texts
    assert "inside a node" in texts and "the only traffic between the nodes" in texts


# ---- the head budget ---------------------------------------------------------------------------------------------


def budget_cells():
    hq, hkv, _, _ = learn_grid.budget_layer()
    return [(hq, hkv, tp, a) for tp in learn_grid.budget_tp() for a in learn_grid.BUDGET_A]


@pytest.mark.parametrize("hq, hkv, tp, a", budget_cells())
def test_a_cell_is_refused_exactly_where_cprefs_a2a_modes_refuse_a_tp_ranks_heads(hq, hkv, tp, a):
    _, _, d, dv = learn_grid.budget_layer()
    cell = learn_grid.per_rank_heads(hq, hkv, tp, a)
    heads = (hq // tp, hkv // tp, d, dv)
    for mode, P, options in (("a2a", a, {}), ("a2a+p2p", 2 * a, {"a2a_size": a})):
        try:
            mode_costs(mode, P=P, local_tokens=16, heads=heads, dtype=torch.bfloat16, **options)
            refused = False
        except cpref.CPInputError:
            refused = True
        assert refused == (cell is None), (mode, tp, a)
    # the page's rule: TP and Ulysses split the heads as one group of TP x a ranks would
    assert (cell is None) == (head_split(hq, hkv, tp * a) is None)
    if cell is not None:  # whole heads per rank; key/value heads replicated to one where fewer than ranks
        assert cell == (hq // (tp * a), hkv // (tp * a) if hkv % (tp * a) == 0 else 1)


def test_the_table_on_the_page_is_the_cells():
    table = learn_grid.head_budget_table()
    rows = [line for line in table.splitlines() if re.match(r"\| \d", line)]
    hq, hkv, _, _ = learn_grid.budget_layer()
    assert len(rows) == len(learn_grid.budget_tp())
    for row, tp in zip(rows, learn_grid.budget_tp()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == str(tp)
        want = [learn_grid.per_rank_heads(hq, hkv, tp, a) for a in learn_grid.BUDGET_A]
        assert cells[1:] == ["-" if w is None else f"{w[0]} / {w[1]}" for w in want]
    assert "-" in table and "**" not in table  # a refused cell; no bold (it would need a glossary row)


def test_the_refusal_the_page_prints_is_what_cpref_attention_raises():
    tp, a, message = learn_grid.refusal()
    hq, hkv, _, _ = learn_grid.budget_layer()
    T = 4 * a
    sharding = cpref.Sharding([0, T], cp_size=a, layout="zigzag")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 8, generator=g) for h in (hq // tp, hkv // tp, hkv // tp))

    def program(comm):
        return cpref.attention(*(sharding.shard(x, comm.rank) for x in (q, k, v)), sharding, comm=comm, mode="a2a")

    with pytest.raises(cpref.CPInputError) as raised:
        SimCluster(a).run(program)
    assert str(raised.value) == message
    assert message in learn_grid.head_budget_refusal()


# ---- the example ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        names = runpy.run_module("examples.learn.grid", run_name="__main__")
    return names, buffer.getvalue().splitlines()


def test_the_example_prints_the_groups_of_sims_topology(example):
    names, lines = example
    dp, cp = names["DP"], names["CP"]
    for strided, line in zip((False, True), lines[:2]):
        assert line.endswith(f"CP groups {[tuple(g) for g in cp_groups(dp * cp, cp, strided)]}")
    assert lines[2].endswith(str(tuple(range(dp * cp))))


def test_the_dp2_x_cp2_gradient_is_the_one_device_gradient_and_an_average_would_not_be(example):
    names, lines = example
    (line,) = [x for x in lines if x.startswith("DP 2 x CP 2 against one device")]
    n, largest, diff = (float(x.replace(",", "")) for x in
                        re.search(r": (\S+) gradients up to (\S+), largest difference (\S+)$", line).groups())
    alone = names["alone"]
    assert n == alone.numel() and largest == pytest.approx(float(alone.abs().max()), rel=0.05)
    assert diff <= 1e-6 * largest  # float32 rounding
    # the check can see the bug it is for: gradients averaged over the 4 ranks instead of summed
    assert float(alone.abs().max()) * (1 - 1 / 4) > 1e4 * diff
    for grad in names["grads"]:
        torch.testing.assert_close(grad, alone, rtol=1e-5, atol=1e-7)


def test_the_example_shows_the_all_reduces_on_the_world_and_shifts_only_in_cp_groups(example):
    names, lines = example
    reduces = [x for x in lines if x.startswith("all_reduce")]
    assert len(reduces) == 3 and all("(op=sum) on (0, 1, 2, 3)" in x for x in reduces)
    assert f"{names['alone'].numel():,} float32, the gradients" in reduces[1]
    shifts = [x for x in lines if x.startswith("send_recv")]
    assert [x.split(":")[0] for x in shifts] == ["send_recv on (0, 1)", "send_recv on (2, 3)"]


# ---- the page --------------------------------------------------------------------------------------------------------


def test_the_page_says_what_the_training_loop_has():
    text = PAGE.read_text()
    assert text.startswith("# 11. CP beside DP, TP and PP\n") and text.count("{{ figure figures/learn/grid.png }}") == 1
    # "two groups ... There is no DP-only group": Topology holds a CP group and the DP x CP group, nothing else
    groups = [f.name for f in dataclasses.fields(Topology) if f.name in ("cp", "world", "dp")]
    assert groups == ["cp", "world"] and "There is no DP-only group" in text
    # the region the page includes sums the gradients over the DP x CP group, normalised by its token count
    source = (ROOT / "src" / "cpref" / "train" / "training.py").read_text()
    region = source.split("# --8<-- [start:dp_cp_reduction]")[1].split("# --8<-- [end:dp_cp_reduction]")[0]
    assert "count = topo.world.all_reduce(" in region and "flat = topo.world.all_reduce(" in region
    assert "cp_loss(token_loss, b[\"loss_mask\"], topo.world, count=count)" in region
    assert '--8<-- "src/cpref/train/training.py:dp_cp_reduction"' in text
    for name in re.findall(r"\{\{ (\w+) \}\}", text):
        assert name in learn_grid.TEXT, name
