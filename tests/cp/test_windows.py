"""Sliding-window attention (issue 20): one definition (the oracle's), exact in the modes that take it,
with work that follows the window, and refused by name where it is not built yet."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.kernels import TorchKernel, Varlen
from sim import oracle
from sim.cluster.simcluster import SimCluster
from tests.cp.conftest import CountingKernel, oracle_shards, run_cp
from tests.helpers import (
    assert_close,
    attention_inputs,
    cu_from_lengths,
    expected_costs,
    only_the_comparison,
    random_qkv,
)

WINDOWED = [name for name, spec in cpref.MODES.items() if spec.windows]
HEADS = {"gqa": (8, 2, 8, 8), "mla": (8, 2, 12, 8)}  # (Hq, Hkv, D, Dv): a2a splits them at P = 2, 4, 8
NAMES = ("out", "dq", "dk", "dv")


def windows(chunk: int, doc: int, causal: bool) -> list[tuple[int, int]]:
    """0, 1, smaller than a chunk, about a chunk, larger than a document; asymmetric without causal."""
    lefts = [0, 1, chunk // 2, chunk, chunk + 1, doc + 5]
    if causal:
        return [(w, 0) for w in lefts]
    return [(w, w) for w in lefts[:3]] + [(chunk, 1), (0, chunk + 1), (-1, 2), (3, -1)]


@pytest.mark.sweep
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("mode", WINDOWED)
def test_every_windowed_mode_matches_the_oracle_rank_by_rank(mode, P, layout, causal, heads):
    """Padded documents (the last one shorter than a chunk), every window of `windows`, FP64 at 1e-10."""
    lengths = [6 * P, 11 * P - 3, P + 1]
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout)
    chunk = sharding.cu_seqlens_padded[1] // (2 * P if layout == "zigzag" else P)
    q, k, v, dout = attention_inputs(sharding.total, HEADS[heads], seed=P)
    for window in windows(chunk, max(lengths), causal):
        results, _ = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, window=window,
                            **cpref.MODES[mode].example_options(P))  # fmt: skip
        refs = oracle_shards(q, k, v, dout, sharding, causal=causal, window=window)
        for r, (got, want) in enumerate(zip(results, refs)):
            for name, a, b in zip(NAMES, got, want):
                assert_close(a, b, torch.float64, msg=f"{mode} P={P} {layout} window={window} rank {r} {name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
def test_all_gather_selects_and_computes_only_what_the_window_sees(layout, causal):
    """The kernel's keys per query chunk are the window's span (block metric), and the scores it computes
    are the visible pairs (exact count), rank by rank: no key row outside any query's window is selected."""
    P, window = 4, (5, 0) if causal else (5, 3)
    sharding = cpref.Sharding(cu_from_lengths([64, 32, 96]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal, window=window, kernels=kernels)
    for r in range(P):
        _, seqs, _, used = next(c for c in kernels[r].calls if c[0] == "forward")
        assert used == window
        assert kernels[r].forward_work() == sharding.attention_work(r, causal=causal, exact=True, window=window)
        block = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in seqs.pairs())
        assert block == sharding.attention_work(r, causal=causal, window=window)
    full = sum(sharding.attention_work(r, causal=causal, exact=True) for r in range(P))
    assert sum(sharding.attention_work(r, causal=causal, exact=True, window=window) for r in range(P)) * 4 < full


def test_a_causal_window_balances_the_contiguous_layout():
    """With w much smaller than a chunk every query past the first w sees w + 1 keys: contiguous is balanced
    to within the first w positions of each document, where zigzag no longer helps."""
    P, w = 4, 7
    sharding = cpref.Sharding(cu_from_lengths([512, 256]), cp_size=P, layout="contiguous")
    work = [sharding.attention_work(r, exact=True, window=(w, 0)) for r in range(P)]
    assert max(work) == (sharding.local_tokens) * (w + 1)  # a rank whose chunks start past position w
    assert min(work) == max(work) - 2 * w * (w + 1) // 2  # rank 0: the first w positions of both documents


