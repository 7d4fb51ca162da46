"""Checkpoints that resume a run exactly, at another CP size if need be.

A checkpoint is a directory: `meta.json` (what the run was: step, DP and CP sizes, mode,
layout, micro-batches, the model config, the training settings, the payload format, the dtypes
of the model's state, and SHA-256 sums of every payload file and of every one of these fields:
[what a checkpoint records][cpref.train.checkpoint_meta]) and the payload: the
model's and the optimizer's state and the RNG state. Under CP every rank holds the same
replica, so the payload is written **once**: by rank 0 with `torch.save` on the simulated
cluster (`TorchPayload`, format `"torch"`), or with `torch.distributed.checkpoint` on real
process groups (`cpref.train.dcp.DcpPayload`, format `"dcp"`). A payload says which
formats it reads (`formats`): `DcpPayload` reads both, and so does the simulated cluster's
`cpref.train.dcp.LocalPayload`, so a simulated-cluster checkpoint resumes on gloo and
the other way round; a payload that cannot read a checkpoint's format is refused naming both.

**Resuming at another CP size** needs nothing special: CP splits the sequence, never the
parameters, so the same state fits any `cp` (and any mode or layout). What must match is the
model (its config, hence every shape) and the number of packs per step (`dp x micro_batches`),
because the data position is counted in steps; and every training setting that changes the run
(`settings`: learning rate, clipping, precision, pack size) matches, or is named in
`override`; and the model's tensors have the checkpoint's dtypes (a bfloat16 model would get
every float32 weight and Adam moment cast without a word), unless `override` names `"dtype"`.
A checkpoint that does not fit is refused before anything is loaded, with an error naming each
setting (or dtype) and both values.

**Nothing is overwritten by a failure, nothing foreign is deleted** ([where checkpoints
live](checkpoint-files.md)): a save writes `DIR.tmp` and swaps it into place, replaces only an
empty directory or a cpref checkpoint of cpref's files alone, replaces a checkpoint only if the
run continues it (it resumed from it, or saved it itself) and moves its step forward, unless
told to (`overwrite=True`, and even then only cpref's own files go), and never saves inside a
checkpoint or where it cannot write: all of it refused before the first step. One run at a time
saves into a directory ([the save lock][cpref.train.checkpoint_lock]): a second run is refused before its
first step. A save that fails (a full disk) says so in one line on every rank, deletes its
partial `DIR.tmp` and leaves `DIR` as it was ([when a save fails][cpref.train.checkpoint_errors]); a
save interrupted anywhere leaves a complete checkpoint that resuming finds and the next save
puts in place ([a save a crash cannot lose][cpref.train.checkpoint_swap]). Loading checks the SHA-256
sum of every file and every field of `meta.json`, naming the first that differs, and every
tensor's shape and dtype, before it touches the model or the optimizer.

**Loading never runs code from the checkpoint.** `meta.json` is JSON; `state.pt` and `rng.pt`
are read with `torch.load(weights_only=True)`; a DCP checkpoint's `.metadata` is read by an
unpickler that admits only the classes DCP's metadata is made of, and its non-tensor items
with `weights_only=True` (`cpref.train.dcp`). The sums are no defence against a
deliberate edit (anyone can recompute them); the restricted readers are.

**How it is tested** (`tests/training/test_checkpoint_safety.py`, `test_checkpoint_targets.py`,
`test_checkpoint.py`, `test_gloo_resume.py`, `test_gloo_training.py`): foreign files and siblings
are refused before the first step and left byte for byte (a fuzz over directory states: user
files and folders, links, a save's leftovers and the user's copies, nested targets, truncated and
edited files); a kill between the renames, and an incomplete `DIR.tmp`,
resume from the newest complete checkpoint; a crash at a random step with `save_every` resumes
bit for bit, and `kill -9` of a gloo run at a random step resumes to the last printed digit;
every setting that differs is refused naming both values, and `override` applies and prints
it; a model of another dtype is refused naming both, in either format, and cast only under
`override` (`test_checkpoint_dtype.py`); an edited field or file is named; a `__reduce__` trap
in every file of both formats, with the sums recomputed, runs no code; each format resumes under
the other payload.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Protocol

import torch

from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as files
from cpref.train import checkpoint_swap as swap
from cpref.train.checkpoint_errors import agree, explain, free_bytes, state_bytes
from cpref.train.checkpoint_lock import SaveLock, hold
from cpref.train.checkpoint_meta import (
    CheckpointMeta,
    check_dtypes,
    check_fits,
    dtypes_of,
    meta_json,
    overridden,
    read_meta,
)

__all__ = ["CheckpointMeta", "Payload", "TorchPayload", "save_checkpoint", "load_checkpoint", "read_meta",
           "find_checkpoint", "check_save", "check_fits", "overridden"]  # fmt: skip


class Payload(Protocol):
    """How the model's and optimizer's state are written and read (collective over the world group)."""

    name: str  # the format it writes: "torch" or "dcp"
    formats: tuple[str, ...]  # the formats its `load` reads

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Write the model's and optimizer's state into `directory` (every rank of `world` calls it)."""
        ...

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read them back into `model` and `optimizer`, checking every tensor's shape (and, unless called with
        `cast=True`, dtype: [`check_dtypes`][cpref.train.checkpoint_meta.check_dtypes]) first."""
        ...


class TorchPayload:
    """`torch.save` by world rank 0 (the simulated cluster, or one process); `weights_only` loading."""

    name = "torch"
    formats = ("torch",)

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Rank 0 writes `state.pt`; the other ranks only wait for it."""
        if world.rank == 0:
            _save(directory / "state.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             cast: bool = False) -> None:  # fmt: skip
        """Read `state.pt` with `weights_only=True` (no code runs from a checkpoint), check every shape and
        (unless `cast`) dtype, load."""
        state = _load_weights(directory, "state.pt")
        for name, tensor in model.state_dict().items():
            got = state["model"].get(name)
            if got is None or got.shape != tensor.shape:
                shape = None if got is None else tuple(got.shape)
                raise CPInputError(f"checkpoint {directory}: parameter {name} is {shape}, the model has {tuple(tensor.shape)}")
        if not cast:
            check_dtypes(str(directory), _torch_dtypes(state, model, optimizer))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _torch_dtypes(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple]:
    """`(name, saved dtype, live dtype)` of the model's tensors and of the optimizer's state (its moments take
    their parameter's dtype on loading: `torch.optim.Optimizer.load_state_dict`)."""
    for name, tensor in model.state_dict().items():
        yield name, state["model"][name].dtype, tensor.dtype
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, moments in state["optimizer"].get("state", {}).items():
        for key, value in moments.items() if isinstance(i, int) and i < len(params) else ():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                yield f"the optimizer's {key} of {names.get(id(params[i]), i)}", value.dtype, params[i].dtype


def _save(file: Path, obj: Any) -> None:
    with open(file, "wb") as f:  # through Python's file: a full disk is an OSError in the chain, not only torch's words
        try:
            torch.save(obj, f)
        except Exception as exc:
            if isinstance(exc.__context__, OSError) and exc.__context__.filename is None:
                exc.__context__.filename = str(file)  # the file it was writing, for the message
            raise


def _load_weights(directory: Path, name: str) -> Any:
    try:
        return torch.load(directory / name, weights_only=True)
    except Exception as exc:  # a truncated or foreign file, or one that would run code
        why = " ".join(str(exc).split())  # one line: torch's unpickling errors run over paragraphs
        raise CPInputError(f"checkpoint {directory}: {name} cannot be read ({type(exc).__name__}: {why:.300})") from None


FORMATS = {"torch": "torch.save, written on the simulated cluster or one process",
           "dcp": "torch.distributed.checkpoint, written on real process groups"}  # fmt: skip


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: CheckpointMeta,
                    world: Any, payload: Payload | None = None, *, overwrite: bool = False,
                    resumed: str | Path | None = None, lock: SaveLock | None = None) -> Path:  # fmt: skip
    """Write a checkpoint of this replica (collective over `world`); returns its directory.

    `resumed` is the checkpoint this run continues (the one it resumed from, or its own last save):
    a checkpoint there may be replaced by a later step; any other needs `overwrite`. `lock` is the
    run's lock on `directory` ([`hold`][cpref.train.checkpoint_lock.hold], as `train` takes it for
    the whole run); None: the save takes it for its own duration. `meta.payload` and `meta.dtype`
    are recorded as the payload and the model are.

    Raises:
        CPInputError: on every rank alike, before anything is written, if `directory` holds
            anything but cpref's own files, a checkpoint this run does not continue (unless
            `overwrite`) or one at `meta.step` or later, see [`check_save`][cpref.train.checkpoint.check_save],
            or if another run holds its lock.
        CheckpointWriteError: on every rank alike, if the checkpoint could not be written (a full
            disk: [`checkpoint_errors`][cpref.train.checkpoint_errors]); a partial `DIR.tmp` is
            deleted and `DIR` is as it was.
    """
    payload = payload or TorchPayload()
    path = check_save(directory, meta.step, overwrite=overwrite, resumed=resumed, pending=True)
    if lock is not None and lock.path != path:
        raise CPInputError(f"save_checkpoint(lock=...) holds {lock.path}, but the save goes to {path}; pass the lock "
                           "of the directory saved to, or none")  # fmt: skip
    # the run's lock, or one for this save (its file made only beside a target checked above)
    with contextlib.nullcontext() if lock is not None else hold(path, world):
        world.barrier()  # every rank has checked before rank 0 changes anything
        _write(path, model, optimizer, replace(meta, payload=payload.name, dtype=dtypes_of(model)), world, payload)
    return path


