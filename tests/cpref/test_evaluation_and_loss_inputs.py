"""Issue 18, part 7: boundaries made under `torch.inference_mode()` (evaluation) work, and a rank
whose `cp_loss` inputs fail validation makes every rank raise instead of leaving them waiting."""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError, PeerInputError
from sim import ClusterFailure, SimCluster
from tests.cp.test_every_mode import LimitedComm
from tests.helpers import cu_from_lengths, random_qkv

MODES = sorted(cpref.MODES)
P = 2
Q, K, V = random_qkv(32, 4, 2, 8)


@pytest.mark.parametrize("inside", [False, True], ids=["used-outside", "used-inside"])
@pytest.mark.parametrize("mode", MODES)
def test_cu_seqlens_made_under_inference_mode_work_in_every_mode(mode, inside):
    """Was: `RuntimeError: Inference tensors do not track version counter` (the cache's key)."""
    with torch.inference_mode():
        inference_cu = cu_from_lengths([8, 24])
    assert inference_cu.is_inference()
    extra = {"a2a_size": 2} if mode == "a2a+p2p" else {}

    def rank_fn(comm, cu):
        with torch.inference_mode(inside):  # inference_mode(False) changes nothing
            sharding = cpref.Sharding(cu, cp_size=P, layout="zigzag")  # where cu_seqlens enters the cache
            local = [sharding.shard(t, comm.rank) for t in (Q, K, V)]
            return cpref.attention(*local, sharding, comm=comm, mode=mode, **extra)

    got = SimCluster(P).run(lambda comm: rank_fn(comm, inference_cu))
    want = SimCluster(P).run(lambda comm: rank_fn(comm, cu_from_lengths([8, 24])))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_inference_cu_seqlens_edited_in_place_is_read_again():
    """Without a version counter the cache keys an inference tensor by identity; the contents
    snapshot of a CPU tensor sees an in-place edit."""
    from cpref.batch.cache import CACHE

    with torch.inference_mode():
        cu = cu_from_lengths([8, 24])
        assert CACHE.entry(cu).bounds.real == (0, 8, 32)
        cu[1] = 16
        assert CACHE.entry(cu).bounds.real == (0, 16, 32)


def losses(comm, bad_rank, how):
    n = 6
    token_loss, mask = torch.rand(n, dtype=torch.float64), torch.ones(n)
    if comm.rank == bad_rank:
        token_loss, mask = how(token_loss, mask)
    return cpref.cp_loss(token_loss, mask, comm)


BAD = {
    "shape": (lambda t, m: (t, m[:-1]), "token_loss has shape (6,) but loss_mask (5,)"),
    "dtype": (lambda t, m: (t.long(), m), "token_loss has dtype torch.int64; it must be floating"),
    "type": (lambda t, m: (t, m.tolist()), "loss_mask must be a tensor, got list"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_rank_whose_loss_inputs_fail_makes_every_rank_raise(what):
    """Was: the failing rank raised before the count's all-reduce, the others waited in it."""
    how, own = BAD[what]
    cluster = SimCluster(3, timeout=20.0)
    with pytest.raises(ClusterFailure) as info:
        cluster.run(lambda comm: losses(comm, 1, how))
    errors = info.value.errors
    assert type(errors[1]) is CPInputError and own in str(errors[1])
    for r in (0, 2):
        assert type(errors[r]) is PeerInputError and "the token_loss / loss_mask of rank 1 of the group failed" in str(errors[r])
    assert [(e.op, e.param) for e in cluster.trace] == [("all_gather", "host")]  # the exchange, not the all-reduce


def test_without_all_gather_the_loss_inputs_are_exchanged_as_min_and_max():
    cluster = SimCluster(3, timeout=20.0)
    with pytest.raises(ClusterFailure) as info:
        cluster.run(lambda comm: losses(LimitedComm(comm), 2, BAD["shape"][0]))
    assert "the token_loss / loss_mask of a rank of the group failed" in str(info.value.errors[0])


def test_valid_loss_inputs_exchange_one_host_row_then_all_reduce_the_count():
    cluster = SimCluster(3, timeout=20.0)
    shares = cluster.run(lambda comm: losses(comm, None, None))
    assert [(e.op, e.param) for e in cluster.trace] == [("all_gather", "host"), ("all_reduce", "op=sum")]
    assert all(s.shape == () for s in shares)
