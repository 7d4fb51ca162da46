"""The kernel-level variants against the FP64 oracle: soft-capping in every call of TorchKernel (explicit path; the
fast path hands soft-capped calls to it), CudaKernel's rule for it, and learnable sinks added once to a call's
`(out, lse)` (`cpref.kernels.sinks`), with their gradient.

Self-attention over packed documents, so the oracle compares directly; windows and GQA included; float64 at 1e-10,
the low-precision dtypes at their stated tolerance against the oracle on the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from cpref.base.errors import CPInputError
from cpref.kernels import CudaKernel, TorchKernel, Varlen
from cpref.kernels.contract import check_softcap
from cpref.kernels.sinks import add_sinks, sinks_grad
from sim import oracle
from tests.helpers import assert_close, attention_inputs, cu_from_lengths

LENGTHS = [37, 5, 64, 1]  # documents: a long one over several blocks, short ones, a single token
HEADS = {"gqa": (8, 2, 16, 16), "mla": (4, 2, 24, 16)}
KERNELS = {"explicit": TorchKernel(fast=False, max_block_elements=4096), "fast": TorchKernel()}
NAMES = ("out", "lse", "dq", "dk", "dv")


def run(kernel, q, k, v, dout, cu, *, causal, window, softcap=None, sinks=None, full_rows=False, scale=None):
    """The kernel's `(out, lse, dq, dk, dv[, dsinks])` over the documents of `cu`, sinks added as a mode adds them."""
    seqs, scale = Varlen(cu.tolist()), scale or q.shape[-1] ** -0.5
    capped = {} if softcap is None else {"softcap": softcap}
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = kernel.forward(q, k, v, seqs, causal=causal, scale=scale, window=window, out_dtype=cdt, **capped)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=scale, window=window,
                                 full_rows=full_rows, **capped)  # fmt: skip
    grads = () if sinks is None else (sinks_grad(dout, out, lse, sinks),)
    return (out, lse, dq, dk, dv, *grads)


@pytest.mark.sweep
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (9, 0)), (False, (-1, -1)), (False, (4, 6))])
@pytest.mark.parametrize("softcap", [2.0, 8.0])
@pytest.mark.parametrize("full_rows", [False, True])
def test_soft_capped_logits_match_the_oracle(kernel, dtype, heads, causal, window, softcap, full_rows):
    """At 3 times the default scale, where a cap of 2 squashes most logits and one of 8 the largest (the CP tests hold
    every mode to this kernel without CP at x30 and x1000, `tests/cp/test_variants_precision.py`)."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v, dout = attention_inputs(int(cu[-1]), HEADS[heads], dtype=dtype)
    scale = 3 * q.shape[-1] ** -0.5
    got = run(KERNELS[kernel], q, k, v, dout, cu, causal=causal, window=window, softcap=softcap, full_rows=full_rows,
              scale=scale)  # fmt: skip
    want = oracle.forward_backward(q, k, v, cu, dout, causal=causal, window=window, softcap=softcap, scale=scale)
    for name, g, w in zip(NAMES, got, want):
        assert_close(g, w, dtype, f"{name} softcap={softcap}")


def test_soft_capping_changes_the_result_and_its_gradient():
    """The cap is applied (a kernel ignoring it would pass a test at a cap no logit reaches) and differentiated (a
    backward without 1 - tanh^2 gives the uncapped gradients)."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v, dout = attention_inputs(int(cu[-1]), HEADS["gqa"])
    capped = run(KERNELS["explicit"], q, k, v, dout, cu, causal=True, window=(-1, -1), softcap=1.0, scale=3.0)
    plain = run(KERNELS["explicit"], q, k, v, dout, cu, causal=True, window=(-1, -1), scale=3.0)
    for name, c, p in zip(NAMES, capped, plain):
        assert (c - p).abs().max() > 1e-2, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sink_scale", [0.0, 1.0, 20.0])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (3, 3))])
def test_sinks_added_to_a_calls_result_are_the_oracles(dtype, sink_scale, causal, window):
    """Sinks of 0, of N(0, 1) and about 20 (a sink that takes nearly all of a row's mass: a small one hides bugs)."""
    cu = cu_from_lengths(LENGTHS)
    q, k, v, dout = attention_inputs(int(cu[-1]), HEADS["gqa"], dtype=dtype)
    sinks = (sink_scale * torch.linspace(-1, 1, 8) + (20.0 if sink_scale == 20.0 else 0.0)).double()  # (Hq,)
    got = run(KERNELS["explicit"], q, k, v, dout, cu, causal=causal, window=window, sinks=sinks)
    want = oracle.forward_backward(q, k, v, cu, dout, causal=causal, window=window, sinks=sinks)
    for name, g, w in zip((*NAMES, "dsinks"), got, want):
        tol = 1e-10 if dtype == torch.float64 else 2.5e-2
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_row_that_sees_no_key_gets_the_sink_alone():
    """lse' = s, out' = 0, and no gradient flows from it (its Delta is 0)."""
    q, k, v, dout = attention_inputs(6, HEADS["gqa"])
    seqs = Varlen([0, 2, 6], [0, 0, 4])  # sequence 0: two queries, no key
    out, lse = TorchKernel(fast=False).forward(q, k[:4], v[:4], seqs, causal=False, scale=0.3, out_dtype=torch.float64)
    sinks = torch.full((8,), 5.0, dtype=torch.float64)
    out, lse = add_sinks(out, lse, sinks)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(lse[:2], torch.full_like(lse[:2], 5.0))
    dq, dk, dv = TorchKernel(fast=False).backward(dout, q, k[:4], v[:4], out, lse, seqs, causal=False, scale=0.3)
    assert torch.equal(dq[:2], torch.zeros_like(dq[:2]))
    only_keyless = sinks_grad(dout[:2], out[:2], lse[:2], sinks)
    assert torch.equal(only_keyless, torch.zeros_like(only_keyless))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "50", True])
def test_a_softcap_that_is_not_a_finite_positive_number_is_refused(bad):
    with pytest.raises(CPInputError, match="softcap=.* must be a finite number > 0"):
        check_softcap(bad)
    q, k, v, _ = attention_inputs(4, HEADS["gqa"])
    with pytest.raises(CPInputError, match="softcap="):
        TorchKernel().forward(q, k, v, Varlen([0, 4]), causal=True, scale=1.0, softcap=bad)


def test_cuda_kernel_hands_soft_capped_calls_to_its_fallback():
    """Flash has no soft-capping: such a call takes the fallback, named so, and the kernel lists the fallback's
    variants (`cpref.attention` refuses a variant the kernel does not list)."""
    from tests.kernels.flash_double import FlashOpsDouble

    kernel = CudaKernel(ops=FlashOpsDouble(), devices=("cpu",))
    q, k, v, dout = attention_inputs(8, (4, 2, 16, 16), dtype=torch.bfloat16)
    assert kernel.path(q, k, v, Varlen([0, 8]), 30.0).startswith("softcap 30.0")
    assert kernel.variants == TorchKernel.variants == frozenset({"softcap"})
    out, lse = kernel.forward(q, k, v, Varlen([0, 8]), causal=True, scale=0.25, softcap=30.0)
    kernel.backward(dout, q, k, v, out, lse, Varlen([0, 8]), causal=True, scale=0.25, softcap=30.0)
    assert kernel.calls == {"fallback forward": 1, "fallback backward": 1}
