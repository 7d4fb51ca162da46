r"""The `balanced` layout: whole documents where they fit, zigzag cuts only where they must.

The chunked layouts cut **every** document into `P` or `2P` chunks: every document is padded
to that granularity and every document's K/V travel, even a 40-token one that one rank could
attend to alone. `balanced` (in the spirit of Megatron's dynamic CP, WLB-LLM and ByteScale)
plans the batch instead, from its boundaries and `P` alone, so every rank computes the same
plan:

1. **Capacity.** The batch is padded at its end only (`Sharding.eod_padded(..., layout="balanced")`
   pads the last document) to $T = P\,T_l$; every rank holds exactly $T_l$ tokens.
2. **Work.** A document of $n$ real tokens costs $w = n(n+1)/2$ causal scores; the mean per
   rank is $W^* = \sum_i w_i / P$.
3. **Order.** Documents are placed by decreasing $w$ (ties: by index).
4. **Cut what must be cut.** The heaviest documents are cut in zigzag pairs over $k$ ranks,
   the $k$ least loaded with room (ties: by index): $2k$ chunks as equal as integers allow (the
   spare tokens to the ranks with the most room, which keeps their room within one token), the
   $s$-th of the $k$ ranks taking chunks $s$ and $2k - 1 - s$, which gives each $1/k$ of the
   document's tokens and, as zigzag does, about $1/k$ of its work; only those $k$ ranks ever
   exchange its K/V. First every document with $w > W^*$ is cut (it would make its rank the
   slowest however the rest is placed), over $k = \lceil w / W^* \rceil$ ranks (at least 2);
   if steps 5 and 6 then leave the largest rank more than 2% above $W^*$ (`TOLERANCE`), every
   $k$ is doubled (up to `P`: a cut over few ranks leaves them little room for the whole
   documents that would balance the others), and when all are at `P`, the next heaviest
   document is cut too, and so on, until the tolerance holds or every document is cut.
5. **Keep the rest whole.** Every other document goes, whole, to the least loaded rank that has
   room for it (longest-processing-time first, the classic greedy for balancing loads).
6. **Fill.** A document that fits on no rank (the ranks are full in tokens before they are in
   work) is cut into contiguous pieces over the least loaded ranks with room, in order.
7. **Padding** (every document's tail, the batch's end included) fills what room is left, in
   rank order; a rank's pieces are then put in stream order.

Each rank's tokens are its pieces `(doc, start, end)` in stream order
([`cpref.layout.local_chunks`][cpref.layout.local_chunks]); every mode runs the layout from
them. A document held whole costs no communication in the modes that send only what is read:
the ring (`p2p` and the ring level of `a2a+p2p`: [the ring that sends only what is read][cpref.modes.ring_window])
`all_gather` ([the all-gather over pieces][cpref.modes.all_gather_pieces]) and `a2a`
([Ulysses for stream and balanced][cpref.modes.ulysses_split]).

## What it guarantees

* **Token equality**, exactly: steps 4 to 6 place every real token at most $T_l$ to a rank,
  and the padding, $P T_l - \sum_i n_i$ tokens, is exactly the room they leave.
* **Work**: the largest rank does at most $(1 + 0.02) W^*$, or every document is cut over all
  `P` ranks, and then the plan is zigzag without its per-document padding (every rank within
  integer rounding of $1/P$ of every document). Cuts over all `P` always fit: each gives every
  rank $2 \lfloor n / 2P \rfloor$ tokens and the spare ones to the ranks with the most room, so
  the ranks' room stays within one token of each other, and it never runs out before the
  tokens do.
* **Few cuts, over few ranks, greedily**: the cut documents are the shortest prefix, in
  decreasing $w$, of the documents after which the greedy meets the tolerance, each over the
  fewest ranks of the doubling that meets it; a document outside the prefix is cut only in step
  6, when at its turn no rank has $n$ tokens of room.
* **Cut documents balance themselves** over their $k$ ranks: each puts the same tokens (to one)
  and about the same work on each of them, and the whole documents are balanced by the greedy
  on top.

## Where it falls short

* The plan is greedy, not optimal: its doubling of `k` and its prefix of cut documents are a
  coarse search; a finer one (each document's own `k`, moving a few whole documents) would move
  fewer bytes for the same balance.
* The exchange level of `a2a+p2p` still exchanges every token of its group, whole documents
  included. `a2a` exchanges only the cut documents and attends to the whole ones where they are
  ([Ulysses for stream and balanced][cpref.modes.ulysses_split]), `p2p` sends only what is
  read, and `all_gather` gathers only the rows other ranks read
  ([the all-gather over pieces][cpref.modes.all_gather_pieces]), each padded to the most any
  rank sends.
* It balances the causal work of full attention; under a sliding window, or without a causal
  mask, the work of a document is another function of its length, which it does not use.
* The hierarchical mode (`a2a+p2p`) runs its ring over groups of `a` consecutive ranks, whose
  unions of pieces the plan does not balance as groups (their sums are balanced, as each
  rank's is).
"""

