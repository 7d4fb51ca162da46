"""The plans at scale are the dry run's, rank by rank: `sim.plan.scale` against `sim.plan.dry` and the modes' plans.

For every covered candidate (p2p, all_gather, a2a+p2p over contiguous and zigzag, full causal), P = 2 to 8, padded
random batches, GQA and replicated key/value heads, bf16 and fp32: each rank's whole run (every post, wait and kernel
call in order, every collective, the saved bytes) equals the dry run's, its priced step equals `rank_time`'s, and a
refusal is the mode's own. The kernel calls' amounts equal the modes' own plans at larger P too. The planner builds
these at any P without a dry run (counted), prices `a2a` from rank 0 alone (counted), and lists what it cannot price.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.base.errors import CPInputError
from cpref.modes.all_gather_plan import build_all_gather_plan
from cpref.modes.ring_plan import build_ring_plan
from sim.plan import planner, scale
from sim.plan.dry import KernelCall, dry_run
from sim.plan.model import rank_time
from sim.plan.profile import Compute, load_profile
from sim.plan.scale_window import piece_all_gather_covers, piece_ring_covers

PROFILE = load_profile("h100-sxm")
CASES = [(P, mode, options) for P in (2, 3, 4, 6, 8)
         for mode, options in [("p2p", {}), ("all_gather", {}), ("all_gather", {"overlap": True}),
                               ("all_gather", {"save_gathered_kv": True})] + [("a2a+p2p", {"a2a_size": a, **hg})
                                                                    for a in range(2, P) if P % a == 0
                                                                    for hg in ({}, {"head_groups": 2})]]  # fmt: skip


def batch(seed: int) -> tuple[int, ...]:
    """One to four documents of 1 to 90 tokens: most need padding, some chunks hold none."""
    rng = random.Random(seed)
    return tuple(rng.randint(1, 90) for _ in range(rng.randint(1, 4)))


def same_price(a, b) -> bool:
    """Two `RankTime`s: equal counts, and times equal up to the order of a sum."""
    return (a.rank, a.bytes, a.saved_bytes, a.calls, a.flops) == (b.rank, b.bytes, b.saved_bytes, b.calls, b.flops) and all(
        math.isclose(getattr(a, f), getattr(b, f), rel_tol=1e-12, abs_tol=1e-18) for f in ("compute", "comm", "exposed", "step"))


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(8, 4, 16, 8), (4, 1, 8, 8), (8, 8, 8, 16)])
@pytest.mark.parametrize("layout", scale.SCALED_LAYOUTS)
@pytest.mark.parametrize("P, mode, options", CASES, ids=[f"P{P}-{m}-{o}" for P, m, o in CASES])
def test_every_rank_runs_and_prices_as_the_dry_run(P, mode, options, layout, heads, dtype):
    compute = PROFILE.kernel("bfloat16")
    for seed in range(3):
        sharding = planner._sharding(batch(seed), P, layout)
        assert scale.covers(mode, layout, options, P, {})
        try:
            built = scale.schedule(mode, sharding, heads=heads, dtype=dtype, **options)
        except CPInputError as refused:
            with pytest.raises(CPInputError) as dry:
                dry_run(mode, sharding, 0, heads=heads, dtype=dtype, **options)
            assert str(refused) == str(dry.value)
            continue
        priced = built.price(PROFILE, compute)
        for r in range(P):
            run = dry_run(mode, sharding, r, heads=heads, dtype=dtype, **options)
            assert built.run(r) == run, (seed, r)
            assert same_price(priced[r], rank_time(run, PROFILE, compute)), (seed, r)


def test_the_batches_reach_every_case_of_the_formulas():
    """The sweep's batches reach what the formulas tell apart: zigzag steps without work, own steps that read the
    front chunk twice and own steps that read the block as it is, padded and unpadded documents."""
    seen = set()
    for seed in range(3):
        for P in (2, 3, 4, 6, 8):
            b = planner._sharding(batch(seed), P, "zigzag").bounds
            work, _, kv = scale.ring_steps(b, P, "zigzag")
            own_whole = kv[:, 0] == b.total // P
            seen |= {("no work", (work == 0).any()), ("selected", (~own_whole).any()), ("whole", own_whole.any()),
                     ("padded", b.is_padded)}  # fmt: skip
    assert {(what, True) for what in ("no work", "selected", "whole", "padded")} | {("padded", False)} <= seen


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6), P=st.integers(2, 16),
       layout=st.sampled_from(scale.SCALED_LAYOUTS))  # fmt: skip
def test_the_call_amounts_are_the_modes_plans(lengths, P, layout):
    """At up to 16 ranks, against the plans the modes run: every ring step's work, rows that see a key, key rows and
    whether it makes a call; all_gather's one call."""
    b = planner._sharding(tuple(lengths), P, layout).bounds
    work, rows, kv = scale.ring_steps(b, P, layout)
    for r in range(P):
        for t, step in enumerate(build_ring_plan(b, P, r, layout, True, torch.device("cpu")).steps):
            assert len(step.calls) == (work[r, t] > 0)
            for call in step.calls:
                assert (call.work, call.seqs.rows_seeing(call.causal)) == (work[r, t], rows[r, t])
                assert kv[r, t] == (len(call.kv_index) if call.kv_index is not None else b.total // P)
    work, rows, kv = scale.all_gather_calls(b, P, layout)
    for r in range(P):
        plan = build_all_gather_plan(b, P, r, layout, True, torch.device("cpu"))
        assert (plan.seqs.work(True), plan.seqs.rows_seeing(True), len(plan.kv_rows)) == (work[r], rows[r], kv[r])


@pytest.mark.parametrize("layout", scale.SCALED_LAYOUTS)
@pytest.mark.parametrize("mask", [{}, {"window": (20, 0)}, {"chunk": 24}])
@pytest.mark.parametrize("options", [{}, {"head_groups": 2}])
def test_a2a_ranks_are_alike(layout, mask, options):
    """Every rank of a2a runs rank 0's timeline, its collectives at its own place."""
    sharding = planner._sharding(batch(2), 4, layout)
    runs = scale.alike_runs(dry_run("a2a", sharding, 0, heads=(8, 8, 8, 8), dtype=torch.bfloat16, **mask, **options), 4)
    assert scale.a2a_alike("a2a", layout, mask)
    for r in range(4):
        assert runs[r] == dry_run("a2a", sharding, r, heads=(8, 8, 8, 8), dtype=torch.bfloat16, **mask, **options)


def test_a2a_is_not_alike_where_documents_stay_home():
    assert not scale.a2a_alike("a2a", "stream", {}) and not scale.a2a_alike("a2a", "balanced", {})
    assert not scale.a2a_alike("p2p", "zigzag", {})


@pytest.mark.parametrize("mode, layout, options, mask", [
    ("p2p", "stream", {}, {}), ("p2p", "zigzag", {}, {"window": (8, 0)}), ("p2p", "zigzag", {}, {"chunk": 8}),
    ("all_gather", "zigzag", {"overlap": True}, {"window": (8, 0)}),
    ("all_gather", "zigzag", {"overlap": True, "save_gathered_kv": True}, {}),
    ("a2a+p2p", "zigzag", {"a2a_size": 2, "head_groups": 2}, {"window": (8, 0)}), ("a2a", "zigzag", {}, {})])  # fmt: skip
def test_what_is_not_covered(mode, layout, options, mask):
    assert not scale.covers(mode, layout, options, 4, mask)
    if not mask:  # schedule refuses it by name, rather than build another mode's schedule
        with pytest.raises(CPInputError, match="is not built at scale"):
            scale.schedule(mode, planner._sharding(batch(0), 4, layout), heads=(8, 8, 8, 8), dtype=torch.bfloat16,
                           **options)  # fmt: skip


@pytest.mark.parametrize("mode, layout, options, mask, P, covered", [
    ("p2p", "stream", {}, {}, 4, True), ("p2p", "balanced", {}, {"window": (8, 0)}, 4, True),
    ("p2p", "zigzag", {}, {"window": (8, 0)}, 4, True), ("p2p", "contiguous", {}, {"chunk": 8}, 4, True),
    ("p2p", "zigzag", {}, {}, 4, False), ("p2p", "stream", {}, {}, 1, False),
    ("all_gather", "stream", {}, {}, 4, False), ("all_gather", "zigzag", {}, {"window": (8, 0)}, 4, False),
    ("a2a+p2p", "stream", {"a2a_size": 2}, {}, 4, False), ("a2a", "balanced", {}, {}, 4, False),
    ("a2a+p2p", "zigzag", {"a2a_size": 2, "head_groups": 2}, {"window": (8, 0)}, 4, True),
    ("a2a+p2p", "contiguous", {"a2a_size": 4}, {"chunk": 8}, 8, True), ("a2a+p2p", "zigzag", {"a2a_size": 2}, {}, 4, False),
    ("a2a+p2p", "balanced", {"a2a_size": 2}, {"window": (8, 0)}, 4, False)])  # fmt: skip
def test_what_the_piece_ring_covers(mode, layout, options, mask, P, covered):
    """`p2p` on the ring over pieces (a window, chunks, or the stream and balanced layouts), from two ranks, and
    `a2a+p2p` under a window or chunks in the chunked layouts; not the classic ring, nor the split hierarchy of the
    stream and balanced layouts, nor another mode."""
    assert piece_ring_covers(mode, layout, options, P, mask) is covered


@pytest.mark.parametrize("layout, options, mask, P, covered", [
    ("stream", {}, {}, 4, True), ("balanced", {}, {"window": (8, 0)}, 4, True), ("zigzag", {}, {"chunk": 8}, 4, True),
    ("zigzag", {}, {"window": (8, 0)}, 4, False), ("zigzag", {}, {}, 4, False), ("stream", {"overlap": True}, {}, 4, True),
    ("stream", {"save_gathered_kv": True}, {}, 4, True), ("stream", {}, {}, 1, False),
    ("balanced", {"overlap": True, "save_gathered_kv": True}, {}, 4, False)])  # fmt: skip
def test_what_the_pieces_all_gather_covers(layout, options, mask, P, covered):
    """`all_gather` on the pieces' plan (chunks, the stream and balanced layouts), with `overlap` or
    save_gathered_kv, not both; a window in the chunked layouts is `sim.plan.scale`'s."""
    assert piece_all_gather_covers("all_gather", layout, options, P, mask) is covered
    assert not piece_all_gather_covers("p2p", layout, options, P, mask)


def test_the_irregular_builders_refuse_what_they_do_not_build_and_what_the_mode_refuses():
    """Called directly, each builder refuses a candidate it does not cover by name (rather than build another
    plan's schedule), and bad input as `cpref.attention` does, before building anything."""
    from sim.plan.scale_window import piece_all_gather_schedule, piece_ring_schedule

    zigzag, stream = (planner._sharding(batch(0), 4, layout) for layout in ("zigzag", "stream"))
    with pytest.raises(CPInputError, match=r"mode 'p2p' over 'zigzag' .* full causal at P = 4 is not built here"):
        piece_ring_schedule(zigzag, heads=(8, 8, 8, 8), dtype=torch.bfloat16)
    with pytest.raises(CPInputError, match=r"mode 'a2a\+p2p' over 'stream' .* is not built here"):
        piece_ring_schedule(stream, heads=(8, 8, 8, 8), dtype=torch.bfloat16, window=(8, 0), a2a_size=2)
    with pytest.raises(CPInputError, match=r"mode 'all_gather' over 'zigzag' .* is not built here"):
        piece_all_gather_schedule(zigzag, heads=(8, 8, 8, 8), dtype=torch.bfloat16, window=(8, 0))
    with pytest.raises(CPInputError, match=r"a2a_size=3"):
        piece_ring_schedule(zigzag, heads=(8, 8, 8, 8), dtype=torch.bfloat16, window=(8, 0), a2a_size=3)
    with pytest.raises(CPInputError, match=r"window=\(8, 0, 1\)|is not a pair"):
        piece_all_gather_schedule(stream, heads=(8, 8, 8, 8), dtype=torch.bfloat16, window=(8, 0, 1))


def test_the_planner_builds_a_thousand_ranks_without_a_dry_run(monkeypatch):
    """At P = 1024 the covered candidates are built, none dry-run (counted), the ring over the stream layout's pieces
    (`sim.plan.scale_window`), the all-gather over them with and without overlap, and the split hierarchy
    (`sim.plan.scale_split`) too: none left to the dry run."""
    calls = []
    monkeypatch.setattr(planner, "dry_run", lambda *a, **k: calls.append(a) or pytest.fail("dry-run at P = 1024"))
    result = planner.plan([8192] * 16, heads=(32, 8, 128, 128), dtype="bfloat16", P=1024, profile="h100-sxm",
                          layouts=["zigzag", "stream"], modes=["p2p", "all_gather", "a2a+p2p"])  # fmt: skip
    full = result.kinds["full"]
    assert calls == []
    split = {f"a2a+p2p {layout} a2a_size={a}" for layout in ("zigzag", "stream") for a in (2, 4, 8, 16, 32)}
    split |= {f"a2a+p2p {layout} a2a_size={a} head_groups=2" for layout in ("zigzag", "stream") for a in (2, 4)}
    assert {p.name for p in full.ranked} == {"p2p zigzag", "p2p stream", "all_gather zigzag", "all_gather zigzag overlap=True",
                                             "all_gather stream", "all_gather stream overlap=True", *split}  # fmt: skip
    assert not full.unpriced
    assert all(len(p.ranks) == 1024 for p in full.ranked)
    by_name = {c.name: c for c in planner.candidates(1024, ["p2p", "all_gather", "a2a+p2p"], ["zigzag", "stream"])}
    listed = [p.name for p in full.ranked + full.refused]
    assert sorted(listed) == sorted(by_name)
    assert full.refused and all("cannot" in p.refused for p in full.refused)  # heads a2a_size 64 .. 512 cannot split


def test_a2a_at_scale_is_one_dry_run(monkeypatch):
    calls = []
    real = planner.dry_run
    monkeypatch.setattr(planner, "dry_run", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    result = planner.plan([4096] * 4, heads=(256, 256, 64, 64), dtype="bfloat16", P=64, profile="h100-sxm",
                          layouts=["zigzag"], modes=["a2a"])  # fmt: skip
    assert calls == [0, 0, 0]  # a2a, head groups 2 and 4: rank 0 each
    assert [len(p.ranks) for p in result.kinds["full"].ranked] == [64, 64, 64]


def test_nothing_priced_is_one_line(monkeypatch):
    """Where no candidate is priced (here the builder of all_gather over stream taken away, so that only the dry run
    could price it), the plan is refused in one line naming the limit."""
    monkeypatch.setattr(planner, "piece_all_gather_covers", lambda *a: False)
    with pytest.raises(CPInputError, match=r"no candidate is priced for full layers at P = 64.*dry_run_limit = 32"):
        planner.plan([4096] * 4, heads=(64, 64, 64, 64), dtype="bfloat16", P=64, profile="h100-sxm",
                     layouts=["stream"], modes=["all_gather"])  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6), causal=st.booleans())
