"""`sim.tools`: what runs cpref on real process groups, checked against the reference in `sim`.

`sim` itself is the reference: the FP64 oracle (`sim.oracle`), the simulated cluster
(`sim.cluster.simcluster`, `sim.cluster.rendezvous`, `sim.cluster.trace`) and the harness the tests and docs run modes with
(`sim.cluster.harness`). The tools here start real processes and compare them with it:

* [`sim.tools.launch`][sim.tools.launch]: run a function on N local processes joined in a
  `torch.distributed` world (with [`sim.tools.launch_watch`][sim.tools.launch_watch]: ranks
  die with the launcher, a hung rank is named);
* [`sim.tools.verify`][sim.tools.verify] (`python -m sim verify`): CP attention on real process
  groups, rank by rank against the simulated cluster in FP64 (`cases`, `rank`, `truth`);
* [`sim.tools.train`][sim.tools.train] (`python -m sim train`): train a small model with CP;
* [`sim.tools.npu_check`][sim.tools.npu_check] (`make test-npu`): the Ascend NPU checks.

`make demo` (`sim.tools.demo`) shows both: every mode on the simulated cluster, then `sim verify`.
"""
