"""Checkpoint payloads on real process groups: `torch.distributed.checkpoint` (DCP).

Every rank of a DP x CP run holds the same replica of the model and optimizer. DCP's save
planner sees the same keys on every rank and has **one** rank write each of them, so the
payload is written once, split across the ranks that must write; loading reads it back on
every rank, whatever the DP and CP sizes now are (the parameters are never split by CP). The
model's and optimizer's states go through `torch.distributed.checkpoint.state_dict`, which
also creates the optimizer's state before loading into it. `cpref.train.checkpoint` adds the
metadata, the SHA-256 sums and the atomic swap around it.

## Loading runs no code

DCP reads two things with Python's unrestricted unpickler: the checkpoint's `.metadata` file
(`FileSystemReader.read_metadata`, `pickle.load`) and every non-tensor item, such as the
optimizer's hyperparameters (`DefaultLoadPlanner.load_bytes`, `torch.load(weights_only=False)`).
A replaced file with recomputed sums would run its code on resume. `DcpPayload` reads both
itself instead:

- `.metadata` through `MetadataUnpickler`, which admits only the classes DCP's metadata is
  made of (`torch.distributed.checkpoint.metadata`'s dataclasses, `torch.Size`, dtypes,
  layouts, memory formats, paths) and refuses any other, naming it;
- non-tensor items with `torch.load(weights_only=True)`.

Tensors are read as raw bytes at the offsets `.metadata` records, which runs no code.

## Either format, either way

`DcpPayload` also reads a `"torch"` checkpoint (`state.pt`, every rank alone). `LocalPayload`
writes like `cpref.train.checkpoint.TorchPayload` and also reads a `"dcp"` checkpoint in one process
without a process group (`no_dist`): the simulated cluster resumes a checkpoint written on gloo
with it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cpref.base.errors import CPInputError
from cpref.train.checkpoint import TorchPayload
from cpref.train.checkpoint_meta import check_dtypes

__all__ = ["DcpPayload", "LocalPayload", "MetadataUnpickler", "SafeReader", "SafePlanner"]

# (module, name) of every global DCP's .metadata may name: its dataclasses and what they hold
_ALLOWED = {
    *((dcp_metadata.__name__, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                           "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                           "_MEM_FORMAT_ENCODING")),  # fmt: skip
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, and nothing else: any other global raises `pickle.UnpicklingError`."""

    def find_class(self, module: str, name: str) -> Any:
        """Resolve a global only if DCP's metadata is made of it (a torch dtype or one of `_ALLOWED`)."""
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata; refused")


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` goes through `MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checkpoint's metadata, read with the restricted unpickler."""
        path = Path(self.path) / (".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata")
        try:
            metadata = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as exc:
            raise CPInputError(f"checkpoint {path.parent.parent}: dcp/{path.name} cannot be read "
                               f"({type(exc).__name__}: {exc})") from None  # fmt: skip
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CPInputError(f"checkpoint {path.parent.parent}: dcp/{path.name} holds a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor items with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Load one non-tensor item without running code from it."""
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CPInputError(f"checkpoint item {read_item.dest_index.fqn} cannot be read "
                               f"({type(exc).__name__}: {exc})") from None  # fmt: skip
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _ErrnoWriter(FileSystemWriter):
    """`FileSystemWriter` whose failure is the `OSError` under it, where there is one (errno, file): DCP sends each
    rank's failure to the others pickled, which keeps an `OSError`'s errno but drops what torch's zip writer wraps
    (`RuntimeError: ... unexpected pos`, its context the `OSError` of a full disk)."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        """`FileSystemWriter.write_data`, failing with the `OSError` under its failure."""
        try:
            return super().write_data(*args, **kwargs)
        except Exception as exc:
            under = _under(exc)
            if under is exc:
                raise
            raise under from exc

    def finish(self, *args: Any, **kwargs: Any) -> None:
        """`FileSystemWriter.finish` (rank 0 writes `.metadata`), failing with the `OSError` under its failure."""
        try:
            return super().finish(*args, **kwargs)
        except Exception as exc:
            under = _under(exc)
            if under is exc:
                raise
            raise under from exc


def _under(exc: BaseException) -> BaseException:
    """The first `OSError` in `exc`'s chain, with its errno and file; else `exc`."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return OSError(e.errno, e.strerror, e.filename) if e.errno else e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return exc


class DcpPayload:
    """`cpref.train.checkpoint.Payload` over `torch.distributed.checkpoint` (a process group must be initialised).

    Args:
        process_group: the group that saves and loads (default: the world).
        local: load in this process alone, without a process group (`no_dist`).
    """

    name = "dcp"
    formats = ("dcp", "torch")

    def __init__(self, process_group: Any = None, *, local: bool = False) -> None:
        self.process_group, self.local = process_group, local

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Collective: every rank takes part, each replicated tensor is written once.

        Raises:
            RuntimeError: from DCP's `CheckpointException` (a `BaseException`), which holds every rank's failure.
        """
        model_state, optim_state = get_state_dict(model, optimizer)
        where = directory / "dcp"
        try:
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(where),
                     storage_writer=_ErrnoWriter(where), process_group=self.process_group)  # fmt: skip
        except CheckpointException as exc:
            raise RuntimeError(f"torch.distributed.checkpoint failed on ranks {sorted(exc.failures)}") from exc

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             cast: bool = False) -> None:  # fmt: skip
        """Collective (unless `local`): every rank reads the whole state into its replica, running no code.
        A tensor of another dtype than the replica's is refused unless `cast`. A `"torch"` checkpoint
        (`state.pt`) is read by every rank alone."""
        if not (directory / "dcp").is_dir() and (directory / "state.pt").is_file():
            return TorchPayload().load(directory, model, optimizer, cast=cast)
        where = directory / "dcp"
        if not cast and (where / ".metadata").is_file():  # (without it, DCP's load below refuses the checkpoint)
            # DCP copies each tensor read into the replica's: another dtype would be cast silently
            check_dtypes(str(directory), _dtypes(SafeReader(where).read_metadata(), model))
        model_state, optim_state = get_state_dict(model, optimizer)  # makes the optimizer's state: after the checks
        state = {"model": model_state, "optimizer": optim_state}
        kwargs = {"no_dist": True} if self.local else {"process_group": self.process_group}
        try:
            dcp.load(state, checkpoint_id=str(where), storage_reader=SafeReader(where), planner=SafePlanner(), **kwargs)
        except CheckpointException as exc:  # DCP wraps what its readers raise: show the reader's own words
            causes = [cause for cause, _ in exc.failures.values()]
            mine = [c for c in causes if isinstance(c, CPInputError)]
            if mine:
                raise mine[0] from None
            raise CPInputError(f"checkpoint {directory}: dcp/ cannot be loaded: "
                               + "; ".join(f"{type(c).__name__}: {c}" for c in causes)) from None  # fmt: skip
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _dtypes(metadata: dcp_metadata.Metadata, model: torch.nn.Module) -> Iterator[tuple[str, torch.dtype, torch.dtype]]:
    """`(name, saved dtype, live dtype)` of every tensor of a DCP checkpoint that the model's state or the optimizer's
    moments (which take their parameter's dtype) would receive."""
    live, params = model.state_dict(), dict(model.named_parameters())
    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            continue
        saved = item.properties.dtype
        if name.removeprefix("model.") in live and name.startswith("model."):
            yield name.removeprefix("model."), saved, live[name.removeprefix("model.")].dtype
        elif name.startswith("optimizer.state.") and saved.is_floating_point:
            fqn, key = name.removeprefix("optimizer.state.").rsplit(".", 1)
            if key != "step" and fqn in params:
                yield f"the optimizer's {key} of {fqn}", saved, params[fqn].dtype


class LocalPayload(TorchPayload):
    """`TorchPayload` that also reads a `"dcp"` checkpoint, in this process alone (the simulated cluster)."""

    formats = ("torch", "dcp")

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             cast: bool = False) -> None:  # fmt: skip
        """`state.pt` as `TorchPayload` reads it, or `dcp/` without a process group."""
        if (directory / "dcp").is_dir():
            return DcpPayload(local=True).load(directory, model, optimizer, cast=cast)
        return super().load(directory, model, optimizer, cast=cast)