def test_the_overlap_calls_sums_are_varlens(seqs, causal):
    """The closed form of the overlap's calls against `Varlen.work` and `rows_seeing` (the kernel contract's)."""
    from cpref.kernels.contract import Varlen

    varlen = Varlen.from_lengths([q for q, _ in seqs], [k for _, k in seqs])
    assert scale._sums(seqs, causal) == (varlen.work(causal), varlen.rows_seeing(causal))


BY_WORK = ((2.0, ((1e5, 2e10), (1e8, 6e10))), (8.0, ((1e5, 4e10), (1e8, 5e10))))


@pytest.mark.parametrize("curve", [Compute(300e12, 2e10), Compute(1e12, 0, ((1e6, 1e10), (1e8, 5e10), (1e11, 8e10))),
                                   Compute(1e12, 0, band=((16.0, 1e10), (64.0, 3e10)), by_work=BY_WORK)])  # fmt: skip
def test_seconds_array_is_call_seconds(curve):
    """Every call of an array priced as `call_seconds` prices it, to the bit: by FLOPs, by band width, by shape."""
    work = np.array([[0, 10**3, 10**4, 10**5], [10**6, 10**7, 10**8, 10**9]])
    heads = np.array([1, 2, 4, 8])
    band = np.array([False, True, False, True])
    width = np.array([[0, 16, 0, 40], [0, 100, 0, 8]])
    calls = [[KernelCall(d, int(work[i, j]), 64, 64, int(heads[j]), 1, 16, 16, bool(band[j]), 64, int(width[i, j]))
              for j in range(4)] for i, d in enumerate(("forward", "backward"))]  # fmt: skip
    flops = np.array([[c.flops for c in row] for row in calls], dtype=np.float64)
    priced = curve.seconds_array(flops, work, heads[None, :], band[None, :], width)
    assert priced.tolist() == [[curve.call_seconds(c) for c in row] for row in calls]
    assert curve.seconds_array(flops, work, heads).tolist() == [[curve.call_seconds(dataclasses.replace(c, band=False, width=0))
                                                                 for c in row] for row in calls]  # fmt: skip
    # the same FLOPs and work in 2 heads of 16 and in 1 head of 32: told apart by their heads alone
    twins = [KernelCall("forward", 10**6, 64, 64, 2, 1, 16, 16), KernelCall("forward", 10**6, 64, 64, 1, 1, 32, 32)]
    assert twins[0].flops == twins[1].flops
    priced = curve.seconds_array(np.array([float(c.flops) for c in twins]), np.array([10**6] * 2), np.array([2, 1]))
    assert priced.tolist() == [curve.call_seconds(c) for c in twins]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: st.lists(st.tuples(*[st.sampled_from([0.0, 1.0, 2.5, -1.0])] * k), min_size=1,
                                                 max_size=40)))
