r"""The union of mask slices, as disjoint slices of the four kinds: how `cpref.Mask` normalises what it is given.

A slice $(q_0, q_1, k_0, k_1, \text{kind})$ is a rectangle of the $T \times T$ score matrix cut by
one or two diagonals. In **global** indices (query $x$, key $y$), with $L_q = q_1 - q_0$ and
$L_k = k_1 - k_0$, its four kinds are

| kind | query $x$ sees key $y$ iff, besides $q_0 \le x < q_1$ and $k_0 \le y < k_1$ |
| --- | --- |
| `full` | always |
| `causal` | $y - x \le k_1 - q_1$ (bottom-right: local $j \le i + L_k - L_q$) |
| `inv_causal` | $y - x \ge k_0 - q_0$ (top-left: local $j \ge i$) |
| `bi_causal` | both |

so every slice is a rectangle intersected with a **band** $d_{lo} \le y - x \le d_{hi}$ (a side
unbounded for the kinds without it). In row $x$ it shows the keys

$$ \mathrm{lo}(x) = \max(k_0, x + d_{lo}), \qquad \mathrm{hi}(x) = \min(k_1 - 1, x + d_{hi}) , $$

each end either a constant or $x$ plus a constant. On rows where neither end changes its form,
a slice is an **atom**: an interval whose ends move with slope 0 or 1 ([`atoms`][cpref.batch.mask_union.atoms]).

**The union.** Between consecutive rows where an atom starts or ends, the same atoms are active;
where two of their ends cross (a slope-1 end meets a constant one) the order of the ends
changes, so those rows are cut too. Between cuts the union of the active intervals has a fixed
shape: sorted by their low end, an interval joins the one before it iff it starts at most one
key after the other ends, and the union's ends are the lowest low end and the highest high end
of each run. Each run is a **piece**: rows $[s, e)$ and the forms of its two ends
([`pieces`][cpref.batch.mask_union.pieces]).

**Merging rows.** A row's interval *continues* the one above it when each end moves by 0 or 1
key; continuing rows form chains ([`runs`][cpref.batch.mask_union.runs]), and a chain is cut where
its step changes. The row where two steps meet fits both runs (the last row of a prefix-LM's
prompt sees exactly what a causal row there would), so where it goes is chosen, the same way
whatever the mask was built from: the fewest slices, then the fewest whose low end moves, then
the most rows in `full` slices, then the earlier run. The causal document that an image span
interrupts is one slice above the span and one below it, a prompt's last row stays with the
prompt, and a dense causal mask read row by row is one causal slice again. A run is written as
the kind its slopes give ([`canonical`][cpref.batch.mask_union.canonical]): both ends constant,
`full` (so is a run of one row); the high end moving, `causal`; the low end, `inv_causal`; both,
`bi_causal`, with the rectangle that puts the kind's diagonals on the run's ends.

Every pair a slice shows is in exactly one output slice, and nothing else is: the output is the
same set of pairs, without overlaps, and the same slices for the same pairs however they were
given (tested against `sim.oracle.slice_mask`, the kinds' definitions pair by pair, and against
the same mask read row by row from its dense matrix).
"""

from __future__ import annotations

import heapq
from typing import Iterable, NamedTuple

__all__ = ["KINDS", "Atom", "Piece", "band", "atoms", "pieces", "runs", "canonical", "normalise"]

KINDS = ("full", "causal", "inv_causal", "bi_causal")
Form = tuple[int, int]  # (slope, c): the value c + slope * x, slope 0 or 1


class Atom(NamedTuple):
    """Rows `[a, b)` in which an interval's ends have fixed forms and the interval is never empty."""

    a: int
    b: int
    lo: Form
    hi: Form


class Piece(NamedTuple):
    """Rows `[a, b)` of the union whose keys are `[lo(x), hi(x)]` (inclusive ends, `Form`s)."""

    a: int
    b: int
    lo: Form
    hi: Form


def _at(form: Form, x: int) -> int:
    return form[1] + form[0] * x


def band(q0: int, q1: int, k0: int, k1: int, kind: str) -> tuple[int | None, int | None]:
    """`(d_lo, d_hi)` of a slice: it shows `d_lo <= y - x <= d_hi` (None: unbounded), see the table above."""
    lo = k0 - q0 if kind in ("inv_causal", "bi_causal") else None
    hi = k1 - q1 if kind in ("causal", "bi_causal") else None
    return lo, hi


