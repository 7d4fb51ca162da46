r"""The simulated cluster: $P$ ranks as threads of one process.

A context-parallel algorithm is a program that $P$ ranks run at once, meeting in collectives.
`SimCluster(P).run(fn)` runs `fn(comm)` once per rank, each rank on its own thread, where
`comm` is a [`SimComm`][sim.cluster.simcluster.SimComm]: the rank's view of the group, satisfying
[`cpref.comm.protocol.Collectives`][cpref.comm.protocol.Collectives]. It returns the per-rank results,
indexed by rank. Every CP algorithm therefore runs unchanged on a laptop.

## Why one process, in FP64

Correctness first: in one process every rank's tensors are ordinary CPU tensors, so they can
be float64, compared bitwise, inspected in a debugger and checked against the FP64 oracle
(`sim.oracle`). A bug then shows as an error of order one, not hidden under bf16 noise.

## Rendezvous and determinism

The `k`-th collective that the members of a group call meets in one slot (see
`sim.cluster.rendezvous`); the last member to arrive computes all outputs at once, **in rank order**.
A reduction is the left fold

$$ y = (\dots((x_0 \oplus x_1) \oplus x_2) \dots) \oplus x_{P-1}, $$

whatever order the threads arrived in: same inputs, bitwise the same outputs, on every run.

**Two reduction precisions.** With `reduction="exact"` (the default) fp16 and bf16 are
accumulated in float64 and rounded once at the end: the ground truth, but more precise than
real hardware. NCCL and HCCL reduce in the tensor's own dtype, rounding after every
addition, so with `reduction="native"` every partial sum $(\dots(x_0 \oplus x_1) \dots)$ is
rounded to the input dtype, as a ring reduction does: the simulator must not flatter
low-precision results, and the bf16/fp16 tests of the CP modes use this option. float32 and
float64 are folded in their own dtype either way. Every output is a fresh
tensor, never a view of another rank's input, without autograd history (as in
`torch.distributed`; algorithms pair their collectives in `autograd.Function`s).

All ranks of a group must make the same calls with **identical shapes and dtypes** (also
`all_gather`: equal-size chunks are what THD sharding produces). `reduce_scatter` and
`all_to_all` need dim 0 divisible by $P$; that is checked before the rendezvous, on every
rank alike, and raises `ValueError`.

## Faults never hang

Mismatched calls, a peer that raised or returned, and deadlocks raise `CollectiveMismatch`,
`PeerFailure` and `CollectiveTimeout` inside the ranks, fast (the table is in
`sim.cluster.rendezvous`). A rank stuck in its own code (an endless loop) cannot be interrupted, as
Python threads cannot be killed; its peers time out waiting for it, and `run` then gives it
a short margin, `min(timeout, 5 s)`, to end. If it has not, `run` reports it as a
`RankStuck` failure with the code it is executing, and returns without it (the thread is
left running as a daemon). `run` re-raises rank 0's exception if every rank raised the same
one (e.g. the same validation error), and otherwise raises `ClusterFailure`: every rank's
exception, and the root cause (see `sim.cluster.rendezvous.ClusterFailure`).

**Ctrl-C.** A `KeyboardInterrupt` reaches `run`'s own thread, not the ranks'. `run` then makes
every rank raise `Interrupted` in the collective it waits in, or at its next one, waits for the
rank threads to end (the same margin, `min(timeout, 5 s)`), lets go of what they left (their
exceptions, and with them the `finally` blocks of generators they were suspended in, which run then:
a checkpoint on the disk is as they leave it when `run` returns), and re-raises the `KeyboardInterrupt`.
No rank is left running into the interpreter's exit, where a thread inside torch's C++ code is
ended mid-call and the C++ runtime aborts the process ("terminate called without an active
exception", SIGABRT) instead of the exit status of Ctrl-C.

## On an accelerator

The ranks' tensors may live on a GPU (`python -m sim.tools.demo --device cuda`): the ranks are
then threads sharing one device. PyTorch's autograd normally runs the backward of device
tensors on one engine thread per device, which would run the ranks' backward passes one
after the other, so a rank blocked in a collective inside its backward would wait forever
for the others. Each rank therefore runs with multithreaded backward off
(`torch.autograd.set_multithreading_enabled(False)`): its backward runs on its own thread.

## Traces

Each completed collective appends one `sim.cluster.trace.CollectiveEvent` to `SimCluster.trace`, with
the bytes each member sends and receives under a bandwidth-optimal cost model. Events of one
group are in call order; events of concurrent sub-groups interleave in completion order.

Example:
    >>> import torch
    >>> from sim import SimCluster
    >>> cluster = SimCluster(4)
    >>> out = cluster.run(lambda comm: comm.all_gather(torch.full((1,), float(comm.rank))))
    >>> out[2]  # every rank holds cat(x_0, ..., x_3)
    tensor([0., 1., 2., 3.])
    >>> ev = cluster.trace[0]
    >>> ev.op, ev.group, ev.bytes_sent  # (P - 1) n = 3 x 4 bytes per rank
    ('all_gather', (0, 1, 2, 3), (12, 12, 12, 12))
"""

