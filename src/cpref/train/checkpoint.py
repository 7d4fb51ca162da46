"""Checkpoints that resume a run exactly, at another CP size if need be.

A checkpoint is a directory: `meta.json` (what the run was: step, DP and CP sizes, mode,
layout, micro-batches, the model config, the training settings, the payload format, and
SHA-256 sums of every payload file and of every one of these fields) and the payload: the
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
`override`. A checkpoint that does not fit is refused before anything is loaded, with an error
naming each setting and both values.

**Nothing is overwritten by a failure, nothing foreign is deleted** ([where checkpoints
live](checkpoint-files.md)): a save writes `DIR.tmp` and swaps it into place, replaces only an
empty directory or a cpref checkpoint of cpref's files alone, replaces a checkpoint only if the
run continues it (it resumed from it, or saved it itself) and moves its step forward, unless
told to (`overwrite=True`, and even then only cpref's own files go), and never saves inside a
checkpoint or where it cannot write: all of it refused before the first step. Loading checks the SHA-256 sum of every file and every field of
`meta.json`, naming the first that differs, and every tensor shape, before it touches the
model or the optimizer.

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
it; an edited field or file is named; a `__reduce__` trap in every file of both formats, with
the sums recomputed, runs no code; each format resumes under the other payload.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Collection, Protocol

import torch

from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as files

__all__ = ["CheckpointMeta", "Payload", "TorchPayload", "save_checkpoint", "load_checkpoint", "read_meta",
           "find_checkpoint", "check_save"]  # fmt: skip

FORMAT = "cpref-checkpoint/2"


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about its run (`meta.json`).

    Attributes:
        step: steps trained; a resumed run starts at this step.
        dp, cp, mode, layout, micro_batches: how it was trained (`cp`, `mode`, `layout` may change on resume).
        model: the model config (every shape follows from it).
        settings: the training settings that change the run, e.g. `{"lr": 3e-3, "pack_tokens": 512}`.
        payload: the payload format, `"torch"` or `"dcp"`.
    """

    step: int
    dp: int
    cp: int
    mode: str
    layout: str
    micro_batches: int
    model: dict
    settings: dict = field(default_factory=dict)
    payload: str = "torch"

    @property
    def packs_per_step(self) -> int:
        """Packs consumed per step by the whole run: the data position is `step * packs_per_step`."""
        return self.dp * self.micro_batches


class Payload(Protocol):
    """How the model's and optimizer's state are written and read (collective over the world group)."""

    name: str  # the format it writes: "torch" or "dcp"
    formats: tuple[str, ...]  # the formats its `load` reads

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Write the model's and optimizer's state into `directory` (every rank of `world` calls it)."""
        ...

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read them back into `model` and `optimizer`, checking every tensor's shape first."""
        ...


class TorchPayload:
    """`torch.save` by world rank 0 (the simulated cluster, or one process); `weights_only` loading."""

    name = "torch"
    formats = ("torch",)

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Rank 0 writes `state.pt`; the other ranks only wait for it."""
        if world.rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read `state.pt` with `weights_only=True` (no code runs from a checkpoint), check every shape, load."""
        state = _load_weights(directory, "state.pt")
        for name, tensor in model.state_dict().items():
            got = state["model"].get(name)
            if got is None or got.shape != tensor.shape:
                shape = None if got is None else tuple(got.shape)
                raise CPInputError(f"checkpoint {directory}: parameter {name} is {shape}, the model has {tuple(tensor.shape)}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _load_weights(directory: Path, name: str) -> Any:
    try:
        return torch.load(directory / name, weights_only=True)
    except Exception as exc:  # a truncated or foreign file, or one that would run code
        why = " ".join(str(exc).split())  # one line: torch's unpickling errors run over paragraphs
        raise CPInputError(f"checkpoint {directory}: {name} cannot be read ({type(exc).__name__}: {why:.300})") from None


FORMATS = {"torch": "torch.save, written on the simulated cluster or one process",
           "dcp": "torch.distributed.checkpoint, written on real process groups"}  # fmt: skip


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sums(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): _sha(p.read_bytes()) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.relative_to(directory).as_posix() not in files.NOT_SUMMED}  # fmt: skip


