"""What the mask probe ([`probe`][sim.tools.verify.probe]) compares, in the process that prints: the pairs a case's
mask allows (`allowed`), why each other pair is forbidden, and each rank's attended pairs against them (`compare`:
a `ProbeRow` per rank, a `MaskReport` per run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

import cpref
from sim import oracle
from sim.tools.verify.cases import Case, Setup, case_mask, lengths, placement
from sim.tools.verify.rank import SKIPPED

__all__ = ["ProbeRow", "MaskReport", "probe_sharding", "allowed", "compare", "pairs", "keys"]

SHOWN = 2  # queries shown per kind of wrong pair


def probe_sharding(setup: Setup, case: Case) -> cpref.Sharding:
    """The case's batch boundaries (`cases.lengths`: its documents rounded to the layout), sharded as the case is."""
    real, padded = lengths(setup, case)
    cu = lambda ns: [0, *torch.tensor(ns).cumsum(0).tolist()]  # noqa: E731  (N + 1,)
    padded_cu = cu(padded) if case.padded else None
    return cpref.Sharding(cu(real), cp_size=case.cp, layout=case.layout, cu_seqlens_padded=padded_cu)



def allowed(setup: Setup, case: Case) -> torch.Tensor:
    """`(T, T)` bool over the padded stream: the pairs the case's mask allows (padding: none)."""
    sharding, real = probe_sharding(setup, case), lengths(setup, case)[0]
    mask = case_mask(setup, case)
    if mask is not None:
        dense = oracle.slice_mask(mask.slices, sum(real))  # (T_real, T_real)
    else:
        cu = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()])  # (N + 1,)
        chunk = dict(case.variants).get("chunk")
        dense = oracle.visibility_mask(cu, causal=case.causal, window=case.window, chunk=chunk)  # (T_real, T_real)
    token = sharding.pad(torch.arange(sum(real)), value=-1)  # (T,): each stream index's real token, -1 padding
    live = token >= 0
    out = torch.zeros(sharding.total, sharding.total, dtype=torch.bool)
    out[live[:, None] & live[None, :]] = dense[token[live]][:, token[live]].flatten()  # (T, T)
    return out


