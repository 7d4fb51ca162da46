"""Faults never hang: mismatches, failing and finishing peers, deadlocks, and how run() reports them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import sim.cluster.simcluster
from sim import ClusterFailure, CollectiveMismatch, CollectiveTimeout, PeerFailure, SimCluster


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every rank thread has ended once run() has returned or raised."""
    before = threading.active_count()
    yield
    assert threading.active_count() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("sim-rank-")]


def run_failing(P: int, fn, timeout: float = 2.0) -> tuple[ClusterFailure, float]:
    """Run `fn` on P ranks; return the ClusterFailure it must raise and the wall time."""
    start = time.monotonic()
    with pytest.raises(ClusterFailure) as info:
        SimCluster(P, timeout=timeout).run(fn)
    return info.value, time.monotonic() - start


# --- mismatches ---------------------------------------------------------------------------


def test_different_ops_raise_collective_mismatch_on_every_rank():
    def fn(comm):
        comm.barrier()  # #0 matches
        return comm.all_gather(torch.ones(2)) if comm.rank == 0 else comm.barrier()

    failure, elapsed = run_failing(2, fn, timeout=30.0)
    assert set(failure.errors) == {0, 1}
    for g, e in failure.errors.items():
        assert isinstance(e, CollectiveMismatch) and e.rank == g
        assert e.calls == {0: "all_gather(shape=(2,), dtype=torch.float32)", 1: "barrier()"}
        assert "collective #1 on group (0, 1)" in str(e)
    assert "all_gather(" in str(failure) and "barrier()" in str(failure)
    assert elapsed < 15.0  # fails fast: far below the 30 s timeout, whatever the load


@pytest.mark.parametrize(
    "arg1, called1",
    [
        (torch.ones(3, 2), "all_reduce(shape=(3, 2), dtype=torch.float32, op=sum)"),
        (torch.ones(2, 2, dtype=torch.float64), "all_reduce(shape=(2, 2), dtype=torch.float64, op=sum)"),
    ],
)
def test_mismatched_shape_or_dtype(arg1, called1):
    def fn(comm):
        return comm.all_reduce(arg1 if comm.rank == 1 else torch.ones(2, 2))

    failure, _ = run_failing(3, fn)
    assert all(isinstance(e, CollectiveMismatch) for e in failure.errors.values()) and len(failure.errors) == 3
    calls = failure.errors[0].calls
    assert calls[0] == calls[2] == "all_reduce(shape=(2, 2), dtype=torch.float32, op=sum)"
    assert calls[1] == called1


def test_mismatched_all_gather_dim0_is_a_mismatch_too():
    failure, _ = run_failing(2, lambda comm: comm.all_gather(torch.ones(comm.rank + 1)))
    assert failure.errors[1].calls == {0: "all_gather(shape=(1,), dtype=torch.float32)",
                                       1: "all_gather(shape=(2,), dtype=torch.float32)"}  # fmt: skip


def test_mismatched_shift_or_reduce_op():
    failure, _ = run_failing(2, lambda comm: comm.send_recv(torch.ones(1), shift=1 + comm.rank))
    assert "shift=1" in str(failure.errors[0]) and "shift=2" in str(failure.errors[0])
    failure, _ = run_failing(2, lambda comm: comm.all_reduce(torch.ones(1), op=("max", "min")[comm.rank]))
    assert "op=max" in str(failure.errors[1]) and "op=min" in str(failure.errors[1])


# --- failing and finishing peers ----------------------------------------------------------


@pytest.mark.parametrize("late", ["peers", "failing rank"])
def test_a_raising_rank_makes_its_peers_fail_fast(late):
    def fn(comm):
        if comm.rank == 2:
            time.sleep(0.2 if late == "failing rank" else 0.0)  # peers already waiting
            raise RuntimeError("boom")
        time.sleep(0.2 if late == "peers" else 0.0)  # peers arrive after the failure
        return comm.all_gather(torch.ones(1))

    failure, elapsed = run_failing(4, fn, timeout=30.0)
    assert elapsed < 15.0  # far below the 30 s timeout
    assert failure.root_rank == 2 and isinstance(failure.__cause__, RuntimeError)
    assert str(failure.errors[2]) == "boom"
    for g in (0, 1, 3):
        e = failure.errors[g]
        assert isinstance(e, PeerFailure) and e.peer == 2 and e.cause is failure.errors[2]
        assert "rank 2 failed with RuntimeError: boom" in str(e) and "all_gather #0 on group (0, 1, 2, 3)" in str(e)
    assert "root cause: rank 2 raised RuntimeError: boom" in str(failure)


