"""Checkpoints that resume a run exactly, at another CP size if need be.

A checkpoint is a directory: `meta.json` (what the run was: step, DP and CP sizes, mode,
layout, micro-batches, the model config, and a SHA-256 of every payload file) and the
payload: the model's and the optimizer's state and the RNG state. Under CP every rank holds
the same replica, so the payload is written **once**: by rank 0 with `torch.save` on the
simulated cluster (`TorchPayload`), or with `torch.distributed.checkpoint` on real process
groups (`cpref.backends.checkpoint.DcpPayload`, which writes each replicated tensor once).

**Resuming at another CP size** needs nothing special: CP splits the sequence, never the
parameters, so the same state fits any `cp` (and any mode or layout). What must match is the
model (its config, hence every shape) and the number of packs per step (`dp x micro_batches`),
because the data position is counted in steps: a checkpoint that does not fit is refused with
an error naming what differs, before anything is loaded.

**Nothing is overwritten by a failure.** A checkpoint is written to `<dir>.tmp` and renamed into
place only when complete; loading checks the SHA-256 of every payload file and every tensor
shape before it touches the model or the optimizer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from cpref.errors import CPInputError

__all__ = ["CheckpointMeta", "Payload", "TorchPayload", "save_checkpoint", "load_checkpoint", "read_meta"]

FORMAT = "cpref-checkpoint/1"


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about its run (`meta.json`)."""

    step: int
    dp: int
    cp: int
    mode: str
    layout: str
    micro_batches: int
    model: dict

    @property
    def packs_per_step(self) -> int:
        """Packs consumed per step by the whole run: the data position is `step * packs_per_step`."""
        return self.dp * self.micro_batches


class Payload(Protocol):
    """How the model's and optimizer's state are written and read (collective over the world group)."""

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Write the model's and optimizer's state into `directory` (every rank of `world` calls it)."""
        ...

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read them back into `model` and `optimizer`, checking every tensor's shape first."""
        ...


class TorchPayload:
    """`torch.save` by world rank 0 (the simulated cluster, or one process); `weights_only` loading."""

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Rank 0 writes `state.pt`; the other ranks only wait for it."""
        if world.rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Read `state.pt` with `weights_only=True` (no code runs from a checkpoint), check every shape, load."""
        try:
            state = torch.load(directory / "state.pt", weights_only=True)
        except Exception as exc:  # a truncated or foreign file
            raise CPInputError(f"checkpoint {directory}: state.pt cannot be read ({type(exc).__name__}: {exc})") from None
        for name, tensor in model.state_dict().items():
            got = state["model"].get(name)
            if got is None or got.shape != tensor.shape:
                shape = None if got is None else tuple(got.shape)
                raise CPInputError(f"checkpoint {directory}: parameter {name} is {shape}, the model has {tuple(tensor.shape)}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _digest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "meta.json"}  # fmt: skip


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: CheckpointMeta,
                    world: Any, payload: Payload | None = None) -> Path:  # fmt: skip
    """Write a checkpoint of this replica (collective over `world`); returns its directory."""
    directory, payload = Path(directory), payload or TorchPayload()
    tmp = directory.with_name(directory.name + ".tmp")
    if world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()
    payload.save(tmp, model, optimizer, world)
    if world.rank == 0:
        torch.save(torch.get_rng_state(), tmp / "rng.pt")  # every replica draws the same numbers
    world.barrier()
    if world.rank == 0:
        record = {"format": FORMAT, **meta.__dict__, "sha256": _digest(tmp)}
        (tmp / "meta.json").write_text(json.dumps(record, indent=1, sort_keys=True))
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)  # the new checkpoint appears complete, or not at all
        shutil.rmtree(old, ignore_errors=True)
    world.barrier()
    return directory


def read_meta(directory: str | Path) -> CheckpointMeta:
    """The metadata of a checkpoint, checked for format and payload integrity."""
    directory = Path(directory)
    try:
        record = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CPInputError(f"checkpoint {directory}: no readable meta.json ({type(exc).__name__}: {exc})") from None
    if not isinstance(record, dict) or record.pop("format", None) != FORMAT:
        raise CPInputError(f"checkpoint {directory}: not a {FORMAT} checkpoint")
    if record.pop("sha256", None) != _digest(directory):
        raise CPInputError(f"checkpoint {directory}: its files do not match the SHA-256 sums in meta.json (corrupt or edited)")
    fields = set(CheckpointMeta.__dataclass_fields__)
    if set(record) != fields:
        raise CPInputError(
            f"checkpoint {directory}: meta.json has the fields {sorted(record)}, expected {sorted(fields)} "
            "(written by another version of cpref, or edited)"
        )
    return CheckpointMeta(**record)


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    expect: CheckpointMeta, payload: Payload | None = None) -> CheckpointMeta:  # fmt: skip
    """Restore model, optimizer and RNG from a checkpoint that fits the run `expect` describes.

    Raises:
        CPInputError: naming the mismatch (model config, packs per step), a corrupt file or a
            tensor of another shape; the model and optimizer are untouched then.
    """
    directory, payload = Path(directory), payload or TorchPayload()
    meta = read_meta(directory)
    if meta.model != expect.model:
        diff = {k: (meta.model.get(k), expect.model.get(k)) for k in set(meta.model) | set(expect.model)
                if meta.model.get(k) != expect.model.get(k)}  # fmt: skip
        raise CPInputError(f"checkpoint {directory} holds another model: (checkpoint, this run) differ in {diff}")
    if meta.packs_per_step != expect.packs_per_step:
        raise CPInputError(
            f"checkpoint {directory} was written with dp x micro_batches = {meta.dp} x {meta.micro_batches} packs per step, "
            f"this run takes {expect.dp} x {expect.micro_batches}: the data position would not carry over"
        )
    payload.load(directory, model, optimizer)
    torch.set_rng_state(torch.load(directory / "rng.pt", weights_only=True))
    return meta
