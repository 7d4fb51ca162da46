r"""Ulysses and the hierarchy over the stream and balanced layouts at scale: own rows at home, shared rows exchanged.

Over `stream` and `balanced`, `a2a` runs the split of [`cpref.modes.ulysses_split`][cpref.modes.ulysses_split]:
each rank attends the documents it holds whole (its *own* rows) with all heads and no communication, and only the
documents whose tokens span ranks (or that the balance moves) take Ulysses' exchange, on the $m$ rows every rank
pads its shared rows to. Unlike Ulysses over the chunked layouts, the ranks differ (their own documents), so no
rank's dry run stands for the others; but every amount is a sum over whole documents, from the boundaries alone.
[`split_a2a_schedule`][sim.plan.scale_split.split_a2a_schedule] builds every rank at once:

* the documents exchanged, by the mode's own rule ([`exchanged_docs`][cpref.modes.ulysses_split.exchanged_docs],
  balance included);
* rank $r$'s own call: the sequences of its own documents' pieces
  ([`document_sequences`][cpref.modes.shared.document_sequences]), all heads;
* the shared call, the same on every rank: the exchanged documents' sequences in order and the padding slots,
  over $P m$ rows of $H_q / P$ query heads (and the key/value heads the exchange leaves, replicated where
  $H_{kv} < P$), with the exchange's seven all-to-alls ([`exchange_kinds`][sim.plan.schedule.exchange_kinds]) on
  $P m$ rows;
* the timeline the Function writes: the own call, then the exchange blocking around the shared call, each way; in
  head groups, the pipeline of the hierarchy with the own call after the posts
  ([`cpref.modes.ulysses_pipeline`][cpref.modes.ulysses_pipeline]);
* the saved tensors: the own rows' q, k, v, output and lse, and the exchange's per group.

`a2a+p2p` over the same layouts ([`cpref.modes.hierarchical_split`][cpref.modes.hierarchical_split],
[`split_hierarchy_schedule`][sim.plan.scale_split.split_hierarchy_schedule]) splits the rows the same way, with
the balance inside each a2a group of `a` ranks; the shared rows take the exchange inside the group, on $a m$ rows,
and then the ring across the $P / a$ groups, each group a ring member holding its shared pieces in stream order and
its padding slots (which see nothing): the ring over pieces of [`sim.plan.scale_window`][sim.plan.scale_window]
(`piece_ring_parts`, `piece_ring_timeline`) over those members. The own call comes first in each phase (in head
groups, after the posts), as in the split Ulysses.

`tests/plan/test_scale.py` holds every rank's whole run of both to the dry run's, event by event, at P = 2 to 8,
with windows, chunks, head groups, replicated key/value heads and `balance` on and off.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from cpref.batch.layout import local_chunks
from cpref.kernels.contract import compute_dtype
from cpref.modes.hierarchical_split import group_members
from cpref.modes.shared import document_sequences, head_split
from cpref.modes.ulysses_split import exchanged_docs
from cpref.modes.visible import chunk_pieces, chunk_real
from sim.plan.dry import sequence_amounts
from sim.plan.scale import _saved
from sim.plan.scale_window import _checked, _slots, piece_ring_parts, piece_ring_timeline
from sim.plan.schedule import (
    RingShifts,
    Schedule,
    Slot,
    _grouped_template,
    _Template,
    exchange_kinds,
    hierarchy_template,
)

__all__ = ["split_a2a_covers", "split_a2a_schedule", "split_hierarchy_covers", "split_hierarchy_schedule"]


def split_a2a_covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `split_a2a_schedule` builds the candidate: `a2a` over `stream` or `balanced` at P >= 2, under a
    window, chunks or neither, in one head group or several, balanced or not."""
    return mode == "a2a" and layout in ("stream", "balanced") and P >= 2 and set(mask) <= {"window", "chunk"} \
        and set(options) <= {"head_groups", "balance"}


