r"""The time model: a rank's counted step ([`sim.plan.dry`][sim.plan.dry]) priced by a profile.

Every term below is a formula of the counts the dry run gives and the numbers of a
[profile][sim.plan.profile] (link rate $B$ and latency $\alpha$ per level, the kernel's curve
$R_\infty$, $F_{1/2}$ per dtype).

**Kernel calls.** A call of $F$ FLOPs takes $t = F / R(F)$ on the profile's curve, $(F + F_{1/2}) /
R_\infty$ with its two numbers; where the profile has `by_work` curves, $t = F / R(w, H_q)$ by the
call's shape instead: its work per head $w$ (visible query-key pairs) and its query heads $H_q$, so
that a Ulysses call (half the heads, twice the work per head) and an all-gather call of the same
FLOPs take the rates each shape runs at; a windowed call of band width $W$ (the most keys one of its rows
sees) takes $F / R_{\mathrm{band}}(W)$ where the profile has a band curve: its rate is its tiles',
set by the width, not by the call's size
([`Compute.call_seconds`][sim.plan.profile.Compute.call_seconds]).

**Collectives**, by the algorithm the backends use (NCCL's and HCCL's ring and pairwise ones, as
the simulated cluster counts bytes), for a group of $P$ ranks and this rank's input of $n$ bytes:

| op | time |
| --- | --- |
| `send_recv` | $\alpha_\ell + n / B^{\mathrm{p2p}}_\ell$, $\ell$ the slower of the links to the rank it sends to and the one it receives from |
| `all_gather`, `reduce_scatter`, `all_reduce` | $s\,\alpha_\ell + V / B_\ell$: $s$ ring steps ($P - 1$; $2 (P - 1)$ for `all_reduce`), $V$ the bytes the rank sends ([`sim.plan.links`][sim.plan.links]), $\ell$ = inter if the group spans nodes (every step waits for its slowest hop) |
| `all_to_all` | $\alpha_\ell + \max_\ell V_\ell / B_\ell$: every pair at once, each level carrying its own bytes $V_\ell$ |

**Overlap, as the schedule does it.** The dry run's timeline gives, in program order, when a
collective is posted, when the rank waits for it, and the kernel calls in between. The model
plays it on two clocks: collectives run one after another on the communication clock, starting
no earlier than their post; kernel calls advance the compute clock; a wait moves the compute
clock to the collective's end, and what it moves it by is the **exposed** communication. So the
ring's shift $i$ hides behind call $i$, a blocking collective hides behind nothing, and Ulysses'
head groups hide the next group's exchange behind this group's call, each because its code posts
and waits where it does; no mode has a rule of its own here.

**The step** of a rank is its compute clock at the end; the layer's step is the slowest rank's.
Ranks are priced each on its own: a collective that would also wait for a slower peer is not
delayed for it (the slowest rank's step is what the others wait for, so the layer's time holds).

**Memory** is the bytes the step saves for the backward, counted from autograd's saved tensors
in the dry run.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.plan.dry import Collective, KernelCall, RankRun
from sim.plan.links import LEVELS, level, link_bytes
from sim.plan.profile import Compute, Profile

__all__ = ["RankTime", "Interval", "collective_seconds", "played", "rank_time"]


@dataclass(frozen=True)
class RankTime:
    """One rank's priced step.

    Attributes:
        rank: its global rank.
        compute: seconds in kernel calls.
        comm: seconds its collectives take, overlapped or not.
        exposed: seconds the rank waits for collectives (comm not hidden behind compute).
        step: compute + exposed: its step.
        bytes: bytes it sends per link level.
        saved_bytes: bytes it saves for the backward.
        calls: its kernel calls.
        flops: their FLOPs (`KernelCall.flops`), summed.
    """

    rank: int
    compute: float
    comm: float
    exposed: float
    step: float
    bytes: dict[str, int]
    saved_bytes: int
    calls: int
    flops: int


def collective_seconds(c: Collective, profile: Profile) -> float:
    """The time of collective `c` for its rank (module docstring's table)."""
    P, rpn = len(c.group), profile.ranks_per_node
    per_level = link_bytes(c, rpn)
    if sum(per_level.values()) == 0:
        return 0.0
    me = c.group[c.rank]
    if c.op == "send_recv":
        to, frm = c.group[(c.rank + c.shift) % P], c.group[(c.rank - c.shift) % P]
        slow = "inter" if "inter" in (level(me, to, rpn), level(me, frm, rpn)) else "intra"
        return profile.links[slow].seconds(c.nbytes, send_recv=True)
    spans = len({g // rpn for g in c.group}) > 1
    if c.op in ("all_gather", "reduce_scatter", "all_reduce"):
        steps = (P - 1) * (2 if c.op == "all_reduce" else 1)
        link = profile.links["inter" if spans else "intra"]
        return link.seconds(sum(per_level.values()), messages=steps)
    # all_to_all: every pair at once, each level carrying its own bytes
    latency = profile.links["inter" if spans else "intra"].latency
    return latency + max(per_level[lv] / profile.links[lv].bandwidth for lv in LEVELS)


@dataclass(frozen=True)
class Interval:
    """One stretch of a priced step: a kernel call or a wait on the compute clock, a collective on the
    communication clock.

    Attributes:
        kind: `"call"`, `"wait"` (the compute clock stopped for collective `index`: exposed communication) or
            `"collective"` (collective `index` running).
        phase: `"forward"` or `"backward"`: the half of the step whose event started it.
        start: seconds from the step's start.
        seconds: its length.
        index: the collective's position in `RankRun.collectives` (`"wait"`, `"collective"`), else -1.
        call: the kernel call (`"call"`), else None.
    """

    kind: str
    phase: str
    start: float
    seconds: float
    index: int = -1
    call: KernelCall | None = None

    @property
    def end(self) -> float:
        """`start + seconds`."""
        return self.start + self.seconds


def played(run: RankRun, profile: Profile, compute: Compute) -> tuple[tuple[Interval, ...], float]:
    """Play `run`'s timeline on its two clocks (module docstring): every call, wait and collective as an
    `Interval`, in the order the timeline reaches them, and the compute clock at the end (the step).

    A collective starts at its post or when the one before it ends, whichever is later; a wait stops the
    compute clock until its collective ends (a `"wait"` interval only where it ends later than the clock)."""
    durations = [collective_seconds(c, profile) for c in run.collectives]
    done: dict[int, float] = {}
    out: list[Interval] = []
    t = comm_clock = 0.0
    for event in run.timeline:
        if event.kind == "post":
            start = max(t, comm_clock)
            comm_clock = done[event.index] = start + durations[event.index]
            out.append(Interval("collective", event.phase, start, durations[event.index], event.index))
        elif event.kind == "wait":
            if done[event.index] > t:
                out.append(Interval("wait", event.phase, t, done[event.index] - t, event.index))
                t = done[event.index]
        else:
            dt = compute.call_seconds(event.call)
            out.append(Interval("call", event.phase, t, dt, call=event.call))
            t += dt
    return tuple(out), t


def rank_time(run: RankRun, profile: Profile, compute: Compute) -> RankTime:
    """Play `run`'s timeline on its two clocks (module docstring; the intervals: `played`) and sum them."""
    intervals, step = played(run, profile, compute)
    busy = sum(i.seconds for i in intervals if i.kind == "call")
    exposed = sum(i.seconds for i in intervals if i.kind == "wait")
    comm = sum(i.seconds for i in intervals if i.kind == "collective")
    sent = dict.fromkeys(LEVELS, 0)
    for c in run.collectives:
        for lv, nbytes in link_bytes(c, profile.ranks_per_node).items():
            sent[lv] += nbytes
    return RankTime(run.rank, busy, comm, exposed, step, sent, run.saved_bytes, len(run.calls),
                    sum(c.flops for c in run.calls))  # fmt: skip
