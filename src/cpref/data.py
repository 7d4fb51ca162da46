"""The data path for packed EOD batches: pad, shard, and a loss that does not depend on P.

A packed batch holds documents of any length, but the zigzag layout needs every document to
be a multiple of `2P` tokens. [`get_batch_on_this_cp_rank`][cpref.data.get_batch_on_this_cp_rank]
follows MindSpeed's EOD-padding path:

1. pad every document **at its end** to a multiple of the layout's granularity (`2P` for
   zigzag), with `pad_token_id` tokens whose loss mask is 0;
2. compute position ids inside each padded document (positions restart at every document,
   for RoPE);
3. slice tokens, labels, loss mask and position ids with the layout.

Padding at the end of a document never changes a real token's result: under the causal mask
no real token sees a later position, and the padded tokens' losses are masked out. The loss
itself must be normalised by the **global** number of loss tokens, not by each rank's own
count, or the loss would depend on how tokens fall on ranks (and a rank holding only padding
would divide by zero):

$$ \\mathcal{L} = \\frac{\\sum_r \\sum_{t \\in r} m_t \\ell_t}{\\sum_r \\sum_{t \\in r} m_t} $$

[`cp_loss`][cpref.data.cp_loss] returns rank `r`'s share of this sum, so the shares add up
to $\\mathcal{L}$ and their gradients add up to the gradient of $\\mathcal{L}$ (all-reduce the
parameter gradients over the CP group, as for data parallelism).
"""

from __future__ import annotations

from typing import Mapping

import torch

from cpref.comm import Collectives
from cpref.layout import CuSeqlens, layout_multiple, pad_to_multiple, positions, shard

__all__ = ["get_batch_on_this_cp_rank", "cp_loss"]


def get_batch_on_this_cp_rank(
    batch: Mapping[str, torch.Tensor],
    cu_seqlens: CuSeqlens,
    *,
    cp_size: int,
    rank: int,
    layout: str = "zigzag",
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """EOD-pad a packed batch and return this rank's slice.

    Args:
        batch: `tokens (T,)`, `labels (T,)` and optionally `loss_mask (T,)` (default all ones);
            any other `(T, ...)` tensor is padded with zeros and sliced alike.
        cu_seqlens: real (unpadded) document boundaries, leading 0.
        cp_size: CP group size `P`.
        rank: this rank.
        layout: `"zigzag"` (default) or `"contiguous"`.
        pad_token_id: token and label id of the padding.

    Returns:
        This rank's `tokens`, `labels`, `loss_mask`, `position_ids` (and other keys), plus
        `cu_seqlens`: the **global padded** boundaries to pass to `cpref.attention`.
    """
    mult = layout_multiple(layout, cp_size)
    batch = dict(batch)
    if "loss_mask" not in batch:
        batch["loss_mask"] = torch.ones_like(batch["tokens"], dtype=torch.float32)
    fill = {"tokens": pad_token_id, "labels": pad_token_id}
    out: dict[str, torch.Tensor] = {}
    cu_pad = None
    for name, x in batch.items():
        x_pad, cu_pad = pad_to_multiple(x, cu_seqlens, mult, value=fill.get(name, 0))  # (T_pad, ...)
        out[name] = shard(x_pad, cu_pad, cp_size=cp_size, rank=rank, layout=layout)  # (T_pad/P, ...)
    out["position_ids"] = positions(cu_pad, cp_size=cp_size, rank=rank, layout=layout)  # (T_pad/P,)
    out["cu_seqlens"] = cu_pad
    return out


def cp_loss(token_loss: torch.Tensor, loss_mask: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """This rank's share of the globally normalised masked mean loss.

    Args:
        token_loss: `(T_l,)` per-token losses of this rank.
        loss_mask: `(T_l,)` 1 for tokens that count, 0 for padding and ignored tokens.
        comm: the CP group (one all-reduce of a scalar count).

    Returns:
        A scalar whose sum over the CP ranks is the mean loss over all loss tokens; 0 (with
        zero gradient) when no rank has a loss token.
    """
    mask = loss_mask.to(token_loss.dtype)
    count = comm.all_reduce(mask.sum().detach().reshape(1))  # global number of loss tokens
    return (token_loss * mask).sum() / count.clamp_min(1).squeeze(0)
