r"""Plans at scale: every rank of a thousand-rank ring built at once, held to the dry run.

The [dry run][sim.plan.dry] runs a mode's own code for one rank, on meta tensors: exact, but a
ring of $P$ ranks makes $P$ kernel calls and $3P$ shifts on each of $P$ ranks, each a few
meta-tensor operations, and at $P = 1024$ that is a million steps. This module builds the same
counts for the plans whose structure is regular, **without running the mode**:

* the **timeline** of a rank (posts, waits, calls, in program order) from the mode's schedule,
  the same for every rank of the candidate ([`ring_template`][sim.plan.scale.ring_template]);
* the **kernel calls'** work, rows and keys for every rank and step at once, from the documents'
  real rows per chunk, as numpy arrays ([`ring_steps`][sim.plan.scale.ring_steps],
  [`all_gather_calls`][sim.plan.scale.all_gather_calls]);
* the **collectives** as the dry run records them (op, group, shape, dtype, shift), one of each
  kind per rank, priced by the time model's own
  [`collective_seconds`][sim.plan.model.collective_seconds];
* the **saved bytes** from the mode's declared costs
  ([`mode_costs`][cpref.api.mode_costs]);

and plays every rank's timeline at once, the two clocks of [`rank_time`][sim.plan.model.rank_time]
as arrays over the ranks ([`Schedule.price`][sim.plan.scale.Schedule.price]).

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
each rank's whole [`RankRun`][sim.plan.dry.RankRun] ([`Schedule.run`][sim.plan.scale.Schedule.run])
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

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from cpref.base.errors import CPInputError
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import compute_dtype
from sim.plan.dry import Collective, Event, KernelCall, RankRun
from sim.plan.links import LEVELS, level, link_bytes
from sim.plan.model import RankTime, collective_seconds
from sim.plan.profile import Compute, Profile

__all__ = ["Slot", "Schedule", "RingShifts", "overlap_template", "overlap_amounts", "ring_steps", "all_gather_calls", "all_gather_window_calls", "all_gather_overlap_calls",
           "ring_template", "hierarchy_template", "exchange_kinds", "schedule",
           "covers", "alike_runs", "a2a_alike", "validate", "SCALED_LAYOUTS"]

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


@dataclass(frozen=True)
class Slot:
    """A kernel call's place in the template: its direction, heads and dims, whether it has a window (its amounts
    are per rank)."""

    direction: str
    hq: int
    hkv: int
    d: int
    dv: int
    band: bool = False


class _Template:
    """A timeline being written: `post(kind)` returns the post's index, `wait(index)`, `call(slot)`."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int]] = []  # (kind, phase, post index or slot, collective kind)
        self.posts = 0
        self.phase = "forward"

    def post(self, kind: int) -> int:
        self.events.append(("post", self.phase, self.posts, kind))
        self.posts += 1
        return self.posts - 1

    def wait(self, index: int) -> None:
        self.events.append(("wait", self.phase, index, -1))

    def blocking(self, kind: int) -> None:
        self.wait(self.post(kind))

    def call(self, slot: int) -> None:
        self.events.append(("call", self.phase, slot, -1))


def overlap_template(tl: _Template) -> None:
    """`all_gather` with `overlap=True` (`cpref.modes.all_gather_overlap`), kinds 0, 1 the K, V gathers and 2, 3
    the dK, dV reduce-scatters, slots 0 .. 4 the calls: forward, the gathers posted, the local call, the gathers
    waited for, the remote call; backward, the gathers posted, the first half, waited for, the remote call, the
    reduce-scatters posted, the last half, waited for."""
    for phase, first in (("forward", 0), ("backward", 2)):
        tl.phase = phase
        posted = [tl.post(0), tl.post(1)]
        tl.call(first)
        for index in posted:
            tl.wait(index)
        tl.call(first + 1)
    posted = [tl.post(2), tl.post(3)]
    tl.call(4)
    for index in posted:
        tl.wait(index)


def ring_template(tl: _Template, p: int, kv: int, dkv: int, first_slot: int, phase: str) -> None:
    """The ring's schedule (`cpref.modes.ring`), `p` steps in slots `first_slot ..`: forward, the shift of the next
    block posted before each call and waited after it; backward, the K/V shift likewise and the dK/dV accumulator's
    shift after each call, waited for one step later, with one more to bring it home."""
    if phase == "forward":
        for t in range(p - 1):
            index = tl.post(kv)
            tl.call(first_slot + t)
            tl.wait(index)
        tl.call(first_slot + p - 1)
        return
    grads = -1
    for t in range(p):
        shift = tl.post(kv) if t < p - 1 else -1
        tl.call(first_slot + t)
        if grads >= 0:
            tl.wait(grads)
        grads = tl.post(dkv)
        if shift >= 0:
            tl.wait(shift)
    tl.wait(grads)


