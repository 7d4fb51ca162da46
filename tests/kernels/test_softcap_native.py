"""The compiled soft-capping loops (`cpref.kernels.softcap_native`): each against FP64 and against the PyTorch passes
it replaces, -inf masks and row tails included; independent of the thread count; the kernel calls them once per
block; where they cannot be built the reason is named and TorchKernel takes the PyTorch passes, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.kernels import TorchKernel, Varlen
from cpref.kernels import softcap_native as native

pytestmark = pytest.mark.skipif(native.library()[0] is None, reason=f"not built here: {native.library()[1]}")
EPS = torch.finfo(torch.float32).eps


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of float32 `got` against float64 `want`, in float32 ulps of `want`."""
    spacing = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny).float().double()
    return ((got.double() - want).abs() / spacing).max().item()


def bounds(arg: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """float32's error in `2^arg`: the argument rounded once (`b t - m` is one fused multiply-add: half an ulp of
    `|arg|`, times ln 2 in the result) and `exp2f`'s own 1 ulp, plus half an ulp for the result's rounding; a
    subnormal result has its own absolute step, 2^-149."""
    return (arg.abs().nan_to_num(0.0) * math.log(2) * EPS / 2 + 1.5 * EPS) * want + 2.0**-149


def masked_block(rows: int, cols: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """`(2, rows, cols)` float32 tanh-range values, some -inf (never a whole row), like a masked capped block."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(2, rows, cols, generator=g).mul_(2).sub_(1).mul_(scale)
    hidden = torch.rand(2, rows, cols, generator=g) < 0.3
    hidden[..., 0] = False
    return t.masked_fill_(hidden, float("-inf"))


def test_tanh_is_within_one_and_a_half_ulp_of_fp64_and_its_slope_is_one_minus_its_square():
    """Logits from 1e-30 to 1e4 of both signs, 0, and a length that leaves a tail of the vector loop."""
    x = torch.cat([torch.logspace(-30, 4, 4001), -torch.logspace(-30, 4, 4001), torch.zeros(3), torch.randn(997) * 3])
    t, slope = x.clone(), torch.empty_like(x)
    native.cap_tanh(t, slope)
    assert ulps(t, torch.tanh(x.double())) <= 1.5
    assert (t.abs() <= 1).all() and (t[x == 0] == 0).all()
    torch.testing.assert_close(slope, 1 - t * t, rtol=0, atol=torch.finfo(torch.float32).eps)  # t from the loop itself


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 67), b=st.floats(0.1, 80.0), seed=st.integers(0, 2**16))
def test_softmax_rows_match_fp64(rows, cols, b, seed):
    """m = b max t exactly; p = 2^(b t - m) and l = sum p at float32 rounding; p = 0 exactly where t = -inf."""
    t, b = masked_block(rows, cols, seed), float(torch.tensor(b, dtype=torch.float32))  # b travels as a float32
    p = t.clone()
    m, el = native.cap_softmax(p, b)
    assert torch.equal(m, t.amax(-1, keepdim=True) * b)
    arg = b * t.double() - m.double()
    want = torch.exp2(arg)
    bound = bounds(arg, want)
    assert ((p.double() - want).abs() <= bound).all()
    assert ((el.double() - want.sum(-1, keepdim=True)).abs() <= bound.sum(-1, keepdim=True) + cols * EPS * el).all()
    assert (p[t == float("-inf")] == 0).all()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 67), b=st.floats(0.1, 80.0), seed=st.integers(0, 2**16))
def test_probs_rows_match_fp64_with_a_strided_lse(rows, cols, b, seed):
    """p = 2^(b t - lse2) per row; lse2 given as a slice of a longer run (not contiguous across heads)."""
    t, b = masked_block(rows, cols, seed), float(torch.tensor(b, dtype=torch.float32))
    lse2 = (torch.randn(2, 3 * rows, 1, generator=torch.Generator().manual_seed(seed)) * 5)[:, rows : 2 * rows]  # (2, R, 1)
    p = native.cap_probs(t.clone(), b, lse2)
    arg = b * t.double() - lse2.double()
    want = torch.exp2(arg)
    assert ((p.double() - want).abs() <= bounds(arg, want)).all()


@pytest.mark.parametrize("given_delta", [True, False])
def test_ds_rows_match_fp64(given_delta):
    """dS = P o (dP - Delta) o slope; Delta = rowsum(P o dP) where none is given (whole rows)."""
    g = torch.Generator().manual_seed(3)
    p, dp, slope = torch.rand(2, 7, 45, generator=g), torch.randn(2, 7, 45, generator=g), torch.rand(2, 7, 45, generator=g)
    delta = torch.randn(2, 7, 1, generator=g) if given_delta else None
    want_delta = delta.double() if given_delta else (p.double() * dp.double()).sum(-1, keepdim=True)
    want = p.double() * (dp.double() - want_delta) * slope.double()
    got = native.cap_ds(dp.clone(), p, slope, delta)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-6 * want.abs().max().item())


def test_results_do_not_depend_on_the_thread_count():
    """Every row is one thread's, summed in one order: 1 thread and 2 give the same bits."""
    t, dp = masked_block(300, 513, 7, scale=1.0), torch.randn(2, 300, 513)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            s, slope = t.clone().nan_to_num_(neginf=0.5), torch.empty_like(t)
            native.cap_tanh(s, slope)
            p = t.clone()
            m, el = native.cap_softmax(p, 30.0)
            results.append((s, slope, p, m, el, native.cap_ds(dp.clone(), p, slope, None)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_wrong_blocks_are_refused_by_name():
    t = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="t: the compiled loops need contiguous float32 CPU blocks, got torch.float64"):
        native.cap_softmax(t.double(), 1.0)
    with pytest.raises(ValueError, match="contiguous=False"):
        native.cap_probs(t.transpose(1, 2), 1.0, torch.zeros(2, 4, 1))
    with pytest.raises(ValueError, match=r"slope \(2, 3, 5\) must have the scores' shape \(2, 3, 4\)"):
        native.cap_tanh(t, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="lse2 has 5 rows, the block 6"):
        native.cap_probs(t, 1.0, torch.zeros(5, 1))


def run_capped(kernel: TorchKernel, dtype=torch.float32):
    """`(out, lse, dq, dk, dv)` of a soft-capped causal GQA call over three documents, logits up to ~30."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(150, 4, 16, generator=g, dtype=dtype) * 2 for _ in range(2))
    k, v = (torch.randn(150, 2, 16, generator=g, dtype=dtype) * 2 for _ in range(2))
    seqs = Varlen([0, 40, 41, 150])
    out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=0.25, window=(20, 0), softcap=8.0)
    return (out, lse, *kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.25, window=(20, 0), softcap=8.0))


def test_the_kernel_calls_each_loop_once_per_block(monkeypatch):
    """Forward: cap_tanh and cap_softmax once a block; backward: cap_tanh, cap_probs and cap_ds once a block."""
    calls = []
    for name in ("cap_tanh", "cap_softmax", "cap_probs", "cap_ds"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    kernel = TorchKernel(max_block_elements=2048)
    q = torch.empty(150, 4, 1)
    blocks, _ = kernel._blocks(q, Varlen([0, 40, 41, 150]), True, (20, 0))
    run_capped(kernel)
    n = len(blocks)
    assert n > 3 and sorted(calls) == sorted(["cap_tanh"] * 2 * n + ["cap_softmax", "cap_probs", "cap_ds"] * n)


def test_the_loops_agree_with_the_pytorch_passes_and_fast_false_takes_those():
    """TorchKernel() (the loops) against TorchKernel(fast=False) (PyTorch's passes): equal to float32 rounding, and
    not bit for bit (the loops did run)."""
    fast, reference = run_capped(TorchKernel()), run_capped(TorchKernel(fast=False))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fast, reference):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=name)
    assert not all(torch.equal(a, b) for a, b in zip(fast, reference))


def test_without_the_library_the_kernel_takes_the_pytorch_passes_bit_for_bit(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: (None, "not built in this test"))
    assert not native.usable(torch.zeros(1))
    assert all(torch.equal(a, b) for a, b in zip(run_capped(TorchKernel()), run_capped(TorchKernel(fast=False))))


def test_float64_blocks_keep_the_pytorch_passes():
    assert not native.usable(torch.zeros(1, dtype=torch.float64))
    fast, reference = run_capped(TorchKernel(), torch.float64), run_capped(TorchKernel(fast=False), torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(fast, reference))


def test_the_build_is_cached_whole_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib, why = native._load()
    assert lib is not None and why == "built"
    assert native._load()[1] == "cached"
    assert [p.name for p in (tmp_path / "cpref").iterdir()] == [f"softcap_rows-{lib._name.split('-')[-1]}"]


def test_where_it_cannot_be_built_the_reason_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert native._load() == (None, "needs Linux with glibc >= 2.35 (libmvec's tanhf), not Linux glibc 2.31")
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda _name: None)
    assert native._load() == (None, "no C compiler (cc or gcc) on PATH")
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "softcap_rows.c"
    broken.write_text("void cap_tanh(float *s) { return s; }\nnot C at all\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    lib, why = native._load()
    assert lib is None and "failed to build softcap_rows.c:" in why and "error" in why
    assert not [p for p in (tmp_path / "cpref").iterdir()]  # no side file left behind


def test_the_cache_key_follows_the_flags_and_one_openmp_runtime_is_loaded(monkeypatch, tmp_path):
    """Other flags build another file beside the first; the loops use the libgomp PyTorch loaded, not a second."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native._load()
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DCPREF_OTHER"))
    assert native._load()[1] == "built" and len(list((tmp_path / "cpref").iterdir())) == 2
    native.cap_tanh(torch.zeros(10))
    gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(gomp) == 1, gomp
