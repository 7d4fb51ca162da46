"""Benchmark: `TorchKernel` (fast and explicit paths) against SDPA called once per document.

Five mixes of documents in 8192 tokens (8 heads, head dim 64, float32, causal, forward +
backward) run through

* **fast**: the default kernel of the device (`cpref.kernels.default_kernel`): on a CPU
  `TorchKernel()`, the fused path (`cpref.kernels.torch_fused`), one varlen call; on CUDA
  `CudaKernel()`, PyTorch's flash attention in float16 and bfloat16 (`cpref.kernels.cuda_kernel`);
* **explicit**: `TorchKernel(fast=False)`, the readable reference path, one varlen call;
* **SDPA**: `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` with an
  autograd backward, called once per document on contiguous `[1, H, S, D]` tensors (made
  before timing), which is what a caller without a varlen kernel does.

Each is warmed up, then the three are timed in alternation, round after round (so that a change
in machine load hits all alike), and the fastest run of each is kept: at least `--repeats`
rounds, and more while a mix's rounds have taken less than `--budget` seconds (at most 50).
On a shared machine one call can run 30% slower than the same call a second later; a
100 ms mix then gets about twenty samples instead of three, the 8k document still three. The
table's last column gives the rounds. The same run measures the
machine's matmul peak (a 4096^3 float32 matmul, sampled the same way) and prints, for the
single long document, each kernel's fraction of that peak, counting the 7 matmuls of forward +
backward over half the score square, $7 T^2 H D$ flops. Targets (printed, never asserted):
fast <= 1.1x SDPA on every mix, <= 1.0x on the short-document mixes. The fraction of peak is printed for
fast and SDPA alike, without a target: PyTorch's fused CPU attention, which the fast path calls, moves
between about half and four fifths of the measured matmul peak from run to run, and SDPA with it.

Run it with `python -m bench.kernel` (or `make bench`); `--help` lists the options.
`--device cuda --dtype bf16` runs the same tables on a GPU, where SDPA dispatches to its
flash or memory-efficient kernel, fast is `CudaKernel` (flash in bf16 and fp16; in float32 its
fallback, the explicit path) and explicit is `TorchKernel`'s explicit path; the peak is then
the device's matmul rate in that dtype, and every timing synchronizes the device.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cpref.kernels import TorchKernel, Varlen, default_kernel
from sim.tools.cli import Parser, device_name, positive, positive_float

# The five mixes, each 8192 tokens.
MIXES = {
    "1 x 8192": [8192],
    "8 x 1024": [1024] * 8,
    "4 mixed": [120, 1128, 2984, 3960],
    "64 x 128": [128] * 64,
    "256 x 32": [32] * 256,
}
SHORT = ("64 x 128", "256 x 32")  # where fast must be at least as fast as SDPA
TARGET = 1.1


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


CPU = torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that wall time covers it."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def fastest(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
            device: torch.device = CPU, budget: float = 0.0,
            max_rounds: int = 50) -> dict[str, float]:  # fmt: skip
    """The fastest wall seconds of each `fn()`, timed in alternation so that load drift hits all alike.

    Runs `repeats` rounds (each `fn` once, in turn), then more rounds while the timed rounds
    have lasted less than `budget` seconds (at most `max_rounds`): a cheap case gets more
    samples, so that its minimum is not one slow phase of a shared machine. Every `fn` gets
    the same number of samples, in the same rounds. The number of rounds is under `"rounds"`.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    began, rounds = time.perf_counter(), 0
    while rounds < repeats or (time.perf_counter() - began < budget and rounds < max_rounds):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
        rounds += 1
    return {**{name: min(ts) for name, ts in times.items()}, "rounds": rounds}


def matmul_peak(repeats: int = 3, n: int = 4096, device: torch.device = CPU,
                dtype: torch.dtype = torch.float32, budget: float = 0.0) -> float:  # fmt: skip
    """FLOP/s of the fastest `n x n x n` matmul in `dtype` on `device` (sampled as `fastest` does)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / fastest({"mm": lambda: torch.mm(a, b, out=c)}, repeats, device=device, budget=budget)["mm"]


def attention_flops(lengths: list[int], heads: int, dim: int) -> int:
    """Causal forward + backward: 7 matmuls over half of each document's score square, `7 S^2 H D`."""
    return sum(7 * n * n * heads * dim for n in lengths)


