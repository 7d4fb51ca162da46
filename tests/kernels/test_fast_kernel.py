"""The fast path of `TorchKernel` (`cpref.kernels.torch_fused`) against the oracle and the explicit path.

Every guarantee of the contract, in every dtype at the stated tolerances: packed runs of equal
documents (one fused call), bottom-right causal blocks with fewer queries than keys (split and
merged by lse) and more (rows that see nothing), empty sequences, GQA/MQA/MLA heads,
`full_rows`, a global lse passed to the backward, `out_dtype`/`grad_dtype`, working memory.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.kernels import TorchKernel, Varlen, torch_fused
from cpref.kernels.merge import merge_partial
from sim import oracle
from tests.helpers import assert_close, cu_from_lengths, random_qkv
from tests.kernels.test_torch_kernel import (
    DTYPES,
    HEADS,
    bf16_gradient_error,
    check,
    check_large_logits,
    check_owned_results,
    largest_allocation,
    reference,
)

FAST, EXPLICIT = TorchKernel(), TorchKernel(fast=False)
# runs of equal documents, single ones, a 1-token one and an empty one
LENGTHS = [16, 16, 16, 5, 1, 24, 24, 0, 3]
# the all-gather plan's pattern (chunk j and chunk 2P-1-j of each document: q_len < kv_len), then
# more queries than keys (the first 7 rows see nothing) and queries without keys
Q_LENS, KV_LENS = [4, 4] * 3 + [12, 3, 6], [4, 16] * 3 + [5, 0, 9]


def check_both(q_lens, kv_lens, heads, dtype, *, causal, seed=0):
    """The fast path against the oracle (in `check`) and against the explicit path, same tolerance."""
    fast = check(FAST, q_lens, kv_lens, heads, dtype, causal=causal, seed=seed)
    explicit = check(EXPLICIT, q_lens, kv_lens, heads, dtype, causal=causal, seed=seed)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fast, explicit):
        assert_close(a, b, dtype, f"fast vs explicit: {name}")
    return fast


def test_the_fast_path_runs_on_the_cpu_unless_asked_not_to_or_the_budget_is_below_a_tile(op_calls):
    q, k, v = random_qkv(20, 4, 2, 8)
    seqs = Varlen([0, 9, 20])
    below_a_tile = TorchKernel(max_block_elements=torch_fused.FUSED_TILE_ELEMENTS - 1)
    for kernel, fused in ((FAST, True), (EXPLICIT, False), (below_a_tile, False)):
        del op_calls[:]
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=0.3)
        kernel.backward(out, q, k, v, out, lse, seqs, causal=True, scale=0.3)
        assert op_calls == (["_FORWARD"] * 2 + ["_BACKWARD"] * 2 if fused else []), kernel  # one call per sequence
    with pytest.raises(ValueError, match="fast=1 must be True"):
        TorchKernel(fast=1)


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_documents_match_oracle_and_explicit_path(dtype, heads, causal):
    check_both(LENGTHS, LENGTHS, heads, dtype, causal=causal)


@pytest.mark.sweep
@pytest.mark.parametrize("lengths", [[24], [8] * 4], ids=["one-document", "equal-documents"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_call_over_the_whole_stream_matches_oracle_and_explicit_path(dtype, heads, causal, lengths):
    """One run covering both streams: the op's outputs are returned as the packed tensors."""
    assert len(torch_fused.plan_runs(Varlen.from_lengths(lengths, lengths), causal)) == 1
    check_both(lengths, lengths, heads, dtype, causal=causal)


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bottom_right_blocks_match_oracle_and_explicit_path(dtype, heads, causal):
    out, lse, dq, dk, dv = check_both(Q_LENS, KV_LENS, heads, dtype, causal=causal)
    if causal:  # 12 queries, 5 keys: the first 7 rows see nothing
        rows = slice(24, 31)
        assert (out[rows] == 0).all() and (lse[rows] == float("-inf")).all() and (dq[rows] == 0).all()
    rows = slice(36, 39)  # 3 queries without keys
    assert (out[rows] == 0).all() and (lse[rows] == float("-inf")).all() and (dq[rows] == 0).all()
    assert all(g.isfinite().all() for g in (dq, dk, dv))


