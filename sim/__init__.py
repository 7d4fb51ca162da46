"""`sim`: the simulated cluster that every cpref algorithm is first run and tested on.

A mini-guide:

* [`SimCluster`][sim.cluster.simcluster.SimCluster]`(P).run(fn)` runs `fn(comm)` on `P` rank threads
  and returns the per-rank results; `comm` is a [`SimComm`][sim.cluster.simcluster.SimComm], which
  implements [`cpref.comm.protocol.Collectives`][cpref.comm.protocol.Collectives] deterministically (rank-order
  reductions) and records every collective in `SimCluster.trace`
  ([`sim.cluster.trace`][sim.cluster.trace]: events and the bytes they move).
* Faults never hang ([`sim.cluster.rendezvous`][sim.cluster.rendezvous]): `CollectiveMismatch`,
  `PeerFailure` and `CollectiveTimeout` inside a rank; `ClusterFailure` out of `run`.
* The FP64 single-device reference lives in `sim.oracle` (import it explicitly).
* The tools that run on real process groups live in [`sim.tools`][sim.tools]: the launcher,
  `python -m sim verify` ([`sim.tools.verify`][sim.tools.verify]: the production path on real
  processes, gloo, NCCL or HCCL, rank by rank against the simulated cluster in FP64), and
  `python -m sim train`.

Example:
    >>> import torch
    >>> from sim import SimCluster
    >>> SimCluster(2).run(lambda comm: comm.all_reduce(torch.tensor([comm.rank + 1.0])))
    [tensor([3.]), tensor([3.])]

`sim` may import `cpref`; `cpref` never imports `sim`.
"""

from sim.cluster.rendezvous import ClusterFailure, CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerFailure
from sim.cluster.simcluster import SimCluster, SimComm
from sim.cluster.trace import CollectiveEvent, TraceSummary, summarize, traffic

__all__ = [
    "ClusterFailure",
    "CollectiveError",
    "CollectiveEvent",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "PeerFailure",
    "SimCluster",
    "SimComm",
    "TraceSummary",
    "summarize",
    "traffic",
]
