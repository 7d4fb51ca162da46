"""A stream-sharded Ulysses written the way DeepSpeed-Ulysses is, for `sim verify --impl` to check.

This is not cpref: it is a **peer**, a sequence-parallel attention of the kind users bring,
written against `torch.distributed` and PyTorch's SDPA only, to show that cpref verifies such
code rank by rank on packed batches once it can describe their sharding (`layout="stream"`:
each rank holds one contiguous piece of the whole packed stream, documents straddling ranks).

As in `deepspeed.sequence.layer.DistributedAttention`, one all-to-all turns sequence shards of
all heads into the whole sequence for `H / P` heads, local attention runs over it (here SDPA
with the packed batch's block-diagonal causal mask, built from the document boundaries, as a
user would), and a second all-to-all turns it back. Both all-to-alls are autograd functions
whose backward is the other one.

Run it:

```bash
python -m sim verify --nproc 2 --mode a2a --layout stream --docs 100,250,38 \\
    --impl examples.stream_ulysses:attention
```
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["attention"]


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """`(T_l, H, D)` -> `(P T_l, H / P, D)`: scatter the heads, gather the sequence."""
    P = dist.get_world_size(group)
    t, h, d = x.shape
    send = x.reshape(t, P, h // P, d).transpose(0, 1).contiguous()  # (P, T_l, H/P, D): block j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block j: rank j's tokens, this rank's heads
    return recv.reshape(P * t, h // P, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """`(P T_l, H / P, D)` -> `(T_l, H, D)`: the inverse."""
    P = dist.get_world_size(group)
    T, h, d = x.shape
    send = x.reshape(P, T // P, h, d).contiguous()  # block j: rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block j: this rank's tokens, rank j's heads
    return recv.transpose(0, 1).reshape(T // P, P * h, d)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = _heads_to_seq(grad.contiguous(), ctx.group) if ctx.to_heads else _seq_to_heads(grad.contiguous(), ctx.group)
        return back, None, None


def _mask(cu: list[int], cu_padded: list[int], causal: bool, window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(allowed (T, T), real (T,))` over the padded stream: same document, real keys, causal and the band.
    A padding query may see only itself (its output is then zeroed), so no row of the mask is empty."""
    T = cu_padded[-1]
    doc = torch.zeros(T, dtype=torch.int64)
    pos = torch.zeros(T, dtype=torch.int64)
    real = torch.zeros(T, dtype=torch.bool)
    for i in range(len(cu) - 1):
        start, end = cu_padded[i], cu_padded[i + 1]
        doc[start:end] = i
        pos[start:end] = torch.arange(end - start)
        real[start : start + cu[i + 1] - cu[i]] = True
    diff = pos[None, :] - pos[:, None]  # key position minus query position
    allowed = (doc[:, None] == doc[None, :]) & real[None, :]
    left, right = window
    right = 0 if causal else right
    if left >= 0:
        allowed &= diff >= -left
    if right >= 0:
        allowed &= diff <= right
    allowed |= torch.diag(~real)  # padding queries: themselves only
    return allowed, real


def attention(q, k, v, sharding, *, process_group, mode="a2a", causal=True, window=(-1, -1), softmax_scale=None,
              **options) -> torch.Tensor:  # fmt: skip
    """Ulysses over contiguous shards of the whole stream: `(T_l, Hq, D)` each -> `(T_l, Hq, Dv)`."""
    if sharding.layout != "stream":
        raise ValueError(f"this Ulysses shards the packed batch as one stream; got layout {sharding.layout!r}: "
                         "run it with --layout stream")  # fmt: skip
    P = dist.get_world_size(process_group)
    if q.shape[1] % P:
        raise ValueError(f"Ulysses needs the {q.shape[1]} query heads divisible by P = {P}")
    if k.shape[1] % P:  # too few key/value heads to scatter: repeat them to the query heads, as DeepSpeed's users do
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    # 1) sequence shards of all heads -> the whole stream for H / P heads
    qh, kh, vh = (_SeqAllToAll.apply(x, process_group, True) for x in (q, k, v))  # (T, H/P, D)
    # 2) local attention over the packed stream, its documents as a block-diagonal mask
    allowed, real = _mask(list(sharding.cu_seqlens), list(sharding.cu_seqlens_padded), causal, tuple(window))
    allowed, real = allowed.to(q.device), real.to(q.device)
    group = qh.shape[1] // kh.shape[1]  # query heads per key/value head (GQA)
    kh, vh = (x.repeat_interleave(group, dim=1) for x in (kh, vh))
    out = F.scaled_dot_product_attention(qh.transpose(0, 1), kh.transpose(0, 1), vh.transpose(0, 1),
                                         attn_mask=allowed, scale=softmax_scale).transpose(0, 1)  # (T, H/P, Dv)
    out = out * real[:, None, None]  # padding rows: zero output, no gradient
    # 3) back to sequence shards of all heads
    return _SeqAllToAll.apply(out.contiguous(), process_group, False)  # (T_l, Hq, Dv)
