r"""The CP path at P = 1: what `cpref.attention` costs a model without CP, every mode against the bare kernel.

A model without context parallelism calls `cpref.attention(..., comm=cpref.SingleRank())`; every
mode then reduces to attention over the whole packed stream. What it pays over calling the kernel
directly is the CP path: validation, the batch cache and the plan, the autograd Function, and what
each mode does around its kernel call (the ring's K/V packing and lse merge, Ulysses' all-to-alls).
The all-gather mode's plan at $P = 1$ names the documents themselves as the kernel's sequences, so
it skips the gather, the `index_select`, the `index_add_` and the backward's re-gather (see
[Load-balanced metadata](metadata.md)).

On three of [the kernel benchmark](perf-kernel.md)'s mixes (one document of 8192 tokens, four mixed,
256 of 32), 8 heads, head dim 64, float32, causal, zigzag, forward + backward, the bare
`TorchKernel()` and each mode are warmed up (the first call builds the plans and makes the rank
check), then timed `--repeats` times (3) in alternation; the fastest of each is kept. Target,
printed and never asserted: every mode within 1.05 times the bare kernel.

Two runs of the same 8192-token call can differ by several percent on a shared machine, more than
the CP path costs. So each mode's kernel calls are also timed inside its step
(`bench.timed.TimedKernel`), and the time the mode spends *outside* them, over the bare kernel's
time, is printed too: the CP path's own cost, free of the kernel's run-to-run noise.

Run it with `python -m bench.overhead` (or `make bench`); `--mixes` picks other mixes of the kernel
benchmark, `--help` lists the options.

{{ results overhead }}
"""

from __future__ import annotations

import os
import time
from itertools import accumulate
from typing import Callable

import torch

import cpref
from bench.kernel import MIXES, fastest
from bench.timed import Clock, TimedKernel
from cpref.kernels import Varlen
from sim.tools.cli import Parser, positive

TARGET = 1.05
DEFAULT_MIXES = ("1 x 8192", "4 mixed", "256 x 32")


class ModeStep:
    """Forward + backward of `cpref.attention` at P = 1 in one mode; keeps `(seconds, kernel seconds)` of every call."""

    def __init__(self, mode: str, leaves: list[torch.Tensor], dout: torch.Tensor, sharding: cpref.Sharding, kernel) -> None:
        self.mode, self.leaves, self.dout, self.sharding = mode, leaves, dout, sharding
        self.clock = Clock()
        self.kernel, self.runs = TimedKernel(kernel, self.clock), []
        self.options = {"a2a_size": 1} if mode == "a2a+p2p" else {}

    def __call__(self) -> None:
        for x in self.leaves:
            x.grad = None  # no accumulation into last step's gradients
        self.clock.reset()
        start = time.perf_counter()
        out = cpref.attention(*self.leaves, self.sharding, comm=cpref.SingleRank(), mode=self.mode, kernel=self.kernel,
                              **self.options)  # fmt: skip
        out.backward(self.dout)
        self.runs.append((time.perf_counter() - start, self.clock.compute))


def cases(lengths: list[int], heads: int, dim: int, seed: int = 0) -> dict[str, Callable[[], object]]:
    """Forward + backward closures: the bare kernel, then `cpref.attention` at P = 1 in every mode."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v, dout = (torch.randn(tokens, heads, dim, generator=g) for _ in range(4))  # (T, H, D)
    sharding = cpref.Sharding(torch.tensor([0, *accumulate(lengths)]), cp_size=1, layout="zigzag")  # the whole batch, on one rank
    seqs, kernel = Varlen.from_lengths(lengths, lengths), cpref.TorchKernel()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def bare() -> object:
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=dim**-0.5)
        return kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=dim**-0.5)

    return {"kernel": bare, **{mode: ModeStep(mode, leaves, dout, sharding, kernel) for mode in sorted(cpref.MODES)}}


def markdown(results: dict) -> str:
    """The table (per mix, the bare kernel's time, then each mode's: over the bare kernel's, and the part outside its
    kernel calls), its key, and each mode's worst case against the target, as Markdown."""
    modes, rows = results["modes"], results["rows"]
    lines = ["| documents | path | time | over the bare kernel | outside its kernel calls |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mix']} | bare kernel | {r['kernel'] * 1e3:.1f} ms | 1 | |")
        lines += [f"| | `{m}` | {r[m] * 1e3:.1f} ms | {r[m] / r['kernel']:.3f}x | {r[m + ' outside'] / r['kernel']:.1%} |"
                  for m in modes]  # fmt: skip
    lines += ["", "over the bare kernel: the mode's time over the bare kernel's (each the fastest of its runs; two runs of "
              "the same call differ by a few percent on a busy machine); outside its kernel calls: the mode's time outside "
              "its kernel calls, over the bare kernel's: the CP path's own cost.", ""]  # fmt: skip
    for m in modes:
        ratio, outside = max(r[m] / r["kernel"] for r in rows), max(r[m + " outside"] / r["kernel"] for r in rows)
        lines.append(f"- {m:>10}: worst {ratio:.3f}x the bare kernel, {outside:.1%} outside the kernel "
                     f"(target <= {results['target']}x: {'met' if ratio <= results['target'] else 'NOT met'})")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=list(DEFAULT_MIXES), choices=list(MIXES))
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--dim", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs per case (fastest kept)")
    args = parser.parse_args(argv)
    modes = sorted(cpref.MODES)
    title = (f"CP path at P = 1 (cpref.SingleRank, zigzag): forward + backward, {args.heads} heads, head dim {args.dim}, "
             f"float32, causal, fastest of {args.repeats} (load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"## {title}\n", flush=True)
    rows = []
    for name in args.mixes:
        steps = cases(MIXES[name], args.heads, args.dim)
        t = fastest(steps, args.repeats)
        row = {"mix": name, "kernel": t["kernel"]}
        for m in modes:
            total, kernel = min(steps[m].runs[1:])  # the fastest timed call (the first was the warm-up)
            row.update({m: t[m], m + " outside": total - kernel})
        rows.append(row)
    results = {"title": title, "modes": modes, "rows": rows, "target": TARGET}
    print(markdown(results))
    print(f"(load average now {os.getloadavg()[0]:.2f})")
    return results

if __name__ == "__main__":
    main()
