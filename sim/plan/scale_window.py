r"""Irregular plans at scale: windows, chunks, and the stream and balanced layouts, built for every rank at once.

Under a sliding window or chunked attention, and in the `stream` and `balanced` layouts with any
mask, `p2p` runs the ring of [`cpref.modes.ring_window`][cpref.modes.ring_window]: one step per
distance $d \in (0, \mathcal{D})$, at each a call per piece *slot* of the sender, and shifts that
carry only the rows a rank reads. Its plan is irregular (halos, pieces cut at chunks, pieces of a
stream), so the closed forms of [`sim.plan.scale`][sim.plan.scale] do not apply; but every
amount is a sum over the pairs of a query piece and a key piece that see each other, which the
mode's own [`piece_pairs`][cpref.modes.ring_window.piece_pairs] yields in one sweep over the
documents. [`piece_ring_schedule`][sim.plan.scale_window.piece_ring_schedule] sums them into
every rank's calls at once:

* a pair of member $r$'s real queries $[a, z_r)$ and member $s$'s keys $[\mathrm{lo}, \mathrm{hi})$
  is one sequence of the call of rank $r$ at distance $d = (r - s) \bmod P$ and the key piece's
  slot: $n_q = z_r - a$ queries, $n_k = \mathrm{hi} - \mathrm{lo}$ keys at shift $a - \mathrm{lo}$, whose work,
  rows that see a key and band width are the kernel contract's closed forms
  ([`Varlen.work`][cpref.kernels.contract.Varlen.work]); a call's keys are its sequences' keys;
* the shifts' sizes $m_d$ are the plan's own (`_halo_rows`, the same sweep);
* the timeline is the one `halo_forward` and `halo_backward` write, the same on every rank:
  forward, the next distance's shift posted before a step's calls and waited after them;
  backward, the same K/V shifts, and after each step past the first the previous step's dK/dV
  share waited for and this one's posted back ($-d$).

The sequences without keys (a query piece the sender's piece does not reach, padding) add rows
to no count the time model reads, so only the pairs are summed.

`a2a+p2p` under a window or chunks, in the contiguous and zigzag layouts, runs the same ring across
its groups of `a2a_size` ranks, each member a group holding its ranks' pieces
([`cpref.batch.layout.group_chunks`][cpref.batch.layout.group_chunks]), on the heads the exchange
leaves a rank, inside the hierarchy's exchanges ([`hierarchy_template`][sim.plan.schedule.hierarchy_template],
in one head group or several): every rank of a group makes its group's calls.

`all_gather` on the pieces' plan ([`cpref.modes.all_gather_pieces`][cpref.modes.all_gather_pieces]:
chunks in every layout, the stream and balanced layouts with any mask) makes one call per rank, a
sequence per piece, from the plan's own sequences of every rank
([`piece_sequences`][cpref.modes.all_gather_pieces.piece_sequences]), and gathers `m` rows per rank
([`piece_reads`][cpref.modes.all_gather_pieces.piece_reads], which finds the rows others read without listing
every read; none at all where no rank reads another's: `m = 0`;
[`piece_all_gather_schedule`][sim.plan.scale_window.piece_all_gather_schedule]).

`tests/plan/test_scale.py` holds every rank's whole run of each to the dry run's, event by event,
at P = 2 to 8, in every layout, with windows, chunks and neither, and `a2a+p2p`'s at every
`a2a_size`, with and without head groups.

**Cost.** The build is linear in the pairs of pieces that see each other, in array operations: `piece_pairs` finds
a document's pairs with two `searchsorted`s per query piece, their amounts are closed forms over arrays
([`sequence_amounts`][sim.plan.dry.sequence_amounts]), and the shifts of a distance are one column of
[`RingShifts`][sim.plan.schedule.RingShifts], priced once per pair of link levels. A window much wider than the
chunks still makes many pairs: at P = 1024 the zigzag ring under a window of 1024 cuts short documents into chunks
of a few tokens, so its plan has a pair for every chunk a window reaches and a shift for nearly every distance,
where the full-causal ring's closed forms have one formula per step.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from cpref.base.errors import CPInputError
from cpref.kernels.contract import _visible_sum, compute_dtype
from cpref.modes.ring_window import _halo_rows, _members, piece_pairs
from cpref.modes.visible import chunk_pieces, chunk_real
from sim.plan.dry import Collective, sequence_amounts, sequence_width
from sim.plan.scale import _saved, overlap_amounts, validate
from sim.plan.schedule import (
    RingShifts,
    Schedule,
    Slot,
    _Template,
    exchange_kinds,
    hierarchy_template,
    overlap_template,
)

__all__ = ["piece_ring_schedule", "piece_ring_covers", "piece_ring_parts", "piece_ring_timeline", "piece_all_gather_schedule",
           "piece_all_gather_covers"]


def _checked(mode: str, sharding: Any, heads, dtype: torch.dtype, causal: bool, window: tuple[int, int],
             chunk: int | None, options: dict[str, Any], covers) -> None:  # fmt: skip
    """Refuse as `cpref.attention` refuses (`sim.plan.scale.validate`), then a candidate `covers` does not cover, by
    name: a builder must not build another mode's schedule."""
    mask = {k: v for k, v in (("window", tuple(window)), ("chunk", chunk)) if v not in ((-1, -1), None)}
    validate(mode, sharding, heads, dtype, {**mask, **options, **({} if causal else {"causal": False})})
    if not causal or not covers(mode, sharding.layout, options, sharding.cp_size, mask):
        raise CPInputError(f"mode {mode!r} over {sharding.layout!r} with {options} and {mask or 'full causal'} at "
                           f"P = {sharding.cp_size} is not built here (see {covers.__name__}): build it with "
                           "sim.plan.scale.schedule or dry-run it with sim.plan.dry.dry_run")  # fmt: skip


