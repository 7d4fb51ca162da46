"""Rank programs for the launcher's newer tests (`test_launch.py`, `test_launch_watch.py`):
module-level functions, importable by spawned ranks. (The older ones are in `gloo_cases.py`.)
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def what_the_launch_exposes() -> dict:
    """Once the group is up: the sockets this rank and the launcher listen on, the rendezvous
    store's file, and the interface gloo was told to use.

    `"listening"`: `{"rank R" / "launcher": [address:port, ...]}`, from `/proc/net/tcp` and
    `/proc/net/tcp6`, the listening sockets whose inode is an open file of this rank or of the
    launcher (its parent).
    """
    dist.barrier()  # every rank's gloo pairs are connected
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == _LISTEN:
                listening[cols[9]] = _address(cols[1])  # inode -> "host:port"
    owners = {f"rank {dist.get_rank()}": os.getpid(), "launcher": os.getppid()}
    found = {name: sorted(listening[i] for i in _socket_inodes(pid) if i in listening) for name, pid in owners.items()}
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore(...)
        store = store.underlying_store
    dist.barrier()  # no rank exits (closing its sockets) while another still reads
    return {"listening": found, "store": getattr(store, "path", None), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(field: str) -> str:
    """`0100007F:1F90` -> `127.0.0.1:8080`: /proc/net/tcp writes each 32-bit word of the address in host order."""
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    order = -1 if sys.byteorder == "little" else 1
    address = b"".join(raw[i : i + 4][::order] for i in range(0, len(raw), 4))  # network order
    return f"{ipaddress.ip_address(address)}:{int(port, 16)}"


def pid_then_sleep(folder: str) -> None:
    """Write this rank's pid to `folder/rank-R.pid`, then work for a minute (the test kills the launcher)."""
    path = Path(folder) / f"rank-{dist.get_rank()}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)  # whole, or not yet there
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        torch.ones(64, 64).sum()  # a training loop's stand-in: busy, never in a collective
        time.sleep(0.05)


def one_never_arrives() -> None:
    """3 ranks, a 3 s timeout: rank 2 never calls anything; rank 0 times out in the barrier at 3 s;
    rank 1 waits for rank 2 in a receive from 3.5 s, so that at 5 s, when the launcher stops the
    survivors (its grace period after rank 0's timeout), rank 1 is inside `torch.distributed`."""
    rank = dist.get_rank()
    if rank == 0:
        dist.barrier()
    elif rank == 1:
        time.sleep(3.5)
        dist.recv(torch.empty(1), src=2)
    else:
        time.sleep(120)


def raise_while_peer_sleeps() -> None:
    """Rank 0 raises a real error at once, rank 1 works on outside any collective: rank 1 did not
    hang, rank 0 failed first (no timeout involved). The barrier first: every rank's gloo pairs are
    connected, so rank 0's exit cannot fail rank 1's own `init_process_group` (a connection closed
    mid-handshake, which rank 1 would report as its own error before the launcher stops it)."""
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("rank 0 rejects its input")
    time.sleep(120)


def stalls_in_a_split_group(sleep_s: float) -> None:
    """Rank 1 sleeps `sleep_s` seconds outside any collective; rank 0 waits for it in an all-reduce on a group split
    from the world (the world's timeout is the launch's)."""
    from cpref.comm import TorchComm

    sub = TorchComm().split([[0, 1]])  # the same two ranks, a process group of their own
    if dist.get_rank() == 1:
        time.sleep(sleep_s)
    sub.all_reduce(torch.ones(4))


def blocked_signals() -> list[str]:
    """The signals this rank has blocked, by name."""
    import signal

    return sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))


# gloo's own collectives: run on its worker threads, which let go of their tensors after the caller has woken
GLOO_WORKER_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                     "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
                     "reduce", "gather", "scatter")  # fmt: skip


def what_torch_comm_hands_gloo_s_workers() -> list[str]:
    """Every `torch.distributed` collective that gloo runs on its worker threads, recorded (and run) while this rank
    trains `examples/own_module.py`'s model and calls every protocol call of `TorchComm` on the world and on a
    split; the calls recorded, in order."""
    import cpref.comm.torch_dist as torch_dist
    from cpref.comm import TorchComm
    from examples.own_module import train

    called: list[str] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            called.append(name)
            return fn(*args, **kwargs)

        return call

    for name in GLOO_WORKER_CALLS:
        if hasattr(dist, name):
            setattr(dist, name, recorded(name, getattr(dist, name)))
    for alias in ("_all_gather_base", "_reduce_scatter_base"):  # bound at import: the torch 2.13 names or the old ones
        setattr(torch_dist, alias, recorded(alias, getattr(torch_dist, alias)))
    world = TorchComm()
    for comm in (world, world.split([[0, 1]])):
        train(comm, steps=2)
        x = torch.arange(6.0).view(3, 2) + comm.rank
        comm.all_gather(x), comm.reduce_scatter(torch.ones(4, 2)), comm.all_to_all(torch.ones(4, 2))
        comm.all_reduce(x), comm.all_reduce(x, "max"), comm.all_reduce(x, "min"), comm.send_recv(x)
        comm.agree([1, 2]), comm.barrier()
        for posted in (comm.all_gather_async(x), comm.reduce_scatter_async(x[:2]), comm.send_recv_async(x)):
            posted.wait()
    return called


def pairwise_all_reduce_against_the_simulator() -> list[str]:
    """`TorchComm.all_reduce` with gloo's pairwise exchange against the simulated cluster's `native` fold (every
    partial sum rounded to the dtype, in rank order), bit for bit, for each op, dtype and shape (one of each not a
    multiple of the group size, and a scalar); what differs, by name."""
    from cpref.comm import TorchComm
    from sim.cluster.simcluster import _reduce

    comm, wrong = TorchComm(), []
    assert comm.exchange == "p2p"
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64):
        for shape in ((7,), (3, 5), (), (2 * comm.size, 4)):
            xs = [torch.randn(shape, generator=torch.Generator().manual_seed(10 * r + len(shape))).mul(100).to(dtype)
                  for r in range(comm.size)]  # fmt: skip
            for op in ("sum", "max", "min"):
                got = comm.all_reduce(xs[comm.rank], op)
                if got.dtype != dtype or got.shape != shape or not torch.equal(got, _reduce(xs, op, "native")):
                    wrong.append(f"{op} {dtype} {shape}")
    return wrong
