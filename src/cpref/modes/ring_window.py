r"""The ring under a sliding window, and over the stream layout: each rank gets only the rows it reads.

With `window=(left, right)` the query at position $p$ sees the keys $[p - \ell, p + r]$ of its
document. The ring of [`cpref.modes.ring`][cpref.modes.ring] then wastes most of what it moves:
a block far from a rank's queries holds no key they see, and a block passes every rank on its
way round. This variant plans from what each rank reads and sends it, directly, only that.

With a causal window of $w$ keys before each query, no wider than a chunk, a rank's queries read
only the last $w$ rows of each document's chunk on a neighbouring rank: a **halo**. Contiguous
sends each halo to the next rank; zigzag sends its front chunks' halos there too and its back
chunks' straight to the rank before ($P - 1$ ranks on). The figure draws it from a real run in
both layouts: who computes each score, and which keys each shift carries.

{{ figure figures/window_ring.png }}

The same plan serves the `stream` layout ([`cpref.batch.layout`][cpref.batch.layout]), with or without a
window: there a rank's pieces are cut from one stream, so a document reaches only the ranks it
straddles, and a rank reads the blocks of the ranks before it only as far back as its first
document began. The classic ring would send every block everywhere; this one sends nothing to
a rank whose documents start on it, and for a document that straddles ranks only the rows of
that document.

The plan is written on the layout's **pieces** (`(doc, start, end)` per rank, in local order,
`cpref.batch.layout.local_chunks`): a chunk of the chunked layouts, or a document's part of a rank's
range of the stream.

**Calls.** Rank $r$ attends to the block of rank $s = (r - d) \bmod P$, at *distance* $d$. For
each of the sender's pieces of a document, each local query piece's real queries $[a, z)$ see
the keys of that piece in $[a - \ell, z + r)$ (without a window: all of it, up to $z$ under a
causal mask); the pairs with keys form one kernel call with
explicit shifts (query $a$ stands at key $a - \mathrm{lo}$, [the kernel contract][cpref.kernels.contract]).
A sender's two zigzag chunks of a document are not adjacent, so a query chunk whose window
reaches both needs two calls, merged by lse like two steps (one call per piece *slot*: the
$k$-th piece the sender holds of each document). A ring of one member (`a2a+p2p` with one a2a
group) has one call on its own block; its plan reads the block as it is, each run of rows the
call does not read (padding) becoming the keys of a sequence without queries: no copy of the
block, no merge, the output in the input dtype (`RingPlan.whole_rows`).

**Distances.** The plan keeps distance 0 (the own block) and the distances
$\mathcal{D} \subseteq \{1, \dots, P - 1\}$ at which some rank's queries see a key of the block
$d$ ranks back, in increasing order (computed from the boundaries alone, so every rank agrees).
With a causal window no wider than a chunk, $\mathcal{D} = \{1\}$ for the contiguous layout
(each rank reads its left neighbour) and $\{1, P - 1\}$ for zigzag (a rank's front chunk
reads the front chunk of the rank before it, its back chunk the back chunk of the rank after
it, which is $P - 1$ ranks back); with `window=(0, 0)`, $\mathcal{D}$ is empty and nothing is
sent at all.

**Rows.** For each $d \in \mathcal{D}$ rank $s$ sends rank $s + d$, in one shift by $d$, the rows
$R_d(s)$ of its own block that rank $s + d$'s calls read, and nothing else: no row passes
through a rank that does not read it (a one-way ring would carry zigzag's back-chunk halo
through all $P - 2$ ranks between). With a causal window of $w \le c$ keys before each query,
$R_1$ is the last $w$ real rows of each document's chunk (contiguous), or of each front chunk
(zigzag, whose $R_{P-1}$ is the last $w$ of each back chunk): the halos of the figure above, $w$
rows per document and neighbour instead of the whole block.

**Backward.** K/V take the same shifts again. At distance $d$ the rank computes the float32
dK/dV share of the rows it received and returns it with one shift by $-d$; the owner adds it
at $R_d$. A shift moves one shape on every rank, so the one at distance $d$ carries
$m_d = \max_s |R_d(s)|$ rows of $H_{kv} (D + D_v)$ elements (zeros past a block's own $R_d$).
Per rank: forward $\sum_{d \in \mathcal{D}} m_d$ rows in $b$ bytes, backward the same plus
$\sum_{d \in \mathcal{D}} m_d$ rows in $f$ bytes, and $|\mathcal{D}|$ shifts forward, $2 |\mathcal{D}|$
backward ([`halo_costs`][cpref.modes.costs.halo_costs], asserted from the trace).

A shift by $d$ is a point-to-point pair (`batch_isend_irecv` on `torch.distributed`) as the
ring's shift by one is, only with a partner $d$ ranks away: on a switched network (NVLink,
InfiniBand, HCCS) that costs the same; on a physical ring it would take $\min(d, P - d)$ hops.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from cpref.base.determinism import add_rows
from cpref.batch.layout import group_chunks, local_chunks
from cpref.batch.seqlens import Boundaries
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import AttentionKernel, Varlen, compute_dtype
from cpref.kernels.merge import merge_partial
from cpref.modes.ring_plan import Halo, RingCall, RingPlan, RingStep
from cpref.modes.shared import padded_rows
from cpref.modes.visible import chunk_pieces, chunk_real

__all__ = ["build_window_ring_plan", "build_piece_ring_plan", "halo_ring_plan", "reading_the_block", "window_distances",
           "Pairs", "piece_pairs", "visible_pairs", "halo_forward", "halo_backward"]

Real = Callable[[int, int, int], int]  # real(doc, a, z): the real tokens of positions [a, z) of document doc


def _pieces(b: Boundaries, P: int, rank: int, layout: str, group: int = 1) -> list[tuple[int, int, int, int]]:
    """`(doc, a, z, row)` of every piece ring member `rank` holds, in local order: positions `[a, z)` of document
    `doc` (padding included), at row `row` of its buffer. A member is a rank (`group = 1`,
    `cpref.batch.layout.local_chunks`) or, in the ring of `a2a+p2p`, a group of `group` ranks of a layout over
    `P group` ranks (`cpref.batch.layout.group_chunks`)."""
    if group == 1:
        chunks = local_chunks(b, cp_size=P, rank=rank, layout=layout)
    else:
        chunks = group_chunks(b, cp_size=P * group, group=group, g=rank, layout=layout)
    out, row = [], 0
    for doc, s, e in chunks:
        out.append((doc, s - b.padded[doc], e - b.padded[doc], row))
        row += e - s
    return out


def _sequences(real: Real, mine, theirs, slot: int, causal: bool, window: tuple[int, int]):
    """`(q_len, kv_len, shift, first key row)` of every sequence of the call over the sender's piece `slot` of each
    document: each local piece's real queries `[a, z)` against the keys of that piece within their window."""
    left, right = window[0], 0 if causal else window[1]
    held: dict[int, list] = {}
    for doc, a, z, row in theirs:
        held.setdefault(doc, []).append((a, z, row))
    out = []
    for doc, a, z, _ in mine:
        zr = a + real(doc, a, z)  # real query positions [a, zr)
        pieces = held.get(doc, [])
        if slot < len(pieces) and zr > a:
            k0, k1, row = pieces[slot]
            k1 = k0 + real(doc, k0, k1)  # the sender piece's real key positions [k0, k1)
            lo = k0 if left < 0 else max(k0, a - left)
            hi = k1 if right < 0 else min(k1, zr + right)
            if hi > lo:
                out += [(zr - a, hi - lo, a - lo, row + lo - k0), (z - zr, 0, 0, 0)]  # real, padding
                continue
        out.append((z - a, 0, 0, 0))  # the piece sees nothing of this sender piece
    return [seq for seq in out if seq[0]]


