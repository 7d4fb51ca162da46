"""Load-balanced THD metadata and its LRU cache (MindSpeed RFC, section 4 unit tests)."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
import cpref.modes.metadata
from cpref.batch.cache import CACHE
from cpref.modes.metadata import CACHE_CAPACITY, cache_info, clear_cp_metadata_cache, get_thd_load_balanced_cp_metadata
from tests.helpers import cu_from_lengths


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cp_metadata_cache()
    yield
    clear_cp_metadata_cache()


def expected_prefixes(cu, P, rank, layout, causal):
    """Independent construction: the global token ids each query sequence must see, in order."""
    cu = cu.tolist()
    zigzag = layout == "zigzag" and P > 1  # without CP a document is one chunk, whole, in either layout
    mult = 2 * P if zigzag else P
    seqs = []
    for i in range(len(cu) - 1):
        c = (cu[i + 1] - cu[i]) // mult
        chunks = [rank, 2 * P - 1 - rank] if zigzag else [rank]
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
    rank_major = torch.cat([cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout=layout) for r in range(P)])
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
        assert meta["work"] == cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout=layout, causal=causal)


@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_zigzag_work_equal_on_every_rank(P, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, 20, (int(torch.randint(1, 28, (1,), generator=g)),), generator=g) * 2 * P).tolist()
    cu = cu_from_lengths(lengths)
    work = [get_thd_load_balanced_cp_metadata(cu, P, r)["work"] for r in range(P)]
    assert len(set(work)) == 1, work
    chunks = 2 if P > 1 else 1  # without CP a document is one chunk, whole
    assert len(get_thd_load_balanced_cp_metadata(cu, P, 0)["actual_seq_qlen"]) == chunks * len(lengths)


def test_worked_example_cp2():
    """The docs' example: one document of 8 tokens, CP=2, zigzag."""
    m0 = get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    m1 = get_thd_load_balanced_cp_metadata([0, 8], 2, 1)
    # rank-major buffer rows: r0 = [t0 t1 | t6 t7], r1 = [t2 t3 | t4 t5]
    assert m0["kv_index"].tolist() == [0, 1, 0, 1, 4, 5, 6, 7, 2, 3]
    assert m1["kv_index"].tolist() == [0, 1, 4, 5, 0, 1, 4, 5, 6, 7]
    assert (m0["actual_seq_qlen"], m0["actual_seq_kvlen"]) == ([2, 4], [2, 10])
    assert (m1["actual_seq_qlen"], m1["actual_seq_kvlen"]) == ([2, 4], [4, 10])


def test_padding_queries_next_to_each_other_form_one_keyless_sequence():
    """One real token padded to 8, CP=2, zigzag (chunks of 2). Rank 0: chunk 0 holds t0 and one
    padding row, chunk 3 only padding; the three padding rows are one sequence without keys, not
    two. Rank 1 (chunks 1 and 2, all padding): one keyless sequence of 4 rows and nothing to gather.
    Fewer sequences is fewer (empty) blocks for the kernel, and on the NPU a shorter TND list."""
    m0 = get_thd_load_balanced_cp_metadata([0, 1], 2, 0, cu_seqlens_padded=[0, 8])
    m1 = get_thd_load_balanced_cp_metadata([0, 1], 2, 1, cu_seqlens_padded=[0, 8])
    assert (m0["actual_seq_qlen"], m0["actual_seq_kvlen"], m0["kv_index"].tolist()) == ([1, 4], [1, 1], [0])
    assert (m1["actual_seq_qlen"], m1["actual_seq_kvlen"], m1["kv_index"].tolist()) == ([4], [0], [])


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
        ([], 2, 0, "at least one document"),
        ([0], 2, 0, "at least one document"),
        ([0, 8, 8], 2, 0, "strictly increasing: document 1 spans \\[8, 8\\), length 0"),
        ([8, 4], 2, 0, "strictly increasing"),
        ([0, 6], 2, 0, "document 0 has length 6, not a multiple of 4"),
        ([0, 8], 0, 0, r"cp_size=0 is outside \[1, inf\)"),
        ([0, 8], 2, 2, r"rank=2 is outside \[0, 2\)"),
        ([0, 8], 2, -1, r"rank=-1 is outside \[0, 2\)"),
    ],
)
def test_invalid_input_raises_assertion_error(cu, P, rank, match):
    with pytest.raises(AssertionError, match=match):
        get_thd_load_balanced_cp_metadata(cu, P, rank)


def test_cache_hits_on_same_tensor_and_misses_after_in_place_change():
    cu = torch.tensor([0, 8, 16])
    m1 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    m2 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert m1["kv_index"] is m2["kv_index"]
    assert cache_info()[:3] == (1, 1, 1)
    cu[2] = 24  # in place: version bumps, the entry must not be reused
    m3 = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert m3["kv_index"] is not m1["kv_index"] and m3["global_tokens"] == 24
    assert cache_info().misses == 2


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_edits_behind_the_version_counter_of_a_host_tensor_are_caught(how):
    """Writing through `.data` or a NumPy view leaves `_version` unchanged: the content check catches it."""
    cu = torch.tensor([0, 8, 16])
    stale = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    version = cu._version
    if how == "data":
        cu.data[2] = 24
    else:
        cu.numpy()[2] = 24
    assert cu._version == version  # the edit really bypassed the counter
    fresh = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert fresh["global_tokens"] == 24 and fresh["kv_index"].numel() != stale["kv_index"].numel()


