r"""Rendezvous: how the rank threads of the simulated cluster meet, and how they fail.

A collective is a meeting. Every call a rank makes on a group takes that group's next
**sequence number** `seq` (0, 1, 2, ... counted by the rank's communicator), so the `k`-th
call of every member lands in the same **slot**, keyed by `(group id, seq)`:

1. the rank registers its call (`op`, shape, dtype, arguments) and its input in the slot;
2. the **last** member to arrive checks that all calls match, computes every member's output
   once, in rank order (see `sim.cluster.simcluster`), records one trace event, and wakes the others;
3. every member takes its own output and returns.

All of this happens under one `threading.Condition` per run, so the computation never races
with an arrival, and the result does not depend on which thread happened to arrive last.

**Faults never hang.** A waiting rank re-checks, each time it is woken, why it might never be
served, and raises instead of waiting:

| situation | every affected rank raises |
| --- | --- |
| the members called different ops, or shapes/dtypes/arguments differ | `CollectiveMismatch` |
| a member raised an exception (now, or before this call) | `PeerFailure` naming it |
| a member returned from its function without making this call | `PeerFailure` naming it |
| a member gave up on this very call (timed out, or saw a failure) | `PeerFailure` naming it |
| nothing happened for `timeout` seconds (a genuine deadlock) | `CollectiveTimeout` |
| the run was interrupted (`SimCluster.run` got Ctrl-C) | `Interrupted`, at once or at its next call |

`SimCluster.run` gathers the ranks' exceptions into one `ClusterFailure`, which names the root
cause: the first failure that is not a `PeerFailure` (peer failures are its consequences).

The timeout report lists where every rank of the cluster is (running, finished, failed, or
waiting in which op `#seq` on which group), which is what one needs to read a deadlock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from cpref.base.errors import PeerInputError

__all__ = [
    "Call",
    "ClusterFailure",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Interrupted",
    "PeerFailure",
    "Position",
    "Rendezvous",
]


class CollectiveError(RuntimeError):
    """Base class of the faults the simulated cluster detects inside a collective."""


@dataclass(frozen=True)
class Position:
    """Where a rank waits: its `seq`-th collective `op` on `group` (global ranks)."""

    op: str
    seq: int
    group: tuple[int, ...]
    gid: Hashable = "world"

    def __str__(self) -> str:
        return f"{self.op} #{self.seq} on group {self.group}"


@dataclass(frozen=True)
class Call:
    """The signature of one rank's call; all members of a slot must have equal ones."""

    op: str
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    param: str = ""

    def __str__(self) -> str:
        args = [] if self.shape is None else [f"shape={self.shape}", f"dtype={self.dtype}"]
        return f"{self.op}({', '.join(args + ([self.param] if self.param else []))})"


class CollectiveMismatch(CollectiveError):
    """The members of a group made different calls at the same sequence point.

    Attributes:
        rank: the global rank that raised this error.
        calls: `{global rank: call}` for every member, e.g. `{0: "barrier()", ...}`.
    """

    def __init__(self, rank: int, pos: Position, calls: dict[int, str]) -> None:
        self.rank, self.calls = rank, calls
        lines = [f"  rank {g}: {c}{'  <- this rank' if g == rank else ''}" for g, c in calls.items()]
        super().__init__(
            f"rank {rank}: collective #{pos.seq} on group {pos.group} does not match across ranks:\n"
            + "\n".join(lines)
            + "\nEvery member must make the same sequence of calls, with identical shapes and dtypes."
        )


class PeerFailure(CollectiveError):
    """A peer failed or finished, so the collective this rank waits in can never complete.

    Attributes:
        rank: the global rank that raised this error.
        peer: the global rank that failed, finished, or gave up.
        cause: the peer's exception, or `None` if it returned without making the call.
    """

    def __init__(self, rank: int, pos: Position, peer: int, cause: BaseException | None) -> None:
        self.rank, self.peer, self.cause = rank, peer, cause
        if cause is None:
            why = f"rank {peer} finished without calling {pos}"
        else:
            first_line = str(cause).splitlines()[0] if str(cause) else ""
            why = f"rank {peer} failed with {type(cause).__name__}: {first_line}"
        super().__init__(f"rank {rank} gave up waiting in {pos}: {why}")


