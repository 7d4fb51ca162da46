"""a2a+p2p in head groups (`head_groups=n`): each group's exchange inside the a2a group posted, its ring across the
groups run while the next group's exchange travels. Against the FP64 oracle, the same bytes and work as the one
exchange in n times every collective and kernel call, the exchange posted before the calls that hide it."""

import re

import pytest
import torch
from hypothesis import example, given, settings

import cpref
from cpref.api import mode_costs
from sim import SimCluster
from tests.cp.conftest import BF16_FLAT, largest_bf16_error_over_logit_scales, oracle_shards, run_cp
from tests.cp.test_ulysses_pipeline import (
    HEAD_GROUP_BATCHES,
    LAYOUTS,
    HeadsKernel,
    LoggingKernel,
    logged_a2a,
    padded_batch,
)
from tests.helpers import assert_close, only_the_comparison

MODE = "a2a+p2p"


def assert_matches_the_oracle(results, q, k, v, dout, sharding, **kw):
    for r, (got, want) in enumerate(zip(results, oracle_shards(q, k, v, dout, sharding, **kw))):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")


@settings(max_examples=10, deadline=None)
@given(**HEAD_GROUP_BATCHES)
@example(P=4, lengths=[40, 8, 24], layout="zigzag", causal=True, heads=(8, 8, 8, 8), groups=2)  # both levels at work
@example(P=4, lengths=[40, 8, 24], layout="balanced", causal=True, heads=(8, 4, 8, 4), groups=2)  # own and shared rows
def test_head_groups_match_the_oracle_on_every_rank(P, lengths, layout, causal, heads, groups):
    a = 2  # P = 2: a ring of one; P = 4: two a2a groups of two, a ring of two
    groups = min(groups, heads[1] // a)  # every rank's key/value heads after the exchange, at most one per group
    sharding, q, k, v, dout = padded_batch(lengths, P, layout, heads, seed=len(lengths))
    results, _ = run_cp(q, k, v, dout, sharding, mode=MODE, causal=causal, a2a_size=a, head_groups=groups)
    assert_matches_the_oracle(results, q, k, v, dout, sharding, causal=causal)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_under_a_window_match_the_oracle(layout):
    """The ring's halo plans (chunked layouts) and piece plans (stream, balanced) run once per group."""
    sharding, q, k, v, dout = padded_batch([40, 8, 24], 4, layout, (8, 8, 8, 8))
    results, _ = run_cp(q, k, v, dout, sharding, mode=MODE, window=(5, 0), a2a_size=2, head_groups=4)
    assert_matches_the_oracle(results, q, k, v, dout, sharding, window=(5, 0))


def test_deterministic_head_groups_repeat_bit_for_bit_and_match_the_oracle():
    sharding, q, k, v, dout = padded_batch([40, 8, 24], 4, "zigzag", (8, 8, 8, 8))
    runs = [run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=2, head_groups=2, deterministic=True)[0] for _ in range(2)]
    assert all(torch.equal(x, y) for a, b in zip(*runs) for x, y in zip(a, b))
    assert_matches_the_oracle(runs[0], q, k, v, dout, sharding)


@pytest.mark.parametrize("P, layout", [(2, "zigzag"), (4, "zigzag"), (4, "contiguous"), (4, "balanced"), (4, "stream")])
def test_head_groups_move_the_same_bytes_and_do_the_same_work_in_n_times_the_calls(P, layout):
    """Every collective of the exchange and of the ring runs once per group, on 1/n of the heads: the same bytes
    (the trace and `mode_costs` alike); every kernel call of the shared rows likewise, the own rows' call once."""
    n = 4
    sharding, q, k, v, dout = padded_batch([40, 8, 24], P, layout, (8, 8, 8, 8))
    runs = {}
    for groups in (1, n):
        kernels = [HeadsKernel() for _ in range(P)]
        _, cluster = run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=2, head_groups=groups, kernels=kernels)
        events = [ev for ev in cluster.trace if ev.op in ("all_to_all", "send_recv")]
        ops = {op: sum(ev.op == op for ev in events) for op in ("all_to_all", "send_recv")}
        sent = [sum(b for ev in events for g, b in zip(ev.group, ev.bytes_sent) if g == r) for r in range(P)]  # global ranks
        runs[groups] = kernels, ops, sent
    (one, ops_1, bytes_1), (split, ops_n, bytes_n) = runs[1], runs[n]
    assert bytes_n == bytes_1 and ops_1["all_to_all"] > 0
    assert ops_n == {op: n * count for op, count in ops_1.items()}
    assert (ops_1["send_recv"] > 0) == (P == 4)  # a ring of two groups shifts; a ring of one does not
    for r, (k1, kn) in enumerate(zip(one, split)):
        assert kn.head_work() == k1.head_work(), f"rank {r}"
        own = sum(h == 8 for h in k1.heads)  # the split layouts' own rows: one call on all heads, unchanged
        assert kn.forward_calls == own + n * (k1.forward_calls - own), f"rank {r}"
        assert kn.backward_calls == own + n * (k1.backward_calls - own), f"rank {r}"
    costs = {g: mode_costs(MODE, P=P, local_tokens=sharding.local_tokens, heads=(8, 8, 8, 8), dtype=torch.float64,
                                 a2a_size=2, head_groups=g) for g in (1, n)}  # fmt: skip
    if layout in ("zigzag", "contiguous"):  # the split layouts' costs need the plan's rows (an upper bound)
        assert costs[n].forward_bytes == costs[1].forward_bytes and costs[n].backward_bytes == costs[1].backward_bytes
        assert costs[n].forward_ops == {op: n * c for op, c in costs[1].forward_ops.items()}
        assert costs[n].backward_ops == {op: n * c for op, c in costs[1].backward_ops.items()}