def _field_sums(record: dict) -> dict[str, str]:
    return {k: _sha(json.dumps(v, sort_keys=True).encode()) for k, v in record.items()}


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: CheckpointMeta,
                    world: Any, payload: Payload | None = None, *, overwrite: bool = False,
                    resumed: str | Path | None = None) -> Path:  # fmt: skip
    """Write a checkpoint of this replica (collective over `world`); returns its directory.

    `resumed` is the checkpoint this run continues (the one it resumed from, or its own last save):
    a checkpoint there may be replaced by a later step; any other needs `overwrite`.

    Raises:
        CPInputError: on every rank alike, before anything is written, if `directory` holds
            anything but cpref's own files, a checkpoint this run does not continue (unless
            `overwrite`) or one at `meta.step` or later, see [`check_save`][cpref.train.checkpoint.check_save].
    """
    payload = payload or TorchPayload()
    path = check_save(directory, meta.step, overwrite=overwrite, resumed=resumed, pending=True)
    world.barrier()  # every rank has checked before rank 0 changes anything
    if world.rank == 0:
        files.recover(path, lambda p: read_meta(p).step)
        files.claim(path)
    world.barrier()
    tmp = files.siblings(path)[0]
    payload.save(tmp, model, optimizer, world)
    if world.rank == 0:
        torch.save(torch.get_rng_state(), tmp / "rng.pt")  # every replica draws the same numbers
    world.barrier()
    if world.rank == 0:
        record = {**asdict(meta), "payload": payload.name}
        sums = {"format": FORMAT, "sha256": _file_sums(tmp), "fields_sha256": _field_sums(record)}
        (tmp / "meta.json").write_text(json.dumps({**record, **sums}, indent=1, sort_keys=True))
        files.swap(path)
    world.barrier()
    return path


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
    problems = {p: _problem(p) for p in (path, *files.siblings(path))}
    held = [p for p, problem in problems.items() if problem is None]
    continued = resumed is not None and files.resolve(resumed) in problems
    if overwrite:
        return path
    if files.is_checkpoint(path) and path not in held and not continued:  # damaged, or edited: still not the save's
        raise CPInputError(
            f"{path} holds a checkpoint that does not verify ({problems[path]}); a save would replace it. Move it "
            "away, or replace it deliberately (--overwrite, overwrite=True)"
        )
    newest = max((read_meta(p).step for p in held), default=None)
    if newest is None:
        return path
    if newest >= first_step:
        raise CPInputError(
            f"{path} holds a checkpoint at step {newest}; saving step {first_step} there would not move it forward. "
            f"Resume from it (--resume {path}) and train past step {newest}, save elsewhere, or replace it "
            "deliberately (--overwrite, overwrite=True)"
        )
    if not continued:
        raise CPInputError(
            f"{path} holds a checkpoint at step {newest} that this run does not continue (it did not resume from it); "
            f"a save would replace it. Resume from it (--resume {path}), save elsewhere, or replace it deliberately "
            "(--overwrite, overwrite=True)"
        )
    return path


def _problem(path: Path) -> str | None:
    """Why `path` holds no complete checkpoint, or None where it holds one."""
    try:
        read_meta(path)
    except CPInputError as exc:
        return str(exc)
    return None


def read_meta(directory: str | Path) -> CheckpointMeta:
    """The metadata of a checkpoint, checked for format and for the integrity of its fields and files.

    Raises:
        CPInputError: naming the field or file whose SHA-256 sum differs, a missing or unknown
            field, or another format.
    """
    directory = Path(directory)
    try:
        record = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CPInputError(f"checkpoint {directory}: no readable meta.json ({type(exc).__name__}: {exc})") from None
    fmt = record.pop("format", None) if isinstance(record, dict) else None
    if fmt != FORMAT:
        raise CPInputError(f"checkpoint {directory}: not a {FORMAT} checkpoint (its meta.json says format {fmt!r})")
    file_sums, field_sums = record.pop("sha256", None), record.pop("fields_sha256", None)
    if not isinstance(file_sums, dict) or not isinstance(field_sums, dict):
        raise CPInputError(f"checkpoint {directory}: meta.json has no SHA-256 sums (edited, or not written by cpref)")
    names = {f.name for f in fields(CheckpointMeta)}
    if set(record) != names:
        raise CPInputError(f"checkpoint {directory}: meta.json has the fields {sorted(record)}, expected {sorted(names)} "
                           "(written by another version of cpref, or edited)")  # fmt: skip
    _compare_sums(directory, "meta.json field", field_sums, _field_sums(record))
    _compare_sums(directory, "file", file_sums, _file_sums(directory))
    return CheckpointMeta(**record)