def test_a_rank_returning_early_makes_its_peers_fail_fast():
    def fn(comm):
        comm.all_gather(torch.ones(1))
        if comm.rank == 0:
            return comm.all_gather(torch.ones(1))  # rank 1 never joins this one
        return None

    failure, elapsed = run_failing(2, fn, timeout=30.0)
    assert elapsed < 15.0
    assert list(failure.errors) == [0]
    e = failure.errors[0]
    assert isinstance(e, PeerFailure) and e.peer == 1 and e.cause is None
    assert "rank 1 finished without calling all_gather #1 on group (0, 1)" in str(e)


def test_an_error_inside_the_computation_does_not_hang(monkeypatch):
    def broken(xs):
        raise ZeroDivisionError("bug in the gather")

    monkeypatch.setattr(sim.cluster.simcluster, "_all_gather", broken)
    failure, elapsed = run_failing(3, lambda comm: comm.all_gather(torch.ones(1)), timeout=30.0)
    assert elapsed < 15.0
    root = failure.errors[failure.root_rank]
    assert isinstance(root, ZeroDivisionError)
    peers = [e for g, e in failure.errors.items() if g != failure.root_rank]
    assert len(peers) == 2 and all(isinstance(e, PeerFailure) and e.peer == failure.root_rank for e in peers)


# --- deadlocks: only the timeout can tell -------------------------------------------------


def test_a_deadlock_raises_collective_timeout_with_every_ranks_position():
    def fn(comm):
        rows = comm.split([[0, 1], [2, 3]])
        if comm.rank == 0:
            rows.barrier()  # waits for rank 1 in group (0, 1) ...
        comm.barrier()  # ... which waits here, in the world group, for rank 0
        if comm.rank == 1:
            rows.barrier()

    failure, elapsed = run_failing(4, fn, timeout=0.5)
    assert 0.5 <= elapsed < 10.0  # only the timeout can end a deadlock; generous above it
    root = failure.errors[failure.root_rank]
    assert isinstance(root, CollectiveTimeout)
    assert set(root.report) == {0, 1, 2, 3}
    assert root.report[0].startswith("waiting in barrier #0 on group (0, 1) for ")
    for g in (1, 2, 3):
        assert root.report[g].startswith("waiting in barrier #1 on group (0, 1, 2, 3) for ")
    assert set(failure.errors) == {0, 1, 2, 3}
    assert all(isinstance(e, (CollectiveTimeout, PeerFailure)) for e in failure.errors.values())


def test_timeout_report_shows_running_and_finished_ranks():
    late = threading.Event()

    def fn(comm):
        pair = comm.split([[0, 2], [1]])
        if comm.rank == 1:
            return None  # finishes: it is not in rank 0's group, so nothing fails fast
        if comm.rank == 2:
            late.wait(30)  # too slow for the 0.3 s timeout, released once rank 0 has timed out
        pair.barrier()

    def release_after_timeout():
        time.sleep(0.6)
        late.set()

    threading.Thread(target=release_after_timeout, daemon=True).start()
    failure, _ = run_failing(3, fn, timeout=0.3)
    root = failure.errors[0]
    assert failure.root_rank == 0 and isinstance(root, CollectiveTimeout)
    assert root.report[0].startswith("waiting in barrier #0 on group (0, 2)")
    assert root.report[1] == "finished"
    assert root.report[2] == "running (outside any collective)"
    assert isinstance(failure.errors[2], PeerFailure) and failure.errors[2].peer == 0


def test_a_rank_stuck_outside_any_collective_is_reported_not_waited_for():
    """An endless loop cannot be interrupted; run() names the rank and where it is, after timeout + margin."""
    from sim.cluster.simcluster import RankStuck

    stop = threading.Event()

    def spin_forever(comm):
        while not stop.is_set():
            pass

    def fn(comm):
        if comm.rank == 1:
            spin_forever(comm)
        return comm.all_gather(torch.ones(1))

    try:
        failure, elapsed = run_failing(3, fn, timeout=1.0)
        assert elapsed < 1.0 + 1.0 + 8.0  # timeout + margin, and generous slack for a busy machine
        assert failure.root_rank == 1
        stuck = failure.errors[1]
        assert isinstance(stuck, RankStuck) and stuck.rank == 1 and "in spin_forever" in stuck.where
        assert "rank 1 is stuck" in str(failure) and "<- root cause" in str(failure)
        assert all(isinstance(failure.errors[g], (CollectiveTimeout, PeerFailure)) for g in (0, 2))
    finally:
        stop.set()
        for t in threading.enumerate():
            if t.name == "sim-rank-1":
                t.join(10)


