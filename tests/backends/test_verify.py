"""`python -m sim verify` on gloo: every mode rank by rank, `--impl`, and faults that never hang.

Process start-up costs seconds, so cases are batched: one world of 4 runs the whole sweep
(every mode of `cpref.MODES` x layout x fp32/bf16 x unpadded/padded, at CP 4 over the world
and at CP 2 as DP 2 x CP 2 with the non-consecutive CP groups {0, 2} and {1, 3}; a2a+p2p as
2 x 2 at CP 4); one launch of 2 checks a correct `--impl` and two wrong ones (one inside the
fixed tolerance, which only the `vs P=1` column catches); one launch of 2 runs a sliding
window (`--window`) through every mode that takes one, beside an `--impl` that drops it; each
fault is one small launch that must end in a clear report, non-zero, within the
process-group timeout. A mode added to `cpref.MODES` joins every check by itself.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cpref
from sim.cluster.harness import run_attention
from sim.cluster.simcluster import SimCluster
from sim.tools import verify
from sim.tools.progress import Progress
from sim.tools.verify import cases_from_args, parse_args, table, truth
from sim.tools.verify.cases import Case, Setup, build_cases, cp_groups, lengths, make_batch, placement
from sim.tools.verify.rank import run_without_cp
from sim.tools.verify.table import Report
from sim.tools.verify.truth import check, compare, ground_truth
from tests.backends.verify_impls import WITHIN_TOLERANCE

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
    cases += build_cases(["all_gather"], cpref.LAYOUTS, ("fp32", "bf16"), cp=4, padded=(False, True), options={"overlap": True})
    # Ulysses in head groups: at CP 2 every rank holds 2 of the 4 key/value heads, one per group
    cases += build_cases(["a2a"], cpref.LAYOUTS, ("fp32", "bf16"), cp=2, strided=True, padded=(True,), options={"head_groups": 2})
    # the hierarchy in head groups: two a2a groups of two (2 key/value heads on each rank), a ring of two per group
    cases += build_cases(["a2a+p2p"], cpref.LAYOUTS, ("fp32", "bf16"), cp=4, padded=(True,),
                         options={"a2a_size": 2, "head_groups": 2})  # fmt: skip
    return cases + build_cases(MODES, ["zigzag"], ["fp32"], cp=4, padded=(True,), causal=False)


def failing_rows(report) -> str:
    return "\n".join(f"{r.case.label} rank {r.rank}: {r.status} {r.errors} {r.note}" for r in report.rows if not r.ok)


@pytest.mark.full
def test_every_mode_layout_dtype_and_placement_rank_by_rank():
    cases = sweep_cases()
    report = verify.run(cases, SETUP, nproc=4, timeout=60.0)
    assert report.ok, "rank rows failed:\n" + failing_rows(report)
    # one row per case and world rank, each CP group against its own ground truth
    assert len(report.rows) == 4 * len(cases)
    assert {r.case.mode for r in report.rows} == set(MODES)
    dp_cp = {(r.rank, r.dp, r.cp_rank) for r in report.rows if r.case.strided}
    assert dp_cp == {(0, 0, 0), (2, 0, 1), (1, 1, 0), (3, 1, 1)}  # CP groups {0, 2} and {1, 3}
    hierarchical = [m for m in MODES if "a2a_size" in cpref.MODES[m].defaults()]
    assert all(dict(r.case.options).get("a2a_size") == 2 for r in report.rows if r.case.mode in hierarchical)
    assert {r.case.layout for r in report.rows if dict(r.case.options).get("overlap")} == set(cpref.LAYOUTS)
    grouped = {(r.case.mode, r.case.layout) for r in report.rows if dict(r.case.options).get("head_groups") == 2}
    assert grouped == {(m, lay) for m in ("a2a", "a2a+p2p") for lay in cpref.LAYOUTS}
    # the simulated cluster agrees with the oracle, so the oracle column repeats the largest error
    assert all(abs(r.oracle - max(r.errors.values())) < 1e-9 for r in report.rows)
    assert "rank rows pass" in report.format().splitlines()[-1]


@pytest.mark.full
def test_impl_right_and_wrong_through_the_command_line(capsys):
    argv = ["--nproc", "2", "--layout", "zigzag", "--dtype", "fp32,bf16", *SMALL, "--impl", f"{IMPLS}:cpref_over_group",
            "--impl", f"{IMPLS}:biased_on_rank_1", "--impl", f"{IMPLS}:off_within_tolerance_on_rank_1"]  # fmt: skip
    assert verify.main(argv) == 1
    out = capsys.readouterr().out
    rows = {}  # (impl, mode, dtype, rank) -> (out, dq, dk, dv errors, tol, vs-P=1 ratio, <=2 or >2, status)
    for row in (line.split() for line in out.splitlines() if line.startswith(IMPLS)):  # impl mode [a2a_size] layout dtype
        errors = tuple(map(float, row[-10:-6]))  # pad baseline cp rank dp r out dq dk dv tol err/tol vs-P=1 (2) oracle result
        rows[row[0].split(":")[1], row[1], row[-17], int(row[-13])] = (*errors, float(row[-6]), float(row[-4]), row[-3], row[-1])
    assert len(rows) == 3 * len(MODES) * 2 * 2  # impls x modes x dtypes x ranks
    for (impl, mode, dtype, rank), (out_err, *grad_errs, tol, ratio, within, status) in rows.items():
        wrong = impl != "cpref_over_group" and rank == 1
        assert status == ("FAIL" if wrong else "pass") and within == (">2" if wrong else "<=2"), (impl, mode, dtype, rank)
        assert (ratio > 2) == wrong
        if impl == "biased_on_rank_1" and wrong:  # the table points at rank 1's out, off by the bias; the gradients are fine
            assert out_err > 0.09 > max(grad_errs)
        elif wrong:  # off within the fixed tolerance: only the vs-P=1 column fails it; its gradients are the right ones
            assert out_err < 0.09 and grad_errs == list(rows["cpref_over_group", mode, dtype, rank][1:4])
        else:
            assert out_err <= tol
    assert "verification FAILED" in out


@pytest.mark.full
def test_a_window_reaches_every_rank_the_run_without_cp_and_the_truth(capsys):
    """`--window 5,0` on 2 gloo ranks: cpref passes against the windowed truth in every mode that takes a
    window, and an `--impl` that drops the window fails on every rank (the truth is windowed, the ranks get it)."""
    windowed = [m for m in MODES if cpref.MODES[m].windows]
    argv = ["--nproc", "2", "--layout", "zigzag", "--padded", "--window", "5,0", *SMALL, "--impl", "cpref",
            "--impl", f"{IMPLS}:drops_window"]  # fmt: skip
    assert verify.main(argv) == 1
    out = capsys.readouterr().out
    assert "causal, window 5,0, seed 0" in out  # the run's description names the window
    skipped = sorted(set(MODES) - set(windowed))
    assert ("note: --window 5,0 skips mode " + ", ".join(skipped) in out) == bool(skipped)
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("impl "))
    assert head.split()[:6] == ["impl", "mode", "layout", "dtype", "pad", "window"]
    rows = [line.split() for line in lines if line.startswith(("cpref ", IMPLS))]  # impl mode [option] layout ...
    assert len(rows) == 2 * len(windowed) * 2 and {row[1] for row in rows} == set(windowed)  # impls x modes x ranks
    assert {row[-16] for row in rows} == {"5,0"}  # window baseline cp rank dp r out dq dk dv tol err/tol vs-P=1 (2) oracle result
    assert all(row[-1] == ("pass" if row[0] == "cpref" else "FAIL") for row in rows), out


@pytest.mark.full
def test_variants_reach_every_rank_the_run_without_cp_and_the_truth(capsys):
    """`--softcap 5 --chunk 16 --sinks 20` on 2 gloo ranks, every mode, padded, fp32 and bf16: cpref passes against
    the capped, chunked, sinked truth, the sinks' gradient summed over the group a fifth column, and an `--impl` that
    drops them fails on every rank."""
    argv = ["--nproc", "2", "--layout", "zigzag", "--padded", "--softcap", "5", "--chunk", "16", "--sinks", "20",
            "--dtype", "fp32,bf16", *SMALL, "--impl", "cpref", "--impl", f"{IMPLS}:drops_variants"]  # fmt: skip
    assert verify.main(argv) == 1
    out = capsys.readouterr().out
    assert "causal, softcap 5, chunk 16, sinks 20, seed 0" in out  # the run's description names them
    head = next(line for line in out.splitlines() if line.startswith("impl "))
    assert head.split()[-10:] == ["dq", "dk", "dv", "dsinks", "tol", "err/tol", "vs", "P=1", "oracle", "result"], head
    rows = [line.split() for line in out.splitlines() if line.startswith(("cpref ", IMPLS))]
    assert len(rows) == 2 * len(MODES) * 2 * 2  # impls x modes x dtypes x ranks
    assert all(row[-1] == ("pass" if row[0] == "cpref" else "FAIL") for row in rows), out


def test_variant_flags_reach_every_case_and_bad_ones_are_refused(capsys):
    cases = cases_from_args(parse_args(["--softcap", "30", "--chunk", "512", "--sinks", "20", "--layout", "zigzag"]), world=2)
    assert [c.mode for c in cases] == MODES
    assert {c.variants for c in cases} == {(("softcap", 30.0), ("chunk", 512), ("sinks", 20.0))}
    tail = "/softcap=30/chunk=512/sinks=20"
    assert all(c.label.endswith(tail + ("/a2a_size=2" if c.mode == "a2a+p2p" else "")) for c in cases)
    for argv, message in ((["--chunk", "0"], "argument --chunk"), (["--softcap", "-1"], "argument --softcap"),
                          (["--softcap", "nan"], "expected a finite number > 0, got 'nan'"),
                          (["--sinks", "0"], "argument --sinks"),
                          (["--softcap", "5", "--baseline", "sdpa"], "--baseline sdpa with --softcap 5: sdpa attends "
                                                                     "without the variants")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            verify.main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.full
def test_a_stream_sharded_peer_is_verified_rank_by_rank_on_a_packed_batch(capsys):
    """A DeepSpeed-style Ulysses over contiguous shards of the whole stream (`examples.stream_ulysses`) passes on
    a padded batch of several documents in fp32 and bf16, on every rank; the same peer without EOD reset (one
    document over the whole stream) fails on every rank: verification sees the documents it does not."""
    argv = ["--nproc", "2", "--mode", "a2a", "--layout", "stream", "--padded", "--dtype", "fp32,bf16",
            "--docs", "24,56,16,40", "--timeout", "30", "--impl", f"{IMPLS}:stream_ulysses",
            "--impl", f"{IMPLS}:stream_ulysses_without_eod_reset"]  # fmt: skip
    assert verify.main(argv) == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(IMPLS)]
    assert len(rows) == 2 * 2 * 2 and {row[2] for row in rows} == {"stream"}  # impls x dtypes x ranks
    for row in rows:
        assert row[-1] == ("pass" if row[0].endswith(":stream_ulysses") else "FAIL"), row


def test_window_flags_parse_to_cpref_s_canonical_window_and_reach_every_case():
    assert parse_args(["--no-causal", "--window", "-1,3"]).window == (-1, 3)  # read as --window=-1,3
    assert parse_args(["--window=4,-1"]).window == (4, 0)  # causal: right = 0
    plain = parse_args(["--window", "-1,0"])  # causal without a bound: no window, every mode runs
    assert plain.window == (-1, -1) and plain.modes == MODES and plain.skipped == []
    args = parse_args(["--no-causal", "--window", "4,3", "--layout", "zigzag"])
    windowed = [m for m in MODES if cpref.MODES[m].windows]
    cases = cases_from_args(args, world=2)
    assert [c.mode for c in cases] == windowed and {(c.window, c.causal) for c in cases} == {((4, 3), False)}
    assert all("/zigzag/fp32/cp2/full/window=4,3" in c.label for c in cases)


@pytest.fixture
def p2p_without_windows(monkeypatch):
    """`cpref.MODES` with p2p alone declaring no window, whatever the modes declare today (no process sees it)."""
    modes = {m: dataclasses.replace(spec, windows=m != "p2p") for m, spec in cpref.MODES.items()}
    monkeypatch.setattr(cpref, "MODES", modes)


@pytest.mark.full
def test_mode_all_skips_the_modes_without_windows_and_naming_one_is_refused(p2p_without_windows, capsys):
    args = parse_args(["--window", "3,0"])
    assert "p2p" not in args.modes and args.skipped == ["p2p"] and args.modes
    assert parse_args(["--mode", "all", "--window", "3,0"]).skipped == ["p2p"]
    with pytest.raises(SystemExit) as info:
        parse_args(["--mode", "p2p,all_gather", "--window", "3,0"])
    err = capsys.readouterr().err
    assert info.value.code == 2  # one line after the usage, no traceback
    assert err.splitlines()[-1].startswith("python -m sim verify: error: --window 3,0: mode p2p takes no sliding window;")
    with pytest.raises(ValueError, match=r"case p2p/zigzag/fp32/cp2/window=3,0: mode p2p takes no sliding window"):
        verify.run([Case("p2p", "zigzag", "fp32", cp=2, window=(3, 0))], SETUP)  # before any process starts
    assert verify.main(["--nproc", "4", "--cp", "3", "--window", "3,0"]) == 2  # refused before anything is printed
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "CP size 3 does not divide the world size 4" in err
    assert verify.main(["--nproc", "2", "--mode", "all", "--layout", "zigzag", "--window", "3,0", "--docs", "40,24"]) == 0
    assert "note: --window 3,0 skips mode p2p (no sliding window); the modes that take one: " in capsys.readouterr().out


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


@pytest.mark.full
def test_runs_unchanged_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "sim", "verify", "--mode", "all_gather", *SMALL]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("all_gather  ")]  # the table's rows
    assert len(rows) == 2 * len(cpref.LAYOUTS) and "verification passed" in done.stdout  # rank 0 prints


# --- no processes: the pieces ----------------------------------------------------------------


def test_cases_follow_modes_and_pass_a2a_size_only_to_the_modes_that_take_it():
    cases = build_cases(MODES, ["zigzag"], ["fp32"], cp=4, a2a_size=None)
    assert [c.mode for c in cases] == MODES
    for c in cases:
        assert dict(c.options) == ({"a2a_size": 2} if "a2a_size" in cpref.MODES[c.mode].defaults() else {})
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
    (["--docs", "10,x"], "comma-separated whole numbers >= 1"),
    (["--heads", "8,3"], "Hkv >= 1 dividing Hq"),
    (["--window", "3"], "argument --window: expected LEFT,RIGHT, two integers >= -1 (-1: unbounded), e.g. 127,0; got '3'"),
    (["--window", "3,0,1"], "expected LEFT,RIGHT, two integers >= -1"),
    (["--window", "3,x"], "got '3,x'"),
    (["--window", "1.5,0"], "got '1.5,0'"),
    (["--window", "3,-2"], "got '3,-2'"),
    (["--window", "-2,0"], "got '-2,0'"),
    (["--window"], "argument --window: expected one argument"),
    (["--window", "3,2"], "--window 3,2: window=(3, 2) with causal=True: a causal query sees no later key"),
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
    for argv, why in ((["--mode", "p2p", "--option", "overlap=True"], "--option overlap: no mode of ['p2p'] takes it"),
                      (["--option", "overlap"], "expected NAME=VALUE"),
                      (["--option", "overlap=yes please"], "must be a Python literal")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:  # the parser's error: before any process starts
            verify.main(argv)
        assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_an_option_reaches_only_the_modes_that_declare_it():
    args = parse_args(["--nproc", "2", "--option", "overlap=True", "--option", "save_gathered_kv=True"])
    cases = cases_from_args(args, 2)
    assert {c.mode for c in cases} == set(MODES)
    assert all(dict(c.options) == ({"overlap": True, "save_gathered_kv": True} if c.mode == "all_gather" else
                                   dict(cpref.MODES[c.mode].example_options(2))) for c in cases)  # fmt: skip


def simulated_results(case: Case) -> list:
    """`per_rank` as `sim.tools.verify.truth.check` takes it, without processes: every rank's results from the simulated
    cluster in the case's dtype (the production path's stand-in), and the run without CP on CP rank 0."""
    batch = make_batch(SETUP, case, dp=0)
    results, _ = run_attention(batch.q, batch.k, batch.v, batch.dout, batch.sharding, mode=case.mode,
                               cluster=SimCluster(case.cp, reduction="native"))  # fmt: skip
    without_cp = run_without_cp(case, SETUP, 0, torch.device("cpu"), cpref.TorchKernel())
    return [[(results[r], without_cp if r == 0 else None)] for r in range(case.cp)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_vs_p1_column_fails_an_error_inside_the_tolerance_that_doubles_the_kernels(dtype):
    """The column on its own (no processes): correct ranks are within 2x of the kernel without CP; rank 1's
    output off by `WITHIN_TOLERANCE` (16 and 4 machine epsilons) passes the fixed tolerance and fails the ratio."""
    case = Case("p2p", "zigzag", dtype, cp=2)
    per_rank = simulated_results(case)
    report = check(SETUP, [case], per_rank)
    assert report.ok and all(row.ratio <= 2 for row in report.rows), report.format()
    (out, *grads), without_cp = per_rank[1][0]
    per_rank[1][0] = ((out + out * WITHIN_TOLERANCE[out.dtype], *grads), without_cp)
    good, bad = check(SETUP, [case], per_rank).rows
    assert good.ok and not bad.ok and bad.ratio > 4 and not bad.ratio_ok
    assert compare(per_rank[1][0][0], ground_truth(SETUP, case, 0, {})[0][1], case.tol(SETUP))[1]  # inside the tolerance
    line = Report([good, bad]).format().splitlines()[3].split()
    assert line[-3:] == [">2", f"{bad.oracle:.2e}", "FAIL"] and float(line[-4]) == round(bad.ratio, 2)


def test_a_shards_largest_error_moves_by_more_than_twice_between_equal_roundings():
    """The truth page's figures, why a rank is held to the batch's error: the RFC's one call on the simulated cluster
    (float32, P = 4, zigzag, 6 seeds) against the kernel without CP on its own rows, and against the whole batch."""
    said = re.search(r"reached ([\d.]+) on one shard of (\d+) against its own rows, and at most ([\d.]+) against the "
                     r"batch", " ".join(truth.__doc__.split())).groups()  # fmt: skip
    own, batch_wide = [], []
    for seed in range(6):
        setup, case = Setup(docs=(96, 224, 64), seed=seed), Case("all_gather", "zigzag", "fp32", cp=4)
        b = make_batch(setup, case, 0)
        results, _ = run_attention(b.q, b.k, b.v, b.dout, b.sharding, mode="all_gather", cluster=SimCluster(4, reduction="native"))
        (whole,), _, _ = run_without_cp(case, setup, 0, torch.device("cpu"), cpref.TorchKernel())
        _, oracle, (plain,) = ground_truth(setup, case, 0, {}, (whole,))
        for r in range(4):
            own.append(max(truth.precision_ratio(results[r][i], plain[r][i], oracle[r][i], torch.float32) for i in range(4)))
            batch_wide.append(max(truth.shard_ratio(results[r][i], oracle[r][i], [p[i] for p in plain], [o[i] for o in oracle],
                                                    torch.float32) for i in range(4)))  # fmt: skip
    assert len(own) == int(said[1]) and max(own) > 2 and max(batch_wide) < 2
    assert abs(max(own) - float(said[0])) <= 0.05 and abs(max(batch_wide) - float(said[2])) <= 0.05, (own, batch_wide)


def test_fp64_rows_have_no_ratio():
    """The FP64 truth is no more precise than an fp64 result: the column reads `-` and never fails a row."""
    case = Case("p2p", "zigzag", "fp64", cp=2)
    report = check(SETUP, [case], simulated_results(case))
    assert report.ok and [row.ratio for row in report.rows] == [None, None]
    assert report.format().splitlines()[2].split()[-3:-1] == ["-", f"{report.rows[0].oracle:.2e}"]


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


# --- results the table reports in a row's note, not by ending the run ------------------------------------------


def notes(out: str) -> dict[tuple[str, int], str]:
    """`{(impl function, world rank): its row's result and note}` of the `--impl` rows of a table."""
    rows = {}
    for line in out.splitlines():
        if line.startswith(IMPLS):
            head, _, result = line.partition("  FAIL" if "  FAIL" in line else "  pass")
            rows[head.split()[0].split(":")[1], int(head.split()[7])] = (result.strip(" ()") or "pass")
    return rows


@pytest.mark.full
def test_an_output_of_the_wrong_shape_or_a_q_without_gradient_is_a_row_note(capfd):
    """On 2 gloo ranks: rank 1's output one row short stops the backward on both ranks (its peer would wait for it
    in a collective), and both rows say so in the table (was: `CaseFailed` from the backward, no table); a detached
    `q` is `dq: no gradient` on every rank, and its run at CP size 1 is not reported as raising (was: "the
    implementation raised at CP size 1 (AttributeError ...)"); `q` detached at CP size 1 alone leaves complete rows
    without a `vs P=1`: they fail, saying so. Where stderr is not a terminal, a line per case as it finishes."""
    impls = ("wrong_shape_on_rank_1", "detached_q", "detached_q_without_cp")
    argv = ["--nproc", "2", "--mode", "p2p", "--layout", "zigzag", *SMALL, *(x for i in impls for x in ("--impl", f"{IMPLS}:{i}"))]
    assert verify.main(argv) == 1
    out, err = capfd.readouterr()
    stopped = "no backward run: out is not the shard's shape on CP rank 1"  # 96 tokens: 48 a rank, 8 heads of 32
    assert notes(out) == {("wrong_shape_on_rank_1", 0): stopped,
                          ("wrong_shape_on_rank_1", 1): f"out: shape (47, 8, 32) != (48, 8, 32); {stopped}",
                          ("detached_q", 0): "dq: no gradient", ("detached_q", 1): "dq: no gradient",
                          **dict.fromkeys([("detached_q_without_cp", 0), ("detached_q_without_cp", 1)],
                                          "vs P=1 not computed: the baseline (impl, at CP size 1) gave dq: no gradient")}, out  # fmt: skip
    assert "raised" not in out and "verification FAILED" in out
    for label in ("ranks run the cases", "ground truth"):  # the ranks' lines and the parent's, one per case
        counts = [line[len(label) :].split()[1] for line in err.splitlines() if line.startswith(label + ": ")]
        assert counts == ["1/3", "2/3", "3/3"], err


def test_a_row_without_backward_or_gradient_or_baseline_fails_saying_why():
    """`check` on the simulated cluster's results (no processes): a rank whose backward did not run is compared on
    `out` alone and fails with the rank's note, its gradients `-`; a missing gradient is `dq: no gradient`; a complete
    row whose baseline gave nothing fails with the baseline's note, on every rank."""
    case = Case("p2p", "zigzag", "fp32", cp=2)
    per_rank = simulated_results(case)
    (out, dq, dk, dv), plain = per_rank[1][0]
    per_rank[0][0] = (per_rank[0][0][0], plain, "no backward run: out is not the shard's shape on CP rank 1")
    per_rank[1][0] = ((out[:-1], None, None, None), None, "no backward run: out is not the shard's shape on CP rank 1")
    rows = check(SETUP, [case], per_rank).rows
    assert [r.ok for r in rows] == [False, False] and list(rows[0].errors) == ["out"] and rows[0].errors["out"] < 1e-5
    assert rows[1].note == "out: shape (47, 8, 32) != (48, 8, 32); no backward run: out is not the shard's shape on CP rank 1"
    line = Report(rows).format().splitlines()[2].split()
    assert line[9:12] == ["-", "-", "-"], line  # dq dk dv
    per_rank = simulated_results(case)
    per_rank[1][0] = ((out, None, dk, dv), None)
    assert [(r.ok, r.note) for r in check(SETUP, [case], per_rank).rows] == [(True, ""), (False, "dq: no gradient")]
    said = "vs P=1 not computed: the baseline (impl, at CP size 1) gave dq: no gradient"
    per_rank = simulated_results(case)
    per_rank[0][0] = (per_rank[0][0][0], ((), "impl", said))  # CP rank 0's run without CP gave no result
    rows = check(SETUP, [case], per_rank).rows
    assert [(r.ok, r.ratio, r.note) for r in rows] == [(False, None, said)] * 2


def test_a_baseline_that_gives_no_gradient_is_said_so_not_raised():
    """`run_without_cp` with a local attention that detaches `q`: no baseline, and the note says what was missing
    (was: `AttributeError: 'NoneType' object has no attribute 'cpu'` out of the harness)."""
    setup = dataclasses.replace(SETUP, baseline=f"{IMPLS}:local_detached_q")
    case = Case("p2p", "zigzag", "bf16", cp=2, impl=f"{IMPLS}:blockwise")
    assert run_without_cp(case, setup, 0, torch.device("cpu"), cpref.TorchKernel()) == (
        (), f"{IMPLS}:local_detached_q", f"vs P=1 not computed: the baseline ({IMPLS}:local_detached_q, at CP size 1) "
        "gave dq: no gradient")  # fmt: skip


def test_where_stderr_is_not_a_terminal_each_case_is_a_line():
    from sim.tools.verify.meter import Lines, meter

    log = io.StringIO()
    lines = meter(2, "ground truth", None, stream=log)
    assert isinstance(lines, Lines)
    lines.step("a")
    lines.step("b")
    lines.close()
    assert log.getvalue() == "ground truth: 1/2 a\nground truth: 2/2 b\n"
    quiet = meter(2, "x", False, stream=log)
    quiet.step("c")
    assert log.getvalue().endswith("2/2 b\n")  # --no-progress: nothing
    bar = meter(2, "x", True, stream=log)  # --progress: the bar, terminal or not
    assert isinstance(bar, Progress) and bar.enabled


def test_padded_says_what_it_did(monkeypatch, capsys):
    """`--padded`'s note gives each layout's real lengths and the padded boundaries they end in (was: the real
    lengths alone, said to be "rounded up", where 100 had lost a token)."""
    monkeypatch.setattr(verify, "run", lambda *args, **kwargs: Report())  # no processes: the lines before the table
    verify.main(["--layout", "zigzag,stream", "--mode", "p2p", "--docs", "100,250,38", "--padded"])
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note: --padded"))
    assert "as run: zigzag cp2 99,250,38 in 100,252,40; stream cp2 100,250,37 in 100,250,38 (" in note
    assert "rounded up" not in note


def test_an_impl_is_named_by_its_file_as_well_as_by_its_module(capsys, tmp_path, monkeypatch):
    """`--impl path/to/file.py:function` loads the file in every process (issue 58: it failed with "No module named
    '/path/to/file'"); a file that is not there, a module that does not import and a missing name are one line each,
    exit status 2, before any process starts."""
    source = Path(__file__).with_name("verify_impls.py").read_text()
    (tmp_path / "mine.py").write_text(source)
    monkeypatch.chdir(tmp_path)  # a relative path, from the folder the user runs in
    args = ["--mode", "p2p", "--layout", "zigzag", "--docs", "48,80"]
    assert verify.main([*args, "--impl", "mine.py:cpref_over_group"]) == 0
    assert "verification passed" in capsys.readouterr().out
    for impl, words in [("nowhere/ring.py:attention", "no file nowhere/ring.py (looked for "),
                        ("no_such_package.ring:attention", "ModuleNotFoundError: No module named 'no_such_package' (is "
                                                           "the package on sys.path?"),
                        ("mine.py:no_such_function", "mine.py has no 'no_such_function'")]:  # fmt: skip
        assert verify.main([*args, "--impl", impl]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_the_err_over_tol_column_is_the_verdicts_measure():
    """Issue 58: a row read "dk 4.56e-02, tol 3.5e-02, pass" (the largest error, where the truth was large). The
    `err/tol` column is the worst entry's |error| / (tol + tol |truth|): at most 1 on every row that passes the
    tolerance, above 1 on the row that fails it (rank 1's output biased by 0.1), and printed as the table shows it."""
    cases = [Case("p2p", "zigzag", dtype, cp=2, impl=f"{IMPLS}:{impl}") for dtype in ("fp32", "bf16")
             for impl in ("cpref_over_group", "biased_on_rank_1")]  # fmt: skip
    report = verify.run(cases, SETUP, progress=False)
    for row in report.rows:
        biased = row.case.impl.endswith("biased_on_rank_1") and row.cp_rank == 1
        assert (row.share > 1) == biased, (row.case.label, row.rank, row.share, row.errors, row.tol)
        assert row.ok == (not biased)
    lines = report.format().splitlines()
    for row, line in zip(report.rows, lines[2:]):
        share = f"{row.share:.2f}" if row.share < 1e3 else f"{row.share:.1e}"
        assert f"{row.tol:>9.1e} {share:>8}" in line


def test_a_case_the_implementation_refuses_is_a_skipped_row_not_an_abort():
    """Issue 58: an adapter raising NotImplementedError (before it communicates, on every rank) gets `skipped (why)`
    rows, the other cases run and the verdict counts only them; raised on one rank alone, the ranks agreed first, so
    nothing hangs: that case's rows fail and name it."""
    cases = [Case("p2p", "zigzag", "fp32", cp=2, impl=f"{IMPLS}:refuses_windows", window=window)
             for window in ((-1, -1), (3, 0))] + [Case("p2p", "zigzag", "fp32", cp=2, impl=f"{IMPLS}:refuses_on_rank_1")]
    report = verify.run(cases, SETUP, progress=False)
    assert [r.status for r in report.rows] == ["pass", "pass", "skipped", "skipped", "FAIL", "FAIL"]
    assert report.rows[2].note == "no sliding window (the adapter's attention has no window argument)"
    assert "was not given: NotImplementedError on CP rank 1" in report.rows[4].note
    assert verify.table.Report(report.rows[:4]).ok and not report.ok  # skipped rows fail nothing
    text = report.format()
    assert text.splitlines()[-1] == "2 of 6 rank rows pass; 2 FAIL; 2 skipped" and "skipped (no sliding window" in text


def test_a_run_whose_every_case_is_skipped_fails_rather_than_passing_on_nothing(capsys):
    assert verify.main(["--impl", f"{IMPLS}:refuses_windows", "--mode", "p2p", "--layout", "zigzag", "--docs", "48,80",
                        "--window", "3,0", "--no-progress"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "0 of 2 rank rows pass; 2 skipped" in out and "nothing verified, every case skipped" in out


def test_impl_options_reach_every_call_and_are_refused_where_the_impl_takes_none(capsys):
    """`--impl-option NAME=VALUE` passes a setting to the implementation (issue 58: `--option rotate=alltoall` was
    refused, "no mode takes it"): the case's label shows it, and it changes what runs; one the function does not
    declare, or one without an --impl, is one line and exit status 2."""
    args = ["--mode", "p2p", "--layout", "zigzag", "--docs", "48,80", "--impl", f"{IMPLS}:scaled"]
    assert verify.main([*args, "--impl-option", "scale_output=1.0"]) == 0
    assert f"{IMPLS}:scaled" in capsys.readouterr().out
    assert verify.main([*args, "--impl-option", "scale_output=2.0"]) == 1
    assert "verification FAILED" in capsys.readouterr().out
    assert verify.main([*args, "--impl-option", "rotate='alltoall'"]) == 2
    assert f"--impl {IMPLS}:scaled takes no rotate= (no such keyword" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        verify.main(["--impl-option", "rotate='alltoall'"])
    assert "--impl-option rotate: it passes settings to an --impl, and none is given" in capsys.readouterr().err
    case = cases_from_args(parse_args([*args, "--impl-option", "scale_output=2.0"]), world=2)[0]
    assert case.impl_options == (("scale_output", 2.0),) and case.label.endswith("scaled/scale_output=2.0")


def test_a_peer_is_its_adapter_with_its_own_modes_layouts_and_documents():
    """`--peer NAME`: the adapter cpref ships, checked in the peer's own modes and layouts over its documents (one
    for PyTorch's ring, which takes no boundaries) unless the command line says otherwise; labelled by its name."""
    from sim.tools.verify.impls import PEERS

    args = parse_args(["--peer", "deepspeed-ulysses"])
    cases = cases_from_args(args, world=2)
    assert {(c.impl, c.mode, c.layout) for c in cases} == {(PEERS["deepspeed-ulysses"].impl, "a2a", "stream")}
    assert args.setup.docs == (1000, 3000, 500)
    ring = parse_args(["--peer", "torch-ring", "--layout", "zigzag"])
    assert ring.setup.docs == (1024,) and {(c.mode, c.layout) for c in cases_from_args(ring, world=2)} == {("p2p", "zigzag")}
    assert parse_args(["--peer", "torch-ring", "--docs", "64"]).setup.docs == (64,)
    plain = parse_args([])
    assert plain.setup.docs == Setup.docs and plain.modes == sorted(cpref.MODES) and plain.impl is None
    row = table.Row(cases[0], 0, 0, 0, {"out": 0.0}, 1e-5, 0.0, "pass")
    assert table.Report([row]).format().splitlines()[2].startswith("deepspeed-ulysses  a2a")
