r"""The FP64 ground truth of `python -m sim verify`, and the rank-by-rank comparison.

For every case and CP group, the process that prints the table (the parent of the local
launch, or rank 0 under torchrun) rebuilds the group's batch from the seed, upcasts it to
float64 (the same rounded values the ranks used) and computes, per CP rank:

* **the simulated cluster's result**: `sim.harness.run_attention` in float64, the same mode,
  layout, padding and options, on `SimCluster(P)`: every rank's `out, dq, dk, dv`;
* **the oracle's result**: dense FP64 attention (`sim.harness.oracle_padded`), cut into the
  same shards. The dense oracle holds a $T \times T$ score matrix per head; since attention
  never crosses a document or a KV head group, it is computed one document and one KV head
  at a time, which is the same definition at a fraction of the memory.

A rank's row compares its four tensors with the simulated cluster's, elementwise as
`torch.testing.assert_close` does with `atol = rtol = tol`:
$|x - x^\ast| \le \mathrm{tol} + \mathrm{tol}\, |x^\ast|$ everywhere (no NaN), and reports the
largest $|x - x^\ast|$ of each tensor, and the largest difference from the oracle over all
four. The row also fails (`BAD-REF`) if the simulated cluster itself differs from the oracle
by more than the float64 tolerance: then the ground truth, not the rank, is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import cpref
from sim.harness import oracle_padded, run_attention
from sim.progress import Progress
from sim.verify_cases import TOL, Batch, Case, Setup, cp_groups, make_batch

__all__ = ["Row", "Report", "ground_truth", "blocked_oracle", "compare", "check"]

NAMES = ("out", "dq", "dk", "dv")


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

    @property
    def ok(self) -> bool:
        """Whether this passed."""
        return self.status == "pass"


@dataclass
class Report:
    """Every row of a run, in case order then world rank order."""

    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether this passed."""
        return bool(self.rows) and all(r.ok for r in self.rows)

    def format(self) -> str:
        """The table, and a last line that counts the failures."""
        cases = [r.case for r in self.rows]
        cols = [("impl", lambda c: c.impl)] if any(c.impl != "cpref" for c in cases) else []
        cols += [("mode", lambda c: c.mode + "".join(f" {k}={v}" for k, v in c.options)), ("layout", lambda c: c.layout),
                 ("dtype", lambda c: c.dtype), ("pad", lambda c: "yes" if c.padded else "no")]  # fmt: skip
        cols += [("mask", lambda c: "causal" if c.causal else "full")] if len({c.causal for c in cases}) > 1 else []
        widths = [max([len(name)] + [len(get(c)) for c in cases]) for name, get in cols]
        head = "  ".join(f"{n:<{w}}" for (n, _), w in zip(cols, widths))
        head += f"  {'cp':>2} {'rank':>4} {'dp':>3} {'r':>3}" + "".join(f"{n:>10}" for n in NAMES) + f"{'tol':>9}{'oracle':>10}  result"
        lines = [head, "-" * len(head)]
        for row in self.rows:
            line = "  ".join(f"{get(row.case):<{w}}" for (_, get), w in zip(cols, widths))
            line += f"  {row.case.cp:>2} {row.rank:>4} {row.dp:>3} {row.cp_rank:>3}"
            line += "".join(f"{row.errors.get(n, float('nan')):>10.2e}" for n in NAMES) + f"{row.tol:>9.1e}{row.oracle:>10.2e}"
            lines.append(f"{line}  {row.status}" + (f" ({row.note})" if row.note else ""))
        bad = [r for r in self.rows if not r.ok]
        lines.append(f"{len(self.rows) - len(bad)} of {len(self.rows)} rank rows pass" + (f"; {len(bad)} FAIL" if bad else ""))
        return "\n".join(lines)


