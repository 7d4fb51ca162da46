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
4. **Cut what must be cut.** The heaviest documents are cut in zigzag pairs over the `P`
   ranks: $2P$ chunks as equal as integers allow (the spare tokens to the ranks with the most
   room, which keeps the ranks' room within one token), rank $r$ taking chunks $r$ and $2P - 1 - r$,
   which gives every rank $1/P$ of the document's tokens and, as zigzag does, about $1/P$ of its
   work. First every document with $w > W^*$ (it would make its rank the slowest however the
   rest is placed); then, one at a time in decreasing $w$, the next heaviest, until steps 5 and
   6 leave the largest rank within 2% of $W^*$ (`TOLERANCE`), or every document is cut.
5. **Keep the rest whole.** Every other document goes, whole, to the least loaded rank that has
   room for it (longest-processing-time first, the classic greedy for balancing loads).
6. **Fill.** A document that fits on no rank (the ranks are full in tokens before they are in
   work) is cut into contiguous pieces over the least loaded ranks with room, in order.
7. **Padding** (every document's tail, the batch's end included) fills what room is left, in
   rank order; a rank's pieces are then put in stream order.

Each rank's tokens are its pieces `(doc, start, end)` in stream order
([`cpref.layout.local_chunks`][cpref.layout.local_chunks]); every mode runs the layout from
them. A document held whole costs no communication in the modes that send only what is read
(the ring, `p2p` and the ring level of `a2a+p2p`: [the ring that sends only what is read][cpref.modes.ring_window]).

## What it guarantees

* **Token equality**, exactly: steps 4 to 6 place every real token at most $T_l$ to a rank,
  and the padding, $P T_l - \sum_i n_i$ tokens, is exactly the room they leave.
* **Work**: the largest rank does at most $(1 + 0.02) W^*$, or every document is cut, and then
  the plan is zigzag without its per-document padding (every rank within integer rounding of
  $1/P$ of every document).
* **Fewest cuts for it, greedily**: the cut documents are the shortest prefix, in decreasing
  $w$, of the documents after which the greedy meets the tolerance; a document outside it is
  cut only in step 6, when at its turn no rank has $n$ tokens of room.
* **Cut documents balance themselves**: each puts the same tokens (to one) and about the same
  work on every rank, so it cannot unbalance the plan, and the whole documents are balanced by
  the greedy on top of them.

## Where it falls short

* The plan is greedy, not optimal: it cuts whole documents over all `P` ranks where cutting one
  over a sub-group (fewer ranks exchanging its K/V) or moving a few whole documents would do;
  a search would move fewer bytes for the same balance.
* Only the modes that send what is read profit in bytes: `p2p` and the ring level of `a2a+p2p`.
  `all_gather` still gathers every rank's K/V and `a2a` still exchanges every token, whole
  documents included (gathering or exchanging only the cut part is not implemented yet).
* It balances the causal work of full attention; under a sliding window, or without a causal
  mask, the work of a document is another function of its length, which it does not use.
* The hierarchical mode (`a2a+p2p`) runs its ring over groups of `a` consecutive ranks, whose
  unions of pieces the plan does not balance as groups (their sums are balanced, as each
  rank's is).
"""

from __future__ import annotations

import functools

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
    works = [piece_work(0, b.real_len(i)) for i in range(b.num_docs)]
    mean = sum(works) / P  # W*
    order = sorted(range(b.num_docs), key=lambda i: (-works[i], i))  # the heaviest first
    cut = sum(w > mean for w in works)  # 4) at least every document heavier than a rank's share
    while True:
        held, load, room = _place(b, P, order, cut)
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


def _place(b: Boundaries, P: int, order: list[int], cut: int):
    """Steps 4 to 6 with the first `cut` documents of `order` cut over all ranks: `(held, load, room)` per rank."""
    room, load = [b.total // P] * P, [0] * P
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(P)]  # (doc, first position, last + 1)

    def put(r: int, doc: int, a: int, z: int) -> None:
        held[r].append((doc, a, z))
        room[r] -= z - a
        load[r] += piece_work(a, z)

    for doc in order[:cut]:  # 4) zigzag pairs over the P ranks: 2P chunks as equal as integers allow
        n = b.real_len(doc)
        by_room = sorted(range(P), key=lambda r: (-room[r], r))  # the spare tokens go where there is most room
        spare = set([*by_room, *(2 * P - 1 - r for r in by_room)][: n % (2 * P)])  # front chunks first, then back
        sizes = [n // (2 * P) + (j in spare) for j in range(2 * P)]
        starts = [sum(sizes[:j]) for j in range(2 * P)]
        for r in range(P):
            for j in (r, 2 * P - 1 - r):
                if sizes[j]:
                    put(r, doc, starts[j], starts[j] + sizes[j])
    for doc in order[cut:]:
        n = b.real_len(doc)
        fits = sorted((load[r], r) for r in range(P) if room[r] >= n)
        if fits:  # 5) whole, to the least loaded rank with room
            put(fits[0][1], doc, 0, n)
            continue
        a = 0  # 6) fill: contiguous pieces over the least loaded ranks with room
        for _, r in sorted((load[r], r) for r in range(P) if room[r]):
            z = min(n, a + room[r])
            put(r, doc, a, z)
            a = z
            if a == n:
                break
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