def _write(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: CheckpointMeta, world: Any,
           payload: Payload) -> None:  # fmt: skip
    """The save's three steps ([`checkpoint_swap`][cpref.train.checkpoint_swap]), each agreed by every rank."""
    tmp, step = files.siblings(path)[0], meta.step
    need, free = state_bytes(model, optimizer), free_bytes(path.parent)
    failed = f"could not write the checkpoint of step {step} to {tmp}"
    # 1) rank 0 finishes what an interrupted save left, and claims DIR.tmp
    _on_rank0(world, lambda: (swap.recover(path, _step), swap.claim(path)),
              f"could not begin the save of step {step} beside {path}", f"{path} is as it was")  # fmt: skip
    # 2) the payload (every rank) and the RNG state (rank 0); a failure deletes the partial DIR.tmp
    error = None
    try:
        payload.save(tmp, model, optimizer, world)
        if world.rank == 0:
            _save(tmp / "rng.pt", torch.get_rng_state())  # every replica draws the same numbers
    except Exception as exc:  # noqa: BLE001 -- raised on every rank below, in one line
        error = explain(exc, failed, f"{path} is as it was", need, free, path.parent)
    agree(world, error, cleanup=lambda: _discard(path) if world.rank == 0 else None)

    # 3) rank 0, once every rank's files are there: meta.json, summing them, last; then the swap
    def finish() -> None:
        try:
            (tmp / "meta.json").write_text(meta_json(meta, tmp))
        except Exception as exc:
            error = explain(exc, failed, f"{path} is as it was", need, free, path.parent)
            _discard(path)
            raise error from exc
        try:
            swap.swap(path)
        except Exception as exc:
            raise explain(exc, f"the checkpoint of step {step} is complete in {tmp}, but could not be put in place of "
                          f"{path}", f"resuming from {path} takes it (the newest complete one there), and the next "
                          "save finishes the swap") from exc  # fmt: skip
        try:
            swap.drop_old(path)
        except Exception as exc:
            raise explain(exc, f"the checkpoint of step {step} is in place in {path}, but the previous one in "
                          f"{files.siblings(path)[1]} could not be deleted", "the next save deletes it") from exc  # fmt: skip

    _on_rank0(world, finish)  # each of its failures says itself what is where


