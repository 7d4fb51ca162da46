"""`python -m sim verify` on gloo: every mode rank by rank, `--impl`, and faults that never hang.

Process start-up costs seconds, so cases are batched: one world of 4 runs the whole sweep
(every mode of `cpref.MODES` x layout x fp32/bf16 x unpadded/padded, at CP 4 over the world
and at CP 2 as DP 2 x CP 2 with the non-consecutive CP groups {0, 2} and {1, 3}; a2a+p2p as
2 x 2 at CP 4); one launch of 2 checks a correct and a wrong `--impl`; each fault is one small
launch that must end in a clear report, non-zero, within the process-group timeout. A mode
added to `cpref.MODES` joins every check by itself.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpref
from sim import verify
from sim.progress import Progress
from sim.verify_cases import Case, Setup, build_cases, cp_groups, lengths, placement

ROOT = Path(__file__).resolve().parents[2]
MODES = sorted(cpref.MODES)
SETUP = Setup(docs=(24, 56, 16))  # multiples of 8 = 2P at P = 4; padded: 23, 55, 15
SMALL = ["--docs", "24,56,16", "--timeout", "30"]
IMPLS = "tests.backends.verify_impls"


def sweep_cases() -> list[Case]:
    """Every mode x layout x fp32/bf16 x unpadded/padded at CP 4 and at DP 2 x CP 2 (strided); some full masks."""
    cases = []
    for cp, strided in ((4, False), (2, True)):
        cases += build_cases(MODES, cpref.LAYOUTS, ("fp32", "bf16"), cp=cp, strided=strided, padded=(False, True))
    return cases + build_cases(MODES, ["zigzag"], ["fp32"], cp=4, padded=(True,), causal=False)


def failing_rows(report) -> str:
    return "\n".join(f"{r.case.label} rank {r.rank}: {r.status} {r.errors} {r.note}" for r in report.rows if not r.ok)


def test_every_mode_layout_dtype_and_placement_rank_by_rank():
    cases = sweep_cases()
    report = verify.run(cases, SETUP, nproc=4, timeout=60.0)
    assert report.ok, "rank rows failed:\n" + failing_rows(report)
    # one row per case and world rank, each CP group against its own ground truth
    assert len(report.rows) == 4 * len(cases)
    assert {r.case.mode for r in report.rows} == set(MODES)
    dp_cp = {(r.rank, r.dp, r.cp_rank) for r in report.rows if r.case.strided}
    assert dp_cp == {(0, 0, 0), (2, 0, 1), (1, 1, 0), (3, 1, 1)}  # CP groups {0, 2} and {1, 3}
    hierarchical = [m for m in MODES if "a2a_size" in dict(cpref.MODES[m].options)]
    assert all(dict(r.case.options) == {"a2a_size": 2} for r in report.rows if r.case.mode in hierarchical)
    # the simulated cluster agrees with the oracle, so the oracle column repeats the largest error
    assert all(abs(r.oracle - max(r.errors.values())) < 1e-9 for r in report.rows)
    assert "rank rows pass" in report.format().splitlines()[-1]


def test_impl_right_and_wrong_through_the_command_line(capsys):
    argv = ["--nproc", "2", "--layout", "zigzag", "--dtype", "fp32,bf16", *SMALL,
            "--impl", f"{IMPLS}:cpref_over_group", "--impl", f"{IMPLS}:biased_on_rank_1"]  # fmt: skip
    assert verify.main(argv) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(IMPLS)]
    assert len(rows) == 2 * len(MODES) * 2 * 2  # impls x modes x dtypes x ranks
    for row in rows:  # impl mode ... rank dp r out dq dk dv tol oracle result
        rank, status, tol = int(row[-10]), row[-1], float(row[-3])
        out_err, *grad_errs = map(float, row[-7:-3])
        wrong = row[0].endswith(":biased_on_rank_1") and rank == 1
        assert status == ("FAIL" if wrong else "pass"), row
        if wrong:  # the table points at rank 1's out, off by the bias; the gradients are fine
            assert out_err > 0.09 > max(grad_errs), row
        else:
            assert out_err <= tol, row
    assert "verification FAILED" in out


def fault(capsys, impl: str) -> str:
    """Run one case under a faulty `--impl`: exit status 1 within the 30 s timeout; return stderr."""
    start = time.monotonic()
    argv = ["--nproc", "2", "--mode", "all_gather", "--layout", "zigzag", *SMALL, "--impl", f"{IMPLS}:{impl}"]
    assert verify.main(argv) == 1
    assert time.monotonic() - start < 30.0  # ended by the failure, never by waiting for the timeout
    return capsys.readouterr().err


def test_a_rank_that_raises_is_named_with_its_case(capsys):
    err = fault(capsys, "raises_on_rank_1")
    assert "rank 1 raised CaseFailed: case all_gather/zigzag/fp32/cp2" in err
    assert "ValueError: rank 1 rejects its input" in err


def test_a_rank_killed_mid_collective_is_reported_by_signal(capsys):
    err = fault(capsys, "killed_mid_collective")
    assert "rank 1 was killed by signal 9 (SIGKILL) without reporting a result (of 2 ranks)" in err


def test_mismatched_inputs_fail_on_every_rank_alike(capsys):
    err = fault(capsys, "mismatched_causal")
    assert "pass different arguments" in err and "causal: rank 0: True; rank 1: False" in err
    assert "rank 0 raised CaseFailed" in err and "rank 1 raised CaseFailed" in err  # the same error everywhere


def test_runs_unchanged_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "sim", "verify", "--mode", "all_gather", *SMALL]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("all_gather") == 4 and "verification passed" in done.stdout  # printed once, by rank 0


# --- no processes: the pieces ----------------------------------------------------------------


def test_cases_follow_modes_and_pass_a2a_size_only_to_the_modes_that_take_it():
    cases = build_cases(MODES, ["zigzag"], ["fp32"], cp=4, a2a_size=None)
    assert [c.mode for c in cases] == MODES
    for c in cases:
        assert dict(c.options) == ({"a2a_size": 2} if "a2a_size" in dict(cpref.MODES[c.mode].options) else {})
    assert {dict(c.options).get("a2a_size") for c in build_cases(MODES, ["zigzag"], ["fp32"], cp=3)} <= {None, 1}


def test_lengths_round_up_or_end_in_padding():
    setup = Setup(docs=(1000, 3000, 500))
    assert lengths(setup, Case("p2p", "zigzag", "fp32", cp=4)) == ((1000, 3000, 504), (1000, 3000, 504))
    real, padded = lengths(setup, Case("p2p", "contiguous", "fp32", cp=4, padded=True))
    assert real == (999, 2999, 499) and padded == (1000, 3000, 500)
    assert all(n % 4 for n in real)


def test_placement_of_consecutive_and_strided_cp_groups():
    assert cp_groups(8, 4, strided=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cp_groups(8, 4, strided=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for strided in (False, True):
        for g in range(8):
            dp, r = placement(g, 8, 4, strided)
            assert cp_groups(8, 4, strided)[dp][r] == g


def test_tolerances():
    assert Case("p2p", "zigzag", "bf16", cp=2).tol(Setup(heads=(8, 4))) == 3.5e-2
    assert Case("p2p", "zigzag", "bf16", cp=2).tol(Setup(heads=(8, 8))) == 2.5e-2
    assert [Case("p2p", "zigzag", d, cp=2).tol(SETUP) for d in ("fp64", "fp32", "fp16")] == [1e-10, 1e-5, 5e-3]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "ring"], "mode ['ring'] unknown"),
    (["--dtype", "fp8"], "dtype ['fp8'] unknown"),
    (["--docs", "10,x"], "comma-separated integers"),
    (["--heads", "8,3"], "Hkv >= 1 dividing Hq"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_any_process_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        verify.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_bad_cases_are_refused_before_any_process_starts(capsys):
    assert verify.main(["--nproc", "4", "--cp", "3"]) == 2
    assert "does not divide the world size 4" in capsys.readouterr().err
    assert verify.main(["--impl", "no_such_module:fn"]) == 2
    assert "--impl 'no_such_module:fn'" in capsys.readouterr().err


def test_progress_bar_draws_only_when_asked():
    stream = io.StringIO()
    bar = Progress(2, "cases", stream=stream, enabled=True)
    bar.step("a")
    bar.step("b")
    bar.close()
    assert "cases [" + "#" * 24 + "] 2/2 b" in stream.getvalue() and stream.getvalue().endswith("\n")
    quiet = io.StringIO()
    Progress(2, "cases", stream=quiet).step()  # not a terminal: nothing drawn
    assert quiet.getvalue() == ""
