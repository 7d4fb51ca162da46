"""A CP attention that knows nothing of documents, made verifiable: the adapter pattern of a peer without boundaries.

Most CP code attends one sequence: no `cu_seqlens`, one causal mask. This one all-gathers K and V over the
group and runs PyTorch's SDPA; it is written on `torch.distributed` and SDPA alone. To verify it, the adapter
needs two things from the batch's `cpref.Sharding`, and refuses the rest before it communicates:

- which tokens this rank holds, in which order: `sharding.global_index(rank)`, their positions in the stream
  (chunk `r` under contiguous, chunks `r` and `2P - 1 - r` under zigzag, piece `r` of the stream under stream,
  and over one document balanced cuts it as zigzag does); the causal mask is built from them, so every layout runs;
- what it cannot do: several documents, padding, a window, a mask, the variants, as
  `NotImplementedError("why")`, which `sim verify` reports as `skipped (why)` rows.

Writing it, the verifier caught a bug that is PyTorch's (on gloo): `torch.distributed.nn.functional.all_gather`
returns wrong gradients when the gradient reaching it is strided; `--impl-option contiguous_grads=False` shows it
(dk and dv fail on every rank and at CP size 1 alike), the hook in `gather` is the fix.

```bash
.venv/bin/python -m sim verify --nproc 2 --impl examples/gather_sdpa.py:attention --mode all_gather --docs 256
```
"""

from __future__ import annotations

# --8<-- [start:adapter]
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F


def attention(
    q, k, v, sharding, *, process_group, causal=True, window=(-1, -1),
    contiguous_grads=True, **options,
) -> torch.Tensor:
    """This rank's `(T / P, Hq, D)` queries against every rank's keys and values
    of one document.
    """
    # 1) refuse, before any communication and alike on every rank, what it does
    #    not attend
    variants = ("mask", "softcap", "sinks", "chunk")
    unsupported = {name for name in variants if options.get(name) is not None}
    if (
        len(sharding.cu_seqlens) != 2
        or sharding.bounds.is_padded
        or window != (-1, -1)
        or unsupported
    ):
        raise NotImplementedError(
            "one document, no padding, no window, mask or variants: "
            "run it with --docs N"
        )
    P, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    # 2) every rank's K and V (autograd: the backward reduce-scatters dK, dV),
    #    and where each token sits
    # (T, Hkv, D), (T, Hkv, Dv)
    k_all, v_all = (gather(x, process_group, contiguous_grads) for x in (k, v))
    # (T,) in gathered order
    keys = torch.cat([sharding.global_index(r) for r in range(P)]).to(q.device)
    queries = sharding.global_index(rank).to(q.device)  # (T / P,)
    # 3) SDPA over the heads, the causal mask from the positions (any layout)
    seen = keys[None, :] <= queries[:, None] if causal else None  # (T / P, T)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
        attn_mask=seen, enable_gqa=True,
    )
    return out.transpose(0, 1)  # (T / P, Hq, Dv)


def gather(
    x: torch.Tensor, group, contiguous_grads: bool = True,
) -> torch.Tensor:
    """Every rank's `x`, concatenated in rank order, differentiable. On gloo the
    backward of PyTorch's `all_gather` scatters the gradient with
    `dist.scatter`, which reads a strided tensor in storage order (the transposes
    above make one): without `contiguous_grads`, dK and dV come back wrong
    (pytorch#192920)."""
    parts = dist_nn.all_gather(x.contiguous(), group=group)
    if contiguous_grads:
        for part in parts:
            # the gradient, laid out before it is scattered
            part.register_hook(torch.Tensor.contiguous)
    return torch.cat(parts)
# --8<-- [end:adapter]