def _why(setup: Setup, case: Case, ok: torch.Tensor) -> torch.Tensor:
    """`(T, T)` int8 over the padded stream: why each pair is forbidden, an index of `WHY` (0 where `ok`, allowed)."""
    sharding, real = probe_sharding(setup, case), lengths(setup, case)[0]
    token = sharding.pad(torch.arange(sum(real)), value=-1)  # (T,)
    cu, T = torch.tensor(sharding.cu_seqlens_padded), sharding.total  # (N + 1,)
    doc = torch.bucketize(torch.arange(T), cu[1:], right=True)  # (T,)
    pos = torch.arange(T) - cu[doc]  # (T,): position in its document
    why = torch.full((T, T), WHY.index("outside the mask" if case.mask else "outside the window"), dtype=torch.int8)
    chunk = dict(case.variants).get("chunk")
    if chunk is not None and case.mask is None:  # the latest reason written wins
        why[(pos[:, None] // chunk) != (pos[None, :] // chunk)] = WHY.index("outside the chunk")
    if case.causal and case.mask is None:
        why[pos[None, :] > pos[:, None]] = WHY.index("after the query")
    if case.mask is None:
        why[doc[:, None] != doc[None, :]] = WHY.index("across documents")
    why[:, token < 0] = WHY.index("on padding keys")
    why[ok] = 0
    return why


WHY = ("", "across documents", "after the query", "outside the chunk", "outside the window", "outside the mask",
       "on padding keys")  # fmt: skip


@dataclass
class ProbeRow:
    """One rank's pattern in one case.

    Attributes:
        case: the case.
        rank: the world rank; `dp`, `cp_rank`: its CP group and its rank in it.
        attended: pairs its real queries attended.
        wrong: `{why: (count, examples)}` of the pairs attended that the mask forbids (`WHY`).
        missed: `(count, examples)` of the pairs the mask allows that some head did not attend.
        note: why there is no pattern to read (an output that is not a tensor of `(T / P, Hq, T)`), else `""`.
    """

    case: Case
    rank: int
    dp: int
    cp_rank: int
    attended: int = 0
    wrong: dict[str, tuple[int, str]] = field(default_factory=dict)
    missed: tuple[int, str] = (0, "")
    note: str = ""

    @property
    def skipped(self) -> bool:
        """Whether the implementation refused the case (`NotImplementedError`): not probed, and no failure."""
        return self.note.startswith(SKIPPED)

    @property
    def ok(self) -> bool:
        """Whether the rank attended exactly the pairs the mask allows (or the case was skipped)."""
        return self.skipped or (not self.note and not self.wrong and not self.missed[0])

    def format(self, groups: bool = False) -> str:
        """`rank 1: FAIL: 96 pairs outside the window (query 40 saw keys 0..7); none missed`."""
        who = f"rank {self.rank}" + (f" (CP group {self.dp}, r {self.cp_rank})" if groups else "")
        if self.skipped:
            return f"{who}: {self.note}"
        if self.note:
            return f"{who}: FAIL: {self.note}"
        if self.ok:
            return f"{who}: pass: {self.attended} pairs attended, every one the mask allows, none missed"
        parts = [f"{pairs(n)} {why} ({ex})" for why, (n, ex) in self.wrong.items()] or ["no pair forbidden"]
        n, ex = self.missed
        return f"{who}: FAIL: " + ", ".join(parts) + (f"; {pairs(n)} missed ({ex})" if n else "; none missed")


def pairs(n: int) -> str:
    """`1 pair`, `96 pairs`."""
    return f"{n} pair{'s' * (n != 1)}"


def keys(ys: Sequence[int], most: int = 4) -> str:
    """Key indices as runs: `keys 0..7, 12`; `key 3` for one.

    Example:
        >>> keys([0, 1, 2, 5, 7, 8]), keys([3])
        ('keys 0..2, 5, 7..8', 'key 3')
    """
    runs: list[list[int]] = []
    for y in ys:
        if runs and y == runs[-1][1] + 1:
            runs[-1][1] = y
        else:
            runs.append([y, y])
    text = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs[:most]) + (", ..." if len(runs) > most else "")
    return ("keys " if len(ys) > 1 else "key ") + text


def _examples(pairs: torch.Tensor, query: torch.Tensor, token: torch.Tensor, verb: str) -> str:
    """The first `SHOWN` queries of `pairs` (`(Tq, T)` bool over the stream's keys; `query` each row's real index)
    and their keys, in real indices (`token`: each stream index's, -1 for padding)."""
    shown, rows = [], pairs.any(1).nonzero().flatten().tolist()
    for i in rows[:SHOWN]:
        ys = token[pairs[i]]  # the keys' real indices, -1 for padding
        real, pad = ys[ys >= 0].tolist(), int((ys < 0).sum())
        text = ", ".join(([keys(real)] if real else []) + ([f"{pad} padding key{'s' * (pad > 1)}"] if pad else []))
        shown.append(f"query {int(query[i])} {verb} {text}")
    return "; ".join(shown) + ("; ..." if len(rows) > SHOWN else "")


def compare(setup: Setup, case: Case, rank: int, world: int, out: torch.Tensor | None, note: str = "") -> ProbeRow:
    """World rank `rank`'s output (of a world of `world` ranks) against the mask's pairs: its `ProbeRow`."""
    sharding = probe_sharding(setup, case)
    dp, r = placement(rank, world, case.cp, case.strided)
    row = ProbeRow(case, rank, dp, r)
    T, rows = sharding.total, sharding.global_index(r)  # (T / P,)
    want = (rows.numel(), setup.heads[0], T)
    if out is None or tuple(out.shape) != want:
        row.note = note if note.startswith(SKIPPED) else f"an output that {note}" if note else \
            f"an output of shape {tuple(out.shape)}, not {want}"  # fmt: skip
        return row
    token = sharding.pad(torch.arange(sharding.cu_seqlens[-1]), value=-1)  # (T,): real index, -1 padding
    local = (token[rows] >= 0).nonzero().flatten()  # (Tq,): the rank's real queries, as rows of its output
    local = local[token[rows[local]].argsort()]  # (Tq,): in the order of the real batch
    mine = rows[local]  # (Tq,): their stream indices
    # o_xy = [x sees y] / n_x >= 1 / T where seen, 0 where not
    seen = out[local].double() > 0.5 / T  # (Tq, Hq, T)
    some, every = seen.any(1), seen.all(1)  # (Tq, T): attended by some head, by every head
    ok = allowed(setup, case)  # (T, T)
    ok, why = ok[mine], _why(setup, case, ok)[mine]  # (Tq, T)
    query = token[mine]  # (Tq,): their real indices
    row.attended = int(some.sum())
    for w in range(1, len(WHY)):
        bad = some & ~ok & (why == w)  # (Tq, T)
        if bad.any():
            row.wrong[WHY[w]] = (int(bad.sum()), _examples(bad, query, token, "saw"))
    lost = ok & ~every  # (Tq, T)
    row.missed = (int(lost.sum()), _examples(lost, query, token, "did not see") if lost.any() else "")
    return row


@dataclass
class MaskReport:
    """Every rank's pattern in every case, in case order then world rank order."""

    setup: Setup
    rows: list[ProbeRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every rank of every case attended exactly the pairs its mask allows."""
        return bool(self.rows) and all(r.ok for r in self.rows)

    def format(self) -> str:
        """A heading per case (its label, the implementation, `T` and the documents), a line per rank, then a count."""
        lines, groups = [], any(r.dp for r in self.rows)
        for i, row in enumerate(self.rows):
            if i == 0 or row.case is not self.rows[i - 1].case:
                real, padded = lengths(self.setup, row.case)
                docs = ",".join(map(str, real)) + (" padded to " + ",".join(map(str, padded))) * row.case.padded
                impl = "" if row.case.impl == "cpref" else f" ({row.case.impl})"
                lines.append(f"mask probe {row.case.label.removesuffix('/' + row.case.impl)}{impl}: T={sum(padded)}, "
                             f"documents {docs}")  # fmt: skip
            lines.append("  " + row.format(groups))
        bad, skipped = sum(not r.ok for r in self.rows), sum(r.skipped for r in self.rows)
        lines.append(f"{len(self.rows) - bad - skipped} of {len(self.rows)} rank rows attend the mask's pairs exactly"
                     + (f"; {bad} FAIL" if bad else "") + (f"; {skipped} skipped" if skipped else ""))  # fmt: skip
        return "\n".join(lines)


