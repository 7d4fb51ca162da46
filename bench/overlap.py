r"""Benchmark: the all-gather mode's overlap against its one call, over gloo, side by side.

The batches of `bench/scaling.py` (16384 causal tokens: one document, and the packed mix of
four; 8 heads, head dim 64, float32, forward + backward, one thread per process), on two gloo
processes, with the zigzag and balanced layouts: `mode="all_gather"` with `overlap=False` (the
RFC's one call each way, the default) and `overlap=True` ([the overlap][cpref.modes.all_gather_overlap]:
the local keys' calls while the K/V travel, the backward's halves around the re-gather and the
reduce-scatter), the two alternating step by step so that both see the same machine. Per rank:
the step, the time inside kernel calls (`compute`) and inside collectives and their waits
(`comm wait`), by the proxies of `bench.timed`. Printed per batch and layout: the step of each
(the slowest rank's, fastest of `--repeats`), the ratio overlap / one call (below 1: the overlap
pays), the waits it removes and the compute it adds (its extra kernel calls and merge).

Run it with `python -m bench.overlap` (or `make bench`); `--tokens 4096` for a quick run.
"""

from __future__ import annotations

import os
import time

import torch

import cpref
from bench.scaling import _batch, batch_parser, batches
from bench.timed import Clock, TimedComm, TimedKernel
from cpref.backends import TorchComm
from sim.tools.launch import launch

LAYOUTS = ("zigzag", "balanced")
VARIANTS = (False, True)  # overlap


def rank_steps(lengths: list[int], heads: int, dim: int, repeats: int) -> dict:
    """On this rank: `{(layout, overlap): [{"total", "compute", "comm"} per timed step]}`."""
    clock, raw = Clock(), TorchComm()
    comm, kernel = TimedComm(raw, clock), TimedKernel(cpref.TorchKernel(), clock)
    batch, small = _batch(sum(lengths), heads, dim), _batch(256, heads, dim, seed=1)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out: dict = {}
    for layout in LAYOUTS:
        timed, warm = (cpref.Sharding(c, cp_size=comm.size, layout=layout) for c in (torch.tensor(cu), [0, 256]))
        for step in range(repeats + 1):  # step 0: the warm-up, on a small batch
            for overlap in VARIANTS:
                sharding, tensors = (warm, small) if step == 0 else (timed, batch)
                q, k, v, dout = (sharding.shard(t, comm.rank) for t in tensors)
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                raw.barrier()  # both ranks start together (not timed)
                clock.reset()
                start = time.perf_counter()
                cpref.attention(q, k, v, sharding, comm=comm, mode="all_gather", kernel=kernel, overlap=overlap).backward(dout)
                if step:
                    out.setdefault((layout, overlap), []).append(
                        {"total": time.perf_counter() - start, "compute": clock.compute, "comm": clock.comm})
    return out


def summary(per_rank: list[dict]) -> list[dict]:
    """Per layout and variant: the fastest step (its slowest rank) and each rank's split."""
    rows = []
    for layout, overlap in per_rank[0]:
        steps = list(zip(*(rank[(layout, overlap)] for rank in per_rank)))  # per step: one dict per rank
        best = min(steps, key=lambda step: max(r["total"] for r in step))
        rows.append({"layout": layout, "overlap": overlap, "t2": max(r["total"] for r in best), "ranks": list(best)})
    return rows


def markdown(batch: dict) -> str:
    """One batch: per layout the one call and the overlap, each rank's split, and the ratio."""
    lines = ["| layout | overlap | step | overlap / one call | compute per rank | comm wait per rank |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    by = {(r["layout"], r["overlap"]): r for r in batch["rows"]}
    for (layout, overlap), row in by.items():
        ratio = f"{row['t2'] / by[(layout, False)]['t2']:.2f}" if overlap else ""
        compute = " / ".join(f"{r['compute']:.2f} s" for r in row["ranks"])
        wait = " / ".join(f"{r['comm']:.3f} s" for r in row["ranks"])
        lines.append(f"| {layout} | {'yes' if overlap else 'no'} | {row['t2']:.2f} s | {ratio} | {compute} | {wait} |")
    return "\n".join(lines)


def verdict(batches_run: list[dict]) -> str:
    """Where the overlap paid (ratio below 1), and by how much the waits fell and the compute rose, per rank."""
    parts = []
    for batch in batches_run:
        by = {(r["layout"], r["overlap"]): r for r in batch["rows"]}
        for layout in LAYOUTS:
            one, ov = by[(layout, False)], by[(layout, True)]
            waits = sum(r["comm"] for r in one["ranks"]) - sum(r["comm"] for r in ov["ranks"])
            extra = sum(r["compute"] for r in ov["ranks"]) / sum(r["compute"] for r in one["ranks"]) - 1
            parts.append(f"{batch['name']} {layout}: {ov['t2'] / one['t2']:.2f} (waiting {waits:+.3f} s less over "
                         f"the ranks, compute {extra:+.0%})")  # fmt: skip
    return "Overlap / one call, step time: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> dict:
    parser = batch_parser(__doc__)
    args = parser.parse_args(argv)
    if args.tokens % 4:
        parser.error(f"--tokens {args.tokens}: zigzag over 2 ranks needs a multiple of 4")
    title = (f"The all-gather overlap against the one call: {args.tokens} causal tokens, {args.heads} heads, head dim "
             f"{args.head_dim}, float32, forward + backward, 2 gloo processes of 1 thread (load average "
             f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")  # fmt: skip
    print(f"## {title}\n", flush=True)
    batches_run = []
    for name, lengths in batches(args.tokens).items():
        per_rank = launch(rank_steps, 2, args=(lengths, args.heads, args.head_dim, args.repeats), check_calls=False,
                          timeout=3600.0)  # fmt: skip
        batch = {"name": name, "lengths": lengths, "rows": summary(per_rank)}
        print(f"### {name} ({lengths})\n\n{markdown(batch)}\n", flush=True)
        batches_run.append(batch)
    text = verdict(batches_run)
    print(text)
    return {"title": title, "batches": batches_run, "verdict": text}


if __name__ == "__main__":
    main()
