"""Where a checkpoint lives on disk, and what a save may replace.

A checkpoint `DIR` is written beside itself and swapped into place, so that a crash at any
moment leaves a complete checkpoint somewhere:

1. `DIR.tmp` is **created exclusively** (`mkdir` without `exist_ok`) and marked as cpref's with a
   file `.cpref-save` before anything else goes in;
2. the payload, the RNG state and last `meta.json` are written into it; the mark is removed;
3. `DIR` (the previous checkpoint, if any) is renamed to `DIR.old`, `DIR.tmp` to `DIR`, and
   `DIR.old` is deleted.

A kill between the renames of step 3 leaves `DIR.old` and `DIR.tmp`, both complete, and no
`DIR`. The next save **recovers** first: it finishes the swap (the newer complete one becomes
`DIR`), and resuming picks the newest complete one of the three ([`find`][cpref.checkpoint_files.find]).

**A save never destroys what cpref did not write.** It replaces `DIR` only if `DIR` does not
exist, is an empty directory, or is a cpref checkpoint (its `meta.json` says so); it deletes a
sibling `DIR.tmp` or `DIR.old` only if it carries the mark or a cpref `meta.json`. Anything
else (a `notes.txt`, a `sub/` folder, a file named `DIR.old`) is refused by
[`check_target`][cpref.checkpoint_files.check_target], which a training run calls **before
its first step**, naming the path and the fix. Paths are resolved first, so `--save .` means
the current directory (refused unless it is empty or a checkpoint) and the filesystem root
is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from cpref.errors import CPInputError

__all__ = ["MARK", "FORMAT_PREFIX", "resolve", "siblings", "is_ours", "check_target", "claim", "swap", "recover",
           "find"]  # fmt: skip

MARK = ".cpref-save"  # inside DIR.tmp while a save is writing it
FORMAT_PREFIX = "cpref-checkpoint/"


def resolve(directory: str | Path) -> Path:
    """The absolute path of a checkpoint directory; `.` and `..` resolved, the root refused."""
    path = Path(directory).expanduser().resolve()
    if not path.name:
        raise CPInputError(f"checkpoint directory {str(directory)!r} is the filesystem root; name a directory to save into")
    return path


def siblings(path: Path) -> tuple[Path, Path]:
    """`(DIR.tmp, DIR.old)` of a resolved checkpoint directory."""
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def _meta_format(path: Path) -> str | None:
    try:
        record = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    fmt = record.get("format") if isinstance(record, dict) else None
    return fmt if isinstance(fmt, str) else None


def is_ours(path: Path) -> bool:
    """Whether `path` is a directory cpref wrote: a checkpoint (its `meta.json` names a cpref format)
    or a save in progress (it holds the mark)."""
    if not path.is_dir() or path.is_symlink():
        return False
    fmt = _meta_format(path)
    return (path / MARK).is_file() or (fmt is not None and fmt.startswith(FORMAT_PREFIX))


def _contents(path: Path, most: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(directory: str | Path) -> Path:
    """Refuse a save target that holds anything but an empty directory or cpref's own files.

    Pure reads, the same on every rank: call it before training starts. Returns the resolved path.

    Raises:
        CPInputError: naming the path, what it holds, and the fix.
    """
    path = resolve(directory)
    fix = "choose another directory to save into, or move it away"
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise CPInputError(f"cannot save a checkpoint to {directory!r} ({path}): it is the current directory or holds it, "
                           "and a save replaces its directory as a whole; name a directory inside it, e.g. ckpt")  # fmt: skip
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise CPInputError(f"cannot save a checkpoint to {path}: it exists and is not a directory; {fix}")
        if any(path.iterdir()) and not is_ours(path):
            raise CPInputError(
                f"cannot save a checkpoint to {path}: it is not empty and not a cpref checkpoint (it holds "
                f"{_contents(path)}); a save replaces only an empty directory or a checkpoint; {fix}"
            )
    for sibling in siblings(path):
        if (sibling.exists() or sibling.is_symlink()) and not is_ours(sibling):
            raise CPInputError(
                f"cannot save a checkpoint to {path}: {sibling} exists and was not written by cpref (a save "
                f"uses that name for its own files); {fix}"
            )
    return path


def _remove_ours(path: Path) -> None:
    if path.exists() or path.is_symlink():
        if not is_ours(path):  # checked before training; checked again at the moment of deleting
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
                problems.append(f"  {p}: {exc}")
    return found, problems


def recover(path: Path, complete: Callable[[Path], int]) -> None:
    """Finish a swap that a crash interrupted, then delete cpref's leftovers beside `path`.

    `complete(p)` returns the step of the complete, verified checkpoint at `p`, or raises
    `CPInputError`. Where `path` is missing, the newer complete one of `DIR.tmp` and `DIR.old`
    becomes `path`.
    """
    tmp, old = siblings(path)
    if not path.exists():
        found, _ = _steps([p for p in (tmp, old) if is_ours(p)], complete)
        if found:
            max(found, key=lambda p: found[p]).rename(path)
    _remove_ours(tmp)
    _remove_ours(old)


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
    (tmp / MARK).unlink()
    if path.exists():
        path.rename(old)
    tmp.rename(path)  # the new checkpoint appears complete, or not at all
    if old.exists():
        shutil.rmtree(old)


def find(directory: str | Path, complete: Callable[[Path], int]) -> tuple[Path, str | None]:
    """The checkpoint to resume from: `DIR` if complete, else the newest complete sibling.

    Returns `(path, note)`; `note` says why a sibling was chosen (None for `DIR` itself).

    Raises:
        CPInputError: if none of `DIR`, `DIR.tmp`, `DIR.old` holds a complete checkpoint, with
            what is wrong with each.
    """
    path = resolve(directory)
    tmp, old = siblings(path)
    found, problems = _steps((path, tmp, old), complete)
    if path in found:
        return path, None
    if found:
        best = max(found, key=lambda p: found[p])
        return best, (f"{path} holds no complete checkpoint (a save was interrupted); resuming from {best}, "
                      f"the newest complete one (step {found[best]})")  # fmt: skip
    if not problems:
        raise CPInputError(f"no checkpoint to resume from at {path}: neither it nor {tmp.name} nor {old.name} exists")
    raise CPInputError(f"no complete checkpoint to resume from at {path}:\n" + "\n".join(problems))