@pytest.mark.parametrize("window, causal, match", [
    ((3,), True, r"window=\(3,\) is not a pair"),
    ("34", True, r"is not a pair"),
    ((3, -2), False, r"right=-2 is not an int >= -1"),
    ((1.5, 0), True, r"left=1\.5 is not an int >= -1"),
    ((True, 0), True, r"left=True is not an int >= -1"),
    ((4, 1), True, r"with causal=True.*right must be 0 or -1.*causal=False"),
])  # fmt: skip
def test_a_bad_window_fails_on_every_rank_before_any_communication(window, causal, match):
    sharding = cpref.Sharding([0, 16], cp_size=2)
    q, k, v = random_qkv(16, 4, 2, 8)
    local = [[sharding.shard(t, r) for t in (q, k, v)] for r in range(2)]

    def rank_fn(comm):
        try:
            cpref.attention(*local[comm.rank], sharding, comm=comm, mode="all_gather", causal=causal, window=window)
        except cpref.CPInputError as e:
            return str(e)
        return None

    cluster = SimCluster(2, timeout=10.0)
    errors = cluster.run(rank_fn)
    assert all(e is not None and re.search(match, e) for e in errors), errors
    assert only_the_comparison(cluster.trace)


def test_ranks_that_pass_different_windows_are_named():
    sharding = cpref.Sharding([0, 16], cp_size=2)
    q, k, v = random_qkv(16, 4, 2, 8)
    local = [[sharding.shard(t, r) for t in (q, k, v)] for r in range(2)]

    def rank_fn(comm):
        window = (3, 0) if comm.rank == 0 else (4, 0)
        try:
            cpref.attention(*local[comm.rank], sharding, comm=comm, mode="all_gather", window=window)
        except cpref.CPInputError as e:
            return str(e)

    errors = SimCluster(2, timeout=10.0).run(rank_fn)
    assert all(e is not None and "window: rank 0: digest" in e for e in errors), errors


def test_a_mode_that_declares_no_windows_refuses_one_by_name(monkeypatch):
    """A mode declares whether it takes a window; one that does not is refused before any communication."""
    import dataclasses
    from types import MappingProxyType

    import cpref.api

    modes = dict(cpref.api.MODES)
    modes["p2p"] = dataclasses.replace(modes["p2p"], windows=False)
    monkeypatch.setattr(cpref.api, "MODES", MappingProxyType(modes))
    sharding = cpref.Sharding([0, 16], cp_size=2)
    q, k, v = random_qkv(16, 4, 2, 8)
    local = [[sharding.shard(t, r) for t in (q, k, v)] for r in range(2)]
    takes = [m for m in modes if m != "p2p"]

    def rank_fn(comm):
        with pytest.raises(cpref.CPInputError, match=re.escape("mode='p2p' does not take a sliding window yet") + ".*"
                           + re.escape(str(takes))):  # fmt: skip
            cpref.attention(*local[comm.rank], sharding, comm=comm, mode="p2p", window=(3, 0))

    cluster = SimCluster(2, timeout=10.0)
    cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace)


def test_no_window_is_the_call_without_one():
    """window=(-1, -1) is the default: bitwise the same outputs and the same plan as not passing it."""
    sharding = cpref.Sharding(cu_from_lengths([16, 48]), cp_size=4)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    for mode in cpref.MODES:
        options = cpref.MODES[mode].example_options(4)
        plain, _ = run_cp(q, k, v, dout, sharding, mode=mode, **options)
        given, _ = run_cp(q, k, v, dout, sharding, mode=mode, window=(-1, -1), **options)
        assert all(torch.equal(a, b) for x, y in zip(plain, given) for a, b in zip(x, y)), mode


# --- the kernel contract ------------------------------------------------------------------------

