"""Collectives or pairwise sends: `TorchComm`'s two ways to exchange data, timed on gloo.

`TorchComm` can move the data of `all_gather`, `reduce_scatter` and `all_to_all` with the
backend's collectives or with one batch of pairwise sends and receives (`exchange`, see
[TorchComm][cpref.comm.torch_dist]). This benchmark times both ways on gloo, for one `(T_l, 8, 64)`
float32 block per rank (16 MiB at the default 8192 rows, `--rows`), on `--nproc` gloo processes
(2) with one thread each; for scale, one ring shift of the same block (`send_recv`); and the ranks'
comparison of their arguments that every attention call makes (`agree`,
[Do the ranks agree?][cpref.modes.consistency]). Every call is timed after a barrier, `--repeats`
times (5) in alternation between the two ways, and the fastest kept; the slowest rank's time
counts. Printed: the milliseconds of each way and the ratio native / p2p.

Pairwise is the default exchange of a gloo `TorchComm` because it wins here; NCCL and HCCL keep
their collectives ([What each backend can do](backend-facts.md)).

Run it with `python -m bench.collectives` (or `make bench`); `--help` lists the options.

{{ results collectives }}
"""

from __future__ import annotations

import os
import time

import torch

from cpref.comm import TorchComm
from cpref.modes.consistency import FIELDS
from sim.tools.cli import Parser, positive
from sim.tools.launch import launch

OPS = ("all_gather", "reduce_scatter", "all_to_all")


def rank_times(rows: int, repeats: int) -> dict[str, float]:
    """This rank's fastest seconds of each `(exchange, op)`, and of one ring shift."""
    comms = {name: TorchComm(exchange=name) for name in ("native", "p2p")}
    block = torch.randn(rows, 8, 64)  # (T_l, H, D)
    wide = torch.randn(comms["p2p"].size * rows, 8, 64)  # (P T_l, H, D): what reduce_scatter and all_to_all take
    calls = {(ex, op): (lambda c=c, op=op: getattr(c, op)(block if op == "all_gather" else wide))
             for ex, c in comms.items() for op in OPS}  # fmt: skip
    calls[("p2p", "send_recv")] = lambda: comms["p2p"].send_recv(block)
    calls[("p2p", "agree")] = lambda: comms["p2p"].agree([7] * len(FIELDS))  # the ranks' comparison
    best = {key: float("inf") for key in calls}
    for _ in range(repeats + 1):  # the first round warms the connections up and is not kept
        for key, call in calls.items():
            comms["p2p"].barrier()
            start = time.perf_counter()
            call()
            best[key] = min(best[key], time.perf_counter() - start) if _ else float("inf")
    return {f"{ex}/{op}": t for (ex, op), t in best.items()}


def markdown(results: dict) -> str:
    """The table: each call's slowest rank, both exchanges and their ratio; one ring shift and the ranks' check for scale."""
    t = results["seconds"]
    lines = ["| call | native (gloo collective) | p2p (pairwise sends) | native / p2p |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {op} | {t['native/' + op] * 1e3:.1f} ms | {t['p2p/' + op] * 1e3:.1f} ms | {t['native/' + op] / t['p2p/' + op]:.2f} |"
              for op in OPS]  # fmt: skip
    lines += [f"| send_recv (one ring shift, for scale) | | {t['p2p/send_recv'] * 1e3:.1f} ms | |", "",
              f"The ranks' comparison that every `cpref.attention` call makes (`agree`, one row of {len(FIELDS)} int64 "
              f"over the host): {t['p2p/agree'] * 1e6:.0f} us a call."]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=positive, default=8192, help="rows T_l of each rank's (T_l, 8, 64) float32 block")
    parser.add_argument("--nproc", type=positive, default=2)
    parser.add_argument("--repeats", type=positive, default=5)
    args = parser.parse_args(argv)
    mib = args.rows * 8 * 64 * 4 / 2**20
    title = (f"gloo exchanges: {args.nproc} processes, one thread each, a {mib:.0f} MiB block per rank, fastest of "
             f"{args.repeats} (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")  # fmt: skip
    print(f"## {title}\n")
    per_rank = launch(rank_times, args.nproc, args=(args.rows, args.repeats), check_calls=False)
    results = {"title": title, "seconds": {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}}  # the slowest rank
    print(markdown(results) + "\n")
    return results

if __name__ == "__main__":
    main()
