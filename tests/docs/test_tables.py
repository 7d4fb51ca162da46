"""The docs' measured tables show what the pages' formulas say: checked here, on the very runs they render.

The docs build only renders (`docs/tables.py`); a build that checked its own figures would fail
in `make docs` for what is a bug in cpref, and the suite would not see it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import cpref
from cpref.api import mode_costs
from cpref.modes.costs import element_bytes
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


# ---- the rules of thumb ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_ulysses_rule_holds_wherever_no_head_is_replicated(tables, dtype):
    """The which-mode page renders the rule from one point (G = 1, P = 2); it holds at every G and every P dividing Hkv:
    a2a over all_gather is (G + 1) / P forward, and 2b / (2b + f) of that forward + backward (all_gather's backward
    gathers again in b bytes and reduce-scatters in f, Ulysses' moves its forward again)."""
    c_fwd, c_tot = tables.rule_coefficients(dtype)
    b, f = element_bytes(dtype)
    assert (c_fwd, c_tot) == (1, Fraction(2 * b, 2 * b + f))
    for hkv in (2, 4, 6, 8, 12, 16):
        for G in range(1, 9):
            for P in (p for p in range(2, hkv + 1) if hkv % p == 0):
                assert tables.traffic_ratios(G, P, dtype, hkv) == (c_fwd * (G + 1) / P, c_tot * (G + 1) / P), (hkv, G, P)


def test_the_rendered_rules_and_crossovers_are_the_cost_models(tables):
    text = tables.ulysses_rule()
    assert "`a2a` moves $\\frac{G + 1}{P}$ times `all_gather`'s bytes, so less once $P > G + 1$" in text
    assert "**Forward + backward**, $\\frac{G + 1}{2P}$ times, so less once $P > \\frac{G + 1}{2}$" in text
    assert "In float32, where the reduce-scatters' 4 bytes are the input's, $\\frac{2(G + 1)}{3P}$" in text
    assert "`p2p` moves as much as `all_gather` forward, and one block more backward" in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0].split()[0]) for r in rows] == list(tables.RULE_GROUPS)
    for row in rows:
        G, (fwd, total, least) = int(row[0].split()[0]), (cell.strip() for cell in row[-3:])
        valid = [P for P in tables.RULE_P if tables.traffic_ratios(G, P) is not None]
        for stated, c in ((fwd, 1), (total, Fraction(1, 2))):  # bf16: (G + 1) / P and (G + 1) / 2P
            first = min(P for P in valid if P > c * (G + 1))
            if first <= tables.RULE_HKV:  # no replicated heads: the formula's crossover
                assert stated == str(first), (G, stated, first)
        assert least == total  # where a2a moves less than all_gather, it moves the least of the four


# A rule comparing Ulysses with all-gather names G + 1. Stated where the forward alone is counted, it says so and gives
# the forward + backward rule beside it (in the same paragraph or list item).
RULE = re.compile(r"G\s*\+\s*1")


def _guide_modules() -> list[str]:
    tree = ast.parse((ROOT / "docs" / "gen_pages.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GUIDE" for t in node.targets):
            return [module for _, _, module in ast.literal_eval(node.value)]
    raise AssertionError("docs/gen_pages.py has no GUIDE")


def _rule_texts():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("learn/*.md"))]:
        yield str(page.relative_to(ROOT)), page.read_text()
    for module in _guide_modules():
        yield module, importlib.import_module(module).__doc__ or ""


def _units(text: str) -> list[str]:
    """Paragraphs, each list item on its own, code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [unit for paragraph in re.split(r"\n\s*\n", text) for unit in re.split(r"\n(?=\s*(?:[*-]|\d+\.)\s)", paragraph)]


def rules_without_the_backward(where: str, text: str) -> list[str]:
    return [f"{where}: {' '.join(unit.split())[:200]}" for unit in _units(text)
            if RULE.search(unit) and not (re.search(r"forward", unit, re.I) and re.search(r"forward \+ backward", unit, re.I))]  # fmt: skip


def test_every_stated_rule_counts_the_backward_too():
    found = [line for where, text in _rule_texts() for line in rules_without_the_backward(where, text)]
    assert found == [], "\n".join(found)


def test_a_forward_only_rule_is_found():
    bad = "* **`a2a`** moves $\\frac{G + 1}{P}$ times all-gather's traffic: the least of all once $P > G + 1$."
    good = ("* **`a2a`** moves $\\frac{G + 1}{P}$ times all-gather's forward traffic (less once $P > G + 1$); "
            "forward + backward, $\\frac{G + 1}{2P}$ times in bf16.")
    assert len(rules_without_the_backward("x", f"Intro.\n\n{bad}\n{good}\n")) == 1
