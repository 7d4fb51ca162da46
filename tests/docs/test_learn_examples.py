"""The Learn CP pages' examples (`examples/learn/*.py`) run and show what their pages say they show.

Each page includes its example by region and prints its output, run when the site is built; these tests hold
the output to the claim the page makes of it: the by-hand code equals the oracle in FP64, the merge is exact,
a rank alone is wrong, zigzag balances what contiguous does not, the by-hand Ulysses moves what cpref's does.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "learn"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if p.stem != "__init__")
EXACT = 1e-12  # FP64 against the FP64 oracle: a few ulps; a wrong mask or merge is off by >= 1e-2


def output(name: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        runpy.run_module(f"examples.learn.{name}", run_name="__main__")
    return buffer.getvalue()


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d[\d,]*\.?\d*(?:e[+-]\d+)?", line.replace(",", ""))]


def test_every_example_has_a_page_that_includes_it():
    pages = "\n".join(p.read_text() for p in (EXAMPLES.parents[1] / "docs" / "learn").glob("*.md"))
    assert NAMES and all(f"examples/learn/{name}.py" in pages for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_error_an_example_prints_is_fp64_exact_unless_it_shows_a_wrong_result(name):
    lines = [line for line in output(name).splitlines() if "error" in line and "alone" not in line]
    for line in lines:
        errors = numbers(line.split("error", 1)[1].split(":")[-1])  # after "rank 0..3:" where a line has it
        assert errors and max(errors) < EXACT, line


def test_problem_a_rank_alone_is_wrong_except_rank_0_and_cp_is_right():
    alone, with_cp = (numbers(line.split(":")[-1]) for line in output("problem").splitlines())
    # rank 0's queries see only their own keys (causal), so alone is right there and only there
    assert alone[0] < EXACT and min(alone[1:]) > 0.1
    assert max(with_cp) < EXACT


def test_collectives_give_what_their_definitions_say():
    got = {}
    op = None
    for line in output("collectives").splitlines():
        if not line.startswith(" "):
            op = line.split(":")[0]
        else:
            rank, values = re.match(r"\s*rank (\d+) gets \[(.*)\]", line).groups()
            got[op, int(rank)] = [int(v) for v in values.split(", ")]
    P = 4
    for r in range(P):
        assert got["all_gather", r] == [s for s in range(P) for _ in range(2)]
        assert got["reduce_scatter", r] == [sum(10 * s + r for s in range(P))]
        assert got["all_to_all", r] == [10 * s + r for s in range(P)]
        assert got["send_recv", r] == [(r - 1) % P] * 2


def test_merge_gives_the_whole_rows_lse():
    first = output("merge").splitlines()[0]
    lse_a, lse_b, merged, whole = numbers(first.split(":", 1)[1])
    assert merged == whole and merged > max(lse_a, lse_b)


def test_ring_shifts_p_minus_1_blocks_forward_and_its_backward_carries_float32_gradients():
    lines = {line.split(":")[0]: line for line in output("ring").splitlines()}
    assert lines["forward"].startswith("forward: 3 shifts")  # P - 1 = 3 shifts of K and V together
    backward = lines["backward"].split(":", 1)[1]
    assert "float32" in backward and "bfloat16" in backward  # dK/dV travel in fp32, K/V in bf16


def test_layouts_zigzag_balances_the_causal_work_and_contiguous_does_not():
    ratio = {line.split(":")[0]: numbers(line.split("=")[-1])[0] for line in output("layouts").splitlines()
             if "slowest / mean" in line}  # fmt: skip
    assert ratio["zigzag"] == 1.0 and ratio["contiguous"] > 1.5


def test_ulysses_by_hand_moves_what_cpref_moves():
    lines = output("ulysses").splitlines()
    by_hand = [line.split(":", 1)[1] for line in lines if line.startswith("by hand: all_to_all")]
    cpref_a2a = [line.split(":", 1)[1] for line in lines if line.startswith("cpref a2a:")]
    assert len(by_hand) == len(cpref_a2a) == 1 and by_hand == cpref_a2a


def test_hierarchy_runs_the_all_to_all_inside_groups_and_the_ring_across():
    text = output("hierarchy")
    assert "all_to_all on ranks (0, 1)" in text and "send_recv on ranks (0, 2)" in text
    assert "all_to_all on ranks (0, 2)" not in text and "send_recv on ranks (0, 1)" not in text


def test_which_mode_matches_the_issue_44_figures_forward_plus_backward():
    rows = {int(numbers(line)[0]): dict(re.findall(r"([\w+]+) (\d[\d,]*\d)", line.split(":", 1)[1]))
            for line in output("which_mode").splitlines()}  # fmt: skip
    # GQA G = 4 at P = 4: a2a 960 MiB against all_gather's 1,536 (forward + backward, bf16, 128k tokens)
    assert rows[4]["all_gather"] == "1,536" and rows[4]["a2a"] == "960"


CODE_WIDTH = 81  # characters a line of the site's code blocks shows without wrapping: 81 fit, 82 wrap (measured)


@pytest.mark.parametrize("name", NAMES)
def test_every_line_fits_the_code_block(name):
    """A longer line wraps in the page's code block, and a wrapped comment reads as broken indentation."""
    long = [f"{i}: {len(line)}" for i, line in enumerate((EXAMPLES / f"{name}.py").read_text().splitlines(), 1)
            if len(line) > CODE_WIDTH]  # fmt: skip
    assert long == [], f"examples/learn/{name}.py: lines over {CODE_WIDTH} characters (line: length)"


