"""`cpref.backends`: the collectives protocol over real process groups.

A mini-guide:

* [`TorchComm`][cpref.backends.torch_dist.TorchComm] implements
  [`cpref.comm.Collectives`][cpref.comm.Collectives] over a `torch.distributed` process
  group, for any backend (gloo on CPUs, NCCL on GPUs, HCCL on Ascend NPUs). Build it from a
  `ProcessGroup` (`TorchComm(pg)`, or `TorchComm()` for the world) or from a named axis of
  a `DeviceMesh` (`TorchComm.from_mesh(mesh, "cp")`), once, next to the model.
* `comm.unsupported_ops` names the collectives the backend cannot run on this group size, so
  that `cpref.attention` refuses a mode before any communication. That and the other
  per-backend choices (dtypes, the default exchange, control tensors' device) are made in
  [`cpref.backends.capabilities`][cpref.backends.capabilities].
* To run a function on N local processes, see the repository's `sim.tools.launch`.

This package is the only part of cpref that imports `torch.distributed`; the CP algorithms
(`cpref.modes`) see only the protocol. `import cpref` does not import this package.

Example:
    ```python
    import torch.distributed as dist
    import cpref
    from cpref.backends import TorchComm

    dist.init_process_group("gloo")          # e.g. under torchrun
    comm = TorchComm()                       # the world as one CP group
    out = cpref.attention(q, k, v, cu_seqlens, comm=comm, mode="all_gather")
    ```
"""

from cpref.backends.capabilities import EXCHANGES, default_exchange, unsupported_ops
from cpref.backends.torch_dist import TorchComm, TorchPending

__all__ = ["EXCHANGES", "TorchComm", "TorchPending", "default_exchange", "unsupported_ops"]