@pytest.mark.parametrize("causal", [True, False])
def test_only_unreached_rows_are_filled_and_they_are_filled(monkeypatch, causal):
    """Buffers start uninitialized (poisoned with NaN here); the rows and keys no call writes are
    exactly those `_unreached` lists, and they come out 0 (lse -inf), as the oracle says."""
    real = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: real(self, *a, **kw).fill_(float("nan")))
    seqs = Varlen.from_lengths(Q_LENS, KV_LENS)
    # the 12-query / 5-key sequence's first 7 rows (causal) and the 3 queries without keys; keys of no query
    rows = [(24, 31), (36, 39)] if causal else [(36, 39)]
    assert torch_fused._unreached(seqs, causal, sum(Q_LENS), "q") == rows
    assert torch_fused._unreached(seqs, causal, sum(KV_LENS), "k") == []
    assert torch_fused._unreached(Varlen.from_lengths([0, 4, 0], [3, 0, 6]), causal, 9, "k") == [(0, 9)]
    check_both(Q_LENS, KV_LENS, HEADS["gqa"], torch.float64, causal=causal)
    check_both([0, 4, 0, 6], [3, 0, 0, 6], HEADS["gqa"], torch.float64, causal=causal)


def test_column_slices_reach_the_op_without_a_copy(monkeypatch):
    """K and V as the two halves of one packed `(T, Hkv, D + Dv)` block (how the ring's K/V travel)
    go to the op as views, and give bitwise what contiguous copies give."""
    seen = []
    real = torch_fused._FORWARD
    monkeypatch.setattr(torch_fused, "_FORWARD", lambda q, k, v, *a, **kw: seen.append((k, v)) or real(q, k, v, *a, **kw))
    q, kv = random_qkv(24, 4, 2, 8, 16, dtype=torch.float32)[::2]  # (24, 4, 8), (24, 2, 16)
    k, v, dout = kv[..., :8], kv[..., 8:], torch.randn(24, 4, 8)
    seqs = Varlen.from_lengths([10, 14], [10, 14])
    got = FAST.forward(q, k, v, seqs, causal=True, scale=0.3)
    assert seen and all(x.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for pair in seen for x in pair)
    want = FAST.forward(q, k.contiguous(), v.contiguous(), seqs, causal=True, scale=0.3)
    grads = FAST.backward(dout, q, k, v, *got, seqs, causal=True, scale=0.3)
    want_grads = FAST.backward(dout, q, k.contiguous(), v.contiguous(), *want, seqs, causal=True, scale=0.3)
    assert all(torch.equal(a, b) for a, b in zip((*got, *grads), (*want, *want_grads)))


@pytest.mark.parametrize("lengths", [[24], [10, 14]], ids=["one-call", "several-calls"])
@pytest.mark.parametrize("kernel", [FAST, EXPLICIT], ids=["fast", "explicit"])
def test_results_belong_to_the_caller(kernel, lengths):
    check_owned_results(kernel, lengths, torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_empty_sequences_and_no_tokens(causal):
    check_both([0, 4, 0, 6], [3, 0, 0, 6], HEADS["gqa"], torch.float64, causal=causal)
    check_both([0], [0], HEADS["gqa"], torch.float64, causal=causal)


def test_whole_rows_keep_bf16_gradients_within_tolerance_at_any_logit_scale():
    """full_rows in bf16: Delta from the recomputed float32 output, not from the bf16 `out`."""
    tol = 2.5e-2
    for factor in (1.0, 2.5, 4.0):
        assert bf16_gradient_error(True, factor, FAST) < tol / 4
    assert bf16_gradient_error(False, 1.0, FAST) < tol < bf16_gradient_error(False, 2.5, FAST)


@pytest.mark.parametrize("kernel", [FAST, EXPLICIT], ids=["fast", "explicit"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_global_lse_gives_each_call_its_share_of_the_gradients(kernel, dtype, causal):
    """Ring attention: each sequence's keys in two calls, as a ring splits them (the first keys seen
    by every row, then the rest, bottom-right causal), outputs merged by lse; each backward gets the
    merged (global) out and lse, and the shares sum to the gradients of the whole rows."""
    q_lens, kv_lens, split = [6, 4], [14, 10], [8, 6]  # split <= kv_len - q_len + 1: the first keys are seen by all
    hq, hkv, d, dv = HEADS["mla"]
    cu_q, cu_kv = cu_from_lengths(q_lens), cu_from_lengths(kv_lens)
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, dtype=dtype, seed=1)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, dtype=dtype, seed=2)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, dtype=dtype, seed=3)[0]
    starts, ends = cu_kv[:-1].tolist(), cu_kv[1:].tolist()
    first = torch.cat([torch.arange(a, a + s) for a, s in zip(starts, split)])  # (sum split,)
    second = torch.cat([torch.arange(a + s, b) for a, b, s in zip(starts, ends, split)])  # the rest
    parts = [(first, Varlen.from_lengths(q_lens, split), False),
             (second, Varlen.from_lengths(q_lens, [n - s for n, s in zip(kv_lens, split)]), causal)]  # fmt: skip
    scale, cdt = d**-0.5, torch.float64 if dtype == torch.float64 else torch.float32
    out, lse = torch.zeros(q.shape[0], hq, dv, dtype=cdt), torch.full((q.shape[0], hq), float("-inf"), dtype=cdt)
    for rows, seqs, masked in parts:
        merge_partial(out, lse, *kernel.forward(q, k[rows], v[rows], seqs, causal=masked, scale=scale, out_dtype=cdt))
    dq, dk, dv_ = torch.zeros(q.shape, dtype=cdt), torch.zeros(k.shape, dtype=cdt), torch.zeros(v.shape, dtype=cdt)
    for rows, seqs, masked in parts:
        g = kernel.backward(dout, q, k[rows], v[rows], out, lse, seqs, causal=masked, scale=scale, grad_dtype=cdt)
        dq += g[0]
        dk[rows], dv_[rows] = g[1], g[2]
    want = reference(q, k, v, cu_q, cu_kv, dout, causal=causal, scale=scale)
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv_), want):
        assert_close(got, w, dtype, name)