def test_distinct_rows_are_numpys(rows):
    """`_distinct`'s rows and inverse are `np.unique(axis=0)`'s: every row maps back to itself."""
    from sim.plan.profile import _distinct

    table = np.array(rows, dtype=np.float64)
    columns, where = _distinct([table[:, j].copy() for j in range(table.shape[1])])
    expected = np.unique(table, axis=0)
    assert np.array_equal(np.stack(columns, axis=1), expected)
    assert np.array_equal(np.stack(columns, axis=1)[where], table)


def test_ring_steps_by_hand():
    """One document of 10 real tokens padded to 12, zigzag over P = 2 (chunks of 3: 3, 3, 3, 1 real rows)."""
    b = cpref.Sharding([0, 10], cp_size=2, layout="zigzag", cu_seqlens_padded=[0, 12]).bounds
    work, rows, kv = scale.ring_steps(b, 2, "zigzag")
    # rank 0 holds chunks 0 (3 real) and 3 (1 real); rank 1 chunks 1 and 2 (3 + 3)
    # rank 0, own: 6 + 1 * 3 + 1 = 10; from rank 1 (s > r): the back (1 row) against chunks 1, 2: 6
    # rank 1, own: 6 + 3 * 3 + 6 = 21; from rank 0 (s < r): both chunks (6 rows) against chunk 0: 18
    assert work.tolist() == [[10, 6], [21, 18]]
    assert rows.tolist() == [[4, 1], [6, 6]]
    assert kv.tolist() == [[3 + 3 + 1, 6], [3 + 3 + 3, 6]]


