r"""Per-step metadata of ring attention on packed documents: which queries see which keys at step `t`.

At ring step `t` rank `r` holds its own queries and the K/V block that started on rank
$r' = (r - t) \bmod P$. Both buffers hold, document by document, the rank's chunks of that
document (`cpref.batch.layout.chunk_ids`), so a document occupies the same rows in every rank's
buffer. For every document, query chunk $j$ and key chunk $j'$ relate in one of three ways:

* **full**: every query sees every key (without a causal mask, or when $j' < j$);
* **diagonal**: $j' = j$, the chunk against itself, causally;
* **none**: $j' > j$ under a causal mask.

A step's plan groups the rank's query chunks of each document by the key chunks they see
(consecutive query chunks that see the same full chunks share one sequence), orders each
group's key chunks as the sender holds them, and puts every sequence of every document into
**one** varlen kernel call. The call is causal if some pair is diagonal (only at `t = 0`,
where the block is the rank's own), and full otherwise, which is why the kernel contract's
single `causal` flag suffices.

| layout | own block (`t = 0`) | earlier rank ($r' < r$) | later rank ($r' > r$) |
| --- | --- | --- | --- |
| contiguous | chunk $r$ causally | chunk $r$ against chunk $r'$, full | nothing: skipped |
| zigzag | front against front; back against front + back, causal | both local chunks against the sender's front, full | the local back against both sender chunks, full |
| any, not causal | everything, full | everything, full | everything, full |

**Zigzag balance per step.** With chunks of $c$ tokens, every step $t \ge 1$ computes
$2c \cdot c$ scores per document on *every* rank (both chunks against one, or one against
both): exactly half of the $2c \times 2c$ block. Step 0 computes $2c^2 + c$ exact scores (the
diagonal's halves), again on every rank. Contiguous causal ring gives rank `r` work at
`r + 1` steps only.

**Key rows.** Every key set is a prefix of the sender's chunks of the document (a query
chunk sees sender chunk $2P-1-r'$ only if it also sees chunk $r'$), so a sequence's keys are
contiguous rows. Where the sequences of a step use disjoint, increasing key ranges, the
kernel reads the block as it arrived, and unused key rows become sequences with no queries;
only the zigzag own block (front and back both see the front) needs its keys selected with
an index, duplicating the front chunk.

**Padding** (`cu_seqlens_padded`): padding is a suffix of its document, so the real queries
of a group and the real keys of a key set are prefixes of them. A sequence takes the real
queries against the real keys; padding queries form a sequence with no keys; padding keys
are seen by nobody.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from cpref.batch.layout import chunk_ids
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import NO_WINDOW, Varlen

__all__ = ["RingCall", "RingStep", "RingPlan", "Halo", "build_ring_plan"]


@dataclass(frozen=True)
class RingCall:
    """One kernel call of a ring step.

    Attributes:
        seqs: its sequences over the rank's queries and the selected keys of the block.
        causal: its mask.
        kv_index: rows of the block to select, in order (None: the block as it is).
        window: its sliding window (`(-1, -1)`: none).
    """

    seqs: Varlen
    causal: bool
    kv_index: torch.Tensor | None
    window: tuple[int, int] = NO_WINDOW

    @property
    def work(self) -> int:
        """Exact score entries per head the call computes."""
        return self.seqs.work(self.causal, self.window)


@dataclass(frozen=True)
class RingStep:
    """One ring step of one rank.

    Attributes:
        source: the rank whose K/V block is held at this step, `(r - t) mod P`.
        calls: its kernel calls (none: the step is skipped; two: a window that reaches both of
            the sender's chunks of a document, which are not adjacent).
    """

    source: int
    calls: tuple[RingCall, ...]

    @property
    def work(self) -> int:
        """Exact score entries per head the step computes."""
        return sum(call.work for call in self.calls)


@dataclass(frozen=True)
class Halo:
    """Which rows of a block travel, and to whom, when only some are read (a sliding window,
    `cpref.modes.ring_window`): step `t` holds the rows `R_d` of the block of rank `r - d`, `d = shifts[t]`.

    Attributes:
        shifts: per step, its distance `d` (0: the own block, then the distances the window reaches, increasing).
        send: per step `t >= 1`, the positions in the own block of the rows rank `r + d` reads, `R_d(r)`: what
            the forward sends there, and where the share that comes back is added (None at `t = 0`).
        sizes: per step, the rows every rank's shift carries, the largest `|R_d|` of any block (a shift moves
            the same shape on every rank); the rows past a block's own `R_d` are zeros (0 at `t = 0`).
    """

    shifts: tuple[int, ...]
    send: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class RingPlan:
    """The steps of one rank (immutable, shared by the cache): `P`, or as many as a window reaches.

    Attributes:
        steps: step `t` holds the block of rank `(r - t) mod P`.
        halo: None: every step holds the whole block (the classic ring); else which rows travel, to whom.
    """

    steps: tuple[RingStep, ...]
    halo: Halo | None = None

    @property
    def whole_rows(self) -> bool:
        """Whether one kernel call sees every key of every row: a ring of one (the classic one, or one member's over
        pieces, `cpref.modes.ring_window`), no merge, no send."""
        return (self.halo is None and len(self.steps) == 1 and len(self.steps[0].calls) == 1
                and self.steps[0].calls[0].kv_index is None)  # fmt: skip


def _doc_sequences(b: Boundaries, i: int, mult: int, mine: list[int], theirs: list[int], causal: bool):
    """`(q_len, k_start, k_len, diagonal)` of document `i`, key rows relative to the document."""
    c = b.padded_len(i) // mult
    out = []
    groups: list[tuple[list[int], tuple[int, ...], bool]] = []
    for j in mine:  # each local query chunk: the sender chunks it sees, in the sender's order
        seen = tuple(jj for jj in theirs if not causal or jj <= j)
        diag = causal and j in seen  # then j is the last chunk it sees
        if groups and groups[-1][1] == seen and not diag and not groups[-1][2]:
            groups[-1][0].append(j)  # the same full key chunks as the previous chunk: one sequence
        else:
            groups.append(([j], seen, diag))
    for qs, seen, diag in groups:
        rq = sum(b.real_in(i, j * c, (j + 1) * c) for j in qs)
        rk = sum(b.real_in(i, jj * c, (jj + 1) * c) for jj in seen)
        if rq and rk:
            out.append((rq, 0, rk, diag))  # keys: a prefix of the sender's chunks of the document
        blind = len(qs) * c - (rq if rk else 0)  # padding queries, or all if the group sees no key here
        if blind:
            out.append((blind, 0, 0, False))
    return out


def _step(b: Boundaries, P: int, mult: int, rank: int, source: int, layout: str, causal: bool, device) -> RingStep:
    mine, theirs = chunk_ids(rank, P, layout), chunk_ids(source, P, layout)
    seqs, offset = [], 0  # (q_len, absolute key start, k_len); offset of the document in every buffer
    for i in range(b.num_docs):
        seqs += [(q, offset + k0, k, d) for q, k0, k, d in _doc_sequences(b, i, mult, mine, theirs, causal)]
        offset += len(mine) * (b.padded_len(i) // mult)
    is_causal = any(d for *_, d in seqs)
    q_lens = [q for q, *_ in seqs]
    if not any(q and k for q, _, k, _ in seqs):
        return RingStep(source, ())
    # keys straight from the block where the key ranges are disjoint and increasing, else selected
    starts = [k0 for _, k0, k, _ in seqs if k]
    ends = [k0 + k for _, k0, k, _ in seqs if k]
    if all(e <= s for e, s in zip(ends, starts[1:])):
        cu_q, cu_kv, pos = [0], [0], 0
        for q, k0, k, _ in seqs:
            if k and k0 > pos:  # key rows nobody here sees: a sequence without queries
                cu_q.append(cu_q[-1])
                cu_kv.append(k0)
            cu_q.append(cu_q[-1] + q)
            cu_kv.append(k0 + k if k else cu_kv[-1])
            pos = cu_kv[-1]
        if pos < offset:
            cu_q.append(cu_q[-1])
            cu_kv.append(offset)
        varlen, kv_index = Varlen(cu_q, cu_kv), None
    else:
        rows = [torch.arange(k0, k0 + k) for _, k0, k, _ in seqs if k]
        kv_index = torch.cat(rows).to(device)  # (sum k_len,) rows of the block, duplicated where shared
        varlen = Varlen([0, *accumulate(q_lens)], [0, *accumulate(k for _, _, k, _ in seqs)])
    return RingStep(source, (RingCall(varlen, is_causal, kv_index),))


def build_ring_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, device: torch.device) -> RingPlan:
    """The steps `t = 0 .. P-1` of rank `rank`: step `t` holds the block of rank `(rank - t) mod P`."""
    mult = b.check_divisible(layout, P)
    return RingPlan(tuple(_step(b, P, mult, rank, (rank - t) % P, layout, causal, device) for t in range(P)))
