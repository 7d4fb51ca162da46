"""The mask probe (`sim.tools.verify.probe`, issue 58 item 2): which pairs each rank attended, against the mask's.

One launch of 2 gloo processes (documents of 40, 56 and 24 tokens, T = 120): cpref's four modes pass under causal
documents, a window and two masks; the three field bugs of `tests.backends.probe_impls` (a window dropped, a mask
replaced by causal, documents not isolated) fail on every rank, each with the counts and first positions computed
here from the dense masks, independently of the probe; padded documents through an adapter whose backward raises
pass, counting real queries only. One more launch runs the command-line hook; a batch too large for the probe is
refused in one line before any process starts; an output written here (no process) shows how the heads combine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import cpref
from sim.tools.verify.cases import Case, Setup, case_mask, lengths
from sim.tools.verify.probe import MAX_T, check_mask
from sim.tools.verify.probe import __doc__ as PROBE_DOC
from sim.tools.verify.probe_pairs import compare, keys, probe_sharding

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "verify-reference.md"
SETUP = Setup(docs=(40, 56, 24), heads=(2, 2))
BUGS = "tests.backends.probe_impls:"
CPREF = "tests.backends.verify_impls:cpref_over_group"
W = 7  # the window: (7, 0)
MODES = sorted(cpref.MODES)
OPTS = {m: tuple(cpref.MODES[m].example_options(2).items()) for m in MODES}  # a2a+p2p: a2a_size=2

PASSING = [Case(m, "zigzag", "fp64", 2, impl=impl, options=OPTS[m], **extra) for m in MODES for impl in ("cpref", CPREF)
           for extra in ({}, {"window": (W, 0)}, {"mask": "random"}, {"mask": "shared-prompt"})]  # fmt: skip
WINDOW = Case("p2p", "zigzag", "fp64", 2, window=(W, 0), impl=BUGS + "drops_window")
MASKED = [Case("a2a", "zigzag", "fp64", 2, mask=name, impl=BUGS + "mask_replaced_by_causal")
          for name in ("random", "prefix-lm")]  # fmt: skip
DOCS = Case("all_gather", "zigzag", "fp64", 2, impl=BUGS + "documents_not_isolated")
PADDED = Case("p2p", "zigzag", "fp64", 2, padded=True, impl=BUGS + "without_backward")  # documents 39,55,23 in 40,56,24
CASES = [*PASSING, PADDED, WINDOW, *MASKED, DOCS]


@pytest.fixture(scope="module")
def report():
    return check_mask(CASES, SETUP, nproc=2, timeout=60.0)


def rows_of(report, case: Case) -> list:
    return [r for r in report.rows if r.case == case]


# ---- the truth, written here from the documents and the mask's own dense matrix -----------------------------------
def docs_and_positions(case: Case) -> list[tuple[int, int]]:
    """`(document, position in it)` of every real token."""
    return [(d, p) for d, n in enumerate(lengths(SETUP, case)[0]) for p in range(n)]


def causal_documents(case: Case) -> torch.Tensor:
    at = docs_and_positions(case)
    return torch.tensor([[a[0] == b[0] and b[1] <= a[1] for b in at] for a in at])  # (T, T)


def expected(case: Case, truth: torch.Tensor, done: torch.Tensor) -> list[tuple[int, int, int, list[int]]]:
    """Per rank: `(forbidden pairs, missed pairs, first forbidden query, its forbidden keys)` of an implementation
    that attends `done` where `truth` is the mask (the batch has no padding: stream index = real index)."""
    out = []
    for r in range(case.cp):
        rows = sorted(probe_sharding(SETUP, case).global_index(r).tolist())
        bad, lost = (done & ~truth)[rows], (truth & ~done)[rows]  # (T / P, T)
        first = next((i for i in range(len(rows)) if bad[i].any()), None)
        ks = [] if first is None else bad[first].nonzero().flatten().tolist()
        out.append((int(bad.sum()), int(lost.sum()), None if first is None else rows[first], ks))
    return out


def test_cprefs_modes_attend_exactly_the_mask_under_causal_a_window_and_masks(report):
    """Every mode, cpref itself and over a process group's TorchComm: every rank attends every allowed pair and no
    other, under causal documents, a window of 7 and the random and shared-prompt masks."""
    for case in PASSING:
        rows = rows_of(report, case)
        assert len(rows) == 2 and all(r.ok for r in rows), "\n".join(r.format() for r in rows)
        want = case_mask(SETUP, case).dense() if case.mask else causal_documents(case)
        if case.windowed:
            at = docs_and_positions(case)
            want &= torch.tensor([[a[1] - b[1] <= W for b in at] for a in at])
        index = probe_sharding(SETUP, case).global_index
        assert [r.attended for r in rows] == [int(want[index(r)].sum()) for r in (0, 1)]


def test_only_real_queries_count_and_no_backward_runs(report):
    """Padded documents, through an adapter whose backward raises: both ranks pass, each attending the causal pairs
    of its real queries only (the padding's rows are not read)."""
    sharding = probe_sharding(SETUP, PADDED)
    real = sharding.pad(torch.arange(sum(lengths(SETUP, PADDED)[0])), value=-1)  # (T,): real index, -1 padding
    causal, queries = causal_documents(PADDED), 0
    for row in rows_of(report, PADDED):
        mine = [int(real[x]) for x in sharding.global_index(row.cp_rank) if real[x] >= 0]
        assert row.ok and row.attended == int(causal[mine].sum())
        queries += len(mine)
    assert queries == 39 + 55 + 23 < sharding.total  # rank 0 holds the padding


def test_a_pair_any_head_attended_is_attended_a_pair_any_head_missed_is_missed():
    """Rank 0's output written here (no process): head 0 exactly the weights, head 1 one pair moved from the first
    allowed key of the last query to a later key of its document, after the query: one pair attended, one missed."""
    case, sharding = Case("p2p", "zigzag", "fp64", 2), probe_sharding(SETUP, Case("p2p", "zigzag", "fp64", 2))
    rows = sharding.global_index(0)  # (T / P,)
    seen = causal_documents(case)[rows].double()  # (T / P, T)
    out = (seen / seen.sum(1, keepdim=True))[:, None, :].repeat(1, 2, 1)  # (T / P, Hq = 2, T)
    last = int(rows.argmax())  # query 119, the last of document 2 (96..119)
    out[last, 1, 96], out[rows.tolist().index(115), 1, 116] = 0.0, 1.0  # query 115 sees key 116 in head 1
    row = compare(SETUP, case, 0, 2, out)
    assert {k: c for k, (c, _) in row.wrong.items()} == {"after the query": 1} and row.missed[0] == 1
    want = "1 pair after the query (query 115 saw key 116); 1 pair missed (query 119 did not see key 96)"
    assert want in row.format()
    assert row.format().startswith("rank 0: FAIL: ")


def test_a_dropped_window_is_reported_as_pairs_outside_the_window(report):
    """`drops_window` attends causal documents: every rank attends pairs `pos(x) - pos(y) > 7` of its documents,
    all named "outside the window", none missed; the first query shown is the first that sees too far."""
    at = docs_and_positions(WINDOW)
    truth = torch.tensor([[a[0] == b[0] and 0 <= a[1] - b[1] <= W for b in at] for a in at])
    for row, (n, missed, x, ks) in zip(rows_of(report, WINDOW), expected(WINDOW, truth, causal_documents(WINDOW))):
        assert n > 0 and missed == 0 and not row.ok
        assert {k: c for k, (c, _) in row.wrong.items()} == {"outside the window": n} and row.missed[0] == 0
        assert f"{n} pairs outside the window (query {x} saw {keys(ks)}" in row.format(), row.format()
        assert row.format().endswith("; none missed")


@pytest.mark.parametrize("index", range(len(MASKED)), ids=[c.mask for c in MASKED])
def test_a_mask_replaced_by_causal_is_reported_as_pairs_outside_the_mask_and_pairs_missed(report, index):
    """`mask_replaced_by_causal` attends causal documents: under the random mask it attends pairs the mask forbids
    and misses pairs it allows; under prefix-LM it misses each prompt's pairs above the diagonal, and attends none
    too many; both counted as `mask.dense()` (cpref's matrix, not the oracle's the probe reads) says."""
    case = MASKED[index]
    truth = case_mask(SETUP, case).dense()
    for row, (n, missed, x, ks) in zip(rows_of(report, case), expected(case, truth, causal_documents(case))):
        assert not row.ok and row.missed[0] == missed > 0
        assert {k: c for k, (c, _) in row.wrong.items()} == ({"outside the mask": n} if n else {})
        if n:
            assert f"{n} pairs outside the mask (query {x} saw {keys(ks)}" in row.format(), row.format()
        assert f"; {missed} pairs missed (query " in row.format()
    if case.mask == "prefix-lm":  # a prompt of 20: its query 0 misses keys 1..19
        want = "missed (query 0 did not see keys 1..19; query 1 did not see keys 2..19; ...)"
        assert want in rows_of(report, case)[0].format()


def test_documents_not_isolated_are_reported_as_pairs_across_documents(report):
    """`documents_not_isolated` is causal over the whole packed stream: every query of document d sees every token
    of the documents before it, all named "across documents", none missed."""
    T = sum(lengths(SETUP, DOCS)[0])
    stream = torch.ones(T, T, dtype=torch.bool).tril()
    for row, (n, missed, x, ks) in zip(rows_of(report, DOCS), expected(DOCS, causal_documents(DOCS), stream)):
        assert missed == 0 and 40 <= x < 96 and ks == list(range(40))  # the first query of document 1 it holds
        assert {k: c for k, (c, _) in row.wrong.items()} == {"across documents": n}
        want = f"{n} pairs across documents (query {x} saw keys 0..39; query {x + 1} saw keys 0..39; ...); none missed"
        assert want in row.format()


def test_the_report_reads_as_the_docs_say(report):
    """The module docstring's and the page's example lines are this run's; the last line counts the rows."""
    text = report.format()
    fails = 2 * len([WINDOW, *MASKED, DOCS])
    last = f"{2 * len(CASES) - fails} of {2 * len(CASES)} rank rows attend the mask's pairs exactly; {fails} FAIL"
    assert text.splitlines()[-1] == last
    assert set(range(10, 30)) <= set(probe_sharding(SETUP, WINDOW).global_index(1).tolist())  # the page: rank 1's
    for doc in (PROBE_DOC, PAGE.read_text()):
        shown = re.search(r"```text\n(mask probe .*?)```", doc, re.S)
        assert shown is not None
        for line in shown.group(1).splitlines():
            assert line in text.splitlines(), line


def test_the_command_line_hook_probes_the_flags_cases_and_fails_a_dropped_window(capsys):
    """`--check-mask`, one launch: p2p, zigzag, a window of 7, two `--impl`s; `drops_window` fails
    on both ranks, `cpref_over_group` passes, the report is printed, then `mask check FAILED` (exit status 1)."""
    from sim.tools import verify

    argv = ["--nproc", "2", "--mode", "p2p", "--layout", "zigzag", "--docs", "40,56,24", "--window", "7,0"]
    assert verify.main([*argv, "--check-mask", "--impl", BUGS + "drops_window", "--impl", CPREF]) == 1  # the flag
    out = capsys.readouterr().out
    assert out.count("pairs outside the window") == 2 and out.count(": pass: ") == 2
    assert "mask probe p2p/zigzag/fp64/cp2/window=7,0 (tests.backends.probe_impls:drops_window): T=120" in out
    assert out.rstrip().endswith("2 of 4 rank rows attend the mask's pairs exactly; 2 FAIL\nmask check FAILED")


def test_a_batch_too_large_for_the_probe_is_refused_in_one_line_before_any_process_starts(capsys):
    """`Dv = T`: the default documents (4500 tokens) are refused, naming T, the limit and the fix (exit status 2)."""
    from sim.tools import verify

    assert verify.main(["--nproc", "2", "--mode", "p2p", "--layout", "zigzag", "--check-mask"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make T = 4500 tokens" in err and f"at most {MAX_T}" in err and "--docs" in err
    with pytest.raises(ValueError, match=f"at most {MAX_T}"):
        check_mask([Case("p2p", "zigzag", "fp64", 2)], Setup(docs=(300, 300)))


def test_a_case_the_implementation_refuses_is_skipped_by_the_probe_too():
    """An adapter's NotImplementedError (raised before it communicates, on every rank) is a skipped row, not an
    abort; the other cases are probed."""
    from sim.tools.verify.cases import Case, Setup

    impl = "tests.backends.verify_impls:refuses_windows"
    cases = [Case("p2p", "zigzag", "fp64", cp=2, impl=impl, window=w) for w in ((-1, -1), (7, 0))]
    report = check_mask(cases, Setup(docs=(40, 56, 24), heads=(2, 2)))
    assert [(r.ok, r.skipped) for r in report.rows] == [(True, False)] * 2 + [(True, True)] * 2
    assert report.format().splitlines()[-1] == "2 of 4 rank rows attend the mask's pairs exactly; 2 skipped"
    assert "rank 0: skipped (no sliding window" in report.format()
