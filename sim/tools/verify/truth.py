r"""The FP64 ground truth of `python -m sim verify`, and the rank-by-rank comparison.

For every case and CP group, the process that prints the table (the parent of the local
launch, or rank 0 under torchrun) rebuilds the group's batch from the seed, upcasts it to
float64 (the same rounded values the ranks used) and computes, per CP rank:

* **the simulated cluster's result**: `sim.cluster.harness.run_attention` in float64, the same mode,
  layout, padding, mask, window and options, on `SimCluster(P)`: every rank's `out, dq, dk, dv`;
* **the oracle's result**: dense FP64 attention (`sim.cluster.harness.oracle_padded`), cut into the
  same shards. The dense oracle holds a $T \times T$ score matrix per head; since attention
  never crosses a document or a KV head group, it is computed one document and one KV head
  at a time, which is the same definition at a fraction of the memory (a sliding window is
  one document's too: its positions count from the document's start). Under `--mask` the
  oracle takes the mask's matrix (`sim.oracle.slice_mask`), one range of tokens that holds
  its slices whole at a time ([`masked_oracle`][sim.tools.verify.masks.masked_oracle]): a mask may cross documents.

A rank's row compares its four tensors with the simulated cluster's, elementwise as
`torch.testing.assert_close` does with `atol = rtol = tol`:
$|x - x^\ast| \le \mathrm{tol} + \mathrm{tol}\, |x^\ast|$ everywhere (no NaN), and reports the
largest $|x - x^\ast|$ of each tensor, and the largest difference from the oracle over all
four. The row also fails (`BAD-REF`) if the simulated cluster itself differs from the oracle
by more than the float64 tolerance: then the ground truth, not the rank, is wrong.

## Relative to the same attention without CP

A fixed tolerance cannot tell a CP fault from the kernel's own rounding once the logits are
large: at inputs 30 times N(0, 1) the float32 kernel alone, without CP, is off the oracle by
more than 1e-5. So every row also holds the criterion of MagiAttention's tests: **a CP result
may be at most `RATIO_LIMIT` = 2 times as far from the FP64 truth as the same attention
without CP** (P = 1, same dtype, same inputs). CP rank 0 of each CP group runs the group's
whole batch once more through the row's baseline ([`sim.tools.verify.baselines`][sim.tools.verify.baselines]:
cpref's kernel on a `SingleRank` for cpref, the implementation itself on one rank for an
`--impl`), on its own device; its result is cut into the same shards. A rank is held to the kernel's error over the
**whole batch**, as MagiAttention holds a CP result (the whole tensor): with

$$ \rho_r = \frac{\max_{\text{rank } r} |x_{CP} - x^\ast|}
              {\max\big(\max_{\text{batch}} |x_{P=1} - x^\ast|,\ \tfrac{\epsilon}{2} \max_{\text{batch}} |x^\ast|\big)}, $$

$x^\ast$ the oracle and $\epsilon$ the machine epsilon of the dtype (the floor is the
largest error that merely storing the exact result in that dtype makes), the `vs P=1` column
shows the largest $\rho_r$ of the row's four tensors (`shard_ratio`) and whether it is
$\le 2$; above 2 the row fails. Held to the run without CP on its own rows instead, a rank
would fail by chance: the largest of a shard's few thousand errors moves by more than 2x
between results rounded equally well (on the simulated cluster, summing across ranks in the
dtype in rank order, `reduction="native"`: float32, P = 4, zigzag, documents of 96, 224 and 64
tokens, 6 seeds: the RFC's one call, whose rounding is the kernel's plus the reduce-scatter's,
reached 2.62 on one shard of 24 against its own rows, and at most 1.31 against the batch; a
test re-measures both). fp64 rows show `-`: the FP64 truth is no more precise than an fp64
result, so the ratio would compare rounding with rounding.

The largest error is one entry of thousands. A result that rounds more on **every** row (a
ring that merges its partial outputs in bf16 across its steps) can keep its largest error near
the baseline's while its root-mean-square error grows with the number of steps, so the
column is the larger of `shard_ratio` and [`rms_ratio`][sim.tools.verify.truth.rms_ratio]: the
rank's RMS error over the baseline's on the **same rows** (an average over thousands of
entries is stable from shard to shard, so no batch-wide comparison is needed there). With
`tests.backends.verify_impls`' plain-torch CP attention in bf16 held to itself (the tables are
on the page "Verify: every option, what it checks and counts", and the test suite re-measures them), carrying its
merge in bf16 passes at P = 2 (1.33 and 1.67: a CP fault that costs less than twice the
rounding passes, by design) and fails 3 of 4 ranks at P = 4 (2.09-2.52), where the exact
implementation's rows stay at or below 1.54.

With several candidate baselines (the fallback of an implementation that cannot run on one
rank, [`sim.tools.verify.baselines`][sim.tools.verify.baselines]), each ratio of each tensor
takes the candidate farther from the truth: the smallest of its ratios.
"""

