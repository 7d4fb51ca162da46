r"""The `balanced` layout given a mask: every rank the same share of what the mask costs.

Zigzag balances causal documents: a document's row $p$ sees $p + 1$ keys, and chunks $r$ and
$2P - 1 - r$ pair a light row with a heavy one. Under another mask the rows cost something
else. A prefix-LM's prompt rows all see the whole prompt; an image span's rows see the span's
end; a shared prompt's answers see the prompt and themselves, whatever their place in the
stream. On long-tailed packs at $P = 8$, zigzag's or the causal plan's busiest rank then does more
than 5% over the mean (the tests assert it, the bench prints by how much). Given the mask,
`Sharding(cu, cp_size=P, layout="balanced", mask=mask)` lays the batch out by the mask's own
cost, the **visible keys of each query**, $w_x$ ([`Mask.visible_per_row`][cpref.batch.mask.Mask.visible_per_row]),
whose sum over a rank's rows is exactly the kernel work the rank does (tests count it).

{{ figure figures/balanced_mask.png }}

## The plan

Every rank holds exactly $T_l = T / P$ tokens (the batch padded at its end, as `balanced` is)
and should do the mean work $W^* = \sum_x w_x / P$. A document's work $W_d$ is the sum of its
rows' $w_x$ (padding rows cost 0); the mask decides it, not the length.

1. **Whole documents, and a pool.** The documents in decreasing work; the first $c$ form the
   **pool**, the ones that will be cut ($c$ starts at the number heavier than a rank may be,
   $(1 + 0.05)\,W^*$, `TOLERANCE`). The others, heaviest first, each go whole to the rank with
   room for it whose **projected load** is least after it: its work so far, the document's,
   and its remaining room filled at the pool's mean work per token $\bar\rho$. A document that
   fits nowhere joins the pool.
2. **The pool fills from both ends.** The pool's documents are laid end to end, densest first
   (work per token), each in stream order. Each rank takes its room $R_r$ from the two ends of
   what is left: $a$ tokens from the dense end and $R_r - a$ from the sparse one, $a$ the count
   whose work comes closest to its shortfall $W^* - L_r$ (all $a$ tried at once from the pool's
   running sum). The rank whose target density is furthest from the rest of the pool goes
   first. Each rank gets at most two runs of the pool: few cuts.
3. **The fewest cuts that balance.** $c$ grows by one until the busiest rank does at most
   $(1 + 0.05)\,W^*$. The bound is looser than the causal plan's 2%: every cut adds pieces, and
   a rank's pieces are kernel sequences, sometimes calls (see below).
4. **Blocks, where no pool balances.** Each document is cut into blocks of $g$ tokens (its last
   block shorter), and the blocks in decreasing work each go to the least loaded rank with room
   for them (the longest-processing-time rule, the tokens a second budget; a block no rank has
   room for is split over the least loaded ranks with room); $g$ halves from $T_l$ until the
   plan balances, else the plan with the least busy busiest rank is kept.
5. **Stream order.** A rank's pieces are put in stream order, adjacent ones of a document
   merged into one piece `(doc, start, end)`.

Every mode runs the plan from these pieces (as it runs `balanced`'s), and the masked modes send
only the rows another rank's queries see ([masks in the modes][cpref.modes.mask_plan]).

## What it guarantees, and what it does not

* **Token equality**, exactly: steps 1 and 4 never give a rank more than its room, step 2 hands
  out exactly each rank's room, and the rooms add up to the padded stream, $P\,T_l$.
* **Work**: the busiest rank within the tolerance wherever some pool or block size reaches it
  (the tests' long-tailed packs under prefix-LM, spans and shared prompts, $P$ up to 8, all
  do, in step 2). Its limit is a single row: a rank cannot do less than the heaviest query's
  keys, so a batch of one short heavy document cannot be balanced, and the plan says so by
  its work (`sharding.attention_work(r, mask=mask)`).
* **Few cuts, not the fewest bytes.** The pool's documents are on several ranks; under a mask
  that stays inside documents, their rows travel in the ring and the all-gather, and a query
  run that reads several key runs makes a kernel sequence of each. Whether the balance pays
  is the planner's to say (`python -m sim plan --mask ...`): for `p2p` over 13 documents of
  512 to 4096 tokens under a prefix-LM at $P = 4$ on the H100 profile it ranks this layout
  first, its busiest rank doing a tenth less work than zigzag's, with no more kernel calls
  and a third of the bytes (`tests/plan/test_planner.py`). The bench prints the bytes
  beside the balance.
* It is computed from the boundaries, $P$ and the mask alone, so every rank computes the same
  plan; the ranks compare the mask's digest before any communication.
"""