def _calls(real: Real, members, rank: int, source: int, causal: bool, window: tuple[int, int]) -> list[tuple[Varlen, torch.Tensor]]:
    """`(seqs, rows)` of every call of one step: one per sender piece slot some local query's window reaches;
    `rows` are the block's rows each call reads, in the original block's coordinates."""
    mine, theirs = members[rank], members[source]
    slots = max(Counter(doc for doc, *_ in theirs).values(), default=0)  # the most pieces of one document
    calls = []
    for slot in range(slots):
        seqs = _sequences(real, mine, theirs, slot, causal, window)
        if any(n_k for _, n_k, _, _ in seqs):
            rows = torch.cat([torch.arange(first, first + n_k) for _, n_k, _, first in seqs if n_k])  # (sum kv_len,)
            varlen = Varlen.from_lengths([n for n, *_ in seqs], [n_k for _, n_k, _, _ in seqs], [d for _, _, d, _ in seqs])
            calls.append((varlen, rows))
    return calls


def _members(b: Boundaries, P: int, layout: str, group: int) -> list[list[tuple[int, int, int, int]]]:
    """Every ring member's pieces (`_pieces`)."""
    b.check_divisible(layout, P * group)
    return [_pieces(b, P, r, layout, group) for r in range(P)]


class Pairs(NamedTuple):
    """The pairs of one document's query and key pieces that see each other (`piece_pairs`), one entry each: member
    `r`'s real queries `[a, zr)` see the keys `[lo, hi)` of member `s`'s piece that starts at position `k0` (its
    `slot`-th piece of the document, at row `row` of its block). All `(n,)` int64."""

    r: torch.Tensor
    s: torch.Tensor
    slot: torch.Tensor
    a: torch.Tensor
    zr: torch.Tensor
    k0: torch.Tensor
    row: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


