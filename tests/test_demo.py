"""`make demo` runs, checks itself against the oracle, and prints what the theory predicts."""

import pytest
import torch

import cpref
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from sim.tools import demo
from tests.helpers import expected_costs


@pytest.mark.full
def test_demo_runs_and_reports(capsys):
    assert demo.main([]) == 0
    out, verified = capsys.readouterr().out.split("Part 3:")
    P = demo.P
    # block metric: contiguous rank r does (r + 1) c^2 per document, so max/mean = 2P / (P + 1); zigzag: 1
    assert f"block metric = {2 * P / (P + 1):.3f}" in out
    assert "exact scores = 1.000, block metric = 1.000" in out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.strip().split()[:1] and line.split()[0] in cpref.MODES}
    assert set(rows) == {(m, lay) for m in cpref.MODES for lay in cpref.LAYOUTS}
    for (mode, layout), cols in rows.items():
        assert float(cols[2]) <= 1e-10  # max |err| against the oracle
        if layout == "zigzag":
            assert cols[3] == "1.00"  # every rank does the same kernel work
        sharding = cpref.Sharding(demo._cu(demo.LENGTHS), cp_size=P, layout=layout)
        costs = expected_costs(mode, sharding, (demo.HQ, demo.HKV, demo.D, demo.D), torch.float64)
        assert int(cols[4]) == costs.forward_bytes + costs.backward_bytes  # bytes sent per rank
        if mode in ("a2a", "a2a+p2p") and layout not in CHUNKED_LAYOUTS:  # split: ranks save differently, within the bound
            assert max(int(x) for x in cols[5].split("-")) <= costs.saved_bytes
        else:
            assert int(cols[5]) == costs.saved_bytes
    assert "within 1e-10" in out
    # part 3: the production path on 2 gloo processes: a passing row per mode, layout and rank
    rows = [line.split() for line in verified.splitlines() if line.split()[:1] and line.split()[0] in cpref.MODES]
    seen = {(r[0], next(w for w in r if w in cpref.LAYOUTS), int(r[-11])) for r in rows}  # ... rank dp r out dq dk dv tol err/tol oracle result
    assert seen == {(m, lay, rank) for m in cpref.MODES for lay in cpref.LAYOUTS for rank in (0, 1)}
    assert len(rows) == len(seen) and all(r[-1] == "pass" for r in rows)
    assert "verification passed" in verified
    # every table says what it shows and explains its columns, in words (the key names every column)
    assert out.count("What this shows:") == 2 and demo.PART1_KEY in out and demo.PART2_KEY in out
    # parts 1 and 2 are the quickstart page's output: every line fits its code block (81), a table never wraps
    assert max(len(line) for line in out.splitlines()) <= demo.WIDTH
    for column in ("tokens", "exact scores", "block metric", "imbalance", "max|err|", "work", "sent",
                   "saved", "calls", "collectives"):  # fmt: skip
        assert f"{column} = " in out, column
    from sim.tools.verify.table import KEY

    assert KEY in verified and all(f"{c} = " in KEY for c in ("cp", "rank", "dp", "r", "vs P=1", "oracle"))
