"""KV all-gather CP (MindSpeed RFC) on the simulated cluster, rank by rank against the FP64 oracle."""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from sim.cluster import SimCluster
from tests.cp.conftest import CountingKernel, oracle_shards, run_cp
from tests.helpers import TOL, assert_close, cu_from_lengths, random_qkv

HEADS = {  # name: (Hq, Hkv, D, Dv)
    "mha": (4, 4, 16, 16),
    "gqa": (4, 2, 16, 16),
    "mqa": (4, 1, 8, 8),
    "mla": (4, 2, 24, 16),  # GQA with Dk != Dv (field bug 3)
}
NAMES = ("out", "dq", "dk", "dv")


def batch(P, layout, heads, dtype=torch.float64, seed=0):
    mult = 2 * P if layout == "zigzag" else P
    cu = cu_from_lengths([mult * 2, mult * 5, mult])  # three documents of unequal length
    hq, hkv, d, dv = HEADS[heads]
    q, k, v = random_qkv(int(cu[-1]), hq, hkv, d, dv, dtype=dtype, seed=seed)
    dout = random_qkv(int(cu[-1]), hq, hq, dv, seed=seed + 1)[0].to(dtype)
    return cu, q, k, v, dout


def check_against_oracle(results, refs, dtype):
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == dtype
            assert_close(a, b, dtype, msg=f"rank {r} {name}")


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_fp64_every_rank_matches_oracle(P, layout, causal, heads):
    cu, q, k, v, dout = batch(P, layout, heads)
    results, _ = run_cp(q, k, v, dout, cu, P=P, mode="all_gather", layout=layout, causal=causal)
    check_against_oracle(results, oracle_shards(q, k, v, dout, cu, P=P, layout=layout, causal=causal), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("P", [2, 4])
def test_low_precision_within_stated_tolerance(P, heads, dtype):
    cu, q, k, v, dout = batch(P, "zigzag", heads, dtype=dtype, seed=3)
    results, _ = run_cp(q, k, v, dout, cu, P=P, mode="all_gather", layout="zigzag")
    refs = oracle_shards(q.double(), k.double(), v.double(), dout.double(), cu, P=P, layout="zigzag")
    check_against_oracle(results, refs, dtype)


def test_cp1_and_custom_scale():
    cu, q, k, v, dout = batch(1, "zigzag", "gqa")
    results, _ = run_cp(q, k, v, dout, cu, P=1, mode="all_gather", layout="zigzag", softmax_scale=0.3)
    check_against_oracle(results, oracle_shards(q, k, v, dout, cu, P=1, layout="zigzag", scale=0.3), torch.float64)


@pytest.mark.parametrize("P", [2, 4])
def test_one_kernel_call_and_one_collective_per_tensor(P):
    """Counted, not timed: forward = 1 kernel call + all-gather K, V; backward = 1 call + reduce-scatter dK, dV."""
    cu, q, k, v, dout = batch(P, "zigzag", "gqa")
    kernels = [CountingKernel() for _ in range(P)]
    seen = {}

    def rank_fn(comm):
        shard = lambda x: cpref.shard(x, cu, cp_size=P, rank=comm.rank, layout="zigzag")  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        out = cpref.attention(ql, kl, vl, cu, comm=comm, mode="all_gather", kernel=kernels[comm.rank])
        comm.barrier()  # marks the end of the forward in the trace
        seen[comm.rank] = (kernels[comm.rank].forward_calls, kernels[comm.rank].backward_calls)
        out.backward(shard(dout))
        return kl.shape[0]

    cluster = SimCluster(P, timeout=30.0)
    t_l = cluster.run(rank_fn)[0]
    assert all(seen[r] == (1, 0) for r in range(P))
    assert all((kern.forward_calls, kern.backward_calls) == (1, 1) for kern in kernels)
    ops = [ev.op for ev in cluster.trace]
    assert ops == ["all_gather", "all_gather", "barrier", "reduce_scatter", "reduce_scatter"]
    hkv, d = HEADS["gqa"][1], HEADS["gqa"][2]
    chunk_bytes = t_l * hkv * d * 8  # one rank's K (or V) shard in fp64
    for ev in cluster.trace:
        if ev.op != "barrier":
            assert ev.bytes_sent == ev.bytes_recv == tuple([(P - 1) * chunk_bytes] * P)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, cu: (q[:, :3], k, v, cu), r"heads: q has 3, k 2"),
        (lambda q, k, v, cu: (q, k, torch.cat([v, v], -1), cu), r"Dq == Dk >= Dv"),
        (lambda q, k, v, cu: (q[:-1], k, v, cu), r"q/k/v hold 15/16/16 tokens but this rank's shard of 32 tokens"),
        (lambda q, k, v, cu: (q, k, v.float(), cu), r"share dtype"),
        (lambda q, k, v, cu: (q, k, v, [0, 6, 32]), r"document 0 has length 6, not a multiple of 4"),
        (lambda q, k, v, cu: (q, k, v, [0, 32, 32]), r"strictly increasing"),
        (lambda q, k, v, cu: (q[0], k, v, cu), r"q must be a THD tensor"),
        (lambda q, k, v, cu: (q.long(), k, v, cu), r"q has dtype torch.int64"),
    ],
)
def test_bad_input_fails_on_every_rank_before_any_communication(mutate, match):
    P = 2
    cu, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [cpref.shard(t, cu, cp_size=P, rank=comm.rank, layout="zigzag") for t in (q, k, v)]
        ql, kl, vl, cu_bad = mutate(*local, cu)
        return cpref.attention(ql, kl, vl, cu_bad, comm=comm, mode="all_gather")

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match=match):
        cluster.run(rank_fn)
    assert cluster.trace == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="ring"), r"unknown mode 'ring'"),
        (dict(mode="all_gather", layout="striped"), r"unknown layout 'striped'"),
        (dict(mode="all_gather", a2a_size=2), r"a2a_size=2 is only used by the hierarchical"),
        (dict(mode="all_gather", softmax_scale=-1.0), r"softmax_scale must be None or a positive"),
    ],
)
def test_bad_arguments_fail_before_communication(kwargs, match):
    P = 2
    cu, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [cpref.shard(t, cu, cp_size=P, rank=comm.rank, layout="zigzag") for t in (q, k, v)]
        return cpref.attention(*local, cu, comm=comm, **kwargs)

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match=match):
        cluster.run(rank_fn)
    assert cluster.trace == []


