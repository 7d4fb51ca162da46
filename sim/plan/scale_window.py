r"""The ring over pieces at scale: `p2p` under a window or chunks, and over the stream and balanced layouts.

Under a sliding window or chunked attention, and in the `stream` and `balanced` layouts with any
mask, `p2p` runs the ring of [`cpref.modes.ring_window`][cpref.modes.ring_window]: one step per
distance $d \in (0, \mathcal{D})$, at each a call per piece *slot* of the sender, and shifts that
carry only the rows a rank reads. Its plan is irregular (halos, pieces cut at chunks, pieces of a
stream), so the closed forms of [`sim.plan.scale`][sim.plan.scale] do not apply; but every
amount is a sum over the pairs of a query piece and a key piece that see each other, which the
mode's own [`visible_pairs`][cpref.modes.ring_window.visible_pairs] yields in one sweep over the
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
to no count the time model reads, so only the pairs are summed. `tests/plan/test_scale.py` holds
every rank's whole run to the dry run's, event by event, at P = 2 to 8, in every layout, with
windows, chunks and neither.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cpref.kernels.contract import _visible_sum, compute_dtype
from cpref.modes.ring_window import _halo_rows, _members, visible_pairs
from cpref.modes.visible import chunk_pieces, chunk_real
from sim.plan.dry import Collective
from sim.plan.scale import Schedule, Slot, _saved, _Template

__all__ = ["piece_ring_schedule", "piece_ring_covers"]


def piece_ring_covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `piece_ring_schedule` builds the candidate: `p2p` (no options) at P >= 2 on the piece ring, i.e. under a
    window or chunks, or in the stream and balanced layouts."""
    from cpref.batch.seqlens import CHUNKED_LAYOUTS

    pieces = bool(mask.get("chunk")) or mask.get("window", (-1, -1)) != (-1, -1) or layout not in CHUNKED_LAYOUTS
    return mode == "p2p" and not options and P >= 2 and pieces and set(mask) <= {"window", "chunk"}


def _width(shift: int, n_q: int, n_k: int, left: int, right: int) -> int:
    """The most keys a row of one sequence sees (`sim.plan.dry.band_width`, for one sequence)."""
    best = 0
    for x in {0, n_q - 1, left - shift, n_k - right - 1 - shift}:
        p = min(max(x, 0), n_q - 1) + shift
        lo = 0 if left < 0 else max(0, p - left)
        hi = n_k if right < 0 else min(n_k, p + right + 1)
        best = max(best, hi - lo)
    return best


def piece_ring_schedule(sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype, causal: bool = True,
                        window: tuple[int, int] = (-1, -1), chunk: int | None = None) -> Schedule:  # fmt: skip
    """Every rank of `p2p` on the piece ring (module docstring), as a `sim.plan.scale.Schedule`."""
    b, P, layout, local = sharding.bounds, sharding.cp_size, sharding.layout, sharding.local_tokens
    hq, hkv, d, dv = heads
    real, members = chunk_real(b.real_in), [chunk_pieces(m, chunk) for m in _members(b, P, layout, 1)]
    left, right = window[0], 0 if causal else window[1]
    # 1) the pairs, summed into each (rank, distance, slot)'s call: work, rows seeing a key, keys, band width
    halo = _halo_rows(real, members, causal, window)
    shifts = (0, *halo)
    step = {dist: t for t, dist in enumerate(shifts)}
    calls: dict[tuple[int, int, int], list[int]] = {}
    for r, s, slot, a, zr, _, _, lo, hi in visible_pairs(real, members, causal, window):
        n_q, n_k, shift = zr - a, hi - lo, a - lo
        rows, work = _visible_sum(shift, n_q, n_k, left, right)
        amounts = calls.setdefault((r, step[(r - s) % P], slot), [0, 0, 0, 0])
        amounts[0] += work
        amounts[1] += rows
        amounts[2] += n_k
        amounts[3] = max(amounts[3], _width(shift, n_q, n_k, left, right))
    T, S = len(shifts), 1 + max((slot for _, _, slot in calls), default=0)
    amounts = np.zeros((4, P, T * S), dtype=np.int64)
    present = np.zeros((P, T * S), dtype=bool)
    for (r, t, slot), values in calls.items():
        amounts[:, r, t * S + slot] = values
        present[r, t * S + slot] = True
    # 2) the timeline of halo_forward and halo_backward; kinds 2 (t - 1): K/V of step t, 2 (t - 1) + 1: its dK/dV back
    tl = _Template()
    for t in range(T):
        pending = tl.post(2 * t) if t + 1 < T else -1
        for slot in range(S):
            tl.call(t * S + slot)
        if pending >= 0:
            tl.wait(pending)
    tl.phase, returning = "backward", -1
    for t in range(T):
        pending = tl.post(2 * t) if t + 1 < T else -1
        for slot in range(S):
            tl.call((T + t) * S + slot)
        if t > 0:
            if returning >= 0:
                tl.wait(returning)
            returning = tl.post(2 * (t - 1) + 1)
        if pending >= 0:
            tl.wait(pending)
    if returning >= 0:
        tl.wait(returning)
    group, f, sizes = tuple(range(P)), compute_dtype(dtype), {dist: max(halo[dist]) for dist in shifts[1:]}
    kinds = tuple(tuple(Collective("send_recv", group, r, (sizes[dist], hkv, d + dv), dt, shift)
                        for dist in shifts[1:]
                        for dt, shift in ((dtype, dist), (f, P - dist)))
                  for r in range(P))  # fmt: skip
    band = window != (-1, -1)
    slots = tuple(Slot(direction, hq, hkv, d, dv, band) for direction in ("forward", "backward") for _ in range(T * S))
    both = lambda x: np.concatenate([x, x], axis=1)  # noqa: E731  the backward's calls are the forward's
    saved = np.full(P, _saved("p2p", P, local, heads, dtype, {"halo_sizes": (0, *sizes.values())}), dtype=np.int64)
    return Schedule(P, tuple(tl.events), kinds, slots, both(amounts[0]), np.full((P, 2 * T * S), local, dtype=np.int64),
                    both(amounts[2]), both(amounts[1]), both(present), saved, both(amounts[3]) if band else None)  # fmt: skip
