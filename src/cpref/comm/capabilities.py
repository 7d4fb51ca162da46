r"""What each `torch.distributed` backend can carry, and how `TorchComm` adapts to it.

[`TorchComm`][cpref.comm.torch_dist] is one class for every backend; what differs between
gloo, NCCL and HCCL is decided here, from the backend's name and the torch version, before any
communication: which calls a group size cannot run (`unsupported_ops`), which dtypes travel
widened (`widened_dtypes`), how `all_gather`, `reduce_scatter` and `all_to_all` move their data
(`default_exchange`), where the communicator's own small tensors live (`control_device`) and
which `new_group` options keep a sub-group's rank order (`new_group_options`).

## The default exchange

`default_exchange` picks `"p2p"` on gloo and `"native"` elsewhere. On one machine gloo's
point-to-point transfers are faster than its collectives: its reduce-scatter is an all-reduce
plus a chunk (twice the traffic, see the facts below). With 2 processes on 2 cores and 16 MiB
a rank (torch 2.13), `bench.collectives` measured the pairwise all-gather 1.4 to 1.9 times and the pairwise
reduce-scatter 2.2 to 2.7 times faster than gloo's, over three runs; all-to-all came out even
(0.87 to 1.16) and is pairwise too, so that one rule covers the three (the performance page
shows the latest run).
NCCL and HCCL collectives are the tuned path on their hardware, so they stay native. So does
gloo under `TORCH_DISTRIBUTED_DEBUG=DETAIL` (what `sim.tools.launch` sets unless `check_calls=False`):
torch then compares every collective's shapes across ranks and raises "Detected mismatch
between collectives" on all of them, a check that point-to-point ops do not get. A pairwise
exchange whose ranks disagree on the size does not hang either: gloo aborts the receiving
process (SIGABRT, after printing "Received data size doesn't match expected size" on its
stderr), which `sim.tools.launch` reports; gloo's native collectives, unchecked, may instead return
garbage silently.

## Backend facts this relies on (probed on torch 2.13, gloo, CPU)

* gloo runs every protocol call in float16, bfloat16, float32 and float64 (`tests/backends`
  probe them). Older gloo builds lacked bfloat16 (pytorch#111131, fixed by #113557 around
  torch 2.2); there, bfloat16 travels and reduces as float32 and is rounded back once, which
  reduces *more* precisely than NCCL or HCCL would. No other dtype is ever changed.
* gloo's own sums (`all_reduce`, and `reduce_scatter` with `exchange="native"`) are not a
  rank-order fold (its ring reduces each chunk in a different order), and fp16/bf16 partial
  sums are rounded at every step, like NCCL's and HCCL's: compare with the simulator at the
  dtype's tolerance, not bitwise. The pairwise `reduce_scatter` is the rank-order fold.
* gloo's reduce-scatter is an all-reduce followed by a chunk (pytorch#118911): correct, but
  twice the traffic of a real reduce-scatter.
* gloo does not check that the ranks' calls match: mismatched shapes can return garbage
  silently. `TORCH_DISTRIBUTED_DEBUG=DETAIL` (what `sim.tools.launch` turns on by default) makes
  every collective compare fingerprints first and raise "Detected mismatch between
  collectives".
* HCCL rejects tensor all-gather and reduce-scatter on groups of 3, 5, 6 or 7 ranks. Such a
  communicator lists them in `unsupported_ops`, `cpref.attention` refuses modes that need
  them before any communication, and calling one anyway raises `CPInputError`.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.distributed as dist

from cpref.base.errors import CPInputError

__all__ = ["EXCHANGES", "HCCL_BAD_SIZES", "NEW_GROUP_PARAMS", "control_device", "default_exchange",
           "new_group_options", "unsupported_ops", "widened_dtypes"]

HCCL_BAD_SIZES = frozenset({3, 5, 6, 7})  # group sizes on which HCCL rejects tensor all-gather / reduce-scatter


def unsupported_ops(backend: str, size: int) -> frozenset[str]:
    """The protocol calls that `backend` cannot run on a group of `size` ranks."""
    if str(backend).lower() == "hccl" and size in HCCL_BAD_SIZES:
        return frozenset({"all_gather", "reduce_scatter"})
    return frozenset()


def widened_dtypes(backend: str) -> dict[torch.dtype, torch.dtype]:
    """`{dtype: wider dtype}` for the dtypes `backend` cannot carry (see the module docstring)."""
    if str(backend).lower() == "gloo" and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 3):
        return {torch.bfloat16: torch.float32}
    return {}


NEW_GROUP_PARAMS = frozenset(inspect.signature(dist.new_group).parameters)


def new_group_options(ranks: Sequence[int], params: frozenset[str] | set[str]) -> dict[str, bool]:
    """The `new_group` options that make a group of `ranks` in the listed order, among the ones this torch has.

    `sort_ranks=False` keeps the listed order; a torch without it (2.11 has none) sorts the
    ranks, which is the same group when they are already ascending (every partition cpref
    makes of an ascending group) and a clear error otherwise, never a silently renumbered group.

    Raises:
        CPInputError: if `ranks` are not ascending and this torch cannot keep their order.
    """
    options = {"use_local_synchronization": True}
    if "sort_ranks" in params:
        return {**options, "sort_ranks": False}
    if list(ranks) != sorted(ranks):
        raise CPInputError(
            f"split: the sub-group {list(ranks)} (global ranks) is not in ascending order, and this torch's "
            f"new_group has no sort_ranks to keep its order; order the CP group's ranks ascending, or use torch >= 2.13"
        )
    return options


EXCHANGES = ("native", "p2p")


def default_exchange(backend: str) -> str:
    """`"p2p"` where gloo serves the group (its collectives are slower than its sends), else `"native"`;
    `"native"` under `TORCH_DISTRIBUTED_DEBUG=DETAIL`, whose call checks cover collectives only."""
    detail = dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL
    return "p2p" if "gloo" in str(backend).lower() and not detail else "native"


_ACCELERATORS = {"nccl": "cuda", "hccl": "npu"}  # backend -> the device type it carries


def control_device(backend: str) -> torch.device:
    """The device a backend carries small control tensors on: CPU where gloo serves it, else the accelerator.

    A backend string may name one backend per device type (`"cpu:gloo,cuda:nccl"`); any with
    gloo takes CPU tensors. NCCL takes the current CUDA device and HCCL the current NPU (bound
    per local rank by `sim.tools.launch` or the launcher before the group is made); another backend,
    the current accelerator if torch names one (`torch.accelerator`, torch >= 2.6), else the CPU.
    """
    if "gloo" in backend:
        return torch.device("cpu")
    kind = _ACCELERATORS.get(backend)
    if kind is None and hasattr(torch, "accelerator") and torch.accelerator.current_accelerator() is not None:
        kind = torch.accelerator.current_accelerator().type
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())