from __future__ import annotations

import bisect
import heapq

import torch

from cpref.batch.seqlens import Boundaries

__all__ = ["mask_balanced_pieces", "block_sizes"]

Piece = tuple[int, int, int]  # (doc, start, end): [start, end) in the padded stream
TOLERANCE = 0.05  # the busiest rank may exceed the mean work by this much (the causal plan's: 0.02; fewer cuts)


def block_sizes(T_l: int) -> list[int]:
    """Step 4's block sizes, largest first: `T_l`, halved down to 1.

    Examples:
        >>> block_sizes(12)
        [12, 6, 3, 1]
    """
    out = [T_l]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def mask_balanced_pieces(b: Boundaries, P: int) -> tuple[tuple[Piece, ...], ...]:
    """Per rank, the pieces it holds in stream order, balancing `b.mask`'s visible keys (the module's plan)."""
    b.check_divisible("balanced", P)
    T_l = b.total // P
    row = b.mask.visible_per_row(b.real[-1])  # (T_real,) keys each query sees
    work = b.pad(row, value=0)  # (T,) padding rows cost nothing
    prefix = [0, *torch.cumsum(work, 0).tolist()]  # work of [s, e) = prefix[e] - prefix[s]
    cap = (1 + TOLERANCE) * prefix[-1] / P
    works = [prefix[e] - prefix[a] for a, e in zip(b.padded, b.padded[1:])]
    order = sorted(range(b.num_docs), key=lambda i: (-works[i], i))  # the heaviest documents first
    for c in range(sum(w > cap for w in works), b.num_docs + 1):  # 1-3) whole documents, the c heaviest cut to fill
        held, load = _whole_and_fill(b, P, T_l, work, order[:c], order[c:])
        if max(load) <= cap:
            return tuple(_in_stream_order(pieces) for pieces in held)
    best: tuple[int, list[list[Piece]]] | None = None
    for g in block_sizes(T_l):  # 4) else the largest blocks that balance
        held, load = _assign(b, P, T_l, prefix, g)
        if best is None or max(load) < best[0]:
            best = (max(load), held)
        if max(load) <= cap:
            break
    return tuple(_in_stream_order(pieces) for pieces in best[1])


