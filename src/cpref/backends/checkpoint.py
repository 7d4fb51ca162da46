"""Checkpoint payloads on real process groups: `torch.distributed.checkpoint` (DCP).

Every rank of a DP x CP run holds the same replica of the model and optimizer. DCP's save
planner sees the same keys on every rank and has **one** rank write each of them, so the
payload is written once, split across the ranks that must write; loading reads it back on
every rank, whatever the DP and CP sizes now are (the parameters are never split by CP). The
model's and optimizer's states go through `torch.distributed.checkpoint.state_dict`, which
also creates the optimizer's state before loading into it. `cpref.checkpoint` adds the
metadata, the SHA-256 sums and the atomic rename around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["DcpPayload"]


class DcpPayload:
    """`cpref.checkpoint.Payload` over `torch.distributed.checkpoint` (a process group must be initialised)."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group

    def save(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> None:
        """Collective: every rank takes part, each replicated tensor is written once."""
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory / "dcp"),
                 process_group=self.process_group)  # fmt: skip

    def load(self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank reads the whole state into its replica."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(directory / "dcp"), process_group=self.process_group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
