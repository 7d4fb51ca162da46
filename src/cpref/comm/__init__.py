"""Collectives: the protocol every CP algorithm is written against, and its `torch.distributed` backend.

* [`cpref.comm.protocol`][cpref.comm.protocol]: the protocol (`Collectives`: all-gather,
  reduce-scatter, all-to-all, the ring shift, their asynchronous forms) and `SingleRank`, the
  group of one rank (both also here: `from cpref.comm import Collectives`). The simulated
  cluster (`sim.SimComm`) implements the same protocol.
* [`cpref.comm.torch_dist`][cpref.comm.torch_dist]: `TorchComm`, the protocol over a
  `torch.distributed` process group, for any backend (gloo on CPUs, NCCL on GPUs, HCCL on Ascend
  NPUs). Build it from a `ProcessGroup` (`TorchComm(pg)`, or `TorchComm()` for the world) or
  from a named axis of a `DeviceMesh` (`TorchComm.from_mesh(mesh, "cp")`), once, next to the model.
* [`cpref.comm.capabilities`][cpref.comm.capabilities]: what each backend can carry
  (`unsupported_ops`, widened dtypes, the default exchange), decided before any communication,
  so that `cpref.attention` refuses a mode a backend cannot run.

To run a function on N local processes, see the repository's `sim.tools.launch`.

`cpref.comm.torch_dist` and `cpref.train.dcp` are the only modules of cpref that import
`torch.distributed`; the CP algorithms (`cpref.modes`) see only the protocol. `import cpref`
does not import the backend: `TorchComm` and its helpers load on first use.

Example:
    ```python
    # run by tests/test_quickstart.py::test_the_own_module_example_trains_over_torchrun_as_on_one_device
    import torch.distributed as dist
    import cpref
    from cpref.comm import TorchComm

    dist.init_process_group("gloo")          # e.g. under torchrun
    comm = TorchComm()                       # the world as one CP group
    out = cpref.attention(q, k, v, sharding, comm=comm, mode="all_gather")
    ```
"""

import importlib
from typing import Any

from cpref.comm.protocol import REDUCE_OPS, Collectives, Pending, SingleRank, check_comm, check_partition, check_payload

__all__ = ["Collectives", "Pending", "REDUCE_OPS", "SingleRank", "check_comm", "check_payload", "check_partition",
           "EXCHANGES", "TorchComm", "TorchPending", "default_exchange", "unsupported_ops"]  # fmt: skip

_LAZY = {"TorchComm": "torch_dist", "TorchPending": "torch_dist", "EXCHANGES": "capabilities",
         "default_exchange": "capabilities", "unsupported_ops": "capabilities"}  # fmt: skip


def __getattr__(name: str) -> Any:
    """The backend's names on first use (`from cpref.comm import TorchComm`, `cpref.comm.TorchComm`)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"cpref.comm.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'cpref.comm' has no attribute {name!r}")
