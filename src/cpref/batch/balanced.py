r"""The `balanced` layout: whole documents where they fit, symmetric cuts only where they must.

The chunked layouts cut **every** document into `P` or `2P` chunks: every document is padded
to that granularity and every document's K/V travel, even a 40-token one that one rank could
attend to alone. `balanced` (in the spirit of Megatron's dynamic CP, WLB-LLM and ByteScale)
plans the batch instead, from its boundaries and `P` alone, so every rank computes the same
plan. Two budgets bind every rank at once: it holds exactly $T_l$ tokens, and it should do the
mean causal work $W^*$. Long documents are dense in work (a document of $n$ tokens costs
$n(n+1)/2$ scores, $(n+1)/2$ a token), short ones sparse; the plan keeps the short ones whole
and lets a few long ones, cut, make up each rank's difference.

{{ figure figures/balanced.png }}

## The identity it rests on

A **symmetric pair** of a document, its chunks $[f, f + h)$ and $[n - f - h, n - f)$, carries

$$ \sum_{p=f}^{f+h-1} (p + 1) + \sum_{p=n-f-h}^{n-f-1} (p + 1) = h\,(n + 1) $$

causal scores, wherever it sits: cut into symmetric pairs, a document is a fluid of density
$(n+1)/2$ scores a token, and any share of it, taken from the outside in, carries its tokens'
share of the work. (Zigzag's chunks $r$ and $2P - 1 - r$ are one such pair, of equal shares.)

## The plan

1. **Capacity.** The batch is padded at its end only (`Sharding.eod_padded(..., layout="balanced")`
   pads the last document) to $T = P\,T_l$; every rank holds exactly $T_l$ tokens.
2. **The pool.** Documents in decreasing work $w = n(n+1)/2$ (ties: by index); the first $c$
   form the **pool**, the documents that will be cut. $c$ starts at the number of documents
   heavier than a rank may be, $(1 + 0.02) W^*$ (`TOLERANCE`), and grows by one until the plan
   below keeps every rank within it.
3. **Whole documents**, largest first, each to one rank with room for it. The pool and the
   padding will fill what they leave, at their mean density $\bar\rho$ (pool work over pool and
   padding tokens), so a document of $n$ tokens and work $w$ moves a rank by $(n,\ w - n\bar\rho)$:
   its tokens, and its work beyond that of the fill it displaces. It goes to the rank whose
   shortfall, $(\bar n - t_r,\ W^* - L_r - (T_l - t_r)\bar\rho)$ with $t_r, L_r$ the rank's
   whole tokens and work so far and $\bar n$ the whole tokens per rank, it fills best (the
   largest dot product, each coordinate in units of its mean per rank: the classic greedy for
   packing vectors). A document that fits on no rank joins the pool.
4. **The pool fills.** The pool is laid out densest document first, the padding (density 0)
   last. Each rank takes its room, $R_r = T_l - t_r$ tokens, from the two ends of what is left:
   $a$ from the dense end and $R_r - a$ from the sparse one, $a$ the count whose work comes
   closest to its target $W^* - L_r$ (the work grows with $a$: a bisection). The ranks whose
   target density is furthest from the remaining pool's go first; the last takes the mean.
5. **Cuts.** Each pooled document's shares become symmetric pairs from the outside in, the
   largest share outermost (its back chunk, the document's end, no other rank reads), an odd
   share's spare token alternately at the front and at the back, so every pair is symmetric to
   a token. A share of the whole document is the document whole.
6. **Fallback.** If no $c$ keeps the ranks within the tolerance, every document is cut in
   zigzag pairs over all `P` ranks, rank $r$ the $r$-th from the outside in, each taking
   $2\lfloor n / 2P \rfloor$ tokens and the spare ones one at a time to the ranks with the most
   room.
7. **Padding** (every document's tail, the batch's end included) fills what room is left, in
   rank order; a rank's pieces are then put in stream order.

Each rank's tokens are its pieces `(doc, start, end)` in stream order
([`cpref.batch.layout.local_chunks`][cpref.batch.layout.local_chunks]); every mode runs the layout from
them. A document held whole costs no communication in the modes that send only what is read:
the ring (`p2p`: [the ring that sends only what is read][cpref.modes.ring_window]),
`all_gather` ([the all-gather over pieces][cpref.modes.all_gather_pieces]), `a2a`
([Ulysses for stream and balanced][cpref.modes.ulysses_split]) and `a2a+p2p`
([the hierarchy for stream and balanced][cpref.modes.hierarchical_split]).

## What it guarantees

* **Token equality**, exactly: steps 3 to 5 place every real token at most $T_l$ to a rank
  (step 4 hands out exactly each rank's room), and the padding, $P T_l - \sum_i n_i$ tokens, is
  exactly the room they leave.
* **Work**: the largest rank does at most $(1 + 0.02) W^*$, or the plan is step 6's, zigzag
  without its per-document padding (every rank within two tokens of $1/P$ of every document).
  Step 6 always fits: the spare tokens go one at a time to the ranks with the most room, so the
  ranks' room stays within one token of each other and never runs out before the tokens do.
* **Shares carry their work**: by the identity, each holder of a cut document does its
  tokens' share of the document's work, to within two tokens' work ($2n$) for the spare
  tokens.
* **Few cuts**: the documents on more than one rank are the pool, the shortest prefix in
  decreasing work that balances, and the documents that found no room whole in step 3.

## Where it falls short

* The plan is greedy, not optimal. What it minimises second, the bytes, follows the busiest
  rank's **shared rows** (its tokens of documents on more than one rank): `all_gather` and
  `a2a` pad every rank's to the most any rank has. Those are at least the pool's tokens over
  `P`; on the bench's long-tailed pack at $P = 8$ the plan's are within 8% of that bound (the
  bench prints both). A finer search (moving a few whole documents after step 4) would close
  some of it.
* **Ulysses balances differently.** `a2a` attends to a rank's whole documents where they are
  and to the shared ones over all ranks by heads (`a2a+p2p` over its group's), so its ranks'
  work is $L_r + W_{pool} / P$:
  the shares step 4 made uneven to balance $L_r$ do not count. A heavy document kept whole (one
  that fits) then makes its rank Ulysses' busiest; on the bench's long-tailed pack at $P = 8$
  the kernel work of `a2a` is 1.25 times the mean. Cutting that document as well balances it, but
  then its tokens are shared rows: for Ulysses on such a pack, balance and a third of the bytes
  exclude each other (the bench shows both columns).
* It balances the causal work of full attention; under a sliding window, or without a causal
  mask, the work of a document is another function of its length, which it does not use.
  Given a mask (`Sharding(..., layout="balanced", mask=mask)`), the layout balances the mask's
  own work instead ([`cpref.batch.balanced_mask`][cpref.batch.balanced_mask]).
* The hierarchical mode (`a2a+p2p`) runs its ring over groups of `a` consecutive ranks, whose
  unions of pieces the plan does not balance as groups (their sums are balanced, as each
  rank's is).
"""