def piece_ring_covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `piece_ring_schedule` builds the candidate: `p2p` at P >= 2 on the piece ring (under a window or chunks,
    or in the stream and balanced layouts); `a2a+p2p` (any `a2a_size` below P, with or without head groups) under
    a window or chunks in the contiguous and zigzag layouts, whose ring across the groups is the same ring over
    the groups' pieces."""
    from cpref.batch.seqlens import CHUNKED_LAYOUTS

    masked = bool(mask.get("chunk")) or mask.get("window", (-1, -1)) != (-1, -1)
    if P < 2 or not set(mask) <= {"window", "chunk"}:
        return False
    if mode == "p2p":
        return not options and (masked or layout not in CHUNKED_LAYOUTS)
    return mode == "a2a+p2p" and masked and layout in CHUNKED_LAYOUTS and 1 < options.get("a2a_size", 1) < P


def piece_ring_schedule(sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype, causal: bool = True,
                        window: tuple[int, int] = (-1, -1), chunk: int | None = None, a2a_size: int = 1,
                        head_groups: int = 1) -> Schedule:  # fmt: skip
    """Every rank of `p2p` on the piece ring, or of `a2a+p2p` whose ring across groups of `a2a_size` ranks is one
    (module docstring), as a `sim.plan.schedule.Schedule`.

    Raises:
        CPInputError: as `cpref.attention` refuses the call, naming the value; or for a candidate
            `piece_ring_covers` does not cover (dry-run it instead).
    """
    mode = "a2a+p2p" if a2a_size > 1 else "p2p"
    options = {"a2a_size": a2a_size, "head_groups": head_groups} if a2a_size > 1 else {}
    if a2a_size == 1 and head_groups != 1:
        options = {"head_groups": head_groups}
    _checked(mode, sharding, heads, dtype, causal, window, chunk, options, piece_ring_covers)
    b, P, layout, local = sharding.bounds, sharding.cp_size, sharding.layout, sharding.local_tokens
    hq, hkv, d, dv = heads
    a, n = a2a_size, head_groups
    p, replicas = P // a, 1 if hkv % a == 0 else a // hkv
    h_kv, h_q, rows_a = hkv * replicas // (a * n), hq // (a * n), a * local  # per rank and head group
    # 1) the shifts' sizes, then the pairs summed into each (ring member, step, slot)'s call
    members, halo, shifts, member = _piece_ring(b, p, layout, a, chunk, causal, window)  # member: (4, p, T*S)
    T, S = len(shifts), _slots(members)
    made = member[2] > 0  # a call is made where it has keys
    # 2) the collectives: the exchanges inside the group (kinds 0 .. 6, a2a+p2p), then per distance t >= 1 the
    #    ring's K/V shift (kind K + 2 (t - 1)) and its dK/dV share back (K + 2 (t - 1) + 1)
    f = compute_dtype(dtype)
    K = 7 if a > 1 else 0
    grad_kv = f if replicas > 1 else dtype
    head = tuple(exchange_kinds(r, a, rows_a, heads, h_q, h_kv, dtype, grad_kv) if a > 1 else () for r in range(P))
    moved = [((max(halo[dist]), h_kv, d + dv), dt, shift) for dist in shifts[1:]
             for dt, shift in ((dtype, dist), (f, p - dist))]  # fmt: skip
    kinds = RingShifts(head, a, *(tuple(x) for x in zip(*moved))) if moved else RingShifts(head, a, (), (), ())

    # 3) the timeline: halo_forward's and halo_backward's ring, inside the hierarchy's exchanges
    tl = _Template()
    hierarchy_template(tl, n, a > 1, piece_ring_timeline(T, S, K, lambda c, phase: (c + n * (phase == "backward")) * T * S),
                       kind=0)  # fmt: skip
    band = window != (-1, -1)
    slots = tuple(Slot(direction, h_q, h_kv, d, dv, band) for direction in ("forward", "backward")
                  for _ in range(n * T * S))  # fmt: skip
    g = np.arange(P) // a  # each rank's ring member
    every = lambda x: np.concatenate([x[g]] * (2 * n), axis=1)  # noqa: E731  per rank; every head group, both ways
    options = {"a2a_size": a, "head_groups": n} if a > 1 else {}
    sizes = tuple(max(halo[dist]) for dist in shifts[1:])
    saved = np.full(P, _saved("a2a+p2p" if a > 1 else "p2p", P, local, heads, dtype,
                              {**options, "halo_sizes": (0, *sizes)}), dtype=np.int64)  # fmt: skip
    return Schedule(P, tuple(tl.events), kinds, slots, every(member[0]),
                    np.full((P, 2 * n * T * S), rows_a, dtype=np.int64), every(member[2]), every(member[1]), every(made),
                    saved, every(member[3]) if band else None)  # fmt: skip


