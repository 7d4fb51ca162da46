"""The all-gather mode with its collectives overlapped (`overlap=True`): against the FP64 oracle, the
same work as the one call, its collectives posted before the calls that hide them and waited after."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpref
from cpref.modes.all_gather_overlap import build_overlap_plan
from cpref.modes.all_gather_pieces import build_piece_all_gather_plan
from cpref.modes.all_gather_plan import build_all_gather_plan
from sim import SimCluster
from tests.cp.conftest import BF16_FLAT, CountingKernel, largest_bf16_error_over_logit_scales, oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison

HEADS = (4, 2, 8, 8)
LAYOUTS = ["zigzag", "contiguous", "balanced", "stream"]
CPU = torch.device("cpu")


def padded_batch(lengths, P, layout, dtype=torch.float64, seed=0):
    """`(sharding, q, k, v, dout)`: real lengths (any), padded at each document's end to the layout's multiple."""
    mult = 2 * P if layout == "zigzag" else P
    cu_pad = cu_from_lengths([-(-n // mult) * mult for n in lengths])
    sharding = cpref.Sharding(cu_from_lengths(lengths), cp_size=P, layout=layout, cu_seqlens_padded=cu_pad)
    return (sharding, *attention_inputs(sharding.total, HEADS, dtype=dtype, seed=seed))


def base_plan(sharding, rank, causal):
    build = build_all_gather_plan if sharding.layout in ("zigzag", "contiguous") else build_piece_all_gather_plan
    return build(sharding.bounds, sharding.cp_size, rank, sharding.layout, causal, CPU)


@settings(max_examples=12, deadline=None)
@given(
    P=st.sampled_from([2, 3, 4]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
    save=st.booleans(),
)
@example(P=4, lengths=[1], layout="zigzag", causal=True, save=False)  # ranks 1-3 hold only padding
@example(P=2, lengths=[40, 8, 24], layout="contiguous", causal=True, save=True)  # rank 0 reads no remote key
def test_overlap_matches_the_oracle_on_every_rank(P, lengths, layout, causal, save):
    sharding, q, k, v, dout = padded_batch(lengths, P, layout, seed=len(lengths))
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal, overlap=True, save_gathered_kv=save)
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")


@settings(max_examples=25, deadline=None)
@given(
    P=st.sampled_from([2, 3, 4]),
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=5),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
)
def test_the_split_computes_each_score_once_and_halves_the_local_work(P, lengths, layout, causal):
    """The local and remote calls together see exactly the one call's keys for every query (no score lost or twice),
    the backward's two halves split the local call's, and neither half does more than half plus one row."""
    sharding = padded_batch(lengths, P, layout)[0]
    for r in range(P):
        plan = base_plan(sharding, r, causal)
        ov = build_overlap_plan(plan, r, sharding.local_tokens, causal)
        pieces = plan.shared is not None
        lo, base = (0, sharding.local_tokens) if pieces else (r * sharding.local_tokens, 0)
        local_src = [lo + i for i in ov.local_index.tolist()]  # back to the plan's source rows
        remote_src = [base + i for i in ov.remote_index.tolist()]

        def seen(seqs, rows, is_causal):
            """query row -> the source rows it sees, from a call's sequences."""
            out = {}
            for i in range(seqs.num_seqs):
                for x in range(seqs.cu_q[i + 1] - seqs.cu_q[i]):
                    a, z = seqs.visible(i, x, is_causal)
                    out[seqs.cu_q[i] + x] = sorted(rows[seqs.cu_kv[i] + a: seqs.cu_kv[i] + max(a, z)])
            return out

        want = seen(plan.seqs, plan.kv_index.tolist(), causal)
        loc, rem = seen(ov.local, local_src, causal), seen(ov.remote, remote_src, False)
        assert {x: sorted(loc[x] + rem[x]) for x in want} == want, f"rank {r}"
        assert not any(set(loc[x]) & set(rem[x]) for x in want), f"rank {r}: a key in both calls"
        first, last = seen(ov.first, local_src, causal), seen(ov.last, local_src, causal)
        assert all(sorted(first[x] + last[x]) == loc[x] and not (first[x] and last[x]) for x in loc), f"rank {r}"
        w_first, w_last = ov.first.work(causal), ov.last.work(causal)
        widest = max((len(keys) for keys in loc.values()), default=0)
        assert w_first + w_last == ov.local.work(causal) and abs(w_first - w_last) <= 2 * widest, f"rank {r}"
        assert ov.parts == (w_first > 0, w_last > 0, ov.remote.work(False) > 0)


def test_a_plan_whose_diagonal_keys_another_rank_holds_is_refused():
    """The split is right only if each query piece's own keys are local: rank 1's plan split as rank 0's is not."""
    sharding = padded_batch([40, 24], 2, "zigzag")[0]
    with pytest.raises(ValueError, match="sequence 0's diagonal keys are not all held by rank 0"):
        build_overlap_plan(base_plan(sharding, 1, True), 0, sharding.local_tokens, True)


def test_a_call_without_work_is_not_made():
    """One token at P = 4: ranks 1-3 hold only padding (no backward call at all), rank 0 one score, in the backward's
    second half (the first half's best cut is empty)."""
    P = 4
    sharding, q, k, v, dout = padded_batch([1], P, "zigzag")
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, sharding, mode="all_gather", overlap=True, kernels=kernels)
    assert [(kern.forward_calls, kern.backward_calls) for kern in kernels] == [(1, 1), (1, 0), (1, 0), (1, 0)]


