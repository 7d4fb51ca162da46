"""The stream layout: the batch cut into P equal pieces, documents straddling ranks.

Exactness in every mode, P and mask is in the suites parametrised over `cpref.LAYOUTS`
(test_every_mode, test_modes, test_windows); here: what stream moves, what it costs in work,
and the piece plans checked against the chunked layouts' direct arithmetic.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.api import mode_costs
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.kernels.contract import NO_WINDOW
from cpref.modes.all_gather_pieces import build_piece_all_gather_plan
from cpref.modes.all_gather_plan import build_all_gather_plan
from sim.cluster.harness import trace_split
from tests.cp.conftest import CountingKernel, run_cp
from tests.helpers import attention_inputs, cu_from_lengths, expected_costs

HEADS = (4, 2, 8, 8)


def test_a_stream_rank_holds_one_contiguous_piece_of_the_batch():
    """Rank r holds tokens [r T / P, (r + 1) T / P), cut at the document boundaries, and positions restart at them."""
    s = cpref.Sharding.eod_padded([0, 5, 17, 30], cp_size=4, layout="stream")  # the last document padded to 32
    assert s.cu_seqlens_padded == (0, 5, 17, 32)
    assert [s.local_chunks(r) for r in range(4)] == [[(0, 0, 5), (1, 5, 8)], [(1, 8, 16)], [(1, 16, 17), (2, 17, 24)],
                                                     [(2, 24, 32)]]  # fmt: skip
    assert s.positions(2).tolist() == [11, 0, 1, 2, 3, 4, 5, 6]
    assert torch.equal(torch.cat([s.global_index(r) for r in range(4)]), torch.arange(32))


@pytest.mark.parametrize("mode", ["p2p", "a2a+p2p"])
def test_the_ring_sends_nothing_when_no_document_straddles_ranks(mode):
    """Documents that each sit on one rank (of the P ranks, or of the P / a groups) are attended to at home:
    the ring level sends nothing at all, forward or backward."""
    P = 4
    sharding = cpref.Sharding(cu_from_lengths([10, 6, 16, 8, 8, 16]), cp_size=P, layout="stream")  # T_l = 16
    q, k, v, dout = attention_inputs(sharding.total, HEADS)
    _, cluster = run_cp(q, k, v, dout, sharding, mode=mode, check_ranks=False, between=lambda comm: comm.barrier(),
                         **cpref.MODES[mode].example_options(P))  # fmt: skip
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert "send_recv" not in fwd_ops and "send_recv" not in bwd_ops, (r, fwd_ops, bwd_ops)


def test_the_ring_sends_only_the_straddling_document_rows_their_readers_see():
    """One document straddles ranks 1 to 3 and the others sit on one rank: rank r reads, of each rank before it,
    only the rows of that document; bytes per rank are the halo formula of the plan's sizes, exactly."""
    P = 4
    sharding = cpref.Sharding(cu_from_lengths([16, 4, 36, 8]), cp_size=P, layout="stream")  # doc 2: [20, 56)
    q, k, v, dout = attention_inputs(sharding.total, HEADS)
    _, cluster = run_cp(q, k, v, dout, sharding, mode="p2p", check_ranks=False, between=lambda comm: comm.barrier())
    from cpref.modes.ring_window import build_window_ring_plan

    plans = [build_window_ring_plan(sharding.bounds, P, r, "stream", True, NO_WINDOW, torch.device("cpu")) for r in range(P)]
    assert plans[0].halo.shifts == (0, 1, 2)  # rank 3 reads from ranks 2 and 1; nothing is 3 ranks back
    # rank 1 sends rank 2 (d = 1) and rank 3 (d = 2) its 12 rows of document 2; rank 2 sends rank 3 its 16
    assert [len(x) for x in plans[1].halo.send[1:]] == [12, 12] and [len(x) for x in plans[2].halo.send[1:]] == [16, 0]
    assert plans[0].halo.sizes == (0, 16, 12)
    want = expected_costs("p2p", sharding, HEADS, torch.float64)
    for r in range(P):
        (fwd, _), (bwd, _) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), r
    row = HEADS[1] * (HEADS[2] + HEADS[3]) * 8
    assert want.forward_bytes == (16 + 12) * row  # of the classic ring's (P - 1) T_l = 48 rows


