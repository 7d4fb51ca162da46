r"""`launch`: run one function on N local processes joined in a `torch.distributed` world.

The simulated cluster (`sim.cluster.simcluster`) runs ranks as threads; the hardware path needs real
processes, each with its own process group. `launch(fn, nproc)` starts `nproc` processes
(`multiprocessing`, spawn start method), joins them in one world over the backend (gloo by
default), runs `fn(*args)` on each, and returns the results, indexed by rank:

```python
# run by tests/backends/test_torch_dist.py::test_every_collective_on_every_group_and_dtype
from sim.tools.launch import launch
results = launch(my_module.check_rank, 4, timeout=30.0)   # fn: a module-level function
```

`fn` must be picklable, i.e. a module-level function of an importable module (spawned
processes import it by name); inside it, `cpref.comm.TorchComm()` is the world group.
Each process runs one thread (`torch.set_num_threads(1)`, so that N ranks share N cores as
on a cluster), binds the device of its rank when given one (`device="cuda"` or `"npu"`, for
NCCL or HCCL), and meets the others through a `FileStore`: a file in a temporary folder that
the launcher creates and removes (no port is guessed, so parallel launches do not collide).

A local launch opens no socket reachable from outside the machine: the rendezvous is a file,
and the sockets that gloo and NCCL open between the ranks are bound to the loopback interface,
since each rank sets `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` to it (`lo`) unless the
environment sets them already. The ranks die with the launcher: killed, even by SIGKILL, it
takes them with it (`sim.tools.launch_watch`), leaving only its temporary folder behind, which the
next launch removes: the folder carries the launcher's pid (`cpref-launch-<pid>-...`), and a launch first
removes the folders of launchers that no longer run ([`sweep`][sim.tools.launch.sweep]).

## Faults never hang

Each rank reports through its own pipe: `("ok", result)`, or its exception's type, message
and traceback. The parent waits on all pipes at once; a pipe that closes without a report is
a rank that died (`os._exit`, a signal, a crash in C++), and the process's exit code says how
("killed by signal 9 (SIGKILL)"). After the first failure the parent collects reports for a
short grace period, terminates the survivors, and raises `LaunchFailure`, which names the
root cause: a rank that died if there is one, else a rank that hung (below), else the
earliest exception (peers that lost it typically raise gloo's "Connection closed by peer" a
moment later).

A rank waiting in a collective for a peer that neither calls it nor dies (a peer looping,
deadlocked or asleep outside any collective, or a mismatched program) is released by the
process-group `timeout`. When no rank died and the earliest failure is such a timeout, the
launcher asks every rank still running for its Python stack (SIGUSR1, which `faulthandler`
answers even in C++) before it stops it. A rank outside `torch.distributed` then never reached
the collective that the others timed out in: it is reported as `hung`, with that stack, and is
the root cause. A rank inside is itself waiting in a collective, and is `terminated`, its stack
kept in its `RankFailure`. (After a real error, ranks still running are `terminated`, and
asked nothing.) A rank that does not answer within a second is not running at all: it is
`hung`, and its message says whether it is stopped (SIGSTOP, Ctrl-Z; the launcher continues it
as it ends it).

A mismatched program need not wait that long: with `check_calls=True` (the default) torch
compares every collective's op, shapes and dtypes across the group first
(`TORCH_DISTRIBUTED_DEBUG=DETAIL`), so mismatched calls raise "Detected mismatch between
collectives" at once instead of returning garbage, which gloo otherwise can. It costs one
small extra collective per call: pass `check_calls=False` for timings.

## Ctrl-C

Ctrl-C in a terminal sends SIGINT to every process of the foreground job: the launcher and its
ranks. Only the launcher acts on it: the ranks start with SIGINT blocked (inherited from the
launcher, which blocks it while it starts them), so none of them prints a `KeyboardInterrupt`
traceback of its own or dies half-way through a collective while the others wait in it. The
launcher's `KeyboardInterrupt` ends every rank (SIGTERM), removes its temporary folder, and
propagates to the caller.

## Under torchrun

When `RANK`, `WORLD_SIZE` and `LOCAL_RANK` are set (`torchrun --nproc-per-node N -m ...`),
`launch` starts nothing: it initializes the process group from that environment (unless it
already is), runs `fn(*args)` in this process, and returns `[result]`, this rank's result
only. `nproc` is then ignored; the world is torchrun's, which is how a run goes multi-node.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.resource_tracker
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from sim.tools.launch_watch import arm_stack_dump, die_with_parent, dump_stacks, in_collective, is_timeout

__all__ = ["launch", "under_torchrun", "sweep", "LaunchFailure", "RankFailure"]

MAX_TIMEOUT_S = (2**63 - 1) / 1e9  # the longest process-group timeout: int64 nanoseconds (gloo refuses 9.3e12 s)
_GRACE_S = 2.0  # after the first failure, how long to collect the other ranks' reports


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: it `raised`, it `died`, it `hung`, or the launcher `terminated` it.

    `hung` and `terminated` ranks were still running when the launcher stopped them; a `hung`
    one's `traceback` is its Python stack then (so is a `terminated` one's, where the others
    timed out), and `message` what the launcher inferred.
    """

    rank: int
    kind: str
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    at: float = field(default=0.0, compare=False)  # time.time() of the failure

    def summary(self) -> str:
        """One line: `rank 1 raised ValueError: boom`, `rank 1 was killed by signal 9 (SIGKILL)`."""
        if self.kind == "raised":
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"rank {self.rank} raised {self.exc_type}: {first}"
        if self.kind == "died":
            return f"rank {self.rank} {_exit_reason(self.exitcode)} without reporting a result"
        if self.kind == "hung":
            return f"rank {self.rank} hung: {self.message}"
        tail = f" ({self.message})" if self.message else ""
        return f"rank {self.rank} was terminated by the launcher after another rank failed{tail}"


