"""The glossary defines every term the Learn CP path teaches, and each definition links where it is taught.

A learner meets a term on a Learn page and looks it up; a term the path uses without a glossary row leaves
them stuck. The terms: those issue 44 names, and every term a Learn page introduces in bold.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
NAMED = ["Ulysses", "all-to-all", "reduce-scatter", "THD", "EOD", "lse", "zigzag", "halo"]
# A bold phrase on a Learn page that is emphasis, not a term, and the glossary row a term is defined under.
NOT_TERMS = {"the precise story:", "forward and backward", "every document"}
SAME = {"log-sum-exp": "lse", "replicated": "replication", "collectives": "collective", "a2a groups": "hierarchical",
        }  # fmt: skip


def glossary_terms() -> set[str]:
    """The first cell of every table row of the glossary, split at commas (`MHA, GQA, MQA`)."""
    cells = re.findall(r"^\|\s*([^|]+?)\s*\|", (DOCS / "glossary.md").read_text(), flags=re.M)
    return {term.strip().strip("`$").lower() for cell in cells for term in cell.split(",")}


def bold_terms() -> set[str]:
    text = "\n".join(p.read_text() for p in (DOCS / "learn").glob("*.md"))
    return {t.lower() for t in re.findall(r"\*\*([^*{}]+)\*\*", text)} - NOT_TERMS


def test_every_term_the_learn_path_uses_has_a_glossary_row():
    terms = glossary_terms()
    missing = [t for t in NAMED if t.lower() not in terms]
    missing += [t for t in sorted(bold_terms()) if SAME.get(t, t).lower() not in terms]
    assert missing == []


def test_a_missing_term_is_found():
    assert "no-such-term" not in glossary_terms() and {"lse", "mha", "gqa", "all-to-all"} <= glossary_terms()
