"""`make demo`: shard a packed batch over a CP group and run every CP mode on the simulated cluster.

Part 1 shards three documents over a CP group of 4 in every layout (one `cpref.Sharding`
each) and prints, per rank, the tokens held and the causal attention work, as exact score
counts and as the block metric `sum(q_len * kv_len)`, with the imbalance (max / mean) of each.
Part 2 runs every CP mode in every layout on the simulated cluster in FP64, forward and
backward, and prints one row per mode and layout: the largest error of out, dQ, dK, dV on
any rank against the dense FP64 oracle, the imbalance of the kernel work actually done, the
bytes each rank sent (from the cluster's trace), the bytes each rank saved for backward
(saved-tensor hooks), the kernel calls and the collectives a rank took part in, forward +
backward (a range where ranks differ).
Part 3 runs the production path: every mode and layout at CP 2 on two gloo processes in
float32 (`cpref.attention` over `TorchComm`), checked rank by rank against the simulated
cluster's FP64 ground truth (`python -m sim verify`, see `sim.tools.verify`): the per-rank table.
`python -m sim.tools.demo --device cuda` runs part 2 on a GPU (the simulated ranks are threads that
share it); parts 1 and 3 are the same on every machine.
"""

from __future__ import annotations

import textwrap
from collections import Counter

import torch

import cpref
from sim.cluster.harness import CountingKernel, max_error, mode_trace, oracle_shards, run_attention, saved_bytes
from sim.cluster.trace import summarize
from sim.tools import verify
from sim.tools.cli import Parser, device_name

LENGTHS = [48, 112, 32]  # three documents, each a multiple of 2P = 8
P = 4
HQ, HKV, D = 4, 2, 16


WIDTH = 80  # every line the demo prints fits a terminal of 80 columns and the site's code block (81)


def _key(text: str) -> str:
    """A table's key, wrapped to `WIDTH` under the table."""
    return textwrap.fill("key: " + text, width=WIDTH, initial_indent="  ", subsequent_indent="  ")


PART1_KEY = _key("tokens = the tokens of the packed batch the rank holds (padding included). exact scores = the "
                 "query-key pairs causal attention computes on the rank (each query sees the keys of its own "
                 "document up to itself). block metric = the sum of q_len x kv_len over the rank's attention "
                 "calls, a coarser count that charges whole blocks. imbalance = the busiest rank's count over the "
                 "mean: 1.000 is perfectly even.")
OPS = {"all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "send_recv": "SR"}
PART2_KEY = _key("max|err| = the largest difference of out, dQ, dK or dV on any rank from the dense FP64 oracle. "
                 "work = the busiest rank's kernel work (scores computed) over the mean. sent = the bytes each rank "
                 "sends, forward + backward, from the cluster's trace. saved = the bytes of the tensors each rank "
                 "keeps for the backward. calls = attention kernel calls per rank, forward + backward. collectives = "
                 "the calls rank 0 takes part in, each with its count: "
                 + ", ".join(f"{short} {op}" for op, short in OPS.items()) + ". A range (a-b) where the ranks differ.")


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)


def _imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def part1_layouts(cu: torch.Tensor) -> None:
    print(f"Part 1: {len(LENGTHS)} documents of {LENGTHS} tokens over a CP group of {P}")  # within WIDTH
    print(textwrap.fill("What this shows: how each layout splits the documents over the ranks, and how evenly the "
                        "causal attention work follows (a rank that holds the ends of documents has more keys to "
                        "look at).", width=WIDTH) + "\n")
    for layout in cpref.LAYOUTS:
        sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
        exact = [sharding.attention_work(r, exact=True) for r in range(P)]
        block = [sharding.attention_work(r) for r in range(P)]
        tokens = [len(sharding.global_index(r)) for r in range(P)]
        print(f"  layout={layout}")
        print(f"    {'rank':>4} {'tokens':>7} {'exact scores':>13} {'block metric':>13}")
        for r in range(P):
            print(f"    {r:>4} {tokens[r]:>7} {exact[r]:>13} {block[r]:>13}")
        print(f"    imbalance (max/mean): exact scores = {_imbalance(exact):.3f}, "
              f"block metric = {_imbalance(block):.3f}\n")
    print(PART1_KEY + "\n")


