"""The benchmarks' own plumbing (their figures are printed, never asserted)."""

from __future__ import annotations

import pytest
import torch

import cpref
from bench import kernel


def test_device_timings_wait_for_the_device(monkeypatch):
    """On an accelerator a kernel launch returns before the work is done: without a
    synchronize on both sides of each timed call the benchmark would time launches."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    times = kernel.fastest({"f": lambda: events.append("call")}, repeats=2, warmup=1, device=torch.device("cuda", 0))
    assert events == ["call"] + [("sync", torch.device("cuda", 0)), "call", ("sync", torch.device("cuda", 0))] * 2
    assert set(times) == {"f", "rounds"} and times["rounds"] == 2


def test_kernel_table_runs_in_the_dtype_asked_for():
    rows = kernel.table({"2 x 32": [32, 32]}, heads=2, dim=8, repeats=1, dtype=torch.bfloat16)
    assert [set(r) for r in rows] == [{"mix", "fast", "explicit", "sdpa", "rounds"}]
    steps = kernel.cases([16], heads=2, dim=8, dtype=torch.bfloat16)
    out = steps["fast"]()  # (dq, dk, dv) of the kernel's backward
    assert all(t.dtype == torch.bfloat16 for t in out)


def test_peak_memory_per_rank_falls_with_P():
    """What CP is for, counted (bytes, not time): every mode's per-rank peak of forward +
    backward, input shards included, falls from P = 1 to 2 to 4, and the saved bytes are the
    formula's. Catches a mode that keeps a full-length buffer (e.g. the gathered K/V saved by
    default, or a ring holding every step's gradients)."""
    import cpref
    from bench.memory import rank_memory
    from cpref.api import mode_costs

    cu, heads = torch.tensor([0, 128, 512]), (4, 2, 16, 16)
    for mode in sorted(cpref.MODES):
        peaks = []
        for P in (1, 2, 4):
            per_rank = rank_memory(cu, heads, P, mode)
            peaks.append(max(p for p, _ in per_rank))
            formula = mode_costs(mode, P=P, local_tokens=512 // P, heads=heads, dtype=torch.float32,
                                 **cpref.MODES[mode].example_options(P)).saved_bytes  # fmt: skip
            assert max(s for _, s in per_rank) == formula, (mode, P)
        assert peaks[0] > peaks[1] > peaks[2], (mode, peaks)


def test_every_benchmark_keeps_its_tables_and_results_and_the_page_shows_them(tmp_path, monkeypatch, capsys):
    """`bench.all` prints a benchmark's output and keeps it, headed by when and where, beside the results its
    `main` returns (the page's tables and figures come from those); a `main` that returns nothing is refused;
    every benchmark of `make bench` has both files in the repository and its last run on its page (a new
    benchmark without them fails here)."""
    import json
    import sys
    import types
    from pathlib import Path

    import pytest

    from bench import all as bench_all

    fake = types.ModuleType("bench.fake")
    fake.main = lambda argv: print(f"| table | {argv} |") or {"ms": [1.5, 2.0]}
    monkeypatch.setitem(sys.modules, "bench.fake", fake)
    bench_all.run("fake", tmp_path)
    kept = (tmp_path / "fake.txt").read_text()
    assert kept.startswith("Measured ") and f"torch {torch.__version__}" in kept and kept.endswith("| table | [] |\n")
    assert "| table | [] |" in capsys.readouterr().out
    results = bench_all.load("fake", tmp_path)
    assert results["results"] == {"ms": [1.5, 2.0]} and kept.startswith(results["measured"] + " (")
    fake.main = lambda argv: print("only printed")
    with pytest.raises(TypeError, match="returned NoneType"):
        bench_all.run("fake", tmp_path)
    for name in bench_all.BENCHMARKS:  # each shown at the end of its page, its module's docstring
        assert (bench_all.RESULTS / f"{name}.txt").read_text().startswith("Measured "), name
        assert json.loads((bench_all.RESULTS / f"{name}.json").read_text())["results"], name
        assert f"{{{{ results {name} }}}}" in Path(bench_all.__file__).with_name(f"{name}.py").read_text(), name