@functools.lru_cache(maxsize=2)
def _piece_ring(b, p: int, layout: str, a: int, chunk: int | None, causal: bool,
                window: tuple[int, int]) -> tuple[list, dict, tuple, np.ndarray]:  # fmt: skip
    """`(members, *piece_ring_parts)` of the ring over `p` members of `a` ranks each: cached for the next candidate
    (the planner asks for a2a+p2p's head groups right after the same ring without them). Read it, never change it:
    the amounts are read-only."""
    real, members = chunk_real(b.real_in), [chunk_pieces(m, chunk) for m in _members(b, p, layout, a)]
    halo, shifts, amounts = piece_ring_parts(real, members, causal, window)
    amounts.setflags(write=False)
    return members, halo, shifts, amounts


def piece_ring_parts(real, members, causal: bool, window: tuple[int, int]) -> tuple[dict, tuple, np.ndarray]:
    """`(halo, shifts, amounts)` of the ring over `members`' pieces: the rows each block sends at each distance
    (`_halo_rows`), the distances of its steps `(0, *halo)`, and `(4, p, T S)` the work, rows seeing a key, keys
    and band width of each member's call at each step and slot (`_call_amounts`)."""
    halo = _halo_rows(real, members, causal, window)
    shifts = (0, *halo)
    return halo, shifts, _call_amounts(real, members, causal, window, shifts)


def piece_ring_timeline(T: int, S: int, K: int, first: Callable[[int, str], int]) -> Callable[[_Template, int, str], None]:
    """The ring over pieces as `halo_forward` and `halo_backward` run it, for `hierarchy_template`: `T` steps of `S`
    calls (slots from `first(head group, phase)`); forward, the next distance's K/V shift (kind `K + 2 t`) posted
    before a step's calls and waited after them; backward, the same, and after each step past the first the previous
    step's dK/dV share waited for and this one's posted back (kind `K + 2 (t - 1) + 1`)."""

    def ring(tl: _Template, c: int, phase: str) -> None:
        start, returning = first(c, phase), -1
        for t in range(T):
            pending = tl.post(K + 2 * t) if t + 1 < T else -1
            for slot in range(S):
                tl.call(start + t * S + slot)
            if phase == "backward" and t > 0:
                if returning >= 0:
                    tl.wait(returning)
                returning = tl.post(K + 2 * (t - 1) + 1)
            if pending >= 0:
                tl.wait(pending)
        if returning >= 0:
            tl.wait(returning)

    return ring


def _slots(members) -> int:
    """The most pieces one member holds of one document: the ring's calls per step (one per sender piece slot)."""
    return max((max(Counter(doc for doc, *_ in pieces).values(), default=0) for pieces in members), default=0)


