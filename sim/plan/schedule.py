r"""A schedule at scale: every rank's timeline, kernel calls and collectives as arrays, priced at once.

The builders of [`sim.plan.scale`][sim.plan.scale], [`sim.plan.scale_window`][sim.plan.scale_window]
and [`sim.plan.scale_split`][sim.plan.scale_split] each describe a candidate the same way, as a
[`Schedule`][sim.plan.schedule.Schedule]:

* **the timeline** of a rank (posts, waits, calls, in program order), the same for every rank of
  the candidate, written by the mode's template ([`ring_template`][sim.plan.schedule.ring_template],
  [`hierarchy_template`][sim.plan.schedule.hierarchy_template],
  [`overlap_template`][sim.plan.schedule.overlap_template]) as its code posts and waits;
* **the kernel calls**: one [`Slot`][sim.plan.schedule.Slot] per call of the timeline (direction,
  heads, dims), and per rank and slot the call's work, rows and keys as `(P, slots)` arrays;
* **the collectives** as the dry run records them (op, group, shape, dtype, shift), one of each
  kind per rank; a ring's ~$P^2$ shifts as one column per distance
  ([`RingShifts`][sim.plan.schedule.RingShifts]), and every collective priced once per what its
  price depends on by the time model's own [`collective_seconds`][sim.plan.model.collective_seconds];
* **the saved bytes** per rank.

[`Schedule.price`][sim.plan.schedule.Schedule.price] plays every rank's timeline at once, the two
clocks of [`rank_time`][sim.plan.model.rank_time] as arrays over the ranks;
[`Schedule.run`][sim.plan.schedule.Schedule.run] writes one rank's
[`RankRun`][sim.plan.dry.RankRun] out, which the tests hold to the dry run's event by event.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sim.plan.dry import Collective, Event, KernelCall, RankRun
from sim.plan.links import LEVELS, level, link_bytes
from sim.plan.model import RankTime, collective_seconds
from sim.plan.profile import Compute, Profile

__all__ = ["Slot", "Schedule", "RingShifts", "overlap_template", "ring_template", "hierarchy_template", "exchange_kinds"]


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
