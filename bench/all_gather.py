"""All-gather balance, timed: each rank's share of the all-gather mode, contiguous against zigzag, at P = 2, 4 and 8.

In [the all-gather mode](all-gather.md) every rank gathers every key and attends its own queries,
so a rank's work is its queries' share of the attention, and the layout decides how even the
shares are. This benchmark times each share alone and prints the measured imbalance next to the
counted one.

For a packed batch (default: the field's `cu_seqlens = [0, 120, 1248, 4232]`, padded to the
layout's granularity; 8 query heads, 2 key/value heads, head dim 64), every rank's share of the
attention, forward + backward, is timed one rank after the other on this process, by running the
mode's own `all_gather_forward` / `all_gather_backward` with that rank's plan against a *replay*
communicator: its all-gather returns every rank's shard (what the real one would), its
reduce-scatter keeps this rank's rows, so only the rank's own work is timed. Printed per layout
and CP size:

* each rank's measured time, and the measured imbalance (max / mean) beside the counted one
  (`work = sum(q_len * kv_len)`);
* the efficiency of the step, `ideal / (P * slowest)`, where `ideal` is the time of the same
  kernel calls on one device, every rank's share one after the other (the sum of the ranks'
  times): the fraction of perfect scaling that the slowest rank allows, at most 1. The
  communication is not timed here; [The layouts on packed batches](perf-layouts.md) counts each
  mode's bytes. One kernel call over the whole batch is printed beside it, `one call`, but not
  used: its tiles and cache footprint differ from the shares', so its time per score is another
  kernel's (as a baseline it makes `one call / (P * slowest)` exceed 1 at `P = 4`).

Run it with `python -m bench.all_gather` (or `make bench`); `--cu`, `--cp`, `--heads`,
`--kv-heads`, `--dim` and `--repeats` (5, the fastest kept) change the defaults.

{{ results all_gather }}
"""

from __future__ import annotations

import statistics
import time

import torch

import cpref
from cpref.api import check_mode
from cpref.base.errors import CPInputError
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.kernels import Varlen
from cpref.modes.all_gather import all_gather_backward, all_gather_forward
from cpref.modes.all_gather_plan import build_all_gather_plan
from sim.tools.cli import Parser, nonnegative, positive


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fwd_bwd(kernel, q, k, v, dout, seqs, scale):
    """Forward + backward of one kernel call over the whole batch (the no-CP baseline)."""
    def step():
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale)
        kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale)

    return step


class ReplayComm:
    """One rank's view of the all-gather mode's collectives, answered from precomputed shards."""

    def __init__(self, rank: int, shards: list[list[torch.Tensor]]) -> None:
        self.rank, self.size, self._shards = rank, len(shards), shards

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        which = 1 if x is self._shards[self.rank][1] else 2  # this rank's K shard, else its V shard
        return torch.cat([s[which] for s in self._shards])  # (P T_l, Hkv, .): rank-major, as the real one

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x.tensor_split(self.size)[self.rank].clone()  # this rank's rows (the sum is not timed)


def rank_seconds(sharding: cpref.Sharding, q, k, v, dout, repeats: int) -> list[float]:
    """Measured forward + backward seconds of every rank's all-gather CP share (its compute only)."""
    kernel, scale, P = cpref.TorchKernel(), q.shape[-1] ** -0.5, sharding.cp_size
    shards = [[sharding.shard(t, r) for t in (q, k, v, dout)] for r in range(P)]
    out = []
    for r in range(P):
        plan = build_all_gather_plan(sharding.bounds, P, r, sharding.layout, True, torch.device("cpu"))
        comm = ReplayComm(r, shards)
        ql, kl, vl, dl = shards[r]

        def step(ql=ql, kl=kl, vl=vl, dl=dl, plan=plan, comm=comm):  # this rank's, bound
            o, lse, k_sel, v_sel = all_gather_forward(ql, kl, vl, plan, comm, kernel, causal=True, scale=scale)
            all_gather_backward(dl, ql, k_sel, v_sel, o, lse, plan, comm, kernel, causal=True, scale=scale)

        out.append(_time(step, repeats))
    return out


def efficiency(seconds: list[float]) -> float:
    """`ideal / (P * slowest)` with `ideal` the ranks' shares one after the other on one device: at most 1."""
    return sum(seconds) / (len(seconds) * max(seconds))


def markdown(results: dict) -> str:
    """The table: per `P` and layout, every rank's milliseconds, the imbalance measured and counted, the efficiency."""
    lines = ["| P | layout | per-rank ms | imbalance, measured | imbalance, counted | efficiency | one call |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in results["rows"]:
        ms = " ".join(f"{s * 1e3:.1f}" for s in r["seconds"])
        lines.append(f"| {r['P']} | {r['layout']} | {ms} | {r['measured']:.2f} | {r['counted']:.2f} | "
                     f"{efficiency(r['seconds']):.2f} | {r['one call'] * 1e3:.1f} ms |")  # fmt: skip
    lines += ["", "imbalance: the slowest rank over the mean; efficiency: ideal / (P * slowest), the ranks' shares one "
              "after the other over P times the slowest (at most 1); one call: the whole batch in one kernel call, "
              "printed beside it, not used."]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--cu", type=nonnegative, nargs="+", default=[0, 120, 1248, 4232])
    parser.add_argument("--cp", type=positive, nargs="+", default=[2, 4, 8])
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--kv-heads", type=positive, default=2)
    parser.add_argument("--dim", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=5)
    args = parser.parse_args(argv)
    try:  # the batch and the heads, refused before anything runs
        cpref.Sharding(args.cu, cp_size=1)
        check_mode("all_gather", cp_size=max(args.cp), heads=(args.heads, args.kv_heads), layout="zigzag")
    except CPInputError as exc:
        parser.error(str(exc))
    lengths = [b - a for a, b in zip(args.cu[:-1], args.cu[1:])]
    title = (f"KV all-gather CP compute balance: documents {lengths}, Hq={args.heads} Hkv={args.kv_heads} D={args.dim}, "
             f"float32, causal fwd+bwd, {torch.get_num_threads()} threads, median of {args.repeats}")  # fmt: skip
    print(f"## {title}\n")
    rows = []
    for P in args.cp:
        for layout in CHUNKED_LAYOUTS:  # the RFC's plan: every document in chunks (stream and balanced: bench.layouts)
            # the documents padded to the layout's granularity, the padding counted as tokens (as the field's runs)
            cu = cpref.Sharding.eod_padded(args.cu, cp_size=P, layout=layout).cu_seqlens_padded
            sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
            g = torch.Generator().manual_seed(0)
            T = sharding.total
            q, dout = (torch.randn(T, args.heads, args.dim, generator=g) for _ in range(2))
            k, v = (torch.randn(T, args.kv_heads, args.dim, generator=g) for _ in range(2))
            secs = rank_seconds(sharding, q, k, v, dout, args.repeats)
            one_call = _time(_fwd_bwd(cpref.TorchKernel(), q, k, v, dout, Varlen(list(cu)), args.dim**-0.5), args.repeats)
            work = [sharding.attention_work(r) for r in range(P)]
            rows.append({"P": P, "layout": layout, "seconds": secs, "measured": max(secs) / statistics.mean(secs),
                         "counted": max(work) / statistics.mean(work), "one call": one_call})  # fmt: skip
    results = {"title": title, "rows": rows}
    print(markdown(results))
    return results

if __name__ == "__main__":
    main()
