"""Ulysses in head groups (`head_groups=n`): against the FP64 oracle, the same bytes and work as the one exchange
in n times the all-to-alls and kernel calls, each group posted before the calls that hide it and waited after."""

import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpref
from cpref.modes.ulysses_pipeline import group_heads, ungroup
from sim import SimCluster
from tests.cp.conftest import BF16_FLAT, CountingKernel, largest_bf16_error_over_logit_scales, oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison

LAYOUTS = ["zigzag", "contiguous", "balanced", "stream"]
HEAD_GROUP_BATCHES = dict(  # hypothesis strategies of the head-group tests (here and the hierarchy's)
    P=st.sampled_from([2, 4]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
    heads=st.sampled_from([(8, 8, 8, 8), (8, 4, 8, 4)]),
    groups=st.sampled_from([2, 4]),
)


def padded_batch(lengths, P, layout, heads, dtype=torch.float64, seed=0):
    """`(sharding, q, k, v, dout)`: real lengths (any), padded at each document's end to the layout's multiple."""
    mult = 2 * P if layout == "zigzag" else P
    cu_pad = cu_from_lengths([-(-n // mult) * mult for n in lengths])
    sharding = cpref.Sharding(cu_from_lengths(lengths), cp_size=P, layout=layout, cu_seqlens_padded=cu_pad)
    return (sharding, *attention_inputs(sharding.total, heads, dtype=dtype, seed=seed))


@pytest.mark.parametrize("a, n", [(1, 2), (2, 2), (3, 2), (2, 3)])
def test_grouping_and_ungrouping_put_every_head_back_in_its_place(a, n):
    """Head `j H/a + c H/(a n) + i` goes to rank j in group c; after an identity exchange (every chunk stays where
    it is, as on one rank that is sent itself) ungroup restores the tensor exactly."""
    t_l, h = 3, a * n * 2
    x = torch.arange(t_l * h * 1.0).reshape(t_l, h, 1)  # (T_l, H, 1): entry = token * H + head
    parts = [group_heads(x, a, n, c) for c in range(n)]
    for c, part in enumerate(parts):
        for j in range(a):
            heads = part[j * t_l: (j + 1) * t_l, :, 0] % h  # chunk j: what rank j receives from this rank
            want = torch.arange(j * h // a + c * h // (a * n), j * h // a + (c + 1) * h // (a * n)).double()
            assert torch.equal(heads, want.expand(t_l, -1)), (c, j)
    assert torch.equal(ungroup(parts, a), x)


@settings(max_examples=12, deadline=None)
@given(**HEAD_GROUP_BATCHES)
@example(P=4, lengths=[1], layout="zigzag", causal=True, heads=(8, 8, 8, 8), groups=2)  # ranks 1-3 hold padding only
@example(P=2, lengths=[40, 8, 24], layout="balanced", causal=True, heads=(8, 4, 8, 4), groups=2)  # own and shared rows
def test_head_groups_match_the_oracle_on_every_rank(P, lengths, layout, causal, heads, groups):
    if (heads[1] // P) % groups:
        groups = heads[1] // P  # every rank's key/value heads, one per group
    sharding, q, k, v, dout = padded_batch(lengths, P, layout, heads, seed=len(lengths))
    results, _ = run_cp(q, k, v, dout, sharding, mode="a2a", causal=causal, head_groups=groups)
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_under_a_window_match_the_oracle(layout):
    P, window = 2, (5, 0)
    sharding, q, k, v, dout = padded_batch([40, 8, 24], P, layout, (8, 8, 8, 8))
    results, _ = run_cp(q, k, v, dout, sharding, mode="a2a", window=window, head_groups=4)
    for r, (got, want) in enumerate(zip(results, oracle_shards(q, k, v, dout, sharding, window=window))):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_give_the_one_exchanges_bits(layout):
    """Attention is per head, so each group's call computes its heads exactly as the one call does: bit for bit."""
    P = 2
    sharding, q, k, v, dout = padded_batch([40, 8, 24], P, layout, (8, 8, 8, 8))
    one, _ = run_cp(q, k, v, dout, sharding, mode="a2a")
    grouped, _ = run_cp(q, k, v, dout, sharding, mode="a2a", head_groups=2)
    for r, (a, b) in enumerate(zip(one, grouped)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {r}"


class HeadsKernel(CountingKernel):
    """Counts the forward's score entries over all the heads of each call."""

    def __init__(self):
        super().__init__()
        self.heads = []

    def forward(self, q, k, v, seqs, **kwargs):
        self.heads.append(q.shape[1])
        return super().forward(q, k, v, seqs, **kwargs)

    def head_work(self) -> int:
        calls = [(seqs, causal) for kind, seqs, causal, _ in self.calls if kind == "forward"]
        return sum(h * seqs.work(causal) for h, (seqs, causal) in zip(self.heads, calls))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_move_the_same_bytes_and_do_the_same_work_in_n_times_the_calls(layout, causal):
    P, n = 2, 4
    sharding, q, k, v, dout = padded_batch([40, 8, 24], P, layout, (8, 8, 8, 8))
    runs = {}
    for groups in (1, n):
        kernels = [HeadsKernel() for _ in range(P)]
        _, cluster = run_cp(q, k, v, dout, sharding, mode="a2a", causal=causal, head_groups=groups, kernels=kernels)
        events = [ev for ev in cluster.trace if ev.op == "all_to_all"]
        runs[groups] = kernels, len(events), [sum(ev.bytes_sent[r] for ev in events) for r in range(P)]
    (one, ops_1, bytes_1), (split, ops_n, bytes_n) = runs[1], runs[n]
    assert bytes_n == bytes_1 and ops_n == n * ops_1 and ops_1 in (0, 8)  # balanced: maybe nothing shared
    for r, (k1, kn) in enumerate(zip(one, split)):
        assert kn.head_work() == k1.head_work(), f"rank {r}"
        shared = ops_1 > 0  # every rank has shared rows (a call per group) or none
        own = k1.forward_calls - shared  # the split layouts' own rows: one call, unchanged
        assert (kn.forward_calls, kn.backward_calls) == (own + n * shared, own + n * shared), f"rank {r}"


class LoggingKernel(CountingKernel):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, q, k, v, seqs, **kwargs):
        self.log.append(f"forward {q.shape[1]} heads")
        return super().forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self.log.append(f"backward {q.shape[1]} heads")
        return super().backward(dout, q, k, v, out, lse, seqs, **kwargs)


def logged_a2a(comm, log):
    """`comm`, logging each post and wait of an all-to-all into `log`."""

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def wait(self):
            log.append("wait")
            return self.inner.wait()

    class Comm:
        def __getattr__(self, name):
            return getattr(comm, name)

        def all_to_all_async(self, x):
            log.append("post")
            return Handle(comm.all_to_all_async(x))

        def all_to_all(self, x):
            log.append("all_to_all")
            return comm.all_to_all(x)

    return Comm()


def schedule(n, own, heads, kind):
    """Post every group's inputs (3 tensors forward, dout backward), the own rows' call, then per group: wait for
    its inputs, its call on `heads` heads, post its results; last, wait for every result."""
    ins, outs = (3, 1) if kind == "forward" else (1, 3)
    steps = ["post"] * (ins * n) + ([f"{kind} 8 heads"] if own else [])
    for _ in range(n):
        steps += ["wait"] * ins + [f"{kind} {heads} heads"] + ["post"] * outs
    return steps + ["wait"] * (outs * n)


@pytest.mark.parametrize("layout, own", [("zigzag", False), ("balanced", True)])
def test_each_group_is_posted_before_the_calls_that_hide_it_and_waited_after(layout, own):
    """Balanced: the batch's first document sits on rank 0, the second on rank 1, the third spans both."""
    P, n = 2, 2
    sharding, q, k, v, dout = padded_batch([32, 32, 64], P, layout, (8, 8, 8, 8))
    logs = [[] for _ in range(P)]

    def rank_fn(comm):
        log = logs[comm.rank]
        local = [sharding.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, sharding, comm=logged_a2a(comm, log), mode="a2a", head_groups=n,
                              kernel=LoggingKernel(log), check_ranks=False)  # fmt: skip
        log.append("backward starts")
        out.backward(sharding.shard(dout, comm.rank))

    SimCluster(P).run(rank_fn)
    want = [*schedule(n, own, 8 // (P * n), "forward"), "backward starts", *schedule(n, own, 8 // (P * n), "backward")]
    for r in range(P):
        assert logs[r] == want, f"rank {r}"


@pytest.mark.parametrize("P", [2, 4])
def test_head_groups_keep_bf16_error_flat_across_logit_scales(P):
    assert largest_bf16_error_over_logit_scales("a2a", P, (8, 8, 16, 16), head_groups=2) < BF16_FLAT


@pytest.mark.parametrize("heads, P, groups, works", [
    ((8, 8, 8, 8), 4, 3, "[1, 2]"),  # 2 key/value heads per rank
    ((8, 2, 8, 8), 4, 2, "[1]"),  # replicated: 1 per rank
    ((8, 4, 8, 8), 2, 4, "[1, 2]"),
])  # fmt: skip
def test_head_groups_that_do_not_split_are_refused_before_any_communication(heads, P, groups, works):
    sharding, q, k, v, _ = padded_batch([4 * P], P, "zigzag", heads)
    cluster = SimCluster(P, timeout=20.0)

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        cpref.attention(*local, sharding, comm=comm, mode="a2a", head_groups=groups)

    with pytest.raises(cpref.CPInputError, match=rf"head_groups={groups}: .* head_groups that work: {re.escape(works)}"):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize("mode", ["a2a", "a2a+p2p"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_a_head_groups_that_is_not_a_positive_int_is_refused(value, mode):
    with pytest.raises(cpref.CPInputError, match="head_groups"):
        cpref.MODES[mode].parse_options({"head_groups": value})
