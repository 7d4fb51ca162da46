"""The ranks' comparison (`cpref.modes.consistency`): a rank whose own inputs fail validation, the
two-all-reduce path of a backend without tensor all-gather, `check_ranks`, what each column
names, and (issue 18) every way ranks can differ between the layers of one batch.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError, PeerInputError
from sim import ClusterFailure, SimCluster
from tests.cp.test_every_mode import LimitedComm
from tests.helpers import cu_from_lengths, only_the_comparison, random_qkv

P = 3  # a size at which HCCL has no tensor all-gather
SHARDING = cpref.Sharding(cu_from_lengths([12, 24]), cp_size=P, layout="zigzag")
Q, K, V = random_qkv(36, 4, 2, 8)


def shards(rank):
    return [SHARDING.shard(t, rank) for t in (Q, K, V)]


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpref.clear_cache()
    yield
    cpref.clear_cache()


def test_without_all_gather_a_failing_rank_is_reported_through_the_two_all_reduces():
    """min and max of the 'inputs valid' column cannot say which rank failed, only that one did."""

    def rank_fn(comm):
        q, k, v = shards(comm.rank)
        if comm.rank == 1:
            q = q.float()
        return cpref.attention(q, k, v, SHARDING, comm=LimitedComm(comm), mode="p2p")

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(ClusterFailure) as info:
        cluster.run(rank_fn)
    errors = info.value.errors
    assert type(errors[1]) is CPInputError and "share dtype" in str(errors[1])
    for r in (0, 2):
        assert type(errors[r]) is PeerInputError, errors[r]
        assert "the inputs of a rank of the CP group failed validation" in str(errors[r])
    assert [e.op for e in cluster.trace] == ["all_reduce", "all_reduce"] and only_the_comparison(cluster.trace)


def test_a_group_that_agreed_on_check_ranks_off_sends_nothing_for_a_failing_rank():
    """The first call is compared whatever check_ranks says (that is how the ranks agree on it);
    after an agreed check_ranks=False, a failing rank raises alone and nothing is sent."""

    def rank_fn(comm):
        q, k, v = shards(comm.rank)
        cpref.attention(q, k, v, SHARDING, comm=comm, mode="all_gather", check_ranks=False)
        comm.barrier()
        return cpref.attention(q[:-1], k, v, SHARDING, comm=comm, mode="all_gather", check_ranks=False)

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(CPInputError, match="tokens"):
        cluster.run(rank_fn)
    host = [e for e in cluster.trace if e.param == "host"]
    assert len(host) == 1 and cluster.trace[-1].op == "barrier"  # the first call's comparison, then nothing


# --- what the comparison compares and how it names it (mutation run over cpref.modes.consistency) ---

P2_SHARDING = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=2, layout="zigzag")
P2_QKV = random_qkv(32, 4, 2, 8)


def digest(value) -> str:
    """The documented fingerprint code of a column shown as a digest: the first 7 bytes of
    blake2b(repr(value)) read little-endian, printed as 14 hex digits (computed here, not copied)."""
    import hashlib

    return f"digest {int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), 'little'):014x}"


def two_ranks_calling(per_rank):
    """Run P = 2 ranks, rank r calling attention with `per_rank(r)`: (mode, tensors(q, k, v), kwargs)."""

    def rank_fn(comm):
        mode, tensors, kw = per_rank(comm.rank)
        local = [P2_SHARDING.shard(t, comm.rank) for t in P2_QKV]
        return cpref.attention(*tensors(*local), P2_SHARDING, comm=comm, mode=mode, **kw)

    cluster = SimCluster(2, timeout=20.0)
    with pytest.raises(CPInputError) as info:  # the same message on every rank: run() re-raises it
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace) and cluster.trace, cluster.trace
    return str(info.value)


def same(q, k, v):
    return q, k, v


def test_ranks_passing_different_modes_are_told_which_mode_each_passed():
    # p2p takes no options, a2a+p2p is given its one on both ranks: only the mode and its options differ
    message = two_ranks_calling(lambda r: (["p2p", "a2a+p2p"][r], same, {"a2a_size": 1} if r else {}))
    assert f"\n  mode: rank 0: {digest('p2p')}; rank 1: {digest('a2a+p2p')}\n" in message
    assert "mode options" in message and "heads:" not in message


def test_ranks_passing_different_mode_options_are_told():
    # the options column is the digest of the sorted (name, value) pairs after defaults are filled in
    message = two_ranks_calling(lambda r: ("all_gather", same, {"save_gathered_kv": r == 0}))
    rank = [digest((("overlap", False), ("save_gathered_kv", flag))) for flag in (True, False)]  # every option, sorted
    want = f"  mode options: rank 0: {rank[0]}; rank 1: {rank[1]}"
    assert want in message and "\n  mode:" not in message


def test_ranks_passing_different_deterministic_flags_are_told():
    # one rank alone summing in an unpinned order: every rank's gradients right, the run no longer repeatable
    message = two_ranks_calling(lambda r: ("all_gather", same, {"deterministic": r == 0}))
    assert "\n  deterministic: rank 0: True; rank 1: False" in message and "mode options" not in message


def test_ranks_passing_different_dtypes_are_told_each_dtype_by_name():
    message = two_ranks_calling(lambda r: ("p2p", (same, lambda *t: [x.float() for x in t])[r], {}))
    assert "\n  dtype: rank 0: torch.float64; rank 1: torch.float32\n" in message


def test_ranks_passing_different_value_head_dims_are_told():
    # rank 1 passes v with Dv = 4 < D = 8 (valid on its own); heads is (Hq, Hkv, D, Dv)
    message = two_ranks_calling(lambda r: ("p2p", (same, lambda q, k, v: (q, k, v[..., :4]))[r], {}))
    assert f"\n  heads (Hq, Hkv, D, Dv): rank 0: {digest((4, 2, 8, 8))}; rank 1: {digest((4, 2, 8, 4))}\n" in message


def test_without_all_gather_a_disagreement_names_the_lowest_and_the_highest_code():
    """Min and max stand in for the table: ranks 0 and 1 pass causal=True (code 1), rank 2
    causal=False (code 0), so the lowest code shows False and the highest True."""

    def rank_fn(comm):
        q, k, v = shards(comm.rank)
        return cpref.attention(q, k, v, SHARDING, comm=LimitedComm(comm), mode="p2p", causal=comm.rank != 2)

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(CPInputError) as info:
        cluster.run(rank_fn)
    assert "\n  causal: lowest code: False; highest code: True\n" in str(info.value)
    assert [e.op for e in cluster.trace] == ["all_reduce", "all_reduce"] and only_the_comparison(cluster.trace)


def test_a_compared_batch_called_again_with_other_arguments_is_compared_again():
    """The verdict is cached per (batch, group, arguments): a later call of the same batch whose
    arguments changed on every rank (and now disagree) is compared, not waved through."""
    sharding = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=2)  # a new batch, one sharding for both calls: one cache entry

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in P2_QKV]
        cpref.attention(*local, sharding, comm=comm, mode="p2p")  # the ranks agree
        return cpref.attention(*local, sharding, comm=comm, mode="p2p", softmax_scale=[0.25, 0.5][comm.rank])

    cluster = SimCluster(2, timeout=20.0)
    with pytest.raises(CPInputError, match=r"\n  softmax_scale: rank 0: 0.25; rank 1: 0.5\n"):
        cluster.run(rank_fn)
    assert [e.dtype for e in cluster.trace].count(torch.int64) == 2  # one comparison per call


def test_a_rank_failing_on_a_batch_another_group_compared_still_meets_its_own_group():
    """The cache remembers which communicator compared a batch: a batch compared by an earlier
    group (its comms are other objects) is new to this one, so its ranks compare it and a failing
    rank must meet them there, not raise alone and leave them waiting."""

    def rank_fn(comm, short_rank=None):
        q, k, v = shards(comm.rank)
        if comm.rank == short_rank:
            q = q[:-1]
        return cpref.attention(q, k, v, SHARDING, comm=comm, mode="all_gather")

    SimCluster(P, timeout=20.0).run(rank_fn)  # a first group compares the batch
    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(ClusterFailure) as info:
        cluster.run(lambda comm: rank_fn(comm, short_rank=1))
    errors = info.value.errors
    assert type(errors[1]) is CPInputError and "tokens" in str(errors[1])
    for r in (0, 2):
        assert type(errors[r]) is PeerInputError, errors[r]
        assert "the inputs of rank 1 of the CP group failed validation" in str(errors[r])
    assert only_the_comparison(cluster.trace) and cluster.trace, cluster.trace


