"""The test double of the NPU ops, tested on its own: strict where the real op is, and storing
its softmax statistics as documented. `test_npu_contract` relies on both."""

from __future__ import annotations

import pytest
import torch

from sim import oracle
from tests.helpers import assert_close, random_qkv
from tests.kernels.npu_double import NpuOpsDouble

LAYOUTS = ["", "TND"]


def test_the_double_rejects_what_the_op_rejects():
    """The double is only useful if it is strict: each call here is one the real op refuses."""
    ops, q, k, v = NpuOpsDouble(), *random_qkv(6, 4, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    good = dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], atten_mask=mask, sparse_mode=3, scale=0.3)
    ops.npu_fusion_attention(q, k, v, 4, "TND", **good)  # accepted
    bad = [
        dict(actual_seq_qlen=[0, 2, 6]),  # a leading 0 makes the lists unequal
        dict(actual_seq_qlen=(2, 6)),  # not a list
        dict(actual_seq_qlen=torch.tensor([2, 6])),  # a device tensor, not host ints
        dict(actual_seq_qlen=[4, 6], actual_seq_kvlen=[2, 6]),  # q_len > kv_len under mode 3
        dict(atten_mask=mask.float()),  # not bool
        dict(atten_mask=mask[:1024, :1024]),  # not 2048 x 2048
        dict(atten_mask=~mask),  # not triu(ones, 1)
        dict(sparse_mode=5),  # not a TND mode
        dict(actual_seq_qlen=[2, 5]),  # does not end at T
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            ops.npu_fusion_attention(q, k, v, 4, "TND", **{**good, **kwargs})
    with pytest.raises(ValueError, match="head_num"):
        ops.npu_fusion_attention(q, k, v, 2, "TND", **good)
    with pytest.raises(ValueError, match="TND only"):
        ops.npu_fusion_attention(q, k, v, 4, "BSND", **good)
    with pytest.raises(TypeError):
        ops.npu_fusion_attention(q, k, v, 4, "TND", scale_value=0.3)
    out, smax, ssum, *_ = ops.npu_fusion_attention(q, k, v, 4, "TND", **good)
    grad = dict(good, softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=good.pop("scale"))
    ops.npu_fusion_attention_grad(q, k, v, out, 4, "TND", **grad)  # accepted
    with pytest.raises(TypeError):
        ops.npu_fusion_attention_grad(q, k, v, out, 4, "TND", **grad, scale=0.3)
    with pytest.raises(ValueError, match="finite"):
        ops.npu_fusion_attention_grad(q, k, v, out, 4, "TND", **{**grad, "softmax_max": smax.fill_(float("-inf"))})
    # no mask means full attention whatever sparse_mode says: q_len > kv_len is then fine
    ops.npu_fusion_attention(q, k, v, 4, "TND", **{**good, "atten_mask": None, "actual_seq_qlen": [4, 6]})


@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
def test_the_double_stores_stats_as_documented(layout):
    """Pin the double itself: lengths 2 and 3, Nq = 2. Head-major storage holds, row by row,
    (seq 0: h0 t0, h0 t1, h1 t0, h1 t1), then (seq 1: h0 t2, h0 t3, h0 t4, h1 t2, h1 t3, h1 t4)."""
    q, k, v = random_qkv(5, 2, 1, 4, seed=8)
    _, want = oracle.attention(q, k, v, torch.tensor([0, 2, 5]), causal=True, scale=0.5)  # (T, Hq)
    _, smax, ssum, *_ = NpuOpsDouble().npu_fusion_attention(
        q, k, v, 2, "TND", scale=0.5, actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], softmax_layout=layout,
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), sparse_mode=3,
    )  # fmt: skip
    assert smax.shape == ssum.shape == (5, 2, 8) and (smax == smax[..., :1]).all()
    stored = (smax[..., 0] + ssum[..., 0].log()).reshape(-1)  # (T*Nq,) lse in storage order
    order = [(t, h) for t in range(5) for h in range(2)]
    if layout == "":
        order = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (4, 1)]
    assert_close(stored, torch.stack([want[t, h] for t, h in order]), torch.float64, "stored lse")


def _band_call(q, k, v, seq_q, seq_kv, pre, nxt, **kwargs):
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    return NpuOpsDouble().npu_fusion_attention(
        q, k, v, q.shape[1], "TND", scale=0.5, actual_seq_qlen=seq_q, actual_seq_kvlen=seq_kv,
        **{"atten_mask": mask, "sparse_mode": 4, "pre_tockens": pre, "next_tockens": nxt, **kwargs},
    )  # fmt: skip


