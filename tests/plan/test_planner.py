"""The planner end to end: candidates priced from their dry runs, ranked, the deciding term named; its bad input.

What each test would catch: a ranking that ignores the slowest rank (layouts that put a long document on one rank
win when they should lose), a deciding term that compares a candidate with itself, a layer kind that forgets its
mask (the window kind priced as full), refusals lost instead of listed, and the command line's one-line errors.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from cpref.base.errors import CPInputError
from sim.plan import load_profile, plan
from sim.plan.calibrate import BY_WORK, WIDTHS
from sim.plan.dry import dry_run
from sim.plan.model import rank_time
from sim.plan.planner import _sharding
from sim.plan.report import attention_call
from sim.tools import plan as cli

HEADS = (8, 2, 64, 64)


def test_every_candidate_is_its_ranks_dry_runs_priced_and_the_slowest_rank_is_its_step():
    result = plan([1024, 512, 512], heads=HEADS, dtype="bfloat16", P=4, profile="h100-sxm", modes=["p2p"])
    profile = load_profile("h100-sxm")
    for p in result.kinds["full"].ranked:
        sharding = _sharding((1024, 512, 512), 4, p.candidate.layout)
        want = [rank_time(dry_run("p2p", sharding, r, heads=HEADS, dtype=torch.bfloat16), profile,
                          profile.kernel("bfloat16")) for r in range(4)]  # fmt: skip
        assert list(p.ranks) == want and p.step == max(r.step for r in want)
    steps = [p.step for p in result.kinds["full"].ranked]
    assert steps == sorted(steps)


def test_the_contiguous_layouts_imbalance_loses_on_one_long_document():
    """The ring over one causal document: contiguous gives the last rank most of the work, zigzag balances it."""
    result = plan([8192], heads=HEADS, dtype="bfloat16", P=4, profile="h100-sxm", modes=["p2p"],
                  layouts=["contiguous", "zigzag"])  # fmt: skip
    ranked = [p.candidate.layout for p in result.kinds["full"].ranked]
    assert ranked == ["zigzag", "contiguous"]
    contiguous = result.kinds["full"].ranked[1]
    assert contiguous.slowest.rank == 3 and contiguous.slowest.compute > 1.5 * min(r.compute for r in contiguous.ranks)


def test_each_layer_kind_is_priced_with_its_own_mask_and_the_winner_named_against_another_mode():
    result = plan([4096, 4096], heads=HEADS, dtype="bfloat16", P=2, profile="h100-sxm", window=256, chunk=1024,
                  layouts=["zigzag"])  # fmt: skip
    assert list(result.kinds) == ["full", "window 256", "chunk 1024"]
    full, window, chunked = (result.kinds[k].ranked[0].slowest for k in result.kinds)
    assert window.flops < full.flops / 4 and chunked.flops < full.flops / 2 and window.compute < full.compute
    for kind in result.kinds.values():
        winner = kind.ranked[0]
        assert winner.name not in kind.decided_by
        assert kind.decided_by.startswith(("compute: ", "exposed communication: ", "a tie in step time with "))
    assert any(p.name == "all_gather zigzag overlap=True" for p in result.kinds["window 256"].refused)


def test_bad_input_is_one_error_naming_the_value():
    with pytest.raises(CPInputError, match=r"unknown mode 'ring'"):
        plan([64], heads=HEADS, dtype="bfloat16", P=2, profile="h100-sxm", modes=["ring"])
    with pytest.raises(CPInputError, match=r"unknown profile 'tpu'"):
        plan([64], heads=HEADS, dtype="bfloat16", P=2, profile="tpu")
    with pytest.raises(CPInputError, match=r"a2a_size=3 does not divide P = 8"):
        plan([64], heads=HEADS, dtype="bfloat16", P=8, profile="h100-sxm", a2a_size=3)
    with pytest.raises(CPInputError, match=r"no candidate runs full layers at P = 16 .*Hq = 8"):
        plan([256], heads=HEADS, dtype="bfloat16", P=16, profile="h100-sxm", modes=["a2a"])
    with pytest.raises(CPInputError, match=r"dtype='fp8'"):
        plan([64], heads=HEADS, dtype="fp8", P=2, profile="h100-sxm")
    with pytest.raises(CPInputError, match=r"lengths=\[64, 0\]"):
        plan([64, 0], heads=HEADS, dtype="bfloat16", P=2, profile="h100-sxm")


def test_the_command_line_prints_the_ranking_or_json_and_refuses_in_one_line(capsys):
    argv = ["--lengths", "2048x2,1024", "--heads", "8,2,64", "--cp", "2", "--layouts", "zigzag", "--window", "128"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "## full" in out and "## window 128" in out and out.count("best: **") == 2
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lengths"] == [2048, 2048, 1024] and data["heads"] == [8, 2, 64, 64]
    assert data["kinds"]["full"]["ranked"][0]["ranks"][0]["kernel_calls"] > 0
    assert cli.main([*argv, "--a2a-size", "3", "--cp", "4"]) == 2  # refused by the planner
    err = capsys.readouterr().err
    assert "a2a_size=3 does not divide P = 4" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as parse:  # refused by the parser
        cli.main([*argv, "--lengths", "2048y2"])
    err = capsys.readouterr().err
    assert parse.value.code == 2 and "expected document lengths" in err and err.count("\n") == 1


@pytest.mark.full
def test_calibrate_writes_a_profile_the_planner_takes(tmp_path, capsys):
    """`--calibrate` measures this machine (two gloo processes, about a minute) into a file that loads and plans."""
    out = tmp_path / "here.json"
    assert cli.main(["--calibrate", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    profile = load_profile(out)
    curve = profile.kernel("float32")
    assert curve.points and all(r > 0 for _, r in curve.points)
    assert [w for w, _ in curve.band] == [w + 1 for w in WIDTHS] and all(r > 0 for _, r in curve.band)
    assert [h for h, _ in curve.by_work] == [1, 2, 4] and all(r > 0 for _, c in curve.by_work for _, r in c)
    assert [n for n, _ in curve.by_work[0][1]] == [n * (n + 1) / 2 for n in BY_WORK[1]]  # one document's work each
    assert profile.links["intra"].bandwidth > 0 and profile.ranks_per_node == 2
    result = plan([2048, 1024], heads=(4, 4, 64, 64), dtype="float32", P=2, profile=out, layouts=["zigzag"])
    assert result.kinds["full"].ranked[0].step > 0


def test_this_machine_before_calibration_says_how_to_measure_it(monkeypatch, tmp_path):
    from sim.plan import profile as module

    monkeypatch.setattr(module, "PROFILES", tmp_path)
    with pytest.raises(CPInputError, match=r"'this-machine' is not measured yet: run python -m sim plan --calibrate"):
        load_profile("this-machine")


def test_sampled_batches_are_the_same_for_the_same_seed_and_fill_every_batch():
    from sim.plan.batches import sample

    a = sample("lognormal:4096,1.0", tokens=65536, batches=3, seed=7)
    assert a == sample("lognormal:4096,1.0", tokens=65536, batches=3, seed=7) != sample("lognormal:4096,1.0",
                                                                                        tokens=65536, batches=3, seed=8)  # fmt: skip
    assert [sum(b) for b in a] == [65536] * 3 and all(n >= 1 for b in a for n in b)
    assert sample("fixed:1000", tokens=2500, batches=1) == [[1000, 1000, 500]]  # the last document cut to fit
    for spec, message in (("gamma:1,2", "unknown distribution 'gamma:1,2'"), ("uniform:5", "uniform takes 2 positive"),
                          ("uniform:9,3", "needs LO <= HI"), ("lognormal:-1,1", "lognormal takes 2 positive")):  # fmt: skip
        with pytest.raises(CPInputError, match=message):
            sample(spec, tokens=100)


def test_several_batches_rank_by_the_mean_step_of_each_candidate():
    batches = [[1024, 512, 512], [2048]]
    both = plan(batches, heads=HEADS, dtype="bfloat16", P=2, profile="h100-sxm", layouts=["zigzag"], modes=["p2p", "a2a"])
    alone = [plan(b, heads=HEADS, dtype="bfloat16", P=2, profile="h100-sxm", layouts=["zigzag"], modes=["p2p", "a2a"])
             for b in batches]  # fmt: skip
    for p in both.kinds["full"].ranked:
        steps = [next(q.step for q in r.kinds["full"].ranked if q.name == p.name) for r in alone]
        assert p.batch_steps == tuple(steps) and p.step == pytest.approx(sum(steps) / 2)
        assert p.slowest.step == max(steps)  # the columns: the slowest batch's


def test_the_command_line_samples_batches(capsys):
    argv = ["--sample", "uniform:500,3000", "--tokens", "8192", "--batches", "2", "--heads", "8,2,64", "--cp", "2",
            "--layouts", "zigzag", "--modes", "p2p,a2a"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "2 sampled batches of 8192 tokens" in capsys.readouterr().out
    assert cli.main(["--heads", "8,2,64", "--cp", "2"]) == 2
    assert "one of --lengths and --sample required" in capsys.readouterr().err


def test_calibrate_into_a_folder_that_is_not_there_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sim.plan.calibrate.calibrate", lambda out: pytest.fail("measured before checking --out"))
    assert cli.main(["--calibrate", "--out", str(tmp_path / "no" / "such.json")]) == 2
    err = capsys.readouterr().err
    assert "is not a writable folder; give --out a file in one" in err and err.count("\n") == 1


def test_the_command_line_lists_what_it_did_not_price_and_takes_the_limit(capsys, monkeypatch):
    """Above `--dry-run-limit` ranks the candidates only the dry run prices are listed as not priced, in the table
    and the JSON; a larger limit prices them; a limit that is not a positive int is refused by the parser. Every
    candidate the planner makes is built at scale today, so the overlap over stream is made dry-run only here (its
    builder told it covers nothing with `overlap`)."""
    from sim.plan import planner

    real = planner.piece_all_gather_covers
    monkeypatch.setattr(planner, "piece_all_gather_covers", lambda mode, layout, options, P, mask: not options.get(
        "overlap") and real(mode, layout, options, P, mask))  # fmt: skip
    argv = ["--lengths", "512x2", "--heads", "8,2,64", "--cp", "4", "--layouts", "zigzag,stream", "--modes", "all_gather"]
    assert cli.main([*argv, "--dry-run-limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "not priced (1: all_gather stream overlap=True): P = 4 > dry_run_limit = 2" in out
    assert "| all_gather stream |" in out
    assert cli.main([*argv, "--dry-run-limit", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["kinds"]["full"]
    assert [p["candidate"] for p in data["not_priced"]] == ["all_gather stream overlap=True"]
    assert len(data["ranked"]) == 3
    assert cli.main([*argv, "--dry-run-limit", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["kinds"]["full"]
    assert data["not_priced"] == [] and len(data["ranked"]) == 4
    with pytest.raises(SystemExit) as parse:
        cli.main([*argv, "--dry-run-limit", "0"])
    assert parse.value.code == 2 and "--dry-run-limit" in capsys.readouterr().err


def test_check_kernel_times_each_call_beside_the_profiles_prediction():
    """`check_kernel` on the CPU (the GPU runs the same code with CudaKernel): one forward and one backward call per
    length, each with the time the profile predicts for exactly that call, the ratio, and the fitted curve."""
    from sim.plan.calibrate import check_kernel
    from sim.plan.dry import KernelCall
    from sim.plan.profile import load_profile

    result = check_kernel("h100-sxm", device="cpu", dtype="float32", heads=2, dim=16, lengths=(64, 128), repeats=1)
    compute = load_profile("h100-sxm").kernel("float32")
    assert [(r["tokens"], r["direction"]) for r in result["rows"]] == [(64, "forward"), (64, "backward"),
                                                                        (128, "forward"), (128, "backward")]  # fmt: skip
    for r in result["rows"]:
        n = r["tokens"]
        call = KernelCall(r["direction"], n * (n + 1) // 2, n, n, 2, 2, 16, 16)
        assert r["predicted_s"] == compute.call_seconds(call) and r["gflop"] == call.flops / 1e9
        assert r["measured_s"] > 0 and r["ratio"] == r["measured_s"] / r["predicted_s"]
    assert result["profile"] == {"peak_tflops": 15.0, "half_size_gflop": 2.5}
    assert all(math.isfinite(x) for x in result["fit"].values())  # two timed pairs, noisy here: fitted, not judged
    with pytest.raises(CPInputError, match=r"lengths=\[64\]: give two lengths or more"):
        check_kernel("h100-sxm", device="cpu", dtype="float32", lengths=(64,))
    with pytest.raises(CPInputError, match=r"dtype='fp8': give one of"):
        check_kernel("h100-sxm", device="cpu", dtype="fp8")


def test_check_kernel_on_the_command_line_and_its_refusals(capsys, monkeypatch):
    from sim.plan import calibrate

    real = calibrate.check_kernel
    monkeypatch.setattr(calibrate, "check_kernel", lambda *a, **k: real(*a, **{**k, "lengths": (64, 96), "repeats": 1}))
    assert cli.main(["--check-kernel", "h100-sxm", "--device", "cpu", "--dtype", "fp32", "--heads", "2,2,16"]) == 0
    out = capsys.readouterr().out
    assert "| 64 | forward |" in out and "| 64 | backward |" in out and "the profile: 15 TFLOP/s, 2.5 GFLOP" in out
    assert cli.main(["--check-kernel", "h100-sxm", "--device", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert "--device nowhere" in err and err.count("\n") == 1
    assert cli.main(["--check-kernel", "tpu", "--device", "cpu"]) == 2
    assert "unknown profile 'tpu'" in capsys.readouterr().err
    assert cli.main(["--check-kernel", "h100-sxm", "--device", "cpu", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "dtype='fp8'" in err and err.count("\n") == 1


def test_a_models_layers_share_one_layout():
    """`Plan.by_layout`: per layout, each kind's best candidate in it and the model's step, the layer counts times
    the picks' steps; fastest first; a kind the plan has not priced, or a bad count, refused by name."""
    result = plan([1024, 512, 512], heads=HEADS, dtype="bfloat16", P=4, profile="h100-sxm", window=128,
                  modes=["p2p", "a2a"], layouts=["zigzag", "stream"])  # fmt: skip
    choices = result.by_layout({"full": 3, "window 128": 5})
    assert [c.layout for c in choices] == sorted(["zigzag", "stream"], key=lambda la: next(
        c.step for c in choices if c.layout == la))  # fmt: skip
    for c in choices:
        for kind in ("full", "window 128"):
            best = next(p for p in result.kinds[kind].ranked if p.candidate.layout == c.layout)
            assert c.picks[kind] is best
        assert c.step == pytest.approx(3 * c.picks["full"].step + 5 * c.picks["window 128"].step)
    with pytest.raises(CPInputError, match=r"no 'chunk 64' layer kind in this plan"):
        result.by_layout({"chunk 64": 2})
    with pytest.raises(CPInputError, match=r"layers\['full'\]=0"):
        result.by_layout({"full": 0})