def _call_amounts(real, members, causal: bool, window: tuple[int, int], shifts: tuple[int, ...]) -> np.ndarray:
    """`(4, p, T S)` int64: the work, rows seeing a key, keys and band width of each ring member's call at each step
    `t` (distance `shifts[t]`) and sender piece slot, summed over `piece_pairs` a document at a time (a pair is a
    sequence of the call, its amounts in closed form over arrays: `sim.plan.dry.sequence_amounts`)."""
    p, T, S = len(members), len(shifts), _slots(members)
    left, right = window[0], 0 if causal else window[1]
    step = np.full(p, -1, dtype=np.int64)
    step[list(shifts)] = np.arange(T)  # the step of each distance
    out = np.zeros((4, p * T * S), dtype=np.int64)
    for pairs in piece_pairs(real, members, causal, window):
        r, s, slot, a0, zr, _, _, lo, hi = (x.numpy() for x in pairs)  # (n,) each
        if not len(r):
            continue
        n_q, n_k, shift = zr - a0, hi - lo, a0 - lo  # (n,) each pair's sequence
        work, rows, width = sequence_amounts(shift, n_q, n_k, left, right)  # (n,) each
        call = (r * T + step[(r - s) % p]) * S + slot  # (n,) the call each pair is a sequence of
        for i, x in enumerate((work, rows, n_k)):  # sums (exact below 2^53)
            out[i] += np.bincount(call, weights=x, minlength=out.shape[1]).astype(np.int64)
        np.maximum.at(out[3], call, width)  # band width: the widest sequence
    return out.reshape(4, p, T * S)


