r"""Performance: what `make bench` measures, how, and against which targets.

## The last run in one screen

{{ figure figures/bench_scaling.png }}

{{ summary }}

## What limits each goal on this machine

{{ limits }}

## How the figures are measured

cpref is a reference, but one people train with: its kernel and its CP path must be fast
enough to use. Every figure here is *measured*, side by side in one run on the machine at hand,
and printed with the load average at the time; none is asserted by a test, because timings
move with the machine. `make bench` runs each benchmark of `bench/` in turn (in the last run
{total_minutes} on 2 cores; the goal is under ten), prints its tables and keeps what it measured: a
`.txt` file of what it printed and a `.json` file of its figures, in `bench/out/` (ignored by git),
or with `make bench KEEP=1` in `bench/results/`, the committed files these pages are built from.
Each benchmark has a page of its own (below): what it measures and how, then its last run,
rendered from that `.json` file when this site was built (the plots too, `docs/bench_figures.py`),
headed by where it ran (CPU, gloo, the simulated cluster), when and on what machine. The summary
above and its goals are rendered from the same files: the goals of the CP path at CP = 2 are those
of [strong scaling](perf-scaling.md) (on the one 16k document and the packed mix, full causal),
printed by the benchmarks, never asserted. The figures move with the machine: compare the ratios
within one table, measured side by side, rather than figures across tables or runs. The table at
the very end is a small version of [the kernel's](perf-kernel.md), measured while this page was
built.

## The benchmarks, one page each

1. [The kernel against SDPA](perf-kernel.md) (`bench/kernel.py`): `TorchKernel`'s fast and
   explicit paths against PyTorch's fused attention called once per document, on five mixes of
   8192 tokens, and the fraction of the machine's matmul peak.
2. [The CP path at P = 1](perf-overhead.md) (`bench/overhead.py`): what `cpref.attention` costs a
   model that runs without CP, every mode against the bare kernel.
3. [Strong scaling over gloo](perf-scaling.md) (`bench/scaling.py`): every mode at CP = 2 against
   CP = 1 and against what two processes get from this machine, each rank's step split into compute
   and waiting; the ring shift by shift, the overlapped paths, and the planner's predictions.
4. [Memory per rank](perf-memory.md) (`bench/memory.py`): the peak of forward + backward and the
   bytes saved for the backward, every mode, at P = 1, 2 and 4.
5. [All-gather balance, timed](perf-all-gather.md) (`bench/all_gather.py`): each rank's share of
   the all-gather mode timed alone, contiguous against zigzag.
6. [Collectives or pairwise sends](perf-collectives.md) (`bench/collectives.py`): gloo's
   collectives against one batch of pairwise sends, the default.
7. [A sliding window on the fused path](perf-window.md) (`bench/window.py`): a window of 1024 keys on 32k
   tokens against full causal and a dense band mask, and a windowed call's rate.
8. [The layouts on packed batches](perf-layouts.md) (`bench/layouts.py`): every layout's padding,
   balance and bytes per mode, counted on three packs.
9. [What the variants cost](perf-variants.md) (`bench/variants.py`): sinks, soft-capping and
   chunked attention.
10. [The planner at scale](perf-plan.md) (`bench/plan.py`): the planner's own seconds up to
    1024 ranks.
11. [What a mask costs](perf-masks.md) (`bench/masks.py`): time, work and bytes under a mask at
    CP = 2, and the layout balanced by the mask.

## On a GPU

Nothing in cpref needs a GPU, but where one is at hand `PY=python3 bench/gpu_check.sh LOGDIR`
runs, in one go: `make demo` with part 2 on the GPU (every mode and layout in FP64 on the
simulated cluster, whose ranks then share the device), `python -m sim verify` over NCCL on
that one GPU (every mode, layout and dtype at CP = 1, the default CUDA kernel checked against
the FP64 ground truth; CP > 1 needs one GPU per rank), and [the kernel benchmark](perf-kernel.md)
with `--device cuda` in float32, bfloat16 and float16, where SDPA runs PyTorch's flash or
memory-efficient kernel, the fast column is [`CudaKernel`][cpref.kernels.cuda_kernel.CudaKernel]
(flash in bfloat16 and float16, its fallback, the explicit path, in float32) and the explicit
column `TorchKernel`'s explicit path. Last, `bench/determinism.py` in bfloat16 and float16 runs
every mode and layout on the simulated cluster at CP = 2 and 4 with flash per rank against the
FP64 oracle, checks that two steps with `deterministic=True` are bitwise equal, and prints what
the flag costs ([Deterministic backward][cpref.base.determinism]). After the GPU's steps, on a machine
with eight cores or more, it runs [strong scaling](perf-scaling.md)'s tables at CP = 4 on the CPU cores
(`bench.scaling --cp 4 --heads 8 --tokens 8192`, full causal): the goals two cores cannot judge. On a 2-core CPU (an earlier run
than this page's other figures, on another machine), where nothing in the backward races, the flag costs only the row sums in occurrence layers:
3 to 4x one `index_add_` for the all-gather plan of 4500 tokens at CP = 4 (1.0 ms against
0.27 ms, twice a step, for dK and dV, in a step of about half a second on the simulated
cluster; a batch's first backward also sorts the index into layers, 0.36 ms, once), and the
step times with and without the flag differ by less than their run-to-run noise (0.95 to 1.14
over three runs of the all-gather rows, 2026-12-03).

Measured once, on 2026-11-30, on one NVIDIA H200 with torch 2.11 (CUDA 13.0): the simulated
cluster on the GPU agreed with the oracle to $4.2 \cdot 10^{-15}$ in every mode and layout, and
the NCCL verification passed all 32 cases. The explicit kernel is correct there but slow:

| documents | float32: TorchKernel / SDPA | bfloat16: TorchKernel / SDPA |
| --- | ---: | ---: |
| 1 x 8192 | 24.8 / 8.4 ms = 2.95 | 24.9 / 1.4 ms = 18.4 |
| 8 x 1024 | 4.5 / 3.2 ms = 1.39 | 4.5 / 2.3 ms = 1.94 |
| 4 mixed | 12.0 / 5.5 ms = 2.16 | 9.4 / 1.5 ms = 6.30 |
| 64 x 128 | 27.5 / 14.0 ms = 1.97 | 25.1 / 12.1 ms = 2.08 |
| 256 x 32 | 102.8 / 48.8 ms = 2.11 | 105.9 / 49.0 ms = 2.16 |

On the single document the explicit path reaches 20% of the float32 matmul peak (49
TFLOP/s measured) against SDPA's 58%, and in bfloat16, which it computes in float32, 1% of
the bfloat16 peak (713 TFLOP/s) against SDPA's 25%. Its time grows with the number of
sequences (one set of kernel launches per block), so short documents cost it most. That run
predates `CudaKernel`, the flash path built since (tested on the CPU against a double of the
ops, `tests/kernels/test_cuda_contract.py`), which has not run on a GPU yet: its figures join
this table at the next run of the script.

## Measured while this page was built

**CPU, the machine that built this site** · *when this page was built*

{kernel_table}
"""