from __future__ import annotations

from typing import Sequence

import torch

import cpref
from cpref.kernels.contract import NO_WINDOW
from sim.cluster.harness import oracle_padded, run_attention
from sim.tools.verify.cases import DTYPES, TOL, Batch, Case, Setup, call_variants, case_mask, cp_groups, make_batch
from sim.tools.verify.masks import masked_oracle
from sim.tools.verify.meter import meter
from sim.tools.verify.table import NAMES, RATIO_LIMIT, SINKS, Report, Row

__all__ = ["RATIO_LIMIT", "ground_truth", "blocked_oracle", "compare", "complete", "precision_ratio", "shard_ratio",
           "rms_ratio", "relative_error", "vs_without_cp", "check"]  # fmt: skip

Tensors = torch.Tensor | Sequence[torch.Tensor]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """`max |got - want| / max |want|`, compared in float64; the absolute error where `want` is all 0."""
    diff = (got.double() - want.double()).abs()
    scale = float(want.abs().max()) if want.numel() else 0.0
    return (float(diff.max()) if diff.numel() else 0.0) / (scale or 1.0)


def precision_ratio(got: Tensors, without_cp: Tensors, truth: Tensors, dtype: torch.dtype, condition: float = 1.0) -> float:
    """How many times farther from `truth` the CP result `got` is than `without_cp`, the same kernel
    at P = 1 on the same inputs in the same `dtype` (see "Relative to the kernel" above).

    `relative_error(got) / max(relative_error(without_cp), condition * eps / 2)` with `eps` the machine
    epsilon of `dtype`: the floor is the largest error that storing the exact result in `dtype`
    can make, relative to its largest entry, so two results exact to their last bit give no
    0 / 0. For a result that is a sum whose terms cancel (the sinks' gradient), storing each exact
    term in `dtype` already moves the sum by up to `eps / 2` of the terms' magnitudes: `condition`
    is that sum of magnitudes over the result's largest entry (the sum's condition number), and the
    floor is `condition` times higher. Each argument may also be a sequence, one tensor per batch: each error is then the
    worst over the batches. Returns 0.0 when `got` is exact, inf when only `got` is off an
    all-zero truth.

    Example:
        >>> truth = torch.tensor([1.0, -2.0], dtype=torch.float64)
        >>> cp, plain = torch.tensor([1.0, -2.0 + 2**-20]), torch.tensor([1.0 + 2**-21, -2.0])
        >>> precision_ratio(cp, plain, truth, torch.float32)  # twice as far: just within the limit
        2.0
        >>> precision_ratio(cp, plain, truth, torch.float32, condition=8.0)  # a sum of terms 8 times its size
        1.0
    """
    got, without_cp, truth = ([x] if isinstance(x, torch.Tensor) else list(x) for x in (got, without_cp, truth))
    err = max(relative_error(g, t) for g, t in zip(got, truth, strict=True))
    err_1 = max(relative_error(p, t) for p, t in zip(without_cp, truth, strict=True))
    floor = condition * torch.finfo(dtype).eps / 2 if any(t.numel() and bool(t.abs().max() > 0) for t in truth) else 0.0
    if err == 0.0:
        return 0.0
    return err / max(err_1, floor) if max(err_1, floor) > 0 else float("inf")


