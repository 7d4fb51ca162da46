"""Where a checkpoint lives on disk, and what a save may replace.

A checkpoint `DIR` is written beside itself and swapped into place
([a save a crash cannot lose][cpref.train.checkpoint_swap]), so a save uses three names beside `DIR`:
`DIR.tmp` (the new checkpoint being written), `DIR.old` (the previous one, while it is
replaced) and `DIR.lock` (the [lock][cpref.train.checkpoint_lock] a run holds while it may save there).

**A save never deletes, moves or overwrites a file it did not write.** cpref's files are the
ones a checkpoint's `meta.json` lists in its sums, `meta.json` itself, and its two marks;
anything else (a `notes.txt`, a `sub/` folder, a link) is the user's. A save replaces `DIR`
only if `DIR` does not exist, is an empty directory, or is a cpref checkpoint that holds
nothing but cpref's files; it deletes a sibling `DIR.tmp` or `DIR.old` only if it carries the
mark cpref put there for that purpose (`.cpref-save`, `.cpref-old`), so a user's copy named
`DIR.old` is never taken for a leftover. A sibling whose deletion was interrupted is still
recognised: cpref deletes a directory's mark last, so what is left is a marked subset of its
files, the mark alone, or an empty directory. [`check_target`][cpref.train.checkpoint_files.check_target],
which a training run calls **before its first step**, refuses every other target in one line
naming the path and the fix:

* a target that holds files cpref did not write, or beside a `DIR.tmp` / `DIR.old` that is
  not a save's own, or a `DIR.lock` that is not cpref's lock file;
* a target that is a link (to a folder, a file or nothing): a save would replace what it points to,
  perhaps another checkpoint, so only the link's name is resolved, never the link;
* a target **inside a checkpoint** (saving there would add files that checkpoint's sums do not
  list: it would no longer load), or named as another checkpoint's `.tmp`, `.old` or `.lock`;
* a target that cannot be written: under a file, in a directory this process may not write
  to (checked by creating and removing an empty directory there), with a name (or a `DIR.tmp`
  beside it) too long for the filesystem, or a `DIR` (or a leftover of cpref's beside it, or a
  folder in either) that this process may not change, being read-only, immutable or another
  user's: a save writes its mark into `DIR` and deletes the previous checkpoint's files;
* the current directory or one holding it, and the filesystem root.

The same ownership is checked again at the moment of each deletion: a file that appeared in
`DIR` during training stops the save with the new checkpoint complete in `DIR.tmp`, and `DIR`
untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from cpref.base.errors import CPInputError

__all__ = ["MARK", "OLD_MARK", "LOCK_HEADER", "FORMAT_PREFIX", "resolve", "siblings", "lock_file", "foreign",
           "is_checkpoint", "is_ours", "is_our_lock", "check_target"]  # fmt: skip

MARK = ".cpref-save"  # inside DIR.tmp while a save is writing it
OLD_MARK = ".cpref-old"  # inside DIR.old, the previous checkpoint a save is replacing
LOCK_HEADER = "cpref checkpoint lock"  # how a DIR.lock that cpref wrote begins
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


def lock_file(path: Path) -> Path:
    """`DIR.lock`, the file a run saving to the resolved checkpoint directory `path` locks."""
    return path.with_name(path.name + ".lock")


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


def _emptied(path: Path, mark: str) -> bool:
    """Whether `path` is a directory that holds nothing but, perhaps, `mark` and empty folders: what a deletion
    of cpref's (mark last, then the directory) leaves where it was interrupted."""
    if not path.is_dir() or path.is_symlink():
        return False
    for root, dirs, names in os.walk(path, followlinks=False):
        if any((Path(root) / d).is_symlink() for d in dirs) or any(Path(root, n) != path / mark for n in names):
            return False
    return not (path / mark).is_symlink()


def is_ours(path: Path, mark: str | None = None) -> bool:
    """Whether `path` is a directory cpref wrote and holds nothing else (and, given `mark`, carries it).

    Given `mark`, also a directory left by an interrupted deletion of cpref's: the mark alone, or empty.
    """
    if mark is not None and _emptied(path, mark):
        return True
    if not is_checkpoint(path) or (mark is not None and not (path / mark).is_file()):
        return False
    return not foreign(path)


def is_our_lock(file: Path) -> bool:
    """Whether `DIR.lock` is absent or cpref's: a plain file, empty or beginning with `LOCK_HEADER`."""
    if not (file.exists() or file.is_symlink()):
        return True
    if file.is_symlink() or not file.is_file():
        return False
    try:
        with open(file, "rb") as f:
            head = f.read(len(LOCK_HEADER))
    except OSError:
        return False
    return head in (b"", LOCK_HEADER.encode())


def _shown(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(directory: str | Path, *, pending: bool = False) -> Path:
    """Refuse a save target that a save could not write, or where it would replace or break what is not its own.

    Reads only (and one empty directory made and removed to prove the place writable), the same on
    every rank: call it before training starts. Returns the resolved path. `pending`: the save is
    about to be written (after training), so files of the user's in `DIR` do not stop it here: it
    writes `DIR.tmp` and [`swap`][cpref.train.checkpoint_swap.swap] leaves `DIR` as it is, saying where
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
    if not is_our_lock(lock_file(path)):
        raise CPInputError(f"cannot save a checkpoint to {path}: {lock_file(path)} exists and is not cpref's lock file "
                           f"(a save locks that name, and writes into it); {fix}")  # fmt: skip
    for d in (path, *siblings(path)):
        _check_changeable(path, d)
    return path


def _check_changeable(path: Path, directory: Path) -> None:
    """Refuse where this process may not add or delete files in `directory` or a folder in it (read-only, immutable)."""
    if not directory.is_dir() or directory.is_symlink() or directory == path and foreign(path):
        return  # nothing there, or files of the user's in DIR: the swap leaves DIR as it is
    for root, _, _ in os.walk(directory, followlinks=False):
        if not os.access(root, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            raise CPInputError(f"cannot save a checkpoint to {path}: this process may not change {root} (read-only, "
                               "immutable, or another user's), and a save writes its mark into the checkpoint there and "
                               f"deletes the previous one's files; make it writable (chmod u+w, chattr -i) or save "
                               "elsewhere")  # fmt: skip


def _check_place(path: Path) -> None:
    """Refuse a target inside a checkpoint or named as a checkpoint's sibling, or where nothing can be written."""
    for parent in path.parents:
        if is_checkpoint(parent):
            raise CPInputError(f"cannot save a checkpoint to {path}: it is inside the checkpoint {parent}, which would "
                               "then hold files its sums do not list and no longer load; save beside it, not in it")  # fmt: skip
    for suffix in (".tmp", ".old", ".lock"):
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