class CollectiveTimeout(CollectiveError):
    """A rendezvous waited longer than the cluster's timeout: most likely a deadlock.

    Attributes:
        rank: the global rank that raised this error.
        report: `{global rank: where it was}` when the timeout fired.
    """

    def __init__(self, rank: int, pos: Position, timeout: float, report: dict[int, str]) -> None:
        self.rank, self.report = rank, report
        lines = [f"  rank {g}: {w}{'  <- this rank' if g == rank else ''}" for g, w in report.items()]
        super().__init__(
            f"rank {rank} waited {timeout} s in {pos} (deadlock?); where every rank is:\n" + "\n".join(lines)
        )


class Interrupted(CollectiveError):
    """The run was interrupted (Ctrl-C in `SimCluster.run`): a rank raises it in the collective it waits in, or
    at its next one, so that every rank thread ends.

    Attributes:
        rank: the global rank that raised this error.
    """

    def __init__(self, rank: int, pos: Position) -> None:
        self.rank = rank
        super().__init__(f"rank {rank} stopped in {pos}: the run was interrupted")


class ClusterFailure(RuntimeError):
    """Some ranks of a `SimCluster.run` raised, and not all the same exception.

    The root cause is chosen among the failures, in the order the ranks failed, by kind: a
    stuck rank first (its peers' timeouts are its consequence), then any exception a rank's
    own code raised, then a `cpref.base.errors.PeerInputError` (a rank that raises because another
    rank's input failed validation: that rank's own error is the cause), then a
    `CollectiveTimeout` (a genuine deadlock), then a `PeerFailure`.

    Attributes:
        errors: `{rank: exception}` for every rank that raised, sorted by rank.
        root_rank: the rank of the root cause.
    """

    def __init__(self, errors: dict[int, BaseException], world_size: int) -> None:
        # `errors` arrives in the order the ranks failed; peers' failures are consequences
        def kind(e: BaseException) -> int:
            if type(e).__name__ == "RankStuck":
                return 0
            if isinstance(e, PeerInputError):
                return 2
            return 4 if isinstance(e, PeerFailure) else 3 if isinstance(e, CollectiveTimeout) else 1

        self.root_rank = min(errors, key=lambda g: kind(errors[g]))  # min keeps the first of a kind
        self.errors = dict(sorted(errors.items()))
        root = errors[self.root_rank]
        lines = [
            f"  rank {g}: {type(e).__name__}: " + str(e).replace("\n", "\n    ")
            + ("  <- root cause" if g == self.root_rank else "")
            for g, e in self.errors.items()
        ]
        head = str(root).splitlines()[0] if str(root) else ""
        super().__init__(
            f"{len(errors)} of {world_size} ranks failed; root cause: rank {self.root_rank} raised "
            f"{type(root).__name__}: {head}\n" + "\n".join(lines)
        )


@dataclass
class _Slot:
    """One collective call of one group: the meeting point of its members."""

    size: int
    calls: dict[int, Call] = field(default_factory=dict)  # local rank -> signature
    inputs: dict[int, Any] = field(default_factory=dict)  # local rank -> input
    outputs: list[Any] | None = None  # local rank -> output, once computed
    mismatch: dict[int, str] | None = None  # global rank -> call, if calls differ
    abandoned: tuple[int, BaseException] | None = None  # (global rank, why) of the first quitter
    taken: int = 0


