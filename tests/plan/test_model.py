"""Profiles as files and the time model's terms, each against its formula with numbers chosen by hand.

The profile loader refuses every bad number by name (the issue's bad input); the shipped profiles give a source for
every figure. Each collective's time is its row of `sim.plan.model`'s table (a ring that crosses a node boundary
pays the inter-node rate for all of it; an all-to-all each level its own bytes; a ring shift the slower of its two
links); the timeline hides a posted collective behind the calls before its wait and no more.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.base.errors import CPInputError
from sim.plan.dry import Collective, Event, KernelCall, RankRun
from sim.plan.model import collective_seconds, rank_time
from sim.plan.profile import Compute, load_profile, profile_names

GOOD = {"name": "toy", "ranks_per_node": 2,
        "links": {"intra": {"bandwidth_GBps": 100, "latency_us": 1, "source": "hand"},
                  "inter": {"bandwidth_GBps": 10, "latency_us": 5, "source": "hand"}},
        "compute": {"bfloat16": {"peak_tflops": 100, "half_size_gflop": 1, "source": "hand"}},
        "memory_GB": 80, "memory_source": "hand"}  # fmt: skip


def write(tmp_path, data) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def toy(tmp_path):
    return load_profile(write(tmp_path, GOOD))


def test_every_shipped_profile_loads_and_names_a_source_for_every_figure():
    assert {"h100-sxm", "ascend-910b"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        data = json.loads(profile.path.read_text())
        assert profile.name == name and data["memory_source"]
        assert all(data["links"][lv]["source"] for lv in ("intra", "inter"))
        assert all(entry["source"] for entry in data["compute"].values())


@pytest.mark.parametrize("path, value, message", [
    (("links", "inter", "bandwidth_GBps"), -3, r"links.inter.bandwidth_GBps is -3; give GB/s one rank sends"),
    (("links", "intra", "latency_us"), 0, r"links.intra.latency_us is 0; give one message's latency"),
    (("compute", "bfloat16", "peak_tflops"), "fast", r"compute.bfloat16.peak_tflops is 'fast'"),
    (("compute", "bfloat16", "half_size_gflop"), True, r"compute.bfloat16.half_size_gflop is True"),
    (("memory_GB",), float("inf"), r"memory_GB is inf"),
    (("ranks_per_node",), 2.5, r"ranks_per_node is 2.5; give a whole number"),
])  # fmt: skip
def test_a_profile_with_a_bad_number_is_refused_naming_it(tmp_path, path, value, message):
    data = json.loads(json.dumps(GOOD))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(CPInputError, match=message):
        load_profile(write(tmp_path, data))


def test_a_profile_with_a_missing_number_or_not_json_is_refused(tmp_path):
    data = json.loads(json.dumps(GOOD))
    del data["links"]["inter"]["latency_us"]
    with pytest.raises(CPInputError, match=r"links.inter.latency_us is missing"):
        load_profile(write(tmp_path, data))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(CPInputError, match=r"cannot read it as JSON"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(CPInputError, match=r"unknown profile 'no-such-machine'"):
        load_profile("no-such-machine")


def test_a_dtype_the_profile_has_no_figures_for_is_refused(toy):
    with pytest.raises(CPInputError, match=r"has no compute figures for float32; it has \['bfloat16'\]"):
        toy.kernel("float32")


def test_a_call_costs_its_flops_plus_the_half_size_at_the_peak():
    curve = Compute(peak=100e12, half_size=1e9)
    assert curve.seconds(1e9) == pytest.approx(2e9 / 100e12)  # half the peak rate at the half size
    assert curve.seconds(0) == 0.0
    call = KernelCall("forward", work=1000, q_rows=10, kv_rows=100, hq=4, hkv=2, d=64, dv=32)
    assert call.flops == 2 * 1000 * 4 * (64 + 32)
    assert KernelCall("backward", 1000, 10, 100, 4, 2, 64, 32).flops == 2 * 1000 * 4 * (3 * 64 + 2 * 32)


MB = 1_000_000  # 10^6 bytes: 250_000 float32 elements


def col(op: str, group, rank: int, shift: int = 0) -> Collective:
    return Collective(op, tuple(group), rank, (250_000,), torch.float32, shift)


def test_each_collective_takes_its_rows_time(toy):
    intra, inter = toy.links["intra"], toy.links["inter"]
    # a ring all-gather of 2 ranks on one node: 1 step of 1 MB intra
    assert collective_seconds(col("all_gather", (0, 1), 0), toy) == pytest.approx(intra.latency + MB / intra.bandwidth)
    # 4 ranks over 2 nodes: 3 steps, 3 MB, at the inter rate (the ring's slowest hop), though rank 0 sends within
    assert collective_seconds(col("all_gather", (0, 1, 2, 3), 0), toy) == pytest.approx(3 * inter.latency + 3 * MB / inter.bandwidth)
    # all_reduce: 2 (P - 1) steps, 2 (P - 1) / P of the input
    assert collective_seconds(col("all_reduce", (0, 1), 0), toy) == pytest.approx(2 * intra.latency + MB / intra.bandwidth)
    # reduce-scatter: (P - 1) / P of the input
    assert collective_seconds(col("reduce_scatter", (0, 1, 2, 3), 1), toy) == pytest.approx(
        3 * inter.latency + 0.75 * MB / inter.bandwidth)
    # all-to-all over 4 ranks: 1/4 MB to its node's peer, 2/4 MB across; each level its own bytes, at once
    assert collective_seconds(col("all_to_all", (0, 1, 2, 3), 0), toy) == pytest.approx(
        inter.latency + max(0.25 * MB / intra.bandwidth, 0.5 * MB / inter.bandwidth))
    # a ring shift: rank 1 sends to 2 (another node), rank 0 to 1 but receives from 3: both wait for the inter link
    for rank in (0, 1):
        assert collective_seconds(col("send_recv", (0, 1, 2, 3), rank, 1), toy) == pytest.approx(
            inter.latency + MB / inter.bandwidth)
    assert collective_seconds(col("send_recv", (0, 1, 2, 3), 0, 4), toy) == 0.0  # a shift of P: nothing moves


def test_a_ring_shift_uses_the_one_peer_rate_where_the_profile_gives_one(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["links"]["intra"]["send_recv_bandwidth_GBps"] = 20
    profile = load_profile(write(tmp_path, data))
    assert collective_seconds(col("send_recv", (0, 1), 0, 1), profile) == pytest.approx(1e-6 + MB / 20e9)
    assert collective_seconds(col("all_gather", (0, 1), 0), profile) == pytest.approx(1e-6 + MB / 100e9)


def run_of(timeline, collectives) -> RankRun:
    return RankRun(0, tuple(collectives), tuple(timeline), saved_bytes=7)


def test_a_posted_collective_hides_behind_the_calls_before_its_wait_and_no_more(toy):
    shift = col("send_recv", (0, 1), 0, 1)  # 1e-6 + 1e-5 = 11 us
    t_comm = collective_seconds(shift, toy)
    compute = Compute(peak=1e12, half_size=1.0)
    flops_for = {"short": 2e6, "long": 40e6}  # 2 us and 40 us of compute (plus 1e-12)
    for length in ("short", "long"):
        call = KernelCall("forward", int(flops_for[length] / (2 * 1 * 128)), 1, 1, 1, 1, 64, 64)
        exposed = max(0.0, t_comm - compute.seconds(call.flops))
        assert (exposed > 5e-6) == (length == "short")
        overlapped = run_of([Event("post", "forward", 0), Event("call", "forward", call=call), Event("wait", "forward", 0)],
                            [shift])  # fmt: skip
        t = rank_time(overlapped, toy, compute)
        assert t.exposed == pytest.approx(exposed, abs=1e-12)
        assert t.step == pytest.approx(t.compute + t.exposed) and t.comm == pytest.approx(t_comm)
        blocking = run_of([Event("post", "forward", 0), Event("wait", "forward", 0), Event("call", "forward", call=call)],
                          [shift])  # fmt: skip
        assert rank_time(blocking, toy, compute).exposed == pytest.approx(t_comm)  # waited at once: all of it exposed


def test_collectives_queue_on_one_communication_clock(toy):
    """Two shifts posted back to back finish one after the other: the second wait sees both."""
    shifts = [col("send_recv", (0, 1), 0, 1)] * 2
    t_comm = collective_seconds(shifts[0], toy)
    run = run_of([Event("post", "forward", 0), Event("post", "forward", 1), Event("wait", "forward", 1)], shifts)
    t = rank_time(run, toy, Compute(1e12, 1.0))
    assert t.exposed == pytest.approx(2 * t_comm) and t.bytes == {"intra": 2 * MB, "inter": 0} and t.saved_bytes == 7


def test_a_measured_curve_is_interpolated_in_the_log_of_the_size_and_held_at_its_ends(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"]["points"] = [[1, 10], [100, 30]]  # 1 GFLOP at 10 TFLOP/s, 100 GFLOP at 30
    curve = load_profile(write(tmp_path, data)).kernel("bfloat16")
    assert curve.rate(10e9) == pytest.approx(20e12)  # halfway in log size: halfway in rate
    assert curve.rate(0.01e9) == 10e12 and curve.rate(1e15) == 30e12
    assert curve.seconds(10e9) == pytest.approx(10e9 / 20e12)
    data["compute"]["bfloat16"]["points"] = [[100, 30], [1, 10]]
    with pytest.raises(CPInputError, match=r"points must be in increasing call size"):
        load_profile(write(tmp_path, data))
    data["compute"]["bfloat16"]["points"] = [[1, -10]]
    with pytest.raises(CPInputError, match=r"compute.bfloat16.points\[0\]\[1\] is -10"):
        load_profile(write(tmp_path, data))


def test_a_windowed_call_takes_its_bands_rate_by_width_and_every_other_call_the_main_curve(tmp_path):
    """Two calls of the same FLOPs under windows of 256 and 1024 keys take the band curve's rates at those widths
    (halfway in log width: halfway in rate); without a window, or in a profile without a band curve, the main curve's."""
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"]["band"] = [[128, 10], [2048, 50]]  # TFLOP/s at 128 and 2048 keys
    curve = load_profile(write(tmp_path, data)).kernel("bfloat16")
    narrow, wide = (KernelCall("forward", 10**6, 4096, 4096, 8, 8, 128, 128, True, 4096, w) for w in (128, 512))
    assert curve.call_seconds(narrow) == pytest.approx(narrow.flops / 10e12)
    assert curve.call_seconds(wide) == pytest.approx(wide.flops / 30e12)  # 512: halfway between 128 and 2048 in log
    assert curve.call_seconds(KernelCall("forward", 10**6, 64, 64, 8, 8, 128, 128, True, 64, 10**5)) == pytest.approx(
        narrow.flops / 50e12)  # held at the widest point
    plain = KernelCall("forward", 10**6, 4096, 4096, 8, 8, 128, 128)
    assert curve.call_seconds(plain) == curve.seconds(plain.flops) != curve.call_seconds(narrow)
    no_band = load_profile(write(tmp_path, GOOD)).kernel("bfloat16")
    assert no_band.call_seconds(wide) == no_band.seconds(wide.flops)