def as_dry_run(built, mode: str, sharding, heads, dtype, profile, compute, seed: int, **arguments) -> None:
    """Every rank of `built`: its whole run equals the dry run's, its price `rank_time`'s."""
    priced = built.price(profile, compute)
    for r in range(sharding.cp_size):
        run = dry_run(mode, sharding, r, heads=heads, dtype=dtype, **arguments)
        assert built.run(r) == run, (seed, r)
        assert same_price(priced[r], rank_time(run, profile, compute)), (seed, r)


PIECE_MASKS = [{}, {"window": (20, 0)}, {"window": (0, 0)}, {"window": (150, 0)}, {"chunk": 24}, {"chunk": 24, "window": (7, 0)}]


def band_profile():
    """The H100 profile with a band curve and `by_work` curves, so that windowed calls take the band's rate by width
    and every other call its shape's (work per head, heads: between the two head counts for 4 and 8 heads)."""
    compute = PROFILE.kernel("bfloat16")
    banded = dataclasses.replace(compute, band=((16.0, 100e12), (64.0, 300e12)),
                                 by_work=((2.0, ((10.0, 50e12), (1e4, 200e12))), (16.0, ((10.0, 80e12), (1e4, 150e12)))))
    return dataclasses.replace(PROFILE, compute={"bfloat16": banded}), banded


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(8, 4, 16, 8), (4, 1, 8, 8)])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("mask", PIECE_MASKS, ids=str)
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_the_piece_ring_runs_and_prices_as_the_dry_run_on_every_rank(P, mask, layout, heads, dtype):
    """`p2p` under windows (narrower and wider than a chunk, and none wide) and chunks, and over the stream and
    balanced layouts: every rank's whole run equals the dry run's, its price `rank_time`'s (band rates included)."""
    from sim.plan.scale_window import piece_ring_covers, piece_ring_schedule

    if not piece_ring_covers("p2p", layout, {}, P, mask):
        assert not mask and layout in scale.SCALED_LAYOUTS  # full causal in the chunked layouts: the classic ring
        return
    profile, compute = band_profile()
    for seed in range(3):
        sharding = planner._sharding(batch(seed), P, layout)
        built = piece_ring_schedule(sharding, heads=heads, dtype=dtype, **mask)
        as_dry_run(built, "p2p", sharding, heads, dtype, profile, compute, seed, **mask)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", scale.SCALED_LAYOUTS)