# --- how run() reports -----------------------------------------------------------------------


def test_identical_errors_on_every_rank_are_reraised_unchanged():
    raised = {}

    def fn(comm):
        raised[comm.rank] = ValueError("cu_seqlens must start at 0")
        raise raised[comm.rank]

    with pytest.raises(ValueError, match="cu_seqlens must start at 0") as info:
        SimCluster(3).run(fn)
    assert info.value is raised[0]


def test_different_errors_or_partial_failure_give_cluster_failure():
    def different(comm):
        raise ValueError(f"bad value on rank {comm.rank}")

    failure, _ = run_failing(2, different)
    assert [str(e) for e in failure.errors.values()] == ["bad value on rank 0", "bad value on rank 1"]

    def partial(comm):
        if comm.rank == 1:
            raise ValueError("only here")

    failure, _ = run_failing(2, partial)
    assert list(failure.errors) == [1] and failure.root_rank == 1
    assert str(failure).startswith("1 of 2 ranks failed; root cause: rank 1 raised ValueError: only here")


def test_cluster_is_reusable_after_a_failure():
    cluster = SimCluster(2, timeout=2)
    with pytest.raises(ClusterFailure):
        cluster.run(lambda comm: comm.barrier() if comm.rank else None)
    assert [t.tolist() for t in cluster.run(lambda comm: comm.all_gather(torch.ones(1)))] == [[1.0, 1.0]] * 2


def test_the_rank_whose_input_failed_is_the_root_cause_not_the_one_that_raised_first():
    """Rank 1's q has the wrong number of tokens; every other rank raises a follow-on PeerInputError after the
    ranks' comparison, and rank 0's follow-on is made to come first: the root cause is still rank 1."""
    import cpref
    from cpref.base.errors import PeerInputError

    sharding = cpref.Sharding([0, 16], cp_size=2, layout="contiguous")

    def rank(comm):
        n = sharding.local_tokens + (1 if comm.rank == 1 else 0)
        q, k, v = torch.zeros(n, 2, 4), torch.zeros(n, 2, 4), torch.zeros(n, 2, 4)
        try:
            return cpref.attention(q, k, v, sharding, comm=comm, mode="p2p")
        except cpref.CPInputError:
            if comm.rank == 1:
                time.sleep(0.2)  # the follow-on of rank 0 arrives first
            raise

    with pytest.raises(ClusterFailure) as info:
        SimCluster(2).run(rank)
    failure = info.value
    assert isinstance(failure.errors[0], PeerInputError) and not isinstance(failure.errors[1], PeerInputError)
    assert failure.root_rank == 1 and "root cause: rank 1 raised CPInputError" in str(failure)
    assert "rank 1: CPInputError" in str(failure).split("<- root cause")[0].splitlines()[-1]


# --- Ctrl-C ---------------------------------------------------------------------------------------------------------


def test_ctrl_c_ends_every_rank_thread_before_run_re_raises_it():
    """Issue 56, item 12: a KeyboardInterrupt in run()'s thread (what Ctrl-C delivers) while the ranks compute and wait.
    run() re-raises it only once every rank thread has ended, each having raised `Interrupted` in its collective or at
    its next one, so that none runs on into the interpreter's exit (where a rank inside torch's C++ code aborted the
    process: 'terminate called without an active exception', exit -6). Was: the ranks ran on after run() had left."""
    import _thread

    from sim.cluster.rendezvous import Interrupted

    seen: dict[int, BaseException] = {}

    def fn(comm):
        try:
            for step in range(2000):
                if comm.rank == 0 and step == 20:
                    _thread.interrupt_main()  # Ctrl-C, as the main thread sees it
                comm.all_reduce(torch.ones(8))
                if comm.rank == 1:
                    time.sleep(0.001)  # rank 1 is often outside any collective when it comes
        except Interrupted as exc:
            seen[comm.rank] = exc
            raise

    with pytest.raises(KeyboardInterrupt):
        SimCluster(3, timeout=30.0).run(fn)
    assert not [t for t in threading.enumerate() if t.name.startswith("sim-rank-") and t.is_alive()]  # ended before run() raised
    assert sorted(seen) == [0, 1, 2] and "the run was interrupted" in str(seen[1])
