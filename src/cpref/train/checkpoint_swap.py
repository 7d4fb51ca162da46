"""A save that a crash cannot lose: written beside, swapped into place, recovered by the next.

A checkpoint `DIR` is written beside itself and swapped into place, so that a crash at any
moment leaves a complete checkpoint somewhere ([what a save may touch][cpref.train.checkpoint_files]):

1. `DIR.tmp` is **created exclusively** (`mkdir` without `exist_ok`) and marked as cpref's with a
   file `.cpref-save` before anything else goes in ([`claim`][cpref.train.checkpoint_swap.claim]);
2. the payload, the RNG state and last `meta.json` are written into it;
3. `DIR` (the previous checkpoint, if any) is marked `.cpref-old` and renamed to `DIR.old`,
   `DIR.tmp` renamed to `DIR` and its mark removed ([`swap`][cpref.train.checkpoint_swap.swap]), and
   `DIR.old` deleted ([`drop_old`][cpref.train.checkpoint_swap.drop_old]).

A kill between the renames of step 3 leaves `DIR.old` and `DIR.tmp`, both complete and both
marked, and no `DIR`; a failure after step 2 and before the swap (a kill, or a disk too full
for the mark of step 3) leaves a complete `DIR.tmp` newer than `DIR`. **Resuming takes the
newest complete checkpoint** of `DIR`, `DIR.tmp` and `DIR.old`, and says which where it is not
`DIR` ([`find`][cpref.train.checkpoint_swap.find]). **The next save recovers first**
([`recover`][cpref.train.checkpoint_swap.recover]): the newest complete one becomes `DIR` (the
swap finished), and the leftovers are deleted.

**Deleting, the mark goes last.** A directory of cpref's is deleted file by file, folders
after their files, then `meta.json`, then its mark, then the directory itself
([`delete`][cpref.train.checkpoint_swap.delete]): a kill (`SIGTERM`, `kill -9`) at any moment of a
deletion leaves a marked subset of the files, the mark alone, or an empty directory, each of
which the next save recognises as its own and deletes. (Deleted in any order, it could leave
an unmarked remainder that cpref would have to take for the user's, and refuse forever.)

A failed write (a full disk) leaves a partial `DIR.tmp`: the save deletes it
([`discard`][cpref.train.checkpoint_swap.discard]) and `DIR` is as it was.

**How it is tested** (`tests/training/test_checkpoint_safety.py`, `test_checkpoint_recovery.py`):
a kill between the renames and a complete `DIR.tmp` newer than `DIR` resume from the newest
and continue bit for bit, and `--resume DIR --save DIR` then saves; an interruption after every
single deletion step (and a `SIGTERM` at each, in a process of its own) leaves a state the
next save cleans up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from cpref.base.errors import CPInputError
from cpref.train.checkpoint_files import MARK, OLD_MARK, _shown, _summed, foreign, is_ours, resolve, siblings

__all__ = ["claim", "swap", "drop_old", "recover", "find", "delete", "discard"]

Complete = Callable[[Path], int]  # the step of the complete, verified checkpoint at a path; else CPInputError


def delete(path: Path, mark: str) -> None:
    """Delete the directory `path` of cpref's: every file, the folders, `meta.json`, then `mark`, then `path`."""
    for root, dirs, names in os.walk(path, topdown=False, followlinks=False):
        for name in names:
            file = Path(root) / name
            if file not in (path / "meta.json", path / mark):
                file.unlink()
        for d in dirs:
            (Path(root) / d).rmdir()
    for last in ("meta.json", mark):
        (path / last).unlink(missing_ok=True)
    path.rmdir()


def _remove(path: Path, mark: str) -> None:
    """Delete a sibling cpref left (it carries `mark` and holds nothing else); refuse anything else."""
    if path.exists() or path.is_symlink():
        if not is_ours(path, mark):  # checked before training; checked again at the moment of deleting
            raise CPInputError(f"{path} exists and was not written by cpref; it is left as it is: move it away")
        delete(path, mark)


def discard(path: Path) -> None:
    """Delete the `DIR.tmp` of a save that failed before it was complete (where it carries the save's mark)."""
    tmp, _ = siblings(path)
    if _marked(tmp, MARK):
        _remove(tmp, MARK)


def _steps(paths, complete: Complete) -> tuple[dict[Path, int], list[str]]:
    """`{path: step}` of the complete checkpoints among `paths`, and what is wrong with the others."""
    found, problems = {}, []
    for p in paths:
        if p.exists():
            try:
                found[p] = complete(p)
            except CPInputError as exc:
                problems.append(f"{p}: {exc}")
    return found, problems


def _newest(found: dict[Path, int], path: Path) -> Path:
    """The newest complete checkpoint; `path` itself where it is as new as any."""
    return max(found, key=lambda p: (found[p], p == path))


def _leftovers(path: Path) -> list[Path]:
    """The siblings of `path` that an interrupted save left, each carrying its mark."""
    return [p for p, mark in zip(siblings(path), (MARK, OLD_MARK)) if is_ours(p, mark)]