def _amounts(lens: list[tuple[int, int]], left: int, right: int, owner: list[int] | None = None,
             calls: int = 1) -> np.ndarray:  # fmt: skip
    """`(calls, 5)` int64: `(work, rows seeing a key, q rows, kv rows, band width)` of each call over its sequences
    (`lens`, sequence `i` in call `owner[i]`, all in call 0 without `owner`), bottom-right: a sequence with keys is a
    document or chunk attending itself."""
    n_q, n_k = (np.array(x, dtype=np.int64) for x in zip(*lens)) if lens else (np.zeros(0, np.int64),) * 2
    call = np.zeros(len(n_q), dtype=np.int64) if owner is None else np.array(owner, dtype=np.int64)
    work, rows, width = sequence_amounts(n_k - n_q, n_q, n_k, left, right)
    out = np.zeros((calls, 5), dtype=np.int64)
    for i, x in enumerate((work, rows, n_q, n_k)):
        out[:, i] = np.bincount(call, weights=x, minlength=calls)  # sums (exact below 2^53)
    np.maximum.at(out[:, 4], call, width)
    return out


def _own_calls(b, P: int, layout: str, shared: set[int], chunk: int | None, left: int,
               right: int) -> tuple[np.ndarray, list[int]]:  # fmt: skip
    """`(P, 5)`: each rank's own rows' call (`_amounts` of the pieces of the documents not in `shared`), and each
    rank's shared rows."""
    lens, owner, shared_rows = [], [], []
    for r in range(P):
        rows = 0
        for doc, s, e in local_chunks(b, cp_size=P, rank=r, layout=layout):
            if doc in shared:
                rows += e - s
            else:
                n_real = b.real_in(doc, s - b.padded[doc], e - b.padded[doc])
                seqs = document_sequences(n_real, e - s - n_real, chunk)
                lens += seqs
                owner += [r] * len(seqs)
        shared_rows.append(rows)
    return _amounts(lens, left, right, owner, P), shared_rows


def split_a2a_schedule(sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype, causal: bool = True,
                       window: tuple[int, int] = (-1, -1), chunk: int | None = None, head_groups: int = 1,
                       balance: bool = True) -> Schedule:  # fmt: skip
    """Every rank of `a2a` over the stream or balanced layout (module docstring), as a `sim.plan.schedule.Schedule`.

    Raises:
        CPInputError: as `cpref.attention` refuses the call, naming the value; or for a candidate
            `split_a2a_covers` does not cover.
    """
    options = {**({"head_groups": head_groups} if head_groups != 1 else {}), **({} if balance else {"balance": False})}
    _checked("a2a", sharding, heads, dtype, causal, window, chunk, options, split_a2a_covers)
    b, P, layout, n = sharding.bounds, sharding.cp_size, sharding.layout, head_groups
    hq, hkv, d, dv = heads
    left, right = window[0], 0 if causal else window[1]
    # 1) the exchanged documents; each rank's own call and shared rows
    shared = exchanged_docs(b, P, layout, P, causal, window, balance)
    own, shared_rows = _own_calls(b, P, layout, shared, chunk, left, right)
    m = max(shared_rows)
    # 2) the shared call: the exchanged documents in order, then the padding slots
    lens = [seq for doc in sorted(shared)
            for seq in document_sequences(b.real_len(doc), b.padded_len(doc) - b.real_len(doc), chunk)]  # fmt: skip
    lens += document_sequences(0, P * m - sum(shared_rows))
    together = _amounts(lens, left, right)[0]
    # 3) the collectives: the exchange's seven on P m rows, per head group
    replicas = head_split(hq, hkv, P)
    h_q, h_kv = hq // (P * n), hkv * replicas // (P * n)
    f = compute_dtype(dtype)
    kinds = tuple(exchange_kinds(r, P, P * m, heads, h_q, h_kv, dtype, f if replicas > 1 else dtype) if m else ()
                  for r in range(P))  # fmt: skip
    # 4) the timeline: slots 0 own, 1 .. n shared (forward), n + 1 own, n + 2 .. 2 n + 1 shared (backward)
    tl = _Template()
    if m and n > 1:
        _grouped_template(tl, n, lambda t, c, phase: t.call(1 + c + (n + 1) * (phase == "backward")), kind=0,
                          meanwhile=lambda t, phase: t.call(0 if phase == "forward" else n + 1))  # fmt: skip
    else:
        for phase, first in (("forward", 0), ("backward", n + 1)):
            tl.phase = phase
            tl.call(first)
            if m:
                for k in (0, 1, 2) if phase == "forward" else (3,):
                    tl.blocking(k)
                tl.call(first + 1)
                for k in (3,) if phase == "forward" else (4, 5, 6):
                    tl.blocking(k)
    band = window != (-1, -1)
    slots = tuple(Slot(direction, *h, d, dv, band) for direction in ("forward", "backward")
                  for h in ((hq, hkv), *((h_q, h_kv),) * n))  # fmt: skip
    per_rank = np.array([[a, *(together,) * n] for a in own], dtype=np.int64)  # (P, 1 + n, 5)
    per_rank = np.concatenate([per_rank, per_rank], axis=1)  # (P, 2 (1 + n), 5): the backward's calls are the forward's
    present = np.concatenate([[[a[2] > 0, *(m > 0,) * n] for a in own]] * 2, axis=1).astype(bool)  # (P, slots)
    saved = np.array([_saved_bytes(a[2], m, P, heads, h_q * n, h_kv * n, dtype) for a in own], dtype=np.int64)
    work, rows, q_rows, kv_rows, width = np.moveaxis(per_rank, 2, 0)
    return Schedule(P, tuple(tl.events), kinds, slots, work, q_rows, kv_rows, rows, present, saved,
                    width if band else None)  # fmt: skip


