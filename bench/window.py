r"""A sliding window on the fused path: a causal window of 1024 keys against full causal attention and a dense band mask.

One document of 32768 tokens, 4 heads, head dim 64, float32, forward + backward, every query
seeing itself and the 1024 keys before it (`window=(1024, 0)`), run through

* **window**: `TorchKernel()` with the window, the fused path's band tiles of 256 rows, masked at
  their edges ([the plan][cpref.kernels.torch_fused_plan]);
* **explicit window**: `TorchKernel(fast=False)` with the window, the explicit path's blocks over
  the band;
* **full causal**: `TorchKernel()` without a window, the work the window saves;
* **SDPA band mask**: `F.scaled_dot_product_attention` with the dense $T \times T$ band as an
  additive mask (made before timing) and an autograd backward: PyTorch's fused CPU attention,
  which computes every one of the $T^2$ scores, masked or not.

Beside the times, the scores each computes, counted: the window's visible ones,
$(w + 1) T - w (w + 1) / 2$ (`Varlen.work`); the window's tiles'
$\sum \text{rows} \times \text{keys}$ (at most $w + R$ a row, $R$ rows a tile); full causal's
$T (T + 1) / 2$; the dense mask's $T^2$. The ideal saving of the window over full causal is the
ratio of visible scores (about $16\times$ here), the planned one that of the tiles' scores (about
$13\times$); both are printed next to the measured ratio of times. The cases are timed in
alternation as in [the kernel benchmark](perf-kernel.md), the fastest of `--repeats` rounds kept
(default one: the dense mask takes about a minute at 32k); the window's plan and masks are built
once, untimed, before the rounds. Nothing is asserted.

**A windowed call's rate is set by its band's width.** That is the planner's premise for windowed
calls (the `band` curve of [the profiles](plan-profiles.md)), measured last: the fused path's
forward + backward rate (FLOPs as [`KernelCall.flops`][sim.plan.dry.KernelCall.flops] counts them,
over the time) on four calls timed in alternation, the same window on 8192 and 2048 tokens and on
four and two heads, and a window an eighth as wide. The rate follows the band's width (the last
row), not the call's size or its heads (the middle two, near 1).

Run it with `python -m bench.window` (or `make bench`); `--tokens`, `--window`, `--heads`, `--dim`
and `--repeats` change the defaults; `--tokens 4096 --window 256` is a quick run.

{{ results window }}
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from bench.kernel import fastest
from cpref.kernels import TorchKernel, Varlen
from cpref.kernels.torch_fused_plan import plan_band_runs
from sim.tools.cli import Parser, nonnegative, positive

NAMES = ("window", "explicit window", "full causal", "SDPA band mask")


def band_mask(tokens: int, window: int, rows: int = 4096) -> torch.Tensor:
    """The dense additive mask `(1, 1, T, T)`: 0 where query `x` sees key `y` (`x - window <= y <= x`), else -inf."""
    mask = torch.full((tokens, tokens), float("-inf"))  # (T, T)
    y = torch.arange(tokens)  # (T,)
    for a in range(0, tokens, rows):  # in row blocks: no (T, T) bool temporary
        x = torch.arange(a, min(a + rows, tokens))[:, None]  # (R, 1)
        mask[a : a + rows].masked_fill_((y[None, :] <= x) & (y[None, :] >= x - window), 0.0)  # (R, T)
    return mask[None, None]


def cases(tokens: int, window: int, heads: int = 8, dim: int = 64, seed: int = 0) -> dict[str, Callable[[], object]]:
    """Forward + backward closures of the four cases over one shared set of float32 tensors; each returns `(dq, dk, dv)`."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(tokens, heads, dim, generator=g) for _ in range(4))  # (T, H, D)
    seqs, scale = Varlen([0, tokens]), dim**-0.5
    head_major = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, dout)]  # (1, H, T, D), before timing
    mask = band_mask(tokens, window)  # (1, 1, T, T)

    def kernel_step(kernel: TorchKernel, band: tuple[int, int]) -> Callable[[], object]:
        def step() -> object:
            out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale, window=band)
            return kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale, window=band)

        return step

    def sdpa() -> object:
        qa, ka, va = (x.detach().requires_grad_(True) for x in head_major[:3])  # (1, H, T, D)
        out = F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=scale)
        return tuple(x[0].transpose(0, 1) for x in torch.autograd.grad(out, (qa, ka, va), grad_outputs=head_major[3]))

    fast, explicit = TorchKernel(), TorchKernel(fast=False)
    steps = [kernel_step(fast, (window, 0)), kernel_step(explicit, (window, 0)), kernel_step(fast, (-1, -1)), sdpa]
    return dict(zip(NAMES, steps))


def scores(tokens: int, window: int) -> dict[str, int]:
    """Scores per head: visible under the window, computed by the window's tiles, by full causal, by the dense mask."""
    seqs = Varlen([0, tokens])
    planned = sum(run.count * run.rows * run.keys for run in plan_band_runs(seqs, True, (window, 0)))
    return {"visible": seqs.work(True, (window, 0)), "planned": planned, "causal": seqs.work(True), "dense": tokens * tokens}


