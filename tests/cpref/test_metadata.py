"""Load-balanced THD metadata and its LRU cache (MindSpeed RFC, section 4 unit tests)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.metadata import CACHE_CAPACITY, cache_info, clear_cp_metadata_cache, get_thd_load_balanced_cp_metadata
from tests.helpers import cu_from_lengths


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cp_metadata_cache()
    yield
    clear_cp_metadata_cache()


def expected_prefixes(cu, P, rank, layout, causal):
    """Independent construction: the global token ids each query sequence must see, in order."""
    cu = cu.tolist()
    mult = 2 * P if layout == "zigzag" else P
    seqs = []
    for i in range(len(cu) - 1):
        c = (cu[i + 1] - cu[i]) // mult
        chunks = [rank, 2 * P - 1 - rank] if layout == "zigzag" else [rank]
        if causal:
            seqs += [(c, list(range(cu[i], cu[i] + (j + 1) * c))) for j in chunks]
        else:
            seqs.append((len(chunks) * c, list(range(cu[i], cu[i + 1]))))
    return seqs


@settings(max_examples=40, deadline=None)
@given(
    P=st.sampled_from([1, 2, 4, 8]),
    units=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
)
def test_kv_index_selects_each_chunks_prefix_from_the_rank_major_buffer(P, units, layout, causal):
    mult = 2 * P if layout == "zigzag" else P
    cu = cu_from_lengths([u * mult for u in units])
    # what an all-gather of every rank's global token ids produces: the rank-major buffer
    rank_major = torch.cat([cpref.global_index(cu, cp_size=P, rank=r, layout=layout) for r in range(P)])
    for r in range(P):
        meta = get_thd_load_balanced_cp_metadata(cu, P, r, "cpu", layout=layout, causal=causal)
        seqs = expected_prefixes(cu, P, r, layout, causal)
        got = rank_major[meta["kv_index"]].tolist()
        assert got == [t for _, kv in seqs for t in kv]
        q_lens = [q for q, _ in seqs]
        kv_lens = [len(kv) for _, kv in seqs]
        assert meta["actual_seq_qlen"] == torch.tensor(q_lens).cumsum(0).tolist()
        assert meta["actual_seq_kvlen"] == torch.tensor(kv_lens).cumsum(0).tolist()
        assert meta["cu_seqlens_q"].tolist() == [0] + meta["actual_seq_qlen"]
        assert meta["cu_seqlens_kv"].tolist() == [0] + meta["actual_seq_kvlen"]
        assert meta["local_tokens"] == int(cu[-1]) // P and meta["global_tokens"] == int(cu[-1])
        assert meta["work"] == sum(q * kv for q, kv in zip(q_lens, kv_lens))
        assert meta["work"] == cpref.attention_work(cu, cp_size=P, rank=r, layout=layout, causal=causal)


@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_zigzag_work_equal_on_every_rank(P, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, 20, (int(torch.randint(1, 28, (1,), generator=g)),), generator=g) * 2 * P).tolist()
    cu = cu_from_lengths(lengths)
    work = [get_thd_load_balanced_cp_metadata(cu, P, r)["work"] for r in range(P)]
    assert len(set(work)) == 1, work
    assert len(get_thd_load_balanced_cp_metadata(cu, P, 0)["actual_seq_qlen"]) == 2 * len(lengths)


def test_worked_example_cp2():
    """The docs' example: one document of 8 tokens, CP=2, zigzag."""
    m0 = get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    m1 = get_thd_load_balanced_cp_metadata([0, 8], 2, 1)
    # rank-major buffer rows: r0 = [t0 t1 | t6 t7], r1 = [t2 t3 | t4 t5]
    assert m0["kv_index"].tolist() == [0, 1, 0, 1, 4, 5, 6, 7, 2, 3]
    assert m1["kv_index"].tolist() == [0, 1, 4, 5, 0, 1, 4, 5, 6, 7]
    assert (m0["actual_seq_qlen"], m0["actual_seq_kvlen"]) == ([2, 4], [2, 10])
    assert (m1["actual_seq_qlen"], m1["actual_seq_kvlen"]) == ([2, 4], [4, 10])


def test_ends_only_form_equals_leading_zero_form():
    a = get_thd_load_balanced_cp_metadata([0, 8, 24], 2, 1)
    b = get_thd_load_balanced_cp_metadata([8, 24], 2, 1)
    c = get_thd_load_balanced_cp_metadata(torch.tensor([8, 24], dtype=torch.int32), 2, 1)
    for m in (b, c):
        assert torch.equal(a["kv_index"], m["kv_index"])
        assert a["actual_seq_kvlen"] == m["actual_seq_kvlen"]


