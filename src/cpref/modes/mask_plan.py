r"""A mask in the modes: the kernel calls of a block of queries against a block of keys.

Every mode, under any mask, comes down to one question asked again and again: this rank holds
these query rows, a buffer holds these key rows (its own block, a ring step's block, the
all-gathered stream, a Ulysses head group's whole stream); which kernel calls compute exactly the
pairs the mask shows between them? This module answers it once, for every mode.

**Rows as runs.** A rank's rows are the layout's pieces in local order, each a run of real tokens
of one document followed by its padding ([`runs`][cpref.modes.mask_plan.runs]): local rows
$[\rho, \rho + n)$ hold the real tokens $[g, g + n)$ of the batch. Padding rows are in no run and
see nothing.

**Slices meet runs.** A normalised slice ([`cpref.batch.mask`][cpref.batch.mask]) is a rectangle cut
by a band, $d_{lo} \le y - x \le d_{hi}$ in global indices. Cut by a query run and a key run it is
a smaller rectangle with the same band, trimmed to the rows that see a key and the keys a row
sees: one **sequence** of a kernel call, whose local query $i$ and key $j$ stand at $x = x_0 + i$
and $y = y_0 + j$. The kernel contract says "query $i$ at key position $p = i + \delta$ sees
$p - \ell \le j \le p + r$", so with $o = y_0 - x_0$:

| band | kernel call | shift $\delta$ |
| --- | --- | --- |
| none, or every pair of the rectangle inside it | full, `window=(-1, -1)` | (any) |
| $y - x \le d_{hi}$ | `causal=True` | $d_{hi} - o$ |
| $y - x \ge d_{lo}$ | `window=(0, -1)` | $d_{lo} - o$ |
| both | `causal=True, window=(d_{hi} - d_{lo}, 0)` | $d_{hi} - o$ |

No dense mask is ever built: a mask is a handful of sequences with shifts, and the kernel's work
is the mask's visible pairs.

**Calls.** The contract has one `causal` and one `window` per call, and each query row in at most
one sequence of it, its rows in order. So the sequences are grouped by their (causal, window), and
a group whose sequences share query rows (a row seeing two key runs, or two slices of one kind) is
split into **layers**, each row at most once per layer
([`mask_calls`][cpref.modes.mask_plan.mask_calls]). Each layer is one call over all the rank's
query rows in order (rows it does not reach are sequences without keys) and the key rows it
reads, selected from the buffer; the calls' partial results merge by lse, as a ring's steps do.
A causal document over its own rows is one sequence of one call, as without a mask.

**In each mode.** `p2p` is a ring over the ranks whose plan ([`mask_ring_plan`][cpref.modes.mask_plan.mask_ring_plan])
keeps only the distances at which some rank reads a key of the block that many ranks back, and
sends of each block only the rows read: the windowed ring's halo
([`cpref.modes.ring_window`][cpref.modes.ring_window]), so the traffic is the mask's. `all_gather`
gathers only the rows another rank reads ([`cpref.modes.all_gather_mask`][cpref.modes.all_gather_mask]).
`a2a` exchanges heads for tokens as always, then runs the mask's calls over the whole stream as it
arrived, rank-major (the calls read rows where they are: no permutation), and `a2a+p2p` the same
inside each a2a group, then the masked ring across the groups (each member's buffer its group's
shards, rank-major, [`stacked_runs`][cpref.modes.mask_plan.stacked_runs]). Learnable sinks enter once,
after the calls' merge; soft-capping is the kernel's.

How it is tested: `tests/cp/test_masks.py` runs every mode, layout and CP size under five masks
(prefix-LM, image spans, shared prompts, a window written as slices, random overlapping slices of
all four kinds) with GQA, MLA, padding, sinks and soft-capping against the FP64 oracle rank by
rank, forward and backward; counts each rank's kernel work against the mask's pairs of its rows;
and holds the ring's and the all-gather's bytes to the rows the oracle's matrix says are read.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import NamedTuple, Sequence

import torch

from cpref.batch import mask_union
from cpref.batch.layout import local_chunks
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import NO_WINDOW, Varlen
from cpref.modes.ring_plan import RingCall, RingPlan, RingStep
from cpref.modes.ring_window import halo_ring_plan, reading_the_block

__all__ = ["Run", "Call", "runs", "stacked_runs", "sequences", "mask_calls", "visible", "mask_ring_plan"]


class Run(NamedTuple):
    """Local rows `[row, row + n)` holding the real tokens `[start, start + n)` of the batch."""

    row: int
    start: int
    n: int


class Call(NamedTuple):
    """One kernel call: `seqs` over every query row in order and the key rows `rows` of the buffer, selected in
    order; its `causal` and `window`."""

    seqs: Varlen
    rows: torch.Tensor
    causal: bool
    window: tuple[int, int]


def runs(b: Boundaries, pieces: Sequence[tuple[int, int, int]]) -> list[Run]:
    """The runs of real tokens of a buffer holding `pieces` (`(doc, start, end)` in the padded stream, local order,
    `cpref.batch.layout.local_chunks`): each piece's real part, consecutive ones joined."""
    out: list[Run] = []
    row = 0
    for doc, s, e in pieces:
        n = b.real_in(doc, s - b.padded[doc], e - b.padded[doc])  # the piece's real tokens: a prefix of it
        start = b.real[doc] + s - b.padded[doc]
        if n > 0:
            if out and out[-1].row + out[-1].n == row and out[-1].start + out[-1].n == start:
                out[-1] = Run(out[-1].row, out[-1].start, out[-1].n + n)
            else:
                out.append(Run(row, start, n))
        row += e - s
    return out