def measure(tokens: int, window: int, heads: int, dim: int, repeats: int) -> dict[str, float]:
    """The fastest seconds of each case (and `"rounds"`), the window's plan and masks built once before."""
    steps = cases(tokens, window, heads, dim)
    steps["window"]()  # builds the plan and the masks, cached on the Varlen, like any later layer of the batch
    return fastest(steps, repeats, warmup=0)


def band_rates(tokens: int, window: int, heads: int, dim: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of the fused path's forward + backward on one document under a causal window, for four calls: `(tokens,
    heads, window)`, a quarter of the tokens, half the heads, an eighth of the window (`BAND_CASES`)."""
    from sim.plan.dry import KernelCall

    kernel, steps, flops = TorchKernel(), {}, {}
    shapes = {"as above": (tokens, heads, window), "a quarter of the tokens": (tokens // 4, heads, window),
              "half the heads": (tokens, max(1, heads // 2), window),
              "an eighth of the window": (tokens, heads, max(1, window // 8))}  # fmt: skip
    for name, (n, h, w) in shapes.items():
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(n, h, dim, generator=g) for _ in range(4))  # (T, H, D)
        seqs, scale = Varlen([0, n]), dim**-0.5

        def step(q=q, k=k, v=v, dout=dout, seqs=seqs, scale=scale, w=w) -> object:
            out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale, window=(w, 0))
            return kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale, window=(w, 0))

        work = seqs.work(True, (w, 0))
        steps[name] = step
        flops[name] = sum(KernelCall(d, work, n, n, h, h, dim, dim).flops for d in ("forward", "backward"))
    times = fastest(steps, max(repeats, 3), warmup=1)  # in alternation: load drift hits all four alike
    return {name: flops[name] / times[name] / 1e9 for name in shapes}


def band_report(rates: dict[str, float], tokens: int, window: int, heads: int) -> str:
    """The four calls' rates and each one's ratio to the first."""
    shapes = {"as above": f"{tokens} tokens, {heads} heads, window {window}",
              "a quarter of the tokens": f"{tokens // 4} tokens", "half the heads": f"{max(1, heads // 2)} heads",
              "an eighth of the window": f"window {max(1, window // 8)}"}  # fmt: skip
    lines = ["| call | shape | GFLOP/s | / the first |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {name} | {shapes[name]} | {r:.1f} | {r / rates['as above']:.2f} |" for name, r in rates.items()]
    return "\n".join(lines)


def report(times: dict[str, float], counts: dict[str, int]) -> str:
    """The times as a Markdown table, then the window's saving over full causal: ideal, planned, measured."""
    lines = ["| case | time | time / window |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {times[name] * 1e3:.1f} ms | {times[name] / times['window']:.2f} |" for name in NAMES]
    ideal, planned = counts["causal"] / counts["visible"], counts["causal"] / counts["planned"]
    lines += ["", f"- full causal / window: ideal {ideal:.1f}x (visible scores), planned {planned:.1f}x (scores the "
              f"tiles compute, {counts['planned'] / counts['visible']:.2f} per visible one), measured "
              f"{times['full causal'] / times['window']:.1f}x",  # fmt: skip
              f"- SDPA band mask / window: planned {counts['dense'] / counts['planned']:.1f}x (it computes all T^2 scores), "
              f"measured {times['SDPA band mask'] / times['window']:.1f}x",  # fmt: skip
              f"- explicit window / window: measured {times['explicit window'] / times['window']:.1f}x"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive, default=32768, help="tokens of the one document")
    parser.add_argument("--window", type=nonnegative, default=1024, help="keys before each query it sees: window=(W, 0)")
    parser.add_argument("--heads", type=positive, default=4)
    parser.add_argument("--dim", type=positive, default=64, help="head dim D = Dv")
    parser.add_argument("--repeats", type=positive, default=1, help="timed rounds of every case (fastest kept)")
    args = parser.parse_args(argv)
    title = (f"Sliding window: 1 x {args.tokens} tokens, causal window {args.window}, {args.heads} heads, head dim "
             f"{args.dim}, fp32, forward + backward, {torch.get_num_threads()} threads, fastest of {args.repeats} "
             f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"## {title}\n")
    times = measure(args.tokens, args.window, args.heads, args.dim, args.repeats)
    counts = scores(args.tokens, args.window)
    print(report(times, counts))
    rates = band_rates(args.tokens // 4, args.window, args.heads, args.dim, args.repeats)
    print(f"\nA windowed call's rate by its band's width, not its size or heads (forward + backward):\n\n"
          f"{band_report(rates, args.tokens // 4, args.window, args.heads)}")
    print(f"(load average now {os.getloadavg()[0]:.2f})")
    return {"title": title, "times": times, "counts": counts, "band": rates, "band_shape": [args.tokens // 4, args.window,
                                                                                           args.heads]}

if __name__ == "__main__":
    main()