@pytest.mark.parametrize("layout", ["stream", "balanced"])
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_moves_only_the_rows_other_ranks_read(layout, causal):
    """Bytes and collectives of all_gather per rank are the formula with the plan's gathered rows, exactly; the
    gathered rows are those of documents held by more than one rank (the most any rank shares), not the shard."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([8] * 10 + [40] + [8] * 10), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS)
    _, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    want = expected_costs("all_gather", sharding, HEADS, torch.float64, causal)
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), r
        assert (fwd_ops, bwd_ops) == (dict(want.forward_ops), dict(want.backward_ops)), r
    whole = mode_costs("all_gather", P=P, local_tokens=sharding.local_tokens, heads=HEADS, dtype=torch.float64)
    # balanced: only the document of 40 is cut (10 rows a rank). stream (ranks of 50 tokens): rank 1 holds 20 rows
    # of it that rank 2 reads; without a causal mask rank 2 shares 26, its 20 of it and 6 of a document of 8
    rows = 10 if layout == "balanced" else (20 if causal else 26)
    assert want.forward_bytes == whole.forward_bytes * rows // sharding.local_tokens


@pytest.mark.parametrize("layout", ["stream", "balanced"])
def test_a2a_exchanges_only_the_documents_that_span_ranks(layout):
    """Ulysses over stream or balanced: the documents held whole stay home (all heads, one call), the others take
    the exchange padded to the most any rank has; bytes and collectives are the formula's, exactly, and the
    saved bytes at most its bound, on every rank."""
    from sim.cluster.harness import saved_bytes

    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([8] * 10 + [40] + [8] * 10), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS)
    kernels = [CountingKernel() for _ in range(P)]
    _, cluster = run_cp(q, k, v, dout, sharding, mode="a2a", check_ranks=False, kernels=kernels,
                        between=lambda comm: comm.barrier())  # fmt: skip
    want = expected_costs("a2a", sharding, HEADS, torch.float64)
    saved = saved_bytes(q, k, v, sharding, mode="a2a", check_ranks=False)
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), r
        assert (fwd_ops, bwd_ops) == (dict(want.forward_ops), dict(want.backward_ops)), r
        assert saved[r] <= want.saved_bytes, r
        assert kernels[r].forward_calls == 2  # the documents held here, and the shared ones
    whole = mode_costs("a2a", P=P, local_tokens=sharding.local_tokens, heads=HEADS, dtype=torch.float64)
    assert 0 < want.forward_bytes < whole.forward_bytes


@pytest.mark.parametrize("layout", ["stream", "balanced"])
@pytest.mark.parametrize(("P", "a"), [(4, 2), (8, 2), (8, 4)])
def test_a2a_p2p_exchanges_and_rings_only_the_documents_that_span_ranks(layout, P, a):
    """The hierarchy over stream or balanced: the documents held whole stay home (all heads, one call), the others
    take the exchange inside the group padded to the most any rank has, then a ring over the groups of those rows
    only; bytes and collectives are the formula's with the plan's rows and shifts, exactly, the saved bytes at
    most its bound, on every rank, and the traffic below the unsplit hierarchy's: under half of it with balanced
    (stream's ranks work unevenly, and exchange some of their whole documents for balance: `exchanged_docs`)."""
    from sim.cluster.harness import saved_bytes

    sharding = cpref.Sharding.eod_padded(cu_from_lengths([8] * 40 + [60] + [8] * 60 + [90]), cp_size=P, layout=layout)
    heads = (8, 2, 8, 8)
    q, k, v, dout = attention_inputs(sharding.total, heads)
    kernels = [CountingKernel() for _ in range(P)]
    _, cluster = run_cp(q, k, v, dout, sharding, mode="a2a+p2p", a2a_size=a, check_ranks=False, kernels=kernels,
                        between=lambda comm: comm.barrier())  # fmt: skip
    saved = saved_bytes(q, k, v, sharding, mode="a2a+p2p", a2a_size=a, check_ranks=False)
    for r in range(P):
        want = mode_costs("a2a+p2p", sharding, heads=heads, dtype=torch.float64, rank=r, a2a_size=a)
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), r
        assert (fwd_ops, bwd_ops) == (dict(want.forward_ops), dict(want.backward_ops)), r
        assert saved[r] <= want.saved_bytes, r
    from cpref.modes.ring_window import build_window_ring_plan  # the unsplit hierarchy: every row exchanged

    ring = build_window_ring_plan(sharding.bounds, P // a, 0, layout, True, NO_WINDOW, torch.device("cpu"), a)
    whole = mode_costs("a2a+p2p", P=P, local_tokens=sharding.local_tokens, heads=heads, dtype=torch.float64,
                       a2a_size=a, halo_sizes=ring.halo.sizes)  # fmt: skip
    assert 0 < want.forward_bytes < whole.forward_bytes / (2 if layout == "balanced" else 1)


def test_stream_work_is_unbalanced_as_contiguous_for_one_document():
    """On one document stream is contiguous (the same pieces), so its causal work grows with the rank."""
    cu = cu_from_lengths([64])
    stream, contiguous = (cpref.Sharding(cu, cp_size=4, layout=lay) for lay in ("stream", "contiguous"))
    assert [stream.local_chunks(r) for r in range(4)] == [contiguous.local_chunks(r) for r in range(4)]
    work = [stream.attention_work(r, exact=True) for r in range(4)]
    assert work == sorted(work) and work[-1] > 3 * work[0]


def _visible_tokens(plan, causal: bool, source) -> list[list[int]]:
    """For each local query row, the global tokens its sequence lets it see (`source[row]`: the token of a
    row of the buffer `kv_index` points into)."""
    seqs, out = plan.seqs, []
    for i, (q0, q1, k0, _k1) in enumerate(seqs.pairs()):
        for x in range(q1 - q0):
            lo, hi = seqs.visible(i, x, causal, plan.window)
            out.append(sorted(source[plan.kv_index[k0 + lo : k0 + hi]].tolist()) if hi > lo else [])
    return out


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(CHUNKED_LAYOUTS), st.sampled_from([2, 3, 4]), st.lists(st.integers(1, 5), min_size=1, max_size=4),
       st.booleans(), st.sampled_from([NO_WINDOW, (2, 0), (5, 3), (0, 0)]), st.booleans())  # fmt: skip
