"""Contract test of `CudaKernel`: the adapter driven end to end against a CPU double of PyTorch's flash ops.

`tests/kernels/flash_double.py` models `torch.ops.aten._flash_attention_forward` and
`_flash_attention_backward` from their schemas and FlashAttention's documented semantics, and
rejects what the real ops reject; these tests check that `CudaKernel` builds valid arguments
(cumulative lengths, maxima, the causal flag, the window, the scale), pads `Dv < D`, turns the
op's `+inf` lse of rows that see no key into the contract's `-inf` and back, and so matches the
FP64 oracle at 1e-10 in float64 (an extension of the double), with windows `TorchKernel`'s
explicit path; and that what flash cannot take goes to the fallback, by the stated rule.
Whether the GPU behaves as documented is `bench/gpu_check.sh`'s to check, on a machine with one.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.kernels import AttentionKernel, CudaKernel, TorchKernel, Varlen, default_kernel
from sim.cluster.harness import oracle_shards, run_attention
from tests.helpers import assert_close, cu_from_lengths, random_qkv
from tests.kernels.double_helpers import check_global_lse_share, one_thread, run  # noqa: F401 (one_thread: autouse)
from tests.kernels.flash_double import FlashOpsDouble
from tests.kernels.test_torch_kernel import HEADS, check_owned_results, reference

EXPLICIT = TorchKernel(fast=False)
ON_CPU = dict(devices=("cpu",), flash_dtypes=(torch.float64, torch.bfloat16, torch.float16))  # the double runs here


def kernel_on_cpu(**kwargs) -> tuple[CudaKernel, FlashOpsDouble]:
    double = FlashOpsDouble()
    return CudaKernel(ops=double, **{**ON_CPU, **kwargs}), double


def inputs(q_lens, kv_lens, heads, dtype=torch.float64, seed=0):
    hq, hkv, d, dv = heads
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, dtype=dtype, seed=seed)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, dtype=dtype, seed=seed + 1)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, dtype=dtype, seed=seed + 2)[0]
    return q, k, v, dout


def check(q_lens, kv_lens, heads=HEADS["gqa"], dtype=torch.float64, *, causal, seed=0):
    """CudaKernel over the double vs the oracle on random data; returns the results and the double."""
    kernel, double = kernel_on_cpu()
    q, k, v, dout = inputs(q_lens, kv_lens, heads, dtype, seed)
    scale = heads[2] ** -0.5
    got = run(kernel, q, k, v, Varlen.from_lengths(q_lens, kv_lens), dout, causal=causal, scale=scale)
    want = reference(q.double(), k.double(), v.double(), cu_from_lengths(q_lens), cu_from_lengths(kv_lens), dout.double(),
                     causal=causal, scale=scale)  # fmt: skip
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, g, w, like in zip(("out", "lse", "dq", "dk", "dv"), got, want, (dout, None, q, k, v)):
        assert g.dtype == (stat_dtype if like is None else like.dtype) and g.shape == w.shape, name
        assert not g.isnan().any(), name
        assert_close(g, w, dtype, name)
    assert kernel.calls == ({"flash forward": 1, "flash backward": 1})
    return got, double


def test_satisfies_the_contract():
    assert isinstance(kernel_on_cpu()[0], AttentionKernel)


@pytest.mark.parametrize("lengths", [[24], [10, 14]], ids=["one-sequence", "several"])
def test_results_belong_to_the_caller(lengths):
    check_owned_results(kernel_on_cpu()[0], lengths, torch.float64)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_packed_documents_match_the_oracle(heads, causal):
    """MHA, GQA, MQA and Dv < D (MLA: V padded from 128 to 192 for the op, cut back after)."""
    _, double = check([12, 16, 1, 19, 1], [12, 16, 1, 19, 1], heads, causal=causal)
    fwd, bwd = double.calls
    assert fwd["op"] == "forward" and bwd["op"] == "backward"
    assert fwd["causal"] == bwd["causal"] == causal and fwd["band"] == bwd["band"] == ((-1, 0) if causal else (-1, -1))
    assert fwd["scale"] == bwd["scale"] == heads[2] ** -0.5
    assert fwd["max"] == bwd["max"] == (19, 19) and fwd["sequences"] == 5  # the longest, exactly


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fewer_queries_than_keys_is_bottom_right(causal):
    _, double = check([10, 1, 33], [40, 25, 33], causal=causal)
    assert double.calls[0]["max"] == (33, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_matches_the_oracle_at_its_tolerance(dtype):
    check([12, 16, 19], [12, 20, 19], HEADS["mla"], dtype, causal=True)


def test_rows_that_see_no_key_give_zero_and_minus_inf_and_no_nan_in_the_backward():
    """Sequence 0: 7 of 12 rows see no key (causal, q > kv); sequence 2: no keys. The plan splits those rows off into
    sequences without keys, whose values (NaN in the double: undocumented) are overwritten, and whose lse goes back
    to the op finite (the double refuses -inf)."""
    (out, lse, dq, dk, dv), _ = check([12, 5, 3, 4], [5, 5, 0, 4], causal=True)
    dead = torch.tensor([*range(7), 17, 18, 19])
    assert (out[dead] == 0).all() and (lse[dead] == float("-inf")).all() and (dq[dead] == 0).all()
    assert lse[[i for i in range(24) if i not in dead.tolist()]].isfinite().all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_empty_sequences(causal):
    (out, lse, *_), _ = check([0, 4, 0, 6, 0], [3, 0, 0, 6, 2], causal=causal)
    assert (out[:4] == 0).all() and (lse[:4] == float("-inf")).all()


@pytest.mark.parametrize("lengths", [([0], [0]), ([5, 2], [0, 0])], ids=["nothing", "no-keys"])
def test_a_call_without_keys_skips_the_op(lengths):
    kernel, double = kernel_on_cpu()
    q, k, v, dout = inputs(*lengths, HEADS["gqa"])
    out, lse, dq, dk, dv = run(kernel, q, k, v, Varlen.from_lengths(*lengths), dout, causal=True, scale=0.3)
    assert double.calls == [] and (out == 0).all() and (lse == float("-inf")).all() and (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
def test_global_lse_backward_gives_the_share_of_the_row(heads):
    """The ring case: each query chunk's keys in two calls (earlier keys without a mask, its own causal), merged by
    lse; the backward with the global out and lse gives gradients that sum to the oracle's for the whole row."""
    hq, hkv, d, dv = heads
    kernel = kernel_on_cpu()[0]
    q_lens, early = [6, 9, 4], [10, 0, 3]
    kv_lens = [m + e for m, e in zip(q_lens, early)]
    q, k, v, dout = inputs(q_lens, kv_lens, heads, seed=3)
    check_global_lse_share(kernel, q, k, v, dout, q_lens, early, kv_lens, d)


