r"""Adapters of well-known CP implementations, for `python -m sim verify --impl sim.tools.verify.peers:<name>`.

Each turns a peer's public API into the signature `--impl` calls,
`fn(q, k, v, sharding, *, process_group, mode, causal, window, **options)`, so that the peer is
verified rank by rank against FP64 ground truth, on packed multi-document batches, with one command.

## DeepSpeed-Ulysses: `deepspeed_ulysses`

`deepspeed.sequence.layer.DistributedAttention` (package `deepspeed`, tested with 0.19.8, on the
CPU over gloo) wraps a local attention in two all-to-alls: sequence shards of every head become
the whole sequence for `H / P` heads, the local attention runs, and the output goes back. It
shards the sequence in contiguous pieces of the whole packed stream, which is cpref's `stream`
layout; the local attention here is PyTorch's SDPA with the packed batch's block-diagonal mask
(`sim.tools.verify.baselines.packed_sdpa`), as a DeepSpeed user with packed documents writes it; under
`--mask` that local attention takes the mask (Ulysses attends whole sequences, so any mask runs there).
Key/value heads that `P` does not divide are repeated to the query heads first, as its users do.

```bash
python -m sim verify --nproc 2 --mode a2a --layout stream --docs 100,250,38 \
    --dtype fp32,bf16 --impl sim.tools.verify.peers:deepspeed_ulysses
```

The `vs P=1` column holds it to DeepSpeed's own attention on a process group of one rank.

## yunchang (USP, ring): no adapter, and why

yunchang 0.6.4 does not run forward and backward on the CPU (PyTorch 2.13), whatever its layer,
ring or attention type: `LongContextAttention`'s `basic` and `zigzag` rings need `flash-attn`
under `AttnType.FA` (the default), call `aten::_scaled_dot_product_flash_attention` or
`_efficient_attention`, which have no CPU kernel, under `TORCH_FLASH` and `TORCH_EFFICIENT`, and
under `TORCH_MATH` run the forward through SDPA's math backend with an lse of zeros (which a ring
of more than one rank merges its blocks by) and raise in the backward; its `basic_pytorch` ring
and `UlyssesAttention` call the flash op whatever the type (`UlyssesAttention` with `FA` refuses
to be built); its packed (varlen) ring needs `flash-attn`. Its non-varlen layers also take no
document boundaries: on a GPU they would verify batches of one document per row. The page
"Verify: every option, what it checks and counts" has the table; a test runs each of its lines while yunchang is
installed, so the adapter is due the day one of them runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sim.tools.verify.baselines import packed_sdpa

__all__ = ["deepspeed_ulysses"]


def _deepspeed() -> Any:
    """`deepspeed`, its communication layer started over the process group torch.distributed already has."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(f"the DeepSpeed adapter needs the deepspeed package ({exc}); pip install deepspeed") from exc
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return deepspeed


def deepspeed_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharding, *, process_group, mode: str = "a2a",
                      causal: bool = True, window=(-1, -1), mask=None, **options: Any) -> torch.Tensor:  # fmt: skip
    """DeepSpeed's `DistributedAttention` over SDPA on this rank's piece of the stream: `(T_l, Hq, D)` -> `(T_l, Hq, Dv)`;
    a `mask` (`cpref.Mask`, `--mask`) is the local SDPA's, which sees the whole stream."""
    if sharding.layout != "stream":
        raise ValueError(f"DeepSpeed-Ulysses shards the packed batch as one stream (contiguous pieces); got layout "
                         f"{sharding.layout!r}: run it with --layout stream")  # fmt: skip
    from deepspeed.sequence.layer import DistributedAttention

    _deepspeed()
    P = dist.get_world_size(process_group)
    if q.shape[1] % P:
        raise ValueError(f"DeepSpeed-Ulysses needs the {q.shape[1]} query heads divisible by P = {P}")
    if k.shape[1] % P:  # too few key/value heads to scatter: repeated to the query heads, as its users do
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))

    def local(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # (T, 1, H / P, D) each: the whole stream for this rank's heads
        return packed_sdpa(qh[:, 0], kh[:, 0], vh[:, 0], sharding, causal=causal, window=window, mask=mask)[:, None]

    attention = DistributedAttention(local, process_group, scatter_idx=2, gather_idx=0)
    return attention(q[:, None], k[:, None], v[:, None], batch_dim_idx=1)[:, 0]  # (T_l, Hq, Dv)