def piece_pairs(real: Real, members, causal: bool, window: tuple[int, int]) -> Iterator[Pairs]:
    """Every pair of a query piece and a key piece of one document that see each other, a document at a time
    (`Pairs`): `_sequences`' sequences with keys, found in one sweep, as tensors.

    In a document's pieces in position order (their ends ascend too: pieces are disjoint), query piece $[a, z_r)$
    meets the key pieces from the first that ends past $a - w_l$ to the last that starts before $z_r + w_r$: two
    `searchsorted`s per query piece, then the ranges expanded into pairs. Asking every member about every distance
    instead (`_calls` for each of the P (P - 1) pairs, on every rank) grows with the square of the members."""
    left, right = window[0], 0 if causal else window[1]
    docs: dict[int, list[tuple[int, int, int, int, int]]] = {}  # doc -> [(a, real end, row, member, slot)]
    for m, pieces in enumerate(members):
        slots: Counter = Counter()
        for doc, a, z, row in pieces:
            docs.setdefault(doc, []).append((a, a + real(doc, a, z), row, m, slots[doc]))
            slots[doc] += 1
    for doc in sorted(docs):
        held = torch.tensor(docs[doc], dtype=torch.int64).view(-1, 5)  # (N, 5) in member-then-local order
        a, zr, row, m, slot = held.unbind(1)  # (N,) each: the pieces as queries and as keys
        by_end = torch.argsort(zr, stable=True)
        by_pos = by_end[torch.argsort(a[by_end], stable=True)]  # (N,) key pieces in position order (then end order)
        k0, k1 = a[by_pos], zr[by_pos]  # (N,)
        # 1) each query piece's key pieces [first, last) in position order
        first = torch.zeros_like(a) if left < 0 else torch.searchsorted(k1, a - left, right=True)  # (N,)
        last = torch.full_like(a, len(a)) if right < 0 else torch.searchsorted(k0, zr + right)  # (N,)
        counts = torch.where(zr > a, (last - first).clamp_min(0), 0)  # (N,) no real query: no pair
        # 2) expand: pair i of query piece q is key piece first[q] + i
        q = torch.repeat_interleave(torch.arange(len(a)), counts)  # (n,)
        k = by_pos[first[q] + torch.arange(len(q)) - (counts.cumsum(0) - counts)[q]]  # (n,)
        lo = a[k] if left < 0 else torch.maximum(a[k], a[q] - left)  # (n,)
        hi = zr[k] if right < 0 else torch.minimum(zr[k], zr[q] + right)  # (n,)
        keep = hi > lo
        q, k = q[keep], k[keep]
        yield Pairs(m[q], m[k], slot[k], a[q], zr[q], a[k], row[k], lo[keep], hi[keep])


def visible_pairs(real: Real, members, causal: bool, window: tuple[int, int]):
    """`piece_pairs` one pair at a time, as `(r, s, slot, a, zr, k0, row, lo, hi)`."""
    for pairs in piece_pairs(real, members, causal, window):
        yield from zip(*(x.tolist() for x in pairs))


