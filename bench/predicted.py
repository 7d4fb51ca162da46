r"""The planner against the measurement: `bench/scaling.py`'s steps, predicted by `python -m sim plan`.

`bench/scaling.py` calls [`calibrate`][sim.plan.calibrate.calibrate] first (the `this-machine`
profile, measured in the same run on the same two processes, kept beside its results: `bench/out/this-machine.json`,
or with `make bench KEEP=1` the committed `bench/results/this-machine.json`),
then, for every batch it measures, [`rows`][bench.predicted.rows] predicts each row's step at
CP = 2 (the same mode, layout, options, window and batch, priced from its dry run on every rank:
[`sim.plan.planner.predict`][sim.plan.planner.predict]) and [`markdown`][bench.predicted.markdown]
prints it beside the measured one. Goals, printed and not asserted: every prediction within
$\pm 15\%$ of the measured step, and the modes ranked as measured (each mode by its best row), where
the measurement ranks them: two modes measured closer than its own resolution are tied. The
resolution is read from the same run ([`resolution`][bench.predicted.resolution]): rows whose
plans are the same (the planner prices them alike to the last bit: `a2a` and `a2a+p2p` at CP = 2,
a mode's zigzag and balanced rows on one document) differ only by run-to-run noise, and the
largest such difference, at least 3%, is the width below which a measured order is no order.
"""

from __future__ import annotations

from typing import Any

import cpref
from sim.plan.planner import Candidate, predict
from sim.plan.profile import Profile

GOAL = 0.15  # |predicted / measured - 1|
TIE = 0.03  # at least this close, modes are tied: run to run, the same step moves by as much here


def rows(batch: dict, lengths: list[int], window: tuple[int, int], heads: int, dim: int, profile: Profile) -> list[dict]:
    """For each measured row of `batch` (`bench.scaling.summary`): `{mode, layout, path, measured, predicted, ...}`."""
    out = []
    for row in batch["rows"]:
        P = len(row["ranks"])
        options = dict(cpref.MODES[row["mode"]].example_options(P))
        if row["path"]:
            name, value = row["path"].split("=")
            options[name] = True if value == "True" else int(value)
        mask: dict[str, Any] = {} if tuple(window) == (-1, -1) else {"window": tuple(window)}
        p = predict(Candidate(row["mode"], row["layout"], tuple(sorted(options.items()))), lengths,
                    heads=(heads, heads, dim, dim), dtype="float32", P=P, profile=profile, mask=mask)  # fmt: skip
        s = p.slowest
        out.append({"mode": row["mode"], "layout": row["layout"], "path": row["path"], "measured": row["t2"],
                    "predicted": p.step, "compute": s.compute, "exposed": s.exposed})  # fmt: skip
    return out


def best(rows_: list[dict], key: str) -> dict[str, float]:
    """Each mode's best row under `key`."""
    out: dict[str, float] = {}
    for r in rows_:
        out[r["mode"]] = min(out.get(r["mode"], float("inf")), r[key])
    return out


def resolution(rows_: list[dict]) -> tuple[float, tuple[dict, dict] | None]:
    """`(tie, twins)`: the largest relative difference between two measured rows predicted alike (the same plan, so
    the same step but for noise), at least `TIE`, and the pair that gave it (None where `TIE` itself)."""
    tie, twins = TIE, None
    for i, a in enumerate(rows_):
        for b in rows_[i + 1 :]:
            if a["predicted"] == b["predicted"]:
                spread = max(a["measured"], b["measured"]) / min(a["measured"], b["measured"]) - 1
                if spread > tie:
                    tie, twins = spread, (a, b)
    return tie, twins


def misranked(rows_: list[dict]) -> list[tuple[str, str]]:
    """The pairs of modes `(a, b)` measured faster-slower by more than the measurement's `resolution` that the
    prediction orders the other way."""
    measured, predicted, tie = best(rows_, "measured"), best(rows_, "predicted"), resolution(rows_)[0]
    return [(a, b) for a in measured for b in measured
            if measured[a] < (1 - tie) * measured[b] and predicted[a] >= predicted[b]]  # fmt: skip


def markdown(rows_: list[dict]) -> str:
    """The rows' predicted and measured steps, and the two goals' verdicts."""
    lines = ["| mode | layout | measured | predicted | predicted / measured | predicted compute / exposed comm |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows_:
        name = f"{r['mode']} ({r['path']})" if r["path"] else r["mode"]
        lines.append(f"| {name} | {r['layout']} | {r['measured']:.3f} s | {r['predicted']:.3f} s | "
                     f"{r['predicted'] / r['measured']:.2f} | {r['compute']:.3f} / {r['exposed']:.3f} s |")  # fmt: skip
    within = [r for r in rows_ if abs(r["predicted"] / r["measured"] - 1) <= GOAL]
    measured, predicted = best(rows_, "measured"), best(rows_, "predicted")
    order = lambda d: " < ".join(sorted(d, key=d.get))  # noqa: E731
    wrong, (tie, twins) = misranked(rows_), resolution(rows_)
    name = lambda r: f"{r['mode']} {r['layout']}" + (f" {r['path']}" if r["path"] else "")  # noqa: E731
    noise = (f"{tie:.1%}, as far apart as {name(twins[0])} and {name(twins[1])}, which run the same plan" if twins
             else f"{TIE:.0%}")  # fmt: skip
    worst = max(rows_, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
    lines += ["", f"- predictions within +/-{GOAL:.0%}: {len(within)} of {len(rows_)} (goal: all; the worst "
              f"{worst['mode']} {worst['layout']} {worst['path']} at {worst['predicted'] / worst['measured']:.2f}): "
              f"{'met' if len(within) == len(rows_) else 'not met'}",
              f"- modes ranked as measured (measured {order(measured)}, predicted {order(predicted)}; modes measured "
              f"within {noise} are tied): "
              + (f"not met: {', '.join(f'{a} < {b}' for a, b in wrong)} measured, predicted the other way" if wrong
                 else "met")]  # fmt: skip
    return "\n".join(lines)