def test_the_command_line_plans_a_models_layers(capsys):
    argv = ["--lengths", "1024,512x2", "--heads", "8,2,64", "--cp", "4", "--window", "128", "--modes", "p2p,a2a",
            "--layouts", "zigzag,stream", "--layers", "full=3,window=5"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "## the model: 3 full + 5 window layers, one layout for all" in out and "best for the model: **" in out
    assert cli.main([*argv, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert {m["layout"] for m in model} == {"zigzag", "stream"} and set(model[0]["picks"]) == {"full", "window 128"}
    assert cli.main([*argv[:-1], "full=3,chunk=2"]) == 2  # no --chunk given
    assert "--layers chunk=2 needs --chunk" in capsys.readouterr().err
    with pytest.raises(SystemExit) as parse:
        cli.main([*argv[:-1], "mlp=3"])
    assert parse.value.code == 2 and "expected layer counts" in capsys.readouterr().err


def test_soft_capped_layers_cost_the_profiles_factor_on_every_call_and_move_the_same_bytes(tmp_path, capsys):
    """`softcap=`: the same counts (bytes, calls, memory) on every rank of every candidate, built at scale (p2p
    zigzag at P = 4) or dry-run (stream), each call's time the profile's factor times as much (so the compute, not the
    exposed communication, scales); refused by name on a profile that has no factor, or for a cap that is not one."""
    data = json.loads(load_profile("h100-sxm").path.read_text())
    data["compute"]["bfloat16"]["softcap_factor"] = 1.75
    path = tmp_path / "capped.json"
    path.write_text(json.dumps(data))
    args = dict(heads=HEADS, dtype="bfloat16", P=4, profile=str(path), layouts=["zigzag", "stream"], window=64)
    plain, capped = plan([2048, 1024], **args), plan([2048, 1024], **args, softcap=30.0)
    assert capped.softcap == 30.0 and plain.kinds.keys() == capped.kinds.keys()
    for kind, kp in plain.kinds.items():
        by_name = {p.name: p for p in capped.kinds[kind].ranked}
        assert set(by_name) == {p.name for p in kp.ranked}
        for p in kp.ranked:
            for a, b in zip(p.ranks, by_name[p.name].ranks):
                assert (b.bytes, b.calls, b.flops, b.saved_bytes) == (a.bytes, a.calls, a.flops, a.saved_bytes)
                assert b.compute == pytest.approx(1.75 * a.compute, rel=1e-12)
    assert cli.main(["--lengths", "2048,1024", "--heads", "8,2,64", "--cp", "4", "--profile", str(path), "--softcap",
                     "30"]) == 0  # fmt: skip
    assert "soft-capped at 30 (every call 1.75x)" in capsys.readouterr().out
    for name in ("h100-sxm", "ascend-910b"):  # no shipped profile has a published factor
        with pytest.raises(CPInputError, match=rf"profile '{name}' has no softcap_factor for bfloat16: .*or plan without"):
            plan([2048], heads=HEADS, dtype="bfloat16", P=2, profile=name, softcap=30.0)
    with pytest.raises(CPInputError, match=r"softcap=0.0 must be a finite number > 0"):
        plan([2048], **args, softcap=0.0)
    assert cli.main(["--lengths", "2048", "--heads", "8,2,64", "--cp", "2", "--softcap", "30"]) == 2
    err = capsys.readouterr().err
    assert "has no softcap_factor" in err and err.count("\n") == 1


def _masked_plan(lengths, mask, **kw):
    return plan(lengths, heads=HEADS, dtype="bfloat16", P=4, profile="h100-sxm", mask=mask, mask_name="prefix-lm", **kw)


def test_a_mask_is_its_own_layer_kind_priced_from_every_ranks_dry_run_and_balanced_by_the_mask():
    """`mask=`: the kind `mask NAME` replaces full causal; every candidate is its P ranks' dry runs under the mask
    (the kernel work of each p2p rank exactly the mask's pairs of its rows), the balanced layout's sharding placed
    by the mask; the winning call says `mask=mask` (and the sharding's, where balanced wins)."""
    import cpref

    lengths = [1000, 600, 300, 120, 80, 40]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mask = cpref.Mask.prefix_lm(cu, [n // 2 for n in lengths])
    result = _masked_plan(lengths, mask, window=64, modes=["p2p", "a2a"])
    assert list(result.kinds) == ["mask prefix-lm", "window 64"]
    kp, profile = result.kinds["mask prefix-lm"], load_profile("h100-sxm")
    for p in kp.ranked:
        sharding = _sharding(tuple(lengths), 4, p.candidate.layout, mask)
        assert (sharding.mask is mask) == (p.candidate.layout == "balanced")
        runs = [dry_run(p.candidate.mode, sharding, r, heads=HEADS, dtype=torch.bfloat16, mask=mask,
                        **dict(p.candidate.options)) for r in range(4)]  # fmt: skip
        assert list(p.ranks) == [rank_time(run, profile, profile.kernel("bfloat16")) for run in runs]
        if p.candidate.mode == "p2p":
            for r, run in enumerate(runs):
                work = sum(c.work for c in run.calls if c.direction == "forward")
                assert work == sharding.attention_work(r, mask=mask), (p.name, r)
    balanced = next(p for p in kp.ranked if p.candidate.layout == "balanced")
    call = attention_call(4, kp, pick=balanced)
    assert 'layout="balanced", mask=mask)' in call and call.endswith(", mask=mask)")
    assert "window=(64, 0)" in attention_call(4, result.kinds["window 64"])


def test_under_a_prefix_lm_the_ring_moves_what_the_mask_reads_not_the_causal_rings_blocks():
    """Many short documents, stream layout: under full causal the stream ring moves the rows of the documents cut
    between ranks; under a prefix-LM mask no more than that; a mask that reads no other rank's row, nothing."""
    import cpref

    lengths = [64] * 32
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    args = dict(heads=HEADS, dtype="bfloat16", P=4, profile="h100-sxm", modes=["p2p"], layouts=["stream", "zigzag"])
    causal = plan(lengths, **args).kinds["full"]
    masked = plan(lengths, **args, mask=cpref.Mask.prefix_lm(cu, [16] * 32), mask_name="prefix-lm").kinds["mask prefix-lm"]

    def sent(kp, layout):
        p = next(p for p in kp.ranked if p.candidate.layout == layout)
        return max(r.bytes["intra"] + r.bytes["inter"] for r in p.ranks)

    assert sent(masked, "stream") == 0 < sent(masked, "zigzag") <= sent(causal, "zigzag")


def test_several_batches_take_a_mask_per_batch():
    import cpref

    def prefix(lengths):
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        return cpref.Mask.prefix_lm(cu, [n // 2 for n in lengths])

    batches = [[512, 256], [256, 256, 256]]
    result = _masked_plan(batches, prefix, modes=["p2p"], layouts=["zigzag"])
    alone = [_masked_plan(b, prefix(b), modes=["p2p"], layouts=["zigzag"]).kinds["mask prefix-lm"].ranked[0].step
             for b in batches]  # fmt: skip
    assert result.kinds["mask prefix-lm"].ranked[0].step == pytest.approx(sum(alone) / 2)


def test_the_planner_ranks_the_layout_balanced_by_the_mask_by_its_work_calls_and_bytes():
    """`cpref.batch.balanced_mask`'s example: p2p over 13 documents under a prefix-LM at P = 4 on the H100 profile.
    Balanced by the mask, the busiest rank does a tenth less work than zigzag's, makes no more kernel calls and
    sends a third of the bytes; the planner ranks it first."""
    from sim.tools.verify.masks import mask_of

    lengths = (4096, *[1024] * 4, *[512] * 8)
    mask = mask_of("prefix-lm", lengths, seed=0)
    result = plan(list(lengths), heads=(32, 8, 128, 128), dtype="bfloat16", P=4, profile="h100-sxm", modes=["p2p"],
                  layouts=["balanced", "zigzag"], mask=mask, mask_name="prefix-lm")  # fmt: skip
    ranked = {p.candidate.layout: p for p in result.kinds["mask prefix-lm"].ranked}
    assert list(ranked) == ["balanced", "zigzag"]
    work = {layout: max(_sharding(lengths, 4, layout, mask).attention_work(r, mask=mask) for r in range(4))
            for layout in ranked}  # fmt: skip
    assert work["balanced"] * 1.10 < work["zigzag"]
    calls = {layout: max(r.calls for r in p.ranks) for layout, p in ranked.items()}
    sent = {layout: max(sum(r.bytes.values()) for r in p.ranks) for layout, p in ranked.items()}
    assert calls["balanced"] <= calls["zigzag"] and 3 * sent["balanced"] == sent["zigzag"]
