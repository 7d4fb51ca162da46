"""Sliding windows and shifts on the fast path of `TorchKernel` (`cpref.kernels.torch_fused_plan`'s band tiles).

Against the FP64 oracle (`sim.oracle` with `window=`) and the explicit path at the stated
tolerances, in every dtype, causal or not, windows narrower than a tile and wider than a
document; shifted sequences against the explicit path (and, in float64, a dense oracle of the
contract's rule), with rows that see no key. The plan itself is counted, not timed: its parts
cover every visible score exactly once and a row costs at most its band plus a tile.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.kernels import TorchKernel, Varlen, torch_fused
from cpref.kernels.contract import check_window
from cpref.kernels.torch_fused_plan import band_rows, is_plain, is_shifted, plan_band_runs, plan_shifted_runs
from sim import oracle
from tests.cp.test_windows import shifted_oracle
from tests.helpers import assert_close, cu_from_lengths, random_qkv
from tests.kernels.test_torch_kernel import DTYPES, HEADS, largest_allocation

FAST, EXPLICIT = TorchKernel(), TorchKernel(fast=False)
# a 5-token document whose two edges are alike under (3, 3) (two parts of one shape over the same rows: two
# runs), then several tiles of 16 rows (the tile of a band up to 127 keys wide), a 1-token and an empty document
DOCS = [5, 40, 64, 1, 37, 0, 16]
# narrower than a tile, about a tile, wider than every document, one side unbounded
WINDOWS = [(0, 0), (3, 0), (40, 0), (500, 0), (3, 3), (2, 5), (40, 9), (-1, 7), (7, -1), (500, 500)]
# keys before and after the queries: rows that see no key at either end (see `empty_rows`)
SHIFTED = Varlen.from_lengths([50, 6, 30, 20], [70, 10, 20, 40], shifts=[-5, 5, 12, 30])


def run_both(seqs, heads, dtype, *, causal, window, seed=0, scale_factor=1.0):
    """`(out, lse, dq, dk, dv)` of the fast and the explicit path on the same random inputs, the fast
    path's dtypes checked and NaN-free, both paths compared at the tolerance of `dtype`."""
    hq, hkv, d, dv = heads
    q = random_qkv(seqs.total_q, hq, hkv, d, dv, dtype=dtype, seed=seed)[0]
    _, k, v = random_qkv(seqs.total_kv, hq, hkv, d, dv, dtype=dtype, seed=seed + 1)
    dout = random_qkv(seqs.total_q, hq, hq, dv, dtype=dtype, seed=seed + 2)[0]
    results = []
    for kernel in (FAST, EXPLICIT):
        out, lse = kernel.forward(q, k, v, seqs, causal=causal, scale=scale_factor * d**-0.5, window=window)
        grads = kernel.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=scale_factor * d**-0.5, window=window)
        results.append((out, lse, *grads))
    for name, a, b, like in zip(("out", "lse", "dq", "dk", "dv"), *results, (dout, None, q, k, v)):
        assert a.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) if like is None else like.dtype
        assert not a.isnan().any(), name
        assert_close(a, b, dtype, f"fast vs explicit: {name} window={window} causal={causal}")
    return (q, k, v, dout), results[0]