def atoms(q0: int, q1: int, k0: int, k1: int, kind: str) -> list[Atom]:
    """A slice's rows cut where an end changes form, without its empty rows (at most three atoms)."""
    d_lo, d_hi = band(q0, q1, k0, k1, kind)
    cuts = {q0, q1}
    if d_lo is not None:
        cuts.add(min(max(k0 - d_lo, q0), q1))  # lo is x + d_lo from here (ties take the moving form)
    if d_hi is not None:
        cuts.add(min(max(k1 - d_hi, q0), q1))  # hi is x + d_hi before here
    edges, out = sorted(cuts), []
    for start, end in zip(edges, edges[1:]):
        lo: Form = (0, k0) if d_lo is None or start < k0 - d_lo else (1, d_lo)
        hi: Form = (0, k1 - 1) if d_hi is None or start >= k1 - d_hi else (1, d_hi)
        # hi(x) - lo(x) = slope * x + c >= 0 on the rows kept
        slope, c = hi[0] - lo[0], hi[1] - lo[1]
        a = max(start, -c) if slope > 0 else start
        b = min(end, c + 1) if slope < 0 else end
        if a < b and (slope != 0 or c >= 0):
            out.append(Atom(a, b, lo, hi))
    return out


def _crossings(active: list[Atom], s: int, e: int) -> set[int]:
    """Rows in `(s, e)` where the order of two active ends changes (a slope-1 end meets a constant one)."""
    ends = [(atom.lo, atom.hi) for atom in active]
    out = set()
    for i, (lo_i, hi_i) in enumerate(ends):
        for lo_j, hi_j in ends[i + 1 :]:
            # which low end is lower, which high end higher, whether one interval reaches the other (hi + 1)
            for f, g, gap in ((lo_i, lo_j, 0), (hi_i, hi_j, 0), (lo_j, hi_i, 1), (lo_i, hi_j, 1)):
                if f[0] != g[0]:
                    root = (g[1] + gap - f[1]) // (f[0] - g[0]) if f[0] > g[0] else (f[1] - g[1] - gap) // (g[0] - f[0])
                    out.update(x for x in (root, root + 1) if s < x < e)
    return out


def _union(active: list[Atom], s: int, e: int) -> Iterable[Piece]:
    """The union of the active atoms on rows `[s, e)`, where its shape does not change (see the module docstring)."""
    last = e - 1
    order = sorted(active, key=lambda t: (_at(t.lo, s), _at(t.lo, last)))
    lo, hi = order[0].lo, order[0].hi
    for atom in order[1:]:
        if _at(atom.lo, s) <= _at(hi, s) + 1:  # reaches the run: joins it
            hi = max(hi, atom.hi, key=lambda f: (_at(f, s), _at(f, last)))
        else:
            yield Piece(s, e, lo, hi)
            lo, hi = atom.lo, atom.hi
    yield Piece(s, e, lo, hi)


def pieces(slices: Iterable[tuple[int, int, int, int, str]]) -> list[Piece]:
    """The union of `slices` as pieces of fixed shape, in row order (a sweep over the rows where atoms start or end)."""
    every = sorted(atom for sl in slices for atom in atoms(*sl))
    rows = sorted({atom.a for atom in every} | {atom.b for atom in every})
    out, active, ends, i = [], [], [], 0  # ends: a heap of (b, index in every) of the active atoms
    for s, e in zip(rows, rows[1:]):
        while i < len(every) and every[i].a == s:
            heapq.heappush(ends, (every[i].b, i))
            i += 1
        while ends and ends[0][0] <= s:
            heapq.heappop(ends)
        active = [every[j] for _, j in ends]
        if not active:
            continue
        cuts = sorted({s, e} | _crossings(active, s, e))
        for u, v in zip(cuts, cuts[1:]):
            out.extend(_union(active, u, v))
    return out


def _chains(parts: list[Piece]) -> list[list[Piece]]:
    """The pieces linked into chains: a piece continues into the piece whose first row's keys move by 0 or 1 at each
    end from its last row's (at most one does, and at most one continues into a piece: two intervals of a row are
    apart by a key at least)."""
    starting: dict[int, list[int]] = {}
    for i, p in enumerate(parts):
        starting.setdefault(p.a, []).append(i)
    after, before = {}, set()
    for i, p in enumerate(parts):
        lo, hi = _at(p.lo, p.b - 1), _at(p.hi, p.b - 1)
        for j in starting.get(p.b, []):
            if _at(parts[j].lo, p.b) - lo in (0, 1) and _at(parts[j].hi, p.b) - hi in (0, 1):
                after[i] = j
                before.add(j)
                break
    chains = []
    for first in range(len(parts)):
        if first not in before:
            chain, i = [parts[first]], first
            while i in after:
                i = after[i]
                chain.append(parts[i])
            chains.append(chain)
    return chains


