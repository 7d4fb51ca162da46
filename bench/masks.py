r"""What a mask costs: attention under a mask at CP = 2 against full causal, and the layout balanced by the mask.

What a mask ([Masks as slices](mask.md)) costs at CP = 2, and what
[the layout balanced given the mask](balanced-mask.md) evens out, in two parts, side by side in
one run, nothing asserted:

1. **Time and bytes at CP = 2.** A packed batch of 16384 tokens (documents of 4096, 2048, 6144,
   2048 and 2048), $H_q = 8$, $H_{kv} = 2$, head dim 64, float32, forward + backward through
   `cpref.attention` on the simulated cluster (two ranks, two threads), every mode with its
   `example_options(2)`, zigzag, under three masks: **full causal** (no mask: the kernel
   contract's causal), **prefix-LM** (`Mask.prefix_lm`, each document's first half its prompt)
   and **spans** (`Mask.bidirectional_spans`, tokens $n/4$ to $n/2$ of each document an image seen
   whole). Per case: the step's time (the fastest of `--repeats` rounds, in alternation) against
   full causal's, the mask's visible pairs against causal's (the work every mode computes,
   exactly: the tests count it), and the bytes the busiest rank sent (from the trace). Then `p2p`
   in the layout balanced by each mask (`Sharding(..., layout="balanced", mask=mask)`), the same
   figures.
2. **Balance, counted.** The lognormal pack of 65536 tokens of
   [The layouts on packed batches](perf-layouts.md) (69 documents) under a prefix-LM (prompts of a
   random share of each document), image spans (a quarter of each document) and shared-prompt
   groups (a prompt and two answers), at $P = 2, 4, 8$: the busiest rank's mask work over the mean
   (`sharding.attention_work(r, mask=mask)`) for zigzag, the causal `balanced` layout and
   `balanced` given the mask. The goal: the last within 1.05.

Run it with `python -m bench.masks` (or `make bench`); `--quick` is a small run.

{{ results masks }}
"""

from __future__ import annotations

import os
import random
import time

import torch

import cpref
from bench.layouts import lognormal_pack
from sim.cluster.harness import run_attention, trace_split
from sim.cluster.simcluster import SimCluster
from sim.tools.cli import Parser, positive

HEADS = (8, 2, 64)
GOAL = 1.05  # the busiest rank's mask work over the mean, balanced given the mask