def _halo_rows(real: Real, members, causal: bool, window: tuple[int, int], pairs=None) -> dict[int, list[int]]:
    """`{d: [|R_d(s)| for every member s]}` for every distance `d` in `1 .. P - 1` at which some member's queries see
    a key of the block `d` members back (the keys `D`; the values: the rows each block sends at `d`), from
    `piece_pairs` (or its `pairs`, already listed): the same pairs as `_calls` finds member by member
    (`tests/cp/test_windows.py` holds the two equal).

    A document's rows are its own rows of each block, so the union of the rows read is a sum over documents of each
    document's union; within one, the spans of a `(d, s)` in start order cover `end - max(start, the ends before)`
    rows each, where "the ends before" is a running maximum (the groups offset apart, so that one `cummax` serves all)."""
    P = len(members)
    total = torch.zeros(P * P, dtype=torch.int64)  # (d, s) flattened
    for p in pairs if pairs is not None else piece_pairs(real, members, causal, window):
        other = p.r != p.s
        group = ((p.r - p.s) % P * P + p.s)[other]  # (n,) d P + s
        start, end = (p.row + p.lo - p.k0)[other], (p.row + p.hi - p.k0)[other]  # (n,) rows of block s
        span = int(end.max()) + 1 if len(end) else 1
        start, order = torch.sort(group * span + start)  # (n,) the groups apart, each in start order
        end = (group * span + end)[order]
        before = torch.cat([start.new_full((1,), -1), end.cummax(0).values[:-1]])  # (n,) the furthest end before
        total.index_add_(0, group[order], (end - torch.maximum(start, before)).clamp_min(0))
    total = total.view(P, P)  # (d, s)
    return {d: total[d].tolist() for d in range(1, P) if bool(total[d].any())}


def _distances(real: Real, members, causal: bool, window: tuple[int, int]) -> tuple[int, ...]:
    return tuple(_halo_rows(real, members, causal, window))


def window_distances(b: Boundaries, P: int, layout: str, causal: bool, window: tuple[int, int],
                     group: int = 1) -> tuple[int, ...]:  # fmt: skip
    """`D`: the distances `d` in `1 .. P - 1` at which some member's queries see a key of the block of member `r - d`."""
    return _distances(b.real_in, _members(b, P, layout, group), causal, window)


def build_window_ring_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, window: tuple[int, int],
                           device: torch.device, group: int = 1, chunk: int | None = None) -> RingPlan:  # fmt: skip
    """The steps of ring member `rank` (of `P`; each a group of `group` ranks, see `_pieces`), one per distance in
    `(0, *D)`, and the rows each shift carries (module docstring); with `chunk`, each chunk of a document a
    document of its own (`cpref.modes.visible`)."""
    return build_piece_ring_plan(b.real_in, _members(b, P, layout, group), rank, causal, window, device, chunk)


def build_piece_ring_plan(real: Real, members, rank: int, causal: bool, window: tuple[int, int],
                          device: torch.device, chunk: int | None = None) -> RingPlan:  # fmt: skip
    """`build_window_ring_plan` over given members: `members[r]` the pieces `(doc, a, z, row)` member `r` holds
    in local order, `real(doc, a, z)` the real tokens of positions `[a, z)` of `doc` (every member's buffer
    equally long); with `chunk`, the pieces cut at the chunks (`cpref.modes.visible.chunk_pieces`)."""
    if chunk is not None:
        real, members = chunk_real(real), [chunk_pieces(pieces, chunk) for pieces in members]
    P = len(members)
    if P == 1:  # a ring of one member: its one call reads the own block as it is (no halo, no copy, no merge)
        calls = _calls(real, members, rank, rank, causal, window)
        whole = reading_the_block(*calls[0], _rows(members[0])) if len(calls) == 1 else None
        if whole is not None:
            return RingPlan((RingStep(rank, (RingCall(whole, causal, None, window),)),))
    halo = _halo_rows(real, members, causal, window)

    def calls_of(r: int, s: int) -> list[tuple[Varlen, torch.Tensor, bool, tuple[int, int]]]:
        return [(seqs, rows, causal, window) for seqs, rows in _calls(real, members, r, s, causal, window)]

    return halo_ring_plan(calls_of, P, rank, halo, device)