def recording(comm, log):
    """`comm`, logging each post and wait of a collective into `log`."""

    class Handle:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def wait(self):
            log.append(f"wait {self.name}")
            return self.inner.wait()

    class Comm:
        def __getattr__(self, name):
            return getattr(comm, name)

        def all_gather_async(self, x):
            log.append("post all_gather")
            return Handle(comm.all_gather_async(x), "all_gather")

        def reduce_scatter_async(self, x):
            log.append("post reduce_scatter")
            return Handle(comm.reduce_scatter_async(x), "reduce_scatter")

        def all_gather(self, x):
            log.append("all_gather")
            return comm.all_gather(x)

        def reduce_scatter(self, x):
            log.append("reduce_scatter")
            return comm.reduce_scatter(x)

    return Comm()


class LoggingKernel(CountingKernel):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, q, k, v, seqs, **kwargs):
        self.log.append(f"forward {'causal' if kwargs['causal'] else 'full'}")
        return super().forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self.log.append(f"backward {'causal' if kwargs['causal'] else 'full'}")
        return super().backward(dout, q, k, v, out, lse, seqs, **kwargs)


FORWARD = ["post all_gather", "post all_gather", "forward causal", "wait all_gather", "wait all_gather", "forward full"]
BACKWARD = {  # the backward's schedule, without and with save_gathered_kv
    False: ["post all_gather", "post all_gather", "backward causal", "wait all_gather", "wait all_gather",
            "backward full", "post reduce_scatter", "post reduce_scatter", "backward causal",
            "wait reduce_scatter", "wait reduce_scatter"],
    True: ["backward full", "post reduce_scatter", "post reduce_scatter", "backward causal", "wait reduce_scatter",
           "wait reduce_scatter"],
}


@pytest.mark.parametrize("save", [False, True], ids=["gather-again", "save_gathered_kv"])
@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_each_collective_is_posted_before_the_calls_it_hides_and_waited_after(layout, save):
    P = 2
    sharding, q, k, v, dout = padded_batch([48, 16, 64], P, layout)
    logs = [[] for _ in range(P)]

    def rank_fn(comm):
        log = logs[comm.rank]
        local = [sharding.shard(t, comm.rank).requires_grad_(True) for t in (q, k, v)]
        out = cpref.attention(*local, sharding, comm=recording(comm, log), mode="all_gather", overlap=True,
                              save_gathered_kv=save, kernel=LoggingKernel(log), check_ranks=False)  # fmt: skip
        log.append("backward starts")
        out.backward(sharding.shard(dout, comm.rank))

    SimCluster(P).run(rank_fn)
    for r in range(P):
        assert logs[r] == [*FORWARD, "backward starts", *BACKWARD[save]], f"rank {r}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_overlap_moves_the_same_bytes_and_does_the_same_work_as_the_one_call(layout, causal):
    P = 4
    sharding, q, k, v, dout = padded_batch([40, 8, 24], P, layout)
    runs = {}
    for overlap in (False, True):
        kernels = [CountingKernel() for _ in range(P)]
        _, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal, overlap=overlap, kernels=kernels)
        runs[overlap] = kernels, [(ev.op, ev.shape, ev.dtype, ev.bytes_sent) for ev in cluster.trace]
    assert runs[True][1] == runs[False][1]  # the same collectives, in the same order, of the same payloads
    for r, (one, split) in enumerate(zip(runs[False][0], runs[True][0])):
        assert split.forward_work() == one.forward_work(), f"rank {r}"
        remote = any(not c and kind == "forward" for kind, _, c, _ in split.calls)  # a call without a mask: remote keys
        assert (split.forward_calls, split.backward_calls) == (1 + remote, 2 + remote), f"rank {r}"
        assert (one.forward_calls, one.backward_calls) == (1, 1)
    if causal and layout == "contiguous":  # rank 0 reads no other rank's key; the last rank every other's
        assert (runs[True][0][0].forward_calls, runs[True][0][-1].forward_calls) == (1, 2)


@pytest.mark.parametrize("P", [2, 4])
def test_overlap_keeps_bf16_error_flat_across_logit_scales(P):
    """The backward's Delta comes from the merged output kept in float32, as the ring's does."""
    assert largest_bf16_error_over_logit_scales("all_gather", P, (4, 2, 16, 16), overlap=True) < BF16_FLAT


def test_overlap_under_a_window_is_refused_before_any_communication():
    P = 2
    sharding, q, k, v, _ = padded_batch([32, 16], P, "zigzag")
    cluster = SimCluster(P, timeout=30.0)

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        return cpref.attention(*local, sharding, comm=comm, mode="all_gather", overlap=True, window=(4, 0))

    with pytest.raises(ValueError, match=r"overlap=True: the overlap needs a plain causal or full mask, not window=\(4, 0\).*overlap=False"):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


def test_overlap_is_a_bool():
    with pytest.raises(ValueError, match="overlap must be True or False, got 'yes'"):
        cpref.attention(*[torch.randn(8, 2, 4)] * 3, cpref.Sharding([0, 8], cp_size=1), comm=cpref.SingleRank(),
                        mode="all_gather", overlap="yes")  # fmt: skip