def stacked_runs(b: Boundaries, P: int, layout: str, ranks: Sequence[int]) -> tuple[list[Run], int]:
    """`(runs, rows)` of a buffer holding the shards of `ranks` one after the other (each of `T / P` rows): a rank's
    own shard, or an all-to-all group's gathered tokens, rank-major."""
    t_l, out = b.total // P, []
    for j, r in enumerate(ranks):
        out += [Run(run.row + j * t_l, run.start, run.n) for run in runs(b, local_chunks(b, cp_size=P, rank=r, layout=layout))]
    return out, t_l * len(ranks)


Cls = tuple[bool, tuple[int, int]]  # (causal, window) of a call


def _sequence(q0: int, q1: int, k0: int, k1: int, d_lo: int | None, d_hi: int | None):
    """The rectangle `[q0, q1) x [k0, k1)` cut by the band, trimmed to the rows that see a key and the keys some row
    sees: `(q0, q1, k0, k1, class, shift)`, or None where no pair is left."""
    lo, hi = -(1 << 62) if d_lo is None else d_lo, (1 << 62) if d_hi is None else d_hi
    q0, q1 = max(q0, k0 - hi), min(q1, k1 - lo)  # rows x with some y in [k0, k1): x + lo <= k1 - 1, x + hi >= k0
    if q0 >= q1:
        return None
    k0, k1 = max(k0, q0 + lo), min(k1, q1 - 1 + hi + 1)  # keys some row of [q0, q1) sees
    if k0 >= k1:
        return None
    o = k0 - q0
    whole_lo = d_lo is None or k0 - (q1 - 1) >= d_lo  # every pair of the rectangle inside the band's low side
    whole_hi = d_hi is None or (k1 - 1) - q0 <= d_hi
    if whole_lo and whole_hi:
        return q0, q1, k0, k1, (False, NO_WINDOW), (k1 - k0) - (q1 - q0)  # full (bottom-right shift: the default)
    if whole_lo:
        return q0, q1, k0, k1, (True, NO_WINDOW), d_hi - o
    if whole_hi:
        return q0, q1, k0, k1, (False, (0, -1)), d_lo - o
    return q0, q1, k0, k1, (True, (d_hi - d_lo, 0)), d_hi - o


def sequences(slices: Sequence[tuple], q_runs: Sequence[Run], k_runs: Sequence[Run]) -> list[tuple]:
    """Every sequence of the mask's `slices` between the query runs and the key runs: `(class, q_row, n_q, k_row,
    n_k, shift)`, local rows (module docstring)."""
    by_q = sorted(slices)
    q_starts = [sl[0] for sl in by_q]
    reach = list(accumulate((sl[1] for sl in by_q), max))  # the furthest q_end among the slices so far
    k_runs = sorted(k_runs, key=lambda r: r.start)  # disjoint in the batch: searched by start
    k_starts = [r.start for r in k_runs]
    out = []
    for qr in q_runs:
        gs, ge = qr.start, qr.start + qr.n
        for q0, q1, k0, k1, kind in by_q[bisect_right(reach, gs) : bisect_left(q_starts, ge)]:
            if q1 <= gs:
                continue
            d_lo, d_hi = mask_union.band(q0, q1, k0, k1, kind)
            for kr in k_runs[max(0, bisect_right(k_starts, k0) - 1) : bisect_left(k_starts, k1)]:
                seq = _sequence(max(q0, gs), min(q1, ge), max(k0, kr.start), min(k1, kr.start + kr.n), d_lo, d_hi)
                if seq is not None:
                    a, z, ka, kz, cls, shift = seq
                    out.append((cls, qr.row + a - gs, z - a, kr.row + ka - kr.start, kz - ka, shift))
    return out