def _on_rank0(world: Any, step: Callable[[], Any], what: str = "", kept: str = "") -> None:
    """Run `step` on world rank 0; if it fails, every rank raises the same one-line error (`what` failed, `kept` is as
    it was: see `explain`; a `CPInputError` of the step's own is raised as it is)."""
    error = None
    if world.rank == 0:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 -- raised on every rank by agree
            error = explain(exc, what, kept)
    agree(world, error)


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError, CPInputError):  # else the next save deletes it: it carries the save's mark
        swap.discard(path)


def _step(path: Path) -> int:
    return read_meta(path).step


def check_save(directory: str | Path, first_step: int, *, overwrite: bool = False,
               resumed: str | Path | None = None, pending: bool = False) -> Path:  # fmt: skip
    """Refuse a save target before training: one a save could not write, or where it would replace what is not its own.

    Besides [`check_target`][cpref.train.checkpoint_files.check_target]'s refusals: a checkpoint there (or
    beside it, left by an interrupted save) that this run does not continue (`resumed` names the
    checkpoint it resumed from), one there that does not verify (damaged or edited), or one at
    `first_step` or later; `overwrite` replaces any of them deliberately, and even then only cpref's
    own files go. Pure reads, the same on every rank. Returns the resolved directory (`pending`:
    see `check_target`).
    """
    path = files.check_target(directory, pending=pending)
    candidates, steps, problems = (path, *files.siblings(path)), {}, {}
    for p in candidates:
        try:
            steps[p] = read_meta(p).step
        except CPInputError as exc:
            problems[p] = str(exc)
    continued = resumed is not None and files.resolve(resumed) in candidates
    if overwrite:
        return path
    if files.is_checkpoint(path) and path not in steps and not continued:  # damaged, or edited: still not the save's
        raise CPInputError(
            f"{path} holds a checkpoint that does not verify ({problems[path]}); a save would replace it. Move it "
            "away, or replace it deliberately (--overwrite, overwrite=True)"
        )
    if not steps:
        return path
    newest = max(steps, key=lambda p: (steps[p], p == path))
    held = f"{path} holds a checkpoint at step {steps[newest]}" + ("" if newest == path else f" (in {newest.name}, "
                                                                   "left by an interrupted save)")  # fmt: skip
    if steps[newest] >= first_step:
        raise CPInputError(
            f"{held}; saving step {first_step} there would not move it forward. Resume from it (--resume {path}) and "
            f"train past step {steps[newest]}, save elsewhere, or replace it deliberately (--overwrite, overwrite=True)"
        )
    if not continued:
        raise CPInputError(
            f"{held} that this run does not continue (it did not resume from it); a save would replace it. Resume from "
            f"it (--resume {path}), save elsewhere, or replace it deliberately (--overwrite, overwrite=True)"
        )
    return path


