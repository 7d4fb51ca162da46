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
