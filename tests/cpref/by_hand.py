"""What the API fuzz (`test_fuzz_api.py`) holds each call to, computed here by hand from the documented rules:
padded boundaries, each rank's token indices and positions, padding, which values a dtype holds, and a
varlen call's masked softmax written out. Nothing here calls the function it checks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import cpref


def outcome(call):
    """`call()`'s result, or the `CPInputError` it raised (any other exception fails the test)."""
    try:
        return call()
    except cpref.CPInputError as err:
        return err


def eod_bounds(lengths: list[int], P: int, layout: str) -> list[int]:
    """The padded boundaries by the documented rule: every document to the layout's multiple (`2P` zigzag, `P`
    contiguous, 1 at P = 1), or for stream and balanced the last document to make the batch a multiple of `P`."""
    mult = 1 if P == 1 or layout in ("stream", "balanced") else (2 * P if layout == "zigzag" else P)
    padded = [-(-n // mult) * mult for n in lengths]
    padded[-1] += -sum(padded) % P
    return [0, *torch.tensor(padded).cumsum(0).tolist()]


def expected_index(padded: list[int], P: int, layout: str, r: int) -> list[int] | None:
    """Rank `r`'s tokens' indices in the padded stream (None for balanced, checked by its invariants)."""
    T = padded[-1]
    if P == 1 or layout == "stream":
        return list(range(r * T // P, (r + 1) * T // P))
    if layout == "balanced":
        return None
    out = []
    for a, b in zip(padded, padded[1:]):
        c = (b - a) // (2 * P if layout == "zigzag" else P)
        chunks = [r, 2 * P - 1 - r] if layout == "zigzag" else [r]
        out += [x for j in chunks for x in range(a + j * c, a + (j + 1) * c)]
    return out


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (NaN where NaN), in dtype and shape too."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def pad_by_hand(x: torch.Tensor, real: list[int], padded: list[int], value) -> torch.Tensor:
    fill = float(value) if x.is_floating_point() or x.is_complex() else int(value)  # torch.full takes no 2**70 int there
    out = torch.full((padded[-1], *x.shape[1:]), fill, dtype=x.dtype)
    for i in range(len(real) - 1):
        out[padded[i] : padded[i] + real[i + 1] - real[i]] = x[real[i] : real[i + 1]]
    return out


def fits(value, dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` holds `value` exactly as it is (inf and nan in a floating dtype)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return isinstance(value, bool)  # True and False are 1 and 0; None, strings and complex numbers are no pad value
    value = int(value) if isinstance(value, (int, np.integer)) else float(value)
    if dtype.is_floating_point or dtype.is_complex:
        return value != value or abs(value) == float("inf") or abs(value) <= torch.finfo(dtype).max
    if dtype == torch.bool:
        return value in (0, 1)
    info = torch.iinfo(dtype)
    return float(value).is_integer() and info.min <= value <= info.max


def positions_by_hand(padded: list[int], index: list[int]) -> list[int]:
    """Each token's position in its document: its index less its document's padded start."""
    return [g - max(a for a in padded[:-1] if a <= g) for g in index]


def dense_reference(q, k, v, cu_q, cu_kv, shifts, causal, window, scale):
    """Every sequence's masked softmax, written out: query x of sequence i, at key position p = x + shift_i,
    sees key y iff (causal: y <= p) and p - left <= y (left >= 0) and y <= p + right (right >= 0)."""
    g = q.shape[1] // k.shape[1]
    out, lse = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype), torch.full(q.shape[:2], -math.inf, dtype=q.dtype)
    seen = 0
    for i in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[i : i + 2], cu_kv[i : i + 2]
        shift = (k1 - k0) - (q1 - q0) if shifts is None else shifts[i]
        p = torch.arange(q1 - q0)[:, None] + shift  # (n_q, 1)
        y = torch.arange(k1 - k0)[None, :]  # (1, n_k)
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        ok &= (y <= p) if causal else (y <= p + window[1]) if window[1] >= 0 else ok
        ok &= (y >= p - window[0]) if window[0] >= 0 else ok
        seen += int(ok.sum())
        s = torch.einsum("xhd,yhd->hxy", q[q0:q1], k[k0:k1].repeat_interleave(g, 1)) * scale  # (Hq, n_q, n_k)
        s = s.masked_fill(~ok, -math.inf)
        rows = ok.any(1)  # (n_q,) rows that see a key
        prob = torch.softmax(s[:, rows], -1)
        out[q0:q1][rows] = torch.einsum("hxy,yhd->xhd", prob, v[k0:k1].repeat_interleave(g, 1))
        lse[q0:q1][rows] = torch.logsumexp(s[:, rows], -1).T
    return out, lse, seen