def find_checkpoint(directory: str | Path) -> tuple[Path, CheckpointMeta, str | None]:
    """The newest complete checkpoint of `directory` and the siblings an interrupted save left.

    Returns `(path, meta, note)`; `note` says which sibling was chosen and why (None for `directory`).
    """
    path, note = swap.find(directory, _step)
    return path, read_meta(path), note


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    expect: CheckpointMeta, payload: Payload | None = None,
                    override: Collection[str] = ()) -> CheckpointMeta:  # fmt: skip
    """Restore model, optimizer and RNG from a checkpoint that fits the run `expect` describes.

    A setting named in `override` may differ (the run's value wins: an overridden `"lr"` is set
    in every parameter group after loading); `"dtype"` in `override` casts the checkpoint's
    tensors into `model`'s dtypes (else another dtype is refused); `model` and packs per step may not.

    Raises:
        CPInputError: naming the mismatch (model config, packs per step, each setting with both
            values, dtypes), a corrupt file or a tensor of another shape; the model and optimizer
            are untouched then.
    """
    directory, payload = Path(directory), payload or TorchPayload()
    meta = read_meta(directory)
    check_fits(meta, replace(expect, dtype=dtypes_of(model)), override, str(directory))
    if meta.payload not in payload.formats:
        raise CPInputError(
            f"checkpoint {directory} holds the {meta.payload!r} format ({FORMATS.get(meta.payload, 'unknown')}); this "
            f"run's {type(payload).__name__} reads {' and '.join(repr(f) for f in payload.formats)} only: load it with "
            "cpref.train.dcp.DcpPayload or LocalPayload, which read both"
        )
    if "dtype" in override:
        payload.load(directory, model, optimizer, cast=True)  # type: ignore[call-arg]
    else:
        payload.load(directory, model, optimizer)
    torch.set_rng_state(_load_weights(directory, "rng.pt"))
    if "lr" in override:
        for group in optimizer.param_groups:
            group["lr"] = expect.settings["lr"]
    return meta
