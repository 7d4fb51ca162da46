"""When a save fails: one line, on every rank alike, and the disk given back.

A save is collective: every rank writes its part of the payload, and world rank 0 alone moves
the directories. A rank that fails while the others wait in the save's next collective would
leave them waiting until the process group's timeout (minutes: a hang). So every step of a
save that can fail ends in an **agreement** ([`agree`][cpref.train.checkpoint_errors.agree]):
each rank says whether it failed (one host exchange of three ints,
[`exchange`][cpref.modes.consistency.exchange]); if one did, the lowest rank that failed sends
its message, and every rank raises the same error with it, after a cleanup (a failed payload
leaves a partial `DIR.tmp`: rank 0 deletes it, so that a full disk does not stay full).

What the message says ([`explain`][cpref.train.checkpoint_errors.explain]): an `OSError`
anywhere in the failure (torch's zip writer wraps one in `RuntimeError: ... unexpected pos`;
`torch.distributed.checkpoint` wraps every rank's in a `CheckpointException`) is named by what
it means, in one line, with the file it concerns:

* no space left on the device, or the disk quota exceeded: with the bytes the save needs and
  the bytes that were free when it began, and where the last checkpoint is;
* a file larger than this process may write (`ulimit -f`), no permission, a read-only
  filesystem: its own words.

Any other failure is named by its type and message. The error is a
[`CheckpointWriteError`][cpref.train.checkpoint_errors.CheckpointWriteError], a `CPInputError`:
the command-line tools print it as one line.

**How it is tested** (`tests/training/test_checkpoint_failures.py`): a save into a full tmpfs
(or under a file-size limit where none can be mounted) on the simulated cluster and with
`torch.distributed.checkpoint` on gloo processes gives one line naming the cause and the path,
leaves no `DIR.tmp`, and keeps the last checkpoint loadable; a failure on one rank alone raises
the same error on every rank.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from cpref.base.errors import CPInputError
from cpref.modes.consistency import agree as shared_agree

__all__ = ["CheckpointWriteError", "agree", "explain", "free_bytes", "state_bytes"]

_MOST = 2000  # bytes of a shared message (one line; a longer one is cut)
_NEARLY_FULL = 1 << 20  # bytes free below which a failed write without an errno is taken for a full filesystem
_SPACE = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded"}
_CAUSES = {**_SPACE, errno.EFBIG: "a file would be larger than this process may write (its file-size limit, ulimit -f)"}
_FIXES = {errno.ENOSPC: "free space there, or save elsewhere", errno.EDQUOT: "free space there, or save elsewhere",
          errno.EFBIG: "raise that limit, or save elsewhere"}  # fmt: skip


class CheckpointWriteError(CPInputError):
    """A checkpoint could not be written (disk full, a file-size limit, no permission, ...).

    The message names the cause, the path and the fix; the last complete checkpoint is kept.
    """


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())  # torch's messages run over lines


def _os_errors(exc: BaseException) -> list[OSError]:
    """Every `OSError` in `exc`'s chain (causes, contexts, and a `CheckpointException`'s per-rank failures)."""
    seen, todo, out = set(), [exc], []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            out.append(e)
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return out


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def explain(exc: Exception, what: str, kept: str, need: int | None = None, free: int | None = None,
            place: Path | None = None) -> CPInputError:  # fmt: skip
    """The one-line error for a save step's failure: `"{what}: {cause} ({errno}, {file}); {kept}; {fix}"`.

    A `CPInputError` (a refusal) is returned as it is. An `OSError` in the chain is named by
    its meaning and file, and the fix follows from it; on a full disk or quota, `need` and
    `free` (bytes, if known) are said. Without an `OSError`, a filesystem at `place` with
    less than 1 MiB free now (or less than `need` when the save began) is named as full.
    `kept` says what is left as it was.
    """
    if isinstance(exc, CPInputError):
        return exc
    found, sizes = _os_errors(exc), ""
    if need is not None:
        began = "" if free is None else f", and {_size(free)} were free when it began"
        sizes = f"; the save needs about {_size(need)}{began}"
    if not found:
        words = f"{type(exc).__name__}: {_one_line(exc)[:_MOST // 4]}"
        now = None if place is None else free_bytes(place)
        if now is not None and (now < _NEARLY_FULL or need is not None and free is not None and need > free):
            return CheckpointWriteError(f"{what}: the filesystem is full, by its numbers: {_size(now)} free now ({words})"
                                        f"{sizes}; {kept}; free space there, or save elsewhere")  # fmt: skip
        return CheckpointWriteError(f"{what}: {words}; {kept}")
    err = next((e for e in found if e.errno in _CAUSES), found[0])
    cause = _CAUSES.get(err.errno, err.strerror or _one_line(err))
    name = errno.errorcode.get(err.errno, "OSError") if err.errno else type(err).__name__
    where = f", {err.filename}" if err.filename else ""
    fix = _FIXES.get(err.errno, "change that, or save elsewhere")
    return CheckpointWriteError(f"{what}: {cause} ({name}{where}){sizes if err.errno in _SPACE else ''}; {kept}; {fix}")


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the model's and the optimizer's tensors: about what a checkpoint of them takes on disk."""
    tensors = [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def free_bytes(path: Path) -> int | None:
    """Bytes free on the filesystem of `path` (or of its nearest existing parent); None if it cannot be read."""
    for place in (path, *path.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


_KINDS = (CPInputError, CheckpointWriteError)  # what a shared error is raised as, by index


def agree(world: Any, error: CPInputError | None, cleanup: Callable[[], Any] | None = None) -> None:
    """Raise the same error on every rank of `world` if any rank's `error` is not None (collective): the lowest rank
    that failed sends its message, raised as a `CheckpointWriteError` where it was one
    ([`cpref.modes.consistency.agree`][cpref.modes.consistency.agree], with `cleanup` run on every rank first)."""
    shared_agree(world, error, kinds=_KINDS, cleanup=cleanup)