@pytest.mark.parametrize("q_lens, kv_lens", [(Q_LENS, KV_LENS), ([24], [24]), ([8] * 4, [8] * 4)],
                         ids=["packed", "one-document", "equal-documents"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_dtype_and_grad_dtype_return_the_float32_accumulators(dtype, q_lens, kv_lens):
    """Both paths compute in float32: asked for float32, they agree to float32 precision, unrounded
    (also where one call covers the whole stream and its outputs are returned as they are)."""
    hq, hkv, d, dv = HEADS["mla"]
    seqs = Varlen.from_lengths(q_lens, kv_lens)
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, dtype=dtype, seed=4)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, dtype=dtype, seed=5)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, dtype=dtype, seed=6)[0]
    results = []
    for kernel in (FAST, EXPLICIT):
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=d**-0.5, out_dtype=torch.float32)
        grads = kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=d**-0.5, grad_dtype=torch.float32)
        assert all(t.dtype == torch.float32 for t in (out, lse, *grads))
        results.append((out, lse, *grads))
    assert (results[0][0] != results[0][0].to(dtype).float()).any()  # not rounded to the input dtype
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_large_logits_stay_finite_and_float64_matches_the_oracle(dtype):
    """Logits scaled by 30 reach hundreds (see the explicit path's test of the same name)."""
    check_large_logits(FAST, [37, 64, 5, 64], dtype)


def test_noncontiguous_inputs_and_bitwise_determinism():
    big = random_qkv(20, 4, 2, 24, seed=9)
    q, k, v = (x[..., :16] for x in big)  # non-contiguous (T, H, 16) views
    dout, cu = torch.randn(20, 4, 16, dtype=torch.float64), torch.tensor([0, 9, 20])
    seqs = Varlen(cu.tolist())
    runs = []
    for _ in range(2):
        out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=0.25)
        runs.append((out, lse, *FAST.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.25)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    want = oracle.forward_backward(q, k, v, cu, dout, causal=True, scale=0.25)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), runs[0], want):
        assert_close(g, w, torch.float64, name)


def test_runs_of_equal_sequences_are_one_call_each(op_calls):
    assert len(torch_fused.plan_runs(Varlen.from_lengths([32] * 256, [32] * 256), causal=True)) == 1
    # all-gather at P = 2: chunk j (c queries, c keys) and chunk 3 - j (c, 4c) alternate: two squares, one merge
    runs = torch_fused.plan_runs(Varlen.from_lengths([8, 8] * 64, [8, 32] * 64), causal=True)
    assert [(r.count, r.causal, r.merge) for r in runs] == [(64, True, False), (64, True, False), (64, False, True)]
    q, k, v = random_qkv(8 * 64, 2, 1, 4, dtype=torch.float32)
    seqs = Varlen.from_lengths([8] * 64, [8] * 64)
    FAST.backward(q, q, k, v, *FAST.forward(q, k, v, seqs, causal=True, scale=0.5), seqs, causal=True, scale=0.5)
    assert op_calls == ["_FORWARD", "_BACKWARD"]


