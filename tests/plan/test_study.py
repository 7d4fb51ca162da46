"""What the page "The modes from 8 to 1024 ranks" says of its curves holds for the curves (`sim.plan.study`, as the site builds them).

Each test is one bullet of the page's "What the curves say", checked on the four runs (two profiles, two models).
The runs take half a minute, so the tests are `full` (make test-all); the module's doctest runs two P in make test.
"""

from __future__ import annotations

import re

import pytest

from sim.plan.study import MODELS, PROFILES, STUDY_P, curves

pytestmark = pytest.mark.full
RUNS = [(prof, model) for prof in PROFILES for model in MODELS]


def run(prof: str, model: str):
    return curves(prof, MODELS[model])


def step(c, mode: str, P: int) -> float:
    return c.points[mode][c.Ps.index(P)].step


def a2a_size(name: str) -> int:
    return int(re.search(r"a2a_size=(\d+)", name).group(1))


@pytest.mark.parametrize("prof, model", RUNS)
def test_inside_one_node_the_fabric_and_the_heads_decide(prof, model):
    c = run(prof, model)
    want = {("h100-sxm", "Llama-3-8B-like"): "p2p", ("h100-sxm", "Llama-3-70B-like"): "all_gather",
            ("ascend-910b", "Llama-3-8B-like"): "a2a", ("ascend-910b", "Llama-3-70B-like"): "all_gather"}
    assert c.Ps[0] == 8 and c.winners[0] == want[prof, model]
    if c.winners[0] == "all_gather":
        assert c.points["all_gather"][0].name.endswith("overlap=True")
    if prof == "ascend-910b":  # the ring last
        assert step(c, "p2p", 8) == max(step(c, m, 8) for m in c.points)


@pytest.mark.parametrize("prof, model", RUNS)
def test_from_the_first_node_boundary_a2a_p2p_wins(prof, model):
    c = run(prof, model)
    assert all(w == "a2a+p2p" for w in c.winners[1:])
    for P, point in zip(c.Ps, c.points["a2a+p2p"]):
        if 16 <= P <= 128:
            assert a2a_size(point.name) in (4, 8), point.name
        elif P > 128:
            assert a2a_size(point.name) > 8, point.name


@pytest.mark.parametrize("prof, model", RUNS)
def test_ulysses_is_second_and_stops_where_the_heads_do(prof, model):
    c = run(prof, model)
    hq = MODELS[model][0]
    assert [P for P, p in zip(c.Ps, c.points["a2a"]) if p is not None] == [P for P in STUDY_P if P <= hq]
    for P in (P for P in c.Ps if 16 <= P <= hq):
        assert step(c, "a2a+p2p", P) < step(c, "a2a", P) < min(step(c, "p2p", P), step(c, "all_gather", P))


@pytest.mark.parametrize("prof, model", RUNS)
def test_the_ring_and_all_gather_gain_nothing_past_the_node_boundary(prof, model):
    c = run(prof, model)
    for mode in ("p2p", "all_gather"):
        assert all(step(c, mode, P) >= 0.8 * step(c, mode, 16) for P in c.Ps if P >= 16), mode


@pytest.mark.parametrize("prof, model", RUNS)
def test_nothing_scales_past_64_ranks(prof, model):
    c = run(prof, model)
    best = [step(c, w, P) * 1e3 for P, w in zip(c.Ps, c.winners) if P >= 64]
    low, high = {"h100-sxm": (6, 7.5), "ascend-910b": (13.5, 18)}[prof]  # the page's "about 6 to 7.5", "14 to 18"
    assert all(low <= ms <= high for ms in best), best


@pytest.mark.parametrize("prof", PROFILES)
def test_usp_advice_at_16_ranks(prof):
    c = run(prof, "Llama-3-8B-like")
    assert a2a_size(c.points["a2a+p2p"][c.Ps.index(16)].name) == 8 and c.winners[c.Ps.index(16)] == "a2a+p2p"


def test_the_ring_a_few_percent_ahead_of_ulysses_on_one_h100_node():
    for model in MODELS:
        c = run("h100-sxm", model)
        assert 1.0 < step(c, "a2a", 8) / step(c, "p2p", 8) < 1.06


def test_documents_kept_whole_at_8_and_16_ranks():
    """The page's "Documents kept whole": all_gather balanced with overlap wins inside a node; at 16 ranks a2a+p2p
    wins, faster over balanced than zigzag; the ring over balanced takes at most half its zigzag step."""
    from sim.plan.study import documents_kept_whole

    heads = MODELS["Llama-3-8B-like"]
    at8, at16 = (documents_kept_whole("h100-sxm", heads, P) for P in (8, 16))
    assert at8["winner"][0].name == "all_gather balanced overlap=True"
    assert at16["winner"][0].name.startswith("a2a+p2p balanced")
    assert at16["a2a+p2p"][1].step < at16["a2a+p2p"][0].step
    assert at16["p2p"][1].name == "p2p balanced" and at16["p2p"][1].step <= 0.5 * at16["p2p"][0].step


def test_inside_one_h100_node_the_ring_hides_its_shifts_where_ulysses_waits():
    """The page's reason for the ring at 8 ranks on the H100s: its exposed communication is smaller than Ulysses'."""
    for model in MODELS:
        c = run("h100-sxm", model)
        assert c.points["p2p"][0].exposed < c.points["a2a"][0].exposed


def test_usp_at_16_ranks_the_70b_like_heads_pick_4_on_the_h100s():
    c = run("h100-sxm", "Llama-3-70B-like")
    assert a2a_size(c.points["a2a+p2p"][c.Ps.index(16)].name) == 4


def whole_and_chunked():
    from sim.plan.study import whole_curves

    heads = MODELS["Llama-3-8B-like"]
    return whole_curves("h100-sxm", heads), curves("h100-sxm", heads)


def test_kept_whole_a2a_p2p_keeps_scaling_to_1024_ranks():
    """The page: falls all the way to 1024 ranks, to about 1.4 ms, under a quarter of its chunked best there."""
    whole, chunked = whole_and_chunked()
    steps = [step(whole, "a2a+p2p", P) for P in whole.Ps if P >= 16]
    assert all(b < a for a, b in zip(steps, steps[1:])), steps
    assert 1.2e-3 <= step(whole, "a2a+p2p", 1024) <= 1.7e-3
    assert step(whole, "a2a+p2p", 1024) < 0.25 * step(chunked, "a2a+p2p", 1024)
    assert all(w == "a2a+p2p" for P, w in zip(whole.Ps, whole.winners) if P >= 16)


def test_kept_whole_the_ring_is_at_its_best_at_128_ranks():
    """The page: at its best at 128 ranks, under a fifth of its chunked step there, slower again beyond."""
    whole, chunked = whole_and_chunked()
    ring = {P: step(whole, "p2p", P) for P in whole.Ps}
    assert min(ring, key=ring.get) == 128 and ring[128] < 0.2 * step(chunked, "p2p", 128)
    assert all(ring[P] > ring[128] for P in (256, 512, 1024))


def test_kept_whole_all_gather_and_ulysses_gain_nothing_past_one_node():
    """The page: no better than in the chunked layouts from 16 ranks on (within 10 %, and Ulysses within 2 %)."""
    whole, chunked = whole_and_chunked()
    for P in (P for P in whole.Ps if P >= 16):
        assert step(whole, "all_gather", P) >= 0.9 * step(chunked, "all_gather", P), P
        if whole.points["a2a"][whole.Ps.index(P)] is not None:
            assert step(whole, "a2a", P) >= 0.98 * step(chunked, "a2a", P), P
