"""Merging partial results by log-sum-exp: exact, stable at huge lse, no NaN for rows without keys."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.kernels.merge import merge_partial

INF = float("inf")


def naive(out, lse, out_b, lse_b):
    """The textbook formula in float64 (fine for moderate lse)."""
    new = torch.logaddexp(lse, lse_b)
    w, w_b = torch.exp(lse - new), torch.exp(lse_b - new)
    return w[..., None] * out + w_b[..., None] * out_b, new


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**16), st.floats(-30, 30), st.floats(-30, 30))
def test_merge_equals_the_textbook_formula(seed, shift, shift_b):
    g = torch.Generator().manual_seed(seed)
    out, out_b = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lse, lse_b = torch.randn(5, 3, generator=g, dtype=torch.float64) + shift, torch.randn(5, 3, generator=g, dtype=torch.float64) + shift_b
    want_out, want_lse = naive(out, lse, out_b, lse_b)
    merge_partial(out, lse, out_b, lse_b)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)


def test_merging_blocks_in_any_grouping_gives_the_softmax_over_all_keys():
    """Merging P blocks one by one equals attention over their union (the ring's whole point)."""
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(6, 12, generator=g, dtype=torch.float64), torch.randn(12, 4, generator=g, dtype=torch.float64)
    full = torch.softmax(scores, -1) @ values
    out, lse = torch.zeros(6, 1, 4, dtype=torch.float64), torch.full((6, 1), -INF, dtype=torch.float64)
    for cols in (slice(0, 5), slice(5, 7), slice(7, 12)):
        s = scores[:, cols]
        merge_partial(out, lse, (torch.softmax(s, -1) @ values[cols])[:, None], torch.logsumexp(s, -1)[:, None])
    torch.testing.assert_close(out[:, 0], full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[:, 0], torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_lse_neither_overflows_nor_loses_the_smaller_block(dtype):
    """Field bug 5: exp(lse) overflows float32 beyond 88; the stable form never forms it."""
    out, out_b = torch.ones(1, 1, 2, dtype=dtype), 3 * torch.ones(1, 1, 2, dtype=dtype)
    lse, lse_b = torch.tensor([[1000.0]], dtype=dtype), torch.tensor([[1000.0]], dtype=dtype)
    merge_partial(out, lse, out_b, lse_b)
    assert torch.equal(out, 2 * torch.ones(1, 1, 2, dtype=dtype))  # equal weights: the mean
    torch.testing.assert_close(lse, torch.tensor([[1000.0 + torch.log(torch.tensor(2.0)).item()]], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_without_keys_stay_finite(dtype):
    """-inf on either side, or both: taken explicitly, never NaN."""
    out = torch.tensor([[[0.0]], [[0.0]], [[5.0]]], dtype=dtype)  # rows: none yet, none yet, seen
    lse = torch.tensor([[-INF], [-INF], [2.0]], dtype=dtype)
    out_b = torch.tensor([[[0.0]], [[7.0]], [[0.0]]], dtype=dtype)  # block: none, seen, none
    lse_b = torch.tensor([[-INF], [1.0], [-INF]], dtype=dtype)
    merge_partial(out, lse, out_b, lse_b)
    assert out.flatten().tolist() == [0.0, 7.0, 5.0]
    assert lse.flatten().tolist() == [-INF, 1.0, 2.0]


# (lse, lse_b): exp of the larger overflows float32 (beyond 88) in every case, float64 (beyond 709) in all but the first two;
# (-333333.3, 1234567.9): the lse of float32 logits of inputs x1000, where lse - logsigmoid(lse - lse_b) is off by 0.125
LSE_GAPS = [(0.0, 200.0), (200.0, 0.0), (-1e4, 1e4), (1e4, -1e4), (1e30, 0.0), (0.0, 1e30), (1e30, -INF), (-INF, 1e30),
            (-333333.3, 1234567.9), (1234567.9, -333333.3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lse_run, lse_block", LSE_GAPS)
def test_a_block_dominating_by_a_huge_lse_gap_takes_the_merge_without_overflow(dtype, lse_run, lse_block):
    """Field bug 5: the weight of the smaller block is sigma(-gap) <= e^-200, far below the dtype's
    resolution, so the merged output is the dominant block's and the merged lse, max + log1p(e^-gap),
    is the larger lse, exactly (the ring's backward recomputes probabilities from it). A merge through
    exp(lse) overflows to inf / inf = NaN for these gaps."""
    g = torch.Generator().manual_seed(0)
    out, out_b = (torch.randn(3, 2, 4, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    lse, lse_b = torch.full((3, 2), lse_run, dtype=dtype), torch.full((3, 2), lse_block, dtype=dtype)
    dominant_out = (out_b if lse_block > lse_run else out).clone()
    larger_lse = torch.maximum(lse, lse_b)
    merge_partial(out, lse, out_b, lse_b)
    assert out.isfinite().all() and lse.isfinite().all()
    # the weights are exactly 1 and 0 and log1p(e^-gap) vanishes: the dominant block's, bit for bit
    assert torch.equal(out, dominant_out) and torch.equal(lse, larger_lse)
