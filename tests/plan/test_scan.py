"""Several P at once (`sim.plan.study.scan`, `python -m sim plan --cp 8,16,...`) and the planner's figures."""

from __future__ import annotations

import json

import pytest

from sim.plan import figures
from sim.plan.planner import plan
from sim.plan.study import MODES_SHOWN, scan
from sim.tools import plan as cli

ARGS = dict(heads=(8, 2, 64, 64), dtype="bfloat16", profile="h100-sxm", layouts=["zigzag"])
LENGTHS = [2048, 1024, 1024]


def test_scan_keeps_each_modes_best_of_every_plan():
    """Each P's curves are that P's plan: per mode its best candidate (None where none runs), the winner, the
    deciding term; a crossover wherever the winner changes."""
    curves = scan(LENGTHS, Ps=(2, 4, 16), window=256, **ARGS)
    assert set(curves) == {"full", "window 256"}
    for kind, c in curves.items():
        for i, P in enumerate(c.Ps):
            kp = plan(LENGTHS, P=P, window=256, **ARGS).kinds[kind]
            assert c.winners[i] == kp.ranked[0].candidate.mode and c.decided_by[i] == kp.decided_by
            for mode in MODES_SHOWN:
                best = next((p for p in kp.ranked if p.candidate.mode == mode), None)
                point = c.points[mode][i]
                assert (point is None) == (best is None)
                assert point is None or (point.name, point.step) == (best.name, best.step)
        assert c.crossovers == tuple((a, b, x, y) for a, b, x, y in zip(c.Ps, c.Ps[1:], c.winners, c.winners[1:])
                                     if x != y)  # fmt: skip
    assert curves["full"].points["a2a"][2] is None  # 16 ranks cannot split 8 query heads


def test_the_command_line_scans_several_p_and_draws(tmp_path, capsys):
    argv = ["--lengths", "2048,1024x2", "--heads", "8,2,64", "--layouts", "zigzag", "--cp", "2,4,16"]
    assert cli.main([*argv, "--figure", str(tmp_path / "scan.png")]) == 0
    out = capsys.readouterr().out
    assert "| P | a2a ms | a2a+p2p ms | p2p ms | all_gather ms | winner |" in out and "| 16 | - |" in out
    assert (tmp_path / "scan.png").stat().st_size > 0 and f"figure: {tmp_path / 'scan.png'}" in out
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["full"]
    assert data["P"] == [2, 4, 16] and len(data["winners"]) == 3 and data["modes"]["a2a"][2] is None
    with pytest.raises(SystemExit) as parse:
        cli.main([*argv[:-1], "4,2"])
    assert parse.value.code == 2 and "increasing sizes" in capsys.readouterr().err
    assert cli.main([*argv, "--figure", str(tmp_path / "missing" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the figure" in err and err.count("\n") == 1


def test_the_ranking_figure_draws_each_candidates_compute_and_exposed_time():
    """The bars are the plan's numbers: per candidate, compute (solid) then exposed communication from its end."""
    kp = plan(LENGTHS, P=4, **ARGS).kinds["full"]
    fig = figures.figure({"full": kp}, "test", top=3)
    bars = [p for p in fig.axes[0].patches if p.get_height() > 0 and p.get_width() >= 0][:6]
    compute, exposed = bars[:3], bars[3:]
    for i, p in enumerate(kp.ranked[:3]):
        assert compute[i].get_width() == pytest.approx(p.slowest.compute * 1e3)
        assert exposed[i].get_x() == pytest.approx(p.slowest.compute * 1e3)
        assert exposed[i].get_width() == pytest.approx(p.slowest.exposed * 1e3)
    labels = fig.axes[0].get_yticklabels()
    assert [t.get_text() for t in labels] == [p.name for p in kp.ranked[:3]] and labels[0].get_fontweight() == "bold"
