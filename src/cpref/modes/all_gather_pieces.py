r"""The all-gather plan for the stream and balanced layouts: gather only the rows others read.

The chunked layouts cut every document over every rank, so every rank needs keys of every
other rank and the all-gather moves whole shards ([the RFC's plan][cpref.modes.all_gather_plan]).
With the layouts that keep documents whole or cut them only across some ranks
([`cpref.batch.layout`][cpref.batch.layout]: `stream`, `balanced`), most of a rank's keys are read by its
own queries only. This plan, written on the layout's pieces (`(doc, start, end)` per rank):

1. **Reads.** Each local piece's real queries $[a, z)$ see the keys $[lo, hi)$ of their document
   (the causal prefix up to $z$, the whole document without a causal mask, or the window's
   span), wherever those keys are held.
2. **Shared rows.** Rank $s$'s *shared* rows are those of its shard that some other rank reads,
   in local order; every rank pads its list to the longest, $m$ rows, which is all it
   contributes to the all-gather (`gathered_rows`, from the boundaries alone, so every rank
   agrees). A batch whose documents all sit on one rank each gathers nothing ($m = 0$).
3. **Source buffer.** The keys come from the local shard followed by the gathered rows,
   rank-major: `(T_l + P m, Hkv, D)`. `kv_index` picks each query sequence's keys from it in
   natural order, the rank's own keys from its shard, the others' from their gathered rows.

The backward adds each key's gradient at its source row (`index_add_`), keeps the local part,
reduce-scatters the gathered part (float32, as the RFC's path does) and adds what comes back at
the shared rows. Per rank: forward $(P - 1)\, m\, H_{kv} (D + D_v)$ elements, backward the same
again (re-gathered) plus $(P - 1)\, m\, H_{kv} (D + D_v)$ float32 elements of dK/dV, against
$(P - 1)\, T_l$ rows of the whole-shard gather.
"""

from __future__ import annotations

import bisect

import torch

from cpref.batch.layout import local_chunks
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import NO_WINDOW, Varlen
from cpref.modes.all_gather_plan import AllGatherPlan
from cpref.modes.visible import chunk_pieces

__all__ = ["build_piece_all_gather_plan", "piece_reads", "piece_sequences"]


def piece_reads(b: Boundaries, P: int, layout: str, causal: bool, window: tuple[int, int] = NO_WINDOW,
                chunk: int | None = None, ranks=None) -> tuple[dict[int, list[tuple]], list[torch.Tensor], int]:  # fmt: skip
    """`(reads, shared, m)`: for each rank of `ranks` (default every rank), `(n_q, n_pad, [(owner, first row, last row
    + 1), ...], shift)` of each local piece (its real queries, its padding, the held rows its keys are, the shift of
    its first query); per rank the rows others read of its shard; the most of them, `m` (module docstring, steps 1
    and 2)."""
    pieces, held = _pieces(b, P, layout, chunk)
    starts = {key: [a for a, *_ in h] for key, h in held.items()}  # the pieces of a key are disjoint: both increase
    ends = {key: [z for _, z, *_ in h] for key, h in held.items()}

    def reads(r: int):
        """`(n_q, n_pad, [(owner, first row, last row + 1), ...], shift)` of each local piece of rank `r`: the held
        pieces its keys `[lo, hi)` overlap, found by bisection (no scan of every piece of the document)."""
        out = []
        for key, a, z, _ in pieces[r]:
            zr, lo, hi = _keys(b, key, a, z, causal, window, chunk)
            first, last = bisect.bisect_right(ends[key], lo), bisect.bisect_left(starts[key], hi)
            spans = [(o, row + max(lo, pa) - pa, row + min(hi, pz) - pa) for pa, pz, o, row in held[key][first:last]
                     if zr > a and min(hi, pz) > max(lo, pa)]  # fmt: skip
            out.append((zr - a, z - zr, spans, a - lo))
        return out

    shared = _shared_rows(b, P, held, causal, window, chunk)
    return {r: reads(r) for r in (range(P) if ranks is None else ranks)}, shared, max(len(x) for x in shared)


def piece_sequences(b: Boundaries, P: int, layout: str, causal: bool, window: tuple[int, int] = NO_WINDOW,
                    chunk: int | None = None) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """Per rank, `(n_q, n_k, shift)` of each local piece's sequence with keys: the counts of `piece_reads`' reads
    without listing the held rows (a piece's keys are one run of its document's positions, `[lo, hi)`, all held
    by some rank), for a planner that needs every rank's calls but no rank's rows."""
    pieces, _ = _pieces(b, P, layout, chunk)
    out = []
    for mine in pieces:
        seqs = []
        for key, a, z, _ in mine:
            zr, lo, hi = _keys(b, key, a, z, causal, window, chunk)
            if zr > a and hi > lo:
                seqs.append((zr - a, hi - lo, a - lo))
        out.append(seqs)
    return out


def _pieces(b: Boundaries, P: int, layout: str, chunk: int | None):
    """`(pieces, held)`: per rank `((doc, chunk), first position, last + 1, first local row)` of each local piece in
    local order; per `(doc, chunk)` the pieces `(a, z, rank, first row)` in position order."""
    pieces = []
    for r in range(P):
        row, mine = 0, []
        for doc, s, e in local_chunks(b, cp_size=P, rank=r, layout=layout):
            mine.append((doc, s - b.padded[doc], e - b.padded[doc], row))
            row += e - s
        pieces.append(chunk_pieces(mine, chunk))
    held: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (doc, chunk) -> (a, z, rank, first row)
    for r in range(P):
        for key, a, z, row in pieces[r]:
            held.setdefault(key, []).append((a, z, r, row))
    for key in held:
        held[key].sort()
    return pieces, held