class LaunchFailure(RuntimeError):
    """Some ranks of a `launch` failed.

    Attributes:
        failures: `{rank: RankFailure}` for every rank that raised, died, hung or was terminated.
        root: the root cause: the first rank that died, else the lowest rank that hung, else
            the earliest exception.
        results: `{rank: result}` of the ranks that finished.
    """

    def __init__(self, failures: dict[int, RankFailure], nproc: int, results: dict[int, Any]) -> None:
        self.failures, self.nproc, self.results = failures, nproc, results
        causes = [f for f in failures.values() if f.kind != "terminated"]
        self.root = min(causes, key=lambda f: (f.kind == "raised", f.at, f.rank))  # died and hung never meet
        lines = [f"{self.root.summary()} (of {nproc} ranks)"]
        if self.root.traceback:
            what = "stack of rank {} when the launcher stopped it" if self.root.kind == "hung" else "traceback of rank {}"
            lines += [what.format(self.root.rank) + ":", self.root.traceback.rstrip()]
        others = [f.summary() for r, f in sorted(failures.items()) if r != self.root.rank]
        lines += (["other ranks:"] + [f"  {line}" for line in others]) if others else []
        super().__init__("\n".join(lines))


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK` set)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    args: Sequence[Any] = (),
    threads: int = 1,
    check_calls: bool = True,
    device: str = "cpu",
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local processes joined in one `torch.distributed` world.

    Args:
        fn: a module-level (picklable) function; it runs with the world process group
            initialized, e.g. `comm = cpref.comm.TorchComm()`.
        nproc: number of processes (ranks) `>= 1`; ignored under torchrun.
        backend: the `torch.distributed` backend.
        timeout: seconds a rank may wait in a collective (the process-group timeout).
        args: positional arguments for `fn`, picklable.
        threads: torch intra-op threads per process.
        check_calls: compare every collective's signature across ranks first
            (`TORCH_DISTRIBUTED_DEBUG=DETAIL`); turn off for timings.
        device: `"cpu"`, or the accelerator type (`"cuda"`, `"npu"`): each process then binds
            the device of its local rank before joining (NCCL and HCCL need one device a rank).

    Returns:
        `[fn(*args) on rank 0, ..., on rank nproc-1]`; under torchrun, `[this rank's result]`.

    Raises:
        LaunchFailure: if a rank raised or died: which, why, and its traceback.
        ValueError: if `nproc < 1`, or `timeout` is not in `(0, MAX_TIMEOUT_S]`.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"launch: nproc must be an int >= 1, got {nproc!r}")
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"launch: timeout must be > 0 and at most {MAX_TIMEOUT_S:.3g} seconds (about 292 years, int64 "
                         f"nanoseconds: a longer one overflows the process group's clock), got {timeout!r}")  # fmt: skip
    setup = (backend, float(timeout), threads, check_calls, device)
    if under_torchrun():
        return [_run_in_torchrun(fn, tuple(args), setup)]
    return _launch_local(fn, tuple(args), nproc, setup)


