"""Semantics of the simulated cluster's collectives against the table in `cpref.comm.protocol`.

Every expected tensor is built element by element (or slice by slice) from the per-rank
inputs, independently of how `sim.cluster.simcluster` computes it.
"""

from __future__ import annotations

import doctest
import threading
import time

import pytest
import torch

import sim
import sim.cluster.rendezvous
import sim.cluster.simcluster
import sim.cluster.trace
from cpref.comm.protocol import Collectives
from sim import ClusterFailure, CollectiveMismatch, SimCluster

SIZES = list(range(1, 9))


def x_of(r: int, rows: int, cols: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank r's input: integer values, distinct per rank and position, with both signs."""
    base = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)  # (rows, cols)
    return ((base * (r + 3) * 7) % 23 - 11 + 100 * r).to(dtype)


# --- the world communicator ---------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 3])
def test_comm_is_collectives_and_knows_its_place(P):
    def fn(comm):
        return isinstance(comm, Collectives), comm.rank, comm.size, comm.global_rank, comm.group

    out = SimCluster(P).run(fn)
    assert out == [(True, r, P, r, tuple(range(P))) for r in range(P)]


@pytest.mark.parametrize("P", SIZES)
def test_all_gather(P):
    n = 2
    out = SimCluster(P).run(lambda comm: comm.all_gather(x_of(comm.rank, n)))
    expected = torch.empty(P * n, 3, dtype=torch.float64)  # (P n, 3)
    for j in range(P * n):
        expected[j] = x_of(j // n, n)[j % n]  # row j comes from rank j // n
    for r in range(P):
        assert torch.equal(out[r], expected), r


@pytest.mark.parametrize("P", SIZES)
def test_reduce_scatter(P):
    n = 2
    out = SimCluster(P).run(lambda comm: comm.reduce_scatter(x_of(comm.rank, P * n)))
    for r in range(P):
        expected = torch.zeros(n, 3, dtype=torch.float64)  # (n, 3)
        for s in range(P):
            expected += x_of(s, P * n)[r * n : (r + 1) * n]  # chunk r of x_s
        assert out[r].shape == (n, 3)
        assert torch.equal(out[r], expected), r


@pytest.mark.parametrize("P", SIZES)
def test_all_to_all(P):
    n = 2
    out = SimCluster(P).run(lambda comm: comm.all_to_all(x_of(comm.rank, P * n)))
    for r in range(P):
        expected = torch.empty(P * n, 3, dtype=torch.float64)  # (P n, 3)
        for j in range(P * n):
            s, i = divmod(j, n)
            expected[j] = x_of(s, P * n)[r * n + i]  # row i of chunk r, sent by rank s
        assert torch.equal(out[r], expected), r


@pytest.mark.parametrize("P", SIZES)
@pytest.mark.parametrize("shift", [1, -1, 2, 0, 9])
def test_send_recv(P, shift):
    out = SimCluster(P).run(lambda comm: comm.send_recv(x_of(comm.rank, 2), shift=shift))
    for r in range(P):
        assert torch.equal(out[r], x_of((r - shift) % P, 2)), r


def test_send_recv_default_shift_is_one():
    out = SimCluster(4).run(lambda comm: comm.send_recv(torch.tensor([float(comm.rank)])))
    assert [float(t) for t in out] == [3.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("P", SIZES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_all_reduce(P, op):
    out = SimCluster(P).run(lambda comm: comm.all_reduce(x_of(comm.rank, 4), op=op))
    xs = [x_of(s, 4) for s in range(P)]
    expected = torch.empty(4, 3, dtype=torch.float64)
    for i in range(4):
        for j in range(3):
            values = [float(x[i, j]) for x in xs]
            expected[i, j] = {"sum": sum, "max": max, "min": min}[op](values)
    for r in range(P):
        assert torch.equal(out[r], expected), r


@pytest.mark.parametrize("P", SIZES)
def test_barrier_returns_none_once_everyone_arrived(P):
    def fn(comm):
        time.sleep(0.02 * comm.rank)  # the last rank arrives ~0.02 (P-1) s late
        comm.barrier()
        return time.monotonic()

    start = time.monotonic()
    left = SimCluster(P).run(fn)
    assert min(left) - start >= 0.02 * (P - 1) - 1e-3


def test_all_reduce_keeps_integer_dtype():
    out = SimCluster(3).run(lambda comm: comm.all_reduce(torch.tensor([comm.rank + 1, -comm.rank])))
    assert out[0].dtype == torch.int64
    assert out[0].tolist() == [6, -3]


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all", "send_recv", "all_reduce"])
def test_outputs_are_fresh_tensors(op):
    def fn(comm):
        x = x_of(comm.rank, 2 * comm.size)
        return x, getattr(comm, op)(x)

    pairs = SimCluster(2).run(fn)
    ptrs = [t.untyped_storage().data_ptr() for pair in pairs for t in pair]
    assert len(set(ptrs)) == len(ptrs)  # no output aliases an input or another output


def test_results_are_returned_in_rank_order():
    assert SimCluster(5).run(lambda comm: comm.rank * 10) == [0, 10, 20, 30, 40]


def test_outputs_carry_no_autograd_history():
    def fn(comm):
        x = torch.ones(2, dtype=torch.float64, requires_grad=True)
        return comm.all_gather(x * 2)

    assert not SimCluster(2).run(fn)[0].requires_grad


# --- validation: local, identical on every rank, re-raised unchanged -----------------------


@pytest.mark.parametrize("op", ["reduce_scatter", "all_to_all"])
def test_dim0_not_divisible_raises_value_error(op):
    with pytest.raises(ValueError, match=r"dim 0 of shape \(5, 3\) must be divisible by the group size P=2"):
        SimCluster(2, timeout=2).run(lambda comm: getattr(comm, op)(x_of(comm.rank, 5)))


def test_bad_reduce_op_and_zero_dim_gather_raise_value_error():
    with pytest.raises(ValueError, match="op must be one of"):
        SimCluster(2, timeout=2).run(lambda comm: comm.all_reduce(torch.ones(1), op="avg"))
    with pytest.raises(ValueError, match="0-d tensor"):
        SimCluster(2, timeout=2).run(lambda comm: comm.all_gather(torch.tensor(1.0)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size must be an int >= 1, got 0"),
        (dict(world_size=True), "world_size must be an int >= 1, got True"),
        (dict(world_size=2, timeout=0), "timeout must be a finite number of seconds > 0, got 0"),
        (dict(world_size=2, timeout=float("inf")), "got inf; a deadlock must end"),
        (dict(world_size=2, timeout=float("nan")), "got nan"),
        (dict(world_size=2, timeout="5"), "got '5'"),
        (dict(world_size=2, reduction="fp32"), "reduction must be one of"),
    ],
)
def test_cluster_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimCluster(**kwargs)


def test_run_is_not_reentrant():
    cluster = SimCluster(2, timeout=2)
    with pytest.raises(RuntimeError, match="not reentrant"):
        cluster.run(lambda comm: cluster.run(lambda c: None))


# --- split: sub-groups -------------------------------------------------------------------


def test_split_2x2_mesh_rows_and_columns():
    cluster = SimCluster(4)

    def fn(comm):
        rows = comm.split([[0, 1], [2, 3]])
        cols = comm.split([[0, 2], [1, 3]])
        me = torch.tensor([float(comm.rank)])
        return rows.group, rows.rank, cols.group, cols.rank, rows.all_gather(me), cols.all_reduce(me)

    out = cluster.run(fn)
    assert [o[:4] for o in out] == [((0, 1), 0, (0, 2), 0), ((0, 1), 1, (1, 3), 0),
                                    ((2, 3), 0, (0, 2), 1), ((2, 3), 1, (1, 3), 1)]  # fmt: skip
    assert [o[4].tolist() for o in out] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert [o[5].tolist() for o in out] == [[2.0], [4.0], [2.0], [4.0]]
    labelled = sorted((ev.op, ev.group, ev.seq) for ev in cluster.trace)
    assert labelled == [("all_gather", (0, 1), 0), ("all_gather", (2, 3), 0),
                        ("all_reduce", (0, 2), 0), ("all_reduce", (1, 3), 0),
                        ("split", (0, 1, 2, 3), 0), ("split", (0, 1, 2, 3), 1)]  # fmt: skip


def test_split_renumbers_in_listed_order():
    def fn(comm):
        sub = comm.split([[3, 1], [0, 2]])
        return sub.rank, sub.group, sub.all_gather(torch.tensor([float(comm.rank)])).tolist()

    out = SimCluster(4).run(fn)
    assert out[3] == (0, (3, 1), [3.0, 1.0])
    assert out[1] == (1, (3, 1), [3.0, 1.0])
    assert out[0] == (0, (0, 2), [0.0, 2.0])


def test_nested_split_uses_global_ranks():
    def fn(comm):
        half = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
        quarter = half.split([[0, 1], [2, 3]])  # local ranks of `half`
        return quarter.group, quarter.all_reduce(torch.tensor([comm.rank])).item()

    out = SimCluster(8).run(fn)
    assert out == [((0, 1), 1), ((0, 1), 1), ((2, 3), 5), ((2, 3), 5),
                   ((4, 5), 9), ((4, 5), 9), ((6, 7), 13), ((6, 7), 13)]  # fmt: skip


@pytest.mark.parametrize("groups", [[[0, 1], [1, 2]], [[0, 1]], [[0, 1, 2, 3]], [[0, 1, 2], []]])
def test_split_rejects_non_partitions(groups):
    with pytest.raises(ValueError, match="must partition the ranks 0..2"):
        SimCluster(3, timeout=2).run(lambda comm: comm.split(groups))


def test_split_with_different_partitions_on_ranks_is_a_mismatch():
    def fn(comm):
        return comm.split([[0, 1], [2, 3]] if comm.rank else [[0, 2], [1, 3]])

    with pytest.raises(ClusterFailure) as info:
        SimCluster(4, timeout=2).run(fn)
    assert all(isinstance(e, CollectiveMismatch) for e in info.value.errors.values())
    assert "groups=((0, 2), (1, 3))" in str(info.value) and "groups=((0, 1), (2, 3))" in str(info.value)


# --- determinism --------------------------------------------------------------------------


def test_reductions_are_bitwise_deterministic_and_in_rank_order():
    P = 8
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** (3 * (s % 4)) for s in range(P)]
    forward = xs[0].clone()
    for x in xs[1:]:
        forward = forward + x  # ((x_0 + x_1) + x_2) + ...
    backward = xs[-1].clone()
    for x in reversed(xs[:-1]):
        backward = backward + x
    assert not torch.equal(forward, backward)  # the order matters for this data

    def fn(delay):
        def rank_fn(comm):
            time.sleep(delay(comm.rank))  # perturb the arrival order between runs
            return comm.all_reduce(xs[comm.rank]), comm.reduce_scatter(xs[comm.rank])

        return rank_fn

    a = SimCluster(P).run(fn(lambda r: 0.002 * r))
    b = SimCluster(P).run(fn(lambda r: 0.002 * (P - r)))
    for r in range(P):
        assert torch.equal(a[r][0], forward) and torch.equal(b[r][0], forward)
        assert torch.equal(a[r][1], forward[r * 512 : (r + 1) * 512]) and torch.equal(a[r][1], b[r][1])


@pytest.mark.parametrize("dtype, big, exact", [(torch.float16, 2048.0, 2050.0), (torch.bfloat16, 256.0, 258.0)])
def test_low_precision_reductions_accumulate_in_float64(dtype, big, exact):
    # in the dtype itself, big + 1 rounds back to big (twice); in float64 the sum is exact
    assert float(torch.tensor(big, dtype=dtype) + 1 + 1) == big

    def fn(comm):
        x = torch.tensor([big if comm.rank == 0 else 1.0], dtype=dtype)
        return comm.all_reduce(x), comm.reduce_scatter(x.repeat(3))

    out = SimCluster(3).run(fn)
    assert out[1][0].dtype == dtype
    assert float(out[1][0]) == exact and float(out[2][1]) == exact


@pytest.mark.parametrize("dtype, big", [(torch.float16, 2048.0), (torch.bfloat16, 256.0)])
def test_native_reductions_round_every_partial_sum_in_rank_order(dtype, big):
    """reduction="native": ((big + 1) + 1) in the dtype, as a ring reduction rounds: the ones are lost."""

    def fn(comm):
        x = torch.tensor([big if comm.rank == 0 else 1.0], dtype=dtype)
        return comm.all_reduce(x), comm.reduce_scatter(x.repeat(3))

    out = SimCluster(3, reduction="native").run(fn)
    assert float(out[1][0]) == big and float(out[2][1]) == big and out[0][0].dtype == dtype
    # rank order, not arrival order: 1 + 1 first would give big + 2 where it is representable
    xs = [torch.tensor([1.0], dtype=dtype), torch.tensor([1.0], dtype=dtype), torch.tensor([big], dtype=dtype)]
    out = SimCluster(3, reduction="native").run(lambda comm: comm.all_reduce(xs[comm.rank]))
    assert float(out[0]) == float((xs[0] + xs[1]) + xs[2])


def test_native_and_exact_agree_for_float32_and_float64():
    xs = [torch.randn(64, dtype=torch.float32, generator=torch.Generator().manual_seed(s)) * 1e3 ** s for s in range(4)]
    for reduction in ("exact", "native"):
        out = SimCluster(4, reduction=reduction).run(lambda comm: comm.all_reduce(xs[comm.rank]))
        assert torch.equal(out[0], ((xs[0] + xs[1]) + xs[2]) + xs[3])


# --- the non-blocking ring shift -------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_send_recv_async_returns_what_send_recv_would(P):
    def fn(comm):
        pending = comm.send_recv_async(x_of(comm.rank, 2), shift=1)
        work = comm.all_reduce(torch.ones(1))  # other collectives may run while the shift is in flight
        return pending.wait(), work

    out = SimCluster(P).run(fn)
    for r in range(P):
        assert torch.equal(out[r][0], x_of((r - 1) % P, 2)) and float(out[r][1]) == P


def test_a_handle_never_waited_on_fails_the_rank():
    from sim.cluster.simcluster import Unwaited

    def fn(comm):
        comm.send_recv_async(torch.ones(2))  # dropped: a real ring would lose this message

    with pytest.raises(Unwaited, match=r"returned without waiting on: send_recv_async #0 on group \(0, 1\)"):
        SimCluster(2).run(fn)


def test_a_handle_waited_on_twice_raises():
    def fn(comm):
        h = comm.send_recv_async(torch.ones(2))
        h.wait()
        h.wait()

    with pytest.raises(RuntimeError, match="wait\\(\\) called twice"):
        SimCluster(2).run(fn)


# --- the documentation's examples run ------------------------------------------------------


@pytest.mark.parametrize("module", [sim, sim.cluster.simcluster, sim.cluster.trace, sim.cluster.rendezvous])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0
    if module is not sim.cluster.rendezvous:
        assert result.attempted > 0


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient and records the thread it ran on."""

    @staticmethod
    def forward(ctx, x, comm, threads):
        ctx.comm, ctx.threads = comm, threads
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.threads[ctx.comm.rank] = threading.current_thread().name
        return ctx.comm.all_reduce(grad), None, None


def test_each_rank_runs_its_own_backward():
    """On a GPU, autograd runs device work on one engine thread per device: the ranks' backward
    passes would queue behind a rank blocked in a collective inside its backward (the deadlock
    seen on CUDA). Every rank runs with multithreaded backward off, so its backward, and the
    collective in it, runs on the rank's own thread."""
    threads: dict[int, str] = {}

    def rank_fn(comm):
        x = torch.ones(3, requires_grad=True)
        _AllReduceGrad.apply(x, comm, threads).sum().backward()
        return torch._C._is_multithreading_enabled(), x.grad

    results = SimCluster(3).run(rank_fn)
    assert [enabled for enabled, _ in results] == [False] * 3
    assert all(torch.equal(grad, torch.full((3,), 3.0)) for _, grad in results)
    assert threads == {r: f"sim-rank-{r}" for r in range(3)}
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched


def test_posted_collectives_return_what_the_blocking_calls_do_and_take_their_place_when_called():
    P = 3

    def fn(comm):
        x = torch.arange(2 * P, dtype=torch.float64) * (comm.rank + 1)  # (2P,)
        gather, scatter, exchange = comm.all_gather_async(x[:2]), comm.reduce_scatter_async(x), comm.all_to_all_async(x)
        total = comm.all_reduce(x)  # a collective between the posts and the waits
        return (exchange.wait(), scatter.wait(), gather.wait(), total, comm.all_gather(x[:2]), comm.reduce_scatter(x),
                comm.all_to_all(x))  # fmt: skip

    cluster = SimCluster(P)
    for r, (exchanged, scattered, gathered, _total, gathered_again, scattered_again, exchanged_again) in enumerate(cluster.run(fn)):
        assert torch.equal(gathered, gathered_again) and torch.equal(scattered, scattered_again)
        assert torch.equal(exchanged, exchanged_again)
        assert gathered.tolist() == [0.0, 1.0, 0.0, 2.0, 0.0, 3.0]
        assert exchanged.tolist() == [s * (2 * r + i) for s in (1, 2, 3) for i in (0, 1)]  # chunk r of every rank's x
    assert [ev.op for ev in cluster.trace] == ["all_gather", "reduce_scatter", "all_to_all", "all_reduce", "all_gather",
                                               "reduce_scatter", "all_to_all"]


@pytest.mark.parametrize("post", ["send_recv_async", "all_gather_async", "reduce_scatter_async", "all_to_all_async"])
def test_an_input_changed_in_place_before_the_wait_raises_there(post):
    """A real backend may still be reading a posted input: the simulated cluster refuses what would pass here only."""

    def fn(comm):
        x = torch.ones(2)
        handle = getattr(comm, post)(x)
        x.add_(1.0)  # in place, before the wait
        handle.wait()

    with pytest.raises(RuntimeError, match=rf"{post} #0 on group \(0, 1\): its input was modified in place before wait"):
        SimCluster(2).run(fn)
