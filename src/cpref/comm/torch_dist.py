r"""`TorchComm`: the collectives protocol over a `torch.distributed` process group.

The CP algorithms are written once against [`cpref.comm.protocol`][cpref.comm.protocol]; `TorchComm` is the
protocol on real process groups, with the semantics of the simulated cluster's `SimComm`:
functional (every call returns a new tensor and never modifies its input), rank-major along
dim 0, no autograd history through a collective (inputs are detached).

| protocol call | `torch.distributed` call on the group `pg` |
| --- | --- |
| `all_gather(x)` | `all_gather_single` (`all_gather_into_tensor` before torch 2.13); gloo: pairwise exchange |
| `reduce_scatter(x)` | `reduce_scatter_single` (`reduce_scatter_tensor`), sum; gloo: pairwise exchange, rank-order sum |
| `all_to_all(x)` | `all_to_all_single`, equal dim-0 chunks to the ranks in group order; gloo: pairwise exchange |
| `send_recv(x, shift)` | `batch_isend_irecv`: send to `r + shift`, receive from `r - shift` |
| `send_recv_async(x, shift)` | the same ops, posted; `wait()` on the handle completes them |
| `all_gather_async(x)`, `reduce_scatter_async(x)`, `all_to_all_async(x)` | the same calls with `async_op=True` (gloo: the exchange posted); `wait()` completes them (and sums, for the exchange's reduce-scatter) |
| `all_reduce(x, op)` | `all_reduce` with `SUM`, `MAX` or `MIN`; gloo: pairwise reduce-scatter, rank-order fold, pairwise all-gather |
| `barrier()` | `barrier` |
| `agree(row)` | `all_gather` of a CPU int64 row, on this group where gloo serves it, else on a gloo group of the same ranks |
| `split(groups)` | `new_group(ranks, timeout=<this group's>, use_local_synchronization=True, sort_ranks=False)` |

## Two ways to move the data: `exchange`

`all_gather`, `reduce_scatter`, `all_to_all` and `all_reduce` move dim-0 chunks between every pair of
ranks. With `exchange="native"` they are the backend's collectives (the table's left part);
with `exchange="p2p"` each is **one pairwise exchange**: every rank posts, in one
`batch_isend_irecv`, a send of chunk $j$ to rank $j$ and a receive from rank $j$ for every
$j \ne r$, waits, and finishes locally (all-gather and all-to-all keep their own chunk;
reduce-scatter sums its $P$ chunks in rank order, $(\dots(x_0 + x_1) + \dots) + x_{P-1}$, in
the input dtype: the fold `reduction="native"` of the simulated cluster models, bit for bit).
The bytes each rank sends are the same, $(P - 1)\,n$ rows, as for a ring collective.
`all_reduce` is two of them: the flattened tensor, zero-padded to $P$ equal chunks, is
reduce-scattered (each rank folds its chunk over the ranks in rank order, with the sum, max or
min) and the folded chunks all-gathered, $2 (P - 1) / P$ of the tensor sent per rank, as a ring
all-reduce sends; every rank holds the same bits, the simulator's `native` fold.

The default is `"p2p"` on gloo and `"native"` elsewhere, for the reasons (measured) given in
[`cpref.comm.capabilities`][cpref.comm.capabilities], which also lists the backend facts
`TorchComm` relies on.

## Leaving the process: no abort at exit on gloo

A process that returns from its last collective and exits must exit 0. gloo runs its own
collectives (`all_reduce`, the tensor all-gather, ...) on worker threads of its own, and a worker
lets go of a finished collective a moment *after* it has woken the caller; the collective holds
the caller's tensors, and letting go of a tensor that Python also holds takes Python's lock. A
caller that exits at once can reach the interpreter's shutdown first: the worker then asks for
the lock during shutdown, which ends the thread inside a C++ destructor, and the C++ runtime
aborts the process, "terminate called without an active exception" (SIGABRT, after correct
results; about 1 run in 10 of a torchrun script on 2 gloo processes). Sends and receives are
never run by those threads: they complete in the caller's wait and are released where the caller
drops them. So with `exchange="p2p"` (gloo's default) every protocol call is sends and receives,
`all_reduce` too, and `barrier` hands gloo no tensor: no worker of gloo's ever holds a tensor of
`TorchComm`'s, and a script that leaves after its last call exits 0, without `destroy_process_group`
or `os._exit`. (Collectives called on the process group directly, outside `TorchComm`, are gloo's
own: call `torch.distributed.destroy_process_group()` and drop the group before leaving.)

## Timeouts

A group made by `split` (and the control group of `agree`) waits as long as the group it was split
from: `new_group` is passed that group's timeout (`init_process_group(timeout=...)`), where torch's
default would be 30 minutes whatever the world's was.

## Group ranks and global ranks

A CP group is rarely the whole world: in a DP $\times$ CP mesh of 4 processes the CP groups
may be $\{0, 2\}$ and $\{1, 3\}$. Algorithms speak **group ranks** $r \in [0, P)$; the
backend addresses peers by **global rank**. `comm.group` is the group's global ranks in
group-rank order (from `get_process_group_ranks`), so `group[r]` is the one mapping used
everywhere; ring neighbours are computed in group ranks and only then mapped:

$$ \text{dst} = \text{group}[(r + \text{shift}) \bmod P], \qquad
   \text{src} = \text{group}[(r - \text{shift}) \bmod P]. $$

## Splitting a group

`split` is collective over the group, as in `SimComm`: every member passes the same
partition, checked with one all-reduce of its digest (a mismatch raises `ValueError` on
every rank instead of a rendezvous that never completes). Each rank then creates only its
own part with `new_group(..., use_local_synchronization=True, sort_ranks=False)` (a torch
without `sort_ranks` sorts the ranks: fine for ascending parts, refused otherwise): only that
part's members meet in the rendezvous, processes outside the group take no part, and the
ranks keep the listed order. `split_group`, the other way to split, is refused in torch 2.13
on a gloo world without a bound accelerator ("No device associated with the default pg").
Sub-groups are made once per partition and cached in the communicator (keep one `TorchComm`
per group); the digest check runs on every call, as `split` stays a collective, so call it
once and keep the sub-communicators. With local synchronization torch names a group after its ranks and the
number of groups the process has already made, so every process must create its groups in
the same order and number (true when all run the same program, as CP training does).

"""