def _setup(local_rank: int, threads: int, check_calls: bool, device: str) -> None:
    """What every rank does before joining: threads, the call checks, its device."""
    torch.set_num_threads(threads)
    if check_calls:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # must precede init_process_group
    if device != "cpu":
        if device == "npu" and not hasattr(torch, "npu"):
            __import__("torch_npu")  # registers torch.npu and the hccl backend
        getattr(torch, device).set_device(local_rank)


def _run_in_torchrun(fn: Callable[..., Any], args: tuple, setup: tuple) -> Any:
    backend, timeout, threads, check_calls, device = setup
    _setup(int(os.environ["LOCAL_RANK"]), threads, check_calls, device)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))  # env:// from torchrun
    try:
        result = fn(*args)
        if owned:
            dist.barrier()  # no rank tears the group down while a peer still has work in flight on it
        return result
    finally:
        if owned:
            dist.destroy_process_group()


def _rank_main(payload: bytes, rank: int, nproc: int, folder: str, setup: tuple, conn: Connection) -> None:
    """One spawned rank: join the world, run `fn`, report the result or the failure, exit."""
    backend, timeout, threads, check_calls, device = setup
    try:
        die_with_parent()
        arm_stack_dump(_stack_path(folder, rank))
        fn, args = pickle.loads(payload)  # here, so that a failing import is reported too
        _setup(rank, threads, check_calls, device)
        _loopback_only()
        wait_s = datetime.timedelta(seconds=timeout)
        store = dist.FileStore(os.path.join(folder, "store"), nproc)
        store.set_timeout(wait_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=wait_s)
        # plain pickle, not multiprocessing's: torch would share tensors through this process's
        # memory, which is gone once it exits
        conn.send_bytes(pickle.dumps(("ok", fn(*args))))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, never lost
        conn.send_bytes(pickle.dumps(("raised", type(exc).__name__, str(exc), traceback.format_exc(), time.time())))
        conn.close()
        os._exit(1)  # skip teardown: peers may be mid-collective with us; the parent reports
    conn.close()
    dist.destroy_process_group()


