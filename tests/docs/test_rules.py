"""A rule the site states on several pages is stated once, by one function, and filled in where it is shown.

Learn 6 said the end-of-document rank is slower "in every mode" while Learn 7 said Ulysses has "no causal imbalance";
the reference said Ulysses' work is "balanced whatever the layout", which cpref's own split Ulysses over the stream
and balanced layouts is not without its balance. Now `docs/learn_text.py`'s `balance_rule` is the statement, each page
that needs it shows `{{ balance_rule }}`, and the old phrasings, each a second statement, are refused anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from docs import learn_text

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("learn/layouts.md", "learn/ulysses.md", "learn/masks.md")
SECOND_STATEMENTS = re.compile(r"no (?:causal|such) imbalance|balanced\s+whatever the layout|equal under any mask"
                               r"|imbalance\s+whatever the layout|(?:slower|more work)[^.]*in every mode", re.I)  # fmt: skip


def sources() -> list[Path]:
    return [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "learn").glob("*.md"), *(ROOT / "src").rglob("*.py"),
            *(ROOT / "sim").rglob("*.py")]  # fmt: skip


def test_the_pages_that_state_the_balance_rule_show_the_one_statement():
    assert all("{{ balance_rule }}" in (ROOT / "docs" / page).read_text() for page in PAGES)


def test_no_page_or_docstring_states_it_a_second_way():
    found = {str(p.relative_to(ROOT)): SECOND_STATEMENTS.findall(p.read_text()) for p in sources()}
    assert {path: hits for path, hits in found.items() if hits} == {}
    assert SECOND_STATEMENTS.findall("Ulysses has no causal imbalance; the rank is slower at every step of every mode")


def test_the_rule_names_every_layout_and_the_tolerance_it_balances_to():
    from cpref.batch.balanced import TOLERANCE

    rule = learn_text.balance_rule()
    assert all(layout in rule for layout in ("contiguous", "zigzag", "stream", "balanced"))
    assert f"{TOLERANCE:.0%}" in rule and "`a2a`" in rule and "`p2p`" in rule
