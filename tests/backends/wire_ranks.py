"""The per-rank program of `test_verify_wire`: every collective API a CP implementation calls, each counted by
`sim.tools.verify.wire.Wire` on its own, on a world of 2 gloo processes. Module-level, importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

from sim.tools.verify.wire import Tally, Wire

F32 = torch.float32  # 4 bytes an element


class GatherInBackward(torch.autograd.Function):
    """Identity forward; the backward all-gathers the gradient (a collective only the backward makes)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(2 * grad.numel(), dtype=grad.dtype)
        dist.all_gather_into_tensor(out, grad.contiguous())
        return grad


def _wait(tensors: list) -> list:
    return [funcol.wait_tensor(t) for t in tensors]


def _calls(rank: int) -> dict:
    """`{name: what the rank runs}`, each with 8 float32 elements (32 bytes) unless its name says otherwise."""
    x = torch.arange(8, dtype=F32)
    world = dist.group.WORLD
    other = 1 - rank

    def p2p():
        mine, theirs = (torch.ones(8 if rank == 0 else 4), torch.empty(4 if rank == 0 else 8))
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, other), dist.P2POp(dist.irecv, theirs, other)]):
            w.wait()

    def uneven():  # rank 0 keeps 1 row and sends 3, rank 1 keeps 2 and sends 2 (rows of 8 bytes)
        splits_in = [1, 3] if rank == 0 else [2, 2]
        splits_out = [1, 2] if rank == 0 else [3, 2]
        out = torch.empty(sum(splits_out), 2)
        dist.all_to_all_single(out, torch.ones(4, 2), splits_out, splits_in)

    def backward():
        leaf = x.clone().requires_grad_(True)
        GatherInBackward.apply(leaf).sum().backward()

    def send_recv():
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(torch.empty(8), 0)

    def coalesced():  # two all-gathers in one coalesced call
        with _coalescing_manager(async_ops=True) as manager:
            dist.all_gather_into_tensor(torch.empty(16), x)
            dist.all_gather_into_tensor(torch.empty(16), x)
        manager.wait()

    def functional_p2p():  # the functional ops' own send and receive, and their batch: 32 B out of rank 0, 16 B of 1
        name = world.group_name
        ops = torch.ops._c10d_functional
        mine, theirs = (torch.ones(8 if rank == 0 else 4), torch.empty(4 if rank == 0 else 8))
        if rank == 0:
            funcol.wait_tensor(ops.isend(mine, 1, 0, name))
            funcol.wait_tensor(ops.irecv(theirs, 1, 0, name))
        else:
            funcol.wait_tensor(ops.irecv(theirs, 0, 0, name))
            funcol.wait_tensor(ops.isend(mine, 0, 0, name))
        _wait(ops.batch_p2p_ops(["isend", "irecv"], [other, other], [0, 0], [mine, theirs], name))

    return {
        "functional isend / irecv, batch_p2p_ops": functional_p2p,
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(16), x),
        "all_gather": lambda: dist.all_gather([torch.empty(8), torch.empty(8)], x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(4), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(8), x),
        "all_to_all_single uneven": uneven,
        "batch_isend_irecv 32 B / 16 B": p2p,
        "send / recv": send_recv,
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "funcol all_gather_tensor": lambda: funcol.wait_tensor(funcol.all_gather_tensor(x, 0, world)),
        "funcol all_to_all_single": lambda: funcol.wait_tensor(funcol.all_to_all_single(x, None, None, world)),
        "funcol reduce_scatter_tensor": lambda: funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, world)),
        "funcol all_reduce": lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", world)),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(torch.empty(4), [x[:4].clone(), x[4:].clone()]),
        "all_to_all (list) 8 B each": lambda: dist.all_to_all([torch.empty(2), torch.empty(2)], [torch.ones(2)] * 2),
        "all_gather_coalesced 2 x 32 B": lambda: dist.all_gather_coalesced([[torch.empty(8)] * 2] * 2, [x, x]),
        "coalesced all_gather_into_tensor 2 x 32 B": coalesced,
        "funcol all_gather coalesced 2 x 32 B": lambda: _wait(funcol.all_gather_into_tensor_coalesced([x, x], world)),
        "funcol reduce_scatter coalesced 2 x 32 B": lambda: _wait(
            funcol.reduce_scatter_tensor_coalesced([x, x], "sum", [0, 0], world)
        ),
        "funcol all_reduce coalesced 2 x 32 B": lambda: _wait(funcol.all_reduce_coalesced([x, x], "sum", world)),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "scatter from rank 0": lambda: dist.scatter(torch.empty(8), [x, x] if rank == 0 else None, src=0),
        "gather to rank 0": lambda: dist.gather(x, [torch.empty(8), torch.empty(8)] if rank == 0 else None, dst=0),
        "a collective in the backward": backward,
    }


def count_each() -> dict:
    """`{name: (bytes sent, {collective: calls}, {unpriced op: calls})}` on this rank, each call under a Wire of its
    own; and `"outside"`: an all-gather run with no Wire active, counted into nothing."""
    rank = dist.get_rank()
    counted = {}
    for name, call in _calls(rank).items():
        tally = Tally()
        with Wire(tally):
            call()
        counted[name] = (tally.sent, dict(tally.calls), dict(tally.uncounted))
    idle = Tally()
    with Wire(idle):
        pass
    dist.all_gather_into_tensor(torch.empty(16), torch.ones(8))
    counted["outside"] = (idle.sent, dict(idle.calls), dict(idle.uncounted))
    return counted


def exchange_under_loopback() -> list[float]:
    """Inside `loopback` on a world of 2: the sends between the ranks go to torch.distributed as they are (a group of
    more than one rank), by `batch_isend_irecv` and by `send`/`recv`; what this rank received."""
    from sim.tools.verify.loopback import loopback

    rank = dist.get_rank()
    got, again = torch.zeros(2), torch.zeros(2)
    with loopback():
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank == 0:
            dist.send(torch.full((2,), 7.0), 1)
        else:
            dist.recv(again, 0)
    return [*got.tolist(), *again.tolist()]
