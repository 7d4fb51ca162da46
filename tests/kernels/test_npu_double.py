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