Calls = Callable[[int, int], list[tuple[Varlen, torch.Tensor, bool, tuple[int, int]]]]


def halo_ring_plan(calls_of: Calls, P: int, rank: int, halo: dict[int, list[int]], device: torch.device) -> RingPlan:
    """The steps of member `rank` and the rows each shift carries, from `calls_of(r, s)`: the calls of member `r`'s
    queries against member `s`'s block, `(seqs, rows of the block, causal, window)` each; `halo`: `{d: [|R_d(s)| for
    every s]}` for the distances where some member reads (`_halo_rows`). A step per distance in `(0, *halo)`."""
    shifts = (0, *halo)

    @functools.cache
    def reads(r: int, d: int) -> torch.Tensor:
        """`R_d(r - d)`: the rows of the block of rank `r - d` that rank `r`'s calls read (sorted, unique)."""
        rows = [rows for _, rows, _, _ in calls_of(r, (r - d) % P)]
        return torch.unique(torch.cat(rows)) if rows else torch.zeros(0, dtype=torch.int64)

    steps = []
    for d in shifts:
        held = reads(rank, d) if d else None  # None: the whole own block
        calls = []
        for seqs, rows, causal, window in calls_of(rank, (rank - d) % P):
            local = rows if held is None else torch.searchsorted(held, rows)  # positions among the rows received
            calls.append(RingCall(seqs, causal, local.to(device), window))
        steps.append(RingStep((rank - d) % P, tuple(calls)))
    sizes = (0, *(max(halo[d]) for d in shifts[1:]))  # a shift's rows, on every rank: the largest R_d
    send = (None, *(reads((rank + d) % P, d).to(device) for d in shifts[1:]))  # own rows rank r + d reads
    return RingPlan(tuple(steps), Halo(shifts, send, sizes))


def _rows(pieces) -> int:
    """The rows of a member's buffer: its pieces, padding included."""
    return pieces[-1][3] + pieces[-1][2] - pieces[-1][1] if pieces else 0


def reading_the_block(seqs: Varlen, rows: torch.Tensor, n: int) -> Varlen | None:
    """A call over `block[rows]` (each sequence's keys one run of consecutive rows, `_calls`) rewritten to read the
    `n`-row block as it is: each run of rows no sequence reads becomes the keys of a sequence without queries (no
    work, as the split Ulysses' padding keys), so the kernel takes the block itself, no `index_select`. None if the
    runs do not come in increasing order."""
    lens, cursor = [], 0  # (q_len, kv_len, shift) of every sequence; the first block row not yet covered
    for i in range(len(seqs.cu_q) - 1):
        n_q, n_k = seqs.cu_q[i + 1] - seqs.cu_q[i], seqs.cu_kv[i + 1] - seqs.cu_kv[i]
        if n_k:
            first = int(rows[seqs.cu_kv[i]])  # its keys: block rows [first, first + n_k)
            if first < cursor:
                return None
            lens += [(0, first - cursor, 0)] if first > cursor else []
            cursor = first + n_k
        lens.append((n_q, n_k, seqs.shifts[i] if seqs.shifts is not None else n_k - n_q))  # None: bottom-right
    lens += [(0, n - cursor, 0)] if n > cursor else []
    if not lens:
        return None
    q_lens, kv_lens, shifts = zip(*lens)
    # shifts every sequence has anyway (bottom-right: kv_len - q_len) are left implicit: the kernel's plain path
    implicit = all(not q or not k or d == k - q for q, k, d in lens)
    return Varlen.from_lengths(q_lens, kv_lens, None if implicit else shifts)


def _outgoing(kv: torch.Tensor, halo: Halo, t: int) -> torch.Tensor:
    """The own rows `R_d` of step `t`'s distance, zero-padded to the shift's size: `(m_d, Hkv, D + Dv)`."""
    return padded_rows(kv, halo.send[t], halo.sizes[t])  # (m_d, Hkv, D + Dv)


