r"""Strong scaling over gloo: every CP mode from CP = 1 to CP = 2 on real process groups, each rank's step split into compute and waiting.

Two causal batches of 16384 tokens, one document and a packed mix of four, 4 heads, head dim 64,
float32, forward + backward, one thread per process:

* **T(CP=1)**: one process runs `TorchKernel` forward + backward over the whole batch, which is
  what every mode reduces to at CP = 1;
* **T(CP=2)**: two processes (`sim.tools.launch`, gloo) run `cpref.attention` forward + backward
  for every mode of `cpref.MODES` in the zigzag and balanced layouts, each rank on its shard (the
  contiguous layout's imbalance and the stream layout's costs are counted in
  [The layouts on packed batches](perf-layouts.md)). A step lasts as long as its slowest rank; the
  ranks start each step together, after a barrier.

Each rank's step is split into **compute** (time inside kernel calls), **comm wait** (inside
collectives and ring-shift waits) and **other** (validation, plans, merging, copies), measured by
the timing proxies of `bench.timed` around the communicator and the kernel.

## The efficiency against the machine

Beside the speedup $T(\text{CP}=1) / T(\text{CP}=2)$ the benchmark times the **machine's
two-process factor**: the CP = 1 step run by two independent processes at once, with no
communication, $2\,T(\text{CP}=1)/T(\text{both})$, what two busy cores (sharing caches, memory
bandwidth and the virtual machine's host) give on two copies of the same work. The speedup over
that factor is the **efficiency against the machine**, $T(\text{both}) / (2\,T(\text{CP}=2))$, 1
when CP = 2 runs as fast as two processes without communication can: a figure that means the same
on any machine, where a speedup target such as 1.8 would hold only where two processes reach 1.9.
Target: at least 0.95 in the zigzag and balanced layouts. A split can exceed the factor when its
smaller pieces run more efficiently per score than one large call, as the 16k document's do. On
the packed mix each rank's compute should be at most 3% over half the CP = 1 step (printed also
over half the step of two processes at once: the split's own extra work, without two busy cores'
cost to each other); on both, its comm wait at most 3% of its step. Every goal is printed, never
asserted.

## How a step is timed

Every timed step runs in rounds (`--repeats`, 2), after one untimed step on a small document
(groups, connections, first calls): each round times the CP = 1 step alone, the same step on both
processes at once and then every CP = 2 configuration, so a slow spell of the virtual machine (a
minute in which every step is 10-20% slower, seen here) hits the baseline and the split alike; the
fastest of each is kept. (Run all the CP = 1 steps first, as until 2026-12-04, and such a spell
reads as 10-29% compute inflation in every mode of one run and none in the next.) A spell shorter
than a round still shows in single rows, one configuration's compute 10-35% above the rows beside
it; a third round did not remove them.

## The ring, shift by shift

For the ring (`p2p`) every kernel call of each rank is printed (one per step without a window;
under one a step can make two): its compute time and the time then spent waiting for the next
block. Then every shift on its own: the timing proxies number each posted shift, and its wait
names the post it completes (`bench/ring_timing.py`), so the share of a shift hidden behind
compute is $1 - \min(e, t_s) / t_s$, with $e$ the time the rank spent inside its post and its wait
and $t_s$ the time of one blocking shift of the ring's largest payload (the block, or under a
window the largest halo), measured alone on the same processes. Waiting longer than $t_s$ is
waiting for the other rank's compute: imbalance, which the per-call times show.

A shift can be hidden only if a kernel call runs between its post and its wait. At CP = 2 the
forward's one shift of K/V, the backward's one shift of K/V and the first shift of the float32
dK/dV accumulators (posted after step 0, awaited after step 1's call) each have one; the
accumulators' trip home after the last call has none, at any $P$, and is shown as `-`. The target,
at least 90% hidden, judges every shift with a call to hide behind (stricter than the issue's
"every shift but the last one of each direction"). The fraction over all of a rank's shifts, the
accumulators' trip home included, is printed beside it.

## The planner's predictions

Every row is also predicted by [the planner](planner.md) (`python -m sim plan` with the
`this-machine` profile the same run calibrates at its start,
[Calibrating this machine](plan-calibrate.md)). Goals: every prediction within 15% of the measured
step, the modes ranked as measured. The profile prices each kernel call by its work per head and
its heads (`by_work`, [the profiles](plan-profiles.md)): at equal FLOPs a Ulysses call, half the
heads over twice the work per head, runs a few percent faster here than an all-gather call, and on
one causal document that is what orders the modes.

## The overlapped paths

Without a window, each overlapped path runs beside its mode's default, in the same run, on the
same batches and layouts:

* the all-gather mode's one call each way (the RFC's, the default) and `overlap=True`, which
  posts the K/V all-gathers and computes the attention of the local keys while they travel, and
  in the backward hides the re-gather and the reduce-scatter of dK/dV behind the two halves of
  the local work ([the all-gather overlap][cpref.modes.all_gather_overlap]);
* Ulysses' one exchange (the default) and `head_groups=2` (one head of each rank's two a group),
  which post every head group's all-to-alls and attend one group while the next travels, the
  outputs and gradients going home under the next group's call
  ([Ulysses in head groups][cpref.modes.ulysses_pipeline]).

Each is printed with its ratio to its mode's default (below 1: the overlap pays), the waits it
removes and the compute it adds. On two cores neither has a spare core to move the data with:
gloo's copies compete with the kernel. The all-gather overlap removes most of the waiting but adds
two kernel calls and a merge; Ulysses' waits are a few percent of the step (on stream and balanced
[the split's balance](ulysses-split.md#balance) evens the ranks' work), so its head groups have
little to hide, and smaller calls to pay for it. Across runs both paths have come out between about
0.8 and 1.3 of their defaults, mostly either side of 1: within what this machine moves from step to
step (the best case, Ulysses' head groups on the packed mix in zigzag, 0.92 to 1.06 over thirteen
runs). So the defaults stay the one call and the one exchange until a backend that moves data off
the compute cores (NCCL, HCCL) is measured (issue 25); pass `overlap=True` or `head_groups` where a
measurement of your own says so.

## Windows, other CP sizes, running it

Both batches run twice: full causal, and under a causal sliding window `window=(1024, 0)`, where
the ring sends each rank only the halo its window reads
([The ring under a sliding window](ring-window.md)) and is compared with a shift of that size. The
goals judge the full-causal batches.

`make bench` runs $P = 2$, all that this machine's two cores run without oversubscription.
`--cp P` runs `P` processes on `P` free cores (with fewer the figures measure the
oversubscription): the $P$-process factor, the compute over $T(\text{CP}=1) / P$, a ring of
$P - 1$ shifts each way, and the hierarchy (`a2a+p2p`, groups of 2, [its page][cpref.modes.hierarchical])
in head groups beside its default, which at CP = 2 (a ring of one rank) is Ulysses' pipeline bit
for bit in the chunked layouts, and is not timed.

Run it with `python -m bench.scaling` (or `make bench`); `--tokens 4096` for a quick run;
`--window none 256 4096` for other windows; `python -m bench.scaling --cp 4 --heads 8` on a
machine with four cores or more.

{{ results scaling }}
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import cpref
from bench.ring_timing import hidden, ring_shifts, ring_steps, shift_hidden
from bench.timed import Clock, TimedComm, TimedKernel
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.comm import TorchComm
from cpref.kernels import Varlen
from cpref.modes.ring_window import build_window_ring_plan
from sim.tools.cli import Parser, positive
from sim.tools.launch import launch

CALIBRATION = Path(__file__).resolve().parent / "out" / "this-machine.json"  # bench.all.OUT's: never the committed one

TARGET = 0.95  # efficiency against the machine, for zigzag and balanced
TARGET_LAYOUTS = ("zigzag", "balanced")
INFLATION_TARGET, WAIT_TARGET = 0.03, 0.03  # compute over half the CP = 1 step; comm wait over the rank's step
RING_TARGET = 0.9  # of each ring shift with a kernel call to hide behind (bench.ring_timing)
TIMED_LAYOUTS = TARGET_LAYOUTS  # contiguous (imbalanced by design) and stream: counted in bench.layouts' tables


def paths(heads: int, P: int = 2) -> tuple[tuple[str, str, object], ...]:
    """The overlapped paths, beside the defaults: the all-gather overlap, Ulysses in head groups of one head (each of
    the `P` ranks' `heads / P` heads a group: the deepest pipeline) and, at `P >= 4`, where the hierarchy has both
    levels, its a2a level in head groups of one head (`heads / a` heads a rank after an exchange over `a` ranks)."""
    out = (("all_gather", "overlap", True), ("a2a", "head_groups", heads // P))
    a = cpref.MODES["a2a+p2p"].example_options(P)["a2a_size"]  # the hierarchy's a2a group size, as every row runs it
    return out + ((("a2a+p2p", "head_groups", heads // a),) if P >= 4 else ())


def batches(tokens: int, P: int = 2) -> dict[str, list[int]]:
    """One document, and a packed mix of four (each a multiple of `2 P`: zigzag over `P` ranks)."""
    mix = [2 * P * round(tokens * f / (2 * P)) for f in (0.015, 0.137, 0.364)]
    return {f"1 x {tokens}": [tokens], "4 mixed": [*mix, tokens - sum(mix)]}


def _batch(tokens: int, heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout: `(T, H, D)` each, float32."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, heads, dim, generator=gen) for _ in range(4))


def cp1_step(kernel, batch, seqs: Varlen, scale: float, window=(-1, -1), together: bool = True) -> float:
    """Seconds of one forward + backward of one kernel call over the whole batch, on this process's own copy
    (`together`: every process of the world alike, starting together: the two-process factor)."""
    q, k, v, dout = batch
    if together:
        torch.distributed.barrier()
    start = time.perf_counter()
    out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale, window=window)
    kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=scale, window=window)
    return time.perf_counter() - start


def batch_rank(lengths: list[int], heads: int, dim: int, repeats: int, window=(-1, -1)) -> dict:
    """One batch on this rank of `P` (the world), in one launch and in `repeats` rounds; each round runs 1) CP = 1 on
    rank 0 alone (the others blocked in a barrier, not computing), 2) the same step on every process at once (the
    machine's `P`-process factor; at `P = 2` the pair), 3) every mode at CP = `P` (`CPSteps.round`). A slow spell of
    the machine then hits the CP = 1 step, the `P` processes and CP = `P` alike, and the ratios of their fastest
    rounds compare like with like. Returns `{"alone": [s], "pair": [s], "cp": {...}, "rounds": [(round, what,
    start)]}` (`start`: this process's clock when each step began; `what`: `"alone"`, `"pair"` or `"cp"`, the
    round's every CP = `P` configuration)."""
    kernel, batch, seqs = cpref.TorchKernel(), _batch(sum(lengths), heads, dim), Varlen.from_lengths(lengths, lengths)
    cp, rounds, alone, pair = CPSteps(lengths, heads, dim, window), [], [], []
    for i in range(repeats):
        if torch.distributed.get_rank() == 0:
            rounds.append((i, "alone", time.perf_counter()))
            alone.append(cp1_step(kernel, batch, seqs, dim**-0.5, window, together=False))
        torch.distributed.barrier()
        rounds.append((i, "pair", time.perf_counter()))
        pair.append(cp1_step(kernel, batch, seqs, dim**-0.5, window))
        rounds.append((i, "cp", time.perf_counter()))
        cp.round()
    return {"alone": alone, "pair": pair, "cp": cp.results, "rounds": rounds}


def _step(comm, kernel, clock: Clock, batch, sharding: cpref.Sharding, mode: str, window=(-1, -1), **path) -> dict:
    """One timed forward + backward of `cpref.attention` on this rank: total, compute, comm, events."""
    options = {**cpref.MODES[mode].example_options(comm.size), **path}
    q, k, v, dout = (sharding.shard(t, comm.rank) for t in batch)  # (T / P, H, D)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    comm.inner.barrier()  # every rank starts the step together (not timed)
    clock.reset()
    start = time.perf_counter()
    out = cpref.attention(q, k, v, sharding, comm=comm, mode=mode, kernel=kernel, window=window, **options)
    out.backward(dout)
    return {"total": time.perf_counter() - start, "compute": clock.compute, "comm": clock.comm, "events": list(clock.events)}


def configurations(window: tuple[int, int], heads: int, P: int = 2) -> list[tuple[str, dict]]:
    """`(mode, path)`: every mode's default (`{}`), then, without a window, the overlapped `paths(heads, P)`."""
    overlapped = [(mode, {option: value}) for mode, option, value in paths(heads, P)] if window == (-1, -1) else []
    return [(mode, {}) for mode in sorted(cpref.MODES)] + overlapped


def path_name(path: dict) -> str:
    """`"overlap=True"`, or `""` for a mode's default."""
    return ", ".join(f"{name}={value}" for name, value in path.items())


def shift_seconds(comm, rows: int, heads: int, dim: int, repeats: int = 3) -> float:
    """The fastest blocking ring shift of `rows` rows of K/V, `(rows, H, 2 D)` float32, alone."""
    kv, times = torch.randn(rows, heads, 2 * dim), []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        comm.send_recv(kv)
        times.append(time.perf_counter() - start)
    return min(times)


def shifted_rows(sharding: cpref.Sharding, window: tuple[int, int]) -> int:
    """The rows of the ring's largest shift: the whole block of a chunked layout, else (under a window, or the
    balanced layout's shared rows) the largest halo of the plan."""
    if window == (-1, -1) and sharding.layout in CHUNKED_LAYOUTS:
        return sharding.local_tokens
    plan = build_window_ring_plan(sharding.bounds, sharding.cp_size, 0, sharding.layout, True, window, torch.device("cpu"))
    return max(plan.halo.sizes)


class CPSteps:
    """Every mode (and overlapped path) and layout at CP = `P` (the world's size) on this rank, one timed step each
    per `round()`.

    `results`: `{(mode, layout, path): [one dict per round]}`, and per layout the time of one of the ring's shifts
    alone (`("shift", layout)`). Made once per batch: groups, connections and every configuration's first calls are
    warmed up on a small document first.
    """

    def __init__(self, lengths: list[int], heads: int, dim: int, window=(-1, -1)) -> None:
        self.clock, raw = Clock(), TorchComm()
        self.comm, self.kernel = TimedComm(raw, self.clock), TimedKernel(cpref.TorchKernel(), self.clock)
        self.batch, self.window = _batch(sum(lengths), heads, dim), window
        small = _batch(256, heads, dim, seed=1)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        self.shardings = {layout: cpref.Sharding(cu, cp_size=raw.size, layout=layout) for layout in TIMED_LAYOUTS}
        self.results: dict = {("shift", layout): shift_seconds(raw, shifted_rows(timed, window), heads, dim)
                              for layout, timed in self.shardings.items()}  # fmt: skip
        self.runs = [(mode, path, layout) for mode, path in configurations(window, heads, raw.size)
                     for layout in self.shardings]  # fmt: skip
        for mode, path, layout in self.runs:  # warm-up: groups, connections, first calls
            warm = cpref.Sharding([0, 256], cp_size=raw.size, layout=layout)
            _step(self.comm, self.kernel, self.clock, small, warm, mode, window, **path)

    def round(self) -> None:
        """One timed step of every configuration, in turn."""
        for mode, path, layout in self.runs:
            step = _step(self.comm, self.kernel, self.clock, self.batch, self.shardings[layout], mode, self.window, **path)
            self.results.setdefault((mode, layout, path_name(path)), []).append(step)


def summary(t1: float, t_pair: float, per_rank: list[dict]) -> dict:
    """One batch's results as plain numbers: per mode and layout the fastest step (each rank's split), the ring's
    calls per rank, and the shift alone per layout."""
    t_shift = {layout: max(rank[("shift", layout)] for rank in per_rank) for layout in TIMED_LAYOUTS}
    rows, ring = [], []
    for key in (k for k in per_rank[0] if k[0] != "shift"):
        steps = list(zip(*(rank[key] for rank in per_rank)))  # per timed step: one dict per rank
        best = min(steps, key=lambda step: max(r["total"] for r in step))  # the fastest step
        mode, layout, path = key
        ranks = [{"total": r["total"], "compute": r["compute"], "comm": r["comm"]} for r in best]
        rows.append({"mode": mode, "layout": layout, "path": path, "t2": max(r["total"] for r in best), "ranks": ranks})
        if mode == "p2p" and not path:
            ring += [{"layout": layout, "rank": rank, "steps": ring_steps(r["events"]), "shifts": ring_shifts(r["events"])}
                     for rank, r in enumerate(best)]  # fmt: skip
    return {"t1": t1, "t_pair": t_pair, "rows": rows, "ring": ring, "shift": t_shift, "target": TARGET,
            "target_layouts": list(TARGET_LAYOUTS)}  # fmt: skip


def cp_size(batch: dict) -> int:
    """`P`: the ranks every row was measured on."""
    return len(batch["rows"][0]["ranks"])


def compute_inflation(batch: dict, row: dict) -> list[float]:
    """Each rank's compute (inside kernel calls) over `1 / P` of the CP = 1 step, minus 1: the extra work of smaller
    calls."""
    return [x["compute"] / (batch["t1"] / len(row["ranks"])) - 1 for x in row["ranks"]]


def busy_inflation(batch: dict, row: dict) -> list[float]:
    """Each rank's compute over `1 / P` of the step of `P` processes at once (`T_pair / P`), minus 1: the extra work
    of the CP split alone, without what busy cores cost each other (which `compute_inflation` includes)."""
    return [x["compute"] / (batch["t_pair"] / len(row["ranks"])) - 1 for x in row["ranks"]]


def efficiency(batch: dict, row: dict) -> float:
    """The speedup over what `P` independent processes achieve here: `(T1 / T_P) / (P T1 / T_pair) = T_pair / (P T_P)`
    (`t2` is the row's step at CP = `P`; `T_pair`, the step of `P` processes at once: a pair at `P = 2`)."""
    return batch["t_pair"] / (len(row["ranks"]) * row["t2"])


def label(row: dict) -> str:
    """A row's mode, with its path where it is not the default: `all_gather (overlap=True)`."""
    return f"{row['mode']} ({row['path']})" if row.get("path") else row["mode"]


def markdown(batch: dict) -> str:
    """One batch as Markdown: the P-process factor, the table (every mode and layout, each rank's split), the ring."""
    t1, t_pair, target, P = batch["t1"], batch["t_pair"], batch["target"], cp_size(batch)
    n, ranks = "two" if P == 2 else str(P), " / ".join(map(str, range(P)))
    lines = [f"T(CP=1) = {t1:.2f} s (TorchKernel over the whole batch, one process); {n} such processes at once: "
             f"{t_pair:.2f} s each: {n} processes here do {P * t1 / t_pair:.2f}x the work of one.", "",
             f"| mode | layout | T(CP={P}) | speedup | efficiency | compute over T(CP=1) / {P}, rank {ranks} | comm wait | other |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in batch["rows"]:
        inflation = " / ".join(f"{x:+.0%}" for x in compute_inflation(batch, r))
        waits, others = (" / ".join(f"{x['total'] and part(x) / x['total']:.1%}" for x in r["ranks"])
                         for part in (lambda x: x["comm"], lambda x: x["total"] - x["compute"] - x["comm"]))  # fmt: skip
        lines.append(f"| {label(r)} | {r['layout']} | {r['t2']:.2f} s | {t1 / r['t2']:.2f} | {efficiency(batch, r):.2f} | "
                     f"{inflation} | {waits} | {others} |")  # fmt: skip
    judged = [r for r in batch["rows"] if r["layout"] in batch["target_layouts"]]
    verdicts = ", ".join(f"{label(r)} {r['layout']} {efficiency(batch, r):.2f} ({'met' if efficiency(batch, r) >= target else 'BELOW'})"
                         for r in judged)  # fmt: skip
    inflated = ", ".join(f"{label(r)} {r['layout']} {max(compute_inflation(batch, r)):+.0%}" for r in judged
                         if max(compute_inflation(batch, r)) > INFLATION_TARGET) or "none"  # fmt: skip
    busy = ", ".join(f"{label(r)} {r['layout']} {max(busy_inflation(batch, r)):+.0%}" for r in judged
                     if max(busy_inflation(batch, r)) > INFLATION_TARGET) or "none"  # fmt: skip
    waiting = ", ".join(f"{label(r)} {r['layout']} {max(x['comm'] / x['total'] for x in r['ranks']):.1%}" for r in batch["rows"]
                        if max(x["comm"] / x["total"] for x in r["ranks"]) > WAIT_TARGET) or "none"  # fmt: skip
    alone = ", ".join(f"{layout} {t * 1e3:.1f} ms" for layout, t in batch["shift"].items())
    part = "half" if P == 2 else f"1 / {P} of"
    lines += ["", f"speedup = T(CP=1) / T(CP={P}); efficiency = the speedup over the {n}-process factor; target >= {target} "
              f"for {' and '.join(batch['target_layouts'])} (printed, not asserted): {verdicts}. Compute over T(CP=1) / {P}: "
              f"each rank's time inside kernel calls over {part} the CP = 1 step; above the target +{INFLATION_TARGET:.0%}: "
              f"{inflated}; over {part} the step of {n} processes at once instead (the split's own extra work, without "
              f"{n} busy cores' cost to each other), above +{INFLATION_TARGET:.0%}: {busy}. Comm wait and other: shares of the rank's step; comm wait above the target {WAIT_TARGET:.0%}: "
              f"{waiting}. The ring (`p2p`) "
              f"per kernel call: compute / then waiting for the next block, ms (its largest shift alone: {alone}); "
              f"each shift in the order posted, the share of it hidden (`-`: no kernel call between its post and its "
              f"wait, nothing to hide it behind); all its shifts together:", "",
              "| layout | rank | kernel calls: compute / wait (ms) | each shift hidden | all shifts |",
              "| --- | ---: | --- | --- | ---: |"]  # fmt: skip
    for r in batch["ring"]:
        t_shift = batch["shift"][r["layout"]]
        shifts, frac = hidden(r["steps"], t_shift)
        cells = ", ".join(f"{s['phase'][:3]} {s['compute'] * 1e3:.0f}/{s['wait'] * 1e3:.1f}" for s in r["steps"])
        each = ", ".join(f"{s['phase'][:3]} {shift_hidden(s, t_shift):.0%}" if s["calls"] else f"{s['phase'][:3]} -"
                         for s in r["shifts"])  # fmt: skip
        lines.append(f"| {r['layout']} | {r['rank']} | {cells} | {each} | {shifts}: {frac:.0%} |")
    return "\n".join(lines)


def batch_parser(doc: str) -> Parser:
    """The command line of a benchmark over `batches`: `--tokens`, `--heads`, `--head-dim`, `--repeats`."""
    parser = Parser(description=doc.splitlines()[0])
    parser.add_argument("--tokens", type=positive, default=16384, help="tokens per batch (a multiple of 2 P)")
    parser.add_argument("--heads", type=positive, default=4, help="query and key heads (a multiple of 2 P: Ulysses in head groups)")
    parser.add_argument("--head-dim", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=2, help="timed rounds: steps per configuration (fastest kept)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = batch_parser(__doc__)
    parser.add_argument("--cp", type=positive, default=2, help="the CP size P: P processes, one thread each (at least P "
                        "free cores, or the figures measure the oversubscription)")
    parser.add_argument("--window", nargs="+", default=["none", "1024"], metavar="W",
                        help="causal sliding windows of W + 1 keys, window=(W, 0), in CP = 1 and every mode, one table "
                             "each ('none': full causal)")  # fmt: skip
    parser.add_argument("--calibration", default=str(CALIBRATION), metavar="PATH", help="where the this-machine profile "
                        "calibrated at the start goes (default: bench/out/this-machine.json, ignored by git; python -m "
                        "bench.all --update-results writes bench/results/this-machine.json, the committed one)")  # fmt: skip
    args = parser.parse_args(argv)
    windows, P = [_window(parser, w) for w in args.window], args.cp
    if P < 2:
        parser.error(f"--cp {P}: the CP size to scale to, an int >= 2 (CP = 1 is the baseline every run measures)")
    if args.tokens % (2 * P):
        parser.error(f"--tokens {args.tokens}: zigzag over {P} ranks needs a multiple of 2 x {P} = {2 * P}")
    if args.heads % (2 * P):
        parser.error(f"--heads {args.heads}: Ulysses in head groups over {P} ranks needs a multiple of 2 x {P} = {2 * P} "
                     f"heads (2 groups or more)")  # fmt: skip
    from bench import predicted
    from sim.plan.calibrate import calibrate
    from sim.plan.profile import load_profile

    Path(args.calibration).parent.mkdir(parents=True, exist_ok=True)
    calibrate(args.calibration, nproc=P)  # the planner's profile of this machine, measured in this run
    profile = load_profile(args.calibration)
    batches_run = []
    for window, (name, lengths) in ((w, batch) for w in windows for batch in batches(args.tokens, P).items()):
        shape = (lengths, args.heads, args.head_dim, args.repeats, window)
        masked = "causal" if window == (-1, -1) else f"causal, window={window}"
        title = (f"Strong scaling: {name} {masked} ({lengths}), {args.heads} heads, head dim {args.head_dim}, float32, "
                 f"forward + backward, 1 thread per process (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
        print(f"## {title}\n", flush=True)
        # one launch of P processes, in rounds: 1) CP = 1, one kernel call over the whole batch on rank 0 alone; 2) the
        # P-process factor, the same step on all at once, no communication; 3) CP = P, every mode and layout
        ranks = launch(batch_rank, P, args=shape, check_calls=False, timeout=3600.0)
        t1 = min(ranks[0]["alone"])
        t_pair = min(max(steps) for steps in zip(*(r["pair"] for r in ranks)))  # per repeat, the slowest process
        per_rank = [r["cp"] for r in ranks]
        batch = {"title": title, "name": name, "window": list(window), **summary(t1, t_pair, per_rank),
                 "schedule": [what for _, what, _ in sorted(ranks[0]["rounds"], key=lambda r: r[2])]}  # rank 0's steps in time order
        print(markdown(batch))
        batch["predicted"] = predicted.rows(batch, lengths, window, args.heads, args.head_dim, profile)
        print(f"\nPredicted by `python -m sim plan` (the this-machine profile, calibrated at the start of this run):\n\n"
              f"{predicted.markdown(batch['predicted'])}")
        if any(r["path"] for r in batch["rows"]):
            print(f"\nThe overlapped paths beside the defaults:\n\n{paths_markdown(batch)}")
        print(f"\n(load average now {os.getloadavg()[0]:.2f})\n", flush=True)
        batches_run.append(batch)
    paths = [b for b in batches_run if any(r["path"] for r in b["rows"])]
    verdict = paths_verdict(paths) if paths else ""
    print(verdict)
    return {"batches": batches_run, "paths_verdict": verdict}


def paths_markdown(batch: dict) -> str:
    """One batch's overlapped paths, each under its mode's default: the step, its ratio to the default (below 1: the
    overlap pays), each rank's compute and comm wait."""
    lines = ["| mode | layout | path | step | / default | compute per rank | comm wait per rank |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    default = {(r["mode"], r["layout"]): r for r in batch["rows"] if not r["path"]}
    overlapped = {r["mode"] for r in batch["rows"] if r["path"]}
    for row in sorted((r for r in batch["rows"] if r["mode"] in overlapped),
                      key=lambda r: (r["mode"], TIMED_LAYOUTS.index(r["layout"]), bool(r["path"]))):  # fmt: skip
        base = default[(row["mode"], row["layout"])]
        ratio = f"{row['t2'] / base['t2']:.2f}" if row["path"] else ""
        compute = " / ".join(f"{r['compute']:.2f} s" for r in row["ranks"])
        wait = " / ".join(f"{r['comm']:.3f} s" for r in row["ranks"])
        lines.append(f"| {row['mode']} | {row['layout']} | {row['path'] or 'default'} | {row['t2']:.2f} s | {ratio} | "
                     f"{compute} | {wait} |")  # fmt: skip
    return "\n".join(lines)


def paths_verdict(batches_run: list[dict]) -> str:
    """Where each overlapped path paid (ratio below 1), and by how much the waits fell and the compute rose."""
    parts = []
    for batch in batches_run:
        default = {(r["mode"], r["layout"]): r for r in batch["rows"] if not r["path"]}
        for row in (r for r in batch["rows"] if r["path"]):
            base = default[(row["mode"], row["layout"])]
            waits = sum(r["comm"] for r in base["ranks"]) - sum(r["comm"] for r in row["ranks"])
            extra = sum(r["compute"] for r in row["ranks"]) / sum(r["compute"] for r in base["ranks"]) - 1
            parts.append(f"{batch['name']} {row['mode']} {row['layout']} {row['path']}: {row['t2'] / base['t2']:.2f} "
                         f"(waiting {waits:+.3f} s less over the ranks, compute {extra:+.0%})")  # fmt: skip
    return "Overlapped path / the mode's default, step time: " + "; ".join(parts) + "."


def _window(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """`none` -> no window; `W` (an int >= 0) -> `(W, 0)`."""
    if text == "none":
        return (-1, -1)
    if not text.isdigit():
        parser.error(f"--window {text}: the keys before each query it sees, an int >= 0, or 'none'")
    return (int(text), 0)


if __name__ == "__main__":
    main()


def goals(batches_run: list[dict]) -> list[dict]:
    """The performance issue's goals over the full-causal batches, each `{"goal", "measured", "met"}` (`met`: True,
    False, or None with a `"why"` where a bar does not judge it): the figures the tables print, gathered for the
    page's summary."""
    plain = [b for b in batches_run if list(b["window"]) == [-1, -1]]

    def judged(batch):  # every mode's default in the target layouts
        return [r for r in batch["rows"] if not r["path"] and r["layout"] in batch["target_layouts"]]

    def where(batch, row):
        return f"{label(row)} {row['layout']}, {batch['name']}"

    eff = [(efficiency(b, r), where(b, r)) for b in plain for r in judged(b)]
    mixed = [b for b in plain if not b["name"].startswith("1 x ")]  # `batches` names the one document "1 x T"
    infl = [(max(compute_inflation(b, r)), max(busy_inflation(b, r)), where(b, r)) for b in mixed for r in judged(b)]
    wait = [(max(x["comm"] / x["total"] for x in r["ranks"]), where(b, r)) for b in plain for r in judged(b)]
    ring = [(shift_hidden(s, b["shift"][r["layout"]]), f"{r['layout']} rank {r['rank']} {s['phase']} shift {i + 1}, {b['name']}")
            for b in plain for r in b["ring"] for i, s in enumerate(r["shifts"]) if s["calls"]]  # fmt: skip
    paths = [(r["t2"] / next(d["t2"] for d in b["rows"] if not d["path"] and (d["mode"], d["layout"]) == (r["mode"], r["layout"])),
              f"{label(r)} {r['layout']}, {b['name']}") for b in plain for r in b["rows"] if r["path"]]  # fmt: skip
    rows = []
    if eff:
        low = min(eff)
        rows.append({"goal": f"efficiency against the machine >= {TARGET}", "met": low[0] >= TARGET,
                     "measured": f"{sum(e >= TARGET for e, _ in eff)} of {len(eff)} at or above; lowest {low[0]:.2f} ({low[1]})"})
    if infl:
        high, busy = max(infl), max(infl, key=lambda x: x[1])
        P = cp_size(mixed[0])
        part, group = ("half", "the pair's") if P == 2 else (f"1 / {P} of", f"the {P} processes'")
        rows.append({"goal": f"compute over {part} the CP = 1 step <= +{INFLATION_TARGET:.0%} (packed mix)",
                     "met": high[0] <= INFLATION_TARGET,
                     "measured": f"{sum(x <= INFLATION_TARGET for x, _, _ in infl)} of {len(infl)} within; largest "
                                 f"{high[0]:+.0%} ({high[2]}); over {part} {group} step {busy[1]:+.0%} at most ({busy[2]})"})
    if wait:
        high = max(wait)
        rows.append({"goal": f"comm wait <= {WAIT_TARGET:.0%} of the rank's step", "met": high[0] <= WAIT_TARGET,
                     "measured": f"{sum(w <= WAIT_TARGET for w, _ in wait)} of {len(wait)} within; largest {high[0]:.1%} ({high[1]})"})
    if ring:
        low = min(ring)
        rows.append({"goal": f"ring: >= {RING_TARGET:.0%} of every shift hidden that a kernel call can hide", "met": low[0] >= RING_TARGET,
                     "measured": f"{sum(x >= RING_TARGET for x, _ in ring)} of {len(ring)} shifts at or above; lowest "
                                 f"{low[0]:.0%} ({low[1]})"})
    if paths:
        best = min(paths)
        rows.append({"goal": "overlapped paths: faster than their mode's default where they pay", "met": None,
                     "why": "a rule: " + ("an overlapped path paid in every case" if max(paths)[0] < 1 else
                                          "the defaults stay, overlap is asked for"),
                     "measured": f"{sum(x < 1 for x, _ in paths)} of {len(paths)} below 1; {best[0]:.2f} at best ({best[1]}), "
                                 f"{max(paths)[0]:.2f} at worst ({max(paths)[1]})"})
    return rows
