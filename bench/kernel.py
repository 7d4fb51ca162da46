"""Benchmark: `TorchKernel` forward + backward against PyTorch's fused SDPA, side by side.

One causal document (8192 tokens, 8 heads, head dim 64, float32 by default) runs through
`TorchKernel.forward` + `TorchKernel.backward` and through
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)` with an autograd
backward, on the same tensors. Each is warmed up, then both are timed `--repeats` times in
alternation (so that a change in machine load hits both alike); the medians and their ratio
are printed. The target is a ratio of at most 1.5 (reported, not asserted).

Run it with `python -m bench.kernel` (or `make bench`); `--help` lists the options.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cpref.kernels import TorchKernel, Varlen

TARGET_RATIO = 1.5


def _medians(fns: list[Callable[[], object]], repeats: int, warmup: int, sync: Callable[[], None]) -> list[float]:
    """Median wall seconds of each `fn()`, timed in alternation so that load drift hits all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def _cases(tokens: int, heads: int, dim: int, device: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """The two forward + backward closures over one shared set of tensors."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(tokens, heads, dim, generator=g, device=device) for _ in range(4))  # (T, H, D)
    seqs = Varlen([0, tokens])
    scale = dim**-0.5
    kernel = TorchKernel()

    def torch_kernel() -> object:
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale)
        return kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale)

    def sdpa() -> object:
        # SDPA wants (B, H, T, D): one batch, heads before tokens
        qa, ka, va = (x.transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in (q, k, v))  # (1, H, T, D)
        out = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)  # (1, H, T, D)
        return torch.autograd.grad(out, (qa, ka, va), grad_outputs=dout.transpose(0, 1).unsqueeze(0))

    return torch_kernel, sdpa


def main(argv: list[str] | None = None) -> None:
    """Parse the options, time both implementations and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="length of the causal document")
    parser.add_argument("--heads", type=int, default=8, help="query (= key/value) heads")
    parser.add_argument("--dim", type=int, default=64, help="head dim D = Dv")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per implementation")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    args = parser.parse_args(argv)

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    torch_kernel, sdpa = _cases(args.tokens, args.heads, args.dim, args.device)
    print(f"causal fwd+bwd, T={args.tokens} H={args.heads} D={args.dim} float32 on {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    t_kernel, t_sdpa = _medians([torch_kernel, sdpa], args.repeats, args.warmup, sync)
    ratio = t_kernel / t_sdpa
    print(f"TorchKernel  {t_kernel * 1e3:9.1f} ms")
    print(f"SDPA         {t_sdpa * 1e3:9.1f} ms")
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"ratio TorchKernel/SDPA = {ratio:.2f} (target <= {TARGET_RATIO}: {verdict})")


if __name__ == "__main__":
    main()
