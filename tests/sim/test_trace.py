"""Trace events of the simulated cluster: one per group collective, with exact byte counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sim import ClusterFailure, CollectiveEvent, SimCluster, summarize, traffic


def single_event(P: int, fn) -> CollectiveEvent:
    cluster = SimCluster(P)
    cluster.run(fn)
    assert len(cluster.trace) == 1  # one event per collective, not one per rank
    return cluster.trace[0]


# (op, call, per-rank input, bytes per rank at P = 4), the bytes worked out by hand:
#   all_gather     n = 2*3*4 = 24       (P-1) n          = 72
#   reduce_scatter N = 8*3*8 = 192      (P-1)/P N        = 144
#   all_to_all     N = 8*2 = 16 (fp16)  (P-1)/P N        = 12
#   send_recv      n = 5*8 = 40         n                = 40
#   all_reduce     N = 6*4 = 24         2 (P-1)/P N      = 36
CASES = [
    ("all_gather", lambda c, x: c.all_gather(x), torch.zeros(2, 3, dtype=torch.float32), 72),
    ("reduce_scatter", lambda c, x: c.reduce_scatter(x), torch.zeros(8, 3, dtype=torch.float64), 144),
    ("all_to_all", lambda c, x: c.all_to_all(x), torch.zeros(8, dtype=torch.float16), 12),
    ("send_recv", lambda c, x: c.send_recv(x), torch.zeros(5, dtype=torch.float64), 40),
    ("all_reduce", lambda c, x: c.all_reduce(x, op="max"), torch.zeros(6, dtype=torch.int32), 36),
]


@pytest.mark.parametrize("op, call, x, nbytes", CASES, ids=[c[0] for c in CASES])
def test_event_fields_and_bytes_at_p4(op, call, x, nbytes):
    ev = single_event(4, lambda comm: call(comm, x))
    assert (ev.op, ev.group, ev.seq, ev.dtype, ev.shape) == (op, (0, 1, 2, 3), 0, x.dtype, tuple(x.shape))
    assert ev.bytes_sent == ev.bytes_recv == (nbytes,) * 4


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_bytes_follow_the_model_for_every_p(P):
    row = 3 * 8  # bytes of one (3,) float64 row
    cases = {
        "all_gather": (lambda c: c.all_gather(torch.zeros(2, 3, dtype=torch.float64)), (P - 1) * 2 * row),
        "reduce_scatter": (lambda c: c.reduce_scatter(torch.zeros(2 * P, 3, dtype=torch.float64)), (P - 1) * 2 * row),
        "all_to_all": (lambda c: c.all_to_all(torch.zeros(2 * P, 3, dtype=torch.float64)), (P - 1) * 2 * row),
        "all_reduce": (lambda c: c.all_reduce(torch.zeros(P, 3, dtype=torch.float64)), 2 * (P - 1) * row),
    }
    for op, (fn, nbytes) in cases.items():
        ev = single_event(P, fn)
        assert ev.bytes_sent == ev.bytes_recv == (nbytes,) * P, op


@pytest.mark.parametrize("P, shift, nbytes", [(4, 1, 8), (4, -1, 8), (4, 4, 0), (4, 8, 0), (3, 5, 8), (1, 1, 0)])
def test_send_recv_bytes_vanish_when_the_shift_is_a_multiple_of_p(P, shift, nbytes):
    ev = single_event(P, lambda comm: comm.send_recv(torch.zeros(1, dtype=torch.float64), shift=shift))
    assert ev.bytes_sent == ev.bytes_recv == (nbytes,) * P
    assert ev.param == f"shift={shift}"


def test_all_reduce_bytes_round_down_when_p_does_not_divide():
    ev = single_event(3, lambda comm: comm.all_reduce(torch.zeros(5, dtype=torch.float64)))
    assert ev.bytes_sent == (53,) * 3  # 2 * 2/3 * 40 = 53.33


def test_barrier_and_split_move_nothing():
    cluster = SimCluster(4)
    cluster.run(lambda comm: (comm.barrier(), comm.split([[0, 1], [2, 3]])))
    barrier, split = cluster.trace
    assert (barrier.op, barrier.seq, barrier.shape, barrier.dtype, barrier.bytes_sent) == ("barrier", 0, None, None, (0,) * 4)
    assert (split.op, split.seq, split.param, split.bytes_recv) == ("split", 1, "groups=((0, 1), (2, 3))", (0,) * 4)


def test_sequence_numbers_count_per_group_and_events_are_frozen():
    cluster = SimCluster(2)

    def fn(comm):
        for _ in range(3):
            comm.all_reduce(torch.ones(1))
        comm.split([[0], [1]]).barrier()

    cluster.run(fn)
    events = [(ev.op, ev.group, ev.seq) for ev in cluster.trace]
    assert events[:4] == [("all_reduce", (0, 1), 0), ("all_reduce", (0, 1), 1), ("all_reduce", (0, 1), 2),
                          ("split", (0, 1), 3)]  # fmt: skip
    # the two single-rank groups run concurrently: their events may come in either order
    assert sorted(events[4:]) == [("barrier", (0,), 0), ("barrier", (1,), 0)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cluster.trace[0].seq = 7


def test_failed_collectives_record_no_event():
    cluster = SimCluster(2, timeout=2)
    with pytest.raises(ClusterFailure, match="does not match across ranks"):
        cluster.run(lambda comm: comm.all_gather(torch.ones(1)) if comm.rank else comm.barrier())
    assert cluster.trace == []


def test_summary_totals_per_rank_and_counts_per_op():
    cluster = SimCluster(4)

    def fn(comm):
        comm.all_gather(torch.zeros(2, dtype=torch.float64))  # 3 * 16 = 48 each
        rows = comm.split([[0, 1], [2, 3]])
        if comm.rank < 2:
            rows.send_recv(torch.zeros(4, dtype=torch.float64))  # 32 each, ranks 0 and 1 only

    cluster.run(fn)
    s = cluster.trace_summary()
    assert s.bytes_sent == s.bytes_recv == {0: 80, 1: 80, 2: 48, 3: 48}
    assert s.counts == {"all_gather": 1, "split": 1, "send_recv": 1}
    assert s == summarize(cluster.trace)
    assert "| 2 | 48 | 48 |" in s.table()

    cluster.run(fn)  # the trace accumulates over runs ...
    assert cluster.trace_summary().bytes_sent[0] == 160
    cluster.reset_trace()  # ... until reset
    assert cluster.trace == [] and summarize(cluster.trace).counts == {}


def test_traffic_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        traffic("gather", size=2, nbytes=8)
