r"""A ring at CP size 1: its sends to itself become local copies, so that it can be its own baseline.

The `vs P=1` column holds a CP result to the same attention without CP, by default the implementation
itself on a process group of one rank ([`baselines`][sim.tools.verify.baselines]). A ring rotates its
K/V blocks with `dist.isend`/`dist.irecv` (or `batch_isend_irecv`), and at CP size 1 the next rank is
itself: gloo refuses a send to oneself, the implementation raises, and the row falls back to SDPA and
eager attention. An exact ring whose local math is all in bf16 is then charged with its own rounding as if
it were CP's.

[`loopback`][sim.tools.verify.loopback.loopback] makes those self-sends what they mean: while it is
active, a point-to-point call on a group of one rank copies the sent tensor into the matching receive,
in the order they were posted (a receive posted first is filled by the next send), and returns a finished
work object; calls on any other group go to `torch.distributed` as they are. A receive that no send ever
matches raises when it is waited on, naming it, rather than hanging.

Example:
    >>> import torch, torch.distributed as dist
    >>> _ = dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> got = torch.zeros(2)
    >>> with loopback():
    ...     works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 0), dist.P2POp(dist.irecv, got, 0)])
    ...     _ = [w.wait() for w in works]
    >>> got
    tensor([1., 1.])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["loopback"]

_SEND = c10d.isend  # the original, as a P2POp built outside the loopback holds it


class _Done:
    """A point-to-point call already carried out: `wait()` returns at once (or raises, for an unmatched receive)."""

    def __init__(self, mailbox: _Mailbox | None = None, buffer: torch.Tensor | None = None) -> None:
        self.mailbox, self.buffer = mailbox, buffer

    def wait(self, timeout=None) -> bool:
        if self.mailbox is not None and any(b is self.buffer for b in self.mailbox.waiting):
            raise RuntimeError(f"a receive from itself (CP size 1) of shape {tuple(self.buffer.shape)} that no send "
                               "matched: the ring posts more receives than sends")  # fmt: skip
        return True

    def is_completed(self) -> bool:
        return True


class _Mailbox:
    """The sends and receives of one rank to itself, matched in posting order."""

    def __init__(self) -> None:
        self.sent: deque[torch.Tensor] = deque()
        self.waiting: deque[torch.Tensor] = deque()

    def send(self, tensor: torch.Tensor) -> _Done:
        if self.waiting:
            self.waiting.popleft().copy_(tensor)
        else:
            self.sent.append(tensor.detach().clone())
        return _Done()

    def recv(self, buffer: torch.Tensor) -> _Done:
        if self.sent:
            buffer.copy_(self.sent.popleft())
        else:
            self.waiting.append(buffer)
        return _Done(self, buffer)


def _alone(group) -> bool:
    """Whether `group` (None: the default group) has this one rank."""
    return dist.get_world_size(group) == 1


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """While active, point-to-point calls on a group of one rank are local copies (see the module docstring)."""
    box = _Mailbox()
    names = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
    originals = {name: getattr(c10d, name) for name in names}

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return box.send(tensor) if _alone(group) else originals["isend"](tensor, dst, group, tag, group_dst=group_dst)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        return box.recv(tensor) if _alone(group) else originals["irecv"](tensor, src, group, tag, group_src=group_src)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not _alone(group):
            return originals["send"](tensor, dst, group, tag, group_dst=group_dst)
        box.send(tensor)

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        if not _alone(group):
            return originals["recv"](tensor, src, group, tag, group_src=group_src)
        box.recv(tensor).wait()
        return dist.get_rank()

    def batch_isend_irecv(ops):
        if not ops or not all(_alone(op.group) for op in ops):  # its ops call isend / irecv below: the originals
            return originals["batch_isend_irecv"](ops)
        return [box.send(op.tensor) if op.op in (_SEND, isend) else box.recv(op.tensor) for op in ops]

    patched = dict(send=send, recv=recv, isend=isend, irecv=irecv, batch_isend_irecv=batch_isend_irecv)
    try:  # both namespaces: `P2POp` checks its op against distributed_c10d's own isend and irecv
        for name, fn in patched.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