def shifted_oracle(q, k, v, dout, q_pos, k_pos, causal, window):
    """Dense FP64 attention of queries at positions `q_pos` over keys at `k_pos` (one sequence), masked by
    the contract's rule `p - left <= y <= p + right` (right = 0 under causal), with autograd's gradients."""
    left, right = window
    right = 0 if causal else right
    ok = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if left >= 0:
        ok &= k_pos[None, :] >= q_pos[:, None] - left
    if right >= 0:
        ok &= k_pos[None, :] <= q_pos[:, None] + right
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("xhd,yhd->hxy", q64, k64.repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("hxy,yhd->xhd", p, v64.repeat_interleave(g, 1))
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), grads


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("budget", [2**24, 48])
def test_the_kernel_masks_windows_and_shifts_as_the_contract_says(fast, budget):
    """Two sequences with explicit shifts (keys that start before, and end after, their queries), every
    window, causal or not: the kernel (explicit path, small blocks too, and the fused path) against a dense
    oracle of the contract's rule. Rows that see no key come out 0 with zero gradients."""
    kernel = TorchKernel(fast=fast, max_block_elements=budget)
    q, k, v = random_qkv(13, 4, 2, 8)
    k, v = random_qkv(17, 2, 2, 8, seed=1)[1:]
    dout = random_qkv(13, 4, 4, 8, seed=2)[0]
    seqs = Varlen([0, 6, 13], [0, 10, 17], shifts=[5, -2])  # query 0 of sequence 0 at key 5; of sequence 1 at key -2
    for causal in (True, False):
        for window in [(-1, -1), (0, 0), (2, 0), (2, 1), (-1, 1), (3, -1), (9, 9)]:
            if causal and window[1] > 0:
                continue
            out, lse = kernel.forward(q, k, v, seqs, causal=causal, scale=8**-0.5, window=window)
            grads = kernel.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=8**-0.5, window=window)
            for (q0, q1, k0, k1), shift in zip(seqs.pairs(), seqs.shifts):
                want, want_grads = shifted_oracle(q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1],
                                                  torch.arange(q1 - q0) + shift, torch.arange(k1 - k0), causal, window)
                assert_close(out[q0:q1], want, torch.float64, msg=f"{window} causal={causal}")
                for got, ref, rows in zip(grads, want_grads, (slice(q0, q1), slice(k0, k1), slice(k0, k1))):
                    assert_close(got[rows], ref, torch.float64, msg=f"grad {window} causal={causal}")


def test_the_contract_counts_the_visible_scores():
    seqs = Varlen([0, 4], [0, 6], shifts=[1])  # queries at keys 1, 2, 3, 4
    assert seqs.work(True, (1, 0)) == 2 * 4  # each sees itself and the key before
    assert seqs.work(False, (0, 2)) == 3 + 3 + 3 + 2  # the last sees keys 4, 5 only
    assert seqs.work(True) == 2 + 3 + 4 + 5 and Varlen([0, 4], [0, 6]).work(True) == 3 + 4 + 5 + 6


def test_the_oracle_window_is_the_band_of_the_definition():
    cu = torch.tensor([0, 5, 8])
    m = oracle.visibility_mask(cu, causal=False, window=(1, 2))
    assert m[2].tolist() == [False, True, True, True, True, False, False, False]  # keys 1 .. 4 of document 0
    assert m[6].tolist() == [False] * 5 + [True, True, True]  # document 1: keys 5 .. 7, never across
    causal = oracle.visibility_mask(cu, causal=True, window=(1, -1))
    assert torch.equal(causal, oracle.visibility_mask(cu, causal=False, window=(1, 0)))


