"""What the tests of a kernel against a CPU double of its op share (`test_npu_contract`, `test_cuda_contract`)."""

from __future__ import annotations

import pytest
import torch

from cpref.kernels import Varlen


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and much faster on a busy machine (autouse where imported)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(kernel, q, k, v, seqs, dout, *, causal, scale, window=(-1, -1)):
    """`(out, lse, dq, dk, dv)` from the kernel's forward and backward."""
    out, lse = kernel.forward(q, k, v, seqs, causal=causal, scale=scale, window=window)
    return (out, lse, *kernel.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=scale, window=window))


def check_global_lse_share(kernel, q, k, v, dout, q_lens, early, kv_lens, d):
    """The ring case: each query chunk's keys in two calls, an earlier block (`early` keys, no mask) and its own
    (causal diagonal), merged by lse; the backward with the *global* out and lse gives gradients that sum to the
    oracle's for the whole row (float64 inputs)."""
    from tests.helpers import assert_close, cu_from_lengths
    from tests.kernels.test_torch_kernel import reference

    starts = cu_from_lengths(kv_lens).tolist()
    rows_a = [j for s, e in zip(starts, early) for j in range(s, s + e)]  # earlier keys
    rows_b = [j for s, e, m in zip(starts, early, q_lens) for j in range(s + e, s + e + m)]  # diagonal
    seqs_a, seqs_b, scale = Varlen.from_lengths(q_lens, early), Varlen.from_lengths(q_lens, q_lens), d**-0.5
    o_a, l_a = kernel.forward(q, k[rows_a], v[rows_a], seqs_a, causal=False, scale=scale)
    o_b, l_b = kernel.forward(q, k[rows_b], v[rows_b], seqs_b, causal=True, scale=scale)
    # lse = log(e^lse_a + e^lse_b); out = sum of e^(lse_x - lse) out_x
    lse = torch.logaddexp(l_a, l_b)  # (T, Hq): -inf in neither (every row sees its diagonal)
    out = (l_a - lse).exp().unsqueeze(-1) * o_a + (l_b - lse).exp().unsqueeze(-1) * o_b  # (T, Hq, Dv)
    dq_a, dk_a, dv_a = kernel.backward(dout, q, k[rows_a], v[rows_a], out, lse, seqs_a, causal=False, scale=scale)
    dq_b, dk_b, dv_b = kernel.backward(dout, q, k[rows_b], v[rows_b], out, lse, seqs_b, causal=True, scale=scale)
    dk, dv_ = torch.zeros_like(k), torch.zeros_like(v)
    dk[rows_a], dk[rows_b], dv_[rows_a], dv_[rows_b] = dk_a, dk_b, dv_a, dv_b
    want = reference(q, k, v, cu_from_lengths(q_lens), cu_from_lengths(kv_lens), dout, causal=True, scale=scale)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq_a + dq_b, dk, dv_), want):
        assert_close(g, w, torch.float64, name)