def _saved_bytes(n_own: int, m: int, P: int, heads: tuple[int, int, int, int], h_q: int, h_kv: int,
                 dtype: torch.dtype) -> int:  # fmt: skip
    """What the Function saves: the own rows' q, k, v, output and lse (if it has own rows), and the exchange's
    gathered q, k, v, output and lse on `P m` rows of `h_q`, `h_kv` heads (all groups together)."""
    hq, hkv, d, dv = heads
    b, f = dtype.itemsize, compute_dtype(dtype).itemsize
    own = n_own * ((hq + hkv) * d + hkv * dv) * b + (n_own * hq * (dv * b + f) if n_own else 0)
    return own + (P * m * ((h_q + h_kv) * d + h_kv * dv + h_q * dv) * b + P * m * h_q * f if m else 0)


def split_hierarchy_covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `split_hierarchy_schedule` builds the candidate: `a2a+p2p` over `stream` or `balanced` with
    `1 < a2a_size < P`, under a window, chunks or neither, in one head group or several, balanced or not."""
    return mode == "a2a+p2p" and layout in ("stream", "balanced") and 1 < options.get("a2a_size", 1) < P \
        and set(mask) <= {"window", "chunk"} and set(options) <= {"a2a_size", "head_groups", "balance"}


@functools.lru_cache(maxsize=2)
def _split_ring(b, P: int, layout: str, a: int, chunk: int | None, causal: bool, window: tuple[int, int],
                balance: bool) -> tuple:  # fmt: skip
    """`(own calls, m, members, halo, shifts, ring amounts)` of `split_hierarchy_schedule`'s steps 1 and 2: cached for
    the next candidate (its head groups, asked for right after). Read it, never change it: the arrays are read-only."""
    left, right = window[0], 0 if causal else window[1]
    shared = exchanged_docs(b, P, layout, a, causal, window, balance)
    own, shared_rows = _own_calls(b, P, layout, shared, chunk, left, right)
    m = max(shared_rows)
    members, real = group_members(b, P, layout, a, shared, m)  # the mode's own members
    real, members = chunk_real(real), [chunk_pieces(x, chunk) for x in members]
    halo, shifts, ring = piece_ring_parts(real, members, causal, window)  # ring: (4, P / a, T*S)
    ring.setflags(write=False)
    return own, m, members, halo, shifts, ring


def split_hierarchy_schedule(sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype,
                             a2a_size: int, causal: bool = True, window: tuple[int, int] = (-1, -1),
                             chunk: int | None = None, head_groups: int = 1, balance: bool = True) -> Schedule:  # fmt: skip
    """Every rank of `a2a+p2p` over the stream or balanced layout (`cpref.modes.hierarchical_split`: own rows at
    home; shared rows exchanged inside the a2a groups, then the ring over pieces across the groups), as a
    `sim.plan.schedule.Schedule`.

    Raises:
        CPInputError: as `cpref.attention` refuses the call, naming the value; or for a candidate
            `split_hierarchy_covers` does not cover.
    """
    options = {"a2a_size": a2a_size, **({"head_groups": head_groups} if head_groups != 1 else {}),
               **({} if balance else {"balance": False})}  # fmt: skip
    _checked("a2a+p2p", sharding, heads, dtype, causal, window, chunk, options, split_hierarchy_covers)
    b, P, layout, a, n = sharding.bounds, sharding.cp_size, sharding.layout, a2a_size, head_groups
    hq, hkv, d, dv = heads
    # 1) the exchanged documents (balanced within each group); each rank's own call and shared rows
    # 2) the ring across the P / a groups over their shared pieces (the slots see nothing)
    own, m, members, halo, shifts, ring = _split_ring(b, P, layout, a, chunk, causal, window, balance)
    T, S, p = len(shifts), _slots(members), P // a
    # 3) the collectives: the exchange's seven on a m rows, then the ring's shifts (sim.plan.scale_window)
    replicas = head_split(hq, hkv, a)
    h_q, h_kv = hq // (a * n), hkv * replicas // (a * n)
    f = compute_dtype(dtype)
    head = tuple(exchange_kinds(r, a, a * m, heads, h_q, h_kv, dtype, f if replicas > 1 else dtype) if m else ()
                 for r in range(P))  # fmt: skip
    moved = [((max(halo[dist]), h_kv, d + dv), dt, shift) for dist in shifts[1:] if m
             for dt, shift in ((dtype, dist), (f, p - dist))]  # fmt: skip
    kinds = RingShifts(head, a, *(tuple(x) for x in zip(*moved))) if moved else RingShifts(head, a, (), (), ())
    # 4) the timeline: slot 0 the own call, 1 .. the ring's (n head groups of T S); then the same backward
    C = n * T * S
    tl = _Template()
    own_call = lambda t, phase: t.call(0 if phase == "forward" else 1 + C)  # noqa: E731
    if m:
        first = lambda c, phase: 1 + c * T * S + (1 + C) * (phase == "backward")  # noqa: E731
        hierarchy_template(tl, n, True, piece_ring_timeline(T, S, 7, first), kind=0, meanwhile=own_call)
    else:
        for phase in ("forward", "backward"):
            tl.phase = phase
            own_call(tl, phase)
    # 5) each rank's calls: its own, then its group's ring calls in every head group
    band = window != (-1, -1)
    slots = tuple(Slot(direction, *h, d, dv, band) for direction in ("forward", "backward")
                  for h in ((hq, hkv), *((h_q, h_kv),) * C))  # fmt: skip
    g = np.arange(P) // a
    mine = np.array(own, dtype=np.int64)  # (P, 5): work, rows, q rows, kv rows, width

    def both(own_x: np.ndarray, ring_x: np.ndarray) -> np.ndarray:  # (P, 2 (1 + C)): per rank, both ways
        way = np.concatenate([own_x[:, None], np.tile(ring_x[g], (1, n))], axis=1)
        return np.concatenate([way, way], axis=1)

    present = both(mine[:, 2] > 0, (ring[2] > 0) & (m > 0))
    saved_ring = _saved("a2a+p2p", P, m, heads, dtype, {"a2a_size": a, "head_groups": n,
                                                         "halo_sizes": (0, *(max(halo[x]) for x in shifts[1:]))}) if m else 0
    saved = np.array([_saved_bytes(x[2], 0, P, heads, h_q * n, h_kv * n, dtype) + saved_ring for x in own], dtype=np.int64)
    return Schedule(P, tuple(tl.events), kinds, slots, both(mine[:, 0], ring[0]),
                    both(mine[:, 2], np.full((p, T * S), a * m)), both(mine[:, 3], ring[2]), both(mine[:, 1], ring[1]),
                    present, saved, both(mine[:, 4], ring[3]) if band else None)  # fmt: skip