def _block(kv: torch.Tensor, call: RingCall, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = kv.index_select(0, call.kv_index)  # (T', Hkv, D + Dv): the call's keys, in order
    return kv[..., :d], kv[..., d:]


def _post(own: torch.Tensor, halo: Halo, t: int, comm: Collectives):
    """Start step `t`'s shift of the own rows it needs (None past the last step)."""
    return comm.send_recv_async(_outgoing(own, halo, t), halo.shifts[t]) if t < len(halo.shifts) else None


# --8<-- [start:forward]
def halo_forward(q, k, v, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float, out_dtype=None):
    """Forward of the windowed ring: `(out (T_l, Hq, Dv), lse (T_l, Hq))`, out in `out_dtype` (default: q's)."""
    acc, d, halo = compute_dtype(q.dtype), k.shape[-1], plan.halo
    out = lse = None
    own = kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv): the own block, whole
    for t, step in enumerate(plan.steps):
        # 1) start the next distance's shift of the own rows its reader needs, before computing on this block
        pending = _post(own, halo, t + 1, comm)  # (m_d, Hkv, D + Dv) arrives from rank r - d
        # 2) every call of the step, merged by log-sum-exp in float32
        for call in step.calls:
            out_b, lse_b = kernel.forward(q, *_block(kv, call, d), call.seqs, causal=call.causal, window=call.window,
                                          scale=scale, out_dtype=acc)  # fmt: skip
            if out is None:
                out, lse = out_b, lse_b
            else:
                merge_partial(out, lse, out_b, lse_b)
        if pending is not None:
            kv = pending.wait()  # (m_d, Hkv, D + Dv): R_d of the block of rank r - d, then zeros
    if out is None:  # no call at all: this rank holds only padding (out 0, lse -inf)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    return out.to(out_dtype or q.dtype), lse
# --8<-- [end:forward]


# --8<-- [start:backward]
def halo_backward(dout, q, k, v, out, lse, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float,
                  kv_grad_dtype=None, deterministic: bool = False):  # fmt: skip
    """Backward of the windowed ring: `(dq, dk, dv)`, dK/dV in `kv_grad_dtype` (default: their dtypes);
    `deterministic`: duplicated rows summed in occurrence layers (`cpref.base.determinism`)."""
    acc, d, halo = compute_dtype(q.dtype), k.shape[-1], plan.halo
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (T_l, Hq, D), stays home
    own = kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv)
    grad = torch.zeros(own.shape, dtype=acc, device=own.device)  # (T_l, Hkv, D + Dv): the own block's dK/dV
    returning = None  # (step, handle): the shares of the own rows, on their way back from rank r + d
    for t, step in enumerate(plan.steps):
        pending = _post(own, halo, t + 1, comm)
        # 1) this block's share, one call at a time, at the rows received (the whole block at t = 0)
        share = grad if t == 0 else torch.zeros(kv.shape, dtype=acc, device=kv.device)  # (m_d, Hkv, D + Dv)
        for call in step.calls:
            dq_b, dk_b, dv_b = kernel.backward(dout, q, *_block(kv, call, d), out, lse, call.seqs, causal=call.causal,
                                               window=call.window, scale=scale, grad_dtype=acc)  # fmt: skip
            dq.add_(dq_b)
            add_rows(share, call.kv_index, torch.cat([dk_b, dv_b], dim=-1), deterministic=deterministic)
        # 2) a received block's share goes straight back to its owner, d ranks back (one shift by -d)
        if t > 0:
            _land(grad, halo, returning)
            returning = (t, comm.send_recv_async(share, comm.size - halo.shifts[t]))  # arrives from rank r + d
        if pending is not None:
            kv = pending.wait()
    _land(grad, halo, returning)  # 3) the last shares come home
    return dq.to(q.dtype), grad[..., :d].to(kv_grad_dtype or k.dtype), grad[..., d:].to(kv_grad_dtype or v.dtype)
# --8<-- [end:backward]


def _land(grad: torch.Tensor, halo: Halo, returning) -> None:
    """Add a returned share at the own rows `R_d` it covers (the rows past them are padding)."""
    if returning is not None:
        t, handle = returning
        grad.index_add_(0, halo.send[t], handle.wait()[: len(halo.send[t])])
