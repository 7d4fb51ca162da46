"""The planner at scale: every rank built at once against every rank dry-run, side by side, then up to 1024 ranks.

What [`sim.plan.scale`][sim.plan.scale] buys [the planner](planner.md), on the 128k-token packed
batch of [The modes from 8 to 1024 ranks](mode-study.md) (Llama-3-8B-like heads, the H100 profile),
in three parts:

1. **Side by side** at P = 4 and 8: the candidates `sim.plan.scale` covers (`p2p`, `all_gather`,
   `a2a+p2p` over contiguous and zigzag), each priced both ways in the same run: every rank
   dry-run on meta tensors and priced by `rank_time`, and every rank built by `schedule` and
   priced by `Schedule.price`. Printed: the seconds of each, their ratio, and whether the two
   agree on every rank's step (to 1e-12; the tests hold them equal rank by rank).
2. **The whole planner** at P = 64, 256 and 1024 (`python -m sim plan` with the study's
   candidates): its seconds and the candidates it priced. Goal: P = 1024 in under ten seconds
   ("in seconds", issue 46).
3. **Every layout, full and windowed layers**: at P = 1024, the planner with every mode and layout
   (stream and balanced too, [built per rank](plan-scale-split.md)) for full-causal layers and
   for layers under a causal window of 1024 (`--window 1024`): windows and the stream and balanced
   layouts make the irregular plans of [Irregular plans at scale](plan-scale-window.md) and
   [Split plans at scale](plan-scale-split.md). Printed: its seconds, the candidates priced per
   layer kind, and those left to the dry run (not priced above 32 ranks; none today).

Nothing here is a measurement of attention: the figures are the planner's own seconds, on this
machine. Run it with `python -m bench.plan` (or `make bench`); `--quick` runs P = 4 and 64 alone.

{{ results plan }}
"""

from __future__ import annotations

import math
import time

import torch

from cpref.base.errors import CPInputError
from sim.plan import scale
from sim.plan.dry import dry_run
from sim.plan.model import rank_time
from sim.plan.planner import _sharding, candidates, plan
from sim.plan.profile import load_profile
from sim.plan.study import MODELS, study_batch
from sim.tools.cli import Parser

HEADS = MODELS["Llama-3-8B-like"]
PROFILE = "h100-sxm"
GOAL_SECONDS = 10.0  # the whole plan at P = 1024


def side_by_side(P: int) -> dict:
    """Every covered candidate at `P`, priced from the dry run and from the schedule: seconds, and agreement."""
    profile = load_profile(PROFILE)
    compute, batch = profile.kernel("bfloat16"), study_batch()
    dry_s = built_s = 0.0
    agree, count = True, 0
    for c in candidates(P, ["p2p", "all_gather", "a2a+p2p"], list(scale.SCALED_LAYOUTS)):
        options = dict(c.options)
        sharding = _sharding(batch, P, c.layout)
        if not scale.covers(c.mode, c.layout, options, P, {}):
            continue
        try:
            scale.validate(c.mode, sharding, HEADS, torch.bfloat16, options)
        except CPInputError:  # heads a2a_size or head_groups cannot split: refused alike both ways
            continue
        start = time.perf_counter()
        dry = [rank_time(dry_run(c.mode, sharding, r, heads=HEADS, dtype=torch.bfloat16, **options), profile, compute)
               for r in range(P)]  # fmt: skip
        middle = time.perf_counter()
        built = scale.schedule(c.mode, sharding, heads=HEADS, dtype=torch.bfloat16, **options).price(profile, compute)
        end = time.perf_counter()
        dry_s, built_s, count = dry_s + middle - start, built_s + end - middle, count + 1
        agree &= all(math.isclose(a.step, b.step, rel_tol=1e-12) for a, b in zip(dry, built))
    return {"P": P, "candidates": count, "dry_run_s": dry_s, "scale_s": built_s, "agree": agree}