def cases(lengths: list[int], heads: int = 8, dim: int = 64, seed: int = 0, device: torch.device = CPU,
          dtype: torch.dtype = torch.float32) -> dict[str, Callable[[], object]]:  # fmt: skip
    """Forward + backward closures of the three implementations over one shared set of tensors."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v, dout = (torch.randn(tokens, heads, dim, generator=g).to(device, dtype) for _ in range(4))  # (T, H, D)
    seqs, scale = Varlen.from_lengths(lengths, lengths), dim**-0.5
    # SDPA's inputs, one contiguous (1, H, S, D) per document, made before timing
    docs = [tuple(x.transpose(0, 1).unsqueeze(0).contiguous() for x in t.split(lengths)) for t in (q, k, v, dout)]

    def kernel_step(kernel) -> Callable[[], object]:
        def step() -> object:
            out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale)
            return kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale)

        return step

    def sdpa() -> None:
        for qd, kd, vd, dd in zip(*docs):
            qa, ka, va = (x.detach().requires_grad_(True) for x in (qd, kd, vd))  # (1, H, S, D)
            out = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)
            torch.autograd.grad(out, (qa, ka, va), grad_outputs=dd)

    return {"fast": kernel_step(default_kernel(device)), "explicit": kernel_step(TorchKernel(fast=False)), "sdpa": sdpa}


def table(mixes: dict[str, list[int]], heads: int, dim: int, repeats: int, device: torch.device = CPU,
          dtype: torch.dtype = torch.float32, budget: float = 0.0) -> list[dict]:  # fmt: skip
    """One row per mix: the fastest seconds of each implementation, over at least `repeats` rounds
    and about `budget` seconds of rounds (see `fastest`), and the number of rounds."""
    return [{"mix": name, **fastest(cases(lengths, heads, dim, device=device, dtype=dtype), repeats, device=device, budget=budget)}
            for name, lengths in mixes.items()]  # fmt: skip


def markdown(rows: list[dict]) -> str:
    """The comparison as a Markdown table (milliseconds and ratios)."""
    lines = ["| documents | fast | explicit | SDPA per document | fast / SDPA | explicit / SDPA | runs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['mix']} | {r['fast'] * 1e3:.1f} ms | {r['explicit'] * 1e3:.1f} ms | {r['sdpa'] * 1e3:.1f} ms "
                     f"| {r['fast'] / r['sdpa']:.2f} | {r['explicit'] / r['sdpa']:.2f} | {r['rounds']} |")  # fmt: skip
    return "\n".join(lines)


def verdicts(results: dict) -> list[str]:
    """Each mix's fast / SDPA against its target, then the single document's fraction of the matmul peak."""
    lines = []
    for r in results["rows"]:
        target = 1.0 if r["mix"] in SHORT else TARGET
        verdict = "met" if r["fast"] / r["sdpa"] <= target else "NOT met"
        lines.append(f"{r['mix']:>9}: fast / SDPA = {r['fast'] / r['sdpa']:.2f} (target <= {target}: {verdict})")
    peak, flops, single = results["peak"], results["flops"], results["rows"][0]
    lines += ["", f"matmul peak (4096^3 {results['dtype']}): {peak / 1e9:.0f} GFLOP/s; {single['mix']} forward + backward = "
              f"{flops / 1e9:.0f} GFLOP, so the floor is {flops / peak * 1e3:.0f} ms"]  # fmt: skip
    for name in ("fast", "explicit", "sdpa"):
        frac = flops / single[name] / peak
        lines.append(f"  {name:>8}: {flops / single[name] / 1e9:6.1f} GFLOP/s = {frac:.0%} of peak")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--dim", type=positive, default=64, help="head dim D = Dv")
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs per implementation, at least (fastest kept)")
    parser.add_argument("--budget", type=positive_float, default=6.0,
                        help="seconds of timed rounds per mix: a cheap mix runs more rounds than --repeats (at most 50)")
    parser.add_argument("--device", type=device_name, default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else _device_name(device)
    title = (f"Kernel: {args.heads} heads, head dim {args.dim}, {args.dtype}, causal forward + backward, {where}, fastest "
             f"of at least {args.repeats} runs and about {args.budget:g} s per mix (load average {os.getloadavg()[0]:.2f})")
    print(f"## {title}\n")
    peak = matmul_peak(args.repeats, device=device, dtype=dtype, budget=args.budget)  # as many samples: no kinder peak
    rows = table(MIXES, args.heads, args.dim, args.repeats, device, dtype, budget=args.budget)
    print(markdown(rows) + "\n")
    results = {"title": title, "dtype": args.dtype, "rows": rows, "peak": peak,
               "flops": attention_flops(MIXES["1 x 8192"], args.heads, args.dim),
               "targets": {name: 1.0 if name in SHORT else TARGET for name in MIXES}}  # fmt: skip
    print("\n".join(verdicts(results)))
    print(f"(load average now {os.getloadavg()[0]:.2f})")
    return results


def _device_name(device: torch.device) -> str:
    """The accelerator's name as its torch module reports it (e.g. `NVIDIA H200`)."""
    module = getattr(torch, device.type)
    return module.get_device_name(device) if hasattr(module, "get_device_name") else str(device)


if __name__ == "__main__":
    main()