from __future__ import annotations

import datetime
import hashlib
import operator
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from cpref.base.errors import CPInputError
from cpref.comm import capabilities
from cpref.comm.capabilities import EXCHANGES, HCCL_BAD_SIZES, control_device, default_exchange, unsupported_ops
from cpref.comm.protocol import REDUCE_OPS, check_partition, check_payload

__all__ = ["TorchComm", "TorchPending"]

_REDUCE_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_FOLD = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}  # out= variants: the fold writes in place
# torch 2.13 renamed the tensor all-gather / reduce-scatter; older builds have the old names
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchPending:
    """A collective in flight, returned by the `_async` calls of `TorchComm`.

    Holds the backend's work handles and `finish`, which makes the result once they are done
    (a cast back to the input dtype; for the pairwise reduce-scatter, the rank-order sum). The
    buffers the backend reads and writes stay referenced until then.
    """

    def __init__(self, works: list, finish: Callable[[], torch.Tensor], where: str) -> None:
        self._works, self._finish = works, finish
        self.where, self.done = where, False

    def wait(self) -> torch.Tensor:
        """Block until the collective has completed; return its result (call exactly once).

        Raises:
            RuntimeError: on a second call.
        """
        if self.done:
            raise RuntimeError(f"{self.where}: wait() called twice on one handle")
        for work in self._works:
            work.wait()
        self.done = True
        finish, self._works, self._finish = self._finish, [], None
        return finish()


