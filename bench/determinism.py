"""Check and benchmark: every mode on the simulated cluster on the device at hand, and `deterministic=True`.

The simulated cluster's ranks are threads that share one device; each gets the device's default kernel
(`CudaKernel`'s flash on CUDA in bf16/fp16, `TorchKernel` elsewhere). For every mode at each CP size
(`--cp`, default 2 and 4), the zigzag and balanced layouts, in `--dtype` (default bf16), cross-rank sums
rounded as NCCL rounds them:

1. **accuracy**: every rank's out, dQ, dK, dV against the FP64 oracle, as the worst
   `|err| / (tol (1 + |ref|))` (1.0 is the dtype's stated tolerance, `sim.oracle.TOL`, GQA's for bf16);
2. **repeatability**: two steps with `deterministic=True` must be bitwise equal; whether two default
   steps are is printed beside (on CUDA the backward's atomics usually make them differ);
3. **cost**: the step (forward + backward) with the flag over without, the fastest of `--repeats`
   alternated runs each; and, alone, the row sums of the all-gather backward (rank 0's plan, zigzag,
   largest CP size: `add_rows` in occurrence layers against one `index_add_`, and the index's sort
   into layers, which a batch's first backward pays once), the part the flag adds on any device
   besides the kernel's own algorithm.

Exit status 1 if an accuracy or repeatability check fails. On a GPU: `python -m bench.determinism --device
cuda` (a step of `bench/gpu_check.sh`); on the CPU, where `index_add_` is sequential, every row repeats.
"""

from __future__ import annotations

import sys

import torch

import cpref
from bench.kernel import fastest
from sim.cluster.harness import oracle_shards, run_attention
from sim.cluster.simcluster import SimCluster
from sim.oracle import TOL, TOL_BF16_GQA
from sim.tools.cli import Parser, device_name, dtype_name, positive, positives

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("zigzag", "balanced")