@pytest.mark.parametrize("options", [{}, {"save_gathered_kv": True}], ids=str)
@pytest.mark.parametrize("w", [0, 5, 20, 150])
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_all_gather_under_a_window_runs_and_prices_as_the_dry_run_on_every_rank(P, w, options, layout, dtype):
    """`all_gather` under a causal window (narrower than a chunk, wider, wider than a document), with and without
    save_gathered_kv: every rank's run equals the dry run's, its price `rank_time`'s with the band curve's rates; the
    overlapped path, which a window refuses, is not covered."""
    profile, compute = band_profile()
    heads = (8, 4, 16, 8)
    assert scale.covers("all_gather", layout, options, P, {"window": (w, 0)})
    assert not scale.covers("all_gather", layout, {"overlap": True}, P, {"window": (w, 0)})
    for seed in range(3):
        sharding = planner._sharding(batch(seed), P, layout)
        built = scale.schedule("all_gather", sharding, heads=heads, dtype=dtype, window=(w, 0), **options)
        as_dry_run(built, "all_gather", sharding, heads, dtype, profile, compute, seed, window=(w, 0), **options)


HIERARCHY = [(P, {"a2a_size": a, **hg}) for P in (4, 6, 8) for a in range(2, P) if P % a == 0
             for hg in ({}, {"head_groups": 2})]  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("heads", [(8, 4, 16, 8), (4, 1, 8, 8)])