def blocked_oracle(batch: Batch, causal: bool) -> tuple[torch.Tensor, ...]:
    """The oracle's `(out, dq, dk, dv)` over the padded stream, one document and KV head at a time."""
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))
    G = q.shape[1] // k.shape[1]  # query heads per KV head
    full = [torch.zeros_like(dout), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    start = 0
    for n, m in zip(batch.real, batch.padded):
        rows = slice(start, start + m)  # the document, padding included
        for h in range(k.shape[1]):
            qh, kh = slice(h * G, (h + 1) * G), slice(h, h + 1)  # its G query heads and its KV head
            parts = oracle_padded(q[rows, qh], k[rows, kh], v[rows, kh], dout[rows, qh], torch.tensor([0, n]),
                                  cu_seqlens_padded=torch.tensor([0, m]), causal=causal)  # fmt: skip
            for t, part, heads in zip(full, parts, (qh, qh, kh, kh)):
                t[rows, heads] = part  # (m, G or 1, D)
        start += m
    return tuple(full)


def ground_truth(setup: Setup, case: Case, dp: int, oracle_cache: dict) -> tuple[list, list]:
    """`(simulated, oracle)`: per CP rank, `(out, dq, dk, dv)` in float64, for CP group `dp`."""
    batch = make_batch(setup, case, dp)
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))  # the same values, upcast
    simulated, _ = run_attention(q, k, v, dout, batch.cu, P=case.cp, mode=case.mode, layout=case.layout,
                                 cu_seqlens_padded=batch.cu_padded, causal=case.causal, **dict(case.options))  # fmt: skip
    key = (dp, case.dtype, case.causal, batch.real, batch.padded)  # the oracle depends on the batch only
    if key not in oracle_cache:
        oracle_cache[key] = blocked_oracle(batch, case.causal)
    shard = lambda t, r: cpref.shard(t, batch.shard_cu, cp_size=case.cp, rank=r, layout=case.layout)  # noqa: E731
    return simulated, [[shard(t, r) for t in oracle_cache[key]] for r in range(case.cp)]


def compare(got, want, tol: float) -> tuple[dict[str, float], bool, str]:
    """`(largest |got - want| per tensor, all within atol = rtol = tol, note)`."""
    errors, ok, notes = {}, True, []
    for name, g, w in zip(NAMES, got, want):
        if g is None or g.shape != w.shape:
            errors[name], ok = float("nan"), False
            notes.append(f"{name}: {'no gradient' if g is None else f'shape {tuple(g.shape)} != {tuple(w.shape)}'}")
            continue
        diff = (g.double() - w).abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
        ok &= not bool(diff.isnan().any()) and bool((diff <= tol + tol * w.abs()).all())
    return errors, ok, "; ".join(notes)


def check(setup: Setup, cases, per_rank: list, *, progress: bool | None = None) -> Report:
    """Compare every rank's results (`per_rank[world rank][case]`) with its ground truth.

    Every CP group of a case (each DP index) gets its own ground truth, from its own batch.
    """
    world, report, oracle_cache = len(per_rank), Report(), {}
    bar = Progress(len(cases), "ground truth", enabled=progress)
    for i, case in enumerate(cases):
        tol, rows = case.tol(setup), []
        for dp, ranks in enumerate(cp_groups(world, case.cp, case.strided)):
            simulated, oracle = ground_truth(setup, case, dp, oracle_cache)
            for r, g in enumerate(ranks):
                got = per_rank[g][i]
                errors, ok, note = compare(got, simulated[r], tol)
                ref_errors, ref_ok, _ = compare(simulated[r], oracle[r], TOL["fp64"])
                oracle_err = max(compare(got, oracle[r], tol)[0].values())
                status = "pass" if ok and ref_ok else "FAIL" if not ok else "BAD-REF"
                note = note or ("" if ref_ok else f"simulated cluster differs from the oracle by {max(ref_errors.values()):.1e}")
                rows.append(Row(case, g, dp, r, errors, tol, oracle_err, status, note))
        report.rows += sorted(rows, key=lambda row: row.rank)
        bar.step(case.label)
    bar.close()
    return report
