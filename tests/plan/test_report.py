"""What `python -m sim plan` prints (`sim.plan.report`): the key, the candidate the deciding term names, the refused
candidates, `--ranks-per-node`, a model's layers at several P, the call to paste, and the published profiles.

What each test would catch: a key whose words the numbers do not bear out, a deciding term that names a candidate the
table does not show, refusals that cannot be seen, a node size the plan ignores, `--layers` with several `--cp` refused
or priced from other plans, a printed call that does not run or runs another candidate, a profile figure without its
source or above its hardware's datasheet.
"""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch

import cpref
from sim.cluster.harness import max_error, oracle_shards, run_attention
from sim.plan import load_profile, plan
from sim.plan.planner import _sharding
from sim.plan.report import KEY
from sim.tools import plan as cli

ARGV = ["--lengths", "2048x2,1024", "--heads", "8,2,64", "--cp", "8", "--layouts", "zigzag,stream"]
MIB = 2**20


def rows(out: str, kind: str) -> dict[str, list[str]]:
    """`{candidate: its row's cells}` of one kind's table."""
    table = out.split(f"## {kind}\n", 1)[1].strip().split("\n\n", 1)[0]
    cut = ([c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:])
    return {cells[1] or cells[0]: cells for cells in cut}


def test_the_key_says_what_each_column_is_and_the_numbers_bear_it_out(capsys):
    """The key under the tables: `step ms` one layer's forward and backward on the slowest rank, its compute plus its
    exposed communication; the byte columns that rank's; `saved MiB` the most any rank saves (was: no key)."""
    assert cli.main(ARGV) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(KEY) and out.count("key (") == 1
    for column in ("step ms", "compute ms", "exposed comm ms", "comm ms", "sent intra / inter MiB", "saved MiB"):
        assert f"\n- {column}: " in KEY, column
    assert "one layer's attention, forward and backward, on its slowest rank" in KEY
    result = plan([2048, 2048, 1024], heads=(8, 2, 64, 64), dtype="bfloat16", P=8, profile="h100-sxm",
                  layouts=["zigzag", "stream"])  # fmt: skip
    shown = rows(out, "full")
    for p in result.kinds["full"].ranked[:12]:
        s = max(p.ranks, key=lambda r: r.step)
        assert p.step == s.step == pytest.approx(s.compute + s.exposed) and {r.calls > 0 for r in p.ranks} == {True}
        cells = shown[p.name]
        assert float(cells[2]) == round(p.step * 1e3, 3) and float(cells[3]) == round(s.compute * 1e3, 3)
        assert float(cells[4]) == round(s.exposed * 1e3, 3) and float(cells[6]) == round(s.bytes["intra"] / MIB, 1)
        assert float(cells[8]) == round(max(r.saved_bytes for r in p.ranks) / MIB, 1)


def test_the_candidate_the_deciding_term_names_is_a_row_of_the_table(capsys):
    """With `--top 1` the runner-up of another mode, which "decided by" names, still gets its row, numbered where it
    ranks, and the line gives that row (was: named, never shown)."""
    assert cli.main([*ARGV, "--top", "1"]) == 0
    out = capsys.readouterr().out
    result = plan([2048, 2048, 1024], heads=(8, 2, 64, 64), dtype="bfloat16", P=8, profile="h100-sxm",
                  layouts=["zigzag", "stream"])  # fmt: skip
    kp = result.kinds["full"]
    against = kp.against
    where = kp.ranked.index(against) + 1
    assert where > 1 and against.candidate.mode != kp.ranked[0].candidate.mode and against.name in kp.decided_by
    shown = rows(out, "full")
    assert list(shown) == [kp.ranked[0].name, "...", against.name] and shown[against.name][0] == str(where)
    assert f"decided by {kp.decided_by} (row {where})" in out
    assert json.loads(_json(capsys, [*ARGV, "--json"]))["kinds"]["full"]["against"] == against.name