def windows(causal: bool) -> list[tuple[int, int]]:
    return [w for w in WINDOWS if not (causal and w[1] > 0)]


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mqa"], HEADS["mla"]], ids=["gqa", "mqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_windows_match_the_oracle_and_the_explicit_path(dtype, heads, causal):
    seqs = Varlen.from_lengths(DOCS, DOCS)
    for window in windows(causal):
        (q, k, v, dout), got = run_both(seqs, heads, dtype, causal=causal, window=window)
        want = oracle.forward_backward(q, k, v, cu_from_lengths(DOCS), dout, causal=causal, scale=heads[2] ** -0.5, window=window)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert_close(g, w, dtype, f"fast vs oracle: {name} window={window} causal={causal}")


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_long_document_in_runs_of_equal_tiles_matches_the_oracle(dtype, causal):
    """600 tokens, a band of 128 keys: tiles of 32 rows, the interior ones one run whose parts share keys
    (their dK and dV are added up in passes over parts that do not)."""
    window, seqs = (127, 0) if causal else (60, 67), Varlen([0, 600])
    runs = torch_fused._runs(seqs, causal, check_window(window, causal))
    assert max(r.count for r in runs) >= 10 and any(r.k_step < r.keys for r in runs if r.count > 1)
    (q, k, v, dout), got = run_both(seqs, HEADS["gqa"], dtype, causal=causal, window=window)
    scale = HEADS["gqa"][2] ** -0.5
    want = oracle.forward_backward(q, k, v, torch.tensor([0, 600]), dout, causal=causal, scale=scale, window=window)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_close(g, w, dtype, f"{name} window={window}")


def empty_rows(seqs: Varlen, causal: bool, window: tuple[int, int]) -> list[int]:
    """The query rows that see no key under the contract."""
    return [q0 + x for i, (q0, q1, _, _) in enumerate(seqs.pairs()) for x in range(q1 - q0)
            if (lambda lo, hi: hi <= lo)(*seqs.visible(i, x, causal, window))]  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shifts_match_the_explicit_path_and_rows_that_see_no_key_stay_zero(dtype, heads, causal):
    for window in [(-1, -1), *windows(causal)]:
        (q, k, v, dout), (out, lse, dq, dk, dv) = run_both(SHIFTED, heads, dtype, causal=causal, window=window)
        empty = empty_rows(SHIFTED, causal, check_window(window, causal))
        assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all() and (dq[empty] == 0).all()
        if dtype != torch.float64:
            continue
        for (q0, q1, k0, k1), shift in zip(SHIFTED.pairs(), SHIFTED.shifts):
            want, want_grads = shifted_oracle(q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1],
                                              torch.arange(q1 - q0) + shift, torch.arange(k1 - k0), causal, window)  # fmt: skip
            assert_close(out[q0:q1], want, dtype, f"out window={window}")
            for got, ref, name in zip((dq[q0:q1], dk[k0:k1], dv[k0:k1]), want_grads, ("dq", "dk", "dv")):
                assert_close(got, ref, dtype, f"{name} window={window}")
    assert empty_rows(SHIFTED, True, (3, 0))  # the case is there: both ends of SHIFTED have rows without keys


def test_windows_and_shifts_take_the_fused_path(op_calls):  # noqa: F811
    for seqs, window in ((SHIFTED, (-1, -1)), (Varlen([0, 20]), (3, 0))):
        q = random_qkv(seqs.total_q, 4, 2, 8)[0]
        _, k, v = random_qkv(seqs.total_kv, 4, 2, 8)
        del op_calls[:]
        FAST.forward(q, k, v, seqs, causal=True, scale=0.3, window=window)
        assert op_calls and set(op_calls) == {"_FORWARD"}
    # no window, no mask: shifts change nothing, the plain plan (one part per sequence) applies
    assert is_plain(SHIFTED, False, (-1, -1)) and not is_plain(SHIFTED, True, (-1, -1))
    assert not is_plain(Varlen([0, 20]), False, (3, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_dtype_and_grad_dtype_return_the_float32_accumulators_with_a_window(dtype):
    hq, hkv, d, dv = HEADS["mla"]
    seqs, window = Varlen.from_lengths(DOCS, DOCS), (40, 0)
    q, k, v = random_qkv(seqs.total_q, hq, hkv, d, dv, dtype=dtype, seed=4)
    dout = random_qkv(seqs.total_q, hq, hkv, dv, dtype=dtype, seed=6)[0]
    results = []
    for kernel in (FAST, EXPLICIT):
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=d**-0.5, window=window, out_dtype=torch.float32)
        grads = kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=d**-0.5, window=window,
                                grad_dtype=torch.float32)  # fmt: skip
        assert all(t.dtype == torch.float32 for t in (out, lse, *grads))
        results.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert_close(a, b, torch.float32, name)


