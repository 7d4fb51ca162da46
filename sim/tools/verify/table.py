"""The table `python -m sim verify` prints: one `Row` per case and rank, the `Report` of a run, the key under the
table, and the last line a CI job reads (`summary`). [`truth`][sim.tools.verify.truth] fills the rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from sim.tools.verify.cases import Case
from sim.tools.verify.impls import peer_name
from sim.tools.verify.wire import balance

__all__ = ["Row", "Report", "KEY", "summary", "NAMES", "SINKS", "RATIO_LIMIT"]

NAMES = ("out", "dq", "dk", "dv")
SINKS = "dsinks"  # the fifth column with --sinks: the sinks' gradient summed over the CP group
RATIO_LIMIT = 2.0  # a CP result at most this many times as far from the truth as the kernel without CP (MagiAttention)


@dataclass
class Row:
    """One rank's result in one case: a line of the table."""

    case: Case
    rank: int  # world rank
    dp: int  # CP group (DP index)
    cp_rank: int  # rank in the CP group
    errors: dict[str, float]  # largest |real - simulated| per tensor
    tol: float
    oracle: float  # largest |real - oracle| over the four tensors
    status: str  # "pass", "FAIL" or "BAD-REF"
    note: str = ""
    ratio: float | None = None  # largest shard_ratio of the four tensors against the run without CP; None for fp64
    baseline: str = "kernel"  # what the run without CP was (sim.tools.verify.baselines)
    share: float = 0.0  # the worst entry's |real - simulated| / (tol + tol |simulated|): the verdict's measure, <= 1

    @property
    def ratio_ok(self) -> bool:
        """Whether the row is at most `RATIO_LIMIT` times as far from the oracle as the run without CP."""
        return self.ratio is None or self.ratio <= RATIO_LIMIT

    @property
    def ok(self) -> bool:
        """Whether this passed (a skipped row, a case the implementation does not support, did not fail)."""
        return self.status in ("pass", "skipped")


@dataclass
class Report:
    """Every row of a run, in case order then world rank order; what each case's ranks moved and computed."""

    rows: list[Row] = field(default_factory=list)
    traffic: list = field(default_factory=list)  # (case, per CP group its ranks' (implementation, cpref beside) tallies)

    @property
    def ok(self) -> bool:
        """Whether this passed."""
        return bool(self.rows) and all(r.ok for r in self.rows)

    def traffic_rows(self) -> list[tuple[str, str, list]]:
        """`(case, who, per CP group its ranks' tallies)` per case, cpref's own mode on a line of its own beside an
        `--impl`: the lines of `wire.traffic_table`."""
        lines = []
        for case, groups in self.traffic:
            name = case.label.replace(f"/{case.impl}", "")
            who = f"cpref {case.mode}" if case.impl == "cpref" else peer_name(case.impl)
            lines.append((name, who, [[t[0] for t in g] for g in groups]))
            if groups[0][0][1] is not None:
                lines.append(("", f"cpref {case.mode}", [[t[1] for t in g] for g in groups]))
        return lines

    def unbalanced(self, limit: float) -> list[str]:
        """The cases whose implementation's worst CP group has a balance (max/mean work) above `limit`."""
        return [case.label for case, groups in self.traffic
                if max((balance([t[0] for t in g]) or 0.0) for g in groups) > limit]  # fmt: skip

    def format(self) -> str:
        """The table, and a last line that counts the failures."""
        cases = [r.case for r in self.rows]
        cols = [("impl", lambda c: peer_name(c.impl))] if any(c.impl != "cpref" for c in cases) else []
        cols += [("mode", lambda c: c.mode + "".join(f" {k}={v}" for k, v in c.options)), ("layout", lambda c: c.layout),
                 ("dtype", lambda c: c.dtype), ("pad", lambda c: "yes" if c.padded else "no")]  # fmt: skip
        if len({c.causal for c in cases}) > 1 or any(c.mask for c in cases):  # --mask's name, else causal or full
            cols += [("mask", lambda c: c.mask or ("causal" if c.causal else "full"))]
        baselines = {id(r.case): r.baseline for r in self.rows if r.cp_rank == 0}  # one per case (CP rank 0 ran it)
        if any(c.windowed for c in cases):  # (left, right) as --window takes it
            cols += [("window", lambda c: "{},{}".format(*c.window) if c.windowed else "none")]
        if any(b != "kernel" for b in baselines.values()) or any(c.impl != "cpref" for c in cases):
            cols += [("baseline", lambda c: baselines.get(id(c), "-"))]
        widths = [max([len(name)] + [len(get(c)) for c in cases]) for name, get in cols]
        head = "  ".join(f"{n:<{w}}" for (n, _), w in zip(cols, widths))
        names = NAMES + ((SINKS,) if any("sinks" in dict(c.variants) for c in cases) else ())
        head += f"  {'cp':>2} {'rank':>4} {'dp':>3} {'r':>3}" + "".join(f"{n:>10}" for n in names) + f"{'tol':>9}"
        head += f"{'err/tol':>9}{'vs P=1':>12}"
        head += f"{'oracle':>10}  result"
        lines = [head, "-" * len(head)]
        for row in self.rows:
            line = "  ".join(f"{get(row.case):<{w}}" for (_, get), w in zip(cols, widths))
            line += f"  {row.case.cp:>2} {row.rank:>4} {row.dp:>3} {row.cp_rank:>3}"
            line += "".join(f"{row.errors[n]:>10.2e}" if n in row.errors else f"{'-':>10}" for n in names) + f"{row.tol:>9.1e}"
            skipped = not row.errors  # not run: no error to show
            line += f"{'-':>9}" if skipped else f" {_share(row.share):>8}"
            line += f"{'-':>8} {'':>3}" if row.ratio is None else f" {_ratio(row.ratio):>7} {'<=2' if row.ratio_ok else '>2':>3}"
            line += f"{'-':>10}" if skipped else f"{row.oracle:>10.2e}"
            lines.append(f"{line}  {row.status}" + (f" ({row.note})" if row.note else ""))
        bad, skipped = [r for r in self.rows if not r.ok], sum(r.status == "skipped" for r in self.rows)
        lines.append(f"{len(self.rows) - len(bad) - skipped} of {len(self.rows)} rank rows pass"
                     + (f"; {len(bad)} FAIL" if bad else "") + (f"; {skipped} skipped" if skipped else ""))
        return "\n".join(lines)


