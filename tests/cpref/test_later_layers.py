"""Ranks that differ on a later layer of one batch (issue 18, part 4): every rank raises the same
`CPInputError` naming what differs, before that layer's mode communicates; or the difference cannot
matter (identical values are identical) and the layer runs. The same triggers on gloo processes are
in tests/backends/gloo_cases.py (`extra_later_layer_*`)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from sim import SimCluster
from tests.cp.test_every_mode import HostSyncCounter
from tests.helpers import cu_from_lengths, only_the_comparison, random_qkv

P = 2
CU = cu_from_lengths([8, 24])
SHARDING = cpref.Sharding(CU, cp_size=P, layout="zigzag")
Q, K, V = random_qkv(32, 4, 2, 8)


def run(layer2, *, layers=2, mode="p2p", first=None):
    """Every rank calls attention `layers` times on one batch, each rank with its own Sharding of
    it (a new tensor of CU); from layer 2 on, rank r passes `layer2(r, local, sharding)` ->
    (tensors, sharding, kwargs). Returns (cluster, outputs or the exception)."""

    def rank_fn(comm):
        sharding = cpref.Sharding(CU.clone(), cp_size=P, layout="zigzag")
        local = [sharding.shard(t, comm.rank) for t in (Q, K, V)]
        outs = [cpref.attention(*local, sharding, comm=comm, mode=mode, **(first or {}))]
        for _ in range(layers - 1):
            tensors, sharding_now, kw = layer2(comm.rank, local, sharding)
            outs.append(cpref.attention(*tensors, sharding_now, comm=comm, mode=kw.pop("mode", mode), **kw))
        return outs

    cluster = SimCluster(P, timeout=20.0)
    try:
        return cluster, cluster.run(rank_fn)
    except Exception as exc:  # noqa: BLE001 -- the caller asserts what it is
        return cluster, exc


def only_comparisons_after_the_first_layer(cluster):
    """Layer 1 ran (its comparison and its mode); layer 2 sent its comparison and nothing else."""
    last = max(i for i, e in enumerate(cluster.trace) if e.param == "host")
    return only_the_comparison([cluster.trace[last]]) and last == len(cluster.trace) - 1


def contiguous_on_rank_1(r, sharding):
    """Rank 1 attends with a Sharding of the same batch in the other layout (its tensors are zigzag's)."""
    return sharding if r == 0 else cpref.Sharding(sharding.cu_seqlens, cp_size=P, layout="contiguous")


# what: (rank r's (sharding, kwargs) on the later layer, given its own sharding; what the error names)
CHANGES = {
    "causal": (lambda r, s: (s, {"causal": r == 0}), r"causal: rank 0: True; rank 1: False"),
    "softmax_scale": (lambda r, s: (s, {"softmax_scale": [0.25, 0.5][r]}), r"softmax_scale: rank 0: 0.25; rank 1: 0.5"),
    "mode": (lambda r, s: (s, {"mode": ["p2p", "all_gather"][r]}), r"\n  mode: rank 0: digest [0-9a-f]+; rank 1: digest"),
    "layout": (lambda r, s: (contiguous_on_rank_1(r, s), {}), r"layout: rank 0: 'zigzag'; rank 1: 'contiguous'"),
}


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_an_argument_changed_on_one_rank_on_a_later_layer_raises_on_every_rank(what):
    """Was: rank 1 compared again while rank 0 went on into the mode: a collective mismatch on the
    simulated cluster, SIGABRT inside gloo (`op.preamble.length <= op.nbytes`), a hang under p2p."""
    change, match = CHANGES[what]
    cluster, result = run(lambda r, local, sharding: (local, *change(r, sharding)))
    assert isinstance(result, CPInputError), result  # the same message on every rank: re-raised as is
    assert "pass different arguments" in str(result) and re.search(match, str(result)), str(result)
    assert only_comparisons_after_the_first_layer(cluster), cluster.trace


def test_a_dtype_changed_on_one_rank_on_a_later_layer_raises_on_every_rank():
    cluster, result = run(lambda r, local, sharding: ([t.float() if r else t for t in local], sharding, {}))
    assert isinstance(result, CPInputError) and "dtype: rank 0: torch.float64; rank 1: torch.float32" in str(result)
    assert only_comparisons_after_the_first_layer(cluster)


def test_a_new_tensor_with_the_same_values_or_a_cleared_cache_on_one_rank_changes_nothing():
    """Identical values are identical: no error, and the same outputs as without the difference."""
    _, plain = run(lambda r, local, sharding: (local, sharding, {}), layers=3)
    assert not isinstance(plain, Exception), plain

    def new_tensor(r, local, sharding):
        return local, (cpref.Sharding(CU.clone(), cp_size=P, layout="zigzag") if r == 1 else sharding), {}

    def a_list(r, local, sharding):
        return local, (cpref.Sharding(CU.tolist(), cp_size=P, layout="zigzag") if r == 1 else sharding), {}

    def cleared(r, local, sharding):  # rank 1 empties the cache and goes on with its Sharding (which holds its entry)
        if r == 1:
            cpref.clear_cache()
        return local, sharding, {}

    def cleared_and_rebuilt(r, local, sharding):  # rank 1 builds the batch's Sharding again, into the emptied cache
        if r == 1:
            cpref.clear_cache()
            sharding = cpref.Sharding(sharding.cu_seqlens, cp_size=P, layout="zigzag")
        return local, sharding, {}

    for layer2 in (new_tensor, a_list, cleared, cleared_and_rebuilt):
        cluster, outs = run(layer2, layers=3)
        assert not isinstance(outs, Exception), outs
        for r in range(P):
            for a, b in zip(outs[r], plain[r]):
                assert torch.equal(a, b)
        assert sum(e.param == "host" for e in cluster.trace) == 3  # one comparison per call, every rank alike


def test_check_ranks_passed_differently_on_the_first_call_is_named():
    def rank_fn(comm):
        local = [SHARDING.shard(t, comm.rank) for t in (Q, K, V)]
        return cpref.attention(*local, SHARDING, comm=comm, mode="p2p", check_ranks=comm.rank == 0)

    cluster = SimCluster(P, timeout=20.0)
    with pytest.raises(CPInputError, match=r"check_ranks: rank 0: True; rank 1: False"):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace)