def blocked_oracle(batch: Batch, causal: bool, window: tuple[int, int] = NO_WINDOW, **variants) -> tuple[torch.Tensor, ...]:
    """The oracle's `(out, dq, dk, dv)` over the padded stream, one document and KV head at a time (`variants`:
    `softcap`, `chunk`, whose positions count from the document's start, as the oracle's do; `sinks`, the sinks of
    each KV head's query heads, whose gradient, summed over the documents, comes fifth)."""
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))
    G = q.shape[1] // k.shape[1]  # query heads per KV head
    sinks = variants.pop("sinks", None)
    full = [torch.zeros_like(dout), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    full += [] if sinks is None else [torch.zeros(q.shape[1], dtype=torch.float64)]
    start = 0
    for n, m in zip(batch.real, batch.padded):
        rows = slice(start, start + m)  # the document, padding included
        doc = cpref.Sharding([0, n], cp_size=1, cu_seqlens_padded=[0, m])  # the document alone, its n real tokens
        for h in range(k.shape[1]):
            qh, kh = slice(h * G, (h + 1) * G), slice(h, h + 1)  # its G query heads and its KV head
            qkv = q[rows, qh], k[rows, kh], v[rows, kh]  # (m, G, D), (m, 1, D), (m, 1, D)
            own = {} if sinks is None else {"sinks": sinks[qh].double()}  # (G,): its query heads' sinks
            parts = oracle_padded(*qkv, dout[rows, qh], doc, causal=causal, window=window, **variants, **own)
            for t, part, heads in zip(full, parts, (qh, qh, kh, kh)):
                t[rows, heads] = part  # (m, G or 1, D)
            if sinks is not None:
                full[4][qh] += parts[4]  # (G,): the document's share of the sinks' gradient
        start += m
    return tuple(full)


def ground_truth(setup: Setup, case: Case, dp: int, oracle_cache: dict, without_cp=None) -> tuple[list, list, list | None]:
    """`(simulated, oracle, without CP)`: per CP rank, `(out, dq, dk, dv)`, for CP group `dp`; the first two in
    float64, the third per candidate of `without_cp` (the whole batch's results at P = 1, if given) its shards."""
    batch = make_batch(setup, case, dp)
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))  # the same values, upcast
    sharding = batch.sharding  # the case's CP size, layout and padding
    variants = call_variants(case, q.shape[1], "fp64")  # the sinks in float64, of the same values
    mask = case_mask(setup, case)  # --mask: in place of causal and window, which keep their defaults
    simulated, _ = run_attention(q, k, v, dout, sharding, mode=case.mode, causal=case.causal, window=case.window,
                                 mask=mask, **variants, **dict(case.options))  # fmt: skip
    if "sinks" in variants:  # every rank's row holds the group's sum of the shares
        total = sum(result[4] for result in simulated)
        simulated = [(*result[:4], total) for result in simulated]
    key = (dp, case.dtype, case.causal, case.window, case.variants, case.mask, batch.real, batch.padded)  # batch, mask
    if key not in oracle_cache and mask is not None:
        oracle_cache[key] = masked_oracle(batch, mask, **variants)
    elif key not in oracle_cache:
        oracle_cache[key] = blocked_oracle(batch, case.causal, case.window, **variants)

    def cut(tensors, r: int) -> list:
        """Rank r's shards of `(out, dq, dk, dv)`; the sinks' gradient, which no rank holds a part of, whole."""
        return [sharding.shard(t, r) for t in tensors[:4]] + list(tensors[4:])

    shards = None if without_cp is None else [[cut(one, r) for r in range(case.cp)] for one in without_cp]
    return simulated, [cut(oracle_cache[key], r) for r in range(case.cp)], shards


def compare(got, want, tol: float, backward: bool = True) -> tuple[dict[str, float], bool, str]:
    """`(largest |got - want| per tensor, all within atol = rtol = tol, note)`; without `backward` (none ran: the
    rank's note says why) only `out` is compared, and the row fails."""
    errors, ok, notes = {}, backward, []
    for name, g, w in zip(NAMES + (SINKS,), got, want):
        if not backward and name != "out":
            continue
        if g is None or g.shape != w.shape:
            errors[name], ok = float("nan"), False
            if g is not None or name != "out":  # an output that is not a tensor: the rank's note says so
                notes.append(f"{name}: {'no gradient' if g is None else f'shape {tuple(g.shape)} != {tuple(w.shape)}'}")
            continue
        diff = (g.double() - w).abs()
        errors[name] = float(diff.max()) if diff.numel() else 0.0
        ok &= not bool(diff.isnan().any()) and bool((diff <= tol + tol * w.abs()).all())
    return errors, ok, "; ".join(notes)