def test_one_rank_with_a_bad_shard_is_surfaced_without_a_hang():
    """Field bug 12: one rank fails validation while the others enter the all-gather."""
    from sim import ClusterFailure, PeerFailure

    P = 4
    cu, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [cpref.shard(t, cu, cp_size=P, rank=comm.rank, layout="zigzag") for t in (q, k, v)]
        if comm.rank == 2:
            local[0] = local[0][:-2]
        return cpref.attention(*local, cu, comm=comm, mode="all_gather")

    start = time.monotonic()
    with pytest.raises(ClusterFailure) as info:
        SimCluster(P, timeout=20.0).run(rank_fn)
    assert time.monotonic() - start < 10.0
    errors = info.value.errors
    assert isinstance(errors[2], ValueError) and "tokens" in str(errors[2])
    assert all(isinstance(errors[r], PeerFailure) for r in (0, 1, 3))


def test_metadata_is_cached_across_layers():
    P = 2
    cu, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [cpref.shard(t, cu, cp_size=P, rank=comm.rank, layout="zigzag") for t in (q, k, v)]
        for _ in range(3):  # three "layers", same cu_seqlens tensor
            cpref.attention(*local, cu, comm=comm, mode="all_gather")

    SimCluster(P, timeout=30.0).run(rank_fn)
    info = cpref.cache_info()
    assert (info.misses, info.hits, info.size) == (P, 2 * P, P)


def test_rfc_alias_is_the_same_function():
    assert cpref.AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced is cpref.AllGatherKVFunc


def test_28_documents_at_cp8():
    """A field-sized mix: 28 packed documents of uneven length over 8 ranks, FP64."""
    P, layout = 8, "zigzag"
    g = torch.Generator().manual_seed(28)
    cu = cu_from_lengths((torch.randint(1, 5, (28,), generator=g) * 2 * P).tolist())
    q, k, v = random_qkv(int(cu[-1]), 4, 2, 8, seed=5)
    dout = random_qkv(int(cu[-1]), 4, 4, 8, seed=6)[0]
    results, _ = run_cp(q, k, v, dout, cu, P=P, mode="all_gather", layout=layout)
    check_against_oracle(results, oracle_shards(q, k, v, dout, cu, P=P, layout=layout), torch.float64)


@settings(max_examples=12, deadline=None)
@given(
    P=st.sampled_from([1, 2, 3, 4]),
    units=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
    heads=st.sampled_from(sorted(HEADS)),
)
def test_property_random_documents_match_oracle(P, units, layout, causal, heads):
    mult = 2 * P if layout == "zigzag" else P
    cu = cu_from_lengths([u * mult for u in units])
    hq, hkv, d, dv = HEADS[heads]
    q, k, v = random_qkv(int(cu[-1]), hq, hkv, d, dv, seed=len(units))
    dout = random_qkv(int(cu[-1]), hq, hq, dv, seed=7)[0]
    results, _ = run_cp(q, k, v, dout, cu, P=P, mode="all_gather", layout=layout, causal=causal)
    check_against_oracle(results, oracle_shards(q, k, v, dout, cu, P=P, layout=layout, causal=causal), torch.float64)


def test_bitwise_deterministic_across_runs():
    cu, q, k, v, dout = batch(4, "zigzag", "gqa", dtype=torch.bfloat16, seed=9)
    first, _ = run_cp(q, k, v, dout, cu, P=4, mode="all_gather", layout="zigzag")
    second, _ = run_cp(q, k, v, dout, cu, P=4, mode="all_gather", layout="zigzag")
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_cu_seqlens_is_copied_to_the_host_once_per_step_not_per_layer():
    """On an accelerator every `.tolist()` stalls the stream; validation reuses the host copy."""
    from cpref.api import _HOST_CU

    _HOST_CU.clear()
    P = 2
    cu, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [cpref.shard(t, cu, cp_size=P, rank=comm.rank, layout="zigzag") for t in (q, k, v)]
        for _ in range(4):  # four layers
            cpref.attention(*local, cu, comm=comm, mode="all_gather")

    SimCluster(P, timeout=30.0).run(rank_fn)
    info = _HOST_CU.info()
    assert info.hits + info.misses == 4 * P and info.misses <= P and info.size == 1
    cu[1] += 0  # an in-place write bumps the version: the next call must re-validate
    SimCluster(P, timeout=30.0).run(rank_fn)
    assert _HOST_CU.info().misses >= info.misses + 1