def _grouped_template(tl: _Template, n: int, ring: Callable[[_Template, int, str], None], kind: int = 2,
                      meanwhile: Callable[[_Template, str], None] | None = None) -> None:  # fmt: skip
    """`a2a+p2p` in `n` head groups (`cpref.modes.hierarchical`): every group's q, k, v exchange posted at once; each
    group waited for, its ring run (`ring(tl, group, phase)`), its output posted; then every output waited for.
    Backward: every group's dout posted; each waited for, its ring backward run, its dq, dk, dv posted; then waited
    for, dq's of every group first, then dk's, then dv's. The exchanges are the collective kinds `kind ..`: q, k, v,
    out / dout, dq, dk, dv. `meanwhile(tl, phase)` writes what runs after the posts, before the first wait (the split
    Ulysses' own rows' call)."""
    posted = [[tl.post(kind + k) for k in (0, 1, 2)] for _ in range(n)]
    if meanwhile is not None:
        meanwhile(tl, "forward")
    outs = []
    for c in range(n):
        for index in posted[c]:
            tl.wait(index)
        ring(tl, c, "forward")
        outs.append(tl.post(kind + 3))
    for index in outs:
        tl.wait(index)
    tl.phase = "backward"
    douts, grads = [tl.post(kind + 3) for _ in range(n)], []
    if meanwhile is not None:
        meanwhile(tl, "backward")
    for c in range(n):
        tl.wait(douts[c])
        ring(tl, c, "backward")
        grads.append([tl.post(kind + k) for k in (4, 5, 6)])
    for k in range(3):
        for c in range(n):
            tl.wait(grads[c][k])


def hierarchy_template(tl: _Template, n: int, exchanged: bool, ring: Callable[[_Template, int, str], None],
                       kind: int = 2, meanwhile: Callable[[_Template, str], None] | None = None) -> None:  # fmt: skip
    """The hierarchy around a ring (`a2a+p2p`; `p2p` alone without `exchanged`): in one head group every exchange
    blocking around one ring, forward then backward; in `n` head groups `_grouped_template`. `meanwhile(tl,
    phase)`: the split modes' own rows' call, first in each phase (in head groups, after the posts)."""
    if n > 1:
        _grouped_template(tl, n, ring, kind, meanwhile)
        return
    if meanwhile is not None:
        meanwhile(tl, "forward")
    if exchanged:
        for k in (0, 1, 2):
            tl.blocking(kind + k)
    ring(tl, 0, "forward")
    if exchanged:
        tl.blocking(kind + 3)
    tl.phase = "backward"
    if meanwhile is not None:
        meanwhile(tl, "backward")
    if exchanged:
        tl.blocking(kind + 3)
    ring(tl, 0, "backward")
    if exchanged:
        for k in (4, 5, 6):
            tl.blocking(kind + k)


def exchange_kinds(r: int, a: int, rows_a: int, heads: tuple[int, int, int, int], h_q: int, h_kv: int,
                   dtype: torch.dtype, grad_kv: torch.dtype) -> tuple[Collective, ...]:  # fmt: skip
    """Rank `r`'s exchanges inside its a2a group of `a` ranks, as the dry run records them: q, k, v, out / dout, dq,
    dk, dv, on `rows_a` rows of `h_q` or `h_kv` heads (per head group)."""
    _, _, d, dv = heads
    g, j = divmod(r, a)
    team = tuple(range(g * a, g * a + a))
    return tuple(Collective("all_to_all", team, j, (rows_a, h, x), dt)
                 for h, x, dt in ((h_q, d, dtype), (h_kv, d, dtype), (h_kv, dv, dtype), (h_q, dv, dtype),
                                  (h_q, d, dtype), (h_kv, d, grad_kv), (h_kv, dv, grad_kv)))  # fmt: skip