from __future__ import annotations

import os
import re

import torch

from bench import (
    all_gather,
    collectives,
    kernel,
    layouts,
    masks,
    memory,
    overhead,
    plan,
    predicted,
    scaling,
    variants,
    window,
)
from bench.all import BENCHMARKS, load
from bench.kernel import cases, fastest, markdown

# A small version of the kernel table of `bench.kernel`, fast enough to run at every docs build.
SMALL_MIXES = {"1 x 1024": [1024], "16 x 64": [64] * 16, "64 x 16": [16] * 64}
SMALL_HEADS, SMALL_DIM = 4, 64


def small_kernel_table(repeats: int = 3) -> str:
    """The kernel comparison on 1024 tokens (4 heads, head dim 64, float32, causal, fwd + bwd), as Markdown."""
    rows = [{"mix": name, **fastest(cases(lengths, SMALL_HEADS, SMALL_DIM), repeats)} for name, lengths in SMALL_MIXES.items()]
    return (
        f"{markdown(rows)}\n\n{SMALL_HEADS} heads, head dim {SMALL_DIM}, float32, causal forward + backward, "
        f"{torch.get_num_threads()} threads, fastest of {repeats} after a warm-up, load average "
        f"{os.getloadavg()[0]:.2f}. Measured while the docs were built, on that machine; the full tables "
        "(8192 tokens, five mixes, the matmul peak, and the other benchmarks) come from `make bench`."
    )


