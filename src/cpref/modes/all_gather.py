"""KV all-gather CP with EOD-aware load balancing on THD (the MindSpeed RFC).

Each rank keeps its queries and gathers everyone's keys and values: after one all-gather of
`K` and one of `V`, a rank can compute the exact attention of its local queries, because
every key its queries may see is now local. This is the Llama 3 scheme; the MindSpeed RFC
makes it efficient on packed (THD) batches with three ideas.

1. **Symmetric per-document chunks.** Every document is split into `2P` chunks and rank `r`
   holds chunks `r` and `2P - 1 - r` (the zigzag layout, `cpref.layout`), so every rank does
   the same causal work, $(2P + 1) \\sum_i c_i^2$.
2. **Rank-major direct indexing.** The gathered K/V stay in rank-major order; one
   `index_select` with the precomputed `kv_index` (`cpref.metadata`) picks, for each local
   query chunk, the causal prefix of its document in natural order. No full reorder of the
   stream, and no restore of the output.
3. **One fused call.** Both local query chunks of every document go to **one** varlen
   attention call: chunk `j` with its prefix of `(j + 1) c_i` keys is one sequence, and the
   kernel's bottom-right causal mask aligns its last query with its last key.

The backward mirrors the forward with the matching collective:

$$ \\text{forward: } K_{all} = \\mathrm{AllGather}(K), \\qquad
   \\text{backward: } dK = \\mathrm{ReduceScatter}\\big(\\mathrm{index\\_add}(0, dK_{sel})\\big) $$

A key row appears in the prefixes of several query chunks, on several ranks; `index_add_`
sums its gradient over this rank's chunks into a rank-major buffer, and the reduce-scatter
sums over ranks and hands every row back to its owner.

## A worked example

One document of 8 tokens, `P = 2`, zigzag: chunks of `c = 2` tokens, rank 0 holds chunks 0
and 3 (tokens 0-1 and 6-7), rank 1 chunks 1 and 2 (tokens 2-5). After the all-gather both
ranks hold the rank-major buffer

| row | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| token | 0 | 1 | 6 | 7 | 2 | 3 | 4 | 5 |
| owner | r0 | r0 | r0 | r0 | r1 | r1 | r1 | r1 |

Rank 0's chunk 0 needs tokens 0-1 (rows 0, 1); its chunk 3 needs tokens 0-7 in order, rows
0, 1, 4, 5, 6, 7, 2, 3. So `kv_index = [0, 1, 0, 1, 4, 5, 6, 7, 2, 3]`, and the one kernel call
sees two sequences, `actual_seq_qlen = [2, 4]`, `actual_seq_kvlen = [2, 10]`. Rank 1's
chunks 1 and 2 need 4 and 6 keys: work `2 * 4 + 2 * 6 = 20`, the same as rank 0's
`2 * 2 + 2 * 8 = 20`. The figure at the end of the page draws a two-document example.

## The code

--8<-- "src/cpref/modes/all_gather.py:forward"

--8<-- "src/cpref/modes/all_gather.py:backward"

**Cost per rank** (forward, `T` tokens, `P` ranks): all-gather traffic
$2 (P - 1) \\frac{T}{P} H_{kv} D$ elements, work $(2P + 1) \\sum_i c_i^2$ score entries per
head; the backward moves the same volume through the reduce-scatter. Memory: the gathered
K/V of the whole stream, the price of this mode's simplicity.

Partial gradients are accumulated in float32 (float64 for float64) by `index_add_` and
rounded once to the input dtype before the reduce-scatter, so low-precision error does not
grow with the number of chunks a key row appears in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from cpref.comm import Collectives
from cpref.kernels.contract import AttentionKernel

__all__ = ["AllGatherKVFunc", "AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced", "all_gather_forward", "all_gather_backward"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --8<-- [start:forward]
def all_gather_forward(q, k, v, meta, comm: Collectives, kernel: AttentionKernel, *, causal: bool, scale: float):
    """Forward of KV all-gather CP. Returns `(out, lse, k_sel, v_sel)`."""
    # 1) gather every rank's K and V, rank-major
    k_all = comm.all_gather(k)  # (T_l, Hkv, D) -> (P T_l, Hkv, D)
    v_all = comm.all_gather(v)  # (T_l, Hkv, Dv) -> (P T_l, Hkv, Dv)
    # 2) pick each local query chunk's keys (causal prefix of its document), natural order
    k_sel = k_all.index_select(0, meta["kv_index"])  # (sum kv_len, Hkv, D)
    v_sel = v_all.index_select(0, meta["kv_index"])  # (sum kv_len, Hkv, Dv)
    # 3) one fused varlen call for all local chunks, bottom-right causal per chunk
    out, lse = kernel.forward(
        q, k_sel, v_sel, meta["seqs"], causal=causal, scale=scale
    )  # (T_l, Hq, Dv), (T_l, Hq)
    return out, lse, k_sel, v_sel
# --8<-- [end:forward]


# --8<-- [start:backward]
def all_gather_backward(dout, q, k_sel, v_sel, out, lse, meta, comm: Collectives, kernel: AttentionKernel, *, causal, scale):
    """Backward of KV all-gather CP. Returns `(dq, dk, dv)` for the local shards."""
    # 1) one fused backward call for all local chunks
    dq, dk_sel, dv_sel = kernel.backward(
        dout, q, k_sel, v_sel, out, lse, meta["seqs"], causal=causal, scale=scale
    )  # (T_l, Hq, D), (sum kv_len, Hkv, D), (sum kv_len, Hkv, Dv)
    rows = comm.size * meta["local_tokens"]
    acc = _acc_dtype(dk_sel.dtype)
    # 2) sum each key row's gradient over this rank's chunks, into a rank-major buffer
    dk_all = dk_sel.new_zeros((rows, *dk_sel.shape[1:]), dtype=acc).index_add_(0, meta["kv_index"], dk_sel.to(acc))
    dv_all = dv_sel.new_zeros((rows, *dv_sel.shape[1:]), dtype=acc).index_add_(0, meta["kv_index"], dv_sel.to(acc))
    # 3) sum over ranks and return every row to its owner
    dk = comm.reduce_scatter(dk_all.to(dk_sel.dtype))  # (P T_l, Hkv, D) -> (T_l, Hkv, D)
    dv = comm.reduce_scatter(dv_all.to(dv_sel.dtype))  # (P T_l, Hkv, Dv) -> (T_l, Hkv, Dv)
    return dq, dk, dv
# --8<-- [end:backward]


class AllGatherKVFunc(torch.autograd.Function):
    """Autograd Function: all-gather K/V forward, reduce-scatter dK/dV backward.

    Use through [`cpref.attention`][cpref.api.attention] with `mode="all_gather"`, which
    validates the input and builds the metadata first.
    """

    @staticmethod
    def forward(ctx: Any, q, k, v, meta, comm, kernel, causal: bool, scale: float):
        out, lse, k_sel, v_sel = all_gather_forward(q, k, v, meta, comm, kernel, causal=causal, scale=scale)
        ctx.save_for_backward(q, k_sel, v_sel, out, lse)
        ctx.meta, ctx.comm, ctx.kernel, ctx.causal, ctx.scale = meta, comm, kernel, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout):
        q, k_sel, v_sel, out, lse = ctx.saved_tensors
        dq, dk, dv = all_gather_backward(
            dout.contiguous(), q, k_sel, v_sel, out, lse, ctx.meta, ctx.comm, ctx.kernel,
            causal=ctx.causal, scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None


# The RFC's name for the same Function.
AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced = AllGatherKVFunc
