"""The balanced layout's plan: what `cpref.balanced` guarantees, on random and built packs.

Exactness in every mode is in the suites parametrised over `cpref.LAYOUTS`; the traffic that
follows the plan (a whole document costs the ring nothing) is at the end.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpref
from cpref.balanced import TOLERANCE, balanced_pieces, piece_work
from cpref.seqlens import Boundaries
from sim.harness import trace_split
from tests.cp.conftest import run_cp
from tests.helpers import attention_inputs, cu_from_lengths

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=40)


def _docs_of(s: cpref.Sharding, r: int) -> dict[int, list[tuple[int, int]]]:
    """Rank r's real pieces per document, as positions inside the document."""
    out: dict[int, list[tuple[int, int]]] = {}
    for doc, a, z in s.local_chunks(r):
        a, z = a - s.cu_seqlens_padded[doc], min(z - s.cu_seqlens_padded[doc], s.cu_seqlens[doc + 1] - s.cu_seqlens[doc])
        if z > a:
            out.setdefault(doc, []).append((a, z))
    return out


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.sampled_from([2, 3, 4, 8]))
def test_every_rank_holds_the_same_tokens_and_every_token_is_held_once(lengths, P):
    s = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout="balanced")
    assert s.total - sum(lengths) < P  # padding only at the batch's end, less than P tokens
    assert all(len(s.global_index(r)) == s.local_tokens for r in range(P))
    assert torch.equal(torch.cat([s.global_index(r) for r in range(P)]).sort().values, torch.arange(s.total))
    for r in range(P):  # stream order: the rank's tokens ascend
        idx = s.global_index(r)
        assert bool((idx[1:] > idx[:-1]).all())


@settings(max_examples=40, deadline=None)
@given(lengths_st, st.sampled_from([2, 4, 8]))
def test_the_plan_depends_on_the_boundaries_and_p_alone(lengths, P):
    """Computed again from equal boundaries (a fresh Boundaries, the cache cleared), the plan is the same."""
    cu = cu_from_lengths(lengths).tolist()
    cu_padded = cpref.Sharding.eod_padded(cu, cp_size=P, layout="balanced").cu_seqlens_padded
    first = balanced_pieces(Boundaries.parse(cu, cu_padded), P)
    balanced_pieces.cache_clear()
    assert balanced_pieces(Boundaries.parse(list(cu), list(cu_padded)), P) == first


def test_a_long_document_is_cut_in_zigzag_pairs_and_the_short_ones_stay_whole():
    """One document of 250 tokens among 60 of 20 over 4 ranks: its work is 2.85 times a rank's share, so it is
    cut in zigzag pairs, first over 3 ranks, which leaves them too little room for the short documents that
    would balance the fourth, so over all 4 (rank r: chunks r and 2P - 1 - r, equal to a token); on top of it
    the short documents balance the ranks whole."""
    P, lengths = 4, [250] + [20] * 60
    s = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout="balanced")
    held = [_docs_of(s, r) for r in range(P)]
    sizes = [250 // (2 * P) + (j < 250 % (2 * P)) for j in range(2 * P)]  # 2P chunks as equal as integers allow
    starts = [sum(sizes[:j]) for j in range(2 * P)]
    chunk = [(starts[j], starts[j] + sizes[j]) for j in range(2 * P)]
    want = [[chunk[r], chunk[2 * P - 1 - r]] for r in range(P)]
    want[-1] = [(chunk[P - 1][0], chunk[P][1])]  # the middle pair is one piece: chunks P - 1 and P are adjacent
    assert [h[0] for h in held] == want
    whole = [doc for doc in range(1, len(lengths)) if sum(doc in h for h in held) == 1]
    assert len(whole) == len(lengths) - 1  # here every short document fits whole somewhere
    load = [s.attention_work(r, exact=True) for r in range(P)]
    assert max(load) <= (1 + TOLERANCE) * sum(load) / P


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=60), st.sampled_from([2, 3, 4, 8]))
@example([17, 33], 4)  # the second cut once found no 4 ranks with room for a share of ceil(17 / 4): it must fit
def test_the_largest_rank_is_within_the_tolerance_or_every_document_is_zigzag(lengths, P):
    """The plan's work guarantee: the largest rank's causal work is at most (1 + TOLERANCE) times the mean, or
    the plan cut every document (then each rank holds chunks r and 2P - 1 - r of each, zigzag's balance)."""
    s = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout="balanced")
    load = [s.attention_work(r, exact=True) for r in range(P)]
    assert sum(load) == sum(piece_work(0, n) for n in lengths)
    if max(load) > (1 + TOLERANCE) * sum(load) / P:
        for doc, n in enumerate(lengths):  # two chunks of 2P, as equal as integers allow
            for r in range(P):
                got = sum(z - a for a, z in _docs_of(s, r).get(doc, []))
                assert 2 * (n // (2 * P)) <= got <= 2 * (n // (2 * P)) + 2, (doc, r)


def test_only_the_heaviest_documents_are_cut_and_over_few_ranks():
    """Of a long-tailed pack, the documents cut in zigzag pairs are the heaviest ones (a prefix in decreasing
    work), few of them, some over fewer than P ranks; every other document sits on one rank or was filled
    into the last room (at most one a rank)."""
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randn(80, generator=g).add(6.2).exp().round().clamp(4, 60000)]
    P = 8
    s = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout="balanced")
    held = [_docs_of(s, r) for r in range(P)]
    spread = [sum(doc in h for h in held) for doc in range(len(lengths))]
    zigzag = [doc for doc in range(len(lengths)) if any(len(h.get(doc, [])) == 2 for h in held)]  # chunks 0, 2k - 1
    order = sorted(range(len(lengths)), key=lambda i: (-piece_work(0, lengths[i]), i))
    assert sorted(zigzag) == sorted(order[: len(zigzag)]) and 0 < len(zigzag) < len(lengths) // 4
    assert any(spread[doc] < P for doc in zigzag)  # a cut over a sub-group: fewer ranks exchange it
    assert sum(k > 1 for k in spread) <= len(zigzag) + P


@pytest.mark.parametrize("mode", sorted(cpref.MODES))
def test_documents_held_whole_cost_nothing(mode):
    """Eight documents of 16 over four ranks: two whole documents a rank, nothing cut, so nothing travels (the
    chunked layouts would move every document's K/V); a2a+p2p's exchange level still moves its groups' tokens,
    but its ring sends nothing."""
    P = 4
    s = cpref.Sharding(cu_from_lengths([16] * 8), cp_size=P, layout="balanced")
    assert all(len(_docs_of(s, r)) == 2 and all(p == [(0, 16)] for p in _docs_of(s, r).values()) for r in range(P))
    q, k, v, dout = attention_inputs(s.total, (4, 2, 8, 8))
    _, cluster = run_cp(q, k, v, dout, s, mode=mode, check_ranks=False, between=lambda comm: comm.barrier(),
                        **cpref.MODES[mode].example_options(P))  # fmt: skip
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        if mode == "a2a+p2p":
            assert "send_recv" not in fwd_ops and "send_recv" not in bwd_ops, r
        else:
            assert (fwd, fwd_ops, bwd, bwd_ops) == (0, {}, 0, {}), r