def learn_order() -> dict[str, int]:
    """`docs/gen_pages.py`'s `LEARN`, read as source (importing it needs mkdocs): page file -> its number."""
    import ast

    source = (EXAMPLES.parents[1] / "docs" / "gen_pages.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LEARN":
            return {page: int(title.split(".")[0]) for page, title in ast.literal_eval(node.value)}
    raise AssertionError("docs/gen_pages.py has no LEARN")


def test_every_page_and_example_says_its_own_number():
    """A page's title and its example's "Learn CP, page N" carry the number of its place in `LEARN`: reordering
    the path (the merge moved after all-gather) cannot leave a page or an example with its old number."""
    order, wrong = learn_order(), []
    for page, number in order.items():
        text = (EXAMPLES.parents[1] / "docs" / page).read_text()
        if not text.startswith(f"# {number}. "):
            wrong.append((page, text.splitlines()[0]))
        for name in re.findall(r"examples/learn/(\w+)\.py", text):
            head = (EXAMPLES / f"{name}.py").read_text().split("\n", 1)[0]
            if not head.startswith(f'"""Learn CP, page {number}:'):
                wrong.append((page, name, head))
    assert order and wrong == []


def test_pages_link_each_other_by_title_not_by_number():
    """"(page 6 fixes that)" went stale when the path was reordered; a link to the page cannot."""
    prose = {page: re.sub(r"```.*?```", "", (EXAMPLES.parents[1] / "docs" / page).read_text(), flags=re.S)
             for page in learn_order()}  # fmt: skip
    numbered = {page: re.findall(r"\b(?:[Pp]age|Learn) \d+\b", text) for page, text in prose.items()}
    assert {page: found for page, found in numbered.items() if found} == {}
    assert re.findall(r"\b(?:[Pp]age|Learn) \d+\b", "as page 6 shows; Learn 7 too") == ["page 6", "Learn 7"]


def test_every_learn_page_is_short():
    """Each Learn page one idea, under ~1,200 words of prose (code and output blocks aside): the performance page
    had grown to 10,000 words, and a learner reads a page at a sitting."""
    prose = {page: len(re.sub(r"```.*?```", "", (EXAMPLES.parents[1] / "docs" / page).read_text(), flags=re.S).split())
             for page in learn_order()}  # fmt: skip
    assert {page: words for page, words in prose.items() if words > 1200} == {}