def test_without_an_exchange_head_groups_change_nothing():
    """a2a_size=1 is the ring: there is no exchange to pipeline, so the groups are not made (the same calls and bits)."""
    sharding, q, k, v, dout = padded_batch([40, 8, 24], 2, "zigzag", (8, 8, 8, 8))
    (one, c1), (grouped, c2) = (run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=1, head_groups=g) for g in (1, 4))
    assert all(torch.equal(x, y) for a, b in zip(one, grouped) for x, y in zip(a, b))
    assert [ev.op for ev in c1.trace] == [ev.op for ev in c2.trace]


def schedule(n, own, heads, kind, calls):
    """Post every group's inputs, the own rows' call, then per group: wait for its inputs, its ring's `calls` kernel
    calls on `heads` heads, post its results; last, wait for every result."""
    ins, outs = (3, 1) if kind == "forward" else (1, 3)
    steps = ["post"] * (ins * n) + ([f"{kind} 8 heads"] if own else [])
    for _ in range(n):
        steps += ["wait"] * ins + [f"{kind} {heads} heads"] * calls + ["post"] * outs
    return steps + ["wait"] * (outs * n)


class SplitLogged:
    """A communicator whose sub-groups (the a2a groups and the rings `split` makes) log their all-to-alls too."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log

    def __getattr__(self, name):
        return getattr(logged_a2a(self.comm, self.log), name)

    def split(self, groups):
        return SplitLogged(self.comm.split(groups), self.log)


@pytest.mark.parametrize("P, layout, own, calls", [(2, "zigzag", False, 1), (4, "zigzag", False, 2),
                                                   (2, "balanced", True, 1)])  # fmt: skip
def test_each_groups_exchange_is_posted_before_the_calls_that_hide_it_and_waited_after(P, layout, own, calls):
    """The a2a groups' all-to-alls logged beside the kernel calls: at P = 4 each group's ring makes two calls (its
    two steps) between its inputs' wait and its output's post. Balanced at P = 2: documents on one rank, one across."""
    n = 2
    sharding, q, k, v, dout = padded_batch([32, 32, 64] if P == 2 else [64, 32, 96], P, layout, (8, 8, 8, 8))
    logs = [[] for _ in range(P)]

    def rank_fn(comm):
        log = logs[comm.rank]
        local = [sharding.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, sharding, comm=SplitLogged(comm, log), mode=MODE, a2a_size=2, head_groups=n,
                              kernel=LoggingKernel(log), check_ranks=False)  # fmt: skip
        log.append("backward starts")
        out.backward(sharding.shard(dout, comm.rank))

    SimCluster(P).run(rank_fn)
    heads = 8 // (2 * n)
    want = [*schedule(n, own, heads, "forward", calls), "backward starts", *schedule(n, own, heads, "backward", calls)]
    for r in range(P):
        assert logs[r] == want, f"rank {r}"


def test_head_groups_keep_bf16_error_flat_across_logit_scales():
    assert largest_bf16_error_over_logit_scales(MODE, 4, (8, 8, 16, 16), a2a_size=2, head_groups=2) < BF16_FLAT


@pytest.mark.parametrize("heads, groups, works", [((8, 8, 8, 8), 3, "[1, 2, 4]"), ((8, 2, 8, 8), 2, "[1]")])
def test_head_groups_that_do_not_split_are_refused_before_any_communication(heads, groups, works):
    """a = 2: 4 key/value heads per rank of the a2a group, or 1 (two heads, one each)."""
    P = 4
    sharding, q, k, v, _ = padded_batch([4 * P], P, "zigzag", heads)
    cluster = SimCluster(P, timeout=20.0)

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        cpref.attention(*local, sharding, comm=comm, mode=MODE, a2a_size=2, head_groups=groups)

    match = rf"mode 'a2a\+p2p' \(a2a_size=2\) with head_groups={groups}: each of the a = 2 ranks of an a2a group .* head_groups that work: {re.escape(works)}"
    with pytest.raises(cpref.CPInputError, match=match):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_head_groups_agree_with_the_one_exchange_to_a_few_units_in_the_last_place(layout):
    """Not bit for bit (a ring step's calls on fewer heads round their sums differently), but within 4 eps of each
    tensor's largest value in FP64: what the page says."""
    sharding, q, k, v, dout = padded_batch([40, 8, 24], 4, layout, (8, 8, 8, 8))
    one, _ = run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=2)
    grouped, _ = run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=2, head_groups=2)
    eps = torch.finfo(torch.float64).eps
    for r, (a, b) in enumerate(zip(one, grouped)):
        for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
            assert (x - y).abs().max() <= 4 * eps * x.abs().max(), f"rank {r} {name}"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_at_cp_2_the_hierarchy_in_head_groups_is_ulysses_pipeline_bit_for_bit(layout):
    """a = P = 2 in a chunked layout: a ring of one rank, one kernel call per group, as Ulysses' pipeline makes (the
    split layouts' ring of one still runs its piece plan, so there the two agree only to the last bits)."""
    sharding, q, k, v, dout = padded_batch([40, 8, 24], 2, layout, (8, 8, 8, 8))
    hier, _ = run_cp(q, k, v, dout, sharding, mode=MODE, a2a_size=2, head_groups=2)
    ulysses, _ = run_cp(q, k, v, dout, sharding, mode="a2a", head_groups=2)
    assert all(torch.equal(x, y) for a, b in zip(hier, ulysses) for x, y in zip(a, b))