def test_a_cache_hit_never_skips_validation():
    get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    for bad, match in [(dict(cp_size=2.0), r"cp_size must be an int, got 2.0 \(float\); pass 2"),
                       (dict(cp_size=True), r"cp_size must be an int, got True"),
                       (dict(rank=True), r"rank must be an int, got True"),
                       (dict(causal="False"), r"causal must be True or False, got 'False'"),
                       (dict(layout="zig"), r"unknown layout 'zig'")]:  # fmt: skip
        args = {"cp_size": 2, "rank": 0, **bad}
        with pytest.raises(ValueError, match=match):
            get_thd_load_balanced_cp_metadata([0, 8], args.pop("cp_size"), args.pop("rank"), **args)


def test_numpy_integers_are_accepted_as_the_ints_they_are():
    a = get_thd_load_balanced_cp_metadata([0, 8], np.int64(2), np.int32(1))
    b = get_thd_load_balanced_cp_metadata([0, 8], 2, 1)
    assert a["kv_index"] is b["kv_index"]
    c = get_thd_load_balanced_cp_metadata(np.array([0, 8]).tolist(), 2, np.int64(1))
    assert torch.equal(c["kv_index"], b["kv_index"])


def test_plans_are_immutable_and_the_view_is_read_only():
    meta = get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    with pytest.raises(TypeError):
        meta["work"] = 0
    plan = next(iter(next(iter(CACHE.entries.values()))._plans.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.work = 0
    meta["actual_seq_qlen"].append(99)  # a caller's list: the next call gets its own
    assert get_thd_load_balanced_cp_metadata([0, 8], 2, 0)["actual_seq_qlen"] == [2, 4]


def test_the_cache_key_includes_the_device_and_kv_index_lives_there():
    cpu = get_thd_load_balanced_cp_metadata([0, 8, 24], 2, 1, "cpu")
    meta = get_thd_load_balanced_cp_metadata([0, 8, 24], 2, 1, "meta")
    assert meta["kv_index"].device.type == "meta" and meta["cu_seqlens_kv"].device.type == "meta"
    assert cpu["kv_index"].device.type == "cpu"
    assert cache_info().misses == 2 and meta["actual_seq_kvlen"] == cpu["actual_seq_kvlen"]
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        get_thd_load_balanced_cp_metadata([0, 8], 2, 0, "gpu0")


def test_racing_ranks_build_each_plan_once(monkeypatch):
    """Force the race: a slow build, eight threads asking for the same plan at once."""
    builds = []
    real = cpref.modes.metadata.build_all_gather_plan

    def slow(*args):
        builds.append(args[2])
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(cpref.modes.metadata, "build_all_gather_plan", slow)
    cu = torch.tensor([0, 16, 48])
    got, start = [], threading.Barrier(8)

    def rank(r):
        start.wait()
        got.append((r % 2, get_thd_load_balanced_cp_metadata(cu, 2, r % 2)["kv_index"]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(builds) == [0, 1]  # one build per rank's plan, not one per thread
    for r in (0, 1):
        same = [kv for rr, kv in got if rr == r]
        assert len(same) == 4 and all(kv is same[0] for kv in same)
    assert cache_info()[:3] == (6, 2, 1)


def test_many_ranks_share_one_batch_entry_and_do_not_thrash():
    """P = 12 > capacity 8: one entry per batch, not per rank, so every later layer hits."""
    cu = torch.tensor([0, 48, 96])
    for _layer in range(3):
        for r in range(12):
            get_thd_load_balanced_cp_metadata(cu, 12, r, layout="contiguous")
    assert cache_info()[:3] == (24, 12, 1)


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
    for entry in CACHE.entries.values():
        for plan in entry._plans.values():
            fields = [getattr(plan, f.name) for f in dataclasses.fields(plan)]
            tensors = [v for v in fields if isinstance(v, torch.Tensor)]
            assert tensors and all(not t.is_floating_point() for t in tensors)


def test_clear_resets_the_one_cache():
    get_thd_load_balanced_cp_metadata([0, 8], 2, 0)
    clear_cp_metadata_cache()
    assert tuple(cache_info()) == (0, 0, 0, 8)
    assert cpref.clear_cache is cpref.batch.cache.clear_cache and cpref.cache_info is cpref.batch.cache.cache_info


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


def visible_keys_from_metadata(cu_real, cu_pad, P, rank, layout, causal):
    """For every local query token, the global ids of the keys the metadata lets it see."""
    meta = get_thd_load_balanced_cp_metadata(cu_real, P, rank, layout=layout, causal=causal, cu_seqlens_padded=cu_pad)
    rank_major = torch.cat([cpref.batch.layout.global_index(cu_pad, cp_size=P, rank=r, layout=layout) for r in range(P)])
    keys = rank_major[meta["kv_index"]].tolist()
    seen = []
    for q0, q1, k0, k1 in meta["seqs"].pairs():
        n_q, n_k = q1 - q0, k1 - k0
        for j in range(n_q):  # bottom-right causal: query j sees key t iff t <= j + n_k - n_q
            hi = min(n_k, j + 1 + n_k - n_q) if causal else n_k
            seen.append(sorted(keys[k0 : k0 + max(hi, 0)]))
    return seen


def visible_keys_expected(cu_real, cu_pad, P, rank, layout, causal):
    """Independent construction: a real query at position p of a document of n real tokens sees
    positions [0, p] (causal) or [0, n); a padding query sees nothing; nobody sees padding."""
    out = []
    for g in cpref.batch.layout.global_index(cu_pad, cp_size=P, rank=rank, layout=layout).tolist():
        d = max(i for i in range(len(cu_pad) - 1) if cu_pad[i] <= g)
        p, n = g - cu_pad[d], cu_real[d + 1] - cu_real[d]
        out.append([] if p >= n else list(range(cu_pad[d], cu_pad[d] + (p + 1 if causal else n))))
    return out


@settings(max_examples=40, deadline=None)
@given(
    P=st.sampled_from([1, 2, 3, 4]),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
)
def test_every_query_sees_exactly_its_real_keys_with_padding(P, lengths, layout, causal):
    mult = 2 * P if layout == "zigzag" else P
    cu_real = cu_from_lengths(lengths).tolist()
    cu_pad = cu_from_lengths([-(-n // mult) * mult for n in lengths]).tolist()
    for r in range(P):
        got = visible_keys_from_metadata(cu_real, cu_pad, P, r, layout, causal)
        assert got == visible_keys_expected(cu_real, cu_pad, P, r, layout, causal)


def test_the_ends_only_reading_of_a_list_is_cached_apart_from_the_strict_one():
    """[8, 24] is MindSpeed's ends-only form to the metadata API (documents of 8 and 16 tokens), but
    an invalid list (no leading 0) to cpref.attention: a cached ends-only entry must not let it through."""
    from cpref.comm.protocol import SingleRank

    assert get_thd_load_balanced_cp_metadata([8, 24], 2, 1)["global_tokens"] == 24
    q = torch.randn(24, 2, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must start with 0"):
        cpref.attention(q, q, q, cpref.Sharding([8, 24], cp_size=1), comm=SingleRank(), mode="p2p")


def test_without_a_host_snapshot_the_version_alone_invalidates_an_edited_tensor(monkeypatch):
    """A device tensor gets no snapshot (comparing one would copy it to the host): an in-place edit
    must still miss, through `_version` in the key. CPU tensors stand in for device ones here."""
    monkeypatch.setattr(cpref.batch.cache, "_is_host_tensor", lambda x: False)
    cu = torch.tensor([0, 8, 16])
    get_thd_load_balanced_cp_metadata(cu, 2, 0)
    cu[2] = 24
    fresh = get_thd_load_balanced_cp_metadata(cu, 2, 0)
    assert fresh["global_tokens"] == 24 and cache_info().misses == 2


def test_an_entry_rebuilt_after_an_edit_becomes_the_most_recently_used():
    tensors = [torch.tensor([0, 4 * (i + 1)]) for i in range(9)]
    for t in tensors[:8]:
        get_thd_load_balanced_cp_metadata(t, 2, 0)
    tensors[0].data[1] = 40  # behind the version counter: the same key, its entry rebuilt on the next call
    assert get_thd_load_balanced_cp_metadata(tensors[0], 2, 0)["global_tokens"] == 40  # LRU order: 1, ..., 7, 0
    get_thd_load_balanced_cp_metadata(tensors[8], 2, 0)  # the ninth batch evicts tensors[1], not tensors[0]
    hits = cache_info().hits
    get_thd_load_balanced_cp_metadata(tensors[0], 2, 0)
    assert cache_info().hits == hits + 1
    get_thd_load_balanced_cp_metadata(tensors[1], 2, 0)
    assert cache_info().hits == hits + 1


def test_a_cached_batch_keeps_its_tensor_alive_so_that_its_id_cannot_be_reused():
    """A tensor's key is its id (and version): while its entry is cached the entry must hold the
    tensor, or a new tensor could be given the freed id and hit the stale entry (on a device,
    where no snapshot is compared, it would get the old plan). Cleared, the tensor is freed."""
    import gc
    import weakref

    cu = torch.tensor([0, 8, 16])
    alive = weakref.ref(cu)
    get_thd_load_balanced_cp_metadata(cu, 2, 0)
    del cu
    gc.collect()
    assert alive() is not None
    cpref.clear_cache()
    gc.collect()
    assert alive() is None
