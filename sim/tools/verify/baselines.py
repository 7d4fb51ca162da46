r"""The baseline of the `vs P=1` column: the same attention without CP, whose rounding a CP result is held to.

MagiAttention's criterion compares a CP result with **the same attention without CP**: a CP
implementation is exact when it is no farther from the FP64 truth than its own local attention
run on the whole batch. So the baseline of a row is chosen with `--baseline`:

| `--baseline` | the run without CP (CP rank 0, the whole batch, the case's dtype, its device) |
| --- | --- |
| `auto` (default) | `impl` for an `--impl` row, `kernel` for cpref's own |
| `impl` | the implementation itself, on a process group of one rank (CP size 1) |
| `sdpa` | PyTorch's SDPA over every document, in the dtype ([`packed_sdpa`][sim.tools.verify.baselines.packed_sdpa]) |
| `eager` | attention as plain torch writes it, in the dtype ([`eager`][sim.tools.verify.baselines.eager]) |
| `kernel` | cpref's fused kernel (`cpref.attention` on a `SingleRank`) |
| `package.module:function` | your local attention: `fn(q, k, v, sharding, *, mode, causal, window, **options)` on the whole batch (under `--mask`, `mask=` too) |

An implementation whose local attention computes `q @ k^T` in bf16 (most written on plain
torch) is as exact as CP can be and still farther from the truth than cpref's kernel, which
computes scores in float32: held to `kernel` its bf16 rows fail the `vs P=1` column with no CP
fault at all (2.05 in the page's example), held to `impl` they pass.

**The fallback.** A ring's sends to itself at CP size 1 are local copies
([`loopback`][sim.tools.verify.loopback]), so it runs there. Where the implementation still cannot run on one rank
(it raises there), its case falls back to `FALLBACK`, SDPA and eager attention both, and
`sim.tools.verify.truth` holds each tensor of each rank, for each of its two ratios, to the one
of the two farther from the truth; the `baseline` column reads `sdpa/eager` and CP rank 0's note
gives the exception. Not knowing how the implementation rounds, the harness must not hold it to
a local attention more precise than it may use: SDPA alone, which on the CPU computes more
precisely than bf16 scores do, failed an exact implementation that computes them so (3 of 4
ranks at P = 4), the issue this module solves. Eager attention rounds scores and probabilities in
the dtype, so a CP fault must cost twice its rounding to fail: the bugs that change the result
still fail every rank by more than 10x, a merge carried in bf16 fewer ranks than held to the
implementation's own local attention. Name that (`package.module:function`) for the strict check;
one that would hang at CP size 1 must be named too (the figures: the page "Verify your
implementation", re-measured by the test suite).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

import cpref
from sim.oracle import slice_mask
from sim.tools.verify.impls import load_impl  # a local attention function, named as --impl names one

__all__ = ["BASELINES", "EAGER", "FALLBACK", "eager", "label", "packed_sdpa", "resolve", "run_baseline"]

BASELINES = ("auto", "impl", "sdpa", "eager", "kernel")  # or package.module:function
EAGER = "sim.tools.verify.baselines:eager"  # `--baseline eager`: a local attention, named as the user's is
VARIANTS = ("softcap", "chunk", "sinks")  # the attention variants a case may take; sdpa and eager take none
FALLBACK = ("sdpa", EAGER)  # where the implementation raises at CP size 1: each tensor held to the looser of these


def resolve(baseline: str, impl: str) -> str:
    """The baseline a row of `impl` uses: `auto` made concrete."""
    if baseline == "auto":
        return "kernel" if impl == "cpref" else "impl"
    return EAGER if baseline == "eager" else baseline


def label(name: str | tuple[str, ...]) -> str:
    """How the table names a baseline: `eager` for `EAGER`, `sdpa/eager` for the fallback, else `name`."""
    return "/".join(label(n) for n in name) if isinstance(name, tuple) else "eager" if name == EAGER else name


def _mask(s: cpref.Sharding, causal: bool, window: tuple[int, int],
          mask: cpref.Mask | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`(allowed (T, T), live (T,))` over the padded stream: the same document, real keys, causal, the band; or
    given `mask` (a `cpref.Mask` over the real tokens), its pairs. `live` marks the rows that see a key (real tokens;
    under a mask, those it shows a key): any other row may see only itself, its output zeroed, so that no row of the
    mask is empty."""
    if mask is not None:
        token = s.pad(torch.arange(s.cu_seqlens[-1]), value=-1)  # (T,): each row's real token, -1 for padding
        real = token >= 0
        allowed = torch.zeros(s.total, s.total, dtype=torch.bool)
        allowed[real.nonzero()[:, 0, None], real.nonzero()[:, 0]] = slice_mask(mask.slices, s.cu_seqlens[-1])
        live = allowed.any(1)
        return allowed | torch.diag(~live), live
    doc = torch.zeros(s.total, dtype=torch.int64)
    pos = torch.zeros(s.total, dtype=torch.int64)
    real = torch.zeros(s.total, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(s.cu_seqlens_padded, s.cu_seqlens_padded[1:])):
        doc[a:b], pos[a:b] = i, torch.arange(b - a)
        real[a : a + s.cu_seqlens[i + 1] - s.cu_seqlens[i]] = True
    step = pos[None, :] - pos[:, None]  # key position minus query position
    allowed = (doc[:, None] == doc[None, :]) & real[None, :]
    left, right = window
    right = 0 if causal else right
    if left >= 0:
        allowed &= step >= -left
    if right >= 0:
        allowed &= step <= right
    return allowed | torch.diag(~real), real