def _bullets(lines: list[str]) -> str:
    """Printed verdict lines as a Markdown list (blank lines dropped, each line one item)."""
    return "\n".join("- " + line.strip().removeprefix("- ") for line in lines if line.strip())


def _details(title: str, body: str) -> str:
    """A block the reader opens (pymdownx.details, closed): the long tables under a figure that shows them."""
    return f'??? info "{title}"\n\n' + "\n".join(("    " + line) if line else "" for line in body.splitlines())


# What each benchmark's kept results show on the page: its tables (the very functions it prints them with) and
# the markers of its figures (`docs/bench_figures.py`, placed by `docs/gen_pages.py`).
RENDER = {
    "kernel": lambda r: "\n\n".join([r["title"] + ".", kernel.markdown(r["rows"]),
                                      _bullets(kernel.verdicts(r))]),
    "overhead": lambda r: r["title"] + ".\n\n" + overhead.markdown(r),
    "scaling": lambda r: "\n\n".join(["Every mode's speedup at CP = 2, in each layout and on each batch, is the plot at the top "
                                        "of [Performance](performance.md). Each batch's table opens below: every mode and layout with each rank's "
                                        "split of the step, and the ring's kernel calls and shifts, each with the share of it "
                                        "hidden."]
                                       + [_details(b["title"], scaling.markdown(b)) for b in r["batches"]]
                                       + ["The overlapped paths beside their modes' defaults, from the same run:"]
                                       + [f"**{b['name']}**\n\n" + scaling.paths_markdown(b)
                                          for b in r["batches"] if any(row["path"] for row in b["rows"])]
                                       + [r["paths_verdict"]]
                                       + ["The planner's predictions of every row, from the same run (`python -m sim plan` "
                                          "with the this-machine profile calibrated at its start, `bench/predicted.py`):"]
                                       + [f"**{b['title'].split(': ', 1)[1].split(' (')[0]}**\n\n" + predicted.markdown(b["predicted"])
                                          for b in r["batches"] if b.get("predicted")]),
    "memory": lambda r: "\n\n".join([r["title"] + ".", memory.markdown(r)]),
    "all_gather": lambda r: r["title"] + ".\n\n" + all_gather.markdown(r),
    "collectives": lambda r: r["title"] + ".\n\n" + collectives.markdown(r),
    "window": lambda r: r["title"] + ".\n\n" + window.report(r["times"], r["counts"]) + "\n\n"
    + window.band_report(r["band"], *r["band_shape"]),
    "variants": lambda r: r["title"] + ".\n\n" + variants.report(r),
    "plan": lambda r: r["title"] + ".\n\n" + plan.report(r),
    "masks": lambda r: r["title"] + ".\n\n" + masks.report(r),
    "layouts": lambda r: "\n\n".join(
        [r["title"] + ". Per pack (open each below), every `P`: each layout's padding, busiest rank's causal work over the mean and "
         "shared rows, and the bytes the busiest rank sends in each mode, forward + backward (the full tables, with "
         "each mode's kernel work and modelled time, are in `bench/results/layouts.txt`); the figure at the top "
         "draws them."]
        + [_details(f"{p['name']}: {p['documents']} documents, {p['tokens']:,} tokens", layouts.bytes_table(p))
           for p in r["packs"]]
        + [r["goals"]]),
}  # fmt: skip