from __future__ import annotations

import gc
import math
import operator
import sys
import threading
import time
import traceback
from functools import partial
from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch

from cpref.comm.protocol import REDUCE_OPS, check_partition, check_payload
from sim.cluster.rendezvous import Call, ClusterFailure, Position, Rendezvous
from sim.cluster.trace import CollectiveEvent, TraceSummary, summarize, traffic

__all__ = ["SimCluster", "SimComm", "SimPending", "RankStuck", "Unwaited", "REDUCTIONS"]

T = TypeVar("T")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_FOLD = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


REDUCTIONS = ("exact", "native")


# --8<-- [start:rank-order]
def _reduce(xs: list[torch.Tensor], op: str, reduction: str = "exact") -> torch.Tensor:
    """Fold `xs` left to right in rank order; "exact": fp16/bf16 accumulate in float64."""
    wide = torch.float64 if xs[0].dtype in _LOW_PRECISION and reduction == "exact" else xs[0].dtype
    acc = xs[0].to(wide, copy=True)  # (...)
    for x in xs[1:]:
        # acc <- acc (+) x_s for s = 1, ..., P-1: one fixed order, hence one fixed rounding
        acc = _FOLD[op](acc, x.to(wide))  # (...)
    return acc.to(xs[0].dtype)


def _reduce_scatter(xs: list[torch.Tensor], reduction: str = "exact") -> list[torch.Tensor]:
    total = _reduce(xs, "sum", reduction)  # (P n, ...)
    return [c.clone() for c in total.tensor_split(len(xs))]  # rank r: chunk r, (n, ...)
# --8<-- [end:rank-order]