@pytest.mark.parametrize("layout", scale.SCALED_LAYOUTS)
@pytest.mark.parametrize("mask", PIECE_MASKS[1:], ids=str)
@pytest.mark.parametrize("P, options", HIERARCHY, ids=[f"P{P}-{o}" for P, o in HIERARCHY])
def test_the_hierarchy_over_the_piece_ring_runs_and_prices_as_the_dry_run(P, options, mask, layout, heads):
    """`a2a+p2p` under a window or chunks: the exchanges inside each group around the ring of groups over their
    pieces, in one head group or two, replicated key/value heads included; every rank's run is the dry run's, a
    refusal the mode's own."""
    from sim.plan.scale_window import piece_ring_covers, piece_ring_schedule

    assert piece_ring_covers("a2a+p2p", layout, options, P, mask)
    profile, compute = band_profile()
    for seed in range(2):
        sharding = planner._sharding(batch(seed), P, layout)
        try:
            scale.validate("a2a+p2p", sharding, heads, torch.bfloat16, {**mask, **options})
        except CPInputError as refused:
            with pytest.raises(CPInputError) as dry:
                dry_run("a2a+p2p", sharding, 0, heads=heads, dtype=torch.bfloat16, **mask, **options)
            assert str(refused) == str(dry.value)
            continue
        built = piece_ring_schedule(sharding, heads=heads, dtype=torch.bfloat16, **mask, **options)
        as_dry_run(built, "a2a+p2p", sharding, heads, torch.bfloat16, profile, compute, seed, **mask, **options)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("mask", PIECE_MASKS, ids=str)