# What limits each goal on this machine (two cores, gloo, one thread per process), in the order of `scaling.goals`.
LIMITS = {
    "efficiency": "The two below: a CP = 2 step is slower than two independent processes by what one rank waits for "
                  "the other and what the split adds to its compute.",
    "compute": "Two busy cores slow each other (the pair's factor: the second figure leaves it out); the ring makes one "
               "call per step, and every split runs its calls over smaller segments.",
    "comm": "The collectives nothing hides (the all-gather's and Ulysses' defaults wait for theirs; the all-gather "
            "overlap cuts that wait by about half or more, Ulysses' head groups by less and not in every run), what one "
            "rank waits for the other, and gloo's copies, which run on the compute cores.",
    "ring:": "A shift travels while both cores compute: gloo's copies get what time the kernels leave them, so the "
             "same shifts come out 97%, 98%, 97% hidden in one run and 94%, 52%, 95% in the next (zigzag, one 16k "
             "document, rank 1, 2026-12-04). Pieces and halos smaller than the largest shift are judged against its time alone.",
    "overlapped": "No core is free to move the data: gloo's copies compete with the kernel, and the overlap adds calls "
                  "and a merge. The defaults stay the one call and the one exchange until NCCL or HCCL is measured.",
}


# Where each benchmark of `make bench` runs: all on the CPU cores of the machine at hand (none on a GPU).
WHERE = {
    "kernel": "CPU",
    "window": "CPU",
    "overhead": "CPU, one process",
    "scaling": "CPU, gloo processes",
    "memory": "CPU, simulated cluster",
    "all_gather": "CPU",
    "collectives": "CPU, gloo processes",
    "layouts": "simulated cluster, counted (nothing timed)",
    "variants": "CPU: one process, and the simulated cluster",
    "plan": "CPU, one process (plans counted and priced, nothing run)",
    "masks": "CPU: the simulated cluster (two threads), and counted",
}
HEADER = re.compile(r"Measured (?P<date>\S+) (?P<time>\S+) UTC on (?P<machine>.+)\.$")  # `bench.all.header`


def _verdicts(lines: list[str], pattern: str) -> list[re.Match]:
    """The lines of a benchmark's printed verdicts that match `pattern` (each ends in its verdict)."""
    found = [m for m in (re.match(pattern, line.strip()) for line in lines) if m]
    if not found:
        raise RuntimeError(f"no verdict matches {pattern!r} in {lines}: the benchmark's printed verdicts changed")
    return found


def _met(found: list[re.Match], name: str) -> str:
    """`met`, or on how many it was met and where not (each verdict's `name` group)."""
    missed = [m[name] for m in found if m["verdict"] != "met"]
    return "met" if not missed else f"met on {len(found) - len(missed)} of {len(found)}; not on {', '.join(missed)}"


def where_and_when() -> str:
    """When, where and on what the kept results were measured, from their headers: the summary's first lines."""
    heads = [HEADER.match(load(name)["measured"]) for name in BENCHMARKS]
    days, times = sorted({h["date"] for h in heads}), sorted(h["time"] for h in heads)
    when = f"{days[0]}, {times[0]} to {times[-1]} UTC" if len(days) == 1 else f"{days[0]} to {days[-1]}"
    machines = sorted({h["machine"] for h in heads})
    minutes = sum(load(name)["seconds"] for name in BENCHMARKS) / 60
    cpu_build = all("+cpu" in m for m in machines)
    return (f"**When and where.** The last `make bench`: {when}, on {'; '.join(machines)}; {minutes:.1f} minutes of "
            "benchmarks. **All on the CPU, none on a GPU**" + (" (a CPU build of torch)" if cpu_build else "") + ": the "
            "kernels on its cores, the CP modes over gloo processes or on the simulated cluster (each benchmark's page "
            "says which). `CudaKernel`, NCCL at CP > 1 and HCCL have not run on hardware yet; [On a GPU](#on-a-gpu) keeps, "
            "typed in by hand, the one earlier GPU check, which predates `CudaKernel`.")  # fmt: skip