def test_the_piece_plan_selects_what_the_rfc_indexing_selects(layout, P, units, causal, window, padded):
    """The all-gather plan written on pieces (what stream and balanced run: the local shard, then the rows others
    read) and the RFC's chunk arithmetic (the rank-major buffer of the chunked layouts) give every query row the
    same visible tokens, on every rank."""
    window = (window[0], 0) if causal and window != NO_WINDOW else window
    mult = cpref.batch.layout.layout_multiple(layout, P)
    lengths = [n * mult - (1 if padded and n * mult > 1 else 0) for n in units]
    s = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout)
    index = [s.global_index(r) for r in range(P)]
    pieces = [build_piece_all_gather_plan(s.bounds, P, r, layout, causal, torch.device("cpu"), window) for r in range(P)]
    m = pieces[0].gathered_rows
    gathered = torch.cat([torch.cat([index[o][p.shared], torch.full((m - len(p.shared),), -1)]) for o, p in enumerate(pieces)])
    for r in range(P):
        rfc = build_all_gather_plan(s.bounds, P, r, layout, causal, torch.device("cpu"), window)
        want = _visible_tokens(rfc, causal, torch.cat(index))  # rank-major
        assert _visible_tokens(pieces[r], causal, torch.cat([index[r], gathered])) == want, r


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("window", [NO_WINDOW, (6, 0)], ids=["causal", "window"])
@pytest.mark.parametrize("layout", ["stream", "balanced"])
@pytest.mark.parametrize(("P", "heads", "groups"), [(2, (4, 2, 8, 8), 1), (2, (8, 4, 8, 8), 2), (4, (8, 4, 8, 8), 1)],
                         ids=["P2", "P2-head_groups=2", "P4"])  # fmt: skip