@pytest.mark.parametrize("options", [{}, {"save_gathered_kv": True}, {"overlap": True}], ids=str)
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_all_gather_over_pieces_runs_and_prices_as_the_dry_run_on_every_rank(P, options, mask, layout, dtype):
    """`all_gather` on the pieces' plan (chunks in every layout; the stream and balanced layouts with any mask), with
    save_gathered_kv (its per-rank saved keys included) or overlap (the local and remote calls, the local halves;
    full causal only: the mode refuses it under a window or chunks, and so does the builder): every rank's run equals
    the dry run's, its price `rank_time`'s."""
    from sim.plan.scale_window import piece_all_gather_covers, piece_all_gather_schedule

    if not piece_all_gather_covers("all_gather", layout, {}, P, mask):
        assert "chunk" not in mask and layout in scale.SCALED_LAYOUTS
        return
    profile, compute = band_profile()
    heads = (8, 4, 16, 8)
    if options.get("overlap") and mask:
        with pytest.raises(CPInputError, match="the overlap needs a plain causal or full mask"):
            piece_all_gather_schedule(planner._sharding(batch(0), P, layout), heads=heads, dtype=dtype, **mask, **options)
        return
    for seed in range(3):
        sharding = planner._sharding(batch(seed) + batch(seed + 5), P, layout)
        built = piece_all_gather_schedule(sharding, heads=heads, dtype=dtype, **mask, **options)
        as_dry_run(built, "all_gather", sharding, heads, dtype, profile, compute, seed, **mask, **options)



@pytest.mark.parametrize("mode, layout, options, mask, P, covered", [
    ("a2a", "stream", {}, {}, 4, True), ("a2a", "balanced", {"head_groups": 2, "balance": False}, {"chunk": 8}, 8, True),
    ("a2a", "balanced", {}, {"window": (4, 0)}, 2, True), ("a2a", "zigzag", {}, {}, 4, False),
    ("a2a", "stream", {}, {}, 1, False), ("a2a+p2p", "stream", {"a2a_size": 2}, {}, 4, False),
    ("a2a", "stream", {}, {"softcap": 5.0}, 4, False)])  # fmt: skip
def test_what_the_split_a2a_covers(mode, layout, options, mask, P, covered):
    from sim.plan.scale_split import split_a2a_covers

    assert split_a2a_covers(mode, layout, options, P, mask) is covered


def split_sweep(test):
    """The split plans' sweep: both dtypes, heads with and without replicated key/value heads, both layouts, every
    mask of `PIECE_MASKS`, one head group or two, the balance on and off."""
    for mark in (pytest.mark.parametrize("options", [{}, {"head_groups": 2}, {"balance": False}], ids=str),
                 pytest.mark.parametrize("mask", PIECE_MASKS, ids=str),
                 pytest.mark.parametrize("layout", ["stream", "balanced"]),
                 pytest.mark.parametrize("heads", [(8, 8, 16, 8), (8, 2, 8, 8)]),
                 pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32]), pytest.mark.sweep):  # fmt: skip
        test = mark(test)
    return test


@split_sweep
@pytest.mark.parametrize("P", [2, 4, 8])
def test_the_split_a2a_runs_and_prices_as_the_dry_run_on_every_rank(P, options, mask, layout, heads, dtype):
    """`a2a` over stream and balanced (own rows at home, shared rows exchanged): every rank's whole run equals the
    dry run's, its price `rank_time`'s, with windows, chunks, head groups (the own call inside the pipeline),
    replicated key/value heads and the balance on and off."""
    from sim.plan.scale_split import split_a2a_schedule

    if "head_groups" in options and heads[1] < P * 2:
        return  # the groups cannot split one key/value head per rank (the mode refuses: tested below)
    profile, compute = band_profile()
    for seed in range(3):
        sharding = planner._sharding(batch(seed) + batch(seed + 7), P, layout)
        built = split_a2a_schedule(sharding, heads=heads, dtype=dtype, **mask, **options)
        as_dry_run(built, "a2a", sharding, heads, dtype, profile, compute, seed, **mask, **options)


def test_the_split_a2a_refuses_what_it_does_not_build_and_what_the_mode_refuses():
    from sim.plan.scale_split import split_a2a_schedule

    zigzag, stream = (planner._sharding(batch(0), 4, layout) for layout in ("zigzag", "stream"))
    with pytest.raises(CPInputError, match=r"mode 'a2a' over 'zigzag' .* is not built here"):
        split_a2a_schedule(zigzag, heads=(8, 8, 8, 8), dtype=torch.bfloat16)
    with pytest.raises(CPInputError, match=r"head_groups=2.*head_groups that work: \[1\]"):
        split_a2a_schedule(stream, heads=(8, 4, 8, 8), dtype=torch.bfloat16, head_groups=2)
    with pytest.raises(CPInputError, match=r"Hq = 6, Hkv = 6 cannot be split so"):
        split_a2a_schedule(stream, heads=(6, 6, 8, 8), dtype=torch.bfloat16)