def summary_table() -> str:
    """Every goal of `make bench` with its verdict and what the last run measured, from the kept results and the
    benchmarks' own printed verdicts: the page's one-screen summary."""
    kern, over, lay = (load(name)["results"] for name in ("kernel", "overhead", "layouts"))
    mark = {True: "met", False: "not met"}
    lines = ["| goal | last run |", "| --- | --- |"]
    found = _verdicts(kernel.verdicts(kern), r"(?P<mix>.+): fast / SDPA = (?P<x>[\d.]+) \(target <= (?P<t>[\d.]+): "
                                             r"(?P<verdict>met|NOT met)\)$")  # fmt: skip
    low, high = min(found, key=lambda m: float(m["x"])), max(found, key=lambda m: float(m["x"]))
    loose = max(found, key=lambda m: float(m["t"]))["t"]
    tight = [m for m in found if m["t"] != loose]
    strict = f" ({tight[0]['t']} on {', '.join(m['mix'] for m in tight)})" if tight else ""
    lines.append(f"| **kernel**: fast path / SDPA per document <= {loose}{strict}, {len(found)} mixes | "
                 f"**{_met(found, 'mix')}**: {low['x']} ({low['mix']}) to {high['x']} ({high['mix']}) |")  # fmt: skip
    found = _verdicts(overhead.markdown(over).splitlines(), r"- +(?P<mode>\S+): worst (?P<x>[\d.]+)x .*\(target <= "
                                                            r"(?P<t>[\d.]+)x: (?P<verdict>met|NOT met)\)$")  # fmt: skip
    worst = max(found, key=lambda m: float(m["x"]))
    lines.append(f"| **CP path at P = 1**: every mode <= {worst['t']}x the bare kernel | **{_met(found, 'mode')}**: "
                 f"worst {worst['x']}x (`{worst['mode']}`) |")  # fmt: skip
    for g in scaling.goals(load("scaling")["results"]["batches"]):
        lines.append(f"| **CP = 2, gloo**: {g['goal']} | **{mark.get(g['met']) or g['why']}**: {g['measured']} |")
    batches_ = [b for b in load("scaling")["results"]["batches"] if b.get("predicted")]
    if batches_:
        verdicts = {}  # goal -> the batches that missed it
        for b in batches_:
            for m in _verdicts(predicted.markdown(b["predicted"]).splitlines(),
                               r"- (?P<what>predictions within|modes ranked as measured).*: (?P<verdict>met|not met)"):  # fmt: skip
                missed = verdicts.setdefault(m["what"], [])
                if m["verdict"] != "met":
                    missed.append(b["title"].split(": ", 1)[1].split(" (")[0])
        cells = [f"{what} on {len(batches_) - len(missed)} of {len(batches_)} batches" + (f" (not: {'; '.join(missed)})" if missed else "")
                 for what, missed in verdicts.items()]  # fmt: skip
        met = "met" if not any(verdicts.values()) else "not met"
        lines.append(f"| **planner** (`python -m sim plan`, CP = 2 here): every step within +/-15% of the measured, the modes "
                     f"ranked as measured | **{met}**: {'; '.join(cells)} |")  # fmt: skip
    rows = load("memory")["results"]["rows"]
    top = max(r["P"] for r in rows)
    saved = {r["mode"]: r["saved"] for r in rows if r["P"] == top}
    fall = [saved[m] / r["saved"] for m in saved for r in rows if r["P"] == 1 and r["mode"] == m]
    exact = sum(r["saved"] == r["formula"] for r in rows)
    lines.append(f"| **memory**: saved for the backward as `mode_costs` says, falling as 1/P | **no target**: {exact} of "
                 f"{len(rows)} (mode, P) as the formula; at P = {top}, {min(fall):.3f} to {max(fall):.3f} of P = 1's |")
    head = lay["goals"].splitlines()[0].removeprefix("goals of ").split(" (")[0]
    found = _verdicts(lay["goals"].splitlines(), r"- (?P<what>.+): (?P<x>[\d.]+) \(goal (?P<op>[<=]+) (?P<t>[\d.]+)\): "
                                                 r"(?P<verdict>met|not met)$")  # fmt: skip
    per_mode = [m for m in found if m["what"].endswith(" bytes / zigzag")]  # one line per mode
    goals = [f"{m['what']} {m['op']} {m['t']}" for m in found if m not in per_mode]
    goals += [f"each mode's bytes / zigzag's {per_mode[0]['op']} {per_mode[0]['t']}"] if per_mode else []
    measured = "; ".join(f"{m['what']} {m['x']}" for m in found)
    lines.append(f"| **layout {head}**: {', '.join(goals)} | **{_met(found, 'what')}**: {measured} |")
    found = _verdicts(variants.report(load("variants")["results"]).splitlines(),
                      r"- (?P<what>[^:]+): .*?\(goal (?P<goal>[<=>]+ [\d.]+)[^)]*\): (?P<verdict>met|not met)")  # fmt: skip
    goals = "; ".join(f"{m['what']} {m['goal']}" for m in found)
    lines.append(f"| **variants**: {goals} | **{_met(found, 'what')}** |")
    found = _verdicts(plan.report(load("plan")["results"]).splitlines(),
                      r"- the planner at P = (?P<P>\d+): (?P<s>[\d.]+) s \(goal < (?P<t>[\d.]+) s\): (?P<verdict>met|not met)")
    lines.append(f"| **planner at scale**: P = {found[0]['P']} in under {found[0]['t']} s | **{_met(found, 'P')}**: "
                 f"{found[0]['s']} s |")  # fmt: skip
    seconds = sum(load(name)["seconds"] for name in BENCHMARKS)
    lines.append(f"| **`make bench`** under ten minutes | **{mark[seconds < 600]}**: {seconds / 60:.1f} minutes (the "
                 "benchmarks' own times) |")  # fmt: skip
    return "\n".join(lines)