def _blocks(chain: list[Piece]) -> list[list]:
    """A chain's steps from row to row, as blocks `[(d lo, d hi), count]` of one step repeated."""
    out: list[list] = []
    for n, p in enumerate(chain):
        steps = [((p.lo[0], p.hi[0]), p.b - p.a - 1)] if p.b - p.a > 1 else []
        if n + 1 < len(chain):  # from p's last row to the next piece's first
            q = chain[n + 1]
            steps.append(((_at(q.lo, q.a) - _at(p.lo, p.b - 1), _at(q.hi, q.a) - _at(p.hi, p.b - 1)), 1))
        for step, count in steps:
            if out and out[-1][0] == step:
                out[-1][1] += count
            else:
                out.append([step, count])
    return out


def _cost(rows: int, step: tuple[int, int]) -> tuple[int, int, int]:
    """A run's cost, compared in order: one slice; one whose low end moves (inv_causal, bi_causal); minus the rows of
    a full one (a run of one row is full)."""
    if rows == 0:
        return 0, 0, 0
    if rows == 1 or step == (0, 0):
        return 1, 0, -rows
    return 1, int(step[0] == 1), 0


def _split(blocks: list[list]) -> list[int]:
    """For each block, whether its last row (shared with the next block's first) goes down to the next block's run
    (1) or stays (0): the fewest slices, then the fewest with a moving low end, then the most rows in full slices;
    ties stay. A dynamic programme over the blocks, its state whether a block's first row went up."""
    best = {0: ((0, 0, 0), [])}  # whether this block's first row is the run above's -> (cost, choices so far)
    for j, (step, count) in enumerate(blocks):
        nxt: dict[int, tuple] = {}
        for went_up, (cost, choices) in sorted(best.items()):
            for goes_down in (0, 1) if j + 1 < len(blocks) else (0,):
                rows = count + 1 - went_up - goes_down
                if rows < 0:
                    continue
                total = tuple(x + y for x, y in zip(cost, _cost(rows, step)))
                went = 1 - goes_down  # the next block's first row is this block's last: it went up unless it went down
                option = (total, choices + [goes_down])  # equal costs: the earlier boundaries' rows stay up
                if went not in nxt or option < nxt[went]:
                    nxt[went] = option
        best = nxt
    return min(best.values())[1]


def runs(parts: Iterable[Piece]) -> list[Piece]:
    """The union's pieces cut into maximal runs of rows whose keys move by one step, the same however the rows were
    given (row by row from a dense mask, or in pieces from slices): chains of continuing rows, each cut where its
    step changes, the row two steps share going where the slices are fewest and simplest (`_split`)."""
    out = []
    for chain in _chains(sorted(parts, key=lambda p: (p.a, _at(p.lo, p.a)))):
        row, blocks = chain[0].a, _blocks(chain)
        lo, hi = _at(chain[0].lo, row), _at(chain[0].hi, row)
        if not blocks:  # a chain of one row
            out.append(Piece(row, row + 1, (0, lo), (0, hi)))
            continue
        went_up = 0
        for ((d_lo, d_hi), count), goes_down in zip(blocks, _split(blocks)):
            first, n = went_up, count + 1 - went_up - goes_down  # our first row (steps from the block's) and rows
            if n >= 1:
                a, s_lo, s_hi = row + first, (d_lo if n > 1 else 0), (d_hi if n > 1 else 0)
                lo_a, hi_a = lo + d_lo * first, hi + d_hi * first
                out.append(Piece(a, a + n, (s_lo, lo_a - s_lo * a), (s_hi, hi_a - s_hi * a)))
            row, lo, hi, went_up = row + count, lo + d_lo * count, hi + d_hi * count, 1 - goes_down
    return out


def canonical(p: Piece) -> tuple[int, int, int, int, str]:
    """A run as the slice of its kind: the rectangle whose kind's diagonals are the run's moving ends."""
    k0 = _at(p.lo, p.a)  # the first row's first key: for a moving low end, k0 - q0 = d_lo
    k1 = _at(p.hi, p.b - 1) + 1  # past the last row's last key: for a moving high end, k1 - q1 = d_hi
    return p.a, p.b, k0, k1, KINDS[(2 if p.lo[0] else 0) + (1 if p.hi[0] else 0)]


def normalise(slices: Iterable[tuple[int, int, int, int, str]]) -> tuple[tuple[int, int, int, int, str], ...]:
    """The union of `slices` (validated) as disjoint canonical slices, sorted by rows then keys."""
    return tuple(sorted(canonical(p) for p in runs(pieces(slices))))