def test_one_a2a_group_is_ulysses_split_one_kernel_call_on_the_gathered_block(P, heads, groups, layout, window, dtype):
    """a2a_size = P: the ring across the groups has one member, so its plan is one call that reads the gathered
    block as it is (rows no sequence reads become keys of sequences without queries, as Ulysses' padding keys):
    no halo, no `index_select` of the block, the output saved in the input dtype. It is then Ulysses' split, bit
    for bit (outputs, gradients, saved bytes) and call for call, in head groups too (the piece plan made the
    same call over a copy of the block and merged it in float32: bf16 saved twice the output's bytes)."""
    from cpref.modes.hierarchical_split import build_split_hierarchical_plan
    from sim.cluster.harness import saved_bytes

    sharding = cpref.Sharding.eod_padded(cu_from_lengths([5, 30, 3, 41, 17, 9]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, heads, dtype=dtype)
    runs = {}
    for mode, options in (("a2a", {"head_groups": groups}), ("a2a+p2p", {"a2a_size": P, "head_groups": groups})):
        kernels = [CountingKernel() for _ in range(P)]
        results, _ = run_cp(q, k, v, dout, sharding, mode=mode, window=window, kernels=kernels, check_ranks=False,
                            **options)  # fmt: skip
        calls = [(kern.forward_calls, kern.backward_calls) for kern in kernels]
        saved = saved_bytes(q, k, v, sharding, mode=mode, window=window, check_ranks=False, **options)
        runs[mode] = results, calls, saved
    (want, want_calls, want_saved), (got, got_calls, got_saved) = runs["a2a"], runs["a2a+p2p"]
    assert got_calls == want_calls and got_saved == want_saved
    for r, (a, b) in enumerate(zip(got, want)):
        for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
            assert torch.equal(x, y), (r, name)
    for r in range(P):
        plan = build_split_hierarchical_plan(sharding.bounds, P, r, layout, P, heads[0], heads[1], True, window,
                                             torch.device("cpu"))  # fmt: skip
        if plan.rows:
            (call,) = plan.ring.steps[0].calls
            assert plan.ring.whole_rows and call.kv_index is None and call.window == window
            assert call.seqs.total_q == call.seqs.total_kv == P * plan.rows  # the gathered block, every row


def test_a_call_over_some_rows_of_a_block_is_rewritten_to_read_the_block_as_it_is():
    """The ring of one's rewrite: rows no sequence reads become keys of sequences without queries, in place; shifts
    kept where they are not the bottom-right ones (None in, bottom-right out); runs out of order are refused."""
    from cpref.kernels import Varlen
    from cpref.modes.ring_window import reading_the_block

    seqs = Varlen.from_lengths([3, 4, 2], [3, 0, 5])  # bottom-right (the last: shift 3); the middle sees no key
    got = reading_the_block(seqs, torch.tensor([1, 2, 3, 6, 7, 8, 9, 10]), 12)
    assert (got.cu_q, got.cu_kv, got.shifts) == ((0, 0, 3, 7, 7, 9, 9), (0, 1, 4, 4, 6, 11, 12), None)
    assert got.work(True) == seqs.work(True)
    shifted = Varlen.from_lengths([2, 2], [4, 2], [1, 0])  # the first query stands at key 1, not 2
    got = reading_the_block(shifted, torch.tensor([0, 1, 2, 3, 4, 5]), 6)
    assert (got.cu_kv, got.shifts) == ((0, 4, 6), (1, 0)) and got.work(True) == shifted.work(True)
    assert reading_the_block(Varlen.from_lengths([1, 1], [1, 1]), torch.tensor([3, 0]), 4) is None


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.sampled_from([2, 3, 4, 8]),
       st.sampled_from(cpref.LAYOUTS), st.integers(-1, 40), st.integers(-1, 15), st.booleans(),
       st.sampled_from([None, 5, 16]))  # fmt: skip
def test_the_shared_rows_are_the_union_of_every_other_ranks_reads(lengths, P, layout, left, right, causal, chunk):
    """`piece_reads`' shared rows (runs of one owner's pieces, linear in the pieces) against the union of the rows
    every other rank's reads list (the quadratic way they replaced), and `piece_sequences` against the reads' counts:
    in every layout, under windows, chunks, full causal and no causal mask."""
    from cpref.modes.all_gather_pieces import piece_reads, piece_sequences

    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout)
    window = (left, 0 if causal else right) if left >= 0 or right >= 0 else NO_WINDOW
    every, shared, m = piece_reads(sharding.bounds, P, layout, causal, window, chunk)
    wanted = [set() for _ in range(P)]
    for r in range(P):
        for _, _, spans, _ in every[r]:
            for o, r0, r1 in spans:
                if o != r:
                    wanted[o].update(range(r0, r1))
    assert [x.tolist() for x in shared] == [sorted(w) for w in wanted]
    assert m == max(len(w) for w in wanted)
    counted = [[(n_q, sum(r1 - r0 for _, r0, r1 in spans), shift) for n_q, _, spans, shift in every[r]
                if n_q and spans] for r in range(P)]  # fmt: skip
    assert piece_sequences(sharding.bounds, P, layout, causal, window, chunk) == counted
    assert piece_reads(sharding.bounds, P, layout, causal, window, chunk, ranks=(1,))[0] == {1: every[1]}
