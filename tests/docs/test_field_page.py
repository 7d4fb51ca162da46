"""docs/field-bugs.md names the test that catches each bug: every name it gives must exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_every_test_the_field_page_names_exists():
    page = (ROOT / "docs" / "field-bugs.md").read_text()
    named = NAMED.findall(page)
    assert len(named) >= 20  # two or so a bug, and the tolerance section's
    missing = [f"{path}::{name}" for path, name in named
               if not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M)]  # fmt: skip
    assert not missing, f"docs/field-bugs.md names tests that do not exist: {missing}"