KEY = """key: cp = the CP group's size; rank = the process (world rank); dp = which CP group it is in (the DP index);
  r = its rank inside that CP group. out, dq, dk, dv = the largest error of the output and the three gradients
  on this rank against the simulated cluster's FP64 run of the same inputs; tol = the dtype's tolerance (atol =
  rtol). err/tol = the worst entry of the four, |error| / (tol + tol |truth|): what the verdict holds to, pass if
  <= 1 (a largest error above tol passes where the truth there is large). vs P=1 = this rank's error
  against the FP64 oracle over the error of the same attention without CP
  (the baseline: the implementation itself at CP size 1 for --impl, or where it raises there sdpa/eager, each
  tensor held to the looser of the two; cpref's kernel for cpref; the baseline column shows it when it is not the
  kernel): 1 is as exact as one device; pass: <= 2. oracle = the error against the dense FP64 oracle itself.
  dsinks (with --sinks) = the sinks' gradient summed over the CP group, on every rank's row alike.
  mask (with --mask, or causal and full mixed) = the mask every call of the case took: a --mask name, or causal/full.
  A note in parentheses after the result: why a baseline fell back (CP rank 0) or gave no result, a missing
  gradient, a wrong shape, or why no backward ran."""


def _share(x: float) -> str:
    """`err/tol` in at most 8 characters: two decimals, or a power of ten from 1000 on."""
    return f"{x:.2f}" if x < 1e3 else f"{x:.1e}"


def _ratio(x: float) -> str:
    """A `vs P=1` ratio in at most 7 characters: `1.04`, `3.5e+05`, `inf`."""
    return f"{x:.2f}" if x < 1000 else f"{x:.1e}"


def summary(report: Report, unbalanced: Sequence[str] = (), limit: float | None = None) -> tuple[str, int]:
    """`(the run's last line, its exit status)`: one line a CI job can grep, `verification passed: ...` or
    `verification FAILED: ...`, with the counts of rank rows and the worst err/tol and vs P=1."""
    rows = report.rows
    run = [r for r in rows if r.status != "skipped"]
    if not run:  # a job signing off must not pass on nothing
        return (f"verification FAILED: nothing verified, every case skipped ({len(rows)} rank rows; the implementation "
                "refused them)", 1)  # fmt: skip
    bad = [r for r in rows if not r.ok]
    ratios = [r.ratio for r in run if r.ratio is not None]
    counts = [f"{len(run) - len(bad)} of {len(run)} rank rows pass"] + [f"{len(bad)} fail"] * bool(bad)
    counts += [f"{len(rows) - len(run)} skipped"] * (len(rows) > len(run))
    counts.append(f"worst err/tol {max((r.share for r in run if r.errors), default=0.0):.2f}")
    if ratios:
        counts.append(f"worst vs P=1 {max(ratios):.2f}")
    if unbalanced:
        counts.append(f"{len(unbalanced)} case(s) above balance {limit:g}: {unbalanced[0]}{', ...' * (len(unbalanced) > 1)}")
    ok = report.ok and not unbalanced
    return f"verification {'passed' if ok else 'FAILED'}: " + ", ".join(counts), 0 if ok else 1