def test_the_double_models_the_band_from_the_bottom_right_corner():
    """sparse_mode=4 pinned by hand: 2 queries over 4 keys with pre = next = 0 see only keys 2 and 3 (the
    bottom-right diagonal), so `out` is exactly their values; pre = 1 adds the key before. With q_len == kv_len
    the band is the oracle's window (left = pre, right = next)."""
    q, k, v = random_qkv(2, 2, 1, 4, seed=1)[0], *random_qkv(4, 2, 1, 4, seed=2)[1:]
    out, *_ = _band_call(q, k, v, [2], [4], 0, 0)
    assert torch.equal(out, v[[2, 3]].expand(2, 2, 4))
    out, *_ = _band_call(q, k, v, [2], [4], 1, 0)
    s = 0.5 * torch.einsum("hd,jd->hj", q[0], k[1:3, 0])  # (Nq, 2) row 0 over keys 1, 2
    assert_close(out[0], torch.softmax(s, -1) @ v[1:3, 0], torch.float64, "row 0 sees keys 1 and 2")
    q, k, v = random_qkv(12, 2, 1, 4, seed=3)
    cu = torch.tensor([0, 5, 12])
    out, smax, ssum, *_ = _band_call(q, k, v, [5, 12], [5, 12], 2, 1, softmax_layout="TND")
    want, want_lse = oracle.attention(q, k, v, cu, causal=False, scale=0.5, window=(2, 1))
    assert_close(out, want, torch.float64, "out")
    assert_close(smax[..., 0] + ssum[..., 0].log(), want_lse, torch.float64, "lse")


def test_the_double_leaves_rows_outside_their_band_undefined():
    """3 queries over 1 key, pre = next = 0: only the last row sees the key; the others are NaN in `out`
    and `dq`, and the sequence's `dk`, `dv` are NaN too (the documentation is silent about such rows)."""
    q, k, v = random_qkv(3, 2, 1, 4, seed=4)[0], *random_qkv(1, 2, 1, 4, seed=5)[1:]
    out, smax, ssum, *_ = _band_call(q, k, v, [3], [1], 0, 0)
    assert out[:2].isnan().all() and torch.equal(out[2], v[0].expand(2, 4))
    smax, ssum = smax.nan_to_num(0.0), ssum.nan_to_num(1.0)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    dq, dk, dv, _ = NpuOpsDouble().npu_fusion_attention_grad(
        q, k, v, out.nan_to_num(0.0), 2, "TND", atten_mask=mask, softmax_max=smax, softmax_sum=ssum,
        attention_in=out.nan_to_num(0.0), scale_value=0.5, actual_seq_qlen=[3], actual_seq_kvlen=[1], sparse_mode=4,
        pre_tockens=0, next_tockens=0,
    )  # fmt: skip
    assert dq[:2].isnan().all() and not dq[2].isnan().any() and dk.isnan().all() and dv.isnan().all()


def test_the_double_holds_the_band_to_its_documented_arguments():
    q, k, v = random_qkv(6, 2, 1, 4)
    _band_call(q, k, v, [2, 6], [2, 6], 1, 0)  # accepted
    with pytest.raises(ValueError, match="compressed"):
        _band_call(q, k, v, [2, 6], [2, 6], 1, 0, atten_mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="triu"):
        _band_call(q, k, v, [2, 6], [2, 6], 1, 0, atten_mask=torch.tril(torch.ones(2048, 2048, dtype=torch.bool)))
    with pytest.raises(ValueError, match="host ints"):
        _band_call(q, k, v, [2, 6], [2, 6], 1.0, 0)
    with pytest.raises(NotImplementedError, match="negative"):
        _band_call(q, k, v, [2, 6], [2, 6], 3, -1)  # documented (pre >= |next|), not modelled
    with pytest.raises(NotImplementedError, match="sparse_mode=0 with a mask"):
        _band_call(q, k, v, [2, 6], [2, 6], 1, 0, sparse_mode=0)  # a top-left band: not modelled
    full, *_ = _band_call(q, k, v, [2, 6], [2, 6], 0, 0, atten_mask=None)  # no mask: tokens ignored
    want, _ = oracle.attention(q, k, v, torch.tensor([0, 2, 6]), causal=False, scale=0.5)
    assert_close(full, want, torch.float64, "no mask is full attention")
