"""How `python -m sim train` reports a run that stops early: one line, and an exit status for each way it stops.

A run ends in one of these ways, whichever backend runs its ranks (threads of the simulated cluster, or gloo
processes started by `sim.tools.launch`); the command prints one line on stderr, `python -m sim train: error: ...`
(`python -m sim train: interrupted ...` for Ctrl-C), and exits with the status of the row:

| status | the run | the line names |
| --- | --- | --- |
| 0 | trained every step | (nothing: no line) |
| 1 | diverged: a step's loss or gradient norm is not finite | the step, both values, what to change |
| 2 | refused: a bad argument, or a `CPInputError` raised while it ran (such as a save into a checkpoint another run is saving to) | the value or path, and the fix |
| 3 | a rank failed: killed by a signal, died, or raised an error of its own (a bug: its traceback is printed above the line) | the rank, and how it failed |
| 4 | timed out: a rank stalled (stopped by SIGSTOP, asleep or looping outside any collective) and the others waited `--timeout` seconds for it; or every rank waited for another (a deadlock) | the stalled ranks, or where the ranks waited |
| 130 | interrupted: Ctrl-C (SIGINT) | (the checkpoint below) |

Every line ends with the last checkpoint the run can continue from: the newest complete checkpoint of `--save`
(else of `--resume`), read from the directory itself, so it is right even when a process of the run wrote it
(`the last checkpoint is step 4 in ckpt`; a save cut short may have left the newest in `ckpt.tmp`, which
`--resume ckpt` takes, and the line says so); or `no checkpoint was saved`.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Sequence

from cpref.base.errors import CPInputError, NonFiniteStepError, PeerInputError
from cpref.train.checkpoint import find_checkpoint

__all__ = ["STATUS", "stopped", "last_checkpoint", "report"]

STATUS = {"diverged": 1, "refused": 2, "failed": 3, "timeout": 4, "interrupted": 130}  # 130 = 128 + SIGINT
_REFUSED = {cls.__name__ for cls in (CPInputError, PeerInputError)}  # by name: a gloo rank reports the type's name


def stopped(exc: BaseException, timeout: float) -> tuple[int, str, str]:
    """`(status, line, detail)` for the exception that ended a run: the exit status, the one line (without the
    program's name), and a traceback to print above it (a rank's own error), or `""`."""
    from sim.cluster.rendezvous import ClusterFailure
    from sim.tools.launch import LaunchFailure

    if isinstance(exc, KeyboardInterrupt):
        return STATUS["interrupted"], "interrupted", ""
    if isinstance(exc, NonFiniteStepError):
        return STATUS["diverged"], str(exc), ""
    if isinstance(exc, CPInputError):
        return STATUS["refused"], str(exc), ""
    if isinstance(exc, ClusterFailure):
        return _simulated(exc, timeout)
    if isinstance(exc, LaunchFailure):
        return _processes(exc, timeout)
    where = "".join(traceback.format_exception(exc)).rstrip()
    return STATUS["failed"], f"{type(exc).__name__}: {_first(str(exc))}", where


def _simulated(failure, timeout: float) -> tuple[int, str, str]:
    """A `ClusterFailure` of the simulated cluster: its root cause decides."""
    from sim.cluster.rendezvous import CollectiveTimeout
    from sim.cluster.simcluster import RankStuck

    stuck = sorted(g for g, e in failure.errors.items() if isinstance(e, RankStuck))
    if stuck:
        frames = [line.strip() for line in failure.errors[stuck[0]].where.splitlines() if line.strip().startswith("File")]
        at = f"; {_ranks(stuck[:1])} was at {frames[-1]}" if frames else ""  # its innermost frame
        return STATUS["timeout"], (f"{_ranks(stuck)} stalled: the others waited {timeout:g} s (--timeout) for "
                                   f"{'it' if len(stuck) == 1 else 'them'} in a collective, and "
                                   f"{'it was' if len(stuck) == 1 else 'they were'} still running outside any "
                                   f"collective after that{at}"), ""  # fmt: skip
    root = failure.errors[failure.root_rank]
    if isinstance(root, CollectiveTimeout):
        return STATUS["timeout"], f"{_first(str(root))}: every rank waited {timeout:g} s (--timeout) for another", ""
    if isinstance(root, (NonFiniteStepError, CPInputError)):
        return stopped(root, timeout)
    where = "".join(traceback.format_exception(root)).rstrip()
    return STATUS["failed"], f"rank {failure.root_rank} raised {type(root).__name__}: {_first(str(root))}", where


def _processes(failure, timeout: float) -> tuple[int, str, str]:
    """A `LaunchFailure` of gloo processes: its root cause decides."""
    from sim.tools.launch_watch import is_timeout

    root = failure.root
    if root.kind == "died":
        return STATUS["failed"], root.summary(), ""
    if root.kind == "hung":
        hung = sorted(r for r, f in failure.failures.items() if f.kind == "hung")
        why = "; ".join(f"rank {r}: {failure.failures[r].message}" for r in hung)
        return STATUS["timeout"], (f"{_ranks(hung)} stalled: the others waited {timeout:g} s (--timeout) for "
                                   f"{'it' if len(hung) == 1 else 'them'} in a collective ({why})"), ""  # fmt: skip
    message = _first(root.message)
    if root.exc_type == NonFiniteStepError.__name__:
        return STATUS["diverged"], message, ""
    if root.exc_type in _REFUSED:
        return STATUS["refused"], message, ""
    if is_timeout(root.message):
        waited = sorted(r for r, f in failure.failures.items() if f.kind == "raised" and is_timeout(f.message))
        return STATUS["timeout"], (f"{_ranks(waited)} waited {timeout:g} s (--timeout) in a collective that no "
                                   f"rank stalled outside of: {message}"), ""  # fmt: skip
    return STATUS["failed"], root.summary(), f"traceback of rank {root.rank}:\n{root.traceback.rstrip()}"


def last_checkpoint(directories: Sequence[str | None]) -> str:
    """Where the run can continue from: the newest complete checkpoint of the first of `directories` that holds
    one (read from the disk), or that none was saved."""
    for directory in directories:
        if directory:
            try:
                path, meta, _ = find_checkpoint(directory)
            except (CPInputError, OSError):
                continue
            aside = "" if Path(path) == Path(directory).resolve() else f" (--resume {directory} takes it)"  # a save cut short
            return f"the last checkpoint is step {meta.step} in {path}{aside}"
    return "no checkpoint was saved"


def report(exc: BaseException, timeout: float, directories: Sequence[str | None], prog: str) -> tuple[int, list[str]]:
    """`(status, lines for stderr)`: the detail, if any, then the one line, ending with the last checkpoint."""
    status, line, detail = stopped(exc, timeout)
    head = f"{prog}: interrupted" if status == STATUS["interrupted"] else f"{prog}: error: {line}"
    return status, ([detail] if detail else []) + [" ".join(f"{head}; {last_checkpoint(directories)}".split())]


def _first(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else ""


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