def test_make_bench_writes_an_ignored_folder_unless_told_to_update_the_committed_results(tmp_path, monkeypatch, capsys):
    """`python -m bench.all` (`make bench`) keeps its files, the calibration `bench.scaling` writes included, in
    `bench/out/`, which git ignores; `--update-results` (`make bench KEEP=1`) in `bench/results/`, the committed files
    the performance page reads (`load`'s default). Was: every run wrote over the committed results."""
    import subprocess
    import sys
    import types
    from pathlib import Path

    from bench import all as bench_all
    from bench import scaling

    root = Path(bench_all.__file__).resolve().parents[1]
    assert bench_all.OUT == root / "bench" / "out" and bench_all.RESULTS == root / "bench" / "results"
    assert scaling.CALIBRATION == bench_all.OUT / "this-machine.json"
    ignored = [subprocess.run(["git", "check-ignore", "-q", f"bench/{f}/kernel.json"], cwd=root).returncode
               for f in ("out", "results")]  # fmt: skip
    assert ignored == [0, 1]  # out ignored by git, results not
    out, results = tmp_path / "out", tmp_path / "results"
    monkeypatch.setattr(bench_all, "OUT", out)
    monkeypatch.setattr(bench_all, "RESULTS", results)
    calls = []
    fake = types.ModuleType("bench.scaling")  # the one benchmark that writes a file of its own: its calibration
    fake.main = lambda argv: calls.append(argv) or {"ms": [1.0]}
    monkeypatch.setitem(sys.modules, "bench.scaling", fake)
    bench_all.main(["--only", "scaling"])
    assert (out / "scaling.json").is_file() and not results.exists()
    assert calls == [["--calibration", str(out / "this-machine.json")]]
    assert "the performance page's) unchanged: --update-results (make bench KEEP=1)" in capsys.readouterr().out
    bench_all.main(["--only", "scaling", "--update-results"])
    assert bench_all.load("scaling", results)["results"] == {"ms": [1.0]}
    assert calls[-1] == ["--calibration", str(results / "this-machine.json")]
    for keep, flags in (([], []), (["KEEP=1"], ["--update-results"])):  # the Makefile's target, dry-run
        made = subprocess.run(["make", "-n", "--no-print-directory", "bench", *keep], cwd=root, capture_output=True,
                              text=True).stdout  # under make test, a sub-make: without its directory lines
        assert made.splitlines()[-1].split()[1:] == ["-m", "bench.all", *flags], made


