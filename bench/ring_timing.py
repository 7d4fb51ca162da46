r"""The ring's timeline on one rank, from the calls `bench.timed` recorded: per kernel call and per shift.

A ring step posts the next block's shift, computes, then waits for it; whatever of the shift's
time the rank spends posting or waiting is **exposed**, the rest ran behind the kernel. For one
shift that takes $t_s$ alone (the benchmark measures one blocking shift of the ring's largest
payload on the same processes), with $p$ seconds inside its post and $w$ inside its wait,

$$ \text{hidden} = 1 - \min(p + w,\ t_s) / t_s , $$

capped at $t_s$: waiting longer than the shift takes is waiting for the other rank's compute
(imbalance), which the per-call times show. Every shift's post and wait are paired by the event
index `bench.timed` records on a handle's wait, so each shift is judged on its own, and a shift
**can be hidden** only when at least one kernel call runs between its post and its wait. The
backward's last shift, the dK/dV accumulators going home after the last call, has nothing to hide
behind at any $P$; at $P = 2$ the forward's one shift of K/V, the backward's one shift of K/V and
the accumulators' first shift each have a call to hide behind.

Example: one forward step (a shift posted, a call, its wait), then a shift posted after the
last call and awaited at once:

    >>> events = [("comm", "send_recv_async", 0.001, None), ("compute", "forward", 0.5, None),
    ...           ("comm", "wait", 0.0, 0), ("comm", "send_recv_async", 0.001, None), ("comm", "wait", 0.009, 3)]
    >>> [(s["phase"], s["calls"], round(s["exposed"], 3)) for s in ring_shifts(events)]
    [('forward', 1, 0.001), ('forward', 0, 0.01)]
    >>> round(shift_hidden(ring_shifts(events)[0], t_shift=0.01), 2)
    0.9
"""

from __future__ import annotations

__all__ = ["hidden", "ring_shifts", "ring_steps", "shift_hidden"]

POSTS = ("send_recv_async",)  # the ring's posted shifts


def ring_steps(events: list[tuple]) -> list[dict]:
    """The ring's steps from a rank's timed calls: each kernel call with the shifts posted before it
    and the waits after it (until the next kernel call)."""
    steps: list[dict] = []
    posted, shifts = 0.0, 0  # posted since the last kernel call: they belong to the next step
    for which, name, seconds, _ in events:
        if which == "compute":
            steps.append({"phase": name, "compute": seconds, "wait": posted, "shifts": shifts})
            posted, shifts = 0.0, 0
        elif name in POSTS:
            posted, shifts = posted + seconds, shifts + 1
        elif name == "wait" and steps:
            steps[-1]["wait"] += seconds
    if steps:  # a shift posted after the last kernel call (the dK/dV coming home)
        steps[-1]["wait"] += posted
        steps[-1]["shifts"] += shifts
    return steps


def ring_shifts(events: list[tuple]) -> list[dict]:
    """Every shift in the order posted: `{"phase", "calls", "exposed"}`, `calls` the kernel calls between its post
    and its wait, `exposed` the seconds inside both, `phase` that of the last kernel call before its wait (else
    of the first after its post).

    Raises:
        ValueError: if a shift is never awaited (the events are not a whole step).
    """
    shifts: dict[int, dict] = {}  # post's event index -> the shift
    for i, (_field, name, seconds, posted) in enumerate(events):
        if name in POSTS:
            shifts[i] = {"post": i, "post_s": seconds, "wait": None}
        elif name == "wait" and posted in shifts:
            shifts[posted].update(wait=i, exposed=shifts[posted]["post_s"] + seconds)
    out = []
    for shift in shifts.values():
        if shift["wait"] is None:
            raise ValueError(f"ring_shifts: the shift posted at event {shift['post']} is never awaited")
        between = [e[1] for e in events[shift["post"] + 1 : shift["wait"]] if e[0] == "compute"]
        before = [e[1] for e in events[: shift["wait"]] if e[0] == "compute"]
        after = [e[1] for e in events[shift["post"] :] if e[0] == "compute"]
        phase = (before or after or ["-"])[-1 if before else 0]
        out.append({"phase": phase, "calls": len(between), "exposed": shift["exposed"]})
    return out


def shift_hidden(shift: dict, t_shift: float) -> float:
    """The fraction of one shift hidden behind compute: `1 - min(exposed, t_shift) / t_shift`."""
    return 1 - min(shift["exposed"], t_shift) / t_shift if t_shift > 0 else float("nan")


def hidden(steps: list[dict], t_shift: float) -> tuple[int, float]:
    """`(shifts, fraction hidden)` of one rank's ring over all its shifts: a call's exposed communication is its
    wait, up to what its shifts take alone (beyond that it waits for the peer's compute)."""
    exposed, shifts = sum(min(s["wait"], s["shifts"] * t_shift) for s in steps), sum(s["shifts"] for s in steps)
    return shifts, (1 - exposed / (shifts * t_shift) if shifts and t_shift > 0 else float("nan"))