from __future__ import annotations

import bisect
import functools

from cpref.batch.balanced_mask import mask_balanced_pieces
from cpref.batch.seqlens import Boundaries

__all__ = ["balanced_pieces", "piece_work", "TOLERANCE"]

Piece = tuple[int, int, int]  # (doc, first position, last + 1), positions inside the document


def piece_work(a: int, z: int) -> int:
    """Causal scores of the queries at positions `[a, z)` of a document: $\\sum_{p=a}^{z-1} (p + 1)$."""
    return (z * (z + 1) - a * (a + 1)) // 2


TOLERANCE = 0.02  # the largest rank's causal work may exceed the mean by this fraction


@functools.lru_cache(maxsize=64)
def balanced_pieces(b: Boundaries, P: int) -> tuple[tuple[Piece, ...], ...]:
    """Per rank, the pieces `(doc, start, end)` it holds, in stream order, `[start, end)` in the padded
    stream (the module docstring's plan; given a mask, the plan of
    [`cpref.batch.balanced_mask`][cpref.batch.balanced_mask]). The batch's length must be a multiple of `P`."""
    if b.mask is not None:
        return mask_balanced_pieces(b, P)
    b.check_divisible("balanced", P)
    works = [piece_work(0, b.real_len(i)) for i in range(b.num_docs)]
    cap = (1 + TOLERANCE) * sum(works) / P  # the most a rank may do: (1 + TOLERANCE) W*
    order = sorted(range(b.num_docs), key=lambda i: (-works[i], i))  # 1) the heaviest first
    for c in range(sum(w > cap for w in works), b.num_docs + 1):  # 2) cut the c heaviest, the fewest that balance
        held, load = _plan(b, P, order[:c], order[c:])
        if max(load) <= cap:
            break
    else:  # 6) no prefix balanced: every document in zigzag pairs over all P
        held = _zigzag_over_all(b, P)
    _pad(b, held, b.total // P)  # 7) padding fills what room is left, in rank order
    return tuple(_in_stream_order(b, pieces) for pieces in held)


def _plan(b: Boundaries, P: int, cut: list[int], whole: list[int]) -> tuple[list[list[Piece]], list[int]]:
    """Steps 3 to 5 with the documents `cut` in the pool and `whole` placed whole where they fit: `(held, load)`."""
    T_l, n = b.total // P, [b.real_len(i) for i in range(b.num_docs)]
    mean = sum(piece_work(0, k) for k in n) / P  # W*
    held: list[list[Piece]] = [[] for _ in range(P)]
    tokens, load = [0] * P, [0] * P  # whole documents' tokens and work per rank
    pool = list(cut)
    fill = b.total - sum(n[i] for i in whole)  # what the pool and the padding will fill
    density = sum(piece_work(0, n[i]) for i in cut) / fill if fill else 0.0  # rho-bar
    # 3) whole documents, largest first, each to the rank whose (tokens, work) shortfall it best fills
    vec = {i: (n[i], piece_work(0, n[i]) - n[i] * density) for i in whole}  # what it adds beyond the fill it displaces
    unit = (sum(x for x, _ in vec.values()) / P or 1.0, sum(abs(y) for _, y in vec.values()) / P or 1.0)

    def fit(r: int, x: int, y: float) -> float:  # the rank's shortfall dotted with the document, in units
        return x * (unit[0] - tokens[r]) / unit[0] ** 2 + y * (mean - load[r] - (T_l - tokens[r]) * density) / unit[1] ** 2

    for doc in sorted(whole, key=lambda i: (-max(vec[i][0] / unit[0], abs(vec[i][1]) / unit[1]), i)):
        fits = [r for r in range(P) if tokens[r] + n[doc] <= T_l]
        if not fits:  # no rank has room for it whole: into the pool
            pool.append(doc)
            continue
        r = max(fits, key=lambda r: (fit(r, *vec[doc]), -r))
        held[r].append((doc, 0, n[doc]))
        tokens[r] += n[doc]
        load[r] += piece_work(0, n[doc])
    # 4) the pool fills each rank's room, densest documents first, to its share of the work
    shares = _fill(pool, n, [T_l - t for t in tokens], [mean - w for w in load], b.total - sum(n))
    # 5) each pooled document in zigzag pairs, its largest share outermost
    for doc, share in shares.items():
        for r, *pair in _pairs(n[doc], share, sorted(range(P), key=lambda r: (-share[r], r))):
            for s, e in pair:
                if e > s:
                    held[r].append((doc, s, e))
                    load[r] += piece_work(s, e)
    return held, load


def _fill(pool: list[int], n: list[int], room: list[int], target: list[float], pad: int) -> dict[int, list[int]]:
    """Step 4: `{doc: tokens per rank}` of the pooled documents (the padding, `pad` tokens, takes the rest)."""
    P, items = len(room), sorted(pool, key=lambda i: (-n[i], i))  # densest first, the padding last
    sizes, dens = [n[i] for i in items] + [pad], [n[i] + 1 for i in items] + [0]  # twice the work per token
    ends = [0]
    for s in sizes:
        ends.append(ends[-1] + s)
    works = [0]
    for s, d in zip(sizes, dens):
        works.append(works[-1] + s * d)

    def F(p: int) -> int:  # twice the work of the stream's first p tokens
        j = min(bisect.bisect_right(ends, p), len(sizes)) - 1
        return works[j] + (p - ends[j]) * dens[j]

    share = {doc: [0] * P for doc in items}

    def take(r: int, s: int, e: int) -> None:  # stream tokens [s, e) to rank r
        j = bisect.bisect_right(ends, s) - 1
        while s < e:
            z = min(e, ends[j + 1])
            if j < len(items):
                share[items[j]][r] += z - s
            s, j = z, j + 1

    lo, hi, todo = 0, ends[-1], [r for r in range(P) if room[r]]
    while todo:  # the rank furthest from the pool's remaining mean density first
        mean = (F(hi) - F(lo)) / (hi - lo)
        r = max(todo, key=lambda r: (abs(2 * target[r] / room[r] - mean), -r))
        todo.remove(r)
        R, goal = room[r], 2 * target[r]

        def work(a: int, lo: int = lo, hi: int = hi, R: int = R) -> int:
            # a tokens from the dense end, R - a from the sparse end (this rank's lo, hi and R, bound)
            return F(lo + a) - F(lo) + F(hi) - F(hi - R + a)

        a, z = 0, R  # the fewest dense tokens that reach the goal (work(a) grows with a), or the one before
        while a < z:
            mid = (a + z) // 2
            a, z = (mid + 1, z) if work(mid) < goal else (a, mid)
        if a and goal - work(a - 1) <= work(a) - goal:
            a -= 1
        take(r, lo, lo + a)
        take(r, hi - R + a, hi)
        lo, hi = lo + a, hi - R + a
    return share


def _pairs(n: int, share: list[int], order: list[int]):
    """Steps 5 and 6: `(rank, front, back)` of a document of `n` tokens shared `share[r]` per rank, the ranks of
    `order` from the outside in: zigzag pairs, an odd share's spare token alternately in front and at the back,
    so that every pair is symmetric to a token."""
    front, back, spare_in_front = 0, n, True
    for r in (r for r in order if share[r]):
        x = share[r]
        f = x - x // 2 if spare_in_front else x // 2
        spare_in_front ^= bool(x % 2)
        yield r, (front, front + f), (back - (x - f), back)
        front, back = front + f, back - (x - f)


def _zigzag_over_all(b: Boundaries, P: int) -> list[list[Piece]]:
    """Step 6: every document in zigzag pairs over all P, rank r the r-th from the outside in, each taking
    2 floor(n / 2P) tokens and the spare ones one at a time to the ranks with the most room (which keeps the
    ranks' room within one token of each other)."""
    room, held = [b.total // P] * P, [[] for _ in range(P)]
    for doc in range(b.num_docs):
        n = b.real_len(doc)
        by_room = sorted(range(P), key=lambda r: (-room[r], r))
        share = [2 * (n // (2 * P))] * P
        for r in [*by_room, *by_room][: n % (2 * P)]:
            share[r] += 1
        for r, *pair in _pairs(n, share, list(range(P))):
            for s, e in pair:
                if e > s:
                    held[r].append((doc, s, e))
            room[r] -= share[r]
    return held


def _pad(b: Boundaries, held: list[list[Piece]], T_l: int) -> None:
    """Step 7: every document's padding fills what room is left, in rank order."""
    room = [T_l - sum(z - a for _, a, z in pieces) for pieces in held]
    for doc in range(b.num_docs):
        a, end = b.real_len(doc), b.padded_len(doc)
        for r in range(len(held)):
            if a < end and room[r]:
                z = min(end, a + room[r])
                held[r].append((doc, a, z))
                room[r] -= z - a
                a = z


def _in_stream_order(b: Boundaries, pieces: list[Piece]) -> tuple[Piece, ...]:
    """Pieces sorted by position, adjacent pieces of one document merged, in padded-stream coordinates."""
    out: list[Piece] = []
    for doc, a, z in sorted(pieces):
        s, e = b.padded[doc] + a, b.padded[doc] + z
        if out and out[-1][0] == doc and out[-1][2] == s:
            out[-1] = (doc, out[-1][1], e)
        else:
            out.append((doc, s, e))
    return tuple(out)