@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_window_work_formula_counts_the_oracle_mask(layout, causal):
    """`attention_work(..., window=, exact=True)` is the number of visible pairs of the oracle's mask, rank by
    rank, padding included (padding sees nothing and is seen by nothing)."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([40, 13, 72]), cp_size=P, layout=layout)
    for window in ([(0, 0), (3, 0), (9, 0), (100, 0)] if causal else [(0, 0), (3, 5), (-1, 4), (6, -1)]):
        mask = oracle.visibility_mask(torch.tensor(sharding.cu_seqlens), causal=causal, window=window)  # (T_real, T_real)
        real_index = sharding.unpad(torch.arange(sharding.total))  # padded-stream index of every real token
        where = torch.full((sharding.total,), -1).index_put_((real_index,), torch.arange(len(real_index)))
        for r in range(P):
            mine = where[sharding.global_index(r)]
            count = int(mask[mine[mine >= 0]].sum())
            assert sharding.attention_work(r, causal=causal, exact=True, window=window) == count, (window, r)


# --- traffic follows the window -----------------------------------------------------------------

RING_MODES = ["p2p", "a2a+p2p"]


@pytest.mark.sweep
@pytest.mark.parametrize("mode", RING_MODES)
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("window, causal", [((3, 0), True), ((12, 0), True), ((40, 0), True), ((5, 5), False), ((0, 0), False)])
def test_the_ring_moves_what_the_halo_formula_says(mode, layout, window, causal):
    """Per rank, forward and backward: the bytes and collectives of the trace are `halo_costs` of the plan's
    sizes exactly, and the ring runs only the distances the window reaches."""
    from cpref.modes.ring_window import window_distances
    from sim.cluster.harness import trace_split

    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([64, 40, 96]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8), dtype=torch.bfloat16)
    _, cluster = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, window=window, check_ranks=False,
                        between=lambda comm: comm.barrier(), **cpref.MODES[mode].example_options(P))  # fmt: skip
    want = expected_costs(mode, sharding, (4, 2, 8, 8), torch.bfloat16, causal, window)
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), f"rank {r}"
        assert (fwd_ops, bwd_ops) == (dict(want.forward_ops), dict(want.backward_ops)), f"rank {r}"
    a = cpref.MODES[mode].example_options(P).get("a2a_size", 1)
    distances = window_distances(sharding.bounds, P // a, layout, causal, window, a)
    assert dict(want.forward_ops).get("send_recv", 0) == len(distances)  # one shift per distance the window reaches


def test_zigzag_under_a_window_within_a_chunk_exchanges_halos_with_both_neighbours():
    """Zigzag, a causal window of w <= c keys back: the front chunk reads the rank before, the back chunk the
    rank after, so exactly two shifts (distances 1 and P - 1) of w rows per document each, not a relay round
    the ring through every rank between."""
    from sim.cluster.harness import trace_split

    P, w, docs = 4, 3, [64, 32, 96]  # zigzag chunks of 8, 4, 12 rows: w fits in each
    sharding = cpref.Sharding(cu_from_lengths(docs), cp_size=P, layout="zigzag")
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    _, cluster = run_cp(q, k, v, dout, sharding, mode="p2p", window=(w, 0), check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    row = 2 * (8 + 8) * 8  # Hkv (D + Dv) float64 bytes
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert fwd_ops == {"send_recv": 2} and fwd == 2 * len(docs) * w * row, r
        assert bwd_ops == {"send_recv": 4} and bwd == 2 * fwd, r  # the halos again, and their dK/dV home
    fwd_shifts = [ev.param for ev in cluster.trace if ev.op == "send_recv"][:2]
    assert fwd_shifts == ["shift=1", f"shift={P - 1}"]  # straight to the neighbour on each side


@pytest.mark.sweep
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("window, causal", [((3, 0), True), ((12, 0), True), ((40, 0), True), ((5, 5), False),
                                            ((2, 30), False), ((-1, 4), False)])  # fmt: skip
def test_every_row_a_rank_receives_is_read_by_it(layout, window, causal):
    """The direct schedule's claim, from the plans of all ranks: at each distance the rows a rank sends are
    exactly the rows its receiver's calls read (no row travels to a rank that does not read it, none is
    missing), and the shift's size is the largest such set."""
    from cpref.modes.ring_window import build_window_ring_plan

    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([64, 40, 96]), cp_size=P, layout=layout)
    plans = [build_window_ring_plan(sharding.bounds, P, r, layout, causal, window, torch.device("cpu")) for r in range(P)]
    assert len({p.halo.shifts for p in plans}) == 1 and len({p.halo.sizes for p in plans}) == 1  # ranks agree
    for r, plan in enumerate(plans):
        for t, d in enumerate(plan.halo.shifts[1:], start=1):
            receiver = plans[(r + d) % P]
            read = torch.unique(torch.cat([c.kv_index for c in receiver.steps[t].calls] + [torch.zeros(0, dtype=torch.int64)]))
            assert receiver.steps[t].source == r
            assert read.tolist() == list(range(len(plan.halo.send[t]))), (r, d)  # all it sends, nothing more
        assert plan.halo.sizes[1:] == tuple(max(len(p.halo.send[t]) for p in plans) for t in range(1, len(plan.halo.shifts)))


@pytest.mark.parametrize("mode", RING_MODES)
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
def test_the_ring_computes_only_what_the_window_sees(mode, layout):
    """Every kernel call's work is the visible pairs, summed over the calls the rank's exact window work, and
    no call has a sequence with keys none of its queries sees."""
    P, window = 4, (9, 0)
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([64, 40, 96]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, sharding, mode=mode, window=window, kernels=kernels, **cpref.MODES[mode].example_options(P))
    for r in range(P):
        for _kind, seqs, causal, used in kernels[r].calls:
            for i, (q0, q1, k0, k1) in enumerate(seqs.pairs()):
                if k1 > k0:
                    assert any(hi > lo for lo, hi in (seqs.visible(i, x, causal, used) for x in range(q1 - q0))), (r, i)
    if mode == "p2p":  # a2a+p2p's kernels see a2a_size ranks' queries for part of the heads
        for r in range(P):
            assert kernels[r].forward_work() == sharding.attention_work(r, exact=True, window=window)


