"""Learn 9, "When CP pays": its numbers against the code they come from.

The overlap condition's crossover block (`crossover`, from the profile's kernel curve and link) is where the dry-run
ring stops waiting in its forward; the memory figure's activations at CP = P are one device's over P and its
attention share is what the mode saves on meta tensors; the timeline's steps are the planner's; the figures are
readable at the column width.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("matplotlib")

import cpref  # noqa: E402
from docs import figures, learn_pays  # noqa: E402
from sim.plan.dry import dry_run  # noqa: E402
from sim.plan.model import played  # noqa: E402
from sim.plan.planner import Candidate, predict  # noqa: E402
from sim.plan.profile import load_profile  # noqa: E402

P = 4


def forward_wait(b: int, profile, dtype: str) -> float:
    """Seconds rank 1 of a zigzag ring of P waits in its forward, at b tokens a rank (every rank on its own node)."""
    sharding = cpref.Sharding([0, P * b], cp_size=P, layout="zigzag")
    run = dry_run("p2p", sharding, 1, heads=learn_pays.HEADS, dtype=getattr(torch, dtype))
    intervals, _ = played(run, profile, profile.kernel(dtype))
    return sum(iv.seconds for iv in intervals if iv.kind == "wait" and iv.phase == "forward")


@pytest.mark.parametrize("name, dtype", [("h100-sxm", "bfloat16"), ("this-machine", "float32")])
def test_the_crossover_block_is_where_the_ring_forward_stops_waiting(name, dtype):
    profile = learn_pays.this_machine() if name == "this-machine" else load_profile(name)
    profile = dataclasses.replace(profile, ranks_per_node=1)  # every shift crosses nodes: the inter link
    b = learn_pays.crossover(profile, dtype, "inter")
    assert b is not None and b > 8
    above, below = b + b % 2, b - 2 + b % 2  # zigzag: an even block (T a multiple of 2P)
    assert forward_wait(above, profile, dtype) == 0
    assert forward_wait(below, profile, dtype) > 0
    assert forward_wait(4 * b, profile, dtype) == 0  # and it stays hidden above


def test_on_nvlink_the_h100_ring_never_waits_in_its_forward():
    profile = load_profile("h100-sxm")
    assert learn_pays.crossover(profile, "bfloat16", "intra") is None
    assert all(learn_pays.hidden(b, profile, "bfloat16", "intra") for b in (16, 512, 4096, 65536))


@pytest.mark.parametrize("T", learn_pays.MEM_T)
def test_activations_at_cp_p_are_one_devices_over_p(T):
    for P_ in learn_pays.MEM_P:
        assert learn_pays.model_bytes(T, P_) * P_ == learn_pays.model_bytes(T, 1)


def test_attention_share_is_what_the_mode_saves_on_meta_tensors():
    hq, hkv, d, dv = learn_pays.HEADS
    for T, P_ in ((256, 1), (1024, 4)):
        sharding = cpref.Sharding([0, T], cp_size=P_, layout="zigzag")
        run = dry_run("all_gather", sharding, 0, heads=learn_pays.HEADS, dtype=torch.bfloat16)
        assert learn_pays.attention_bytes(T, P_) == run.saved_bytes
        assert run.saved_bytes == T // P_ * (2 * (hq * d + hkv * d + hkv * dv + hq * dv) + 4 * hq)  # q k v out; lse


def test_the_fits_are_the_largest_lengths_under_the_memory():
    memory = learn_pays.h100_memory()
    for P_ in learn_pays.MEM_P:
        T = learn_pays.fits(P_)
        assert learn_pays.model_bytes(T, P_) <= memory < learn_pays.model_bytes(T + 2 * P_, P_)
    T = learn_pays.fits(1, recompute=True)
    assert learn_pays.recompute_bytes(T) <= memory < learn_pays.recompute_bytes(T + 2)


def test_the_timeline_is_the_planners_step_for_its_rank():
    profile = load_profile("h100-sxm")
    for mode, (intervals, step) in learn_pays.timelines().items():
        options = tuple(cpref.MODES[mode].example_options(learn_pays.TL_P).items())
        pred = predict(Candidate(mode, "zigzag", options), [learn_pays.TL_T], heads=learn_pays.HEADS,
                       dtype="bfloat16", P=learn_pays.TL_P, profile=profile, mask={})  # fmt: skip
        rank = next(r for r in pred.ranks if r.rank == learn_pays.TL_RANK)
        assert step == pytest.approx(rank.step, rel=1e-9), mode
        waits = sum(iv.seconds for iv in intervals if iv.kind == "wait")
        assert waits == pytest.approx(rank.exposed, rel=1e-9, abs=1e-12), mode


def test_every_text_placeholder_fills():
    for name, text in learn_pays.TEXT.items():
        out = text()
        assert out and "{" not in out.replace("{kv}", ""), name


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.full) if "where" in p else p
                                  for p in learn_pays.FIGURES])  # fmt: skip
def test_figures_are_readable(path):
    fig = learn_pays.FIGURES[path]()
    figures.check_readable(fig, path)
    figures.plt.close(fig)


def test_the_example_shows_what_the_page_says():
    """The long document divides by P with zigzag; short documents wait in zigzag and not when kept whole."""
    import contextlib
    import io
    import re
    import runpy

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        runpy.run_module("examples.learn.when_cp_pays", run_name="__main__")
    ms = {}
    for line in buffer.getvalue().splitlines():
        if not line.startswith("  "):
            batch, ideal = line.split(":")[0], float(re.findall(r"over P ([\d.]+) ms", line)[0])
        else:
            name, step, wait = re.match(r"\s+(.+?): step ([\d.]+) ms, of which waiting ([\d.]+) ms", line).groups()
            ms[batch, name] = (float(step) / ideal, float(wait) / float(step))
    long, short = sorted({b for b, _ in ms}, key=lambda b: "documents" in b)  # one document first
    assert ms[long, "p2p zigzag"][0] < 1.05 < ms[long, "p2p stream"][0]
    assert ms[short, "p2p stream"][1] == 0 and ms[short, "p2p zigzag"][1] > 0.9