def _same(values: list[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else f"{min(values)}-{max(values)}"


def part2_modes(cu: torch.Tensor, layouts: list[str], device: torch.device | str = "cpu") -> float:
    device = torch.device(device)
    T = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, D, generator=g, dtype=torch.float64).to(device) for h in (HQ, HKV, HKV, HQ))
    on = "" if device.type == "cpu" else f" on {device}"
    print(f"Part 2: every CP mode, FP64 on the simulated cluster{on}, P={P} Hq={HQ} Hkv={HKV} D={D},\n"
          "causal, forward + backward, per rank")
    print(textwrap.fill("What this shows: every mode gives the exact answer in every layout, and what each costs a "
                        "rank: the bytes it sends, the memory it keeps for the backward, the kernel calls and "
                        "collectives.", width=WIDTH) + "\n")
    head = f"  {'mode':<10} {'layout':<10} {'max|err|':>8} {'work':>5} {'sent':>6} {'saved':>12} {'calls':>5}  collectives"
    print(head + "\n  " + "-" * (WIDTH - 2))
    worst, shardings = 0.0, {layout: cpref.Sharding(cu, cp_size=P, layout=layout) for layout in layouts}
    for mode in sorted(cpref.MODES):
        extra = cpref.MODES[mode].example_options(P)  # the hierarchical mode: 2 x 2
        for layout, sharding in shardings.items():
            kernels = [CountingKernel() for _ in range(P)]
            results, cluster = run_attention(q, k, v, dout, sharding, mode=mode, kernels=kernels, check_ranks=False, **extra)
            err = max_error(results, oracle_shards(q, k, v, dout, sharding))
            worst = max(worst, err)
            summary = summarize(mode_trace(cluster))
            sent = [summary.bytes_sent[r] for r in range(P)]
            saved = saved_bytes(q, k, v, sharding, mode=mode, check_ranks=False, **extra)
            calls = [kern.forward_calls + kern.backward_calls for kern in kernels]
            ops = Counter(ev.op for ev in mode_trace(cluster) if 0 in ev.group and ev.op != "split")  # rank 0's calls
            work = _imbalance([kern.forward_work() for kern in kernels])
            print(f"  {mode:<10} {layout:<10} {err:>8.1e} {work:>5.2f} {_same(sent):>6} {_same(saved):>12} "
                  f"{_same(calls):>5}  " + ", ".join(f"{OPS[op]} x{n}" for op, n in sorted(ops.items())))
    print("\n" + PART2_KEY + "\n")
    return worst


# part 3: the documents of parts 1 and 2, four times as long (the GQA heads of sim.tools.verify)
VERIFY_ARGS = ["--backend", "gloo", "--nproc", "2", "--mode", "all", "--layout", "all", "--dtype", "fp32",
               "--docs", ",".join(str(4 * n) for n in LENGTHS), "--timeout", "120"]  # fmt: skip


def part3_verify() -> int:
    print("Part 3: the production path on 2 gloo processes, rank by rank against the FP64 ground truth\n")
    print("  $ python -m sim verify " + " ".join(VERIFY_ARGS), flush=True)
    return verify.main(VERIFY_ARGS)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=cpref.LAYOUTS, action="append", help="limit part 2 to layouts")
    parser.add_argument("--device", type=device_name, default="cpu", help="torch device of part 2's tensors, e.g. cuda (default cpu)")
    args = parser.parse_args(argv)
    cu = _cu(LENGTHS)
    part1_layouts(cu)
    worst = part2_modes(cu, args.layout or list(cpref.LAYOUTS), torch.device(args.device))
    ok = worst <= 1e-10
    print(f"largest error against the FP64 oracle: {worst:.2e} ({'within' if ok else 'OUTSIDE'} 1e-10)\n")
    verified = part3_verify() == 0
    return 0 if ok and verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