def share_of_tolerance(got, want, tol: float) -> float:
    r"""The worst entry's $|x - x^\ast| / (\mathrm{tol} + \mathrm{tol}\,|x^\ast|)$ over the tensors of `got` that are
    there and of `want`'s shape: what the verdict holds to at most 1 (NaN where an entry is NaN).

    Examples:
        >>> import torch
        >>> truth = torch.tensor([1.0, 10.0], dtype=torch.float64)
        >>> share_of_tolerance([torch.tensor([1.5, 10.0], dtype=torch.float64)], [truth], 0.25)  # 0.5 / (0.25 + 0.25)
        1.0
    """
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None or g.shape != w.shape or not g.numel():
            continue
        share = ((g.double() - w).abs() / (tol + tol * w.abs())).max()
        worst = float("nan") if share.isnan() or worst != worst else max(worst, float(share))
    return worst


def complete(got, want) -> bool:
    """Whether every tensor of `got` is there and of `want`'s shape (a row whose `vs P=1` can be computed)."""
    return all(g is not None and g.shape == w.shape for g, w in zip(got, want))


def vs_without_cp(case: Case, got, rank: int, without_cp, oracle) -> float | None:
    """The largest `shard_ratio` and `rms_ratio` of rank `rank`'s four tensors `got`; None for fp64, a missing
    tensor, or no baseline (`without_cp` None or empty). `oracle`: per rank, its four shards of the oracle;
    `without_cp`: per candidate baseline, the same of the batch without CP. With several candidates (the fallback)
    each ratio of each tensor takes the candidate farther from the truth: the smallest ratio."""
    if case.dtype == "fp64" or not without_cp or not complete(got, oracle[rank]):
        return None
    dtype, truth = DTYPES[case.dtype], [[w[i] for w in oracle] for i in range(len(got))]  # per tensor, every rank's
    return max(max(min(shard_ratio(g, oracle[rank][i], [p[i] for p in one], truth[i], dtype) for one in without_cp),
                   min(rms_ratio(g, oracle[rank][i], one[rank][i], dtype) for one in without_cp))
               for i, g in enumerate(got))  # fmt: skip


def rms_ratio(got: torch.Tensor, truth: torch.Tensor, without_cp: torch.Tensor, dtype: torch.dtype) -> float:
    """How many times the root-mean-square error of a rank's shard `got` is that of the same rows without CP.

    Where the largest error (`shard_ratio`) is one entry, this is all of them: a CP result that rounds
    more on every row (a merge carried in bf16 across ring steps) is caught here while its largest error
    may still look like the baseline's. The floor, `eps / 4` of the rows' root mean square, is about what
    storing the exact result in `dtype` costs. Returns 0.0 when `got` is exact.

    Example:
        >>> truth = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
        >>> rms_ratio(torch.tensor([1.0, -2.0, 4.0 + 2**-18]), truth, torch.tensor([1.0, -2.0 + 2**-19, 4.0]), torch.float32)
        2.0
    """
    if not got.numel():
        return 0.0
    rms = lambda x: float(x.double().pow(2).mean().sqrt())  # noqa: E731
    err = rms(got.double() - truth)
    if err == 0.0:
        return 0.0
    floor = torch.finfo(dtype).eps / 4 * rms(truth)
    base = max(rms(without_cp.double() - truth), floor)
    return err / base if base > 0 else float("inf")


def shard_ratio(got: torch.Tensor, truth: torch.Tensor, without_cp: Tensors, batch_truth: Tensors,
                dtype: torch.dtype) -> float:  # fmt: skip
    """`precision_ratio` of one rank's shard: its largest error `max |got - truth|` and the run without CP's over the
    whole batch (`without_cp`, `batch_truth`: every rank's shards), both relative to the batch's largest entry.

    A rank's shard is a fraction of the batch, and the largest error over a few thousand entries moves from shard to
    shard by more than 2x between two results equally rounded; so the rank is held to the kernel's error over the
    batch, as MagiAttention's criterion holds a CP result (the whole tensor): a rank 2x farther than that is 2x
    farther than P = 1 anywhere. Returns 0.0 when `got` is exact.

    Example:
        >>> truth = [torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)]
        >>> plain = [torch.tensor([1.0, -2.0]), torch.tensor([4.0 + 2**-20])]  # P = 1: off on rank 1's entry
        >>> shard_ratio(torch.tensor([1.0, -2.0 + 2**-19]), truth[0], plain, truth, torch.float32)  # rank 0: twice
        2.0
    """
    scale = max((float(t.abs().max()) for t in batch_truth if t.numel()), default=0.0)
    err = float((got.double() - truth).abs().max()) if got.numel() else 0.0
    if err == 0.0:
        return 0.0
    err_1 = max((float((p.double() - t).abs().max()) for p, t in zip(without_cp, batch_truth, strict=True) if t.numel()),
                default=0.0)  # fmt: skip
    floor = torch.finfo(dtype).eps / 2 * scale
    return err / max(err_1, floor) if max(err_1, floor) > 0 else float("inf")


