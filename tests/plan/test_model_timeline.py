"""The time model's intervals (`sim.plan.model.played`): what `rank_time` sums, and the overlap they show.

Every mode's intervals sum to its `RankTime` (one source of the arithmetic); kernel calls and waits tile the compute
clock without overlap, collectives run one at a time on the communication clock, none before its post; and a ring
step's transfer is hidden exactly when the kernel it was posted before outlasts it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpref
from sim.plan.dry import Collective, Event, KernelCall, RankRun, dry_run
from sim.plan.model import collective_seconds, played, rank_time
from sim.plan.profile import load_profile

HEADS = (4, 2, 16, 16)


@pytest.mark.parametrize("mode", list(cpref.MODES))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_intervals_sum_to_rank_time(mode, layout):
    profile = load_profile("h100-sxm")
    profile = dataclasses.replace(profile, ranks_per_node=2)  # a ring that crosses nodes
    sharding = cpref.Sharding([0, 256, 512], cp_size=4, layout=layout)
    for rank in range(4):
        run = dry_run(mode, sharding, rank, heads=HEADS, dtype=torch.bfloat16, **cpref.MODES[mode].example_options(4))
        compute = profile.kernel("bfloat16")
        intervals, step = played(run, profile, compute)
        timed = rank_time(run, profile, compute)
        of = {kind: [iv for iv in intervals if iv.kind == kind] for kind in ("call", "wait", "collective")}
        assert step == timed.step
        assert sum(iv.seconds for iv in of["call"]) == timed.compute
        assert sum(iv.seconds for iv in of["wait"]) == timed.exposed
        assert sum(iv.seconds for iv in of["collective"]) == timed.comm
        assert len(of["call"]) == timed.calls and len(of["collective"]) == len(run.collectives)
        # the compute clock: calls and waits one after another, ending at the step
        clock = sorted(of["call"] + of["wait"], key=lambda iv: iv.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(clock, clock[1:]))
        assert step == pytest.approx(max((iv.end for iv in clock), default=0.0))
        # the communication clock: one collective at a time, each its own time
        comm = of["collective"]
        assert all(a.end <= b.start + 1e-15 for a, b in zip(comm, comm[1:]))
        assert [iv.seconds for iv in comm] == [collective_seconds(c, profile) for c in run.collectives]
        # a wait ends when its collective does
        ends = {iv.index: iv.end for iv in comm}
        assert all(iv.end == pytest.approx(ends[iv.index]) for iv in of["wait"])


def one_step(work: int) -> RankRun:
    """A ring step by hand: post a shift, compute a call of `work` pairs per head, wait for the shift."""
    shift = Collective("send_recv", (0, 1), 0, (2**20, 2, 32), torch.bfloat16, shift=1)  # 128 MiB
    call = KernelCall("forward", work, 64, 64, 4, 2, 16, 16)
    timeline = (Event("post", "forward", 0), Event("call", "forward", call=call), Event("wait", "forward", 0))
    return RankRun(0, (shift,), timeline, 0)


@pytest.mark.parametrize("work", [1, 10**6, 10**8, 10**9, 10**10])
def test_a_ring_step_hides_its_transfer_exactly_when_its_kernel_outlasts_it(work):
    profile = load_profile("h100-sxm")
    compute = profile.kernel("bfloat16")
    run = one_step(work)
    kernel, transfer = compute.call_seconds(run.calls[0]), collective_seconds(run.collectives[0], profile)
    intervals, step = played(run, profile, compute)
    waits = [iv for iv in intervals if iv.kind == "wait"]
    assert (kernel > transfer) == (work >= 10**9)  # the works cross over
    assert bool(waits) == (kernel < transfer)
    assert step == pytest.approx(max(kernel, transfer))
    assert rank_time(run, profile, compute).exposed == pytest.approx(max(0.0, transfer - kernel))
