r"""`launch_watch`: what `sim.tools.launch` needs beyond its ranks' report pipes.

Three things, each a few lines, each called by `sim.tools.launch` (the child side in every spawned
rank before it joins, the parent side in the launcher):

* **Ranks die with their launcher.** A launcher killed by SIGKILL runs no cleanup, so each
  rank sees to it itself ([`die_with_parent`][sim.tools.launch_watch.die_with_parent]). On Linux the
  kernel sends the rank SIGKILL when its parent goes (`prctl(PR_SET_PDEATHSIG)`), even while
  the rank is busy in C++; the signal follows the *thread* that started the rank, which is the
  one blocked in `launch` until every rank is stopped, so it outlives them. A parent that went
  before the rank set the signal shows as a changed parent pid. Elsewhere a daemon thread waits
  on multiprocessing's parent sentinel (a pipe the launcher holds open, ready once it is gone)
  and ends the process.
* **A rank's stack on demand.** [`arm_stack_dump`][sim.tools.launch_watch.arm_stack_dump] makes
  `faulthandler` write every thread's Python stack to a file of the launcher's temporary
  folder when the rank receives SIGUSR1 (from C, so even a rank stuck in a C++ call answers);
  [`dump_stacks`][sim.tools.launch_watch.dump_stacks] sends the signal and reads the files.
* **Who timed out, who hung.** [`is_timeout`][sim.tools.launch_watch.is_timeout] recognises the
  process group's timeouts by their text (gloo's transport, the monitored barrier of the
  `DETAIL` call checks, the rendezvous store), and
  [`in_collective`][sim.tools.launch_watch.in_collective] tells from a stack whether the rank was
  waiting inside `torch.distributed`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from multiprocessing.connection import wait

__all__ = ["die_with_parent", "arm_stack_dump", "dump_stacks", "is_timeout", "in_collective"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# gloo: "Timed out waiting 3000ms for recv operation to complete"; the DETAIL checks: "Ranks 1
# failed to pass monitoredBarrier in 3000 ms"; the FileStore: "Timeout waiting for key: ...", "Wait timeout"
# gloo's words for a collective that timed out: "Timed out waiting 5000ms for recv", or, on a pair an earlier timeout
# closed (a rank stopped during a save: seen in 1 of 3 runs), "Application timeout caused pair closure"
_TIMEOUTS = re.compile(r"Timed out waiting \d+ ?ms|failed to pass monitoredBarrier|Timeout waiting for key|Wait timeout"
                       r"|Application timeout caused pair closure")
_TORCH_DISTRIBUTED = re.compile(r"[/\\]torch[/\\]distributed[/\\]")


def die_with_parent() -> None:
    """End this spawned process as soon as the process that started it is gone."""
    parent = multiprocessing.parent_process()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent.pid:  # gone already: we were handed to another process
            os._exit(1)
    else:  # the sentinel is ready at once if the parent already went
        threading.Thread(target=_exit_when_ready, args=(parent.sentinel,), name="cpref-parent-watch", daemon=True).start()


def _exit_when_ready(sentinel: int) -> None:
    wait([sentinel])
    os._exit(1)  # no one is left to report to, and peers die the same way


def arm_stack_dump(path: str) -> None:
    """On SIGUSR1, write every thread's Python stack to `path` (appended, on each signal)."""
    faulthandler.register(signal.SIGUSR1, file=open(path, "w"), all_threads=True)  # noqa: SIM115 -- held by faulthandler


def dump_stacks(pids: dict[int, int], paths: dict[int, str], patience: float = 1.0) -> dict[int, str]:
    """Send SIGUSR1 to `{rank: pid}`; return `{rank: stack}` of those that wrote one within `patience` s."""
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # exited meanwhile
            pass
    stacks: dict[int, str] = {}
    seen: dict[int, str] = {}
    deadline = time.monotonic() + patience
    while len(stacks) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in pids.keys() - stacks.keys():
            try:
                with open(paths[rank]) as f:
                    text = f.read()
            except FileNotFoundError:  # the rank has not armed its dump yet
                text = ""
            if text and text == seen.get(rank):  # unchanged for one poll: written whole
                stacks[rank] = text
            seen[rank] = text
    return stacks


def is_timeout(message: str) -> bool:
    """Whether an exception's message is a process-group (or rendezvous) timeout."""
    return bool(_TIMEOUTS.search(message))


def in_collective(stack: str) -> bool:
    """Whether a faulthandler stack has a frame in `torch.distributed` (a rank waiting in a collective)."""
    return bool(_TORCH_DISTRIBUTED.search(stack))
