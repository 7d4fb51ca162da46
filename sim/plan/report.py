r"""The planner's answer as text: the tables `python -m sim plan` prints, their key, the JSON, and the call to paste.

Per layer kind, [`plan_table`][sim.plan.report.plan_table] ranks the candidates (the `--top` best, and the
candidate the deciding term names, wherever it ranks), names the winner and what decided it, says how many
candidates the modes refuse (each with its reason under `--show-refused`), and prints the winner as the
lines a user pastes into a model ([`attention_call`][sim.plan.report.attention_call]); `KEY`
says what every column is. A model's layers share one layout ([`Plan.by_layout`][sim.plan.planner.Plan.by_layout]):
[`model_table`][sim.plan.report.model_table] for one CP size, [`models_table`][sim.plan.report.models_table] for
several; [`scan_table`][sim.plan.report.scan_table] gives each mode's best step at every P.

Example:
    >>> from sim.plan import plan
    >>> result = plan([4096, 2048, 2048], heads=(8, 2, 64, 64), dtype="bfloat16", P=4, profile="h100-sxm",
    ...               modes=["p2p", "a2a"], layouts=["zigzag"], window=1024)
    >>> print(attention_call(result.P, result.kinds["window 1024"]))
    sharding = cpref.Sharding.eod_padded(cu_seqlens, cp_size=4, layout="zigzag")
    out = cpref.attention(q, k, v, sharding, comm=comm, mode="a2a", window=(1024, 0))
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["KEY", "plan_table", "attention_call", "as_json", "model_table", "models_table", "scan_table", "scan_json"]

MIB = 2**20
KEY = """key (one row per candidate, fastest first; predicted by the time model, sim.plan.model, from the profile's \
figures, not measured):

- step ms: one layer's attention, forward and backward, on its slowest rank (the others wait for it): that rank's \
compute + exposed comm; with sampled batches the mean over them (the other columns are the slowest batch's)
- compute ms: the slowest rank's time in kernel calls
- exposed comm ms: its time waiting for collectives that its compute does not hide
- comm ms: all its collectives' time, hidden or not
- sent intra / inter MiB: the bytes it sends to ranks of its own node / of other nodes
- saved MiB: the most bytes any rank keeps for the backward: autograd's saved tensors (its shards of q, k, v, the \
output and lse, and what the mode keeps besides, such as gathered K/V); MiB = 2^20 bytes"""


def _row(i: int, p) -> str:
    """One candidate's row of the table."""
    s = p.slowest
    return (f"| {i} | {p.name} | {p.step * 1e3:.3f} | {s.compute * 1e3:.3f} | {s.exposed * 1e3:.3f} | {s.comm * 1e3:.3f} "
            f"| {s.bytes['intra'] / MIB:.1f} | {s.bytes['inter'] / MIB:.1f} | {p.peak_saved_bytes / MIB:.1f} |")  # fmt: skip


def _literal(value: Any) -> str:
    """`value` as Python source, strings in double quotes (as the docs write them)."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def attention_call(P: int, kp, softcap: float | None = None, pick=None) -> str:
    """The lines that run kind `kp`'s winner (or `pick`, one of its candidates) in a model: the `Sharding` of its
    layout (documents padded at their end, as the planner priced them) and `cpref.attention` with its mode, options
    and the kind's mask (`softcap` given, soft-capped)."""
    c = (pick or kp.ranked[0]).candidate
    named = [("mode", c.mode), *c.options, *kp.mask, *([] if softcap is None else [("softcap", softcap)])]
    args = ["mask=mask" if k == "mask" else f"{k}={_literal(v)}" for k, v in named]  # a planned Mask: the user's own
    by_mask = ", mask=mask" if kp.balanced_by_mask and c.layout == "balanced" else ""
    return (f'sharding = cpref.Sharding.eod_padded(cu_seqlens, cp_size={P}, layout="{c.layout}"{by_mask})\n'
            f"out = cpref.attention(q, k, v, sharding, comm=comm, {', '.join(args)})")  # fmt: skip


def _kind_lines(result, kind: str, kp, top: int, show_refused: bool) -> list[str]:
    """One layer kind's table, its winner, the call, and what was refused or not priced."""
    lines = ["", f"## {kind}", "",
             "| # | candidate | step ms | compute ms | exposed comm ms | comm ms | sent intra MiB | sent inter MiB | saved MiB |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    lines += [_row(i, p) for i, p in enumerate(kp.ranked[:top], 1)]
    against = kp.against
    where = kp.ranked.index(against) + 1 if against is not None else 0
    if where > top:  # the candidate the deciding term names, shown where it ranks
        lines += ["| ... |" + " |" * 8, _row(where, against)]
    if kp.ranked:
        lines += ["", f"best: **{kp.ranked[0].name}**; decided by {kp.decided_by}" + (f" (row {where})" if where else ""),
                  "", "the call, for these layers (`cu_seqlens`: the batch's document boundaries; `comm`: the CP group's "
                  "collectives):", "", "```python", attention_call(result.P, kp, result.softcap), "```"]  # fmt: skip
    if kp.refused and show_refused:
        lines += ["", f"refused ({len(kp.refused)}):"] + [f"- {p.name}: {p.refused}" for p in kp.refused]
    elif kp.refused:
        lines += ["", f"refused: {len(kp.refused)} candidate{'s' * (len(kp.refused) > 1)} (their modes refuse them: "
                      "--show-refused lists each with the reason)"]  # fmt: skip
    if kp.unpriced:
        lines += ["", f"not priced ({len(kp.unpriced)}: {', '.join(p.name for p in kp.unpriced[:4])}"
                      f"{' ...' if len(kp.unpriced) > 4 else ''}): {kp.unpriced[0].unpriced}"]  # fmt: skip
    return lines


def plan_table(result, top: int, show_refused: bool = False) -> str:
    """The plan as Markdown: a header, per layer kind its table and winner (`_kind_lines`), then `KEY`."""
    batches = result.batches
    what = (f"{len(batches[0])} documents, {sum(batches[0])} tokens" if len(batches) == 1 else
            f"{len(batches)} sampled batches of {sum(batches[0])} tokens ({', '.join(str(len(b)) for b in batches)} "
            "documents; step: the mean over them, the other columns the slowest batch's)")  # fmt: skip
    capped = ("" if result.softcap is None else f", soft-capped at {result.softcap:g} (every call "
              f"{result.profile.kernel(result.dtype, softcap=True).factor:g}x)")  # fmt: skip
    lines = [f"P = {result.P} on {result.profile.name} ({result.profile.ranks_per_node} ranks per node), heads "
             f"{result.heads}, {result.dtype}, {what}{capped}"]  # fmt: skip
    for kind, kp in result.kinds.items():
        lines += _kind_lines(result, kind, kp, top, show_refused)
    return "\n".join(lines + ["", KEY])


def as_json(result) -> dict:
    """The plan as plain data (every refused candidate with its reason)."""

    def rank(r):
        return {"rank": r.rank, "compute_s": r.compute, "comm_s": r.comm, "exposed_s": r.exposed, "step_s": r.step,
                "bytes": r.bytes, "saved_bytes": r.saved_bytes, "kernel_calls": r.calls, "flops": r.flops}  # fmt: skip

    return {"P": result.P, "profile": result.profile.name, "ranks_per_node": result.profile.ranks_per_node,
            "heads": list(result.heads), "dtype": result.dtype, "softcap": result.softcap,
            "lengths": list(result.lengths), "batches": [list(b) for b in result.batches],
            "kinds": {kind: {"decided_by": kp.decided_by, "against": kp.against and kp.against.name,
                             "call": attention_call(result.P, kp, result.softcap),
                             "ranked": [{"candidate": p.name, "step_s": p.step, "batch_steps_s": list(p.batch_steps),
                                         "ranks": [rank(r) for r in p.ranks]}
                                        for p in kp.ranked],
                             "refused": [{"candidate": p.name, "reason": p.refused} for p in kp.refused],
                             "not_priced": [{"candidate": p.name, "reason": p.unpriced} for p in kp.unpriced]}
                      for kind, kp in result.kinds.items()}}  # fmt: skip


def _model_calls(result, choice) -> list[str]:
    """A model's layout as one `Sharding` and one `cpref.attention` call per layer kind."""
    calls = [attention_call(result.P, result.kinds[k], result.softcap, p).splitlines() for k, p in choice.picks.items()]
    return ["```python", calls[0][0]] + [f"{c[1]}  # {k} layers" for k, c in zip(choice.picks, calls)] + ["```"]


def model_table(result, choices: list, layers: dict[str, int]) -> str:
    """A model's layers over one layout (`Plan.by_layout`) as Markdown: per layout, each kind's pick and the step;
    the best layout's calls."""
    kinds = list(choices[0].picks) if choices else []
    what = " + ".join(f"{n} {k}" for k, n in layers.items())
    lines = [f"## the model: {what} layers, one layout for all (the batch is sharded once)", "",
             "| layout | model step ms | " + " | ".join(kinds) + " |", "| --- | ---: |" + " --- |" * len(kinds)]  # fmt: skip
    for c in choices:
        lines.append(f"| {c.layout} | {c.step * 1e3:.3f} | " + " | ".join(
            f"{p.name} ({p.step * 1e3:.3f} ms)" for p in c.picks.values()) + " |")  # fmt: skip
    if not choices:
        return "\n".join(lines + ["", "no layout runs every kind"])
    best = choices[0]
    lines += ["", f"best for the model: **{best.layout}**, " + "; ".join(f"{k}: {p.name}" for k, p in best.picks.items()),
              "", "the calls, every layer on the one sharding:", ""]  # fmt: skip
    return "\n".join(lines + _model_calls(result, best))


def models_table(plans: Sequence, layers: dict[str, int], named: dict[str, str]) -> str:
    """A model's layers at several P (`--cp 8,16 --layers ...`): per P, the best layout for the whole model, its step
    and each kind's pick there (`named`: a `--layers` kind to the plan's kind name)."""
    kinds = [named[k] for k in layers]
    what = " + ".join(f"{n} {k}" for k, n in layers.items())
    lines = ["", f"## the model: {what} layers, one layout for all, at each P", "",
             "| P | layout | model step ms | " + " | ".join(kinds) + " |", "| ---: | --- | ---: |" + " --- |" * len(kinds)]  # fmt: skip
    for result in plans:
        choices = result.by_layout({named[k]: n for k, n in layers.items()})
        if not choices:
            lines.append(f"| {result.P} | - | - |" + " no layout runs every kind |" + " |" * (len(kinds) - 1))
            continue
        c = choices[0]
        lines.append(f"| {result.P} | {c.layout} | {c.step * 1e3:.3f} | " + " | ".join(
            f"{c.picks[k].name} ({c.picks[k].step * 1e3:.3f} ms)" for k in kinds) + " |")  # fmt: skip
    return "\n".join(lines)


def scan_table(curves: dict, Ps: Sequence[int], heads: Sequence[int]) -> str:
    """Several P as Markdown: per layer kind, each mode's best step at every P, the winner, and the crossovers."""
    from sim.plan.study import MODES_SHOWN

    lines = [f"P = {', '.join(map(str, Ps))} on {next(iter(curves.values())).profile}, heads {tuple(heads)}"]
    for kind, c in curves.items():
        lines += ["", f"## {kind}", "", "| P | " + " | ".join(f"{m} ms" for m in MODES_SHOWN) + " | winner |",
                  "| ---: |" + " ---: |" * len(MODES_SHOWN) + " --- |"]  # fmt: skip
        for i, P in enumerate(c.Ps):
            cells = [f"{c.points[m][i].step * 1e3:.3f}" if c.points[m][i] else "-" for m in MODES_SHOWN]
            lines.append(f"| {P} | " + " | ".join(cells) + f" | {c.points[c.winners[i]][i].name} |")
        lines += [""] + [f"crossover: {w0} at P = {p0}, {w1} at P = {p1}: {c.decided_by[c.Ps.index(p1)]}"
                         for p0, p1, w0, w1 in c.crossovers] or ["no crossover: one mode wins at every P"]  # fmt: skip
    return "\n".join(lines)


def scan_json(curves: dict) -> dict[str, Any]:
    """Several P as plain data: per kind, per mode, its best candidate and step at every P (None where none runs)."""
    return {kind: {"P": list(c.Ps), "winners": list(c.winners), "decided_by": list(c.decided_by),
                   "modes": {m: [p and {"candidate": p.name, "step_s": p.step, "compute_s": p.compute,
                                        "exposed_s": p.exposed} for p in pts] for m, pts in c.points.items()}}
            for kind, c in curves.items()}  # fmt: skip