WINDOWS = [(True, (0, 0)), (True, (1, 0)), (True, (3, 0)), (True, (40, 0)), (False, (0, 0)), (False, (2, 2)),
           (False, (1, 4)), (False, (4, 1)), (False, (-1, 2)), (False, (3, -1))]  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
@pytest.mark.parametrize("causal, window", WINDOWS, ids=[f"{'causal' if c else 'full'}{w}" for c, w in WINDOWS])
def test_windows_match_the_contract(causal, window, heads):
    """Bottom-right sequences (more queries than keys, fewer, one, none, no keys) under every kind of window, against
    the explicit path (itself checked against a dense oracle of the contract's rule, tests/cp/test_windows.py)."""
    q_lens, kv_lens = [7, 12, 1, 9, 0, 5], [7, 5, 4, 14, 3, 0]
    kernel, double = kernel_on_cpu()
    q, k, v, dout = inputs(q_lens, kv_lens, heads)
    seqs, kwargs = Varlen.from_lengths(q_lens, kv_lens), dict(causal=causal, scale=heads[2] ** -0.5, window=window)
    got, want = run(kernel, q, k, v, seqs, dout, **kwargs), run(EXPLICIT, q, k, v, seqs, dout, **kwargs)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not g.isnan().any(), name
        assert_close(g, w, torch.float64, f"{name} causal={causal} window={window}")
    assert {c["band"] for c in double.calls} == {window} and kernel.calls["flash forward"] == 1


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (2, 0)), (False, (1, 3)), (False, (-1, -1))])
def test_explicit_shifts_become_bands_of_the_bottom_right_corner(causal, window):
    """A ring or all-gather plan gives sequences a shift: each becomes the band of its corner, one call per band."""
    kernel, double = kernel_on_cpu()
    q_lens, kv_lens, shifts = [4, 4, 5, 3], [6, 6, 9, 2], [0, 5, 3, 4]
    q, k, v, dout = inputs(q_lens, kv_lens, HEADS["mla"])
    seqs = Varlen.from_lengths(q_lens, kv_lens, shifts)
    got = run(kernel, q, k, v, seqs, dout, causal=causal, scale=0.3, window=window)
    want = run(EXPLICIT, q, k, v, seqs, dout, causal=causal, scale=0.3, window=window)
    assert kernel.calls == {"flash forward": 1, "flash backward": 1}
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not g.isnan().any(), name
        assert_close(g, w, torch.float64, name)
    bands = [c["band"] for c in double.calls if c["op"] == "forward"]
    if causal or window != (-1, -1):  # the shifts differ: one call per band
        assert len(bands) > 1 and all(left >= 0 or left == -1 for left, _ in bands)
    else:  # full attention: a shift changes nothing, one call
        assert bands == [(-1, -1)]


