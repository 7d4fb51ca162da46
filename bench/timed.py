"""Thin timing proxies: a communicator and a kernel that time their own calls.

`TimedComm(comm, clock)` satisfies the collectives protocol by forwarding every call to
`comm` and adding the wall time spent inside it to `clock.comm` (for a posted collective,
`send_recv_async`, `all_gather_async`, `reduce_scatter_async`, `all_to_all_async`: inside the post and inside the
handle's `wait()`, i.e. the time the rank actually waits; one that completes while the rank
computes costs nothing). `TimedKernel(kernel, clock)` adds the
time inside `forward` and `backward` to `clock.compute`. The CP modes see them as any other
communicator and kernel: nothing in cpref changes to be measured.

Example:
    >>> import torch
    >>> from sim import SimCluster
    >>> clock = Clock()
    >>> out = SimCluster(1).run(lambda comm: TimedComm(comm, clock).all_reduce(torch.ones(2)))
    >>> clock.comm > 0.0, clock.compute
    (True, 0.0)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = ["Clock", "TimedComm", "TimedHandle", "TimedKernel"]


@dataclass
class Clock:
    """Seconds spent inside kernel calls (`compute`) and collective calls (`comm`).

    `events` lists every timed call in order as `(field, name, seconds, posted)`, e.g.
    `("compute", "forward", 0.41, None)` or `("comm", "wait", 0.02, 3)`: the per-step view of a ring.
    `posted` is set on a handle's `wait`: the index in `events` of the call that posted it (so each
    shift's post, the kernel calls after it and its wait can be told apart); `None` elsewhere.
    """

    compute: float = 0.0
    comm: float = 0.0
    events: list[tuple[str, str, float]] = field(default_factory=list)

    def reset(self) -> None:
        self.compute = self.comm = 0.0
        self.events = []

    def timed(self, which: str, fn: Callable[..., Any], *args: Any, posted: int | None = None, **kwargs: Any) -> Any:
        """Call `fn(*args, **kwargs)`, adding its wall time to `which` (compute or comm) and to `events`
        (`posted`: for a handle's wait, the event index of its post)."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            setattr(self, which, getattr(self, which) + seconds)
            self.events.append((which, getattr(fn, "__name__", type(fn).__name__), seconds, posted))


class TimedHandle:
    """A posted collective whose `wait()` is timed as communication, naming its post's event."""

    def __init__(self, handle: Any, clock: Clock, posted: int) -> None:
        self._handle, self._clock, self._posted = handle, clock, posted

    def wait(self) -> torch.Tensor:
        return self._clock.timed("comm", self._handle.wait, posted=self._posted)


class TimedComm:
    """`comm`, with the time inside every collective added to `clock.comm`."""

    def __init__(self, comm: Any, clock: Clock) -> None:
        self.inner, self.clock = comm, clock
        self.rank, self.size, self.group = comm.rank, comm.size, comm.group
        self.global_rank, self.unsupported_ops = comm.global_rank, comm.unsupported_ops
        self._splits: dict[tuple, TimedComm] = {}

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.clock.timed("comm", self.inner.all_gather, x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return self.clock.timed("comm", self.inner.reduce_scatter, x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self.clock.timed("comm", self.inner.all_to_all, x)

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        return self.clock.timed("comm", self.inner.send_recv, x, shift)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> TimedHandle:
        return self._posted(self.inner.send_recv_async, x, shift)

    def all_gather_async(self, x: torch.Tensor) -> TimedHandle:
        return self._posted(self.inner.all_gather_async, x)

    def reduce_scatter_async(self, x: torch.Tensor) -> TimedHandle:
        return self._posted(self.inner.reduce_scatter_async, x)

    def all_to_all_async(self, x: torch.Tensor) -> TimedHandle:
        return self._posted(self.inner.all_to_all_async, x)

    def _posted(self, post: Callable[..., Any], *args: Any) -> TimedHandle:
        """Time the post; its handle's wait names the post's event."""
        handle = self.clock.timed("comm", post, *args)
        return TimedHandle(handle, self.clock, len(self.clock.events) - 1)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.clock.timed("comm", self.inner.all_reduce, x, op)

    def barrier(self) -> None:
        self.clock.timed("comm", self.inner.barrier)

    def split(self, groups: Sequence[Sequence[int]]) -> TimedComm:
        """The timed sub-communicator (one proxy per partition, like the communicators it wraps)."""
        key = tuple(tuple(part) for part in groups)
        sub = self.clock.timed("comm", self.inner.split, groups)
        if key not in self._splits:
            self._splits[key] = TimedComm(sub, self.clock)
        return self._splits[key]


class TimedKernel:
    """`kernel`, with the time inside `forward` and `backward` added to `clock.compute`."""

    def __init__(self, kernel: Any, clock: Clock) -> None:
        self.inner, self.clock = kernel, clock

    def forward(self, q, k, v, seqs, **kwargs):
        return self.clock.timed("compute", self.inner.forward, q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        return self.clock.timed("compute", self.inner.backward, dout, q, k, v, out, lse, seqs, **kwargs)
