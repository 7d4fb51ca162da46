"""The simulated cluster: P ranks as threads of one process, every collective in FP64.

* [`sim.cluster.simcluster`][sim.cluster.simcluster]: `SimCluster(P).run(fn)` and `SimComm`, each
  rank's view of its group (its names also here: `from sim.cluster import SimCluster`);
* [`sim.cluster.rendezvous`][sim.cluster.rendezvous]: how the rank threads meet in a collective,
  and how a fault is reported instead of hanging;
* [`sim.cluster.trace`][sim.cluster.trace]: one structured event per collective, with the bytes it
  moves;
* [`sim.cluster.harness`][sim.cluster.harness]: `cpref.attention` run rank by rank, beside the
  oracle's answer for each rank.
"""

from sim.cluster.simcluster import REDUCTIONS, RankStuck, SimCluster, SimComm, SimPending, Unwaited

__all__ = ["SimCluster", "SimComm", "SimPending", "RankStuck", "Unwaited", "REDUCTIONS"]
