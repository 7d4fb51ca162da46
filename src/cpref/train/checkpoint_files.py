"""Where a checkpoint lives on disk, and what a save may replace.

A checkpoint `DIR` is written beside itself and swapped into place, so that a crash at any
moment leaves a complete checkpoint somewhere:

1. `DIR.tmp` is **created exclusively** (`mkdir` without `exist_ok`) and marked as cpref's with a
   file `.cpref-save` before anything else goes in;
2. the payload, the RNG state and last `meta.json` are written into it;
3. `DIR` (the previous checkpoint, if any) is marked `.cpref-old` and renamed to `DIR.old`,
   `DIR.tmp` renamed to `DIR` and its mark removed, and `DIR.old` deleted.

A kill between the renames of step 3 leaves `DIR.old` and `DIR.tmp`, both complete and both
marked, and no `DIR`. The next save **recovers** first: it finishes the swap (the newer
complete one becomes `DIR`), and resuming picks the newest complete one of the three
([`find`][cpref.train.checkpoint_files.find]).

**A save never deletes, moves or overwrites a file it did not write.** cpref's files are the
ones a checkpoint's `meta.json` lists in its sums, `meta.json` itself, and its two marks;
anything else (a `notes.txt`, a `sub/` folder, a link) is the user's. A save replaces `DIR`
only if `DIR` does not exist, is an empty directory, or is a cpref checkpoint that holds
nothing but cpref's files; it deletes a sibling `DIR.tmp` or `DIR.old` only if it carries the
mark cpref put there for that purpose, so a user's copy named `DIR.old` is never taken for a
leftover. [`check_target`][cpref.train.checkpoint_files.check_target], which a training run calls
**before its first step**, refuses every other target in one line naming the path and the fix:

* a target that holds files cpref did not write, or beside a `DIR.tmp` / `DIR.old` that is
  not a save's own;
* a target that is a link (to a folder, a file or nothing): a save would replace what it points to,
  perhaps another checkpoint, so only the link's name is resolved, never the link;
* a target **inside a checkpoint** (saving there would add files that checkpoint's sums do not
  list: it would no longer load), or named as another checkpoint's `.tmp` or `.old`;
* a target that cannot be written: under a file, in a directory this process may not write
  to (checked by creating and removing an empty directory there), or with a name (or a `DIR.tmp`
  beside it) too long for the filesystem;
* the current directory or one holding it, and the filesystem root.

The same ownership is checked again at the moment of each deletion: a file that appeared in
`DIR` during training stops the save with the new checkpoint complete in `DIR.tmp`, and `DIR`
untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from cpref.base.errors import CPInputError

__all__ = ["MARK", "OLD_MARK", "FORMAT_PREFIX", "resolve", "siblings", "foreign", "is_checkpoint", "is_ours",
           "check_target", "claim", "swap", "recover", "find"]  # fmt: skip

MARK = ".cpref-save"  # inside DIR.tmp while a save is writing it
OLD_MARK = ".cpref-old"  # inside DIR.old, the previous checkpoint a save is replacing
FORMAT_PREFIX = "cpref-checkpoint/"
NOT_SUMMED = ("meta.json", MARK, OLD_MARK)  # cpref's files that meta.json's sums do not list


def resolve(directory: str | Path) -> Path:
    """The absolute path of a checkpoint directory; `.` and `..` and links above it resolved, the root refused.

    A link named as the directory itself stays a link (a save refuses it): resolved, a save would
    replace whatever it points to, e.g. another checkpoint.
    """
    try:
        path = Path(directory).expanduser()
        path = path.resolve() if path.name in ("", ".", "..") else path.parent.resolve() / path.name
    except (RuntimeError, OSError) as exc:  # ~user of no such user, a loop of links
        raise CPInputError(f"checkpoint directory {str(directory)!r} cannot be resolved ({exc}); name another") from None
    if not path.name:
        raise CPInputError(f"checkpoint directory {str(directory)!r} is the filesystem root; name a directory to save into")
    return path


def siblings(path: Path) -> tuple[Path, Path]:
    """`(DIR.tmp, DIR.old)` of a resolved checkpoint directory."""
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def _summed(path: Path) -> set[str] | None:
    """The files a cpref `meta.json` in `path` lists, or None where there is none (or another program's)."""
    try:
        record = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not str(record.get("format", "")).startswith(FORMAT_PREFIX):
        return None
    sums = record.get("sha256")
    return set(sums) if isinstance(sums, dict) else None


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a directory (not a link) with a cpref `meta.json`, or a save's `DIR.tmp` being written
    (complete or not: see `cpref.train.checkpoint.read_meta` for whether it verifies)."""
    return path.is_dir() and not path.is_symlink() and (_summed(path) is not None or (path / MARK).is_file())


def foreign(path: Path) -> list[str]:
    """What under the directory `path` cpref did not write (relative paths, sorted; directories end in `/`).

    Everything, where `path` is neither a checkpoint nor a save in progress. In a save in progress
    (`MARK`, no `meta.json` yet) every plain file is taken for the save's payload.
    """
    summed = _summed(path)
    writing = summed is None and (path / MARK).is_file()
    own = set(NOT_SUMMED) | (summed or set())
    out = []
    for root, dirs, names in os.walk(path, followlinks=False):
        here = Path(root).relative_to(path)
        for d in list(dirs):
            rel = (here / d).as_posix()
            if (Path(root) / d).is_symlink() or not (writing or any(f.startswith(rel + "/") for f in own)):
                out.append(rel + "/")
                dirs.remove(d)  # not walked: the whole folder is the user's
        for name in names:
            rel, file = (here / name).as_posix(), Path(root) / name
            if file.is_symlink() or not file.is_file() or not (writing or summed is not None and rel in own):
                out.append(rel)
    return sorted(out)


def is_ours(path: Path, mark: str | None = None) -> bool:
    """Whether `path` is a directory cpref wrote and holds nothing else (and, given `mark`, carries it)."""
    if not is_checkpoint(path) or (mark is not None and not (path / mark).is_file()):
        return False
    return not foreign(path)


def _shown(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(directory: str | Path, *, pending: bool = False) -> Path:
    """Refuse a save target that a save could not write, or where it would replace or break what is not its own.

    Reads only (and one empty directory made and removed to prove the place writable), the same on
    every rank: call it before training starts. Returns the resolved path. `pending`: the save is
    about to be written (after training), so files of the user's in `DIR` do not stop it here: it
    writes `DIR.tmp` and [`swap`][cpref.train.checkpoint_files.swap] leaves `DIR` as it is, saying where
    the new checkpoint is.

    Raises:
        CPInputError: naming the path, what is wrong with it, and the fix (see the module docstring).
    """
    path = resolve(directory)
    try:
        return _check_target(path, directory, pending)
    except OSError as exc:  # a name too long for the filesystem (DIR.tmp's too), a folder that cannot be read
        raise CPInputError(f"cannot save a checkpoint to {path}: {type(exc).__name__}: {exc.strerror or exc} (for "
                           f"{exc.filename or path}); name another directory") from None  # fmt: skip


def _check_target(path: Path, directory: str | Path, pending: bool) -> Path:
    fix = "choose another directory to save into, or move it away"
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise CPInputError(f"cannot save a checkpoint to {directory!r} ({path}): it is the current directory or holds it, "
                           "and a save replaces its directory as a whole; name a directory inside it, e.g. ckpt")  # fmt: skip
    _check_place(path)
    if path.exists() or path.is_symlink():
        if path.is_symlink():
            raise CPInputError(f"cannot save a checkpoint to {path}: it is a link (to {os.readlink(path)}), and a save "
                               "would replace what it points to; name the directory itself, or another")  # fmt: skip
        if not path.is_dir():
            raise CPInputError(f"cannot save a checkpoint to {path}: it exists and is not a directory; {fix}")
        mine = foreign(path)
        if mine and not pending:
            what = "is a checkpoint but" if is_checkpoint(path) else "is not empty and not a cpref checkpoint:"
            raise CPInputError(f"cannot save a checkpoint to {path}: it {what} it holds {_shown(mine)}, which cpref did "
                               "not write; a save replaces only an empty directory or a checkpoint of cpref's files "
                               f"alone, and never deletes yours; {fix}")  # fmt: skip
    for sibling, mark in zip(siblings(path), (MARK, OLD_MARK)):
        if (sibling.exists() or sibling.is_symlink()) and not is_ours(sibling, mark):
            raise CPInputError(f"cannot save a checkpoint to {path}: {sibling} exists and was not written by cpref "
                               f"(a save uses that name for its own files, and deletes it); {fix}")  # fmt: skip
    return path


def _check_place(path: Path) -> None:
    """Refuse a target inside a checkpoint or named as a checkpoint's sibling, or where nothing can be written."""
    for parent in path.parents:
        if is_checkpoint(parent):
            raise CPInputError(f"cannot save a checkpoint to {path}: it is inside the checkpoint {parent}, which would "
                               "then hold files its sums do not list and no longer load; save beside it, not in it")  # fmt: skip
    for suffix in (".tmp", ".old"):
        if path.name.endswith(suffix) and is_checkpoint(path.with_name(path.name.removesuffix(suffix))):
            raise CPInputError(f"cannot save a checkpoint to {path}: that is the name a save of the checkpoint "
                               f"{path.with_name(path.name.removesuffix(suffix))} uses beside it; name another directory")  # fmt: skip
    place = path.parent
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        raise CPInputError(f"cannot save a checkpoint to {path}: {place} is a file, not a directory; name a directory "
                           "to save into")  # fmt: skip
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cpref-probe-", dir=place))
    except OSError as exc:
        raise CPInputError(f"cannot save a checkpoint to {path}: nothing can be written in {place} "
                           f"({type(exc).__name__}: {exc.strerror}); choose a directory you can write to") from None  # fmt: skip


def _remove(path: Path, mark: str) -> None:
    """Delete a sibling cpref left (it carries `mark` and holds nothing else); refuse anything else."""
    if path.exists() or path.is_symlink():
        if not is_ours(path, mark):  # checked before training; checked again at the moment of deleting
            raise CPInputError(f"{path} exists and was not written by cpref; it is left as it is: move it away")
        shutil.rmtree(path)


def _steps(paths, complete) -> tuple[dict[Path, int], list[str]]:
    """`{path: step}` of the complete checkpoints among `paths`, and what is wrong with the others."""
    found, problems = {}, []
    for p in paths:
        if p.exists():
            try:
                found[p] = complete(p)
            except CPInputError as exc:
                problems.append(f"{p}: {exc}")
    return found, problems


def _leftovers(path: Path) -> list[Path]:
    """The siblings of `path` that an interrupted save left, each carrying its mark."""
    return [p for p, mark in zip(siblings(path), (MARK, OLD_MARK)) if is_ours(p, mark)]


def recover(path: Path, complete: Callable[[Path], int]) -> None:
    """Finish a swap that a crash interrupted, then delete cpref's leftovers beside `path`.

    `complete(p)` returns the step of the complete, verified checkpoint at `p`, or raises
    `CPInputError`. Where `path` is missing, the newer complete one of `DIR.tmp` and `DIR.old`
    becomes `path`.
    """
    tmp, old = siblings(path)
    if not path.exists():
        found, _ = _steps(_leftovers(path), complete)
        if found:
            max(found, key=lambda p: found[p]).rename(path)
    for mark in (MARK, OLD_MARK):  # a mark left inside the checkpoint by a kill during the swap
        if path.is_dir() and (path / mark).is_file() and _summed(path) is not None:
            (path / mark).unlink()
    _remove(tmp, MARK)
    _remove(old, OLD_MARK)


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
    """Put the complete `DIR.tmp` in place of `DIR` (step 3 of the module docstring)."""
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
    if old.exists():
        _remove(old, OLD_MARK)


def _marked(path: Path, mark: str) -> bool:
    try:
        return (path / mark).is_file()
    except OSError:  # e.g. DIR.tmp of a DIR whose name is as long as the filesystem allows: it cannot exist
        return False


def find(directory: str | Path, complete: Callable[[Path], int]) -> tuple[Path, str | None]:
    """The checkpoint to resume from: `DIR` if complete, else the newest complete sibling a save left.

    Returns `(path, note)`; `note` says why a sibling was chosen (None for `DIR` itself).

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
    if path in found:
        return path, None
    if found:
        best = max(found, key=lambda p: found[p])
        return best, (f"{path} holds no complete checkpoint (a save was interrupted); resuming from {best}, "
                      f"the newest complete one (step {found[best]})")  # fmt: skip
    if not problems:
        raise CPInputError(f"no checkpoint to resume from at {path}: neither it nor a {tmp.name} or {old.name} that a "
                           "save left exists")  # fmt: skip
    raise CPInputError(f"no complete checkpoint to resume from at {path}: " + "; ".join(problems))
