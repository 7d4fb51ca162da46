"""The collectives protocol: the one seam between CP algorithms and communication.

Every CP algorithm in cpref talks to its context-parallel group through an object that
satisfies [`Collectives`][cpref.comm.protocol.Collectives]. Three implementations exist:

* `sim.SimComm`, the simulated cluster: every rank is a thread of one process, every
  collective is computed in a fixed rank order (bitwise deterministic) and recorded as a
  trace event;
* `cpref.comm.torch_dist.TorchComm`, over `torch.distributed` process groups (gloo,
  NCCL, HCCL);
* [`SingleRank`][cpref.comm.protocol.SingleRank], the group of one rank: no communication, so the same
  model code runs without context parallelism.

The protocol is *functional*: each collective takes a tensor and returns a new one, so an
algorithm reads like the mathematics and never manages output buffers. Tensors are split
and concatenated along **dim 0** (the token dimension of THD tensors), always in rank order
("rank-major").

| call | input on rank `r` | output on rank `r` |
| --- | --- | --- |
| `all_gather(x)` | `x_r` of shape `(n, ...)` | `cat(x_0, ..., x_{P-1})`, `(P n, ...)` |
| `reduce_scatter(x)` | `x_r` of shape `(P n, ...)` | chunk `r` of `sum_s x_s`, `(n, ...)` |
| `all_to_all(x)` | `x_r` of shape `(P n, ...)`, chunk `j` goes to rank `j` | `cat_s(chunk r of x_s)`, `(P n, ...)` |
| `send_recv(x, shift)` | `x_r` | `x_{(r - shift) mod P}`: the ring shift |
| `send_recv_async(x, shift)` | `x_r` | a handle; `handle.wait()` returns what `send_recv` would |
| `all_gather_async(x)` | `x_r` | a handle; `handle.wait()` returns what `all_gather` would |
| `reduce_scatter_async(x)` | `x_r` | a handle; `handle.wait()` returns what `reduce_scatter` would |
| `all_to_all_async(x)` | `x_r` | a handle; `handle.wait()` returns what `all_to_all` would |
| `all_reduce(x, op)` | `x_r` | `op_s x_s` (`"sum"`, `"max"`, `"min"`) |
| `barrier()` | | |
| `split(groups)` | a partition of this group's ranks | the sub-group holding `r` |

The four `_async` calls start the same collective without waiting for it, so that an
algorithm can compute while the data travels: the ring mode computes on the current block
while the next one travels, the all-gather mode on its local keys while the others' arrive
([the all-gather overlap][cpref.modes.all_gather_overlap]), Ulysses on one head group while the
next travels ([the Ulysses pipeline][cpref.modes.ulysses_pipeline]). A posted collective takes its place in
the group's sequence of collectives when it is *called*; every handle must be waited on exactly
once, before the rank's next use of the result, and the input must not be modified before
then. `wait()` returns the result ([`Pending`][cpref.comm.protocol.Pending]).

`split` is itself collective: every rank of the group calls it with the same partition,
and gets back a `Collectives` for the part that holds it, with ranks renumbered `0..len-1`
in the order listed. It builds the sub-groups of the hierarchical (a2a + p2p) mode and of
DP x CP meshes.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from cpref.base.checks import as_int, missing_members
from cpref.base.errors import CPInputError

__all__ = ["Collectives", "Pending", "REDUCE_OPS", "SingleRank", "check_comm", "check_payload", "check_partition"]

REDUCE_OPS = ("sum", "max", "min")


@runtime_checkable
class Pending(Protocol):
    """A collective in flight, returned by the `_async` calls of `Collectives`."""

    def wait(self) -> torch.Tensor:
        """Block until the collective has completed; return its result (call exactly once)."""
        ...


@runtime_checkable
class Collectives(Protocol):
    """A context-parallel group as the algorithms see it.

    Attributes:
        rank: this rank's index in the group, `0 <= rank < size`.
        size: the number of ranks `P` in the group.
        unsupported_ops: the collectives this backend cannot run for this group (e.g. tensor
            all-gather on HCCL groups of 3, 5, 6 or 7 ranks); `cpref.attention` refuses a mode
            that needs one before any communication.
    """

    rank: int
    size: int
    unsupported_ops: frozenset[str]

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along dim 0 in rank order: `(n, ...) -> (P n, ...)`."""
        ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks and keep chunk `rank` of dim 0: `(P n, ...) -> (n, ...)`."""
        ...

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Send chunk `j` of dim 0 to rank `j`; return the chunks received, in rank order."""
        ...

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """Ring shift: send `x` to rank `r + shift`, return what rank `r - shift` sent (mod P)."""
        ...

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> Pending:
        """Start the ring shift of `send_recv`; the handle's `wait()` returns the received tensor."""
        ...

    def all_gather_async(self, x: torch.Tensor) -> Pending:
        """Start the `all_gather` of `x`; the handle's `wait()` returns `(P n, ...)`."""
        ...

    def reduce_scatter_async(self, x: torch.Tensor) -> Pending:
        """Start the `reduce_scatter` of `x`; the handle's `wait()` returns `(n, ...)`."""
        ...

    def all_to_all_async(self, x: torch.Tensor) -> Pending:
        """Start the `all_to_all` of `x`; the handle's `wait()` returns `(P n, ...)`."""
        ...

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` elementwise over ranks with `op` in `REDUCE_OPS`; every rank gets the result."""
        ...

    def barrier(self) -> None:
        """Return once every rank of the group has called `barrier`."""
        ...

    def split(self, groups: Sequence[Sequence[int]]) -> "Collectives":
        """Partition the group; return the sub-group that holds this rank (collective call)."""
        ...


def check_payload(op: str, x: Any, min_dim: int = 0, divisor: int = 1) -> torch.Tensor:
    """Check a collective's input locally, before any communication, so that every rank fails alike.

    Raises:
        TypeError: if `x` is not a tensor.
        ValueError: if `x` has fewer than `min_dim` dims, or (with `min_dim`) a dim 0 that `divisor`
            (the group size of a reduce-scatter or all-to-all) does not divide.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{op}: needs a dim 0 to split or concatenate, got a 0-d tensor; reshape it to (1,)")
    if min_dim and x.shape[0] % divisor:
        raise ValueError(
            f"{op}: dim 0 of shape {tuple(x.shape)} must be divisible by the group size P={divisor}; "
            f"pad dim 0 to a multiple of {divisor}"
        )
    return x


def check_partition(groups: Sequence[Sequence[int]], size: int) -> tuple[tuple[int, ...], ...]:
    """`groups` as a tuple of tuples, if it partitions `range(size)` into non-empty groups (for `split`).

    Raises:
        ValueError: naming the missing, repeated or out-of-range ranks.
    """
    parts = tuple(tuple(operator.index(r) for r in part) for part in groups)
    flat = [r for part in parts for r in part]
    if any(not part for part in parts) or sorted(flat) != list(range(size)):
        missing = sorted(set(range(size)) - set(flat))
        extra = sorted({r for r in flat if flat.count(r) > 1 or not 0 <= r < size})
        raise ValueError(
            f"split: groups {parts} must partition the ranks 0..{size - 1}, each exactly once, "
            f"in non-empty groups (missing: {missing}, repeated or out of range: {extra})"
        )
    return parts


class SingleRank:
    """The group of one rank: every collective is the identity (a fresh copy), nothing is communicated.

    A model written against `cpref.attention` runs unchanged without context parallelism by
    passing `comm=SingleRank()`: every mode then reduces to attention over the whole packed
    stream (`P = 1`).

    Examples:
        >>> import torch
        >>> comm = SingleRank()
        >>> comm.all_gather(torch.ones(2)).tolist(), comm.all_reduce(torch.ones(1), "max").tolist()
        ([1.0, 1.0], [1.0])
    """

    rank, size = 0, 1
    global_rank, group = 0, (0,)
    unsupported_ops: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return "SingleRank()"

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x` itself (a copy): the only rank's contribution."""
        return self._copy(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """`x` itself (a copy): the sum over one rank, chunk 0 of 1."""
        return self._copy(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """`x` itself (a copy): the one chunk goes to the only rank."""
        return self._copy(x)

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """`x` itself (a copy): every shift of a ring of one comes back home."""
        return self._copy(x)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> "_Done":
        """A handle whose `wait()` returns `x` (a copy)."""
        return _Done(self._copy(x))

    def all_gather_async(self, x: torch.Tensor) -> "_Done":
        """A handle whose `wait()` returns `x` (a copy)."""
        return _Done(self._copy(x))

    def reduce_scatter_async(self, x: torch.Tensor) -> "_Done":
        """A handle whose `wait()` returns `x` (a copy)."""
        return _Done(self._copy(x))

    def all_to_all_async(self, x: torch.Tensor) -> "_Done":
        """A handle whose `wait()` returns `x` (a copy)."""
        return _Done(self._copy(x))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`x` itself (a copy), for any `op` in `REDUCE_OPS`."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        return self._copy(x)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def split(self, groups: Sequence[Sequence[int]]) -> "SingleRank":
        """The only partition of one rank, `[[0]]`: this group again."""
        if [list(g) for g in groups] != [[0]]:
            raise ValueError(f"split: groups {groups} must partition the ranks [0] of a single-rank group")
        return self


class _Done:
    """A completed collective."""

    def __init__(self, x: torch.Tensor) -> None:
        self._x = x

    def wait(self) -> torch.Tensor:
        """The received tensor."""
        return self._x


FIX = ("on the simulated cluster sim.SimCluster(P).run(fn) passes one to fn, over torch.distributed use "
       "cpref.comm.TorchComm, without CP cpref.SingleRank()")  # fmt: skip


def check_comm(comm: Any, fix: str = FIX) -> tuple[int, int]:
    """`(rank, size)` of a communicator that has every member of `Collectives`, with a valid rank and size.

    Raises:
        CPInputError: naming what `comm` is and lacks, and `fix`.
    """
    missing = missing_members(comm, Collectives)
    if comm is None or missing:
        raise CPInputError(f"comm must be the CP group's collectives (a cpref.Collectives), got {type(comm).__name__} "
                           f"(without {', '.join(missing)}); {fix}")  # fmt: skip
    size = as_int("comm.size", comm.size, lo=1)
    return as_int("comm.rank", comm.rank, lo=0, hi=size), size