def _all_gather(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = torch.cat(xs)  # P x (n, ...) -> (P n, ...)
    return [out.clone() for _ in xs]


def _all_to_all(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    p = len(xs)
    chunks = [x.tensor_split(p) for x in xs]  # chunks[s][r]: (n, ...), sent from s to r
    return [torch.cat([chunks[s][r] for s in range(p)]) for r in range(p)]  # (P n, ...)


def _send_recv(xs: list[torch.Tensor], shift: int) -> list[torch.Tensor]:
    return [xs[(r - shift) % len(xs)].clone() for r in range(len(xs))]  # rank r <- x_{r-shift}


def _all_reduce(xs: list[torch.Tensor], op: str, reduction: str = "exact") -> list[torch.Tensor]:
    total = _reduce(xs, op, reduction)  # (...)
    return [total.clone() for _ in xs]


def _nothing(xs: list[Any]) -> list[None]:
    return [None] * len(xs)


class RankStuck(RuntimeError):
    """A rank still running its own code (outside any collective) after its peers failed.

    Attributes:
        rank: the stuck rank.
        where: the innermost lines of its stack when it was reported.
    """

    def __init__(self, rank: int, margin: float, frame: Any) -> None:
        self.rank = rank
        stack = traceback.format_stack(frame)[-3:] if frame is not None else ["  (no frame)\n"]
        self.where = "".join(stack).rstrip()
        super().__init__(
            f"rank {rank} is stuck: still running outside any collective {margin:.1f} s after its peers "
            f"failed; it is executing:\n{self.where}"
        )


class Unwaited(RuntimeError):
    """A rank returned while a collective it posted (`send_recv_async`, `all_gather_async`, ...) was never waited on."""


class SimPending:
    """The handle of a simulated posted collective: it has completed; `wait()` hands the result over.

    It also holds the rank to the protocol's rule that a posted input stays untouched until the
    wait: a real backend may still be reading it, so an in-place change in between (seen by the
    tensor's version counter) raises at the wait instead of passing here and failing there.
    """

    def __init__(self, result: torch.Tensor, where: str, sent: torch.Tensor) -> None:
        self._result: torch.Tensor | None = result
        self._sent, self._version = (None, None) if sent.is_inference() else (sent, sent._version)  # no counter there
        self.where, self.done = where, False

    def wait(self) -> torch.Tensor:
        """Return the result.

        Raises:
            RuntimeError: on a second call, or if the posted input was modified in place since the post.
        """
        if self.done:
            raise RuntimeError(f"{self.where}: wait() called twice on one handle")
        if self._sent is not None and self._sent._version != self._version:
            raise RuntimeError(f"{self.where}: its input was modified in place before wait(); a real backend may "
                               "still be sending it: change a copy, or wait first")  # fmt: skip
        self.done = True
        result, self._result, self._sent = self._result, None, None
        return result


class SimComm:
    """One rank's view of one group of the simulated cluster; a `cpref.comm.protocol.Collectives`.

    Created by `SimCluster.run` (the world group) and by `split` (sub-groups); the collectives
    follow the semantics table of `cpref.comm.protocol`.

    Attributes:
        rank: this rank's index in the group, `0 <= rank < size`.
        size: the number of ranks `P` in the group.
        global_rank: this rank's index in the cluster.
        group: the group's global ranks, in group rank order (`group[rank] == global_rank`).
        unsupported_ops: empty: the simulated cluster runs every collective at every size.
    """

    unsupported_ops: frozenset[str] = frozenset()

    def __init__(
        self, rdv: Rendezvous, trace: list, group: tuple[int, ...], global_rank: int, gid: Hashable = "world",
        pending: list | None = None,
    ):
        self.group, self.global_rank = group, global_rank
        self.rank, self.size = group.index(global_rank), len(group)
        self._rdv, self._trace, self._gid, self._seq = rdv, trace, gid, 0
        self._pending: list[SimPending] = [] if pending is None else pending  # shared with sub-groups

    def __repr__(self) -> str:
        return f"SimComm(rank={self.rank}, size={self.size}, group={self.group})"

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along dim 0 in rank order: `(n, ...) -> (P n, ...)`."""
        return self._collective("all_gather", check_payload("all_gather", x, 1, 1), _all_gather)

    def agree(self, row: Sequence[int]) -> list[list[int]]:
        """Every rank's `row` of Python ints, in rank order: a host all-gather (`cpref.modes.consistency`).

        No tensor is made or read: the exchange models one over the CPU, which never waits for
        an accelerator. Traced as an `all_gather` of `(1, n)` int64 with `param` `"host"`.
        """
        row = tuple(operator.index(v) for v in row)
        return self._collective("all_gather", row, lambda rows: [[list(r) for r in rows]] * len(rows), "host")

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks (rank order) and keep chunk `rank`: `(P n, ...) -> (n, ...)`.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        compute = partial(_reduce_scatter, reduction=self._rdv.reduction)
        return self._collective("reduce_scatter", check_payload("reduce_scatter", x, 1, self.size), compute)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Send chunk `j` of dim 0 to rank `j`; return the chunks received, in rank order.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        return self._collective("all_to_all", check_payload("all_to_all", x, 1, self.size), _all_to_all)

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """Ring shift: send `x` to rank `r + shift`, return what rank `r - shift` sent (mod P)."""
        shift = operator.index(shift)
        compute = partial(_send_recv, shift=shift)
        return self._collective("send_recv", check_payload("send_recv", x), compute, f"shift={shift}", shift)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> SimPending:
        """Start the ring shift of `send_recv`; `wait()` on the handle returns the received tensor.

        The simulated cluster completes a posted collective eagerly, at the call (it takes its
        place in the group's sequence of collectives there), but still holds the rank to the
        protocol: a handle waited on twice raises at once, an input changed in place before the
        wait raises there (`SimPending`), and a rank that returns with a handle it never waited
        on fails (`Unwaited`), as a real ring would lose that message.
        """
        return self._posted("send_recv_async", self.send_recv(x, shift), x)

    def all_gather_async(self, x: torch.Tensor) -> SimPending:
        """Start the `all_gather` of `x`; `wait()` returns `(P n, ...)` (completed at the call, as `send_recv_async`)."""
        return self._posted("all_gather_async", self.all_gather(x), x)

    def reduce_scatter_async(self, x: torch.Tensor) -> SimPending:
        """Start the `reduce_scatter` of `x`; `wait()` returns `(n, ...)` (completed at the call, as `send_recv_async`)."""
        return self._posted("reduce_scatter_async", self.reduce_scatter(x), x)

    def all_to_all_async(self, x: torch.Tensor) -> SimPending:
        """Start the `all_to_all` of `x`; `wait()` returns `(P n, ...)` (completed at the call, as `send_recv_async`)."""
        return self._posted("all_to_all_async", self.all_to_all(x), x)

    def _posted(self, name: str, result: torch.Tensor, x: torch.Tensor) -> SimPending:
        handle = SimPending(result, f"{name} #{self._seq - 1} on group {self.group}", x)
        self._pending.append(handle)
        return handle

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` elementwise over ranks, in rank order, with `op` in `REDUCE_OPS`.

        Raises:
            ValueError: if `op` is not `"sum"`, `"max"` or `"min"`.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        compute = partial(_all_reduce, op=op, reduction=self._rdv.reduction)
        return self._collective("all_reduce", check_payload("all_reduce", x), compute, f"op={op}")

    def barrier(self) -> None:
        """Return once every rank of the group has called `barrier`."""
        self._collective("barrier", None, _nothing)

    def split(self, groups: Sequence[Sequence[int]]) -> SimComm:
        """Partition the group; return the sub-group that holds this rank (collective call).

        Args:
            groups: a partition of `range(size)`, the same on every rank; each part lists its
                ranks in the order that numbers them `0..len-1` in the sub-group.

        Returns:
            The `SimComm` of the part holding this rank.

        Raises:
            ValueError: if `groups` is not a partition of `range(size)`.
            CollectiveMismatch: if the ranks pass different partitions.

        Examples:
            >>> from sim import SimCluster
            >>> cols = SimCluster(4).run(lambda comm: comm.split([[0, 2], [1, 3]]).group)
            >>> cols
            [(0, 2), (1, 3), (0, 2), (1, 3)]
        """
        parts = check_partition(groups, self.size)
        seq = self._seq
        self._collective("split", None, _nothing, f"groups={parts}")
        index = next(i for i, part in enumerate(parts) if self.rank in part)
        sub = tuple(self.group[r] for r in parts[index])  # local ranks -> global ranks
        return SimComm(self._rdv, self._trace, sub, self.global_rank, gid=(self._gid, seq, index), pending=self._pending)

    def unwaited(self) -> list[str]:
        """Where this rank posted collectives (on this group or its sub-groups) never waited on."""
        return [h.where for h in self._pending if not h.done]

    def _collective(self, op: str, x: torch.Tensor | tuple | None, compute: Callable, param: str = "", shift: int = 1) -> Any:
        """Meet the group in call `#seq`; the last rank to arrive runs `compute` for all."""
        # 1) the call's signature, and this group's next sequence number
        if isinstance(x, tuple):  # a host row of ints (`agree`): an int64 (1, n) on the wire
            call, nbytes, payload = Call(op, (1, len(x)), torch.int64, param), 8 * len(x), x
        elif x is None:
            call, nbytes, payload = Call(op, None, None, param), 0, None
        else:
            call, nbytes, payload = Call(op, tuple(x.shape), x.dtype, param), x.numel() * x.element_size(), x.detach()
        seq, self._seq = self._seq, self._seq + 1

        # 2) what the last rank to arrive does, once, for the whole group
        def complete(inputs: list[Any]) -> list[Any]:
            outputs = compute(inputs)
            per_rank = (traffic(op, self.size, nbytes, shift),) * self.size
            self._trace.append(CollectiveEvent(op, self.group, seq, call.dtype, call.shape, per_rank, per_rank, param))
            return outputs

        # 3) rendezvous; inputs are detached, as collectives carry no autograd history
        pos = Position(op, seq, self.group, self._gid)
        return self._rdv.arrive(self.global_rank, self.rank, pos, call, payload, complete)


class SimCluster:
    """`world_size` simulated ranks; `run(fn)` runs `fn(comm)` on every rank, one thread each.

    Args:
        world_size: number of ranks `P >= 1`.
        timeout: seconds a rank may wait in one collective before `CollectiveTimeout`
            (finite: a deadlock must end).
        reduction: `"exact"` (fp16/bf16 summed in float64, rounded once) or `"native"`
            (every partial sum rounded to the dtype, as NCCL/HCCL do).

    Attributes:
        trace: the `CollectiveEvent`s of all runs so far, one per completed group collective.

    Raises:
        ValueError: if `world_size < 1`, `timeout` is not a finite number > 0, or
            `reduction` is unknown.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0, reduction: str = "exact") -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"SimCluster: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(
                f"SimCluster: timeout must be a finite number of seconds > 0, got {timeout!r}; "
                "a deadlock must end, so pass a long finite timeout (e.g. 3600) instead of inf"
            )
        if reduction not in REDUCTIONS:
            raise ValueError(f"SimCluster: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.world_size, self.timeout, self.reduction = world_size, float(timeout), reduction
        self.trace: list[CollectiveEvent] = []
        self._running = threading.Lock()

    def run(self, fn: Callable[[SimComm], T]) -> list[T]:
        """Run `fn(comm)` on every rank concurrently; return the results, indexed by rank.

        Args:
            fn: the per-rank program; it gets this rank's world `SimComm`.

        Returns:
            `[fn(comm_0), ..., fn(comm_{P-1})]`, once every rank thread has ended.

        Raises:
            BaseException: rank 0's exception, if every rank raised the same type and message.
            ClusterFailure: if some ranks raised otherwise (`.errors` holds every exception).
            RuntimeError: if called while this cluster is already running.
        """
        if not self._running.acquire(blocking=False):
            raise RuntimeError("SimCluster.run is not reentrant; use a second SimCluster")
        try:
            return self._run(fn)
        finally:
            self._running.release()

    def _run(self, fn: Callable[[SimComm], T]) -> list[T]:
        # 1) a fresh rendezvous, and one world communicator per rank
        ranks = tuple(range(self.world_size))
        rdv = Rendezvous(self.world_size, self.timeout)
        rdv.reduction = self.reduction
        results: list[Any] = [None] * self.world_size
        # set as each rank's code has ended: after Ctrl-C, `Thread.join` cannot be trusted (below)
        ended = [threading.Event() for _ in ranks]

        def rank_main(g: int) -> None:
            try:
                comm = SimComm(rdv, self.trace, ranks, g)
                # backward on this thread: autograd runs accelerator work on one engine thread per
                # device, which would serialize the ranks' backward passes and deadlock their collectives
                with torch.autograd.set_multithreading_enabled(False):
                    results[g] = fn(comm)
                if comm.unwaited():
                    raise Unwaited(f"the rank returned without waiting on: {', '.join(comm.unwaited())}")
            except BaseException as exc:  # noqa: BLE001 -- reported by run(), never lost
                rdv.failed(g, exc)
            else:
                rdv.finished(g)
            finally:
                ended[g].set()

        # 2) one thread per rank; every collective wait is bounded, so every thread ends
        threads = [threading.Thread(target=rank_main, args=(g,), name=f"sim-rank-{g}", daemon=True) for g in ranks]
        for t in threads:
            t.start()
        try:
            stuck = self._join(threads, rdv)
        except KeyboardInterrupt:  # Ctrl-C: no rank thread may outlive the run (module docstring)
            rdv.interrupt()
            deadline = time.monotonic() + min(self.timeout, 5.0)
            # A KeyboardInterrupt that lands in `Thread.join` (where `_join` waits) can leave that thread marked
            # stopped while it still runs (CPython 3.11: `is_alive()` False, `join()` returns at once), so the
            # ranks' own events say when their code has ended; the joins then let each thread exit.
            for g, t in enumerate(threads):
                ended[g].wait(max(0.0, deadline - time.monotonic()))
                t.join(max(0.0, deadline - time.monotonic()))
            rdv.forget()  # the ranks' exceptions, and the frames they hold: their `finally`s run now, not later
            gc.collect()
            raise
        # 3) results, or the failures: identical on every rank -> re-raise, else ClusterFailure
        errors = {**rdv.failures(), **stuck}
        if not errors:
            return results
        if len(errors) == self.world_size and len({(type(e), str(e)) for e in errors.values()}) == 1:
            raise errors[0]
        failure = ClusterFailure(errors, self.world_size)
        raise failure from errors[failure.root_rank]

    def _join(self, threads: list[threading.Thread], rdv: Rendezvous) -> dict[int, BaseException]:
        """Wait for every rank; after a failure, report the ranks still running their own code as stuck.

        Ranks waiting in a collective end within the timeout, so the margin starts only once
        no rank waits: then the ranks alive are all outside any collective.
        """
        margin, since = min(self.timeout, 5.0), None
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.02)
            if not rdv.failures() or rdv.waiting():
                since = None  # no failure yet (a slow rank is just slow), or waits still bounded
                continue
            since = time.monotonic() if since is None else since
            if time.monotonic() - since > margin:
                frames = sys._current_frames()
                return {g: RankStuck(g, margin, frames.get(t.ident)) for g, t in enumerate(threads) if t.is_alive()}
        return {}

    def trace_summary(self) -> TraceSummary:
        """Per-rank byte totals and per-op counts of `trace` (see `sim.cluster.trace.summarize`)."""
        return summarize(self.trace)

    def reset_trace(self) -> None:
        """Forget the recorded events (the `trace` list is cleared in place)."""
        self.trace.clear()