@dataclass(frozen=True)
class RingShifts:
    """Every rank's collectives by kind (`kinds[r][k]`), where the kinds after each rank's own `head[r]` are ring
    shifts alike on every rank: kind `len(head[r]) + i` of rank `r` is a `send_recv` by `shifts[i]` of `shapes[i]` in
    `dtypes[i]` on the ring of ranks `j, j + a, ..., j + a (p - 1)` (`j = r mod a`, `p = P / a`), at member `r // a`.
    A ring of P ranks at every distance has ~P^2 such shifts; this keeps one column per distance, and `prices` them
    a column at a time (`_priced`'s few prices, spread by each rank's pair of link levels)."""

    head: tuple[tuple[Collective, ...], ...]
    a: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    shifts: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.head)

    def __getitem__(self, r: int) -> tuple[Collective, ...]:
        P, a = len(self.head), self.a
        ring = tuple(r % a + a * i for i in range(P // a))
        return (*self.head[r], *(Collective("send_recv", ring, r // a, shape, dtype, shift)
                                 for shape, dtype, shift in zip(self.shapes, self.dtypes, self.shifts)))  # fmt: skip

    def prices(self, profile: Profile) -> tuple[np.ndarray, np.ndarray]:
        """`(seconds (P, K), link bytes (P, K, levels))` of every rank's kinds, as `_priced` prices each."""
        P, a, rpn = len(self.head), self.a, profile.ranks_per_node
        head_s, head_b = _prices(self.head, profile)
        seconds, sent = np.zeros((P, len(self.shifts))), np.zeros((P, len(self.shifts), len(LEVELS)), dtype=np.int64)
        r = np.arange(P)
        j, g, p = r % a, r // a, P // a
        cache: dict = {}
        rings = [tuple(x + a * i for i in range(p)) for x in range(a)]  # the ring of j = r mod a
        for i, (shape, dtype, shift) in enumerate(zip(self.shapes, self.dtypes, self.shifts)):
            to, frm = j + a * ((g + shift) % p), j + a * ((g - shift) % p)  # (P,) the ranks sent to, received from
            pair = (to // rpn == r // rpn) * 2 + (frm // rpn == r // rpn)  # (P,) which levels the two links are
            for kind in np.flatnonzero(np.bincount(pair, minlength=4)):  # the pairs of levels that occur
                rank = int(np.argmax(pair == kind))  # one rank of this pair of levels prices them all
                c = Collective("send_recv", rings[rank % a], rank // a, shape, dtype, shift)
                t, levels = _priced(c, profile, cache)
                seconds[pair == kind, i] = t
                sent[pair == kind, i] = [levels[lv] for lv in LEVELS]
        return np.concatenate([head_s, seconds], axis=1), np.concatenate([head_b, sent], axis=1)


def _prices(kinds, profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """`(seconds (P, K), link bytes (P, K, levels))` of every rank's kinds (`RingShifts.prices` for those)."""
    if isinstance(kinds, RingShifts):
        return kinds.prices(profile)
    cache: dict = {}
    priced = [[_priced(c, profile, cache) for c in row] for row in kinds]
    seconds = np.array([[t for t, _ in row] for row in priced], dtype=np.float64).reshape(len(kinds), -1)
    sent = np.array([[[levels[lv] for lv in LEVELS] for _, levels in row] for row in priced], dtype=np.int64)
    return seconds, sent.reshape(len(kinds), seconds.shape[1], len(LEVELS))


@dataclass(frozen=True)
class Schedule:
    """Every rank of one candidate: the shared timeline, each rank's collectives by kind, its calls' amounts.

    Attributes:
        P: the ranks.
        events: the timeline, `(kind, phase, post index or slot, collective kind)` per event.
        kinds: `kinds[r][k]`: rank `r`'s collective of kind `k`, as the dry run records it (a tuple per rank, or
            `RingShifts`).
        slots: the calls' directions, heads and dims.
        work, q_rows, kv_rows, rows_seeing: `(P, slots)` int64: each rank's amounts per call.
        present: `(P, slots)` bool: the rank makes the call (a ring step with no work makes none).
        saved_bytes: `(P,)`: bytes each rank saves for the backward.
        width: `(P, slots)` int64: a windowed call's band width (`KernelCall.width`), or None: no window.
    """

    P: int
    events: tuple[tuple[str, str, int, int], ...]
    kinds: tuple[tuple[Collective, ...], ...] | RingShifts
    slots: tuple[Slot, ...]
    work: np.ndarray
    q_rows: np.ndarray
    kv_rows: np.ndarray
    rows_seeing: np.ndarray
    present: np.ndarray
    saved_bytes: np.ndarray
    width: np.ndarray | None = None

    def _call(self, r: int, s: int) -> KernelCall:
        slot = self.slots[s]
        width = 0 if self.width is None else int(self.width[r, s])
        return KernelCall(slot.direction, int(self.work[r, s]), int(self.q_rows[r, s]), int(self.kv_rows[r, s]),
                          slot.hq, slot.hkv, slot.d, slot.dv, slot.band, int(self.rows_seeing[r, s]), width)  # fmt: skip

    def run(self, r: int) -> RankRun:
        """Rank `r`'s run as the dry run records it (for the tests; `price` needs none)."""
        collectives, timeline = [], []
        for kind, phase, arg, k in self.events:
            if kind == "post":
                collectives.append(self.kinds[r][k])
                timeline.append(Event("post", phase, arg))
            elif kind == "wait":
                timeline.append(Event("wait", phase, arg))
            elif self.present[r, arg]:
                timeline.append(Event("call", phase, call=self._call(r, arg)))
        return RankRun(r, tuple(collectives), tuple(timeline), int(self.saved_bytes[r]))

    def price(self, profile: Profile, compute: Compute) -> tuple[RankTime, ...]:
        """Every rank's `RankTime`, as `rank_time` prices its run: the same two clocks, as arrays over the ranks."""
        P, posts = self.P, [k for kind, _, _, k in self.events if kind == "post"]
        durations, link = _prices(self.kinds, profile)  # (P, K), (P, K, levels)
        per_kind = np.bincount(np.asarray(posts, dtype=np.int64), minlength=durations.shape[1])
        per_pair = np.array([s.d + s.dv if s.direction == "forward" else 3 * s.d + 2 * s.dv for s in self.slots])
        heads = np.array([s.hq for s in self.slots])
        flops = np.where(self.present, 2 * self.work * heads * per_pair, 0)  # (P, slots)
        band = np.array([s.band for s in self.slots], dtype=bool)[None, :] & (self.width is not None)
        width = np.zeros_like(flops) if self.width is None else self.width
        seconds = compute.seconds_array(flops.astype(np.float64), self.work, heads[None, :], band, width)
        t, comm, exposed, busy = (np.zeros(P) for _ in range(4))
        done: dict[int, np.ndarray] = {}
        for kind, _, arg, k in self.events:
            if kind == "post":
                comm = np.maximum(t, comm) + durations[:, k]
                done[arg] = comm
            elif kind == "wait":
                late = done[arg] > t
                exposed = np.where(late, exposed + (done[arg] - t), exposed)
                t = np.where(late, done[arg], t)
            else:
                busy, t = busy + seconds[:, arg], t + seconds[:, arg]
        moved = np.einsum("pkl,k->pl", link, per_kind)  # (P, levels): each kind's bytes times its posts
        sent = [{lv: int(moved[r, i]) for i, lv in enumerate(LEVELS)} for r in range(P)]
        total_comm = durations @ per_kind
        calls, total_flops = self.present.sum(axis=1), flops.sum(axis=1)
        return tuple(RankTime(r, float(busy[r]), float(total_comm[r]), float(exposed[r]), float(t[r]), sent[r],
                              int(self.saved_bytes[r]), int(calls[r]), int(total_flops[r])) for r in range(P))  # fmt: skip


def _priced(c: Collective, profile: Profile, cache: dict) -> tuple[float, dict[str, int]]:
    """`(collective_seconds, link_bytes)` of `c`, priced once per what they depend on: a ring shift's shape, dtype
    and pair of link levels (to the rank it sends to, from the one it receives from); another collective's op,
    shape, dtype, group size, whether the group spans nodes, and the level to its ring successor (all-gather,
    reduce-scatter, all-reduce) or how many of its group share its node (all-to-all). A ring of P ranks with P - 1
    distances has P (P - 1) shifts, and P ranks each price their all-gather, but a handful of prices are distinct."""
    P, rpn, me = len(c.group), profile.ranks_per_node, c.group[c.rank]
    if c.op == "send_recv":
        to, frm = c.group[(c.rank + c.shift) % P], c.group[(c.rank - c.shift) % P]
        key = (c.shape, c.dtype, c.shift % P == 0, me // rpn == to // rpn, me // rpn == frm // rpn)
    else:
        nodes = cache.get(c.group)  # per group: how many of its ranks each node holds
        if nodes is None:
            nodes = cache[c.group] = Counter(g // rpn for g in c.group)
        near = nodes[me // rpn] if c.op == "all_to_all" else level(me, c.group[(c.rank + 1) % P], rpn)
        key = (c.op, c.shape, c.dtype, P, len(nodes) > 1, near)
    if key not in cache:
        cache[key] = (collective_seconds(c, profile), link_bytes(c, rpn))
    return cache[key]


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