@pytest.mark.parametrize("save", [False, True], ids=["default", "save_gathered_kv"])
def test_all_gather_saves_for_backward_only_what_the_window_selects(save):
    """With `save_gathered_kv` the backward keeps the selected K/V: under a window those are the window's rows
    only (the plan's `sum(kv_len)`), and the saved bytes are the formula's with that count, rank by rank."""
    from cpref.api import mode_costs
    from cpref.modes.all_gather_plan import build_all_gather_plan
    from sim.cluster.harness import saved_bytes

    P, window = 4, (5, 0)
    sharding = cpref.Sharding(cu_from_lengths([64, 32, 96]), cp_size=P)
    q, k, v, _ = attention_inputs(sharding.total, (4, 2, 8, 8))
    measured = saved_bytes(q, k, v, sharding, mode="all_gather", window=window, save_gathered_kv=save, check_ranks=False)
    for r in range(P):
        plan = build_all_gather_plan(sharding.bounds, P, r, "zigzag", True, torch.device("cpu"), window)
        rows = plan.seqs.total_kv
        assert rows <= sharding.local_tokens * (window[0] + 1)  # at most w + 1 keys for each query
        want = mode_costs("all_gather", sharding, heads=(4, 2, 8, 8), dtype=torch.float64, rank=r, window=window,
                          save_gathered_kv=save)  # fmt: skip
        assert measured[r] == want.saved_bytes, r


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=5), st.sampled_from([2, 3, 4, 8]), st.sampled_from([1, 2]),
       st.sampled_from(cpref.LAYOUTS), st.integers(-1, 50), st.integers(-1, 20), st.booleans(),
       st.sampled_from([None, 5, 16]))  # fmt: skip
def test_the_halo_sweep_finds_what_asking_every_rank_finds(lengths, P, group, layout, left, right, causal, chunk):
    """`_halo_rows` (one sweep over the pieces that see each other) against the plan's own calls asked rank by rank
    at every distance (the quadratic way it replaced): the same distances, and per distance the same rows every
    block sends, in every layout, ring members of one rank or of an a2a group, any window or none, chunked or not,
    documents padded or not."""
    from cpref.modes.ring_window import _calls, _halo_rows, _members
    from cpref.modes.visible import chunk_pieces, chunk_real

    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P * group, layout=layout)
    window = (left, 0 if causal else right)
    real, members = chunk_real(sharding.bounds.real_in), [chunk_pieces(m, chunk)
                                                           for m in _members(sharding.bounds, P, layout, group)]
    asked = {}
    for d in range(1, P):
        for s in range(P):
            calls = _calls(real, members, (s + d) % P, s, causal, window)
            if calls:
                asked.setdefault(d, [0] * P)[s] = len(torch.unique(torch.cat([rows for _, rows in calls])))
    assert _halo_rows(real, members, causal, window) == asked


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=5), st.sampled_from([2, 3, 4, 8]), st.sampled_from([1, 2]),
       st.sampled_from(cpref.LAYOUTS), st.integers(-1, 50), st.integers(-1, 20), st.booleans(),
       st.sampled_from([None, 5, 16]))  # fmt: skip
def test_the_pairs_are_the_sequences_with_keys_of_every_call(lengths, P, group, layout, left, right, causal, chunk):
    """`piece_pairs` (two searchsorteds a query piece, the ranges expanded) against the sequences with keys that
    `_sequences` makes member by member, sender by sender, slot by slot: each `(q_len, kv_len, shift, first key row)`
    once, none missing, none extra."""
    from collections import Counter

    from cpref.modes.ring_window import _members, _sequences, piece_pairs
    from cpref.modes.visible import chunk_pieces, chunk_real

    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P * group, layout=layout)
    window = (left, 0 if causal else right)
    real, members = chunk_real(sharding.bounds.real_in), [chunk_pieces(m, chunk)
                                                           for m in _members(sharding.bounds, P, layout, group)]
    asked = Counter()
    for r in range(P):
        for s in range(P):
            slots = max(Counter(doc for doc, *_ in members[s]).values(), default=0)
            for slot in range(slots):
                asked.update((r, s, slot, seq) for seq in _sequences(real, members[r], members[s], slot, causal, window)
                             if seq[1])  # fmt: skip
    swept = Counter()
    for p in piece_pairs(real, members, causal, window):
        for r, s, slot, a, zr, k0, row, lo, hi in zip(*(x.tolist() for x in p)):
            swept[(r, s, slot, (zr - a, hi - lo, a - lo, row + lo - k0))] += 1
    assert swept == asked
