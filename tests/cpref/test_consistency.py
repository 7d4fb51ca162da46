"""The ranks' comparison (`cpref.consistency`) when one rank's own inputs fail validation.

The all-gather path is tested with the all-gather mode (tests/cp/test_all_gather.py); here the
two-all-reduce path of a backend without tensor all-gather, `check_ranks=False`, and the cache
lookups the failing rank uses to know whether the others compare.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.cache import CACHE
from cpref.errors import CPInputError
from sim import ClusterFailure, SimCluster
from tests.cp.test_every_mode import LimitedComm
from tests.helpers import cu_from_lengths, only_the_comparison, random_qkv

P = 3  # a size at which HCCL has no tensor all-gather
CU = cu_from_lengths([12, 24])
Q, K, V = random_qkv(36, 4, 2, 8)


def shards(rank):
    return [cpref.shard(t, CU, cp_size=P, rank=rank, layout="zigzag") for t in (Q, K, V)]


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
        return cpref.attention(q, k, v, CU, comm=LimitedComm(comm), mode="p2p")

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(ClusterFailure) as info:
        cluster.run(rank_fn)
    errors = info.value.errors
    assert type(errors[1]) is CPInputError and "share dtype" in str(errors[1])
    for r in (0, 2):
        assert type(errors[r]) is CPInputError, errors[r]
        assert "the inputs of a rank of the CP group failed validation" in str(errors[r])
    assert [e.op for e in cluster.trace] == ["all_reduce", "all_reduce"] and only_the_comparison(cluster.trace)


def test_with_check_ranks_off_a_failing_rank_sends_nothing():
    def rank_fn(comm):
        q, k, v = shards(comm.rank)
        return cpref.attention(q[:-1], k, v, CU, comm=comm, mode="all_gather", check_ranks=False)

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(CPInputError, match="tokens"):
        cluster.run(rank_fn)
    assert cluster.trace == []


def test_finding_a_batch_neither_builds_nor_counts_nor_validates():
    before = cpref.cache_info()
    assert CACHE.find(CU) is None and CACHE.find([0, 5, 3]) is None  # the second is invalid: no error either
    assert cpref.cache_info() == before
    entry = CACHE.entry(CU)
    assert CACHE.find(CU) is entry and CACHE.find(CU, None) is entry and CACHE.find(CU.clone()) is None
    assert cpref.cache_info().hits == before.hits


def test_a_batch_remembers_which_communicator_compared_it():
    entry = CACHE.entry(CU)
    entry.mark_checked(("ranks-agree", 7, (1, 2, 3)))
    assert entry.has_check(("ranks-agree", 7)) and entry.has_check(("ranks-agree",))
    assert not entry.has_check(("ranks-agree", 8)) and not entry.has_check(("other", 7))


def test_a_cpu_cu_seqlens_edited_in_place_is_not_found():
    cu = CU.clone()
    entry = CACHE.entry(cu)
    assert CACHE.find(cu) is entry
    version = cu._version
    cu.data[1] = 8  # an edit through .data: the version counter, and so the key, does not change
    assert cu._version == version and CACHE.find(cu) is None  # the snapshot comparison sees it