def test_whole_rows_keep_bf16_gradients_within_tolerance_with_a_window():
    """full_rows in bf16: Delta from the recomputed float32 output (of the same band), at any logit scale."""
    hq, hkv, d, dv = HEADS["gqa"]
    lens, window = [120, 128, 151], (47, 0)
    q, k, v = random_qkv(sum(lens), hq, hkv, d, dv, dtype=torch.bfloat16, seed=1)
    dout = random_qkv(sum(lens), hq, hq, dv, dtype=torch.bfloat16, seed=2)[0]
    seqs, cu = Varlen.from_lengths(lens, lens), cu_from_lengths(lens)
    for factor in (1.0, 2.5, 4.0):
        out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=factor * d**-0.5, window=window)
        got = FAST.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=factor * d**-0.5, window=window, full_rows=True)
        want = oracle.forward_backward(q, k, v, cu, dout, causal=True, scale=factor * d**-0.5, window=window)[2:]
        assert max(((g.double() - w).abs() / (1 + w.abs())).max().item() for g, w in zip(got, want)) < 2.5e-2 / 4, factor


def test_windowed_working_memory_is_linear_in_the_tokens():
    """Nothing score-sized: the masks are at most R x 2R and shared by alike tiles; the largest buffer is the
    op's dK (or dV) of every tile of a run, tiles that share keys, at most (w + R) / R times K."""
    n, (hq, hkv, d, dv) = 1024, (4, 2, 4, 4)
    q, k, v = random_qkv(n, hq, hkv, d, dv, dtype=torch.float32)
    dout = random_qkv(n, hq, hq, dv, dtype=torch.float32, seed=1)[0]
    seqs, window, w = Varlen([0, n]), (63, 0), 64
    out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=0.5, window=window)
    fwd = largest_allocation(lambda: FAST.forward(q, k, v, seqs, causal=True, scale=0.5, window=window))
    bwd = largest_allocation(lambda: FAST.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.5, window=window))
    assert fwd <= q.numel() and bwd <= (w + band_rows(w)) / band_rows(w) * k.numel() < n * n * hq // 16


# --- the plan, counted ---------------------------------------------------------------------------

def coverage(seqs: Varlen, runs) -> tuple[torch.Tensor, list[int]]:
    """How often the plan computes each visible score `(T, T')`, and each row's cost (scores its parts compute)."""
    count, cost = torch.zeros(seqs.total_q, seqs.total_kv, dtype=torch.int64), [0] * seqs.total_q
    for run in runs:
        for i in range(run.count):
            q0, k0 = run.q0 + i * run.q_step, run.k0 + i * run.k_step
            for j in range(run.rows):
                lo, hi = run.seen[j] if run.seen is not None else (0, j + 1 if run.causal else run.keys)
                assert run.count == 1 or run.q_step >= run.rows, "parts of one run that write the same rows"
                assert hi > lo, "a row of a part that sees none of its keys"
                count[q0 + j, k0 + lo : k0 + hi] += 1
                cost[q0 + j] += run.keys
    return count, cost


def visible(seqs: Varlen, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """The contract's `(T, T')` visibility, from `Varlen.visible`."""
    mask = torch.zeros(seqs.total_q, seqs.total_kv, dtype=torch.int64)
    for i, (q0, q1, k0, _) in enumerate(seqs.pairs()):
        for x in range(q1 - q0):
            lo, hi = seqs.visible(i, x, causal, window)
            mask[q0 + x, k0 + lo : k0 + max(lo, hi)] = 1
    return mask


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(-35, 35)), min_size=1, max_size=4),
    causal=st.booleans(),
    left=st.integers(-1, 12),
    right=st.integers(-1, 12),
    rows=st.integers(1, 9),
)
def test_band_tiles_compute_every_visible_score_once_and_a_row_costs_its_band_plus_a_tile(lens, causal, left, right, rows):
    seqs = Varlen.from_lengths([a for a, _, _ in lens], [b for _, b, _ in lens], [s for _, _, s in lens])
    window = check_window((left, 0 if causal and right > 0 else right), causal)
    runs = plan_band_runs(seqs, causal, window, rows=rows)
    count, cost = coverage(seqs, runs)
    want = visible(seqs, causal, window)
    assert torch.equal(count, want)  # every visible score once, no other
    width = int(want.sum(1).max()) if want.numel() else 0  # the widest row's keys
    assert all(c <= width + rows - 1 for c in cost)
    assert all(r.rows <= rows and (r.seen is None or r.keys < 2 * rows) for r in runs)  # masks under R x 2R
    assert sum(cost) == sum(r.count * r.rows * r.keys for r in runs) >= seqs.work(causal, window)