def _inputs(total: int, heads: tuple[int, int], dim: int) -> list[torch.Tensor]:
    """q (T, Hq, D), k, v (T, Hkv, D), dout (T, Hq, D): float64 on the host, N(0, 1), seed 0."""
    g, (hq, hkv) = torch.Generator().manual_seed(0), heads
    return [torch.randn((total, h, dim), generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _step(tensors, sharding, mode, device, dtype, P, deterministic):
    """One forward + backward on P simulated ranks: per rank `(out, dq, dk, dv)`, on the host."""
    q, k, v, dout = (t.to(device=device, dtype=dtype) for t in tensors)
    results, _ = run_attention(q, k, v, dout, sharding, mode=mode, cluster=SimCluster(P, timeout=600.0, reduction="native"),
                               deterministic=deterministic, **cpref.MODES[mode].example_options(P))  # fmt: skip
    return [[t.cpu() for t in rank] for rank in results]


def _worst(results, refs, tol: float) -> float:
    return max(((a.double() - b).abs() / (tol * (1 + b.abs()))).max().item()
               for got, want in zip(results, refs) for a, b in zip(got, want))  # fmt: skip


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def row(mode: str, P: int, layout: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """The three figures of one mode, CP size and layout."""
    sharding = cpref.Sharding.eod_padded(torch.tensor([0, *torch.tensor(args.docs).cumsum(0).tolist()]), cp_size=P,
                                         layout=layout)  # fmt: skip
    tensors = _inputs(sharding.total, args.heads, args.dim)
    refs = oracle_shards(*(t.to(dtype).double() for t in tensors), sharding)
    tol = TOL_BF16_GQA if dtype == torch.bfloat16 and args.heads[1] < args.heads[0] else TOL[dtype]
    runs = {flag: [_step(tensors, sharding, mode, device, dtype, P, flag) for _ in range(2)] for flag in (False, True)}
    times = fastest({flag: (lambda f=flag: _step(tensors, sharding, mode, device, dtype, P, f)) for flag in (False, True)},
                    repeats=args.repeats, warmup=0, device=device)  # fmt: skip
    return {"mode": mode, "P": P, "layout": layout, "accuracy": _worst(runs[True][0], refs, tol),
            "repeats": _same(*runs[True]), "default repeats": _same(*runs[False]), "cost": times[True] / times[False],
            "seconds": (times[True], times[False])}  # fmt: skip


def row_sums(args, device: torch.device) -> dict:
    """Seconds of the all-gather backward's dK sum over rank 0's plan: one `index_add_` vs occurrence layers."""
    from cpref.base.determinism import add_rows, occurrence_layers
    from cpref.modes.all_gather_plan import build_all_gather_plan

    P = max(args.cp)
    sharding = cpref.Sharding.eod_padded(torch.tensor([0, *torch.tensor(args.docs).cumsum(0).tolist()]), cp_size=P)
    plan = build_all_gather_plan(sharding.bounds, P, 0, "zigzag", True, device)
    src = torch.randn((len(plan.kv_index), args.heads[1], args.dim), device=device)  # float32: the partials' dtype
    dst = torch.zeros((sharding.total, args.heads[1], args.dim), device=device)  # (P T_l, Hkv, D)
    cases = {flag: (lambda f=flag: add_rows(dst, plan.kv_index, src, deterministic=f)) for flag in (False, True)}
    cases["sort"] = lambda: occurrence_layers(plan.kv_index)  # what a batch's first backward adds, once per index
    times = fastest(cases, repeats=max(args.repeats, 5), device=device)
    return {"rows": len(plan.kv_index), "P": P, "index_add_": times[False], "layers": times[True], "sort": times["sort"]}


def markdown(rows: list[dict]) -> str:
    """The table of `rows`."""
    header = ("| mode | P | layout | worst err / tol | deterministic: 2 runs equal | default: 2 runs equal | "
              "step, deterministic / default |")  # fmt: skip
    lines = [header, "| --- | ---: | --- | ---: | --- | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['P']} | {r['layout']} | {r['accuracy']:.3f} | {'yes' if r['repeats'] else 'NO'} | "
                     f"{'yes' if r['default repeats'] else 'no'} | {r['seconds'][0] * 1e3:.0f} / {r['seconds'][1] * 1e3:.0f} ms "
                     f"= {r['cost']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(prog="python -m bench.determinism", description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_name, default="cpu", help="torch device, e.g. cuda")
    parser.add_argument("--dtype", type=dtype_name, choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--cp", type=positives, default=(2, 4), help="CP sizes")
    parser.add_argument("--docs", type=positives, default=(1000, 3000, 500))
    parser.add_argument("--heads", type=positives, default=(8, 4), help="Hq,Hkv")
    parser.add_argument("--dim", type=positive, default=64, help="head dim D = Dv")
    parser.add_argument("--repeats", type=positive, default=3, help="timed steps each way (fastest kept)")
    parser.add_argument("--mode", default="all", help="comma list or all")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    modes = sorted(cpref.MODES) if args.mode == "all" else args.mode.split(",")
    print(f"# deterministic=True on the simulated cluster: {device}, {args.dtype}, documents {args.docs}, heads {args.heads}, "
          f"D = {args.dim}, default kernel {type(cpref.kernels.default_kernel(device)).__name__}")  # fmt: skip
    rows = []
    for mode in modes:
        for P in args.cp:
            for layout in LAYOUTS:
                rows.append(row(mode, P, layout, args, device, dtype))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    failed = [r for r in rows if r["accuracy"] > 1.0 or not r["repeats"]]
    print(markdown(rows))
    sums = row_sums(args, device)
    print(f"row sums of the all-gather backward (P = {sums['P']}, rank 0, {sums['rows']} key rows): one index_add_ "
          f"{sums['index_add_'] * 1e6:.0f} us, occurrence layers {sums['layers'] * 1e6:.0f} us "
          f"({sums['layers'] / sums['index_add_']:.2f}x); the batch's first backward also sorts the index, "
          f"{sums['sort'] * 1e6:.0f} us, once (the layers are kept with the plan's index)")  # fmt: skip
    print(f"{len(failed)} of {len(rows)} checks failed" if failed else f"all {len(rows)} checks passed")
    return {"rows": rows, "row sums": sums, "failed": len(failed)}


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