def test_a_call_takes_its_shapes_rate_by_work_per_head_and_heads_where_the_profile_has_by_work(tmp_path):
    """Linear in log work on each head count's curve, then linear in log heads between the two nearest, held at the
    ends of both; a forward and its backward (2.5 times the FLOPs) at one rate; windowed calls keep the band's rate."""
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"].update(by_work={"1": [[1, 20], [100, 40]], "4": [[1, 10], [100, 30]]},
                                       band=[[128, 5], [2048, 5]])  # fmt: skip
    curve = load_profile(write(tmp_path, data)).kernel("bfloat16")
    call = lambda work, heads, d="forward": KernelCall(d, work, 64, 64, heads, 1, 128, 128)  # noqa: E731
    assert curve.work_rate(10e6, 1) == pytest.approx(30e12) and curve.work_rate(10e6, 4) == pytest.approx(20e12)
    assert curve.work_rate(10e6, 2) == pytest.approx(25e12)  # 2 heads: halfway between 1 and 4 in log
    assert curve.work_rate(1e3, 1) == 20e12 and curve.work_rate(1e12, 32) == 30e12  # held at the ends
    for c in (call(10**7, 2), call(10**7, 2, "backward"), call(10**5, 8), call(10**9, 1)):
        assert curve.call_seconds(c) == pytest.approx(c.flops / curve.work_rate(c.work, c.hq), rel=1e-15)
    assert curve.call_seconds(call(10**7, 2, "backward")) == pytest.approx(2.5 * curve.call_seconds(call(10**7, 2)))
    banded = KernelCall("forward", 10**7, 64, 64, 2, 1, 128, 128, True, 64, 512)
    assert curve.call_seconds(banded) == pytest.approx(banded.flops / 5e12)
    assert curve.call_seconds(call(0, 2)) == 0.0
    # the same FLOPs in one head of twice the work run faster than in two heads: the shape, not the size, sets it
    assert curve.call_seconds(call(2 * 10**7, 1)) < curve.call_seconds(call(10**7, 2))
    assert load_profile(write(tmp_path, GOOD)).kernel("bfloat16").by_work == ()
    data["compute"]["bfloat16"]["by_work"] = {"4": [[1, 10], [100, 30]], "1": [[1, 20], [100, 40]]}  # any key order
    assert load_profile(write(tmp_path, data)).kernel("bfloat16").work_rate(10e6, 2) == pytest.approx(25e12)


