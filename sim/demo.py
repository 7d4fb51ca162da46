"""`make demo`: shard a packed batch over a CP group and run every CP mode on the simulated cluster.

Part 1 shards three documents over a CP group of 4 in both layouts and prints, per rank, the
tokens held, the causal attention work `sum(q_len * kv_len)` and the imbalance (max / mean).
Part 2 runs each CP mode on the simulated cluster in FP64, forward and backward, and prints
per rank the tokens, attention work, bytes sent and received (from the cluster's trace) and
the largest error of the output and of dQ/dK/dV against the dense FP64 oracle.
"""

from __future__ import annotations

import argparse

import torch

import cpref
from sim.harness import max_error, oracle_shards, run_attention
from sim.trace import summarize

LENGTHS = [48, 112, 32]  # three documents, each a multiple of 2P = 8
P = 4
HQ, HKV, D = 4, 2, 16


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)


def part1_layouts(cu: torch.Tensor) -> None:
    print(f"Part 1: {len(LENGTHS)} documents of {LENGTHS} tokens over a CP group of {P}\n")
    for layout in cpref.LAYOUTS:
        work = [cpref.attention_work(cu, cp_size=P, rank=r, layout=layout) for r in range(P)]
        tokens = [len(cpref.global_index(cu, cp_size=P, rank=r, layout=layout)) for r in range(P)]
        print(f"  layout={layout}")
        print(f"    {'rank':>4} {'tokens':>7} {'causal work':>12}")
        for r in range(P):
            print(f"    {r:>4} {tokens[r]:>7} {work[r]:>12}")
        print(f"    imbalance (max/mean work) = {max(work) / (sum(work) / P):.3f}\n")


def part2_modes(cu: torch.Tensor, layouts: list[str]) -> float:
    T = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
    worst = 0.0
    print(f"Part 2: every CP mode, FP64 on the simulated cluster, Hq={HQ} Hkv={HKV} D={D}, causal\n")
    for mode in sorted(cpref.MODES):
        for layout in layouts:
            results, cluster = run_attention(q, k, v, dout, cu, P=P, mode=mode, layout=layout)
            refs = oracle_shards(q, k, v, dout, cu, P=P, layout=layout)
            summary = summarize(cluster.trace)
            print(f"  mode={mode} layout={layout}")
            print(f"    {'rank':>4} {'tokens':>7} {'work':>7} {'bytes sent':>11} {'bytes recv':>11} {'max |err|':>10}")
            for r, res in enumerate(results):
                err = max_error([res], [refs[r]])
                worst = max(worst, err)
                work = cpref.attention_work(cu, cp_size=P, rank=r, layout=layout)
                print(f"    {r:>4} {res[0].shape[0]:>7} {work:>7} {summary.bytes_sent[r]:>11} {summary.bytes_recv[r]:>11} {err:>10.2e}")
            counts = ", ".join(f"{op} x{n}" for op, n in sorted(summary.counts.items()))
            print(f"    collectives (forward + backward): {counts}\n")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=cpref.LAYOUTS, action="append", help="limit part 2 to layouts")
    args = parser.parse_args(argv)
    cu = _cu(LENGTHS)
    part1_layouts(cu)
    worst = part2_modes(cu, args.layout or list(cpref.LAYOUTS))
    ok = worst <= 1e-10
    print(f"largest error against the FP64 oracle: {worst:.2e} ({'within' if ok else 'OUTSIDE'} 1e-10)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