def test_check_ranks_off_on_one_rank_after_the_group_agreed_on_it_is_named():
    cluster, result = run(lambda r, local, sharding: (local, sharding, {"check_ranks": r == 0}))
    assert isinstance(result, CPInputError) and "check_ranks: rank 0: True; rank 1: False" in str(result)
    assert only_comparisons_after_the_first_layer(cluster)


def test_a_group_that_agreed_on_check_ranks_off_skips_later_comparisons_and_warns_a_rank_asking_for_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster, outs = run(lambda r, local, sharding: (local, sharding, {"check_ranks": r == 1}), layers=3,
                            first={"check_ranks": False})  # fmt: skip
    assert not isinstance(outs, Exception), outs
    assert sum(e.param == "host" for e in cluster.trace) == 1  # the first call's, which agreed on False
    assert sum("agreed on check_ranks=False" in str(w.message) for w in caught) == 2  # rank 1, layers 2 and 3


def test_cu_seqlens_that_differ_show_their_values_from_the_first_difference():
    """Was: digests only. The values follow from an exchange made on the error path alone."""
    other = cpref.Sharding(cu_from_lengths([16, 16]), cp_size=P, layout="zigzag")

    def rank_fn(comm):
        sharding = SHARDING if comm.rank == 0 else other
        local = [sharding.shard(t, comm.rank) for t in (Q, K, V)]
        return cpref.attention(*local, sharding, comm=comm, mode="p2p")

    with pytest.raises(CPInputError) as info:
        SimCluster(P, timeout=20.0).run(rank_fn)
    want = "cu_seqlens values from entry 0 (first difference at entry 1): rank 0: [0, 8, 32]; rank 1: [0, 16, 32]"
    assert want in str(info.value), str(info.value)


def test_long_boundaries_are_shown_around_their_first_difference():
    lengths = [8] * 40
    shardings = [cpref.Sharding(cu_from_lengths(lengths), cp_size=P, layout="zigzag"),
                 cpref.Sharding(cu_from_lengths(lengths[:30] + [16] + lengths[32:]), cp_size=P, layout="zigzag")]  # fmt: skip

    def rank_fn(comm):
        sharding = shardings[comm.rank]
        local = [sharding.shard(t, comm.rank) for t in random_qkv(320, 4, 2, 8)]
        return cpref.attention(*local, sharding, comm=comm, mode="p2p")

    with pytest.raises(CPInputError) as info:
        SimCluster(P, timeout=20.0).run(rank_fn)
    want = ("cu_seqlens values from entry 30 (first difference at entry 31): rank 0: [..., 240, 248, 256, 264, 272, "
            "280, ...]; rank 1: [..., 240, 256, 264, 272, 280, 288, ...]")
    assert want in str(info.value), str(info.value)


@pytest.mark.parametrize("layers", [2, 6])
def test_comparing_every_call_reads_no_tensor_on_the_host(layers, monkeypatch):
    """The hardening check: the per-call comparison goes over the host (`agree`), so no tensor is
    copied to the host after the first layer, whatever the number of layers."""
    counter = {}

    def rank_fn(comm):
        local = [SHARDING.shard(t, comm.rank).requires_grad_() for t in (Q, K, V)]
        out = cpref.attention(*local, SHARDING, comm=comm, mode="p2p")
        comm.barrier()
        if comm.rank == 0:
            counter["sync"] = HostSyncCounter(monkeypatch)
        comm.barrier()
        for _ in range(layers - 1):
            out = cpref.attention(out * 0.5 + local[0], local[1], local[2], SHARDING, comm=comm, mode="p2p")
        out.sum().backward()

    cluster = SimCluster(P, timeout=20.0)
    cluster.run(rank_fn)
    assert counter["sync"].calls == []
    assert sum(e.param == "host" for e in cluster.trace) == layers