def packed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharding: cpref.Sharding, *, causal: bool = True,
                window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                mask: cpref.Mask | None = None) -> torch.Tensor:  # fmt: skip
    """PyTorch's SDPA over a whole packed stream in its dtype: `(T, Hq, D)`, `(T, Hkv, D)`, `(T, Hkv, Dv)` -> `(T, Hq, Dv)`.

    Every document attends only itself (a block-diagonal mask from `sharding`'s boundaries, causal
    and the window as `cpref.attention` reads them), or given `mask` (a `cpref.Mask`), each query the keys
    it shows; padding rows, and rows that see no key, get a zero output and gradient.
    """
    allowed, real = (t.to(q.device) for t in _mask(sharding, causal, tuple(window), mask))
    group = q.shape[1] // k.shape[1]  # query heads per key/value head (GQA)
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # (T, Hq, X)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
                                         scale=softmax_scale).transpose(0, 1)  # (T, Hq, Dv)  # fmt: skip
    return out * real[:, None, None]


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharding: cpref.Sharding, *, causal: bool = True,
          window: tuple[int, int] = (-1, -1), softmax_scale: float | None = None, mask: cpref.Mask | None = None,
          **options: Any) -> torch.Tensor:  # fmt: skip
    """Attention as plain torch writes it (Hugging Face's eager attention), one document at a time, in the input dtype:
    `(T, Hq, D)`, `(T, Hkv, D)`, `(T, Hkv, Dv)` -> `(T, Hq, Dv)`; masks as `packed_sdpa`'s. `mode` and options are ignored.

    Scores `q @ k^T` and their scale in the input dtype, softmax in float32, the probabilities cast back
    to the input dtype and multiplied with `v` there: the rounding of most local attentions written on torch.
    Under a `mask` (which may cross documents) the whole stream is one block.
    """
    allowed, real = (t.to(q.device) for t in _mask(sharding, causal, tuple(window), mask))
    group, scale = q.shape[1] // k.shape[1], softmax_scale or q.shape[-1] ** -0.5
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax's dtype
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # (T, Hq, X)
    bounds = sharding.cu_seqlens_padded if mask is None else (0, sharding.total)
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))  # (Hq, n, X): one document
        # S = Q K^T / sqrt(D), in the input dtype
        s = (qd @ kd.transpose(1, 2)) * scale  # (Hq, n, n)
        # P = softmax(S) in float32 (fp64 stays fp64), cast back: P V in the input dtype
        p = torch.softmax(s.masked_fill(~allowed[a:b, a:b], float("-inf")), dim=-1, dtype=wide).to(q.dtype)
        outs.append((p @ vd).transpose(0, 1))  # (n, Hq, Dv)
    return torch.cat(outs) * real[:, None, None]


def run_baseline(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: cpref.Sharding, *,
                 impl: Callable | None, solo: Any, kernel: Any, **call: Any) -> torch.Tensor:  # fmt: skip
    """The baseline `name`'s output over the whole batch (`whole`: its sharding at CP size 1), differentiable.

    `impl` is the row's implementation and `solo` a process group of this one rank (for `impl`); `call`
    holds `mode`, `causal`, `window`, the mode options and under `--mask` the `mask`, as the implementation receives
    them.
    """
    if name == "kernel":
        variants = {key: call[key] for key in VARIANTS if key in call}  # the kernel's calls take them as the ranks' do
        return cpref.attention(q, k, v, whole, comm=cpref.SingleRank(), mode="all_gather", causal=call["causal"],
                               window=call["window"], kernel=kernel, mask=call.get("mask"), **variants)  # fmt: skip
    if name == "sdpa":
        return packed_sdpa(q, k, v, whole, causal=call["causal"], window=call["window"], mask=call.get("mask"))
    if name == "impl":
        return impl(q, k, v, whole, process_group=solo, **call)

    return load_impl(name, "--baseline")(q, k, v, whole, **call)
