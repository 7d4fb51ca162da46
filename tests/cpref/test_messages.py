"""The newcomer's message cuts of issue 56: a `Sharding` shown whole however long its batch (was: its repr cut
mid-list, `cu_seqlens_padded=[) but the communicator has 1 ranks`), a transposed `(H, T, D)` input told that dim 0 is
the tokens, and `mode=` left out a `CPInputError` listing the modes (was: Python's `TypeError`)."""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError, PeerInputError
from sim import ClusterFailure, SimCluster

LONG = list(range(0, 4097, 32))  # 129 boundaries: 128 documents of 32 tokens
MODES = "['a2a', 'a2a+p2p', 'all_gather', 'p2p']"


def test_a_long_sharding_is_shown_by_its_ends_and_length_and_a_short_one_whole():
    assert repr(cpref.Sharding(LONG, cp_size=2)) == "Sharding([0, 32, 64, ..., 4096] (129 entries), cp_size=2, layout='zigzag')"
    sharding = cpref.Sharding([0, *(36 * i - 4 for i in range(1, 129))], cp_size=2, layout="contiguous",
                              cu_seqlens_padded=[36 * i for i in range(129)])  # each document padded to 36 tokens
    assert repr(sharding) == ("Sharding([0, 32, 68, ..., 4604] (129 entries), cp_size=2, layout='contiguous', "
                              "cu_seqlens_padded=[0, 36, 72, ..., 4608] (129 entries))")  # fmt: skip
    eight = list(range(0, 57, 8))  # 8 entries: written out
    assert repr(cpref.Sharding(eight, cp_size=1)) == f"Sharding({eight}, cp_size=1, layout='zigzag')"


def test_a_sharding_for_another_group_size_is_named_whole_in_the_refusal():
    """Was: `(Sharding([0, 32, ..., 448, ) but the communicator has 1 ranks`, cut at 80 characters."""
    sharding = cpref.Sharding(LONG, cp_size=2)
    q = torch.randn(sharding.local_tokens, 2, 4)
    with pytest.raises(CPInputError) as info:
        cpref.attention(q, q, q, sharding, comm=cpref.SingleRank(), mode="p2p")
    assert str(info.value) == (
        "the batch is sharded over cp_size=2 (Sharding([0, 32, 64, ..., 4096] (129 entries), cp_size=2, "
        "layout='zigzag')) but the communicator has 1 ranks; shard it for this group with cpref.Sharding(..., cp_size=1)"
    )


def test_boundaries_passed_in_place_of_the_sharding_are_shown_shortened_not_cut():
    q = torch.randn(4096, 2, 4)
    with pytest.raises(CPInputError, match=r"got list \[0, 32, 64, 96, 128, 160, \.\.\.\]; build it once per batch"):
        cpref.attention(q, q, q, LONG, comm=cpref.SingleRank(), mode="p2p")


def test_a_transposed_input_is_told_that_dim_0_is_the_tokens_and_the_fix_works():
    sharding = cpref.Sharding([0, 16], cp_size=1)
    q, k, v = (torch.randn(h, 16, 8, dtype=torch.float64) for h in (4, 2, 2))  # (H, T, D): the layout of SDPA's heads
    with pytest.raises(CPInputError) as info:
        cpref.attention(q, k, v, sharding, comm=cpref.SingleRank(), mode="p2p")
    assert str(info.value) == (
        "q/k/v hold 4/2/2 tokens but this rank's shard of 16 tokens over cp_size=1 has 16; shard them with "
        "sharding.shard(x, comm.rank); q, k, v have the 16 tokens in dim 1, as if laid out (heads, tokens, head dim), "
        "but dim 0 is the tokens, (tokens, heads, head dim): pass q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)"
    )
    turned = [t.transpose(0, 1) for t in (q, k, v)]  # what the message says to pass
    out = cpref.attention(*turned, sharding, comm=cpref.SingleRank(), mode="p2p")
    want = cpref.attention(*[t.contiguous() for t in turned], sharding, comm=cpref.SingleRank(), mode="p2p")
    assert torch.equal(out, want)


def test_only_the_transposed_tensor_is_named_and_a_short_shard_gets_no_hint():
    sharding = cpref.Sharding([0, 16, 32], cp_size=2)
    k = v = torch.randn(16, 2, 8)
    with pytest.raises(CPInputError, match=r"q has the 16 tokens in dim 1, .*: pass q\.transpose\(0, 1\)$"):
        cpref.attention(torch.randn(2, 16, 8), k, v, cpref.Sharding([0, 16], cp_size=1), comm=cpref.SingleRank(), mode="p2p")
    with pytest.raises(CPInputError) as info:
        sharding.check_local(q=torch.randn(15, 2, 8), k=k, v=v)
    assert str(info.value).endswith("shard them with sharding.shard(x, comm.rank)")  # dim 1 is not the tokens: no hint
    with pytest.raises(CPInputError, match=r"dim 0 must hold the whole \(padded\) stream; x has the 32 tokens in dim 1"):
        sharding.shard(torch.randn(4, 32, 8), 0)


def test_mode_left_out_is_a_cpinputerror_listing_the_modes():
    sharding = cpref.Sharding([0, 8], cp_size=1)
    q = torch.randn(8, 2, 4)
    with pytest.raises(CPInputError) as info:
        cpref.attention(q, q, q, sharding, comm=cpref.SingleRank())
    assert str(info.value) == (f"cpref.attention needs mode=, the CP algorithm: one of {MODES} (cpref.MODES; the docs' "
                               "'Which mode?' compares them), the same on every rank")  # fmt: skip


def test_mode_left_out_on_one_rank_fails_every_rank_alike():
    """A rank's own mistake, told to the others in the ranks' comparison: nobody waits for it."""
    sharding = cpref.Sharding([0, 16], cp_size=2)
    q = torch.randn(16, 2, 4)

    def rank_fn(comm):
        local = sharding.shard(q, comm.rank)
        mode = {} if comm.rank == 1 else {"mode": "p2p"}
        return cpref.attention(local, local, local, sharding, comm=comm, **mode)

    with pytest.raises(ClusterFailure) as info:
        SimCluster(2, timeout=20.0).run(rank_fn)
    errors = info.value.errors
    assert type(errors[1]) is CPInputError and "needs mode=" in str(errors[1])
    assert type(errors[0]) is PeerInputError and "the inputs of rank 1 of the CP group failed validation" in str(errors[0])