def masks_of(cu: list[int]) -> dict[str, cpref.Mask | None]:
    """Part 1's masks over the batch `cu`: None is full causal (no mask)."""
    n = [b - a for a, b in zip(cu, cu[1:])]
    return {"full causal": None, "prefix-LM": cpref.Mask.prefix_lm(cu, [x // 2 for x in n]),
            "spans": cpref.Mask.bidirectional_spans(cu, [(a + x // 4, a + x // 2) for a, x in zip(cu, n)])}  # fmt: skip


def step(cu: list[int], mode: str, layout: str, mask: cpref.Mask | None, seed: int = 0) -> tuple[float, int]:
    """`(seconds, busiest rank's bytes)` of one forward + backward at CP = 2 on the simulated cluster."""
    hq, hkv, d = HEADS
    sharding = cpref.Sharding.eod_padded(cu, cp_size=2, layout=layout, mask=mask if layout == "balanced" else None)
    g = torch.Generator().manual_seed(seed)
    q, dout = (sharding.pad(torch.randn(cu[-1], hq, d, generator=g)) for _ in range(2))  # (T, Hq, D)
    k, v = (sharding.pad(torch.randn(cu[-1], hkv, d, generator=g)) for _ in range(2))  # (T, Hkv, D)
    cluster = SimCluster(2, timeout=600.0)
    start = time.perf_counter()
    run_attention(q, k, v, dout, sharding, mode=mode, cluster=cluster, mask=mask, check_ranks=False,
                  between=lambda comm: comm.barrier(),
                  **cpref.MODES[mode].example_options(2))  # fmt: skip
    seconds = time.perf_counter() - start
    sent = [sum(b for b, _ in trace_split(cluster.trace, r)) for r in range(2)]
    return seconds, max(sent)


def timed(cu: list[int], repeats: int) -> list[dict]:
    """Part 1: a row per (layout, mode, mask), the fastest of `repeats` rounds, the rounds in alternation."""
    masks = masks_of(cu)
    causal_pairs = cpref.Mask.causal_documents(cu).visible_pairs()
    cases = [("zigzag", mode, name) for mode in sorted(cpref.MODES) for name in masks]
    cases += [("balanced", "p2p", name) for name in masks if masks[name] is not None]
    best: dict[tuple, tuple[float, int]] = {}
    for _ in range(repeats):
        for case in cases:
            seconds, sent = step(cu, case[1], case[0], masks[case[2]])
            best[case] = min(best.get(case, (seconds, sent)), (seconds, sent))
    rows = []
    for layout, mode, name in cases:
        pairs = causal_pairs if masks[name] is None else masks[name].visible_pairs()
        base = best[("zigzag", mode, "full causal")][0]  # the same mode, zigzag, no mask
        rows.append({"layout": "zigzag" if layout == "zigzag" else "balanced by the mask",
                     "mode": mode, "mask": name, "seconds": best[(layout, mode, name)][0],
                     "time / causal": best[(layout, mode, name)][0] / base, "work / causal": pairs / causal_pairs,
                     "bytes": best[(layout, mode, name)][1]})  # fmt: skip
    return rows


def pack_masks(cu: list[int], seed: int = 0) -> dict[str, tuple[list[int], cpref.Mask]]:
    """Part 2's masks over the pack: `{name: (the boundaries it covers, mask)}` (the shared prompts take whole groups
    of three documents, so the last one or two documents may be left out)."""
    rng, n = random.Random(seed), [b - a for a, b in zip(cu, cu[1:])]
    groups = [(n[i], n[i + 1 : i + 3]) for i in range(0, len(n) - 2, 3)]
    grouped = cu[: 3 * len(groups) + 1]
    return {"prefix-LM": (cu, cpref.Mask.prefix_lm(cu, [rng.randint(0, x) for x in n])),
            "spans": (cu, cpref.Mask.bidirectional_spans(cu, [(a + x // 4, a + x // 2) for a, x in zip(cu, n)])),
            "shared prompt": (grouped, cpref.Mask.shared_prompt(groups))}  # fmt: skip


def balance(cu: list[int], sizes: tuple[int, ...]) -> list[dict]:
    """Part 2: per mask and P, the busiest rank's mask work over the mean in three layouts."""
    rows = []
    for name, (bounds, mask) in pack_masks(cu).items():
        for P in sizes:
            row = {"mask": name, "P": P}
            for label, layout, by in (("zigzag", "zigzag", None), ("causal balanced", "balanced", None),
                                      ("balanced by the mask", "balanced", mask)):  # fmt: skip
                sharding = cpref.Sharding.eod_padded(bounds, cp_size=P, layout=layout, mask=by)
                work = [sharding.attention_work(r, mask=mask) for r in range(P)]
                row[label] = max(work) * P / sum(work)
            rows.append(row)
    return rows


def report(r: dict) -> str:
    """Both parts' tables and the goal's verdicts."""
    lines = [f"### At CP = 2: {r['tokens']} tokens, documents {r['lengths']}, heads {HEADS}, float32, forward + backward "
             f"(fastest of {r['repeats']} rounds)", "",
             "| layout | mode | mask | seconds | time / causal | work / causal | bytes (busiest rank) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    lines += [f"| {x['layout']} | {x['mode']} | {x['mask']} | {x['seconds']:.3f} | {x['time / causal']:.2f} "
              f"| {x['work / causal']:.2f} | {x['bytes']:,} |" for x in r["timed"]]  # fmt: skip
    lines += ["", f"### Balance: the lognormal pack ({r['pack documents']} documents, {r['pack tokens']} tokens), the "
              "busiest rank's mask work over the mean", "",
              "| mask | P | zigzag | causal balanced | balanced by the mask | goal |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for x in r["balance"]:
        verdict = "met" if x["balanced by the mask"] <= GOAL else "not met"
        lines.append(f"| {x['mask']} | {x['P']} | {x['zigzag']:.3f} | {x['causal balanced']:.3f} "
                     f"| {x['balanced by the mask']:.3f} | <= {GOAL}: {verdict} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a check that it runs")
    parser.add_argument("--repeats", type=positive, default=2, help="rounds of part 1 (the fastest kept)")
    args = parser.parse_args(argv)
    lengths = [1024, 512, 1536, 512, 512] if args.quick else [4096, 2048, 6144, 2048, 2048]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    pack = lognormal_pack(16384 if args.quick else 65536)
    title = (f"Masks: time, work and bytes at CP = 2 against full causal, and the layout balanced by the mask, "
             f"{torch.get_num_threads()} threads (load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"## {title}\n")
    results = {"title": title, "tokens": cu[-1], "lengths": lengths, "repeats": 1 if args.quick else args.repeats,
               "timed": timed(cu, 1 if args.quick else args.repeats), "pack documents": len(pack) - 1,
               "pack tokens": pack[-1], "balance": balance(pack, (2, 4) if args.quick else (2, 4, 8))}  # fmt: skip
    print(report(results))
    return results


if __name__ == "__main__":
    main()
