"""cpref: reference-first context-parallel (CP) attention.

The pieces, each a page of the docs:

* `cpref.layout`: the THD data model, the four layouts (contiguous, zigzag, stream, and balanced,
  whose plan is `cpref.balanced`), padding;
* `cpref.seqlens`: real and padded document boundaries, validated once per batch;
* `cpref.sharding`: `Sharding`, the one description of how a batch is sharded (boundaries,
  CP size, layout), which shards, unshards and is what `cpref.attention` takes;
* `cpref.comm`: the collectives protocol every algorithm is written against;
* `cpref.kernels`: the attention kernel contract, the portable `TorchKernel` and `CudaKernel` (flash on CUDA);
* `cpref.cache`: the batch cache (everything derived from `cu_seqlens`, once per step);
* `cpref.metadata`: the MindSpeed RFC's metadata API (load-balanced THD metadata for KV
  all-gather CP);
* `cpref.modes`: the CP algorithms, each one file that declares itself (`cpref.modes.spec`):
  `all_gather` (KV all-gather), `p2p` (the ring), `a2a` (Ulysses) and `a2a+p2p`
  (hierarchical), with their plans and what they share;
* `cpref.api`: the public entry point `cpref.attention`;
* `cpref.consistency`: the ranks' comparison of their arguments on every call;
* `cpref.data`: the EOD-padding data path and the CP-invariant loss;
* `cpref.models`, `cpref.training`, `cpref.checkpoint`: models with CP, the DP x CP training
  step, checkpoints;
* `cpref.backends` (imported on first use): `TorchComm` over `torch.distributed`, DCP payloads.

Example (on the simulated cluster of the `sim` package, installed with cpref):

```python
import cpref, sim
sharding = cpref.Sharding(cu_seqlens, cp_size=4, layout="zigzag")
out = sim.SimCluster(4).run(
    lambda comm: cpref.attention(*(sharding.shard(x, comm.rank) for x in (q, k, v)), sharding,
                                 comm=comm, mode="all_gather"))
```
"""

from cpref.api import MODES, attention
from cpref.cache import cache_info, clear_cache
from cpref.comm import Collectives, SingleRank
from cpref.data import cp_loss, get_batch_on_this_cp_rank
from cpref.errors import CPInputError
from cpref.kernels import AttentionKernel, CudaKernel, TorchKernel, Varlen
from cpref.layout import LAYOUTS, bshd_to_thd, thd_to_bshd
from cpref.metadata import clear_cp_metadata_cache, get_thd_load_balanced_cp_metadata
from cpref.modes.all_gather import AllGatherKVFunc, AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced
from cpref.seqlens import Boundaries
from cpref.sharding import Sharding

__all__ = [
    "attention",
    "MODES",
    "Collectives",
    "SingleRank",
    "CPInputError",
    "AttentionKernel",
    "TorchKernel",
    "CudaKernel",
    "Varlen",
    "Sharding",
    "Boundaries",
    "LAYOUTS",
    "bshd_to_thd",
    "thd_to_bshd",
    "get_thd_load_balanced_cp_metadata",
    "clear_cp_metadata_cache",
    "clear_cache",
    "cache_info",
    "AllGatherKVFunc",
    "AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced",
    "get_batch_on_this_cp_rank",
    "cp_loss",
]


def __getattr__(name: str):
    """`cpref.backends` on first use (`cpref.backends.TorchComm(...)` works after `import cpref`),
    so that `import cpref` does not import `torch.distributed.checkpoint` and the backends."""
    if name == "backends":
        import importlib

        return importlib.import_module("cpref.backends")
    raise AttributeError(f"module 'cpref' has no attribute {name!r}")