def test_fastest_samples_cheap_cases_more_and_every_case_alike():
    """`fastest` runs at least `repeats` rounds, more within the time budget, never more than
    `max_rounds`, and every case once per round: a case timed fewer times than the other
    would get a kinder (or harsher) minimum."""
    calls = {"a": 0, "b": 0}

    def count(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    fns = {name: count(name) for name in calls}
    assert kernel.fastest(fns, repeats=2, warmup=1)["rounds"] == 2 and calls == {"a": 3, "b": 3}
    calls.update(a=0, b=0)
    times = kernel.fastest(fns, repeats=2, warmup=0, budget=60.0, max_rounds=7)
    assert times["rounds"] == 7 and calls == {"a": 7, "b": 7}
    assert set(times) == {"a", "b", "rounds"} and all(times[n] >= 0.0 for n in ("a", "b"))


def test_window_benchmark_compares_one_attention_and_runs_quick(capsys):
    """`bench.window`: its four cases compute the same gradients (the SDPA case through its dense band
    mask), its counts are the contract's and the plan's, and a quick run prints the table and the ratios."""
    from bench import window
    from cpref.kernels import Varlen

    steps = window.cases(256, 31, heads=2, dim=8)
    want = steps["window"]()
    for name in ("explicit window", "SDPA band mask"):
        for a, b in zip(steps[name](), want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    counts = window.scores(256, 31)
    assert counts["visible"] == 32 * 256 - 31 * 32 // 2 == Varlen([0, 256]).work(True, (31, 0))
    assert counts["visible"] <= counts["planned"] <= 256 * (31 + 16) < counts["causal"] < counts["dense"]
    window.main(["--tokens", "512", "--window", "32", "--heads", "2", "--dim", "8"])
    out = capsys.readouterr().out
    assert "| SDPA band mask |" in out and "full causal / window: ideal 8.0x" in out and "measured" in out


def test_all_gather_efficiency_is_a_fraction_of_perfect_scaling():
    """`ideal / (P * slowest)` with `ideal` the same shares one after the other: 1 when balanced, the mean over the
    slowest otherwise, never above 1 (was: one call over the batch as `ideal`, 1.52 at P = 4)."""
    from bench.all_gather import efficiency

    assert efficiency([2.0, 2.0, 2.0, 2.0]) == 1.0
    assert efficiency([1.0, 3.0]) == 2.0 / 3.0
    assert all(efficiency(list(s)) <= 1.0 for s in ([0.1, 5.0, 2.0], [7.0], [1e-6, 1e-3]))


def test_scaling_efficiency_is_the_speedup_over_the_machines_two_process_factor():
    """Efficiency against the machine = (T1 / T2) / (2 T1 / T_pair): 1 when CP = 2 runs as fast as two independent
    processes; the verdicts name the target layouts only (contiguous shows its imbalance, unjudged)."""
    import pytest

    from bench import scaling

    def ranks(*compute_comm):
        return [{"total": 5.5, "compute": c, "comm": w} for c, w in compute_comm]

    rows = [{"mode": "a2a", "layout": "balanced", "t2": 5.5, "ranks": ranks((5.0, 0.1), (5.1, 0.2))},
            {"mode": "p2p", "layout": "zigzag", "t2": 6.0, "ranks": ranks((5.3, 0.11), (5.0, 0.3))},
            {"mode": "p2p", "layout": "contiguous", "t2": 9.0, "ranks": ranks((2.0, 3.0), (5.0, 0.0))}]  # fmt: skip
    batch = {"t1": 10.0, "t_pair": 11.0, "target": 0.95, "target_layouts": ["zigzag", "balanced"], "rows": rows,
             "ring": [], "shift": {}}  # fmt: skip
    assert scaling.efficiency(batch, rows[0]) == pytest.approx(1.0)  # speedup 1.82 = the factor 20 / 11
    assert scaling.efficiency(batch, rows[1]) == pytest.approx(11.0 / 12.0)
    # compute over half the CP = 1 step (5 s): +0% / +2% and +6% / +0%; comm wait over the rank's step (5.5 s)
    assert scaling.compute_inflation(batch, rows[1]) == pytest.approx([0.06, 0.0])
    text = scaling.markdown(batch)
    assert "| a2a | balanced | 5.50 s | 1.82 | 1.00 | +0% / +2% | 1.8% / 3.6% |" in text
    assert "| p2p | zigzag | 6.00 s | 1.67 | 0.92 | +6% / +0% | 2.0% / 5.5% |" in text
    assert "a2a balanced 1.00 (met), p2p zigzag 0.92 (BELOW)." in text and "contiguous 0." not in text
    assert "above the target +3%: p2p zigzag +6%;" in text  # contiguous is not judged on compute
    # against half the pair's step (5.5 s): 5.3 / 5.5 = -4%, 5.1 / 5.5 = -7%: none of the split's own above +3%
    assert scaling.busy_inflation(batch, rows[1]) == pytest.approx([5.3 / 5.5 - 1, 5.0 / 5.5 - 1])
    assert "two busy cores' cost to each other), above +3%: none." in text
    slow = {**batch, "t_pair": 10.0}  # the pair as fast as one: 5.3 / 5.0 = +6% again
    assert "two busy cores' cost to each other), above +3%: p2p zigzag +6%." in scaling.markdown(slow)
    assert "above the target 3%: a2a balanced 3.6%, p2p zigzag 5.5%, p2p contiguous 54.5%." in text  # every mode and layout


def test_the_balanced_rings_shift_alone_is_its_largest_planned_shift_not_the_whole_block():
    """The ring's hidden fraction compares waits with one shift alone; under balanced the ring ships only the rows
    others read, so timing a whole block would flatter the fraction hidden."""
    import cpref
    from bench import scaling
    from cpref.modes.ring_window import build_window_ring_plan

    lengths = scaling.batches(4096)["4 mixed"]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    balanced, zigzag = (cpref.Sharding(cu, cp_size=2, layout=lay) for lay in ("balanced", "zigzag"))
    plan = build_window_ring_plan(balanced.bounds, 2, 0, "balanced", True, (-1, -1), torch.device("cpu"))
    assert scaling.shifted_rows(balanced, (-1, -1)) == max(plan.halo.sizes) < balanced.local_tokens
    assert scaling.shifted_rows(zigzag, (-1, -1)) == zigzag.local_tokens


def test_the_scaling_benchmark_reports_each_overlapped_paths_ratio_against_its_modes_default():
    from bench import scaling

    def row(mode, layout, path, t2, comm):
        return {"layout": layout, "mode": mode, "path": path, "t2": t2,
                "ranks": [{"total": t2, "compute": t2 - c, "comm": c} for c in comm]}  # fmt: skip

    rows = [row("all_gather", "zigzag", "", 4.0, (0.5, 0.1)), row("all_gather", "zigzag", "overlap=True", 3.0, (0.1, 0.1)),
            row("all_gather", "balanced", "", 2.0, (0.2, 0.2)), row("all_gather", "balanced", "overlap=True", 2.5, (0.0, 0.0)),
            row("a2a", "zigzag", "", 5.0, (0.3, 0.3)), row("a2a", "zigzag", "head_groups=4", 4.5, (0.1, 0.1)),
            row("p2p", "zigzag", "", 1.0, (0.0, 0.0))]  # fmt: skip
    batch = {"name": "1 x 8", "lengths": [8], "rows": rows}
    text = scaling.paths_markdown(batch)
    assert "| all_gather | zigzag | overlap=True | 3.00 s | 0.75 | 2.90 s / 2.90 s | 0.100 s / 0.100 s |" in text
    assert "| all_gather | balanced | overlap=True | 2.50 s | 1.25 |" in text
    assert "| all_gather | zigzag | default | 4.00 s |  |" in text and "| a2a | zigzag | default | 5.00 s |  |" in text
    assert "| a2a | zigzag | head_groups=4 | 4.50 s | 0.90 |" in text  # against a2a's own default, not all_gather's
    assert "p2p" not in text  # a mode without an overlapped path
    verdict = scaling.paths_verdict([batch])
    assert "1 x 8 all_gather zigzag overlap=True: 0.75 (waiting +0.400 s less over the ranks, compute -22%)" in verdict  # (2.9 + 2.9) / (3.5 + 3.9)
    assert "1 x 8 all_gather balanced overlap=True: 1.25 (waiting +0.400 s less over the ranks, compute +39%)" in verdict  # 5.0 / 3.6
    assert "1 x 8 a2a zigzag head_groups=4: 0.90 (waiting +0.400 s less over the ranks, compute -6%)" in verdict  # 8.8 / 9.4
    assert verdict.count(": ") == 4  # the three paths, and the lead
    assert "| all_gather (overlap=True) | zigzag |" in scaling.markdown({**batch, "t1": 8.0, "t_pair": 8.0, "ring": [], "shift": {},
                                                                       "target": 0.95, "target_layouts": ["zigzag"]})


def test_the_overlapped_paths_run_only_without_a_window_and_every_mode_by_default():
    from bench import scaling

    plain, windowed = scaling.configurations((-1, -1), 8), scaling.configurations((1024, 0), 8)
    assert windowed == [(mode, {}) for mode in sorted(cpref.MODES)]
    assert plain == windowed + [("all_gather", {"overlap": True}), ("a2a", {"head_groups": 4})]  # one head a group
    assert [scaling.path_name(path) for _, path in plain[-2:]] == ["overlap=True", "head_groups=4"]
    assert scaling.configurations((-1, -1), 4)[-1] == ("a2a", {"head_groups": 2})
    # at P = 4 Ulysses' ranks hold 8 / 4 heads, and the hierarchy (groups of 2) runs its a2a level in head groups too
    assert scaling.configurations((-1, -1), 8, P=4)[-2:] == [("a2a", {"head_groups": 2}), ("a2a+p2p", {"head_groups": 4})]
    assert scaling.batches(1000, P=4)["4 mixed"] == [16, 136, 368, 480]  # each a multiple of 2 P = 8


def test_the_scaling_figures_at_another_cp_size_divide_by_p():
    """`--cp 4`: the factor is 4 T1 / T_all, the efficiency T_all / (4 T4), the compute over T1 / 4 (P: the ranks of
    each row), and the table names every rank; refused before any process starts: a P below 2, tokens or heads that
    the P ranks cannot split."""
    import pytest

    from bench import scaling

    ranks = [{"total": 3.0, "compute": c, "comm": 0.1} for c in (2.5, 2.6, 2.5, 2.8)]
    rows = [{"mode": "p2p", "layout": "zigzag", "path": "", "t2": 3.0, "ranks": ranks}]
    batch = {"t1": 10.0, "t_pair": 11.0, "target": 0.95, "target_layouts": ["zigzag"], "rows": rows, "ring": [], "shift": {}}
    assert scaling.efficiency(batch, rows[0]) == pytest.approx(11.0 / 12.0)
    assert scaling.compute_inflation(batch, rows[0]) == pytest.approx([0.0, 0.04, 0.0, 0.12])
    assert scaling.busy_inflation(batch, rows[0]) == pytest.approx([c / 2.75 - 1 for c in (2.5, 2.6, 2.5, 2.8)])
    text = scaling.markdown(batch)
    assert "4 such processes at once: 11.00 s each: 4 processes here do 3.64x the work of one." in text
    assert "| T(CP=4) | speedup | efficiency | compute over T(CP=1) / 4, rank 0 / 1 / 2 / 3 |" in text
    assert "| p2p | zigzag | 3.00 s | 3.33 | 0.92 | +0% / +4% / +0% / +12% |" in text
    for argv, message in ((["--cp", "1"], "--cp 1: the CP size"), (["--cp", "4", "--tokens", "1004"], "a multiple of 2 x 4 = 8"),
                          (["--cp", "4"], "--heads 4: Ulysses in head groups over 4 ranks")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            scaling.main(argv)
        assert exit_.value.code == 2, message

def test_the_determinism_check_runs_and_reports_what_it_checked():
    """`bench.determinism` (a step of bench/gpu_check.sh): one row per mode, CP size and layout, each with its
    accuracy against the FP64 oracle and both repeatability answers, and the row sums timed both ways."""
    from bench import determinism

    result = determinism.main(["--mode", "all_gather,p2p", "--cp", "2", "--docs", "24,8", "--heads", "2,1", "--dim", "8",
                               "--repeats", "1"])  # fmt: skip
    rows = result["rows"]
    assert [(r["mode"], r["P"], r["layout"]) for r in rows] == [(m, 2, lay) for m in ("all_gather", "p2p")
                                                                 for lay in ("zigzag", "balanced")]  # fmt: skip
    assert result["failed"] == 0 and all(r["repeats"] and r["default repeats"] for r in rows)  # the CPU sums in order
    assert all(0 < r["accuracy"] <= 1.0 and r["cost"] > 0 for r in rows)
    assert all(result["row sums"][key] > 0 for key in ("index_add_", "layers", "sort"))


@pytest.mark.full
def test_the_scaling_benchmark_runs_every_configuration_in_one_launch_per_batch(monkeypatch, tmp_path):
    """A tiny run end to end (two gloo processes per batch), in rounds of CP = 1 alone on rank 0, the pair, then every
    mode and overlapped path in both timed layouts, each kept with both ranks' split; what a broken launch or round
    loses, and a baseline timed before the rounds instead of inside them. Its calibration is written to a temporary
    folder: a test leaves the kept results (`bench/results/this-machine.json`) as the last `make bench` wrote them."""
    from bench import scaling

    result = scaling.main(["--tokens", "256", "--heads", "4", "--head-dim", "4", "--window", "none", "--repeats", "2",
                           "--calibration", str(tmp_path / "this-machine.json")])  # fmt: skip
    assert [b["name"] for b in result["batches"]] == ["1 x 256", "4 mixed"]
    for batch in result["batches"]:
        assert batch["t1"] > 0 and batch["t_pair"] > 0
        keys = [(r["mode"], r["layout"], r["path"]) for r in batch["rows"]]
        want = [(m, lay, scaling.path_name(p)) for m, p in scaling.configurations((-1, -1), 4) for lay in scaling.TIMED_LAYOUTS]
        assert keys == want and all(len(r["ranks"]) == 2 for r in batch["rows"])
        assert {(r["layout"], r["rank"]) for r in batch["ring"]} == {(lay, k) for lay in scaling.TIMED_LAYOUTS for k in (0, 1)}
        # the baseline runs inside the rounds, beside the split: a slow spell cannot hit CP = 2 alone
        assert batch["schedule"] == ["alone", "pair", "cp"] * 2
    assert "head_groups=2" in result["paths_verdict"]
    assert (tmp_path / "this-machine.json").is_file()


def test_the_goals_summary_gathers_each_target_from_the_tables_figures():
    """The page's summary of the performance goals: efficiency over both full-causal batches, compute inflation on
    the packed mix only, comm wait, each ring shift that a kernel call can hide, the overlapped paths' ratios;
    a windowed batch is left out (its tables print its own figures)."""
    from bench import scaling

    def row(mode, layout, t2, compute, comm, path=""):
        return {"mode": mode, "layout": layout, "path": path, "t2": t2,
                "ranks": [{"total": t2, "compute": c, "comm": w} for c, w in zip(compute, comm)]}  # fmt: skip

    def batch(name, window, rows, ring=()):
        return {"name": name, "window": window, "t1": 10.0, "t_pair": 11.0, "rows": rows, "ring": list(ring),
                "shift": {"zigzag": 0.1}, "target": 0.95, "target_layouts": ["zigzag", "balanced"]}  # fmt: skip

    steps = [{"phase": "forward", "compute": 1.0, "wait": 0.05, "shifts": 1}, {"phase": "backward", "compute": 1.0, "wait": 0.0, "shifts": 1}]
    shifts = [{"phase": "forward", "calls": 1, "exposed": 0.005}, {"phase": "backward", "calls": 1, "exposed": 0.02},
              {"phase": "backward", "calls": 0, "exposed": 0.1}]  # the last: nothing to hide behind, not judged
    doc = batch("1 x 16", [-1, -1], [row("p2p", "zigzag", 5.5, (5.0, 5.0), (0.1, 0.1)),
                                    row("p2p", "contiguous", 9.0, (5.0, 5.0), (4.0, 0.0))],  # not a target layout
                ring=[{"layout": "zigzag", "rank": 0, "steps": steps, "shifts": shifts}])
    mix = batch("4 mixed", [-1, -1], [row("a2a", "zigzag", 6.0, (5.3, 5.0), (0.3, 0.1)),
                                      row("a2a", "zigzag", 5.4, (5.0, 5.0), (0.0, 0.0), path="head_groups=2")])
    windowed = batch("4 mixed", [1024, 0], [row("a2a", "zigzag", 99.0, (50.0, 50.0), (40.0, 40.0))])
    goals = {g["goal"].split(" ")[0]: g for g in scaling.goals([doc, mix, windowed])}
    assert goals["efficiency"]["measured"] == "1 of 2 at or above; lowest 0.92 (a2a zigzag, 4 mixed)"  # 11 / 12
    assert goals["efficiency"]["met"] is False
    assert goals["compute"]["measured"] == "0 of 1 within; largest +6% (a2a zigzag, 4 mixed); over half the pair's step -4% at most (a2a zigzag, 4 mixed)"
    assert goals["comm"]["measured"] == "1 of 2 within; largest 5.0% (a2a zigzag, 4 mixed)"  # 0.3 / 6.0; contiguous's 44% unjudged
    assert goals["ring:"]["measured"] == "1 of 2 shifts at or above; lowest 80% (zigzag rank 0 backward shift 2, 1 x 16)"
    assert goals["ring:"]["met"] is False
    assert goals["overlapped"]["measured"] == "1 of 1 below 1; 0.90 at best (a2a (head_groups=2) zigzag, 4 mixed), 0.90 at worst (a2a (head_groups=2) zigzag, 4 mixed)"
    assert goals["overlapped"]["met"] is None and goals["overlapped"]["why"] == "a rule: an overlapped path paid in every case"


def test_each_ring_shift_is_paired_with_its_wait_and_the_calls_between():
    """The ring at P = 2 on the simulated cluster through the timing proxies: the forward's one shift of K/V, the
    backward's shift of K/V and first of dK/dV each have a kernel call between post and wait, the accumulators' trip
    home none; a wait paired with the wrong post (or none) changes the calls counted and the exposure."""
    import pytest

    from bench.ring_timing import ring_shifts, ring_steps, shift_hidden
    from bench.timed import Clock, TimedComm, TimedKernel
    from sim import SimCluster

    cu, gen = torch.tensor([0, 64, 160]), torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(160, 2, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    sharding = cpref.Sharding(cu, cp_size=2, layout="zigzag")

    def rank(comm):
        clock = Clock()
        timed, kernel = TimedComm(comm, clock), TimedKernel(cpref.TorchKernel(), clock)
        qr, kr, vr = (sharding.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v))
        out = cpref.attention(qr, kr, vr, sharding, comm=timed, mode="p2p", kernel=kernel)
        out.backward(sharding.shard(dout, comm.rank))
        return clock.events

    for events in SimCluster(2).run(rank):
        shifts = ring_shifts(events)
        assert [(s["phase"], s["calls"]) for s in shifts] == [("forward", 1), ("backward", 1), ("backward", 1), ("backward", 0)]
        waits = [e for e in events if e[1] == "wait"]
        assert sorted(e[3] for e in waits) == [i for i, e in enumerate(events) if e[1] == "send_recv_async"]
        posts = {i: e[2] for i, e in enumerate(events) if e[1] == "send_recv_async"}
        assert sum(s["exposed"] for s in shifts) == pytest.approx(sum(posts.values()) + sum(e[2] for e in waits))
        assert sum(s["shifts"] for s in ring_steps(events)) == len(shifts)
    assert shift_hidden({"exposed": 0.25}, 1.0) == 0.75 and shift_hidden({"exposed": 3.0}, 1.0) == 0.0


def test_a_shift_never_awaited_is_refused():
    import pytest

    from bench.ring_timing import ring_shifts

    with pytest.raises(ValueError, match="event 0 is never awaited"):
        ring_shifts([("comm", "send_recv_async", 0.1, None), ("compute", "forward", 1.0, None)])


def test_the_variants_benchmark_runs_quick_and_counts_what_it_says(capsys):
    """`bench.variants --quick`: every case of the three parts printed with its goal's verdict; the chunked step
    sends nothing where every chunk lies on one rank, and the full causal ring sends its whole block forward, again
    backward, and the block's dK/dV accumulator P = 2 times (on and home); the direct halo is one shift to each reading rank (m_1 + m_P-1 rows),
    the relay's count m_1 + (P - 1) m_P-1."""
    from bench import variants

    results = variants.main(["--quick"])
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in variants.NAMES)
    assert "sinks / plain:" in out and "softcap / plain:" in out and "chunked " in out and "one-way relay" in out
    assert "per float32" in out and set(results["per_float"]) >= {"PyTorch tanh", "PyTorch exp2"}
    for layout, c in results["chunked"].items():
        assert c["chunked"][1] == [0, 0] and c["halo"] == 0, layout  # chunks of 1024 = the zigzag chunks of 4096 / 4
        assert c["full"][1] == [4 * 2048 * 4 * 2 * 64 * 4] * 2, layout  # 4 shifts of T/2 rows of K|V or dK|dV, fp32
    h = results["halo"]
    assert h["shifts"] == 2 and h["direct"] == h["m_1"] + h["m_back"] and h["relay"] == h["m_1"] + 3 * h["m_back"]
    assert h["m_1"] == h["m_back"] == 4 * 512  # four documents, a halo of w = 512 rows each


def test_the_plan_benchmark_runs_quick_and_prices_both_ways_alike(capsys):
    """`bench.plan --quick`: at P = 4 the ten covered candidates (p2p, all_gather with and without overlap, a2a+p2p with a2a_size 2, alone and in two head groups, each in
    contiguous and zigzag) priced from the dry run and built at scale agree on every rank; at P = 64 the planner prices
    the study's candidates on all 64 ranks, every one built (none left unpriced), and the goal's verdict is printed;
    with every layout and a windowed layer kind too, none is left unpriced."""
    from bench import plan

    results = plan.main(["--quick"])
    out = capsys.readouterr().out
    (side,), (whole,) = results["side_by_side"], results["whole"]
    assert side["P"] == 4 and side["candidates"] == 10 and side["agree"]
    assert whole["P"] == 64 and whole["ranks"] == 64 and whole["priced"] > 0 and whole["unpriced"] == 0  # all built
    assert "- the planner at P = 64: " in out and "(goal < 10 s)" in out
    (every,) = results["every_layout"]  # every mode and layout, full and windowed: none left to the dry run
    assert every["P"] == 64 and set(every["kinds"]) == {"full", "window 1024"}
    assert every["kinds"]["full"]["unpriced"] == every["kinds"]["window 1024"]["unpriced"] == []
    assert "| 64 | full, window 1024 |" in out


def test_the_planners_ranking_is_judged_at_the_runs_own_resolution():
    """`bench.predicted`: two rows predicted alike (the same plan) measured 6% apart set the tie at 6%, so modes
    measured 4% apart and predicted the other way are tied, 8% apart misranked; without such a pair the tie is 3%."""
    from bench import predicted

    def row(mode, layout, measured, predicted_):
        return {"mode": mode, "layout": layout, "path": "", "measured": measured, "predicted": predicted_,
                "compute": predicted_, "exposed": 0.0}  # fmt: skip

    twins = [row("a2a", "zigzag", 1.00, 0.9), row("a2a", "balanced", 1.06, 0.9)]
    close = [*twins, row("p2p", "zigzag", 1.04, 0.8)]  # p2p predicted faster, measured 4% slower than a2a's best
    assert predicted.resolution(close)[0] == pytest.approx(0.06) and predicted.misranked(close) == []
    far = [*twins, row("p2p", "zigzag", 1.08, 0.8)]
    assert predicted.misranked(far) == [("a2a", "p2p")]
    text = predicted.markdown(far)
    assert "within 6.0%, as far apart as a2a zigzag and a2a balanced, which run the same plan" in text
    assert text.endswith("not met: a2a < p2p measured, predicted the other way")
    alone = [row("a2a", "zigzag", 1.00, 0.9), row("p2p", "zigzag", 1.04, 0.8)]
    assert predicted.resolution(alone) == (predicted.TIE, None) and predicted.misranked(alone) == [("a2a", "p2p")]
