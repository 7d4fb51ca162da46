"""One run at a time saves into a checkpoint directory.

Two runs saving into one `DIR` at once (a requeued job whose first copy still runs) destroy
each other's work: the cleanup at the start of a save deletes the other run's live `DIR.tmp`,
both write the same files, one swaps a half-written directory into place, and the last good
checkpoint is gone. So a run **holds an exclusive lock on `DIR` for as long as it may save
there**, and a second run is refused before its first step:

* the lock is `fcntl.flock` on the file `DIR.lock` beside `DIR`, taken by world rank 0; every
  rank learns the outcome, and where another run holds it every rank refuses alike, naming
  that run's process, host and start from the line it wrote into the file
  ([`hold`][cpref.train.checkpoint_lock.hold]);
* the kernel releases a flock when its process ends, however it ends (`kill -9` too), so a run
  that died holds nothing: the next run takes the lock, and the file it left, over;
* the holder deletes `DIR.lock` as it lets go, while still holding it; a run that opened the
  file just before finds, once it holds the lock, that the name has gone or points to another
  file, and opens it again;
* [`train`][cpref.train.training.train] holds it from before the first step to the end of the
  run; [`save_checkpoint`][cpref.train.checkpoint.save_checkpoint] takes it for its own
  duration where the caller holds none; `python -m sim train` takes it before it resumes, and
  [`probe`][cpref.train.checkpoint_lock.probe]s it (a shared lock for an instant, which any
  number of processes may take at once) before it starts anything.

A `DIR.lock` that cpref did not write (a folder, a link, a file with other content) is refused
by [`check_target`][cpref.train.checkpoint_files.check_target] before training and never
written to. Where the filesystem has no locks (`flock` fails, as on some network
filesystems), the run warns and goes on without one.

**How it is tested** (`tests/training/test_checkpoint_lock.py`): a save where another process
holds the lock is refused before the first step on every rank, the checkpoint there kept byte
for byte; once that process is killed, the same run saves; two `python -m sim train` runs
started together on one target, again and again, end with one refused before its first step
and the other's checkpoint complete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as files
from cpref.train.checkpoint_errors import agree, explain

__all__ = ["SaveLock", "hold", "probe"]

_TRIES = 10  # times the name may change under us (a holder letting go) before giving up


class SaveLock:
    """An exclusive lock on the checkpoint directory `path` (`fcntl.flock` on `DIR.lock`), in this process.

    Args:
        path: the resolved checkpoint directory ([`resolve`][cpref.train.checkpoint_files.resolve]).
    """

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, files.lock_file(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (or, on a filesystem without locks, its file)."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock without waiting.

        Raises:
            CPInputError: another process holds it (naming it), or `DIR.lock` is not cpref's.
        """
        for _ in range(_TRIES):
            fd = self._open()
            try:
                _flock(fd, fcntl.LOCK_EX)
            except BlockingIOError:
                busy = _busy(self.path, self.file, fd)
                os.close(fd)
                raise busy from None
            except OSError as exc:  # no locks on this filesystem: go on with the file alone
                warnings.warn(f"{self.file}: this filesystem does not lock files ({exc.strerror}); a second run saving "
                              f"to {self.path} at the same time would not be detected", stacklevel=2)  # fmt: skip
            if self._names(fd):
                since = time.strftime("%Y-%m-%d %H:%M:%S")
                line = f"{files.LOCK_HEADER}: pid {os.getpid()} on {socket.gethostname()}, since {since}\n"
                os.ftruncate(fd, 0)
                os.pwrite(fd, line.encode(), 0)
                self._fd = fd
                return
            os.close(fd)  # its holder deleted it as it let go: open the file now there
        raise CPInputError(f"cannot lock {self.file}: it was replaced {_TRIES} times while this run tried to take it "
                           "(another program creating and deleting it?); move it away")  # fmt: skip

    def _open(self) -> int:
        if not files.is_our_lock(self.file):
            raise CPInputError(f"cannot save a checkpoint to {self.path}: {self.file} exists and is not cpref's lock "
                               "file (a save locks that name, and writes into it); move it away")  # fmt: skip
        try:
            if not self.file.parent.exists():
                self.file.parent.mkdir(parents=True, exist_ok=True)  # as the save would (check_target found it writable)
            return os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):  # a link or a folder put there meanwhile
                raise CPInputError(f"cannot save a checkpoint to {self.path}: {self.file} is not cpref's lock file "
                                   f"({exc.strerror}); move it away") from None  # fmt: skip
            raise explain(exc, f"cannot lock {self.file}", f"{self.path} is as it was") from None  # e.g. a full disk

    def _names(self, fd: int) -> bool:
        """Whether `DIR.lock` still names the file `fd` is open on."""
        try:
            now = os.lstat(self.file)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Delete `DIR.lock` and let go (a no-op where not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._names(fd):
                os.unlink(self.file)
        finally:
            os.close(fd)  # the kernel releases the flock


def _flock(fd: int, how: int) -> None:
    """`flock(fd, how)` without waiting, tried again for a moment: a `probe` holds the lock shared for an instant."""
    for wait in (0.01, 0.02, 0.04, 0.08, 0.16, None):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if wait is None:
                raise
            time.sleep(wait)


def _busy(path: Path, file: Path, fd: int) -> CPInputError:
    """The refusal of a second run, naming the holder from the line it wrote into `DIR.lock`."""
    holder = os.pread(fd, 300, 0).decode(errors="replace").removeprefix(files.LOCK_HEADER).strip(": \n")
    holder = holder or f"it holds {file}"
    return CPInputError(f"cannot save a checkpoint to {path}: another run is saving there ({holder}); "
                        "two runs saving into one directory at once delete each other's files and can lose the last "
                        "checkpoint. Wait for that run to end (or stop it), or save elsewhere")  # fmt: skip


def probe(directory: str | Path) -> None:
    """Refuse, without taking the lock, a save target whose lock another run holds now (reads only).

    Holds the lock shared for an instant, so that several processes may probe at once; a file
    that is not cpref's is left alone (`check_target` refuses it).

    Raises:
        CPInputError: naming the run that holds it.
    """
    path = files.resolve(directory)
    file = files.lock_file(path)
    try:
        if not files.is_our_lock(file):
            return
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # none there (no run holds it), it went as its holder let go, or a name too long (refused later)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(path, file, fd) from None
    except OSError:  # no locks on this filesystem
        pass
    finally:
        os.close(fd)  # lets go of the shared lock


@contextlib.contextmanager
def hold(directory: str | Path, world: Any) -> Iterator[SaveLock]:
    """Hold the save lock on `directory` for the body of a `with` (collective over `world`).

    World rank 0 takes the lock; every rank learns whether it did (one exchange) and, where it
    did not, raises the same `CPInputError`. Yields this rank's `SaveLock` (held on rank 0 only).
    """
    lock, error = SaveLock(files.resolve(directory)), None
    try:
        if world.rank == 0:
            try:
                lock.acquire()
            except CPInputError as exc:
                error = exc
        agree(world, error)
        yield lock
    finally:
        lock.release()