@pytest.mark.parametrize("by_work, message", [
    ([[1, 2]], r"compute.bfloat16.by_work must be \{\"heads\": \[\[mpairs, tflops\], ...\], ...\}"),
    ({"two": [[1, 2]]}, r"compute.bfloat16.by_work has the key 'two'; give the query heads of the curve's calls"),
    ({"0": [[1, 2]]}, r"compute.bfloat16.by_work has the key '0'"),
    ({"2": []}, r"compute.bfloat16.by_work.2 is empty; give at least one \[mpairs, tflops\]"),
    ({"2": [[1, 2], [1, 3]]}, r"compute.bfloat16.by_work.2 must be in increasing work"),
    ({"2": [[1, -2]]}, r"compute.bfloat16.by_work.2\[0\]\[1\] is -2; give a positive number"),
])  # fmt: skip
def test_bad_by_work_curves_are_refused_naming_them(tmp_path, by_work, message):
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"]["by_work"] = by_work
    with pytest.raises(CPInputError, match=message):
        load_profile(write(tmp_path, data))


def test_soft_capped_calls_cost_the_profiles_factor_and_a_profile_without_one_is_refused(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"].update(softcap_factor=1.5, band=[[128, 10], [2048, 50]])
    calls = [KernelCall("forward", 10**6, 4096, 4096, 8, 8, 128, 128), KernelCall("backward", 10**6, 64, 64, 8, 8, 128, 128),
             KernelCall("forward", 10**6, 4096, 4096, 8, 8, 128, 128, True, 4096, 512)]  # plain, small, banded
    for by_work in ({}, {"8": [[0.1, 20], [10, 60]]}):  # by FLOPs, and by shape
        data["compute"]["bfloat16"]["by_work"] = by_work
        profile = load_profile(write(tmp_path, data))
        plain, capped = profile.kernel("bfloat16"), profile.kernel("bfloat16", softcap=True)
        for call in calls:
            assert capped.call_seconds(call) == pytest.approx(1.5 * plain.call_seconds(call), rel=1e-12)
    assert plain.factor == 1.0 and capped.factor == 1.5
    with pytest.raises(CPInputError, match=r"profile 'toy' has no softcap_factor for bfloat16"):
        load_profile(write(tmp_path, GOOD)).kernel("bfloat16", softcap=True)


def test_the_calibration_line_weighs_every_point_by_its_own_size():
    """Relative least squares: through exact points, the line itself; with the largest time 1 % high (noise of the
    size a long call has), the intercept (the latency, the per-call cost) stays within 0.3 % where an absolute fit,
    ruled by the largest point, puts it 9 % off."""
    from sim.plan.calibrate import fit_line

    xs = [1.0, 10.0, 100.0, 1000.0]
    assert fit_line(xs, [2 + 0.5 * x for x in xs]) == pytest.approx((2.0, 0.5))
    a, b = fit_line(xs, [2.5, 7.0, 52.0, 502.0 * 1.01])
    assert a == pytest.approx(2.0, rel=3e-3) and b == pytest.approx(0.5, rel=0.01)


def test_a_calibration_whose_line_passes_through_the_origin_still_writes_a_positive_half_size(tmp_path, monkeypatch):
    """Under load the per-call cost can vanish into the noise (make test-all's second worker did it): the file must
    still load."""
    from sim.plan import calibrate as module

    calls = [(float(f), f / 50e9) for f in (1e8, 1e9, 1e10, 1e11)]  # no per-call cost at all
    shaped = [(1, 10**6, 2e9, 0.1), (1, 10**7, 2e10, 0.5), (4, 10**6, 8e9, 0.2)]  # heads, work, FLOPs, seconds
    ranks = [{"link": {k: [(n, 1e-4 + n / 1e9) for n in module.SIZES] for k in ("send_recv", "all_gather")},
              "calls": [c for c in calls for _ in range(1)], "banded": [(129, 1e9, 0.05), (1025, 1e9, 0.025)],
              "shaped": shaped, "capped": [(1.0, 1.5), (3.0, 4.5)]},
             {"link": {k: [(n, 1e-4 + n / 1e9) for n in module.SIZES] for k in ("send_recv", "all_gather")},
              "calls": [c for c in calls for _ in range(1)], "banded": [(129, 1e9, 0.05), (1025, 1e9, 0.025)],
              "shaped": [(h, w, f, t * (2 if h == 4 else 1)) for h, w, f, t in shaped], "capped": [(1.0, 1.5), (3.0, 4.5)]}]
    monkeypatch.setattr("sim.tools.launch.launch", lambda *a, **k: ranks)
    out = tmp_path / "p.json"
    module.calibrate(out)
    curve = load_profile(out).kernel("float32")
    assert curve.half_size > 0 and curve.band == ((129, 20e9), (1025, 40e9))  # each width's pair: 1 GFLOP in its time
    assert curve.softcap_factor == 1.5  # (1.5 + 4.5) / (1 + 3)
    # each head count's curve by work per head, at the slower process's time (the second's, twice the first's, at 4)
    assert curve.by_work == ((1.0, ((1e6, 20e9), (1e7, 40e9))), (4.0, ((1e6, 20e9),)))


@pytest.mark.parametrize("entry, message", [
    ({"band_rows": 256}, r"compute.bfloat16.band_rows is no longer read: windowed calls take a 'band' curve"),
    ({"band": [[1024, 0]]}, r"compute.bfloat16.band\[0\]\[1\] is 0; give a positive number"),
    ({"band": [[1024, 3], [128, 2]]}, r"compute.bfloat16.band must be in increasing width"),
    ({"band": [1024, 3]}, r"compute.bfloat16.band must be \[\[width, tflops\], ...\]"),
    ({"softcap_factor": -2}, r"compute.bfloat16.softcap_factor is -2; give a soft-capped call's time over"),
    ({"points": [[1, 2, 3]]}, r"compute.bfloat16.points must be \[\[gflop, tflops\], ...\]"),
    ({"points": "fast"}, r"compute.bfloat16.points must be"),
])  # fmt: skip
def test_a_curves_bad_band_or_points_are_refused_naming_them(tmp_path, entry, message):
    data = json.loads(json.dumps(GOOD))
    data["compute"]["bfloat16"].update(entry)
    with pytest.raises(CPInputError, match=message):
        load_profile(write(tmp_path, data))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-40, 40), st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=30),
       st.integers(-1, 40), st.integers(-1, 40))  # fmt: skip