def check(setup: Setup, cases, per_rank: list, *, progress: bool | None = None) -> Report:
    """Compare every rank's results with its ground truth and with the run without CP.

    `per_rank[world rank][case]` is `(result, without_cp[, note[, traffic]])`: the rank's `(out, dq, dk, dv)`; on CP
    rank 0 of each group the whole batch's at P = 1 (`rank.run_without_cp`'s; None elsewhere); where no backward ran,
    why (`rank.run_case`'s note: the row fails on its output alone); what the rank moved and computed (kept in the
    report's `traffic` where every rank has it). Every CP group of a case (each DP index) gets its own ground truth,
    from its own batch. Under `setup.forward_only` the output alone is compared.
    """
    world, report, oracle_cache = len(per_rank), Report(), {}
    bar = meter(len(cases), "ground truth", progress)
    per_rank = [[(*pair, "", None)[:4] for pair in cases_of] for cases_of in per_rank]  # note, traffic: "" and None
    first = lambda x: [t[:1] for t in x] if setup.forward_only else x  # noqa: E731  (out) alone, or every tensor
    for i, case in enumerate(cases):
        tol, rows, moved = case.tol(setup), [], []
        for dp, ranks in enumerate(cp_groups(world, case.cp, case.strided)):
            unsupported = [per_rank[g][i][2] for g in ranks if per_rank[g][i][0] == ()]
            if unsupported:  # the implementation refused the case on every rank (they agreed): a row each, not run
                why = unsupported[0].partition(" ")[2][1:-1]  # "skipped (why)" -> why
                rows += [Row(case, g, dp, r, {}, tol, float("nan"), "skipped", why) for r, g in enumerate(ranks)]
                continue
            moved.append([per_rank[g][i][3] for g in ranks] if all(per_rank[g][i][3] for g in ranks) else None)
            result, used, note_1 = per_rank[ranks[0]][i][1] or (None, "kernel", "")  # the runs without CP, their label
            simulated, oracle, plain = ground_truth(setup, case, dp, oracle_cache, result or None)
            simulated, oracle, plain = first(simulated), first(oracle), plain and [first(one) for one in plain]
            for r, g in enumerate(ranks):
                got, _, stopped, _ = per_rank[g][i]  # stopped: why no backward ran, where none did
                got, backward = first([got])[0], not stopped
                errors, ok, note = compare(got, simulated[r], tol, backward)
                ref_errors, ref_ok, _ = compare(simulated[r], oracle[r], TOL["fp64"])
                oracle_err = max(compare(got, oracle[r], tol, backward)[0].values())
                ratio = vs_without_cp(case, got, r, plain, oracle)
                ok &= ratio is None or ratio <= RATIO_LIMIT
                # a baseline that gave no result (`result == ()`) leaves a complete row without its check: it fails
                unchecked = result == () and case.dtype != "fp64" and complete(got, oracle[r])
                ok &= not unchecked
                status = "pass" if ok and ref_ok else "FAIL" if not ok else "BAD-REF"
                note = note or ("" if ref_ok else f"simulated cluster differs from the oracle by {max(ref_errors.values()):.1e}")
                said = note_1 if (r == 0 and result != ()) or unchecked else ""
                note = "; ".join(n for n in (note, stopped, said) if n)
                share = share_of_tolerance(got[: len(errors)], simulated[r], tol)  # the tensors compared
                rows.append(Row(case, g, dp, r, errors, tol, oracle_err, status, note, ratio, used, share))
        report.rows += sorted(rows, key=lambda row: row.rank)
        if moved and None not in moved:
            report.traffic.append((case, moved))
        bar.step(case.label)
    bar.close()
    return report