def test_the_planner_builds_a2a_over_whole_documents_at_a_thousand_ranks_without_a_dry_run(monkeypatch):
    """`a2a` over stream and balanced at P = 1024: built for every rank, none dry-run (counted), in one head group
    and two."""
    monkeypatch.setattr(planner, "dry_run", lambda *a, **k: pytest.fail("dry-run at P = 1024"))
    result = planner.plan([8192] * 12 + [3000, 500] * 20, heads=(2048, 2048, 64, 64), dtype="bfloat16", P=1024,
                          profile="h100-sxm", layouts=["stream", "balanced"], modes=["a2a"])  # fmt: skip
    full = result.kinds["full"]
    assert {p.name for p in full.ranked} == {"a2a stream", "a2a balanced", "a2a stream head_groups=2",
                                             "a2a balanced head_groups=2"}  # fmt: skip
    assert all(len(p.ranks) == 1024 for p in full.ranked) and not full.unpriced


@pytest.mark.parametrize("mode, layout, options, mask, P, covered", [
    ("a2a+p2p", "stream", {"a2a_size": 2}, {}, 4, True),
    ("a2a+p2p", "balanced", {"a2a_size": 4, "head_groups": 2, "balance": False}, {"chunk": 8, "window": (3, 0)}, 8, True),
    ("a2a+p2p", "balanced", {"a2a_size": 4}, {}, 4, False), ("a2a+p2p", "zigzag", {"a2a_size": 2}, {}, 4, False),
    ("a2a", "stream", {}, {}, 4, False), ("a2a+p2p", "stream", {"a2a_size": 2}, {"softcap": 5.0}, 4, False)])  # fmt: skip
def test_what_the_split_hierarchy_covers(mode, layout, options, mask, P, covered):
    from sim.plan.scale_split import split_hierarchy_covers

    assert split_hierarchy_covers(mode, layout, options, P, mask) is covered


@split_sweep
@pytest.mark.parametrize("P, a", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_the_split_hierarchy_runs_and_prices_as_the_dry_run_on_every_rank(P, a, options, mask, layout, heads, dtype):
    """`a2a+p2p` over stream and balanced (own rows at home; shared rows exchanged in each a2a group, then the ring
    over the groups' shared pieces): every rank's whole run equals the dry run's, its price `rank_time`'s, with
    windows, chunks, head groups, replicated key/value heads and the balance on and off."""
    from sim.plan.scale_split import split_hierarchy_schedule

    if "head_groups" in options and heads[1] < a * 2 or heads[0] % a or (heads[1] % a and a % heads[1]):
        return  # heads the mode refuses (tested below)
    profile, compute = band_profile()
    for seed in range(3):
        sharding = planner._sharding(batch(seed) + batch(seed + 7), P, layout)
        built = split_hierarchy_schedule(sharding, heads=heads, dtype=dtype, a2a_size=a, **mask, **options)
        as_dry_run(built, "a2a+p2p", sharding, heads, dtype, profile, compute, seed, a2a_size=a, **mask, **options)


def test_the_split_hierarchy_refuses_what_it_does_not_build_and_what_the_mode_refuses():
    from sim.plan.scale_split import split_hierarchy_schedule

    zigzag, stream = (planner._sharding(batch(0), 4, layout) for layout in ("zigzag", "stream"))
    with pytest.raises(CPInputError, match=r"mode 'a2a\+p2p' over 'zigzag' .* is not built here"):
        split_hierarchy_schedule(zigzag, heads=(8, 8, 8, 8), dtype=torch.bfloat16, a2a_size=2)
    with pytest.raises(CPInputError, match=r"a2a_size=3"):
        split_hierarchy_schedule(stream, heads=(8, 8, 8, 8), dtype=torch.bfloat16, a2a_size=3)
    with pytest.raises(CPInputError, match=r"head_groups=2"):
        split_hierarchy_schedule(stream, heads=(8, 2, 8, 8), dtype=torch.bfloat16, a2a_size=2, head_groups=2)
