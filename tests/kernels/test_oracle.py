"""The FP64 oracle (`sim.oracle`) against an independently written per-document softmax.

The oracle builds one `(T, T)` mask over the packed stream; the reference here never does:
it loops over documents and heads, slices each document out, and computes the log-sum-exp
from its own max-shifted formula. Agreement of the two is what makes the oracle trusted.
"""

from __future__ import annotations

import pytest
import torch

from sim import oracle
from tests.helpers import assert_close, cu_from_lengths, random_qkv

F64 = torch.float64

# (Hq, Hkv, D, Dv): MHA, GQA, MQA, MLA-style head dims
HEADS = [(2, 2, 8, 8), (4, 2, 8, 8), (3, 1, 8, 8), (4, 2, 12, 6)]
LENGTHS = [[7], [5, 1, 9, 3], [1, 1, 1]]


def per_document(q, k, v, cu, *, causal, scale):
    """Attention document by document and head by head, in float64 (differentiable)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    outs, lses = [], []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        n = stop - start
        out_doc, lse_doc = [], []
        for h in range(q.shape[1]):
            qd, kd, vd = q[start:stop, h], k[start:stop, h // group], v[start:stop, h // group]  # (n, D), (n, Dv)
            s = scale * qd @ kd.T  # (n, n)
            if causal:
                s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))  # (n, n)
            # lse = m + log sum exp(s - m), written out rather than torch.logsumexp
            m = s.max(dim=-1, keepdim=True).values  # (n, 1)
            lse_doc.append((m + (s - m).exp().sum(-1, keepdim=True).log()).squeeze(-1))  # (n,)
            out_doc.append(torch.softmax(s, dim=-1) @ vd)  # (n, Dv)
        outs.append(torch.stack(out_doc, dim=1))  # (n, Hq, Dv)
        lses.append(torch.stack(lse_doc, dim=1))  # (n, Hq)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_forward_matches_per_document_softmax(lengths, heads, causal):
    hq, hkv, d, dv = heads
    cu = cu_from_lengths(lengths)
    q, k, v = random_qkv(int(cu[-1]), hq, hkv, d, dv, seed=len(lengths))
    out, lse = oracle.attention(q, k, v, cu, causal=causal, scale=0.3)
    ref_out, ref_lse = per_document(q, k, v, cu, causal=causal, scale=0.3)
    assert out.dtype == lse.dtype == F64
    assert out.shape == (q.shape[0], hq, dv) and lse.shape == (q.shape[0], hq)
    assert_close(out, ref_out, F64, "out")
    assert_close(lse, ref_lse, F64, "lse")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS)
def test_forward_backward_matches_autograd_of_per_document_softmax(heads, causal):
    hq, hkv, d, dv = heads
    cu = cu_from_lengths([6, 1, 10])
    q, k, v = random_qkv(17, hq, hkv, d, dv, seed=3)
    dout = torch.randn(17, hq, dv, generator=torch.Generator().manual_seed(4), dtype=F64)
    out, lse, dq, dk, dv_ = oracle.forward_backward(q, k, v, cu, dout, causal=causal, scale=0.4)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref_out, ref_lse = per_document(*leaves, cu, causal=causal, scale=0.4)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad_outputs=dout)
    assert_close(out, ref_out, F64, "out")
    assert_close(lse, ref_lse, F64, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref_grads):
        assert got.dtype == F64 and got.shape == want.shape
        assert_close(got, want, F64, name)


def test_visibility_mask_spelled_out():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    causal = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    full = [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert oracle.visibility_mask(cu, causal=True).tolist() == [[bool(x) for x in row] for row in causal]
    assert oracle.visibility_mask(cu, causal=False).tolist() == [[bool(x) for x in row] for row in full]


def test_default_scale_and_low_precision_inputs_upcast():
    cu = cu_from_lengths([4, 3])
    q, k, v = random_qkv(7, 2, 1, 16, dtype=torch.bfloat16, seed=5)
    out, lse = oracle.attention(q, k, v, cu)
    ref_out, ref_lse = per_document(q, k, v, cu, causal=True, scale=16**-0.5)
    assert out.dtype == lse.dtype == F64
    assert_close(out, ref_out, F64, "out")
    assert_close(lse, ref_lse, F64, "lse")


def test_single_token_document_returns_its_value():
    q, k, v = random_qkv(1, 2, 2, 4, seed=6)
    out, lse = oracle.attention(q, k, v, torch.tensor([0, 1]), scale=0.5)
    assert_close(out, v, F64, "out = v")
    assert_close(lse, 0.5 * (q * k).sum(-1), F64, "lse = s q.k")


# ---- the variants (issue 45): each against a second, independent statement of its definition ----------------------
def test_chunked_attention_is_causal_attention_over_the_documents_cut_at_every_chunk():
    q, k, v = random_qkv(23, 4, 2, 8)
    got, _ = oracle.attention(q, k, v, torch.tensor([0, 13, 23]), chunk=5)
    want, _ = oracle.attention(q, k, v, torch.tensor([0, 5, 10, 13, 18, 23]))  # 13 = 5 + 5 + 3, 10 = 5 + 5
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    longer, _ = oracle.attention(q, k, v, torch.tensor([0, 13, 23]), chunk=13)  # no document reaches a second chunk
    torch.testing.assert_close(longer, oracle.attention(q, k, v, torch.tensor([0, 13, 23]))[0], atol=0, rtol=0)


def test_sinks_join_the_denominator_once_and_carry_no_value():
    q, k, v = random_qkv(12, 4, 2, 8)
    cu, sinks = torch.tensor([0, 7, 12]), torch.tensor([-3.0, 0.0, 5.0, 20.0], dtype=torch.float64)
    out, lse = oracle.attention(q, k, v, cu, sinks=sinks)
    plain, plain_lse = oracle.attention(q, k, v, cu)
    want_lse = torch.log(torch.exp(plain_lse) + torch.exp(sinks)[None])  # (T, Hq)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out, plain * torch.exp(plain_lse - want_lse)[..., None], atol=1e-12, rtol=1e-12)


def test_the_sinks_gradient_is_the_formula_of_the_page():
    q, k, v = random_qkv(12, 4, 2, 8)
    dout = random_qkv(12, 4, 4, 8, seed=1)[0]
    cu, sinks = torch.tensor([0, 7, 12]), torch.tensor([-3.0, 0.0, 5.0, 20.0], dtype=torch.float64)
    out, lse, *_, dsinks = oracle.forward_backward(q, k, v, cu, dout, sinks=sinks)
    want = -(torch.exp(sinks[None] - lse) * (dout * out).sum(-1)).sum(0)  # -sum_x e^(s - lse') (dO . o')
    torch.testing.assert_close(dsinks, want, atol=1e-12, rtol=1e-12)


def test_soft_capping_squashes_every_score_before_the_mask():
    q, k, v = random_qkv(9, 2, 2, 4)
    scores = 10 * torch.einsum("xhd,yhd->hxy", q, k)  # (H, T, T)
    capped = 3.0 * torch.tanh(scores / 3.0)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = torch.einsum("hxy,yhd->xhd", torch.softmax(capped.masked_fill(~causal, float("-inf")), -1), v)
    got, _ = oracle.attention(q, k, v, torch.tensor([0, 9]), scale=10.0, softcap=3.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
