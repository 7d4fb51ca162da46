"""cpref: reference-first context-parallel (CP) attention.

The package, from the bottom up (each part imports only the parts above it in this list):

* [`cpref.base`][cpref.base]: the error type, argument checks, determinism;
* [`cpref.batch`][cpref.batch]: the batch description: document boundaries, the four layouts
  (contiguous, zigzag, stream, balanced), `Sharding` (the one object saying how a batch is
  split, which shards, unshards and is what `cpref.attention` takes), `Mask` (which keys each
  query sees, as slices) and the batch cache;
* [`cpref.kernels`][cpref.kernels]: the attention kernel contract (varlen, bottom-right causal,
  out + lse), the portable `TorchKernel`, `CudaKernel` (flash on CUDA), `NpuKernel` (Ascend);
* [`cpref.comm`][cpref.comm]: the collectives protocol every algorithm is written against, and
  `TorchComm` over `torch.distributed` (loaded on first use);
* [`cpref.modes`][cpref.modes]: the CP algorithms, each one file that declares itself:
  `all_gather` (KV all-gather, with the MindSpeed RFC's metadata API), `p2p` (the ring), `a2a`
  (Ulysses) and `a2a+p2p` (hierarchical), the validated call they receive, the ranks'
  agreement check and their costs;
* [`cpref.api`][cpref.api]: `cpref.attention`, the one entry point;
* [`cpref.models`][cpref.models]: GPT-2, LLaMA and Qwen3 style models with CP;
* [`cpref.train`][cpref.train]: the data path and loss, the DP x CP training step, checkpoints;
* [`cpref.hf`][cpref.hf]: Hugging Face `transformers` models with CP.

One call of `cpref.attention`, file by file: `batch/sharding.py` (the `Sharding` the tensors were
cut with) -> `api.py` (every argument checked, before any communication) -> `modes/call.py` (the
validated `CPCall`) -> `modes/consistency.py` (the ranks agree) -> `modes/<mode>.py` (its plan
from the batch cache, its collectives through `comm/`, its kernel calls through `kernels/`).

Example (on the simulated cluster of the `sim` package, installed with cpref):

```python
# given: cu_seqlens, q, k, v; a packed batch (every document a multiple of 2P = 8 tokens), q, k, v (T, H, D)
import cpref, sim
sharding = cpref.Sharding(cu_seqlens, cp_size=4, layout="zigzag")
outs = sim.SimCluster(4).run(  # every rank's output shard, in rank order
    lambda comm: cpref.attention(*(sharding.shard(x, comm.rank) for x in (q, k, v)), sharding,
                                 comm=comm, mode="all_gather"))
```
"""

from cpref.api import MODES, attention
from cpref.base.errors import CPInputError, NonFiniteStepError
from cpref.batch.cache import cache_info, clear_cache
from cpref.batch.layout import LAYOUTS, bshd_to_thd, thd_to_bshd
from cpref.batch.mask import Mask
from cpref.batch.seqlens import Boundaries
from cpref.batch.sharding import Sharding
from cpref.comm.protocol import Collectives, SingleRank
from cpref.kernels import AttentionKernel, CudaKernel, TorchKernel, Varlen
from cpref.modes.all_gather import AllGatherKVFunc, AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced
from cpref.modes.metadata import clear_cp_metadata_cache, get_thd_load_balanced_cp_metadata
from cpref.train.data import cp_loss, get_batch_on_this_cp_rank

__all__ = [
    "attention",
    "MODES",
    "Collectives",
    "SingleRank",
    "CPInputError",
    "NonFiniteStepError",
    "AttentionKernel",
    "TorchKernel",
    "CudaKernel",
    "Varlen",
    "Sharding",
    "Mask",
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