def test_a_causal_window_costs_w_plus_r_per_row_on_a_32k_document():
    """The benchmark's case, from the plan: w = 1024 keys, tiles of R = 256 rows, at most w + R scores a row
    (against T / 2 on average for plain causal: about 13x fewer), in a handful of calls whatever T."""
    t, w = 32768, 1024
    seqs, window = Varlen([0, t]), (w - 1, 0)
    runs = plan_band_runs(seqs, True, window)
    r, work = band_rows(w), sum(run.count * run.rows * run.keys for run in runs)
    assert r == 256 and seqs.work(True, window) <= work <= t * (w + r)
    assert t * (t + 1) // 2 / work > 12
    assert len(runs) == len(plan_band_runs(Varlen([0, 8192]), True, window)) <= 16


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-45, 45)), min_size=1, max_size=4),
    shifted=st.booleans(),
    causal=st.booleans(),
    left=st.integers(-1, 20),
    right=st.integers(-1, 20),
    hkv=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_property_windows_and_shifts_match_the_explicit_path(lens, shifted, causal, left, right, hkv, seed):
    shifts = [s for _, _, s in lens] if shifted else None
    seqs = Varlen.from_lengths([a for a, _, _ in lens], [b for _, b, _ in lens], shifts)
    window = (left, 0 if causal and right > 0 else right)
    run_both(seqs, (2 * hkv, hkv, 8, 4), torch.float64, causal=causal, window=window, seed=seed)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-45, 45)), min_size=1, max_size=4),
    hkv=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_property_shifted_causal_calls_match_the_explicit_path_without_masks(lens, hkv, seed):
    """A causal call with explicit shifts and no window (what the ring over pieces makes): mask-free parts (rows
    that see nothing skipped, a growing prefix as a bottom-right block, full rows unmasked) that compute exactly
    the visible scores, and the same out, lse and gradients as the explicit path. Catches an off-by-one between
    the prefix and the full rows (a score counted twice or lost), and keys shared by the two parts copied
    instead of added."""
    seqs = Varlen.from_lengths([a for a, _, _ in lens], [b for _, b, _ in lens], [d for _, _, d in lens])
    runs = plan_shifted_runs(seqs)
    assert all(run.seen is None for run in runs)
    computed = sum(run.count * (run.rows * (run.rows + 1) // 2 if run.causal else run.rows * run.keys) for run in runs)
    assert computed == seqs.work(True)
    if is_shifted(seqs, True, (-1, -1)):
        assert torch_fused._runs(seqs, True) == runs  # the fused path takes this plan
    run_both(seqs, (2 * hkv, hkv, 8, 4), torch.float64, causal=True, window=(-1, -1), seed=seed)


def test_a_piece_that_sees_a_whole_earlier_piece_is_one_unmasked_call(op_calls):
    """8 queries at key positions 8..15 against 8 keys: every query sees every key, one call of the op and no mask
    (the band path took two masked tiles and merged them)."""
    seqs = Varlen.from_lengths([8], [8], [8])
    assert plan_shifted_runs(seqs) == [torch_fused.Run(0, 1, 0, 1, 1, 8, 8, False, False)]
    run_both(seqs, (2, 1, 8, 4), torch.float64, causal=True, window=(-1, -1))
    assert op_calls == ["_FORWARD", "_BACKWARD"]