@pytest.mark.parametrize("lengths", [[24], [8] * 4], ids=["one-document", "equal-documents"])
def test_one_call_over_the_whole_stream_returns_the_ops_own_outputs(monkeypatch, lengths):
    """Where one call covers both streams in order, `out`, `lse` and the gradients are the op's
    results themselves (no packed buffer, no copy), as the module docstring says; a mixed batch
    is assembled into new buffers."""
    made = []
    for name in ("_FORWARD", "_BACKWARD"):
        real = getattr(torch_fused, name)
        monkeypatch.setattr(torch_fused, name, lambda *a, _real=real, **kw: (r := _real(*a, **kw), made.extend(r))[0])
    q, k, v = random_qkv(sum(lengths), 4, 2, 8, dtype=torch.float32)  # D = Dv: nothing to narrow
    seqs = Varlen.from_lengths(lengths, lengths)
    out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=0.3)
    grads = FAST.backward(out, q, k, v, out, lse, seqs, causal=True, scale=0.3)
    storages = {t.untyped_storage().data_ptr() for t in made}
    assert all(t.untyped_storage().data_ptr() in storages for t in (out, lse, *grads))
    made.clear()
    seqs = Varlen.from_lengths([*lengths, 3], [*lengths, 3])
    q, k, v = random_qkv(sum(lengths) + 3, 4, 2, 8, dtype=torch.float32)
    out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=0.3)
    assert not {t.untyped_storage().data_ptr() for t in (out, lse)} & {t.untyped_storage().data_ptr() for t in made}


def test_the_fused_path_needs_one_tile_per_thread(op_calls):
    """The op keeps one score tile per thread: a `max_block_elements` that holds fewer tiles than
    threads takes the explicit path, which honours any budget."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch_fused.fused_available(torch.device("cpu"), 2 * torch_fused.FUSED_TILE_ELEMENTS)
        assert not torch_fused.fused_available(torch.device("cpu"), 2 * torch_fused.FUSED_TILE_ELEMENTS - 1)
        assert not torch_fused.fused_available(torch.device("meta"), 2 * torch_fused.FUSED_TILE_ELEMENTS)
        q, k, v = random_qkv(20, 4, 2, 8)
        TorchKernel(max_block_elements=2 * torch_fused.FUSED_TILE_ELEMENTS - 1).forward(q, k, v, Varlen([0, 20]), causal=True, scale=0.3)
        assert op_calls == []
    finally:
        torch.set_num_threads(threads)


def test_runs_are_planned_once_per_varlen(monkeypatch):
    calls = []
    real = torch_fused.plan_runs
    monkeypatch.setattr(torch_fused, "plan_runs", lambda *a: calls.append(a) or real(*a))
    q, k, v = random_qkv(20, 4, 2, 8)
    seqs = Varlen([0, 9, 20])
    for _ in range(3):
        out, lse = FAST.forward(q, k, v, seqs, causal=True, scale=0.3)
        FAST.backward(out, q, k, v, out, lse, seqs, causal=True, scale=0.3)
    assert len(calls) == 1
    FAST.forward(q, k, v, seqs, causal=False, scale=0.3)  # another mask: another plan
    assert len(calls) == 2


@pytest.mark.parametrize("causal", [True, False])
def test_working_memory_is_linear_in_the_tokens(causal):
    """No score-sized allocation: the fused op keeps its tiles to itself, everything else is O(T)."""
    n, (hq, hkv, d, dv) = 256, (4, 2, 4, 4)
    q, k, v = random_qkv(n, hq, hkv, d, dv, dtype=torch.float32)
    dout = random_qkv(n, hq, hq, dv, dtype=torch.float32, seed=1)[0]
    seqs = Varlen([0, n])
    out, lse = FAST.forward(q, k, v, seqs, causal=causal, scale=0.5)
    fwd = largest_allocation(lambda: FAST.forward(q, k, v, seqs, causal=causal, scale=0.5))
    bwd = largest_allocation(lambda: FAST.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=0.5))
    assert max(fwd, bwd) <= q.numel() < n * n * hq // 2


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=5),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    dims=st.sampled_from([(8, 8), (8, 4), (4, 4)]),
    causal=st.booleans(),
    repeat=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_property_matches_oracle(lens, hkv, group, dims, causal, repeat, seed):
    q_lens, kv_lens = [a for a, _ in lens] * repeat, [b for _, b in lens] * repeat  # repeats make runs
    check(FAST, q_lens, kv_lens, (hkv * group, hkv, *dims), torch.float64, causal=causal, seed=seed)
