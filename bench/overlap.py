r"""Benchmark: the overlapped paths against the default ones, over gloo, side by side.

The batches of `bench/scaling.py` (16384 causal tokens: one document, and the packed mix of
four; 8 heads, head dim 64, float32, forward + backward, one thread per process), on two gloo
processes, with the zigzag and balanced layouts, each mode's default path next to its
overlapped ones:

* `mode="all_gather"` with `overlap=False` (the RFC's one call each way, the default) and
  `overlap=True` ([the overlap][cpref.modes.all_gather_overlap]: the local keys' calls while
  the K/V travel, the backward's halves around the re-gather and the reduce-scatter);
* `mode="a2a"` with `head_groups=1` (the one exchange, the default) and `head_groups=2, 4`
  ([Ulysses in head groups][cpref.modes.ulysses_pipeline]: each group's call while the next
  group's all-to-alls travel).

The paths alternate step by step so that all see the same machine. Per rank: the step, the
time inside kernel calls (`compute`) and inside collectives and their waits (`comm wait`), by
the proxies of `bench.timed`. Printed per batch, mode and layout: the step of each (the slowest
rank's, fastest of `--repeats`), the ratio to the mode's default (below 1: the overlap pays),
the waits it removes and the compute it adds (its extra kernel calls, its merge).

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
VARIANTS = (  # (mode, option, value), the mode's default first
    ("all_gather", "overlap", False), ("all_gather", "overlap", True),
    ("a2a", "head_groups", 1), ("a2a", "head_groups", 2), ("a2a", "head_groups", 4),
)


def rank_steps(lengths: list[int], heads: int, dim: int, repeats: int) -> dict:
    """On this rank: `{(layout, mode, option, value): [{"total", "compute", "comm"} per timed step]}`."""
    clock, raw = Clock(), TorchComm()
    comm, kernel = TimedComm(raw, clock), TimedKernel(cpref.TorchKernel(), clock)
    batch, small = _batch(sum(lengths), heads, dim), _batch(256, heads, dim, seed=1)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out: dict = {}
    for layout in LAYOUTS:
        timed, warm = (cpref.Sharding(c, cp_size=comm.size, layout=layout) for c in (torch.tensor(cu), [0, 256]))
        for step in range(repeats + 1):  # step 0: the warm-up, on a small batch
            for mode, option, value in VARIANTS:
                sharding, tensors = (warm, small) if step == 0 else (timed, batch)
                q, k, v, dout = (sharding.shard(t, comm.rank) for t in tensors)
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                raw.barrier()  # both ranks start together (not timed)
                clock.reset()
                start = time.perf_counter()
                cpref.attention(q, k, v, sharding, comm=comm, mode=mode, kernel=kernel, **{option: value}).backward(dout)
                if step:
                    out.setdefault((layout, mode, option, value), []).append(
                        {"total": time.perf_counter() - start, "compute": clock.compute, "comm": clock.comm})
    return out


def summary(per_rank: list[dict]) -> list[dict]:
    """Per layout and path: the fastest step (its slowest rank) and each rank's split."""
    rows = []
    for key in per_rank[0]:
        steps = list(zip(*(rank[key] for rank in per_rank)))  # per step: one dict per rank
        best = min(steps, key=lambda step: max(r["total"] for r in step))
        layout, mode, option, value = key
        rows.append({"layout": layout, "mode": mode, "option": option, "value": value,
                     "t2": max(r["total"] for r in best), "ranks": list(best)})  # fmt: skip
    return rows


def _defaults(batch: dict) -> dict:
    """`{(mode, layout): row}` of each mode's default path (the first of its `VARIANTS`)."""
    first = {}
    for mode, option, value in VARIANTS:
        first.setdefault(mode, value)
    return {(r["mode"], r["layout"]): r for r in batch["rows"] if first[r["mode"]] == r["value"]}


def markdown(batch: dict) -> str:
    """One batch: per mode and layout each path, each rank's split, and the ratio to the mode's default."""
    lines = ["| mode | layout | path | step | / default | compute per rank | comm wait per rank |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    default = _defaults(batch)
    for row in sorted(batch["rows"], key=lambda r: (r["mode"], LAYOUTS.index(r["layout"]))):  # stable: paths in order
        base = default[(row["mode"], row["layout"])]
        ratio = f"{row['t2'] / base['t2']:.2f}" if row is not base else ""
        compute = " / ".join(f"{r['compute']:.2f} s" for r in row["ranks"])
        wait = " / ".join(f"{r['comm']:.3f} s" for r in row["ranks"])
        lines.append(f"| {row['mode']} | {row['layout']} | {row['option']}={row['value']} | {row['t2']:.2f} s | {ratio} | "
                     f"{compute} | {wait} |")  # fmt: skip
    return "\n".join(lines)


def verdict(batches_run: list[dict]) -> str:
    """Where each overlapped path paid (ratio below 1), and by how much the waits fell and the compute rose."""
    parts = []
    for batch in batches_run:
        default = _defaults(batch)
        for row in batch["rows"]:
            base = default[(row["mode"], row["layout"])]
            if row is base:
                continue
            waits = sum(r["comm"] for r in base["ranks"]) - sum(r["comm"] for r in row["ranks"])
            extra = sum(r["compute"] for r in row["ranks"]) / sum(r["compute"] for r in base["ranks"]) - 1
            parts.append(f"{batch['name']} {row['mode']} {row['layout']} {row['option']}={row['value']}: "
                         f"{row['t2'] / base['t2']:.2f} (waiting {waits:+.3f} s less over the ranks, compute {extra:+.0%})")
    return "Overlapped path / the mode's default, step time: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> dict:
    parser = batch_parser(__doc__)
    args = parser.parse_args(argv)
    if args.tokens % 4:
        parser.error(f"--tokens {args.tokens}: zigzag over 2 ranks needs a multiple of 4")
    title = (f"The overlapped paths against the defaults: {args.tokens} causal tokens, {args.heads} heads, head dim "
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