def _compare_sums(directory: Path, what: str, recorded: dict, actual: dict) -> None:
    differ = sorted(k for k in set(recorded) | set(actual) if recorded.get(k) != actual.get(k))
    if differ:
        how = {k: "missing" if k not in actual else "not in the sums" if k not in recorded else "SHA-256 differs"
               for k in differ}  # fmt: skip
        raise CPInputError(
            f"checkpoint {directory}: its {what}s do not match the SHA-256 sums in meta.json (corrupt or edited): "
            + ", ".join(f"{k} ({v})" for k, v in how.items())
        )


def find_checkpoint(directory: str | Path) -> tuple[Path, CheckpointMeta, str | None]:
    """The complete checkpoint at `directory`, or its newest complete sibling after an interrupted save.

    Returns `(path, meta, note)`; `note` says which sibling was chosen and why (None for `directory`).
    """
    path, note = files.find(directory, lambda p: read_meta(p).step)
    return path, read_meta(path), note


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    expect: CheckpointMeta, payload: Payload | None = None,
                    override: Collection[str] = ()) -> CheckpointMeta:  # fmt: skip
    """Restore model, optimizer and RNG from a checkpoint that fits the run `expect` describes.

    A setting named in `override` may differ (the run's value wins: an overridden `"lr"` is set
    in every parameter group after loading); `model` and packs per step may not.

    Raises:
        CPInputError: naming the mismatch (model config, packs per step, each setting with both
            values), a corrupt file or a tensor of another shape; the model and optimizer are
            untouched then.
    """
    directory, payload = Path(directory), payload or TorchPayload()
    meta = read_meta(directory)
    check_fits(meta, expect, override, str(directory))
    if meta.payload not in payload.formats:
        raise CPInputError(
            f"checkpoint {directory} holds the {meta.payload!r} format ({FORMATS.get(meta.payload, 'unknown')}); this "
            f"run's {type(payload).__name__} reads {' and '.join(repr(f) for f in payload.formats)} only: load it with "
            "cpref.train.dcp.DcpPayload or LocalPayload, which read both"
        )
    payload.load(directory, model, optimizer)
    torch.set_rng_state(_load_weights(directory, "rng.pt"))
    if "lr" in override:
        for group in optimizer.param_groups:
            group["lr"] = expect.settings["lr"]
    return meta


def check_fits(meta: CheckpointMeta, expect: CheckpointMeta, override: Collection[str] = (), where: str = "") -> None:
    """Raise a `CPInputError` unless the checkpoint `meta` fits the run `expect` (see `load_checkpoint`)."""
    # a field one side lacks is its default, None (a checkpoint written before the field existed)
    diff = {k: (meta.model.get(k), expect.model.get(k)) for k in sorted(set(meta.model) | set(expect.model))
            if meta.model.get(k) != expect.model.get(k)}  # fmt: skip
    if diff:
        raise CPInputError(f"checkpoint {where} holds another model: (checkpoint, this run) differ in {diff}")
    if meta.packs_per_step != expect.packs_per_step:
        raise CPInputError(
            f"checkpoint {where} was written with dp x micro_batches = {meta.dp} x {meta.micro_batches} packs per step, "
            f"this run takes {expect.dp} x {expect.micro_batches}: the data position would not carry over"
        )
    unknown = sorted(set(override) - set(expect.settings))
    if unknown:
        raise CPInputError(f"override names {unknown}, which are not settings; the settings are {sorted(expect.settings)}")
    differ = [k for k in sorted(set(meta.settings) | set(expect.settings))
              if meta.settings.get(k) != expect.settings.get(k) and k not in override]  # fmt: skip
    if differ:
        raise CPInputError(
            f"checkpoint {where} was trained with other settings than this run: "
            + "; ".join(f"{k} is {meta.settings.get(k)!r} there, {expect.settings.get(k)!r} here" for k in differ)
            + f". Pass the checkpoint's values, or override them deliberately ({', '.join(f'--override {k}' for k in differ)})"
        )


def overridden(meta: CheckpointMeta, expect: CheckpointMeta, override: Collection[str]) -> list[str]:
    """One line per overridden setting whose value changes: `lr: 0.003 (checkpoint) -> 0.001 (this run)`."""
    return [f"{k}: {meta.settings.get(k)!r} (checkpoint) -> {expect.settings.get(k)!r} (this run)"
            for k in sorted(override) if meta.settings.get(k) != expect.settings.get(k)]  # fmt: skip