def _keys(b: Boundaries, key: tuple[int, int], a: int, z: int, causal: bool, window: tuple[int, int],
          chunk: int | None) -> tuple[int, int, int]:  # fmt: skip
    """`(zr, lo, hi)`: piece `[a, z)` of `key`'s real queries `[a, zr)` see the positions `[lo, hi)` (step 1)."""
    doc, k = key
    left, right = window if window != NO_WINDOW else (-1, -1)
    right = 0 if causal else right
    n = b.real_len(doc) if chunk is None else min(b.real_len(doc), (k + 1) * chunk)  # the chunk's real end
    zr = a + b.real_in(doc, a, z)  # real queries [a, zr)
    lo = 0 if left < 0 else max(0, a - left)
    lo = lo if chunk is None else max(lo, k * chunk)  # not before the chunk
    hi = n if right < 0 else min(n, zr + right)
    return zr, lo, hi


def _shared_rows(b: Boundaries, P: int, held: dict, causal: bool, window: tuple[int, int],
                 chunk: int | None) -> list[torch.Tensor]:  # fmt: skip
    r"""Per rank, the rows of its shard that another rank reads (step 2), without listing who reads what.

    In a document's pieces in position order, the positions $[\mathrm{lo}_i, \mathrm{hi}_i)$ piece $i$'s queries
    read both ascend with $i$, so the pieces reading a position $x$ are a run of consecutive pieces. $x$ is read by
    a rank other than $o$ unless every piece of that run is $o$'s: unless $x$ lies where a run $i..j$ of $o$'s
    own pieces reads and no neighbour does, $[\max(\mathrm{lo}_i, \mathrm{hi}_{i-1}), \min(\mathrm{hi}_j,
    \mathrm{lo}_{j+1}))$. So owner $o$'s piece shares the part of it that some piece reads (the union of all the
    reads), less those stretches of $o$'s own runs: linear in the pieces, where listing the reads pair by pair is
    quadratic in them (full causal reads of a document cut over many ranks)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # per owner: shared rows [r0, r1)
    for key, pieces in held.items():
        reading = [(lo, hi, o) for a, z, o, _ in pieces for zr, lo, hi in [_keys(b, key, a, z, causal, window, chunk)]
                   if zr > a and hi > lo]  # fmt: skip
        covered = _merged([(lo, hi) for lo, hi, _ in reading])  # every position some piece reads, merged
        alone: dict[int, list[tuple[int, int]]] = {}  # owner -> stretches only its own pieces read
        i = 0
        while i < len(reading):
            j = i
            while j + 1 < len(reading) and reading[j + 1][2] == reading[i][2]:
                j += 1
            start = max(reading[i][0], reading[i - 1][1]) if i else reading[i][0]
            end = min(reading[j][1], reading[j + 1][0]) if j + 1 < len(reading) else reading[j][1]
            if end > start:
                alone.setdefault(reading[i][2], []).append((start, end))
            i = j + 1
        for a, z, o, row in pieces:
            for lo, hi in _minus(_clip(covered, a, z), alone.get(o, [])):
                spans[o].append((row + lo - a, row + hi - a))
    return [_rows_of(sorted(x)) for x in spans]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans `[lo, hi)` merged into disjoint ascending ones."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _clip(spans: list[tuple[int, int]], a: int, z: int) -> list[tuple[int, int]]:
    """Disjoint ascending `spans` within `[a, z)`."""
    first = bisect.bisect_right([hi for _, hi in spans], a)
    out = []
    for lo, hi in spans[first:]:
        if lo >= z:
            break
        out.append((max(lo, a), min(hi, z)))
    return out


def _minus(spans: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint ascending `spans` less the spans `cut`."""
    for c0, c1 in cut:
        spans = [part for lo, hi in spans for part in ((lo, min(hi, c0)), (max(lo, c1), hi)) if part[1] > part[0]]
    return spans


def build_piece_all_gather_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, device: torch.device,
                                window: tuple[int, int] = NO_WINDOW, chunk: int | None = None) -> AllGatherPlan:  # fmt: skip
    """Rank `rank`'s plan (module docstring): its sequences, its shared rows and every key's source row; with
    `chunk`, each chunk of a document a document of its own (`cpref.modes.visible`)."""
    T_l = b.total // P
    every, shared, m = piece_reads(b, P, layout, causal, window, chunk, ranks=(rank,))
    # 3) this rank's key rows in the source buffer: its shard, then the gathered rows, rank-major
    keys, q_lens, kv_lens, shifts = [], [], [], []
    for n_q, n_pad, spans, shift in every[rank]:
        rows = [torch.arange(r0, r1) if o == rank else T_l + o * m + torch.searchsorted(shared[o], torch.arange(r0, r1))
                for o, r0, r1 in spans]  # fmt: skip
        for count, keys_of, d in ((n_q, rows, shift), (n_pad, [], None)):
            if count:
                n_k = sum(len(x) for x in keys_of)
                keys += keys_of
                q_lens.append(count), kv_lens.append(n_k), shifts.append(d if d is not None and n_k else n_k - count)
    kv_rows = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)  # (sum kv_len,), on the host
    return AllGatherPlan(kv_rows.to(device), Varlen.from_lengths(q_lens, kv_lens, shifts), window, shared[rank].to(device),
                         m, kv_rows)  # fmt: skip


def _rows_of(spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of disjoint ascending spans `[r0, r1)`, as one sorted tensor."""
    rows = [torch.arange(r0, r1) for r0, r1 in spans]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
