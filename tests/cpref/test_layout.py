"""Layouts: round trips, chunk ownership, positions, padding, work balance, bad input.

The layout math itself, `cpref.batch.layout`'s functions (what `cpref.Sharding` calls).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.batch.layout import LAYOUTS, layout_multiple
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from tests.helpers import cu_from_lengths


@st.composite
def packed(draw, layout=None):
    """A random packed batch: (cu_seqlens, P, layout), every document divisible by the layout (for stream and
    balanced: any lengths, the last one making the batch a multiple of P)."""
    P = draw(st.integers(1, 8))
    layout = layout or draw(st.sampled_from(LAYOUTS))
    mult = layout_multiple(layout, P)
    lengths = draw(st.lists(st.integers(1, 4 if layout in CHUNKED_LAYOUTS else 20).map(lambda n: n * mult), min_size=1, max_size=5))
    if layout not in CHUNKED_LAYOUTS:
        lengths[-1] += -sum(lengths) % P
    return cu_from_lengths(lengths), P, layout


@settings(max_examples=60, deadline=None)
@given(packed())
def test_shard_unshard_round_trip(case):
    cu, P, layout = case
    x = torch.randn(int(cu[-1]), 3, 2, dtype=torch.float64)
    shards = [cpref.batch.layout.shard(x, cu, cp_size=P, rank=r, layout=layout) for r in range(P)]
    assert all(s.shape[0] == int(cu[-1]) // P for s in shards)
    assert torch.equal(cpref.batch.layout.unshard(shards, cu, layout=layout), x)


@settings(max_examples=60, deadline=None)
@given(packed())
def test_global_index_partitions_the_stream_and_positions_match(case):
    cu, P, layout = case
    idx = [cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout=layout) for r in range(P)]
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(int(cu[-1])))
    starts = cu[torch.searchsorted(cu, torch.cat(idx), right=True) - 1]
    pos = torch.cat([cpref.batch.layout.positions(cu, cp_size=P, rank=r, layout=layout) for r in range(P)])
    assert torch.equal(pos, torch.cat(idx) - starts)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_zigzag_rank_holds_chunks_r_and_2p_minus_1_minus_r_in_order(P):
    c = 3
    cu = cu_from_lengths([2 * P * c, 4 * P * c])
    for r in range(P):
        got = cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout="zigzag").tolist()
        want = []
        for start, L in ((0, 2 * P * c), (2 * P * c, 4 * P * c)):
            cc = L // (2 * P)
            want += list(range(start + r * cc, start + (r + 1) * cc))
            want += list(range(start + (2 * P - 1 - r) * cc, start + (2 * P - r) * cc))
        assert got == want


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_contiguous_rank_holds_chunk_r(P):
    cu = cu_from_lengths([P * 2, P * 5])
    for r in range(P):
        got = cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout="contiguous").tolist()
        assert got == list(range(2 * r, 2 * r + 2)) + list(range(2 * P + 5 * r, 2 * P + 5 * r + 5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(1, 16))
def test_pad_to_multiple_pads_each_document_at_its_end(lengths, multiple):
    cu = cu_from_lengths(lengths)
    x = torch.arange(1, int(cu[-1]) + 1)
    xp, cup = cpref.batch.layout.pad_to_multiple(x, cu, multiple, value=-1)
    padded = (cup[1:] - cup[:-1]).tolist()
    assert all(p % multiple == 0 and 0 <= p - n < multiple for p, n in zip(padded, lengths))
    for i, n in enumerate(lengths):
        doc = xp[int(cup[i]) : int(cup[i + 1])]
        assert torch.equal(doc[:n], x[int(cu[i]) : int(cu[i + 1])])
        assert (doc[n:] == -1).all()
    assert torch.equal(cpref.batch.layout.unpad(xp, cup, cu), x)


def test_document_of_length_7_is_never_treated_as_6():
    """Field bug 1: a real token must never be dropped; padding makes 7 into 8."""
    cu = cu_from_lengths([7, 5])
    with pytest.raises(ValueError, match=r"document 0 has length 7.*multiple of 4.*Sharding\.eod_padded"):
        cpref.Sharding(cu, cp_size=2, layout="zigzag")
    sharding = cpref.Sharding.eod_padded(cu, cp_size=2, layout="zigzag")
    assert sharding.cu_seqlens_padded == (0, 8, 16)
    shards = [sharding.shard(sharding.pad(torch.arange(12)), r) for r in range(2)]
    assert torch.equal(sharding.unpad(sharding.unshard(shards)), torch.arange(12))


@pytest.mark.parametrize(
    "cu, kwargs, match",
    [
        ([0, 6, 12], dict(cp_size=4, rank=0, layout="zigzag"), r"document 0 has length 6, not a multiple of 8"),
        ([0, 8, 13], dict(cp_size=2, rank=0, layout="contiguous"), r"document 1 has length 5"),
        ([1, 8], dict(cp_size=1, rank=0, layout="zigzag"), r"start with 0"),
        ([0, 8, 8], dict(cp_size=1, rank=0, layout="zigzag"), r"strictly increasing: document 1"),
        ([0, 8], dict(cp_size=2, rank=2, layout="zigzag"), r"rank=2 is outside \[0, 2\)"),
        ([0, 8], dict(cp_size=2, rank=-1, layout="zigzag"), r"rank=-1 is outside"),
        ([0, 8], dict(cp_size=0, rank=0, layout="zigzag"), r"cp_size=0 is outside \[1, inf\)"),
        ([0, 8], dict(cp_size=2, rank=0, layout="ring"), r"unknown layout 'ring'"),
        ([0], dict(cp_size=1, rank=0, layout="zigzag"), r"at least one document"),
    ],
)
def test_bad_input_raises_value_error_naming_value_and_fix(cu, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cpref.batch.layout.global_index(cu, **kwargs)


def test_shard_rejects_token_count_mismatch():
    with pytest.raises(ValueError, match=r"x has shape \(10,\) but cu_seqlens ends at 8"):
        cpref.batch.layout.shard(torch.zeros(10), [0, 8], cp_size=2, rank=0, layout="zigzag")


@settings(max_examples=40, deadline=None)
@given(packed(layout="zigzag"))
def test_zigzag_causal_work_is_equal_on_every_rank(case):
    cu, P, _ = case
    work = [cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout="zigzag") for r in range(P)]
    if P == 1:  # without CP a document is one chunk, whole: n queries against their causal prefix
        assert work == [sum(n * n for n in (cu[1:] - cu[:-1]).tolist())]
        return
    c = ((cu[1:] - cu[:-1]) // (2 * P)).tolist()
    assert work == [(2 * P + 1) * sum(ci * ci for ci in c)] * P


@pytest.mark.parametrize("P", [2, 4, 8])
def test_contiguous_causal_work_grows_with_rank(P):
    cu = cu_from_lengths([4 * P, 2 * P])
    work = [cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout="contiguous") for r in range(P)]
    assert work == [(r + 1) * (16 + 4) for r in range(P)]
    non_causal = [cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout="contiguous", causal=False) for r in range(P)]
    assert non_causal == [4 * 4 * P + 2 * 2 * P] * P


def test_unshard_rejects_a_short_shard_naming_the_rank():
    # [0, 8] over P = 2 zigzag: every rank holds 8 / 2 = 4 tokens; rank 1 hands in only 3
    shards = [torch.zeros(4), torch.zeros(3)]
    with pytest.raises(ValueError, match=r"shard of rank 1 has 3 tokens, expected 4"):
        cpref.batch.layout.unshard(shards, [0, 8], layout="zigzag")


def test_bshd_thd_round_trip():
    x = torch.randn(3, 8, 2, 4)
    thd, cu = cpref.bshd_to_thd(x)
    assert thd.shape == (24, 2, 4) and cu.tolist() == [0, 8, 16, 24]
    assert torch.equal(thd[8:16], x[1])
    assert torch.equal(cpref.thd_to_bshd(thd, cu), x)
    with pytest.raises(ValueError, match="one"):
        cpref.thd_to_bshd(torch.zeros(12), [0, 4, 12])


@pytest.mark.parametrize("layout", CHUNKED_LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_chunk_owner_agrees_with_the_tokens_each_rank_holds(P, layout):
    """The one encoding of ownership (chunk_owner) matches what shard/global_index hand out."""
    mult = layout_multiple(layout, P)
    c = 2
    cu = cu_from_lengths([mult * c])
    for r in range(P):
        held = cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout=layout).tolist()
        for slot, j in enumerate(cpref.batch.layout.chunk_ids(r, P, layout)):
            assert cpref.batch.layout.chunk_owner(j, P, layout) == (r, slot)
            assert held[slot * c : (slot + 1) * c] == list(range(j * c, (j + 1) * c))


def exact_scores(cu, P, r, layout, causal=True):
    """Visible (query, key) pairs of rank r's queries, counted from the oracle's dense mask."""
    from sim.oracle import visibility_mask

    mask = visibility_mask(cu, causal=causal)  # (T, T)
    return int(mask[cpref.batch.layout.global_index(cu, cp_size=P, rank=r, layout=layout)].sum())


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_work_counts_the_visible_scores(P, layout):
    cu = cu_from_lengths([6 * P, 2 * P, 10 * P])
    for causal in (True, False):
        got = [cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout=layout, causal=causal, exact=True) for r in range(P)]
        assert got == [exact_scores(cu, P, r, layout, causal) for r in range(P)]


def test_block_and_exact_metrics_give_the_documented_contiguous_imbalance():
    """Block metric: 2P/(P+1) = 1.6 at P = 4; exact counts: (2P-1)/P = 1.75 for long documents."""
    P, c = 4, 1000
    cu = cu_from_lengths([P * c])
    for exact, want in ((False, 2 * P / (P + 1)), (True, (2 * P - 1) / P)):
        work = [cpref.batch.layout.attention_work(cu, cp_size=P, rank=r, layout="contiguous", exact=exact) for r in range(P)]
        assert max(work) / (sum(work) / P) == pytest.approx(want, rel=1e-3)
    zig_cu = cu_from_lengths([2 * P * c])
    zig = [cpref.batch.layout.attention_work(zig_cu, cp_size=P, rank=r, layout="zigzag", exact=True) for r in range(P)]
    assert len(set(zig)) == 1


def test_work_with_padding_counts_only_real_tokens():
    b = cpref.Boundaries.parse([0, 5, 12], [0, 8, 16])
    # zigzag P = 2, chunks of 2; doc 0 has 5 real tokens, doc 1 has 7
    for r in range(2):
        chunks = cpref.batch.layout.local_chunks(b, cp_size=2, rank=r, layout="zigzag")
        want = 0
        for d, s, e in chunks:
            n = b.real_len(d)
            want += sum(p + 1 for p in range(s - b.padded[d], e - b.padded[d]) if p < n)
        assert cpref.batch.layout.attention_work(b, cp_size=2, rank=r, layout="zigzag", exact=True) == want


def test_non_causal_work_with_padding_counts_only_real_keys():
    """Without the mask a real query sees the n real keys of its document, never its padding."""
    b = cpref.Boundaries.parse([0, 5, 12], [0, 8, 16])
    # zigzag P = 2, chunks of 2. Doc 0 (5 real), doc 1 (7 real).
    # rank 0 holds chunks 0, 3 = positions 0-1, 6-7: real queries 2 + 0 in doc 0, 2 + 1 in doc 1
    #   -> 2 * 5 + 3 * 7 = 31
    # rank 1 holds chunks 1, 2 = positions 2-5: real queries 2 + 1 in doc 0, 2 + 2 in doc 1
    #   -> 3 * 5 + 4 * 7 = 43   (together 5 * 5 + 7 * 7 = 74)
    got = [cpref.batch.layout.attention_work(b, cp_size=2, rank=r, layout="zigzag", causal=False) for r in range(2)]
    assert got == [31, 43]
    assert got == [cpref.batch.layout.attention_work(b, cp_size=2, rank=r, layout="zigzag", causal=False, exact=True) for r in range(2)]


def test_boundaries_report_padding_only_when_a_document_is_padded():
    assert not cpref.Boundaries.parse([0, 8, 16]).is_padded  # no padded list: both are equal
    assert not cpref.Boundaries.parse([0, 8, 16], [0, 8, 16]).is_padded
    assert cpref.Boundaries.parse([0, 5, 12], [0, 8, 16]).is_padded
    assert cpref.Boundaries.parse([0, 8, 15], [0, 8, 16]).is_padded  # only the last document padded


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stream"])
@pytest.mark.parametrize("P, a", [(4, 2), (8, 2), (8, 4), (6, 3), (4, 4)])
def test_groups_of_consecutive_ranks_hold_the_layout_over_fewer_ranks(layout, P, a):
    """The nesting a2a+p2p relies on: `a` consecutive ranks hold together exactly the tokens of the layout over
    `P / a` ranks (zigzag's two runs of chunks are its chunks g and 2p - 1 - g), in the same order."""
    mult = layout_multiple(layout, P)
    cu = cu_from_lengths([mult * 3, mult * 5 + (7 if layout == "stream" else 0), mult])
    if layout == "stream":
        cu[-1] += -int(cu[-1]) % P
    for g in range(P // a):
        got = cpref.batch.layout.group_chunks(cu, cp_size=P, group=a, g=g, layout=layout)
        want = cpref.batch.layout.global_index(cu, cp_size=P // a, rank=g, layout=layout if P > a else "contiguous")
        assert torch.cat([torch.arange(s, e) for _, s, e in got]).tolist() == want.tolist(), g