def recover(path: Path, complete: Complete) -> None:
    """Put the newest complete of `DIR`, `DIR.tmp` and `DIR.old` in place as `DIR`, then delete cpref's leftovers.

    This finishes a swap that a crash interrupted (or never began). `complete(p)` returns the
    step of the complete, verified checkpoint at `p`, or raises `CPInputError`.
    """
    tmp, old = siblings(path)
    leftovers = _leftovers(path)
    if leftovers:
        found, _ = _steps([path, *leftovers], complete)
        best = _newest(found, path) if found else path
        if best != path:
            _put_in_place(path, best)
    for mark in (MARK, OLD_MARK):  # a mark left inside the checkpoint by a kill during the swap
        if path.is_dir() and (path / mark).is_file() and _summed(path) is not None:
            (path / mark).unlink()
    _remove(tmp, MARK)
    _remove(old, OLD_MARK)


def _put_in_place(path: Path, best: Path) -> None:
    """Make the complete sibling `best` the checkpoint `DIR`; what `DIR` held (older, or incomplete) is deleted."""
    tmp, old = siblings(path)
    other, other_mark = (old, OLD_MARK) if best == tmp else (tmp, MARK)
    _remove(other, other_mark)  # the other sibling: older than `best`, or incomplete
    if path.exists() or path.is_symlink():
        if not (is_ours(path) or is_ours(path, MARK) or path.is_dir() and not any(path.iterdir())):
            raise CPInputError(f"{path} holds files cpref did not write ({_shown(foreign(path))}), and the newest "
                               f"complete checkpoint is {best}; both are left as they are: move those files away and "
                               "save again")  # fmt: skip
        (path / other_mark).write_text("the checkpoint a cpref save is replacing\n")
        path.rename(other)
    best.rename(path)
    (path / (MARK if best == tmp else OLD_MARK)).unlink()
    _remove(other, other_mark)


def claim(path: Path) -> Path:
    """Create `DIR.tmp` exclusively and mark it as cpref's; returns it."""
    tmp, _ = siblings(path)
    try:
        tmp.mkdir(parents=True)
    except FileExistsError:
        raise CPInputError(f"{tmp} appeared while this save was starting (another run saving here?)") from None
    (tmp / MARK).write_text("a cpref checkpoint being written\n")
    return tmp


def swap(path: Path) -> None:
    """Put the complete `DIR.tmp` in place of `DIR`, the previous checkpoint aside as `DIR.old` (step 3 of the module
    docstring, but for [`drop_old`][cpref.train.checkpoint_swap.drop_old])."""
    tmp, old = siblings(path)
    if old.exists() or old.is_symlink():
        raise CPInputError(f"{old} appeared during training; it is left as it is, and the new checkpoint is complete in "
                           f"{tmp}: move {old.name} away and rename {tmp.name} to {path.name}")  # fmt: skip
    if path.exists() and any(path.iterdir()):
        mine = foreign(path)
        if mine:
            raise CPInputError(f"{path} now holds files cpref did not write ({_shown(mine)}); it is left as it is, and the "
                               f"new checkpoint is complete in {tmp}: move those files away and save again")  # fmt: skip
        (path / OLD_MARK).write_text("the checkpoint a cpref save is replacing\n")
        path.rename(old)
    tmp.rename(path)  # the new checkpoint appears complete, or not at all (over an empty directory too)
    (path / MARK).unlink()


def drop_old(path: Path) -> None:
    """Delete `DIR.old`, the previous checkpoint, once the swap has put the new one in place (the end of step 3)."""
    _remove(siblings(path)[1], OLD_MARK)


def _marked(path: Path, mark: str) -> bool:
    try:
        return (path / mark).is_file()
    except OSError:  # e.g. DIR.tmp of a DIR whose name is as long as the filesystem allows: it cannot exist
        return False


def find(directory: str | Path, complete: Complete) -> tuple[Path, str | None]:
    """The checkpoint to resume from: the newest complete one of `DIR` and the siblings a save left.

    Returns `(path, note)`; `note` says which sibling was chosen and why (None for `DIR` itself).

    Raises:
        CPInputError: if none of `DIR` and the siblings an interrupted save left holds a complete
            checkpoint, with what is wrong with each.
    """
    path = resolve(directory)
    tmp, old = siblings(path)
    try:
        found, problems = _steps((path, *(p for p, mark in ((tmp, MARK), (old, OLD_MARK)) if _marked(p, mark))), complete)
    except OSError as exc:  # a name too long for the filesystem, a folder that cannot be read
        raise CPInputError(f"cannot resume from {path}: {type(exc).__name__}: {exc.strerror or exc} (for "
                           f"{exc.filename or path})") from None  # fmt: skip
    if found:
        best = _newest(found, path)
        if best == path:
            return path, None
        why = (f"holds step {found[path]}, and a save interrupted before its swap left a newer one"
               if path in found else "holds no complete checkpoint (a save was interrupted)")  # fmt: skip
        return best, f"{path} {why}; resuming from {best}, the newest complete one (step {found[best]})"
    if not problems:
        raise CPInputError(f"no checkpoint to resume from at {path}: neither it nor a {tmp.name} or {old.name} that a "
                           "save left exists")  # fmt: skip
    raise CPInputError(f"no complete checkpoint to resume from at {path}: " + "; ".join(problems))
