"""The docs' measured tables show what the pages' formulas say: checked here, on the very runs they render.

The docs build only renders (`docs/tables.py`); a build that checked its own figures would fail
in `make docs` for what is a bug in cpref, and the suite would not see it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import cpref
from cpref.api import mode_costs
from sim.cluster.harness import mode_trace, trace_split

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tables():
    return importlib.import_module("docs.tables")


@pytest.mark.parametrize("mode", list(cpref.MODES))
def test_every_mode_page_trace_is_its_cost_formula(tables, mode):
    cluster = tables.traced_run(mode)
    P, T = tables.TRACE_P, int(tables.TRACE_CU[-1])
    want = mode_costs(mode, P=P, local_tokens=T // P, heads=(tables.TRACE_HQ, tables.TRACE_HKV, tables.TRACE_D, tables.TRACE_D),
                      dtype=torch.float32, **cpref.MODES[mode].example_options(P))  # fmt: skip
    for rank in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(mode_trace(cluster), rank)
        assert (fwd, bwd, fwd_ops, bwd_ops) == (want.forward_bytes, want.backward_bytes, dict(want.forward_ops),
                                                 dict(want.backward_ops))  # fmt: skip


def test_the_all_gather_page_states_its_collectives_and_formula(tables):
    """The page says: 2 all-gathers forward, 2 + 2 backward, (P-1) (T/P) Hkv (D + Dv) 4-byte elements, twice backward."""
    cluster = tables.traced_run("all_gather")
    P, T = tables.TRACE_P, int(tables.TRACE_CU[-1])
    assert [ev.op for ev in mode_trace(cluster)] == ["all_gather"] * 2 + ["barrier"] + ["all_gather"] * 2 + ["reduce_scatter"] * 2
    formula = (P - 1) * (T // P) * tables.TRACE_HKV * 2 * tables.TRACE_D * 4
    (fwd, _), (bwd, _) = trace_split(mode_trace(cluster), 0)
    assert (fwd, bwd) == (formula, 2 * formula)


@pytest.mark.parametrize("save", [False, True])
def test_the_memory_table_measures_the_formula(tables, save):
    for P in tables.MEMORY_P:
        measured, formula = tables.all_gather_saved(P, save)
        assert measured == formula


def test_which_mode_marks_what_the_heads_cannot_do(tables):
    """MHA with 16 heads: Ulysses at P = 16 works (16 | 16), GQA with 8 key/value heads at P = 16 works by
    replication (16 % 8 == 0); a layer of 12 heads at P = 8 cannot be split, and its cell is '-'."""
    with pytest.raises(cpref.CPInputError, match="8 ranks cannot split Hq = 12"):
        mode_costs("a2a", P=8, local_tokens=16, heads=(12, 12, 8, 8), dtype=torch.bfloat16)
    text = tables.which_mode()
    assert "| P | all_gather | p2p | a2a | a2a+p2p, a2a_size = 2 |" in text
    assert " - " not in text  # both reference layers split at every P of the table
