r"""Plans at scale: every rank of a thousand-rank ring built at once, held to the dry run.

The [dry run][sim.plan.dry] runs a mode's own code for one rank, on meta tensors: exact, but a
ring of $P$ ranks makes $P$ kernel calls and $3P$ shifts on each of $P$ ranks, each a few
meta-tensor operations, and at $P = 1024$ that is a million steps. This module builds the same
counts for the plans whose structure is regular, **without running the mode**:

* the **timeline** of a rank (posts, waits, calls, in program order) from the mode's schedule,
  the same for every rank of the candidate ([`ring_template`][sim.plan.schedule.ring_template]);
* the **kernel calls'** work, rows and keys for every rank and step at once, from the documents'
  real rows per chunk, as numpy arrays ([`ring_steps`][sim.plan.scale.ring_steps],
  [`all_gather_calls`][sim.plan.scale.all_gather_calls]);
* the **collectives** as the dry run records them (op, group, shape, dtype, shift), one of each
  kind per rank, priced by the time model's own
  [`collective_seconds`][sim.plan.model.collective_seconds];
* the **saved bytes** from the mode's declared costs
  ([`mode_costs`][cpref.api.mode_costs]);

all of it a [`Schedule`][sim.plan.schedule.Schedule] ([`sim.plan.schedule`][sim.plan.schedule]), which
plays every rank's timeline at once, the two clocks of [`rank_time`][sim.plan.model.rank_time] as
arrays over the ranks ([`Schedule.price`][sim.plan.schedule.Schedule.price]).

**Covered:** full causal attention (no window, no chunk) in the contiguous and zigzag layouts,
for `p2p`, `all_gather` (with or without `overlap` or `save_gathered_kv`, not both) and `a2a+p2p`
(with or without `head_groups`): the chunked layouts, whose plans are sums over each document's chunks;
and `all_gather` under a causal window there, whose one call per rank is a sequence per local chunk
([`all_gather_window_calls`][sim.plan.scale.all_gather_window_calls]). There, with
every document cut into $2P$ (zigzag) or $P$ (contiguous) chunks of $c_i$ rows of which
$R_i[j] = \min(c_i, \max(0, n_i - j c_i))$ are real, the ring's step $t$ on rank $r$ holds the
block of rank $s = (r - t) \bmod P$ and computes, per document (zigzag, $f = r$, $b = 2P - 1 - r$):

| step | work (visible pairs per head) | rows that see a key |
| --- | --- | --- |
| $s < r$ | $(R[f] + R[b]) R[s]$ | $(R[f] + R[b]) [R[s] > 0]$ |
| $s > r$ | $R[b] (R[s] + R[2P - 1 - s])$ | $R[b] [R[s] + R[2P-1-s] > 0]$ |
| $s = r$ | $\binom{R[f] + 1}{2} + R[b] R[f] + \binom{R[b] + 1}{2}$ | $R[f] + R[b]$ |

(contiguous: $R[r] R[s]$ for $s < r$, $\binom{R[r] + 1}{2}$ for $s = r$, nothing after). These
are the sums of the ring plan's sequences ([`cpref.modes.ring_plan`][cpref.modes.ring_plan]); the
hierarchical mode's ring is the same ring over $P / a$ ranks with chunks $a$ times larger. `p2p`
on the ring over pieces (windows, chunks, the stream and balanced layouts) is built by
[`sim.plan.scale_window`][sim.plan.scale_window], `a2a` and `a2a+p2p` over the stream and balanced layouts by
[`sim.plan.scale_split`][sim.plan.scale_split]. Other candidates are dry-run; `a2a`, whose ranks are all alike in
these layouts (every rank attends the whole batch on its heads), is dry-run on one rank
([`alike_runs`][sim.plan.scale.alike_runs]).

**Held to the dry run.** Nothing here is a second source of truth:
`tests/plan/test_scale.py` compares, for every covered candidate at P = 2 to 8 on random batches,
each rank's whole [`RankRun`][sim.plan.dry.RankRun] ([`Schedule.run`][sim.plan.schedule.Schedule.run])
with the dry run's, event by event and call by call, and the priced steps with
[`rank_time`][sim.plan.model.rank_time]'s. A change to a mode's schedule fails there first.

Example:
    >>> import torch, cpref
    >>> from sim.plan.scale import ring_steps
    >>> b = cpref.Sharding.eod_padded([0, 40, 64], cp_size=2, layout="zigzag").bounds
    >>> work, rows, kv = ring_steps(b, 2, "zigzag")
    >>> work.tolist()  # rank x step: zigzag gives both ranks the same work at every step
    [[288, 272], [288, 272]]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from cpref.base.errors import CPInputError
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import compute_dtype
from sim.plan.dry import Collective, RankRun
from sim.plan.schedule import (
    Schedule,
    Slot,
    _Template,
    exchange_kinds,
    hierarchy_template,
    overlap_template,
    ring_template,
)

__all__ = ["overlap_amounts", "ring_steps", "all_gather_calls", "all_gather_window_calls", "all_gather_overlap_calls",
           "schedule", "covers", "alike_runs", "a2a_alike", "validate", "SCALED_LAYOUTS"]

SCALED_LAYOUTS = ("contiguous", "zigzag")


def _reals(b: Boundaries, nchunks: int) -> tuple[np.ndarray, np.ndarray]:
    """`(R, c)`: the real rows of every chunk `(docs, nchunks)`, and each document's chunk size `(docs,)`."""
    c = np.array([b.padded_len(i) // nchunks for i in range(b.num_docs)], dtype=np.int64)
    n = np.array([b.real_len(i) for i in range(b.num_docs)], dtype=np.int64)
    j = np.arange(nchunks, dtype=np.int64)
    return np.clip(n[:, None] - j[None, :] * c[:, None], 0, c[:, None]), c


def _tri(x: np.ndarray) -> np.ndarray:
    """x (x + 1) / 2: a chunk's causal work against itself."""
    return x * (x + 1) // 2


def ring_steps(b: Boundaries, P: int, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The classic ring's kernel calls under a causal mask, every rank `r` and step `t` at once (module docstring).

    Returns:
        `(work, rows_seeing, kv_rows)`, int64 arrays `(P, P)` indexed `[r, t]`; a step with no work makes no call.
    """
    zigzag = layout == "zigzag"
    R, c = _reals(b, 2 * P if zigzag else P)
    local = int(c.sum()) * (2 if zigzag else 1)  # T_l: the block as it arrives
    r = np.arange(P)[:, None]
    s = (r - np.arange(P)[None, :]) % P  # the block's source at step t
    before, same = s < r, s == r
    work = np.zeros((P, P), dtype=np.int64)
    rows = np.zeros((P, P), dtype=np.int64)
    selected = np.zeros(P, dtype=np.int64)  # zigzag's own step: the front chunk read twice
    overlaps = np.zeros(P, dtype=bool)
    for Ri, ci in zip(R, c):  # (P,) per document
        if not zigzag:
            mine, theirs = Ri[r], Ri[s]
            work += np.where(before, mine * theirs, np.where(same, _tri(mine), 0))
            rows += np.where(before, mine * (theirs > 0), np.where(same, mine, 0))
            continue
        front, back = Ri[r], Ri[2 * P - 1 - r]
        sf, sb = Ri[s], Ri[2 * P - 1 - s]
        work += np.where(before, (front + back) * sf,
                         np.where(same, _tri(front) + back * front + _tri(back), back * (sf + sb)))  # fmt: skip
        rows += np.where(before, (front + back) * (sf > 0), np.where(same, front + back, back * (sf + sb > 0)))
        selected += front[:, 0] + np.where(back[:, 0] > 0, ci + back[:, 0], 0)
        overlaps |= back[:, 0] > 0
    kv = np.where(same & overlaps[:, None], selected[:, None], local)  # the block as it arrives, else the selection
    return work, rows, kv


def all_gather_calls(b: Boundaries, P: int, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """all_gather's one call per rank under a causal mask: each local chunk `j` of `R[j]` real rows against its
    document's prefix through its last real row, `j c + R[j]` keys (`cpref.modes.all_gather_plan`).

    Returns:
        `(work, rows_seeing, kv_rows)`, int64 arrays `(P,)`.
    """
    zigzag = layout == "zigzag"
    R, c = _reals(b, 2 * P if zigzag else P)
    r = np.arange(P)
    work, rows, kv = (np.zeros(P, dtype=np.int64) for _ in range(3))
    for Ri, ci in zip(R, c):
        for j in (r, 2 * P - 1 - r) if zigzag else (r,):
            real = Ri[j]
            work += real * (j * ci) + _tri(real)
            rows += real
            kv += np.where(real > 0, j * ci + real, 0)
    return work, rows, kv


def all_gather_window_calls(b: Boundaries, P: int, layout: str, window: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """all_gather's one call per rank under a causal window `(w, 0)`: each local chunk `j`'s real queries `[a, z)`
    (`a = j c`) against its document's keys `[max(0, a - w), z)`, at shift `a - lo` (`cpref.modes.all_gather_plan`);
    each sequence's work, rows that see a key and band width by the kernel contract's closed forms.

    Returns:
        `(work, rows_seeing, kv_rows, width)`, int64 arrays `(P,)`.
    """
    from cpref.kernels.contract import _visible_sum
    from sim.plan.dry import sequence_width

    zigzag, left = layout == "zigzag", window[0]
    R, c = _reals(b, 2 * P if zigzag else P)
    out = np.zeros((4, P), dtype=np.int64)
    for r in range(P):
        for Ri, ci in zip(R.tolist(), c.tolist()):
            for j in (r, 2 * P - 1 - r) if zigzag else (r,):
                a, real = j * ci, Ri[j]
                if real:
                    lo = max(0, a - left)
                    rows, work = _visible_sum(a - lo, real, a + real - lo, left, 0)
                    out[:, r] += (work, rows, a + real - lo, 0)
                    out[3, r] = max(out[3, r], sequence_width(a - lo, real, a + real - lo, left, 0))
    return tuple(out)


def _lengths(seqs) -> list[tuple[int, int]]:
    """A `Varlen`'s `(q_len, kv_len)` per sequence."""
    return [(b - a, y - x) for a, b, x, y in seqs.pairs()]


def _sums(seqs: list[tuple[int, int]], causal: bool) -> tuple[int, int]:
    """`(work, rows that see a key)` of sequences `(n_q, n_k)` with the kernel contract's masks (`Varlen.work`), in
    closed form: bottom-right causal, `m = min(n_q, n_k)` rows see `n_k - n_q + x + 1` keys each; else every row
    sees every key."""
    work = rows = 0
    for n_q, n_k in seqs:
        m = min(n_q, n_k) if causal else (n_q if n_k else 0)
        work += m * (m + 1) // 2 + m * (n_k - m) if causal else n_q * n_k
        rows += m
    return work, rows


def all_gather_overlap_calls(b: Boundaries, P: int, layout: str) -> tuple[np.ndarray, ...]:
    """all_gather with `overlap=True`, causal: each rank's calls in schedule order (forward: local, remote; backward:
    first half, remote, last half; `cpref.modes.all_gather_overlap`), from each sequence of the selecting plan split
    into the keys the rank holds (its own chunks before the diagonal, then the diagonal) and the others' keys; the
    halves by the mode's own `_halves`.

    Returns:
        `(work, rows_seeing, kv_rows, present)`, arrays `(P, 5)`.
    """
    zigzag = layout == "zigzag"
    R, c = _reals(b, 2 * P if zigzag else P)
    out = [np.zeros((P, 5), dtype=np.int64) for _ in range(3)] + [np.zeros((P, 5), dtype=bool)]
    for r in range(P):
        lens: list[list[int]] = []  # (n_q, local keys, remote keys) of every sequence, in the plan's order
        for Ri, ci in zip(R.tolist(), c.tolist()):
            for slot, j in enumerate((r, 2 * P - 1 - r) if zigzag else (r,)):
                real = Ri[j]
                if real:  # the real queries: the diagonal held here, the own front chunk too for the back chunk
                    lens.append([real, real + ci * slot, j * ci - ci * slot])
                if ci - real and lens and lens[-1][1] + lens[-1][2] == 0:  # padding beside padding: one sequence
                    lens[-1][0] += ci - real
                elif ci - real:
                    lens.append([ci - real, 0, 0])
        for i, x in enumerate(overlap_amounts(lens, True)):
            out[i][r] = x
    return tuple(out)


def overlap_amounts(lens: list[tuple[int, int, int]], causal: bool) -> tuple[list, list, list, list]:
    """`(work, rows seeing a key, keys, made)` of one rank's five overlapped calls in schedule order (forward: local,
    remote; backward: first half, remote, last half; `cpref.modes.all_gather_overlap`) from each sequence's `(n_q,
    local keys, remote keys)` in the plan's order; the halves by the mode's own `_halves`."""
    from cpref.modes.all_gather_overlap import _halves

    first, last = (_lengths(v) for v in _halves([(n_q, n_l) for n_q, n_l, _ in lens], causal))
    local, remote = [(n, n_l) for n, n_l, _ in lens], [(n, n_r) for n, _, n_r in lens]
    n_local, n_remote = sum(x[1] for x in lens), sum(x[2] for x in lens)
    calls = ((local, causal, n_local), (remote, False, n_remote), (first, causal, n_local), (remote, False, n_remote),
             (last, causal, n_local))  # fmt: skip
    work, rows = zip(*(_sums(seqs, masked) for seqs, masked, _ in calls))
    return list(work), list(rows), [keys for *_, keys in calls], [True, *(w > 0 for w in work[1:])]


def covers(mode: str, layout: str, options: dict[str, Any], P: int, mask: dict[str, Any]) -> bool:
    """Whether `schedule` builds this candidate (the module docstring's list)."""
    if mode == "all_gather" and set(mask) == {"window"} and mask["window"] != (-1, -1):
        return P >= 2 and layout in SCALED_LAYOUTS and not options.get("overlap")
    if P < 2 or layout not in SCALED_LAYOUTS or mask:
        return False
    if mode == "p2p":
        return not options
    if mode == "all_gather":
        return not (options.get("overlap") and options.get("save_gathered_kv"))
    if mode == "a2a+p2p":
        return 1 < options["a2a_size"] < P
    return False


def validate(mode: str, sharding: Any, heads: tuple[int, int, int, int], dtype: torch.dtype, options: dict) -> None:
    """Refuse as `cpref.attention` refuses (the same checks, on meta tensors, nothing run)."""
    from cpref.api import prepare
    from sim.plan.dry import DryComm, TallyKernel, _Recorder

    hq, hkv, d, dv = heads
    t = sharding.local_tokens
    q, k, v = (torch.empty(t, h, x, dtype=dtype, device="meta") for h, x in ((hq, d), (hkv, d), (hkv, dv)))
    recorder = _Recorder()
    prepare(q, k, v, sharding, comm=DryComm(0, range(sharding.cp_size), recorder), mode=mode,
            kernel=TallyKernel(recorder), **options)  # fmt: skip


def _saved(mode: str, P: int, local: int, heads, dtype: torch.dtype, options: dict) -> int:
    from cpref.api import mode_costs

    return mode_costs(mode, None, P=P, local_tokens=local, heads=tuple(heads), dtype=dtype, **options).saved_bytes


def schedule(mode: str, sharding: Any, *, heads: tuple[int, int, int, int], dtype: torch.dtype,
             window: tuple[int, int] = (-1, -1), **options: Any) -> Schedule:  # fmt: skip
    """Every rank of a covered candidate (`covers`): full causal, or `all_gather` under a causal `window`.

    Raises:
        CPInputError: as `cpref.attention` refuses the call, naming the value; or for a candidate `covers` does not
            cover (dry-run it instead).
    """
    mask = {} if tuple(window) == (-1, -1) else {"window": tuple(window)}
    validate(mode, sharding, heads, dtype, {**mask, **options})
    if not covers(mode, sharding.layout, options, sharding.cp_size, mask):
        raise CPInputError(f"mode {mode!r} over {sharding.layout!r} with {options} at P = {sharding.cp_size} is not built "
                           "at scale (see sim.plan.scale.covers): dry-run it with sim.plan.dry.dry_run")  # fmt: skip
    b, P, layout, local = sharding.bounds, sharding.cp_size, sharding.layout, sharding.local_tokens
    hq, hkv, d, dv = heads
    f = compute_dtype(dtype)
    ranks = range(P)
    tl, width = _Template(), None
    if mode == "all_gather":
        group = tuple(ranks)
        kinds = tuple((Collective("all_gather", group, r, (local, hkv, d), dtype),
                       Collective("all_gather", group, r, (local, hkv, dv), dtype),
                       Collective("reduce_scatter", group, r, (P * local, hkv, d), f),
                       Collective("reduce_scatter", group, r, (P * local, hkv, dv), f)) for r in ranks)  # fmt: skip
        if options.get("overlap"):  # the gathers behind the local call; the reduce-scatters behind the last half
            overlap_template(tl)
            slots = tuple(Slot(direction, hq, hkv, d, dv) for direction in ("forward",) * 2 + ("backward",) * 3)
            work, rows, kv, present = all_gather_overlap_calls(b, P, layout)
            q_rows = np.full((P, 5), local, dtype=np.int64)
        else:
            for phase in ("forward", "backward"):
                tl.phase = phase
                if phase == "forward" or not options.get("save_gathered_kv"):  # saved: the backward gathers nothing
                    tl.blocking(0)
                    tl.blocking(1)
                tl.call(0 if phase == "forward" else 1)
            tl.blocking(2)
            tl.blocking(3)
            band = bool(mask)
            slots = (Slot("forward", hq, hkv, d, dv, band), Slot("backward", hq, hkv, d, dv, band))
            amounts = all_gather_window_calls(b, P, layout, window) if band else all_gather_calls(b, P, layout)
            work, rows, kv, *widths = (np.repeat(x[:, None], 2, axis=1) for x in amounts)
            width = widths[0] if widths else None
            present = np.ones((P, 2), dtype=bool)
            q_rows = np.full((P, 2), local, dtype=np.int64)
    else:  # p2p, a2a+p2p: a ring of p ranks (after an exchange inside groups of a), in n head groups
        a = options.get("a2a_size", 1) if mode == "a2a+p2p" else 1
        n = options.get("head_groups", 1) if mode == "a2a+p2p" else 1
        p = P // a
        replicas = 1 if hkv % a == 0 else a // hkv
        h_kv, h_q, rows_a = hkv * replicas // (a * n), hq // (a * n), a * local  # per rank and head group
        grad_kv = f if replicas > 1 else dtype

        def kinds_of(r: int) -> tuple[Collective, ...]:
            g, j = divmod(r, a)
            ring = tuple(j + a * i for i in range(p))
            shifts = (Collective("send_recv", ring, g, (rows_a, h_kv, d + dv), dtype, 1),
                      Collective("send_recv", ring, g, (rows_a, h_kv, d + dv), f, 1))  # fmt: skip
            if a == 1:
                return shifts
            return (*shifts, *exchange_kinds(r, a, rows_a, heads, h_q, h_kv, dtype, grad_kv))  # kinds 2 .. 8

        kinds = tuple(kinds_of(r) for r in ranks)
        def ring(tl: _Template, c: int, phase: str) -> None:  # head group c's ring, in its slots
            ring_template(tl, p, 0, 1, (c if phase == "forward" else n + c) * p, phase)

        hierarchy_template(tl, n, a > 1, ring)
        slots = (Slot("forward", h_q, h_kv, d, dv),) * (n * p) + (Slot("backward", h_q, h_kv, d, dv),) * (n * p)
        w, rs, kvr = ring_steps(b, p, layout)
        g = np.arange(P) // a  # each rank's place in its ring
        work, rows, kv = (np.concatenate([x[g]] * (2 * n), axis=1) for x in (w, rs, kvr))
        present = work > 0
        q_rows = np.full((P, 2 * n * p), rows_a, dtype=np.int64)
    if options.get("save_gathered_kv"):  # the gathered K/V the call selects are kept: per rank, its call's keys
        saved = np.array([_saved(mode, P, local, heads, dtype, {**options, "selected_kv_rows": int(x)}) for x in kv[:, 0]],
                         dtype=np.int64)  # fmt: skip
    else:
        saved = np.full(P, _saved(mode, P, local, heads, dtype, options), dtype=np.int64)
    return Schedule(P, tuple(tl.events), kinds, slots, work, q_rows, kv, rows, present, saved, width)


def alike_runs(run: RankRun, P: int) -> list[RankRun]:
    """Every rank's run from rank 0's, for a candidate whose ranks all do the same (`a2a` in the chunked layouts):
    the same timeline and calls, each collective at the rank's own place in its group."""

    def moved(c: Collective, r: int) -> Collective:
        return replace(c, rank=c.group.index(r))

    return [run if r == 0 else RankRun(r, tuple(moved(c, r) for c in run.collectives), run.timeline, run.saved_bytes)
            for r in range(P)]  # fmt: skip


def a2a_alike(mode: str, layout: str, mask: dict[str, Any]) -> bool:
    """Whether every rank of the candidate does what rank 0 does: `a2a` in a chunked layout, with any mask (every rank
    attends the whole batch on its heads, over the whole group)."""
    return mode == "a2a" and layout in SCALED_LAYOUTS