class Rendezvous:
    """The meeting point of one run's rank threads (one lock, one condition, all slots).

    Args:
        world_size: number of ranks in the cluster.
        timeout: seconds a rank may wait in one collective before `CollectiveTimeout`.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[tuple[Hashable, int], _Slot] = {}
        self._where: list[str | tuple[Position, float]] = ["running"] * world_size
        self._failed: dict[int, BaseException] = {}  # insertion order = order of failure
        self._finished: set[int] = set()
        self._interrupted = False
        self.reduction = "exact"  # how SimComm reduces fp16/bf16 in this run (see sim.cluster.simcluster)

    # --8<-- [start:rendezvous]
    def arrive(self, rank: int, local: int, pos: Position, call: Call, x: Any, complete: Callable) -> Any:
        """Join collective `pos` as global `rank` (`local` in the group); return this rank's output.

        `complete(inputs)` maps the inputs in rank order to the outputs in rank order; the last
        member to arrive calls it, exactly once, under the lock.

        Raises:
            CollectiveMismatch, PeerFailure, CollectiveTimeout: see the module docstring.
        """
        with self._cond:
            if self._interrupted:
                raise Interrupted(rank, pos)
            slot = self._slots.setdefault((pos.gid, pos.seq), _Slot(len(pos.group)))
            # 1) a member that already failed or finished will never come: fail fast
            self._raise_if_doomed(rank, pos, slot)
            # 2) register; the last to arrive computes every member's output at once
            slot.calls[local], slot.inputs[local] = call, x
            if len(slot.calls) == slot.size:
                self._complete(rank, pos, slot, complete)
            # 3) wait until served or until it is certain that this call can never complete
            self._where[rank] = (pos, time.monotonic())
            try:
                return self._wait(rank, local, pos, slot)
            finally:
                self._where[rank] = "running"

    def _complete(self, rank: int, pos: Position, slot: _Slot, complete: Callable) -> None:
        calls = [slot.calls[i] for i in range(slot.size)]
        try:
            if any(c != calls[0] for c in calls):
                slot.mismatch = {g: str(c) for g, c in zip(pos.group, calls)}
            else:
                slot.outputs = complete([slot.inputs[i] for i in range(slot.size)])
        except BaseException as exc:  # a bug in the computation: the peers must not hang
            slot.abandoned = (rank, exc)
            raise
        finally:
            slot.inputs = {}  # drop the references to the inputs
            self._cond.notify_all()

    def _wait(self, rank: int, local: int, pos: Position, slot: _Slot) -> Any:
        deadline = time.monotonic() + self.timeout
        while slot.outputs is None:
            if self._interrupted:
                raise Interrupted(rank, pos)
            if slot.mismatch is not None:
                raise CollectiveMismatch(rank, pos, slot.mismatch)
            self._raise_if_doomed(rank, pos, slot)
            if time.monotonic() >= deadline:
                error = CollectiveTimeout(rank, pos, self.timeout, self.report())
                self._abandon(rank, slot, error)
                raise error
            self._cond.wait(deadline - time.monotonic())
        output, slot.outputs[local] = slot.outputs[local], None
        slot.taken += 1
        if slot.taken == slot.size:  # everyone served: forget the slot
            del self._slots[(pos.gid, pos.seq)]
        return output

    # --8<-- [end:rendezvous]

    def _raise_if_doomed(self, rank: int, pos: Position, slot: _Slot) -> None:
        """Raise `PeerFailure` if some member can no longer make this call."""
        # a member that failed or finished without arriving, or one that arrived and gave up
        doomed = [(g, self._failed.get(g)) for i, g in enumerate(pos.group) if i not in slot.calls]
        doomed = [(g, e) for g, e in doomed if e is not None or g in self._finished]
        doomed += [slot.abandoned] if slot.abandoned is not None else []
        if doomed:
            # blame an original failure rather than a peer that merely gave up because of it
            peer, cause = min(doomed, key=lambda d: isinstance(d[1], PeerFailure))
            error = PeerFailure(rank, pos, peer, cause)
            self._abandon(rank, slot, error)
            raise error

    def _abandon(self, rank: int, slot: _Slot, error: BaseException) -> None:
        if slot.abandoned is None:
            slot.abandoned = (rank, error)
        self._cond.notify_all()

    def report(self) -> dict[int, str]:
        """Return `{global rank: where it is}`: running, finished, failed, or waiting in what."""
        with self._cond:
            now, report = time.monotonic(), {}
            for g, where in enumerate(self._where):
                if g in self._failed:
                    report[g] = f"failed with {type(self._failed[g]).__name__}"
                elif g in self._finished:
                    report[g] = "finished"
                elif isinstance(where, tuple):
                    report[g] = f"waiting in {where[0]} for {now - where[1]:.2f} s"
                else:
                    report[g] = "running (outside any collective)"
            return report

    def finished(self, rank: int) -> None:
        """Record that `rank`'s function returned; wake peers that wait for it."""
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()

    def failed(self, rank: int, error: BaseException) -> None:
        """Record that `rank`'s function raised `error`; wake peers that wait for it."""
        with self._cond:
            self._failed[rank] = error
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Make every rank raise `Interrupted`: those waiting now at once, the others at their next collective."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def forget(self) -> None:
        """Drop the exceptions recorded so far (and the frames their tracebacks hold)."""
        with self._cond:
            self._failed.clear()

    def waiting(self) -> bool:
        """Whether some rank is waiting inside a collective right now."""
        with self._cond:
            return any(isinstance(w, tuple) for w in self._where)

    def failures(self) -> dict[int, BaseException]:
        """Return `{global rank: exception}` in the order the ranks failed."""
        with self._cond:
            return dict(self._failed)