def _loopback_only() -> None:
    """Bind gloo's and NCCL's sockets to the loopback interface, unless the environment names one."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)  # Linux; macOS and BSD
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if loopback else ():
        os.environ.setdefault(variable, loopback)


PREFIX = "cpref-launch-"  # a launch's temporary folder: PREFIX, the launcher's pid, "-", a random part


def sweep(directory: str | os.PathLike | None = None) -> list[Path]:
    """Remove the temporary folders that launchers killed before their cleanup left in `directory` (default: the
    temporary directory): those named for a pid that no longer runs. Returns what it removed.

    A folder of a live launcher, one whose name carries no pid, or one that cannot be removed is left as it is.
    """
    removed = []
    for folder in Path(directory or tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = folder.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and folder.is_dir() and not folder.is_symlink() and not _runs(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
    return removed


def _runs(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it cannot be signalled, but it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stack_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stack-{rank}.txt")


def _launch_local(fn: Callable[..., Any], args: tuple, nproc: int, setup: tuple) -> list[Any]:
    # 1) the function (unpicklable: fail here, not in N children), and a folder of ours for the
    #    rendezvous file and the ranks' stacks
    payload = pickle.dumps((fn, args))
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], {}
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    finished = False
    sweep()
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-") as folder:
        try:
            # 2) one process per rank, each with a pipe back to us and SIGINT blocked (module docstring: Ctrl-C)
            with _sigint_blocked():
                for rank in range(nproc):
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_rank_main, args=(payload, rank, nproc, folder, setup, send),
                                       name=f"cpref-rank-{rank}", daemon=True)  # fmt: skip
                    proc.start()
                    send.close()  # the child holds the only write end: EOF means it is gone
                    procs.append(proc)
                    conns[recv] = rank
            # 3) collect every outcome; the first failure starts the grace period
            results, failures = _collect(conns, procs, folder)
            finished = not failures
        finally:
            # 4) no process outlives the launch: after a failure, survivors are terminated at once
            for proc in procs:
                _stop(proc, patience=10.0 if finished else 0.0)
    if failures:
        raise LaunchFailure(failures, nproc, results)
    return [results[rank] for rank in range(nproc)]


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread meanwhile: processes started then inherit the blocked signal (a SIGINT that
    arrives meanwhile is delivered here once the block is lifted)."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: the ranks take Ctrl-C themselves
        yield
        return
    # multiprocessing starts its resource tracker with the first process, and *unblocks* SIGINT after: start it first
    multiprocessing.resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _collect(conns: dict[Connection, int], procs: list, folder: str) -> tuple[dict[int, Any], dict[int, RankFailure]]:
    """Wait on all pipes; return `(results, failures)`, ranks still running included (`_still_running`)."""
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    first_failure = None
    while conns:
        left = None if first_failure is None else first_failure + _GRACE_S - time.monotonic()
        if left is not None and left <= 0:
            break
        for conn in wait(list(conns), timeout=left):
            rank = conns.pop(conn)
            try:
                report = pickle.loads(conn.recv_bytes())
            except EOFError:  # closed without a report: the process died
                procs[rank].join(timeout=5.0)
                report = ("died", procs[rank].exitcode)
            if report[0] == "ok":
                results[rank] = report[1]
                continue
            first_failure = first_failure or time.monotonic()
            if report[0] == "raised":
                failures[rank] = RankFailure(rank, "raised", *report[1:4], at=report[4])
            else:
                failures[rank] = RankFailure(rank, "died", exitcode=report[1], at=time.time())
    failures.update(_still_running(failures, {rank: procs[rank].pid for rank in conns.values()}, folder))
    return results, failures


def _still_running(failures: dict[int, RankFailure], pids: dict[int, int], folder: str) -> dict[int, RankFailure]:
    """The ranks `{rank: pid}` still running after the grace period: `hung` where the others timed
    out waiting for them outside any collective, else `terminated`."""
    if not pids:
        return {}
    now, first = time.time(), min(failures.values(), key=lambda f: f.at)  # a failure started the grace period
    timed_out = sorted(rank for rank, f in failures.items() if f.kind == "raised" and is_timeout(f.message))
    if first.rank not in timed_out or any(f.kind == "died" for f in failures.values()):
        return {rank: RankFailure(rank, "terminated", at=now) for rank in pids}  # a real error came first
    stacks = dump_stacks(pids, {rank: _stack_path(folder, rank) for rank in pids})
    waiters = f"rank {timed_out[0]}" if len(timed_out) == 1 else f"ranks {', '.join(map(str, timed_out))}"
    still: dict[int, RankFailure] = {}
    for rank in pids:
        stack = stacks.get(rank, "")
        if not stack:  # faulthandler answers even in C++: a rank that does not is not running
            state = "is stopped (SIGSTOP, Ctrl-Z)" if _stopped(pids[rank]) else "did not answer"
            why = f"it {state}: no answer to the launcher's request for its stack"
            still[rank] = RankFailure(rank, "hung", message=why, at=now)
        elif in_collective(stack):  # waiting itself, for a rank that hung
            still[rank] = RankFailure(rank, "terminated", message="it was waiting in a collective", traceback=stack, at=now)
        else:
            why = f"it never reached the collective that {waiters} timed out in"
            still[rank] = RankFailure(rank, "hung", message=why, traceback=stack, at=now)
    return still


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (Linux: state `T` in /proc; elsewhere not known: False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop(proc, patience: float) -> None:
    """Give a process `patience` seconds to exit; then terminate it (and kill it if that fails)."""
    proc.join(timeout=patience)
    if proc.is_alive():
        proc.terminate()
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(proc.pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) takes the SIGTERM only once continued
        proc.join(timeout=5.0)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"