def whole_plan(P: int) -> dict:
    """The planner at `P` with the study's candidates: seconds, candidates priced, the winner."""
    start = time.perf_counter()
    result = plan(list(study_batch()), heads=HEADS, dtype="bfloat16", P=P, profile=PROFILE,
                  layouts=list(scale.SCALED_LAYOUTS), dry_run_limit=1).kinds["full"]  # fmt: skip
    return {"P": P, "seconds": time.perf_counter() - start, "priced": len(result.ranked), "refused": len(result.refused),
            "unpriced": len(result.unpriced), "winner": result.ranked[0].name, "ranks": len(result.ranked[0].ranks)}  # fmt: skip


def every_layout(P: int, window: int = 1024) -> dict:
    """The planner at `P` with every mode and layout, full-causal and windowed layers: seconds, and per layer kind
    the candidates priced and not priced."""
    start = time.perf_counter()
    result = plan(list(study_batch()), heads=HEADS, dtype="bfloat16", P=P, profile=PROFILE, window=window)
    seconds = time.perf_counter() - start
    return {"P": P, "seconds": seconds, "window": window,
            "kinds": {kind: {"priced": len(k.ranked), "unpriced": [p.name for p in k.unpriced], "winner": k.ranked[0].name}
                      for kind, k in result.kinds.items()}}  # fmt: skip


def report(r: dict) -> str:
    """The two tables and the goal, as Markdown (what `main` prints, and the performance page shows)."""
    lines = ["| P | candidates | dry run, every rank (s) | built at scale (s) | ratio | steps agree |",
             "| ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for s in r["side_by_side"]:
        lines.append(f"| {s['P']} | {s['candidates']} | {s['dry_run_s']:.2f} | {s['scale_s']:.3f} | "
                     f"{s['dry_run_s'] / s['scale_s']:.0f}x | {'yes' if s['agree'] else 'NO'} |")  # fmt: skip
    lines += ["", "| P | planner (s) | candidates priced | refused | not priced | winner |",
              "| ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for w in r["whole"]:
        lines.append(f"| {w['P']} | {w['seconds']:.1f} | {w['priced']} | {w['refused']} | {w['unpriced']} | "
                     f"{w['winner']} |")  # fmt: skip
    lines += ["", "| P | layer kinds | planner, every layout (s) | priced | not priced (dry run only) | winners |",
              "| ---: | --- | ---: | ---: | --- | --- |"]  # fmt: skip
    for e in r["every_layout"]:
        kinds = e["kinds"].items()
        priced = " + ".join(str(k["priced"]) for _, k in kinds)
        unpriced = ", ".join(sorted({n for _, k in kinds for n in k["unpriced"]})) or "none"
        winners = "; ".join(f"{kind}: {k['winner']}" for kind, k in kinds)
        lines.append(f"| {e['P']} | full, window {e['window']} | {e['seconds']:.1f} | {priced} | {unpriced} | {winners} |")
    top = max(r["whole"], key=lambda w: w["P"])
    met = top["seconds"] < GOAL_SECONDS
    lines += ["", f"- the planner at P = {top['P']}: {top['seconds']:.1f} s (goal < {GOAL_SECONDS:.0f} s): "
                  f"{'met' if met else 'not met'}"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P = 4 and 64 alone")
    args = parser.parse_args(argv)
    dry_run("p2p", _sharding((8,), 2, "zigzag"), 0, heads=(2, 2, 8, 8), dtype=torch.bfloat16)  # imports, off the clock
    result = {"title": f"The study's batch ({len(study_batch())} documents, {sum(study_batch())} tokens), heads "
                       f"{HEADS}, bf16, the {PROFILE} profile",  # fmt: skip
              "side_by_side": [side_by_side(P) for P in ((4,) if args.quick else (4, 8))],
              "whole": [whole_plan(P) for P in ((64,) if args.quick else (64, 256, 1024))],
              "every_layout": [every_layout(P) for P in ((64,) if args.quick else (1024,))]}  # fmt: skip
    print(result["title"] + "\n\n" + report(result))
    return result


if __name__ == "__main__":
    main()
