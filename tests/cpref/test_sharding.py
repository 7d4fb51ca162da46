"""`cpref.Sharding`: one description of the sharded batch, and attention that cannot disagree with it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.models import CPContext
from sim.cluster.simcluster import SimCluster
from tests.helpers import cu_from_lengths, only_the_comparison, random_qkv

LAYOUTS = cpref.LAYOUTS


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpref.clear_cache()
    yield
    cpref.clear_cache()


@st.composite
def shardings(draw):
    P = draw(st.sampled_from([1, 2, 3, 4]))
    layout = draw(st.sampled_from(LAYOUTS))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    return cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout), lengths


@settings(max_examples=40, deadline=None)
@given(shardings())
def test_shard_unshard_pad_unpad_round_trip(case):
    """Every token lands on exactly one rank, and unshard(shard) and unpad(pad) are the identity."""
    s, lengths = case
    x = torch.arange(sum(lengths)) * 10 + 1  # (T_real,) distinct, nonzero
    padded = s.pad(x, value=0)  # (T,)
    assert padded.shape[0] == s.total and (padded != 0).sum() == sum(lengths)
    parts = [s.shard(padded, r) for r in range(s.cp_size)]
    assert all(p.shape[0] == s.local_tokens for p in parts)
    assert torch.equal(torch.sort(torch.cat([s.global_index(r) for r in range(s.cp_size)])).values, torch.arange(s.total))
    assert torch.equal(s.unshard(parts), padded)
    assert torch.equal(s.unpad(s.unshard(parts)), x)


@settings(max_examples=40, deadline=None)
@given(shardings())
def test_eod_padding_is_the_least_that_divides(case):
    """Each document is padded at its end to the next multiple of P (contiguous) or 2P (zigzag), never further;
    under stream and balanced only the last document, to the next multiple of P of the whole batch."""
    s, lengths = case
    padded = [s.cu_seqlens_padded[i + 1] - s.cu_seqlens_padded[i] for i in range(len(lengths))]
    if s.layout in ("stream", "balanced"):
        assert padded[:-1] == lengths[:-1] and padded[-1] - lengths[-1] == -sum(lengths) % s.cp_size
    else:
        mult = 1 if s.cp_size == 1 else s.cp_size * (2 if s.layout == "zigzag" else 1)
        assert padded == [-(-n // mult) * mult for n in lengths]
    assert s.cu_seqlens == tuple(cu_from_lengths(lengths).tolist())


@settings(max_examples=30, deadline=None)
@given(shardings())
def test_positions_are_places_inside_the_document(case):
    """A local token's position is its global index minus its (padded) document's start."""
    s, _ = case
    starts = torch.tensor(s.cu_seqlens_padded)
    for r in range(s.cp_size):
        idx = s.global_index(r)
        doc = torch.searchsorted(starts, idx, right=True) - 1
        assert torch.equal(s.positions(r), idx - starts[doc])


def test_zigzag_chunks_are_r_and_2p_minus_1_minus_r():
    s = cpref.Sharding([0, 8, 24], cp_size=2, layout="zigzag")
    assert s.local_chunks(0) == [(0, 0, 2), (0, 6, 8), (1, 8, 12), (1, 20, 24)]
    assert s.local_chunks(1) == [(0, 2, 4), (0, 4, 6), (1, 12, 16), (1, 16, 20)]
    assert cpref.Sharding([0, 8], cp_size=2, layout="contiguous").local_chunks(1) == [(0, 4, 8)]


def test_without_cp_any_length_and_either_layout_keeps_the_stream():
    for layout in LAYOUTS:
        s = cpref.Sharding([0, 5, 12], cp_size=1, layout=layout)
        assert s.cu_seqlens_padded == (0, 5, 12)
        assert torch.equal(s.global_index(0), torch.arange(12))


def test_equal_hashable_immutable_picklable():
    a = cpref.Sharding(torch.tensor([0, 8, 24]), cp_size=2)
    b = cpref.Sharding([0, 8, 24], cp_size=2, layout="zigzag")
    assert a == b and hash(a) == hash(b)
    assert a != cpref.Sharding([0, 8, 24], cp_size=2, layout="contiguous")
    assert a != cpref.Sharding([0, 8, 24], cp_size=4)
    assert a != cpref.Sharding([0, 7, 23], cp_size=2, cu_seqlens_padded=[0, 8, 24])
    with pytest.raises(AttributeError, match="immutable"):
        a.layout = "contiguous"
    c = pickle.loads(pickle.dumps(cpref.Sharding.eod_padded([0, 7, 20], cp_size=2)))
    assert c == cpref.Sharding([0, 7, 20], cp_size=2, cu_seqlens_padded=[0, 8, 24])
    assert repr(c) == "Sharding([0, 7, 20], cp_size=2, layout='zigzag', cu_seqlens_padded=[0, 8, 24])"


def test_built_once_per_batch_and_immune_to_later_edits():
    """Two shardings of one tensor share its cache entry; an in-place edit afterwards is a new batch,
    and the sharding built before it keeps the boundaries it was built with."""
    cu = torch.tensor([0, 8, 24])
    a = cpref.Sharding(cu, cp_size=2)
    b = cpref.Sharding(cu, cp_size=2)
    assert a.entry is b.entry
    a.global_index(1)
    before = cpref.cache_info()
    b.global_index(1)
    assert cpref.cache_info().hits == before.hits + 1 and cpref.cache_info().misses == before.misses
    cu[1] = 4
    assert a.cu_seqlens == (0, 8, 24)
    assert cpref.Sharding(cu, cp_size=2).cu_seqlens == (0, 4, 24)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: cpref.Sharding([0, 6, 32], cp_size=2), r"document 0 has length 6, not a multiple of 4 .*Sharding\.eod_padded"),
        (lambda: cpref.Sharding([0, 8], cp_size=0), r"cp_size=0"),
        (lambda: cpref.Sharding([0, 8], cp_size=2, layout="ring"), r"unknown layout 'ring'.*contiguous.*zigzag"),
        (lambda: cpref.Sharding([0, 8], cp_size=2, cu_seqlens_padded=[0, 6]), r"document 0 has 8 real tokens"),
        (lambda: cpref.Sharding([0, 8], cp_size=2).shard(torch.zeros(6), 0), r"shape \(6,\).*8 tokens"),
        (lambda: cpref.Sharding.eod_padded([0, 7], cp_size=2).shard(torch.zeros(7), 0), r"sharding\.pad\(x\)"),
        (lambda: cpref.Sharding([0, 8], cp_size=2).shard(torch.zeros(8), 2), r"rank=2 is outside \[0, 2\)"),
        (lambda: cpref.Sharding([0, 8], cp_size=2).unshard([torch.zeros(4)]), r"1 shards.*cp_size=2"),
        (lambda: cpref.Sharding([0, 8], cp_size=2).unshard([torch.zeros(4), torch.zeros(3)]), r"rank 1 has 3 tokens, expected 4"),
        (lambda: cpref.Sharding.eod_padded([0, 7], cp_size=2).pad(torch.zeros(8)), r"cu_seqlens ends at 7"),
    ],
)
def test_bad_sharding_input_names_the_value_and_the_fix(build, match):
    with pytest.raises(cpref.CPInputError, match=match):
        build()


def _shards(s, seed=0):
    q, k, v = random_qkv(s.total, 4, 2, 8, seed=seed)
    return [[s.shard(t, r) for t in (q, k, v)] for r in range(s.cp_size)]


def test_attention_takes_layout_and_size_from_the_sharding_only():
    """The issue's case: shard zigzag, then ask for contiguous at the call. The keyword form is gone,
    and passing it is an error on every rank before any communication, not a wrong output."""
    s = cpref.Sharding([0, 16, 32], cp_size=2, layout="zigzag")
    local = _shards(s)
    for extra in ({"layout": "contiguous"}, {"cu_seqlens_padded": [0, 16, 32]}):
        cluster = SimCluster(2, timeout=10.0)
        errors = cluster.run(lambda comm, extra=extra: _error(lambda: cpref.attention(*local[comm.rank], s, comm=comm, mode="p2p", **extra)))
        assert all(isinstance(e, cpref.CPInputError) and "Sharding" in str(e) for e in errors), errors
        assert only_the_comparison(cluster.trace)


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return e
    return None


def test_cp_size_mismatch_is_an_error_on_every_rank_before_communication():
    """A batch sharded over 2 ranks, attended over a group of 4: every rank raises, naming both sizes."""
    s2, s4 = cpref.Sharding([0, 16, 32], cp_size=2), cpref.Sharding([0, 16, 32], cp_size=4)
    local = _shards(s4)
    cluster = SimCluster(4, timeout=10.0)
    errors = cluster.run(lambda comm: _error(lambda: cpref.attention(*local[comm.rank], s2, comm=comm, mode="a2a")))
    for e in errors:
        assert isinstance(e, cpref.CPInputError) and "cp_size=2" in str(e) and "4 ranks" in str(e), e
    assert only_the_comparison(cluster.trace)


def test_one_rank_with_another_sharding_is_named_by_every_rank():
    """Rank 1 alone shards for another CP size, then for another layout: every rank raises, none waits."""
    good = cpref.Sharding([0, 16, 32], cp_size=4)
    local = _shards(good)
    for bad, named in ((cpref.Sharding([0, 16, 32], cp_size=2), "rank 1"), (good, None)):
        def rank_fn(comm, bad=bad):
            mine = bad if comm.rank == 1 else good
            return _error(lambda: cpref.attention(*local[comm.rank], mine, comm=comm, mode="all_gather"))

        cluster = SimCluster(4, timeout=10.0)
        errors = cluster.run(rank_fn)
        if named is None:
            assert errors == [None] * 4
            continue
        assert all(isinstance(e, cpref.CPInputError) for e in errors), errors
        assert all(named in str(e) for r, e in enumerate(errors) if r != 1), errors
        assert only_the_comparison(cluster.trace)
    contiguous = cpref.Sharding([0, 16, 32], cp_size=4, layout="contiguous")

    def rank_fn(comm):
        mine = contiguous if comm.rank == 1 else good
        return _error(lambda: cpref.attention(*local[comm.rank], mine, comm=comm, mode="all_gather"))

    errors = SimCluster(4, timeout=10.0).run(rank_fn)
    assert all(isinstance(e, cpref.CPInputError) and "layout" in str(e) and "'contiguous'" in str(e) for e in errors), errors


@pytest.mark.parametrize("given", [[0, 16, 32], torch.tensor([0, 16, 32]), None])
def test_boundaries_in_place_of_the_sharding_are_refused_with_the_fix(given):
    s = cpref.Sharding([0, 16, 32], cp_size=2)
    local = _shards(s)
    cluster = SimCluster(2, timeout=10.0)
    errors = cluster.run(lambda comm: _error(lambda: cpref.attention(*local[comm.rank], given, comm=comm, mode="p2p")))
    for e in errors:
        assert isinstance(e, cpref.CPInputError) and "cpref.Sharding(cu_seqlens, cp_size=2" in str(e), e
    assert only_the_comparison(cluster.trace)


def test_context_checks_the_sharding_against_the_group():
    s = cpref.Sharding([0, 16, 32], cp_size=2)
    with pytest.raises(cpref.CPInputError, match=r"cp_size=2.*1 ranks"):
        CPContext(comm=cpref.SingleRank(), sharding=s, mode="p2p")
    with pytest.raises(cpref.CPInputError, match=r"must be described by a cpref\.Sharding"):
        CPContext(comm=cpref.SingleRank(), sharding=[0, 16, 32], mode="p2p")
    one = CPContext.single([0, 5, 12])
    assert one.sharding == cpref.Sharding([0, 5, 12], cp_size=1)
    nxt = dataclasses.replace(one, sharding=cpref.Sharding([0, 3], cp_size=1))
    assert nxt.sharding.cu_seqlens == (0, 3) and one.sharding.cu_seqlens == (0, 5, 12)


def test_the_data_path_returns_the_sharding_that_cut_its_tensors():
    tokens = torch.arange(20)
    for rank in range(2):
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, [0, 7, 20], cp_size=2, rank=rank)
        s = b["sharding"]
        assert s == cpref.Sharding([0, 7, 20], cp_size=2, layout="zigzag", cu_seqlens_padded=[0, 8, 24])
        assert torch.equal(b["tokens"], s.shard(s.pad(tokens, value=0), rank))
        assert torch.equal(b["position_ids"], s.positions(rank))
        assert "cu_seqlens" not in b and "cu_seqlens_padded" not in b