def piece_all_gather_covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `piece_all_gather_schedule` builds the candidate: `all_gather` on the pieces' plan (under chunks, or
    in the stream and balanced layouts), with `overlap` or `save_gathered_kv` (not both)."""
    from cpref.batch.seqlens import CHUNKED_LAYOUTS

    pieces = bool(mask.get("chunk")) or layout not in CHUNKED_LAYOUTS
    return (mode == "all_gather" and P >= 2 and pieces and set(mask) <= {"window", "chunk"}
            and not (options.get("overlap") and options.get("save_gathered_kv")))  # fmt: skip


def piece_all_gather_schedule(sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype,
                              causal: bool = True, window: tuple[int, int] = (-1, -1),
                              chunk: int | None = None, save_gathered_kv: bool = False,
                              overlap: bool = False) -> Schedule:  # fmt: skip
    """Every rank of `all_gather` on the pieces' plan (`cpref.modes.all_gather_pieces`): from the plan's own reads of
    every rank, each rank's one call (a sequence per piece: its real queries against the keys `[lo, hi)` its reads
    cover) and the gathers of `m` rows, as a `sim.plan.schedule.Schedule`.

    Raises:
        CPInputError: as `cpref.attention` refuses the call; or for a candidate `piece_all_gather_covers` does not
            cover.
    """
    from cpref.modes.all_gather_pieces import piece_reads, piece_sequences

    options = {k: True for k, on in (("save_gathered_kv", save_gathered_kv), ("overlap", overlap)) if on}
    _checked("all_gather", sharding, heads, dtype, causal, window, chunk, options, piece_all_gather_covers)

    b, P, local = sharding.bounds, sharding.cp_size, sharding.local_tokens
    hq, hkv, d, dv = heads
    _, _, m = piece_reads(b, P, sharding.layout, causal, window, chunk, ranks=())  # no rank's rows: only m
    if overlap and m:
        return _piece_overlap_schedule(sharding, heads, dtype, causal, chunk, m)
    left, right = window[0], 0 if causal else window[1]
    amounts, priced = np.zeros((4, P), dtype=np.int64), {}  # work, rows seeing a key, keys, band width
    for r, seqs in enumerate(piece_sequences(b, P, sharding.layout, causal, window, chunk)):
        for n_q, n_k, shift in seqs:
            if (shift, n_q, n_k) not in priced:
                rows, work = _visible_sum(shift, n_q, n_k, left, right)
                priced[shift, n_q, n_k] = (work, rows, sequence_width(shift, n_q, n_k, left, right))
            work, rows, width = priced[shift, n_q, n_k]
            amounts[:3, r] += (work, rows, n_k)
            amounts[3, r] = max(amounts[3, r], width)
    f, group = compute_dtype(dtype), tuple(range(P))
    kinds = tuple((Collective("all_gather", group, r, (m, hkv, d), dtype),
                   Collective("all_gather", group, r, (m, hkv, dv), dtype),
                   Collective("reduce_scatter", group, r, (P * m, hkv, d), f),
                   Collective("reduce_scatter", group, r, (P * m, hkv, dv), f)) if m else () for r in range(P))  # fmt: skip
    tl = _Template()  # no row read across ranks (m = 0): no collective at all
    for phase in ("forward", "backward"):
        tl.phase = phase
        if m and (phase == "forward" or not save_gathered_kv):  # saved: the backward gathers nothing
            tl.blocking(0)
            tl.blocking(1)
        tl.call(0 if phase == "forward" else 1)
    if m:
        tl.blocking(2)
        tl.blocking(3)
    band = window != (-1, -1)
    slots = (Slot("forward", hq, hkv, d, dv, band), Slot("backward", hq, hkv, d, dv, band))
    both = lambda x: np.repeat(x[:, None], 2, axis=1)  # noqa: E731  the backward's call is the forward's
    saved = np.array([_saved("all_gather", P, local, heads, dtype, {"gathered_rows": m, **options,
                                                                    **({"selected_kv_rows": int(x)} if save_gathered_kv else {})})
                      for x in amounts[2]], dtype=np.int64)  # with save_gathered_kv, per rank: its call's keys kept
    return Schedule(P, tuple(tl.events), kinds, slots, both(amounts[0]), np.full((P, 2), local, dtype=np.int64),
                    both(amounts[2]), both(amounts[1]), np.ones((P, 2), dtype=bool), saved,
                    both(amounts[3]) if band else None)  # fmt: skip


def _piece_overlap_schedule(sharding: Any, heads: tuple[int, int, int, int], dtype: torch.dtype, causal: bool,
                            chunk: int | None, m: int) -> Schedule:  # fmt: skip
    """`all_gather` with `overlap=True` on the pieces' plan (`m > 0` rows gathered; `cpref.modes.all_gather_overlap`):
    each sequence of the plan split into the keys the rank holds and the others', the local call's halves by the
    mode's own `_halves`; the gathers and reduce-scatters of `m` rows around them (`sim.plan.schedule.overlap_template`)."""
    b, P, local = sharding.bounds, sharding.cp_size, sharding.local_tokens
    hq, hkv, d, dv = heads
    out = [np.zeros((P, 5), dtype=np.int64) for _ in range(3)] + [np.zeros((P, 5), dtype=bool)]
    for r, lens in enumerate(_overlap_lengths(b, P, sharding.layout, causal, chunk)):
        for i, x in enumerate(overlap_amounts(lens, causal)):
            out[i][r] = x
    f, group = compute_dtype(dtype), tuple(range(P))
    kinds = tuple((Collective("all_gather", group, r, (m, hkv, d), dtype),
                   Collective("all_gather", group, r, (m, hkv, dv), dtype),
                   Collective("reduce_scatter", group, r, (P * m, hkv, d), f),
                   Collective("reduce_scatter", group, r, (P * m, hkv, dv), f)) for r in range(P))  # fmt: skip
    tl = _Template()
    overlap_template(tl)
    slots = tuple(Slot(direction, hq, hkv, d, dv) for direction in ("forward",) * 2 + ("backward",) * 3)
    saved = np.full(P, _saved("all_gather", P, local, heads, dtype, {"gathered_rows": m, "overlap": True}), dtype=np.int64)
    return Schedule(P, tuple(tl.events), kinds, slots, out[0], np.full((P, 5), local, dtype=np.int64), out[2], out[1],
                    out[3], saved)  # fmt: skip


def _overlap_lengths(b, P: int, layout: str, causal: bool, chunk: int | None) -> list[list[tuple[int, int, int]]]:
    """Per rank, `(n_q, local keys, remote keys)` of each sequence of its pieces' plan in order (a piece's real
    queries, then its padding as `(n_pad, 0, 0)`): a piece's keys `[lo, hi)` are its document's, the local ones those
    of the rank's own pieces of the document, counted from the positions (no rows listed)."""
    from cpref.modes.all_gather_pieces import _keys, _pieces

    pieces, _ = _pieces(b, P, layout, chunk)
    out = []
    for mine in pieces:
        own: dict = {}
        for key, a, z, _ in mine:
            own.setdefault(key, []).append((a, z))
        lens = []
        for key, a, z, _ in mine:
            zr, lo, hi = _keys(b, key, a, z, causal, (-1, -1), chunk)
            if zr > a:
                near = sum(max(0, min(hi, pz) - max(lo, pa)) for pa, pz in own[key])
                lens.append((zr - a, near, hi - lo - near))
            if z > zr:
                lens.append((z - zr, 0, 0))
        out.append(lens)
    return out