def _json(capsys, argv) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_every_refused_candidate_can_be_seen_and_the_default_says_how(capsys):
    """By default one line counts the refused candidates and names the flag; `--show-refused` lists every one with
    its whole reason (was: the first four, cut at the first semicolon)."""
    refused = json.loads(_json(capsys, [*ARGV, "--json"]))["kinds"]["full"]["refused"]
    assert len(refused) > 4
    out = _json(capsys, ARGV)
    assert f"refused: {len(refused)} candidates (their modes refuse them: --show-refused lists each with the reason)" in out
    out = _json(capsys, [*ARGV, "--show-refused"])
    listed = out.split("## full", 1)[1].split(f"refused ({len(refused)}):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert listed == [f"- {r['candidate']}: {r['reason']}" for r in refused]


def test_ranks_per_node_replaces_the_profiles_and_decides_what_crosses_nodes(capsys):
    """`--ranks-per-node 4` at P = 8: two nodes, so some bytes cross them; the profile's 8 keeps every byte inside one
    (was: no such option)."""
    one = json.loads(_json(capsys, [*ARGV, "--json"]))
    two = json.loads(_json(capsys, [*ARGV, "--json", "--ranks-per-node", "4"]))
    assert (one["ranks_per_node"], two["ranks_per_node"]) == (8, 4)
    inter = lambda data: [r["bytes"]["inter"] for c in data["kinds"]["full"]["ranked"] for r in c["ranks"]]  # noqa: E731
    assert set(inter(one)) == {0} and max(inter(two)) > 0
    assert "P = 8 on h100-sxm (4 ranks per node)" in _json(capsys, [*ARGV, "--ranks-per-node", "4"])
    with pytest.raises(SystemExit) as parse:
        cli.main([*ARGV, "--ranks-per-node", "0"])
    assert parse.value.code == 2 and "--ranks-per-node" in capsys.readouterr().err


def test_a_models_layers_at_several_p_are_each_ps_best_layout(capsys):
    """`--layers` with `--cp 4,8`: per P the best layout for the whole model, its step and picks, from that P's plan
    (was: refused, "give one CP size")."""
    argv = ["--lengths", "1024,512x2", "--heads", "8,2,64", "--cp", "4,8", "--window", "128", "--modes", "p2p,a2a",
            "--layouts", "zigzag,stream", "--layers", "full=3,window=5"]  # fmt: skip
    out = _json(capsys, argv)
    table = out.split("## the model: 3 full + 5 window layers, one layout for all, at each P\n\n", 1)[1].splitlines()
    assert table[0] == "| P | layout | model step ms | full | window 128 |"
    data = json.loads(_json(capsys, [*argv, "--json"]))["model"]
    for line, P in zip(table[2:], (4, 8)):
        best = plan([1024, 512, 512], heads=(8, 2, 64, 64), dtype="bfloat16", P=P, profile="h100-sxm", window=128,
                    modes=["p2p", "a2a"], layouts=["zigzag", "stream"]).by_layout({"full": 3, "window 128": 5})  # fmt: skip
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert cells[:3] == [str(P), best[0].layout, f"{best[0].step * 1e3:.3f}"]
        assert cells[3].startswith(best[0].picks["full"].name + " (")
        assert data[str(P)][0] == {"layout": best[0].layout, "step_s": best[0].step,
                                   "picks": {k: p.name for k, p in best[0].picks.items()}}  # fmt: skip


@pytest.mark.parametrize("kind, extra", [("full", []), ("window 24", ["--window", "24"]), ("chunk 64", ["--chunk", "64"])])
def test_the_printed_call_runs_the_winner_and_computes_its_attention(kind, extra, capsys):
    """The winner printed as the lines to paste: the `Sharding` line builds the sharding the planner priced, and the
    `cpref.attention` keywords (mode, options, the kind's mask) run on the simulated cluster to the FP64 oracle (was:
    the candidate's name only)."""
    lengths = [160, 96]
    argv = ["--lengths", ",".join(map(str, lengths)), "--heads", "4,2,16", "--cp", "2", "--layouts", "zigzag,balanced",
            "--dtype", "fp32", *extra]  # fmt: skip
    out = _json(capsys, argv)
    block = out.split(f"## {kind}\n", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0].splitlines()
    result = plan(lengths, heads=(4, 2, 16, 16), dtype="float32", P=2, profile="h100-sxm", layouts=["zigzag", "balanced"],
                  window=24 if "window" in kind else None, chunk=64 if "chunk" in kind else None)  # fmt: skip
    winner = result.kinds[kind].ranked[0].candidate
    cu_seqlens = [0, 160, 256]
    scope = {"cpref": cpref, "cu_seqlens": cu_seqlens}
    exec(block[0], scope)  # noqa: S102 - the printed line, as a user pastes it
    sharding = scope["sharding"]
    want = _sharding(tuple(lengths), 2, winner.layout)
    assert (sharding.layout, sharding.cp_size, sharding.cu_seqlens_padded) == (want.layout, 2, want.cu_seqlens_padded)
    call = ast.parse(block[1]).body[0].value
    assert [ast.unparse(a) for a in call.args] == ["q", "k", "v", "sharding"]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg != "comm"}
    assert kwargs.pop("mode") == winner.mode and {k: kwargs[k] for k, _ in winner.options} == dict(winner.options)
    gen = torch.Generator().manual_seed(0)
    T = sharding.total
    q, k, v, dout = (torch.randn(T, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    got, _ = run_attention(q, k, v, dout, sharding, mode=winner.mode, **kwargs)
    mask = {key: kwargs[key] for key in ("window", "chunk") if key in kwargs}
    assert max_error(got, oracle_shards(q, k, v, dout, sharding, **mask)) < 1e-10


NEW = ("a100-sxm", "h200-sxm", "b200-sxm")


@pytest.mark.parametrize("name", NEW)
def test_the_published_gpu_profiles_source_every_figure_and_stay_under_their_datasheet(name):
    """A100, H200 and B200 beside H100: every figure and every datasheet figure has a source with its address; what
    the planner prices (achieved collective bandwidth per direction, the attention kernel's rate) stays under the line
    rate and the dense peak; each plans a batch."""
    profile = load_profile(name)
    data = json.loads(profile.path.read_text())
    sources = [data["links"][lv]["source"] for lv in ("intra", "inter")] + [c["source"] for c in data["compute"].values()]
    sheet = data["datasheet"]
    sources += [data["memory_source"]] + [entry["source"] for entry in sheet.values()]
    assert all(re.search(r"https://\S+", s) for s in sources), sources
    assert profile.links["intra"].bandwidth / 1e9 < sheet["nvlink_GBps_both_directions"]["value"] / 2
    assert profile.links["inter"].bandwidth / 1e9 < sheet["ib_Gbps_per_gpu"]["value"] / 8
    assert profile.kernel("bfloat16").peak / 1e12 < sheet["bf16_dense_tflops"]["value"]
    assert profile.ranks_per_node == 8 and profile.memory_bytes > 0
    result = plan([8192] * 4, heads=(32, 8, 128, 128), dtype="bfloat16", P=16, profile=name, layouts=["zigzag"])
    assert result.kinds["full"].ranked[0].step > 0


def test_the_derived_figures_are_their_stated_derivations():
    """The figures a profile derives from others, recomputed from the numbers its source strings give."""
    a100 = load_profile("a100-sxm").kernel("bfloat16").peak / 1e12
    assert a100 == round(3.5 / (1 / 230 + 2.5 / 196))  # FlashAttention-2 on A100: fwd 230, bwd 196
    assert load_profile("b200-sxm").links["intra"].bandwidth == pytest.approx(900e9 * 370 / 450)  # NVLink 5 x H100's
    h100, h200 = load_profile("h100-sxm"), load_profile("h200-sxm")
    assert (h200.links, h200.compute) == (h100.links, h100.compute) and h200.memory_bytes == 141e9  # H100 + HBM3e


def test_calibrate_refuses_to_write_over_a_published_profile(capsys, monkeypatch):
    """`--calibrate --out sim/plan/profiles/h100-sxm.json` is refused before measuring; the default writes
    `this-machine`, which git ignores."""
    import subprocess
    from pathlib import Path

    from sim.plan.profile import PROFILES

    monkeypatch.setattr("sim.plan.calibrate.calibrate", lambda out: pytest.fail("measured before checking --out"))
    assert cli.main(["--calibrate", "--out", str(PROFILES / "h100-sxm.json")]) == 2
    err = capsys.readouterr().err
    assert "is the published profile 'h100-sxm', which --calibrate must not overwrite" in err and err.count("\n") == 1
    root = Path(cli.__file__).resolve().parents[2]
    assert subprocess.run(["git", "check-ignore", "-q", str(PROFILES / "this-machine.json")], cwd=root).returncode == 0