from __future__ import annotations

import functools
import math

from cpref.seqlens import Boundaries

__all__ = ["balanced_pieces", "piece_work", "TOLERANCE"]


def piece_work(a: int, z: int) -> int:
    """Causal scores of the queries at positions `[a, z)` of a document: $\\sum_{p=a}^{z-1} (p + 1)$."""
    return (z * (z + 1) - a * (a + 1)) // 2


TOLERANCE = 0.02  # the largest rank's causal work may exceed the mean by this fraction


@functools.lru_cache(maxsize=64)
def balanced_pieces(b: Boundaries, P: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per rank, the pieces `(doc, start, end)` it holds, in stream order, `[start, end)` in the padded
    stream (the module docstring's plan). The batch's length must be a multiple of `P`."""
    b.check_divisible("balanced", P)
    works = [piece_work(0, b.real_len(i)) for i in range(b.num_docs)]
    mean = sum(works) / P  # W*
    order = sorted(range(b.num_docs), key=lambda i: (-works[i], i))  # the heaviest first
    cut = sum(w > mean for w in works)  # 4) at least every document heavier than a rank's share
    while True:
        spread = 1
        while True:  # each cut document over k = spread ceil(w / W*) ranks (at least 2, at most P)
            ks = [min(P, max(2, spread * math.ceil(works[doc] / mean))) for doc in order[:cut]]
            held, load, room = _place(b, P, order, ks)
            if max(load) <= (1 + TOLERANCE) * mean or all(k == P for k in ks):
                break
            spread *= 2
        if max(load) <= (1 + TOLERANCE) * mean or cut == len(order):
            break
        cut += 1  # the next heaviest document is cut too
    for doc in range(b.num_docs):  # 7) padding fills what room is left, in rank order
        a, end = b.real_len(doc), b.padded_len(doc)
        for r in range(P):
            if a < end and room[r]:
                z = min(end, a + room[r])
                held[r].append((doc, a, z))
                room[r] -= z - a
                a = z
    return tuple(_in_stream_order(b, pieces) for pieces in held)


def _place(b: Boundaries, P: int, order: list[int], ks: list[int]):
    """Steps 4 to 6 with the first `len(ks)` documents of `order` cut, the `i`-th over `ks[i]` ranks:
    `(held, load, room)` per rank."""
    room, load = [b.total // P] * P, [0] * P
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(P)]  # (doc, first position, last + 1)

    def put(r: int, doc: int, a: int, z: int) -> None:
        held[r].append((doc, a, z))
        room[r] -= z - a
        load[r] += piece_work(a, z)

    def fill(doc: int, n: int) -> None:  # 6) contiguous pieces over the least loaded ranks with room
        a = 0
        for _, r in sorted((load[r], r) for r in range(P) if room[r]):
            z = min(n, a + room[r])
            put(r, doc, a, z)
            a = z
            if a == n:
                break

    for doc, k in zip(order, ks):  # 4) zigzag pairs over k ranks: 2k chunks as equal as integers allow
        n = b.real_len(doc)
        ranks = sorted(r for _, r in sorted((load[r], r) for r in range(P) if room[r] >= 2 * (n // (2 * k)))[:k])
        by_room = sorted(range(len(ranks)), key=lambda s: (-room[ranks[s]], s))  # spare tokens where there is most room
        spare = set([*by_room, *(2 * k - 1 - s for s in by_room)][: n % (2 * k)])  # front chunks first, then back
        sizes = [n // (2 * k) + (j in spare) for j in range(2 * k)]
        if len(ranks) < k or any(room[r] < sizes[s] + sizes[2 * k - 1 - s] for s, r in enumerate(ranks)):
            fill(doc, n)  # no k ranks with room for their share (never when every cut is over all P: see above)
            continue
        starts = [sum(sizes[:j]) for j in range(2 * k)]
        for s, r in enumerate(ranks):
            for j in (s, 2 * k - 1 - s):
                if sizes[j]:
                    put(r, doc, starts[j], starts[j] + sizes[j])
    for doc in order[len(ks):]:
        n = b.real_len(doc)
        fits = sorted((load[r], r) for r in range(P) if room[r] >= n)
        if fits:  # 5) whole, to the least loaded rank with room
            put(fits[0][1], doc, 0, n)
        else:
            fill(doc, n)
    return held, load, room


def _in_stream_order(b: Boundaries, pieces: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Pieces sorted by position, adjacent pieces of one document merged, in padded-stream coordinates."""
    out: list[tuple[int, int, int]] = []
    for doc, a, z in sorted(pieces):
        s, e = b.padded[doc] + a, b.padded[doc] + z
        if out and out[-1][0] == doc and out[-1][2] == s:
            out[-1] = (doc, out[-1][1], e)
        else:
            out.append((doc, s, e))
    return tuple(out)