@pytest.mark.parametrize("dtype, d, device, why", [
    (torch.float32, 32, "cuda", "dtype torch.float32"),
    (torch.float64, 32, "cuda", "dtype torch.float64"),
    (torch.bfloat16, 12, "cuda", "head dim 12"),
    (torch.bfloat16, 264, "cuda", "head dim 264"),
    (torch.bfloat16, 32, "cpu", "device cpu"),
])  # fmt: skip
def test_the_path_rule_names_why_a_call_takes_the_fallback(dtype, d, device, why):
    kernel = CudaKernel(ops=FlashOpsDouble())  # the default rule: CUDA, float16 / bfloat16
    q = torch.empty(4, 2, d, dtype=dtype, device="meta")
    fake = type("T", (), {"device": torch.device(device), "dtype": dtype, "shape": q.shape})()
    assert kernel.path(fake, fake, fake, Varlen([0, 4])).startswith(why)
    ok = type("T", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16, "shape": (4, 2, 256)})()
    assert kernel.path(ok, ok, ok, Varlen([0, 4])) == "flash"


def test_a_float32_call_on_the_cpu_runs_the_fallback_with_the_same_results():
    kernel, double = kernel_on_cpu(flash_dtypes=(torch.bfloat16,))
    q, k, v, dout = inputs([9, 7], [9, 7], HEADS["gqa"])
    seqs = Varlen.from_lengths([9, 7], [9, 7])
    got, want = run(kernel, q, k, v, seqs, dout, causal=True, scale=0.3), run(EXPLICIT, q, k, v, seqs, dout, causal=True, scale=0.3)
    assert double.calls == [] and kernel.calls == {"fallback forward": 1, "fallback backward": 1}
    assert all(torch.allclose(g, w, atol=1e-12) for g, w in zip(got, want))


def test_an_unrounded_output_is_rounded_for_the_op_and_results_are_upcast_on_request():
    """The ring passes its merged output in float32; the op takes one dtype, so the kernel rounds it first (the
    gradients are those of the rounded output, bit for bit); out_dtype / grad_dtype return the op's results upcast."""
    kernel, seqs = kernel_on_cpu()[0], Varlen.from_lengths([10, 14], [10, 14])
    q, k, v, dout = inputs([10, 14], [10, 14], (4, 2, 8, 8), torch.bfloat16)
    out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=0.3, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    wide = kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.3)
    rounded = kernel.backward(dout, q, k, v, out.to(torch.bfloat16), lse, seqs, causal=True, scale=0.3)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(wide, rounded))
    upcast = kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.3, grad_dtype=torch.float32)
    assert all(a.dtype == torch.float32 and torch.equal(a, b.float()) for a, b in zip(upcast, wide))


def test_ops_without_the_flash_functions_are_refused():
    with pytest.raises(CPInputError, match="has no function _flash_attention_forward"):
        CudaKernel(ops=object())


def test_the_default_kernel_is_flash_on_cuda_and_torch_elsewhere():
    assert isinstance(default_kernel(torch.device("cuda", 0)), CudaKernel)
    assert isinstance(default_kernel(torch.device("cpu")), TorchKernel)


@pytest.mark.parametrize("mode, window", [("all_gather", (-1, -1)), ("p2p", (-1, -1)), ("a2a", (-1, -1)),
                                          ("p2p", (5, 0)), ("all_gather", (5, 0))])  # fmt: skip
@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_the_modes_run_on_the_kernel_rank_by_rank(mode, window, layout):
    """Every rank's out, dq, dk, dv against the FP64 oracle with one CudaKernel (over the double) shared by the ranks;
    the ring under a window and the balanced all-gather make shifted calls, which become bands."""
    P = 2
    sharding = cpref.Sharding(cu_from_lengths([24, 40, 8]), cp_size=P, layout=layout)
    q, k, v, dout = inputs([72], [72], (4, 2, 16, 8))
    kernel = kernel_on_cpu()[0]
    results, _ = run_attention(q, k, v, dout, sharding, mode=mode, window=window, kernels=[kernel] * P)
    for r, (got, want) in enumerate(zip(results, oracle_shards(q, k, v, dout, sharding, window=window))):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")
    assert kernel.calls["flash forward"] > 0