class TorchComm:
    """One rank's view of a `torch.distributed` process group; a `cpref.comm.protocol.Collectives`.

    Args:
        process_group: the group; `None` for the default (world) group, which must exist
            (`torch.distributed.init_process_group`).
        exchange: how `all_gather`, `reduce_scatter` and `all_to_all` move data: `"native"`
            (the backend's collectives) or `"p2p"` (one batch of pairwise sends and receives);
            `None` picks `default_exchange(backend)`. Sub-groups from `split` inherit it.
        control_group: a gloo group of the same ranks for `agree` (the ranks' comparison of
            their arguments), where this group's backend carries no CPU tensors; `None` makes
            one at the first `agree` on such a group.

    Attributes:
        rank: this rank's index in the group, `0 <= rank < size`.
        size: the number of ranks `P` in the group.
        global_rank: this rank's index in the world.
        group: the group's global ranks, in group rank order (`group[rank] == global_rank`).
        backend: the backend's name (`"gloo"`, `"nccl"`, `"hccl"`, ...).
        exchange: `"native"` or `"p2p"`, see the module docstring.
        device: where the communicator's own small tensors (the `split` digest) live: the
            CPU for gloo, else the process's current accelerator (NCCL and HCCL carry no
            CPU tensors).
        unsupported_ops: the protocol calls the backend cannot run on this group size.
        process_group: the underlying `ProcessGroup`.

    Raises:
        RuntimeError: if `torch.distributed` is not initialized.
        ValueError: if this process is not a member of `process_group`, or `exchange` is
            not one of `EXCHANGES`.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, exchange: str | None = None,
                 control_group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        if exchange is not None and exchange not in EXCHANGES:
            raise ValueError(f"TorchComm: exchange must be one of {EXCHANGES} or None (the backend's default), got {exchange!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchComm needs an initialized torch.distributed: call torch.distributed.init_process_group "
                "first (torchrun sets its environment), or run the function with sim.tools.launch"
            )
        pg = dist.group.WORLD if process_group is None else process_group
        if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("TorchComm: this process is not a member of the process group it was given")
        self.process_group = pg
        self.group = tuple(dist.get_process_group_ranks(pg))  # group rank -> global rank
        self.global_rank, self.size = dist.get_rank(), len(self.group)
        if self.global_rank not in self.group:
            raise ValueError(f"TorchComm: global rank {self.global_rank} is not in the process group {self.group}")
        self.rank = self.group.index(self.global_rank)
        self.backend = str(dist.get_backend(pg)).lower()
        self.device = control_device(self.backend)
        self.exchange = exchange or default_exchange(self.backend)
        self.unsupported_ops = unsupported_ops(self.backend, self.size)
        self._widen = capabilities.widened_dtypes(self.backend)
        self._splits: dict[tuple[tuple[int, ...], ...], TorchComm] = {}
        self._seq = 0  # calls so far, to name handles in messages
        self._ctl_pg, self._ctl = control_group, None  # the host (gloo) group of `agree`, where not this one

    @classmethod
    def from_mesh(cls, mesh: "torch.distributed.device_mesh.DeviceMesh", axis: str) -> TorchComm:
        """The communicator of this rank's group along the named `axis` of a `DeviceMesh`.

        Args:
            mesh: a `torch.distributed.device_mesh.DeviceMesh` with named axes.
            axis: the mesh axis name, e.g. `"cp"`.

        Raises:
            ValueError: if `mesh` has no axis called `axis`.

        Examples:
            ```python
            # run by tests/backends/test_torch_dist.py::test_every_collective_on_every_group_and_dtype
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            cp = TorchComm.from_mesh(mesh, "cp")   # world ranks {0, 1} and {2, 3}
            ```
        """
        names = tuple(mesh.mesh_dim_names or ())
        if axis not in names:
            raise ValueError(f"TorchComm.from_mesh: the mesh has axes {names}, not {axis!r}; pass one of them")
        return cls(mesh.get_group(axis))

    def __repr__(self) -> str:
        return (f"TorchComm(rank={self.rank}, size={self.size}, group={self.group}, backend={self.backend!r}, "
                f"exchange={self.exchange!r})")  # fmt: skip

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along dim 0 in rank order: `(n, ...) -> (P n, ...)`."""
        return self.all_gather_async(x).wait()

    def all_gather_async(self, x: torch.Tensor) -> TorchPending:
        """Start the `all_gather` of `x`; `wait()` on the handle returns `(P n, ...)`. Leave `x` unchanged until then."""
        send = self._wire("all_gather", x, 1, 1)
        out = send.new_empty((self.size * send.shape[0], *send.shape[1:]))  # (P n, ...)
        if self.exchange == "p2p":  # chunk r is ours; chunk s arrives from rank s
            chunks = out.chunk(self.size)
            chunks[self.rank].copy_(send)
            works = self._post_pairwise([send] * self.size, chunks)
        else:
            works = [_all_gather_base(out, send, group=self.process_group, async_op=True)]
        return TorchPending(works, lambda: out.to(x.dtype), self._where("all_gather_async"))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks and keep chunk `rank`: `(P n, ...) -> (n, ...)`.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        return self.reduce_scatter_async(x).wait()

    def reduce_scatter_async(self, x: torch.Tensor) -> TorchPending:
        """Start the `reduce_scatter` of `x`; `wait()` on the handle returns `(n, ...)`. Leave `x` unchanged until then.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        send = self._wire("reduce_scatter", x, 1, self.size)
        where = self._where("reduce_scatter_async")
        if self.exchange == "p2p":  # chunk s of every rank comes to rank s, which sums them in rank order
            mine = send.chunk(self.size)  # P x (n, ...): chunk s goes to rank s
            parts = [mine[s] if s == self.rank else torch.empty_like(mine[s]) for s in range(self.size)]

            def rank_order_sum() -> torch.Tensor:
                return _rank_order_fold(parts, "sum", owned=self.rank != 0).to(x.dtype)  # never a view of x

            return TorchPending(self._post_pairwise(mine, parts), rank_order_sum, where)
        out = send.new_empty((send.shape[0] // self.size, *send.shape[1:]))  # (n, ...)
        work = _reduce_scatter_base(out, send, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
        return TorchPending([work], lambda: out.to(x.dtype), where)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Send chunk `j` of dim 0 to rank `j`; return the chunks received, in rank order.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        return self.all_to_all_async(x).wait()

    def all_to_all_async(self, x: torch.Tensor) -> TorchPending:
        """Start the `all_to_all` of `x`; `wait()` on the handle returns `(P n, ...)`. Leave `x` unchanged until then.

        Raises:
            ValueError: if dim 0 of `x` is not divisible by `size`.
        """
        send = self._wire("all_to_all", x, 1, self.size)
        out = torch.empty_like(send)  # (P n, ...): chunk s came from rank s
        if self.exchange == "p2p":
            mine, theirs = send.chunk(self.size), out.chunk(self.size)
            theirs[self.rank].copy_(mine[self.rank])
            works = self._post_pairwise(mine, theirs)
        else:
            works = [dist.all_to_all_single(out, send, group=self.process_group, async_op=True)]
        return TorchPending(works, lambda: out.to(x.dtype), self._where("all_to_all_async"))

    def _post_pairwise(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> list:
        """Post, in one batch, a send of `sends[s]` to group rank `s` and a receive of `recvs[s]` from it, for every
        `s != rank`; return the works to wait on.

        `recvs[s]` are contiguous dim-0 chunks (or fresh tensors); the own entries are not touched.
        """
        ops = []
        for s in range(self.size):
            if s != self.rank:
                ops.append(dist.P2POp(dist.isend, sends[s], self.group[s], self.process_group))
                ops.append(dist.P2POp(dist.irecv, recvs[s], self.group[s], self.process_group))
        return dist.batch_isend_irecv(ops) if ops else []

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """Ring shift: send `x` to rank `r + shift`, return what rank `r - shift` sent (mod P)."""
        return self.send_recv_async(x, shift).wait()

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> TorchPending:
        """Start the ring shift of `send_recv`; `wait()` on the handle returns the received tensor.

        Both the send and the receive are posted at once (`batch_isend_irecv`), so a rank can
        compute while they travel. Do not modify `x` in place before `wait()`: like any
        asynchronous send, the backend may still be reading it.
        """
        shift = operator.index(shift)
        send = self._wire("send_recv", x)
        where = self._where("send_recv_async")
        if shift % self.size == 0:  # every rank keeps its own block: nothing travels
            kept = send.clone()
            return TorchPending([], lambda: kept.to(x.dtype), where)
        recv = torch.empty_like(send)
        # --8<-- [start:ring-peers]
        # ring neighbours in group ranks, then mapped to global ranks
        dst = self.group[(self.rank + shift) % self.size]
        src = self.group[(self.rank - shift) % self.size]
        ops = [dist.P2POp(dist.isend, send, dst, self.process_group),
               dist.P2POp(dist.irecv, recv, src, self.process_group)]  # fmt: skip
        # --8<-- [end:ring-peers]
        return TorchPending(dist.batch_isend_irecv(ops), lambda: recv.to(x.dtype), where)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` elementwise over ranks with `op` in `REDUCE_OPS`; every rank gets the result.

        Raises:
            ValueError: if `op` is not `"sum"`, `"max"` or `"min"`.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        if self.exchange == "p2p":
            return self._all_reduce_pairwise(x, op)
        out = self._wire("all_reduce", x, copy=True)  # reduced in place: never the caller's tensor
        dist.all_reduce(out, op=_REDUCE_OP[op], group=self.process_group)
        return out.to(x.dtype)

    def _all_reduce_pairwise(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """`all_reduce` as two pairwise exchanges (module docstring): reduce-scatter, rank-order fold, all-gather."""
        send = self._wire("all_reduce", x)
        n, p = send.numel(), self.size
        if n == 0 or p == 1:
            return send.clone().to(x.dtype)
        m = -(-n // p)  # chunk length: ceil(n / P)
        flat = send.new_zeros(p * m)  # (P m,): the padding is only ever folded with padding
        flat[:n] = send.reshape(-1)  # (...) -> (n,)
        mine = flat.chunk(p)  # P x (m,): chunk s goes to rank s
        parts = [mine[s] if s == self.rank else torch.empty_like(mine[s]) for s in range(p)]
        for work in self._post_pairwise(mine, parts):
            work.wait()
        folded = _rank_order_fold(parts, op, owned=True)  # (m,): chunk `rank` of the result, in a buffer of ours
        out = flat.new_empty(p * m)  # (P m,)
        chunks = out.chunk(p)
        chunks[self.rank].copy_(folded)
        for work in self._post_pairwise([folded] * p, chunks):
            work.wait()
        return out[:n].view(send.shape).to(x.dtype)  # (P m,) -> (n,) -> x's shape

    def agree(self, row: Sequence[int]) -> list[list[int]]:
        """Every rank's `row` of ints, in rank order, over the host (`cpref.modes.consistency`'s comparison).

        A CPU tensor all-gathered on gloo: on this group where gloo serves it, else on the
        control group (`control_group`, or a gloo group of the same ranks made at the first
        call, by the members alone), so the exchange never waits for an accelerator's stream.
        """
        t = torch.tensor([list(row)], dtype=torch.int64)  # (1, n) on the CPU
        return self._control().all_gather(t).tolist()  # (P, n): a host copy of a host tensor

    def _control(self) -> TorchComm:
        if self.device.type == "cpu":
            return self
        if self._ctl is None:
            options = capabilities.new_group_options(self.group, capabilities.NEW_GROUP_PARAMS)  # keeps the order
            pg = self._ctl_pg or dist.new_group(list(self.group), backend="gloo", timeout=self._timeout(), **options)
            self._ctl = TorchComm(pg)
        return self._ctl

    def barrier(self) -> None:
        """Return once every rank of the group has called `barrier`."""
        self._seq += 1
        dist.barrier(group=self.process_group)

    def split(self, groups: Sequence[Sequence[int]]) -> TorchComm:
        """Partition the group; return the sub-group that holds this rank (collective call).

        Args:
            groups: a partition of `range(size)`, the same on every rank; each part lists its
                ranks in the order that numbers them `0..len-1` in the sub-group.

        Returns:
            The `TorchComm` of the part holding this rank (made once per partition, cached).

        Raises:
            ValueError: if `groups` is not a partition of `range(size)`, or if the ranks
                passed different partitions.
        """
        parts = check_partition(groups, self.size)
        self._check_same_partition(parts)  # every time: split is a collective, cached or not
        if parts not in self._splits:
            # every part's options, so that a part this torch cannot make fails on every rank alike
            known = capabilities.NEW_GROUP_PARAMS
            options = {part: capabilities.new_group_options([self.group[r] for r in part], known) for part in parts}
            mine = next(part for part in parts if self.rank in part)
            ranks = [self.group[r] for r in mine]  # group ranks -> global ranks, listed order
            pg = dist.new_group(ranks, timeout=self._timeout(), **options[mine])
            self._splits[parts] = TorchComm(pg, exchange=self.exchange)
        return self._splits[parts]

    def _check_same_partition(self, parts: tuple[tuple[int, ...], ...]) -> None:
        """Compare a digest of `parts` over the group; raise the same `ValueError` on every rank if they differ."""
        digest = int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "little")
        # max over ranks of (d, -d) = (max d, -min d): all equal iff max d == min d (one all-reduce, any backend)
        pair = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)  # (2,)
        hi, neg_lo = self.all_reduce(pair, "max").tolist()
        if hi != -neg_lo:
            raise ValueError(
                f"split: the ranks of group {self.group} passed different partitions (rank {self.rank} passed "
                f"{[list(p) for p in parts]}); every rank must pass the same groups"
            )

    def _timeout(self) -> datetime.timedelta | None:
        """This group's timeout, for the groups split from it (module docstring); None (torch's default) where the
        backend does not say."""
        for device in getattr(self.process_group, "_device_types", ()):
            try:
                backend = self.process_group._get_backend(device)
            except RuntimeError:  # no backend for that device type
                continue
            timeout = getattr(getattr(backend, "options", None), "_timeout", None)
            if isinstance(timeout, datetime.timedelta):
                return timeout
        return None

    def _where(self, name: str) -> str:
        """How a handle names its call in messages: the call's number on this communicator, and the group."""
        return f"{name} #{self._seq - 1} on group {self.group}"

    def _wire(self, op: str, x: torch.Tensor, min_dim: int = 0, divisor: int = 1, copy: bool = False) -> torch.Tensor:
        """Check `x` locally (every rank alike), then detach it into a dense tensor the backend can carry."""
        self._seq += 1
        check_payload(op, x, min_dim, divisor)
        if op in self.unsupported_ops:
            raise CPInputError(
                f"{op}: the {self.backend} backend does not support {op} on a group of {self.size} ranks "
                f"(HCCL's tensor all-gather and reduce-scatter reject group sizes {sorted(HCCL_BAD_SIZES)}); "
                f"use a CP size of 2, 4 or 8, or a mode that does not need {op} (see comm.unsupported_ops)"
            )
        wire = x.detach().to(self._widen.get(x.dtype, x.dtype)).contiguous()  # a copy unless x already fits
        return wire.clone() if copy and wire.data_ptr() == x.data_ptr() else wire


def _rank_order_fold(parts: Sequence[torch.Tensor], op: str, owned: bool) -> torch.Tensor:
    """`(...((x_0 op x_1) op x_2) ...) op x_{P-1}` in the dtype of the parts, rounded at every step (the simulator's
    `native` fold), written into `parts[0]` when `owned` (a buffer of ours), else into a copy of it."""
    out = parts[0] if owned else parts[0].clone()  # (m, ...)
    # out <- out (op) x_s for s = 1 .. P-1
    for part in parts[1:]:
        _FOLD[op](out, part, out=out)
    return out