def test_sequence_amounts_are_the_per_sequence_closed_forms(shapes, left, right):
    """`sequence_amounts` over arrays against `_visible_sum` (the kernel contract's work and rows) and
    `sequence_width`, sequence by sequence: windows on either side or none, shifts before, inside and past the keys,
    empty sequences."""
    from cpref.kernels.contract import _visible_sum
    from sim.plan.dry import sequence_amounts, sequence_width

    shift, n_q, n_k = (np.array(x, dtype=np.int64) for x in zip(*shapes))
    work, rows, width = sequence_amounts(shift, n_q, n_k, left, right)
    for i, (s, q, k) in enumerate(shapes):
        want_rows, want_work = _visible_sum(s, q, k, left, right)
        assert (work[i], rows[i]) == (want_work, want_rows), (s, q, k)
        assert width[i] == (sequence_width(s, q, k, left, right) if q else 0), (s, q, k)


@pytest.mark.parametrize("ranks_per_node", [2, 4])
def test_a_collective_priced_from_the_cache_is_priced_as_alone(tmp_path, ranks_per_node):
    """`sim.plan.schedule._priced`, one cache over every rank of many groups (consecutive, strided, spanning nodes of
    2 ranks or not) and every op: each answer is `collective_seconds` and `link_bytes` of that very collective. A key
    missing what a price depends on (whether the group spans nodes, the node a rank shares with its successor, how
    many peers share its node) answers another rank's price."""
    from sim.plan.links import link_bytes
    from sim.plan.schedule import _priced

    toy = load_profile(write(tmp_path, {**GOOD, "ranks_per_node": ranks_per_node}))
    groups = [tuple(range(8)), (0, 1), (1, 2), (0, 2, 4, 6), (1, 3, 4, 5), (0, 3), (2, 3, 4), (5, 6, 7, 0), (0, 1, 2, 3),
              (2, 3, 4, 5)]  # fmt: skip
    cache, checked = {}, 0
    for group in groups:
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"):
            for shift in ((1, 2, len(group) - 1) if op == "send_recv" else (0,)):
                for rank in range(len(group)):
                    c = Collective(op, group, rank, (4 * len(group), 2, 8), torch.bfloat16, shift)
                    assert _priced(c, toy, cache) == (collective_seconds(c, toy), link_bytes(c, toy.ranks_per_node)), c
                    checked += 1
    assert checked > 100 and len(cache) < checked  # answers were reused