@pytest.mark.parametrize(
    "cu, P, rank, match",
    [
        ([], 2, 0, "empty"),
        ([0], 2, 0, "empty"),
        ([0, 8, 8], 2, 0, "strictly increasing: document 1 spans \\[8, 8\\), length 0"),
        ([8, 4], 2, 0, "strictly increasing"),
        ([0, 6], 2, 0, "document 0 has length 6, not a multiple of 4"),
        ([0, 8], 0, 0, "cp_size must be an int >= 1, got 0"),
        ([0, 8], 2, 2, r"rank 2 is outside \[0, cp_size=2\)"),
        ([0, 8], 2, -1, "rank -1"),
    ],
)
def test_invalid_input_raises_assertion_error(cu, P, rank, match):
    with pytest.raises(AssertionError, match=match):
        get_thd_load_balanced_cp_metadata(cu, P, rank)


def test_cache_hits_on_same_tensor_and_misses_after_in_place_change():
    cu = torch.tensor([0, 8, 16])
    m1 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    m2 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert m1 is m2
    assert cache_info()[:3] == (1, 1, 1)
    cu[2] = 24  # in place: version bumps, the entry must not be reused
    m3 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert m3 is not m1 and m3["global_tokens"] == 24
    assert cache_info().misses == 2


def test_cache_distinguishes_equal_tensors_rank_device_and_layout():
    a, b = torch.tensor([0, 8]), torch.tensor([0, 8])
    get_thd_load_balanced_cp_metadata(a, 2, 0)
    get_thd_load_balanced_cp_metadata(b, 2, 0)  # another tensor: identity, not value
    get_thd_load_balanced_cp_metadata(a, 2, 1)
    get_thd_load_balanced_cp_metadata(a, 2, 0, layout="contiguous")
    get_thd_load_balanced_cp_metadata(a, 2, 0, causal=False)
    get_thd_load_balanced_cp_metadata(a, 1, 0)
    assert cache_info().misses == 6 and cache_info().hits == 0
    get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    get_thd_load_balanced_cp_metadata([0, 8], 2, 0)  # lists are keyed by value
    assert cache_info().hits == 1


def test_cache_evicts_least_recently_used_past_capacity():
    assert CACHE_CAPACITY == 8 and cache_info().capacity == 8
    tensors = [torch.tensor([0, 4 * (i + 1)]) for i in range(9)]
    for t in tensors[:8]:
        get_thd_load_balanced_cp_metadata(t, 2, 0)
    get_thd_load_balanced_cp_metadata(tensors[0], 2, 0)  # refresh the oldest
    get_thd_load_balanced_cp_metadata(tensors[8], 2, 0)  # evicts tensors[1]
    assert cache_info().size == 8
    hits = cache_info().hits
    get_thd_load_balanced_cp_metadata(tensors[0], 2, 0)
    assert cache_info().hits == hits + 1
    get_thd_load_balanced_cp_metadata(tensors[1], 2, 0)
    assert cache_info().hits == hits + 1 and cache_info().size == 8


def test_cache_holds_only_lengths_and_indices():
    get_thd_load_balanced_cp_metadata(torch.tensor([0, 8]), 2, 0)
    from cpref.metadata import _CACHE

    for owner, meta in _CACHE.entries.values():
        tensors = [v for v in meta.values() if isinstance(v, torch.Tensor)]
        assert all(not t.is_floating_point() for t in tensors + [owner])


def test_clear_resets():
    get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    clear_cp_metadata_cache()
    assert tuple(cache_info()) == (0, 0, 0, 8)


def test_cache_is_safe_under_concurrent_ranks():
    """The simulated cluster's ranks are threads of one process and share the cache."""
    import threading

    tensors = [torch.tensor([0, 4 * (i + 1)]) for i in range(12)]
    errors = []

    def hammer(rank):
        try:
            for _ in range(50):
                for t in tensors:  # 12 keys through an LRU of 8: constant eviction
                    meta = get_thd_load_balanced_cp_metadata(t, 2, rank % 2)
                    assert meta["global_tokens"] == int(t[-1])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    info = cache_info()
    assert info.hits + info.misses == 4 * 50 * 12 and info.size == 8