def limits() -> str:
    """What limits each goal of the CP path at CP = 2 on this machine, and `make bench`'s time, as a list."""
    names = [g["goal"] for g in scaling.goals(load("scaling")["results"]["batches"])]
    items = [f"- **{name}**: {LIMITS[name.split(' ')[0]]}" for name in names]
    items.append("- **`make bench` under ten minutes**: the 16k document's twelve configurations at CP = 2 and the "
                 "dense band mask at 32k.")  # fmt: skip
    return "\n".join(items)


def last_run(name: str) -> str:
    """A benchmark's last run, the end of its page: where, when and on what it ran, then its tables and figures."""
    kept = load(name)
    return (f"## Last run\n\n**{WHERE[name]}** · *{kept['measured']} ({kept['seconds']} s)*\n\n"
            f"{RENDER[name](kept['results'])}")


# A benchmark page's marker of its last run: `{{ results NAME }}`, NAME a benchmark of `bench.all.BENCHMARKS`.
RESULTS_MARKER = re.compile(r"\{\{ results (\w+) \}\}")


def fill_results(doc: str) -> str:
    """A page's `{{ results NAME }}` markers (a benchmark module's docstring), each replaced by `last_run(NAME)`:
    what `docs/gen_pages.py` does to every guide page."""
    return RESULTS_MARKER.sub(lambda m: last_run(m[1]), doc)


def check_shown(pages: dict[str, str]) -> None:
    """Raise unless every benchmark of `make bench` shows its last run on exactly one page and no page names one it
    does not run (`pages`: each guide page's docstring, by module)."""
    found = [(name, where) for where, doc in pages.items() for name in RESULTS_MARKER.findall(doc)]
    shown = {name: [where for n, where in found if n == name] for name in {*BENCHMARKS, *(n for n, _ in found)}}
    wrong = {name: where for name, where in sorted(shown.items()) if len(where) != 1 or name not in BENCHMARKS}
    if wrong:
        raise RuntimeError(f"every benchmark of make bench ({', '.join(BENCHMARKS)}) shows its last run on exactly one "
                           f"page, with its marker {{{{ results NAME }}}}; not so for (benchmark: pages) {wrong}")


def _fill(doc: str) -> str:
    """The overview's markers filled: the summary, the limits, the minutes and the small kernel table (each benchmark's
    last run is on its own page: `fill_results`)."""
    if RESULTS_MARKER.search(doc):
        raise RuntimeError("a benchmark's last run goes on its own page (its module's docstring), not the overview")
    minutes = sum(load(name)["seconds"] for name in BENCHMARKS) / 60
    doc = doc.replace("{{ summary }}", where_and_when() + "\n\n" + summary_table()).replace("{{ limits }}", limits())
    doc = doc.replace("{total_minutes}", f"{minutes:.1f} minutes")
    return doc.replace("{kernel_table}", small_kernel_table())


# The overview is filled when the docs import this module for its docstring (the small table takes a few hundred ms).
__doc__ = _fill(__doc__)