def _whole_and_fill(b: Boundaries, P: int, T_l: int, work: torch.Tensor, cut: list[int],
                    whole: list[int]) -> tuple[list[list[Piece]], list[int]]:  # fmt: skip
    """Steps 1 and 2: the documents `whole` placed whole, the `cut` ones laid out densest first and shared out from
    both ends (`work`: `(T,)` each row's keys): `(held, load)`."""
    held: list[list[Piece]] = [[] for _ in range(P)]
    room, load = [T_l] * P, [0] * P
    span = [(b.padded[i], b.padded[i + 1]) for i in range(b.num_docs)]  # a document with its padding
    doc_work = [int(work[a:e].sum()) for a, e in span]
    mean, pool = sum(doc_work) / P, list(cut)  # W*
    density = sum(doc_work[i] for i in cut) / (sum(span[i][1] - span[i][0] for i in cut) or 1)  # the pool's, a token
    def change(doc: int) -> float:  # what a document adds to a rank's projected load: its work less the fill's
        return doc_work[doc] - (span[doc][1] - span[doc][0]) * density

    # 1) the documents that change a projected load most first (its work, and its room filled at the pool's density:
    #    the loads' mean stays W*), a denser one than the pool to the least projected rank with room, a sparser one
    #    to the most projected: the projected loads level
    for doc in sorted(whole, key=lambda i: (-abs(change(i)), i)):
        a, e = span[doc]
        fits = [r for r in range(P) if room[r] >= e - a]
        if not fits:
            pool.append(doc)
            continue
        sign = 1 if change(doc) > 0 else -1
        r = min(fits, key=lambda r: (sign * (load[r] + room[r] * density), r))
        held[r].append((doc, a, e))
        room[r], load[r] = room[r] - (e - a), load[r] + doc_work[doc]
    # 2) the pool, densest document first, each in stream order; every rank takes its room from both ends
    blocks = sorted(((i, *span[i]) for i in pool), key=lambda blk: (-doc_work[blk[0]] / (blk[2] - blk[1]), blk[0]))
    ends = [0]
    for _, x, z in blocks:
        ends.append(ends[-1] + z - x)
    rows = torch.cat([torch.arange(x, z) for _, x, z in blocks]) if blocks else torch.zeros(0, dtype=torch.long)
    F = torch.nn.functional.pad(torch.cumsum(work[rows], 0), (1, 0))  # (n + 1,) the pool's first p tokens' work

    def take(r: int, p: int, q: int) -> None:  # pool tokens [p, q) to rank r, a piece per block
        while p < q:
            j = bisect.bisect_right(ends, p) - 1
            z, x = min(q, ends[j + 1]), blocks[j][1] + p - ends[j]
            held[r].append((blocks[j][0], x, x + z - p))
            p = z

    lo, hi, todo = 0, ends[-1], [r for r in range(P) if room[r]]
    while todo:  # the rank whose target density is furthest from the pool's remaining mean first
        left = float(F[hi] - F[lo]) / (hi - lo)
        r = max(todo, key=lambda r: (abs((mean - load[r]) / room[r] - left), -r))
        todo.remove(r)
        R, a = room[r], torch.arange(room[r] + 1)  # a tokens from the dense end, R - a from the sparse one
        got = F[lo + a] - F[lo] + F[hi] - F[hi - R + a]  # (R + 1,)
        a = int(torch.argmin((got - (mean - load[r])).abs()))  # the first closest to the rank's target
        take(r, lo, lo + a)
        take(r, hi - R + a, hi)
        load[r] += int(got[a])
        lo, hi = lo + a, hi - R + a
    return held, load


def _assign(b: Boundaries, P: int, T_l: int, prefix: list[int], g: int) -> tuple[list[list[Piece]], list[int]]:
    """Step 4 at block size `g`: `(held, load)`, each rank's pieces and work."""
    blocks = [(prefix[min(s + g, e)] - prefix[s], s, min(s + g, e), doc)  # 1) (work, start, end, doc)
              for doc, (a, e) in enumerate(zip(b.padded, b.padded[1:])) for s in range(a, e, g)]  # fmt: skip
    blocks.sort(key=lambda x: (-x[0], x[1]))
    held: list[list[Piece]] = [[] for _ in range(P)]
    room, load = [T_l] * P, [0] * P
    heap = [(0, r) for r in range(P)]  # (work, rank) of the ranks with room left
    for _, start, e, doc in blocks:  # 2) heaviest first, to the least loaded rank with room for it
        skipped = []
        while heap and room[heap[0][1]] < e - start:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, r = heapq.heappop(heap)
            _take(held, room, load, prefix, r, doc, start, e)
            if room[r]:
                heapq.heappush(heap, (load[r], r))
        else:  # no rank has room for it whole: the least loaded ranks with room take what fits
            s = start
            for _, r in sorted(skipped):
                if s < e:
                    z = min(e, s + room[r])
                    _take(held, room, load, prefix, r, doc, s, z)
                    s = z
            skipped = [(load[r], r) for _, r in skipped if room[r]]
        for item in skipped:
            heapq.heappush(heap, item)
    return held, load


def _take(held: list[list[Piece]], room: list[int], load: list[int], prefix: list[int], r: int, doc: int,
          s: int, e: int) -> None:  # fmt: skip
    held[r].append((doc, s, e))
    room[r] -= e - s
    load[r] += prefix[e] - prefix[s]


def _in_stream_order(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Pieces sorted by position, adjacent pieces of one document merged."""
    out: list[Piece] = []
    for doc, s, e in sorted(pieces, key=lambda p: p[1]):
        if out and out[-1][0] == doc and out[-1][2] == s:
            out[-1] = (doc, out[-1][1], e)
        else:
            out.append((doc, s, e))
    return tuple(out)