def mask_calls(slices: Sequence[tuple], q_runs: Sequence[Run], k_runs: Sequence[Run], n_rows: int,
               device: torch.device | str = "cpu") -> list[Call]:  # fmt: skip
    """The kernel calls of the mask between a buffer of `n_rows` query rows and a buffer of keys (module docstring):
    per class of sequences, one call per layer, each query row at most once in a layer, in order."""
    groups: dict[Cls, list[tuple]] = {}
    for cls, *seq in sorted(sequences(slices, q_runs, k_runs), key=lambda s: (s[1], s[3])):
        groups.setdefault(cls, []).append(seq)
    calls = []
    for cls in sorted(groups):
        layers: list[list[tuple]] = []
        for seq in groups[cls]:  # in query order: the first layer whose last sequence ends before this one starts
            layer = next((la for la in layers if la[-1][0] + la[-1][1] <= seq[0]), None)
            if layer is None:
                layers.append([seq])
            else:
                layer.append(seq)
        calls += [_call(layer, cls, n_rows, device) for layer in layers]
    return calls


def _call(layer: list[tuple], cls: Cls, n_rows: int, device) -> Call:
    """One layer as a call over every query row in order: the gaps as sequences without keys."""
    lens, rows, cursor = [], [], 0  # (q_len, kv_len, shift) per sequence
    for q_row, n_q, k_row, n_k, shift in layer:
        if q_row > cursor:
            lens.append((q_row - cursor, 0, 0))
        lens.append((n_q, n_k, shift))
        rows.append(torch.arange(k_row, k_row + n_k))
        cursor = q_row + n_q
    if n_rows > cursor:
        lens.append((n_rows - cursor, 0, 0))
    q_lens, kv_lens, shifts = zip(*lens)
    seqs = Varlen.from_lengths(q_lens, kv_lens, shifts)
    return Call(seqs, torch.cat(rows).to(device), cls[0], cls[1])


def visible(calls: Sequence[Call]) -> int:
    """The pairs the calls compute, per head: the work of a block under the mask."""
    return sum(c.seqs.work(c.causal, c.window) for c in calls)


def mask_ring_plan(slices: Sequence[tuple], members: Sequence[tuple[list[Run], int]], rank: int,
                   device: torch.device | str) -> RingPlan:  # fmt: skip
    """Ring member `rank`'s plan under a mask: `members[r]` is `(runs, rows)` of member `r`'s buffer (`stacked_runs`).
    Step 0 attends the own block; then only the distances at which some member's queries see a key of the block
    `d` members back, and of each block only the rows read travel (`cpref.modes.ring_window`'s halo): the traffic
    follows the mask. A ring of one member is one step over its own rows, no communication."""
    P = len(members)
    cache: dict[tuple[int, int], list[Call]] = {}

    def calls_of(r: int, s: int) -> list[tuple]:
        if (r, s) not in cache:
            cache[(r, s)] = mask_calls(slices, members[r][0], members[s][0], members[r][1])
        return [(c.seqs, c.rows, c.causal, c.window) for c in cache[(r, s)]]

    if P == 1:
        calls = calls_of(0, 0)
        if len(calls) == 1 and (whole := reading_the_block(calls[0][0], calls[0][1], members[0][1])) is not None:
            calls = [(whole, None, calls[0][2], calls[0][3])]  # the block as it is: one call that sees whole rows
        return RingPlan((RingStep(0, tuple(RingCall(seqs, causal, None if rows is None else rows.to(device), window)
                                           for seqs, rows, causal, window in calls)),))  # fmt: skip
    halo = {}
    for d in range(1, P):  # the rows each block sends at distance d: what its reader, d members on, reads of it
        sizes = [len(torch.unique(torch.cat([rows for _, rows, _, _ in calls_of((s + d) % P, s)])))
                 if calls_of((s + d) % P, s) else 0 for s in range(P)]  # fmt: skip
        if any(sizes):
            halo[d] = sizes
    return halo_ring_plan(calls_of, P, rank, halo, device)
