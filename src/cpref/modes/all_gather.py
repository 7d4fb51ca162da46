r"""KV all-gather CP with EOD-aware load balancing on THD (the MindSpeed RFC).

Each rank keeps its queries and gathers everyone's keys and values: after one all-gather of
`K` and one of `V`, a rank can compute the exact attention of its local queries, because
every key its queries may see is now local. This is the Llama 3 scheme; the MindSpeed RFC
makes it efficient on packed (THD) batches with three ideas.

1. **Symmetric per-document chunks.** Every document is split into `2P` chunks and rank `r`
   holds chunks `r` and `2P - 1 - r` (the zigzag layout, `cpref.batch.layout`), so every rank does
   the same causal work, $(2P + 1) \sum_i c_i^2$.
2. **Rank-major direct indexing.** The gathered K/V stay in rank-major order; one
   `index_select` with the precomputed `kv_index` (`cpref.modes.all_gather_plan`) picks, for each local
   query chunk, the causal prefix of its document in natural order. No full reorder of the
   stream, and no restore of the output.
3. **One fused call.** Both local query chunks of every document go to **one** varlen
   attention call: chunk `j` with its prefix of `(j + 1) c_i` keys is one sequence, and the
   kernel's bottom-right causal mask aligns its last query with its last key.

The three at work on two documents at `P = 2`: each rank's chunks, the buffer after the
all-gather, and the rows each query chunk's `kv_index` picks.

{{ figure figures/rank_major_index.png }}

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
`2 * 2 + 2 * 8 = 20`.

## The backward

The backward mirrors the forward with the matching collective:

$$ \text{forward: } K_{all} = \mathrm{AllGather}(K), \qquad
   \text{backward: } dK = \mathrm{ReduceScatter}\big(\mathrm{index\_add}(0, dK_{sel})\big) $$

A key row appears in the prefixes of several query chunks, on several ranks; `index_add_`
sums its gradient over this rank's chunks into a rank-major buffer, and the reduce-scatter
sums over ranks and hands every row back to its owner.

With the stream and balanced layouts, which keep documents whole where they can, the plan
gathers only the rows other ranks read ([the all-gather over pieces][cpref.modes.all_gather_pieces]);
the Function is the same.

## The code

--8<-- "src/cpref/modes/all_gather.py:forward"

--8<-- "src/cpref/modes/all_gather.py:backward"

## Memory: two schedules for the backward

The backward needs the selected K/V again. Keeping them from the forward costs
$\sum \mathrm{kv\_len} \approx \frac{2P + 1}{2P}\, T$ rows per layer per rank (causal,
zigzag): more than the whole stream, so activation memory would no longer fall with `P`,
which is what CP is for. By default cpref saves only the **local shards** (`q, k, v, out,
lse`: $\frac{T}{P}$ rows) and **gathers K and V again** in the backward, TransformerEngine's
choice: two more all-gathers per layer, in exchange for memory that falls as $1/P$. With
`save_gathered_kv=True` the forward's `k_sel, v_sel` are kept instead (no extra
communication, for when memory is not the limit). Bytes saved for backward per rank, with
$b$ bytes per element and float32 lse, by default

$$ \frac{T}{P} \big( b\,(H_q D + H_{kv} D + H_{kv} D_v + H_q D_v) + 4 H_q \big), $$

and with `save_gathered_kv`

$$ \frac{T}{P} \big( b\,(H_q D + H_q D_v) + 4 H_q \big) + \textstyle\sum \mathrm{kv\_len} \cdot b\, H_{kv} (D + D_v) . $$

## Cost per rank

Forward, per rank and layer: two all-gathers (K and V) moving
$(P - 1) \frac{T}{P} H_{kv} (D + D_v)$ elements, and one kernel call of
$(2P + 1) \sum_i c_i^2$ score entries per head (block metric, zigzag, causal). Backward: the
default schedule all-gathers K and V again (the same volume, in the input dtype) and
reduce-scatters dK and dV (the same number of elements, in float32: twice the bytes for bf16
input; see Precision); with `save_gathered_kv` only the reduce-scatters. One kernel call each
way.

K and V travel as two collectives each way, not as one of `[K | V]` concatenated along the
head dim (what the ring sends, and PyTorch's CP gathers): one call would save a collective's
latency, but every gathered row would then be twice as wide for the `index_select`, and the
backward's `index_add_` would write each half of a row with a stride, or copy dK and dV into
one buffer. On the CPU, at 16k tokens, those copies took longer than the saved collective.

At $P = 1$ the local K/V already are every key in
order, so the plan (see [Load-balanced metadata][cpref.modes.all_gather_plan]) has no
`kv_index` and its sequences send the kernel straight to them: no collective, no `index_select`, no `index_add_`.

## Overlap

With `overlap=True` the same plan runs another schedule
([the all-gather overlap][cpref.modes.all_gather_overlap]): the all-gathers are posted first and
the attention of the keys each rank holds is computed while they travel; the gathered keys'
share follows, merged by lse; the backward hides the re-gather and the reduce-scatter behind two
halves of the local work. It moves the same bytes in the same collectives and computes the same
scores, in two kernel calls forward and three backward instead of one each (two backward with
`save_gathered_kv`; one fewer each way on a rank that reads no other rank's key, rank 0 of the
contiguous layout under a causal mask). The default is the
one call, by this rule, measured side by side in `bench/scaling.py` (the performance page):

--8<-- "src/cpref/modes/all_gather.py:rule"

## Precision

Every query sees all its keys in the one kernel call, so the backward asks the kernel for
`full_rows=True` (see the [kernel contract](kernel-contract.md)): $\Delta$ comes from float32
probabilities, not from the output rounded to bf16, so dQ's bf16 error does not grow with the
logit scale.

dK and dV are sums of partial gradients: a key row appears in at most two key sequences of one
rank (one per local chunk), and on up to `P` ranks. The kernel returns the partials unrounded
(`grad_dtype=float32`, float64 for float64), `index_add_` sums a rank's in that precision, and
the reduce-scatter sums the ranks' **in float32 too**; the result is rounded to the input dtype
once, at the end. Rounding each rank's sum to bf16 before the reduce-scatter (what a
reduce-scatter in the input dtype does) would cost half the bytes, but the partials of one key
grow with the logit scale and cancel across ranks, so the rounding error of each would
survive in a much smaller sum. Measured on three documents of about 130 tokens in bf16: at
4 times the default scale the largest dK error grows from 0.003 at `P = 1` to 0.02 at `P = 2`
and 0.03 at `P = 4` (past bf16's 2.5e-2 tolerance) with a bf16 reduce-scatter, and stays at 0.003
with a float32 one. The ring's dK/dV accumulators travel in float32 for the same reason. The
simulated cluster's `reduction="native"` sums in the dtype it is given, as NCCL and HCCL do,
and the low-precision tests use it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from cpref.base.checks import as_bool
from cpref.base.determinism import add_rows
from cpref.base.errors import CPInputError
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import NO_WINDOW, AttentionKernel, compute_dtype
from cpref.kernels.sinks import add_sinks, sinks_grad
from cpref.modes.all_gather_mask import MaskedAllGatherFunc, mask_gather_plan
from cpref.modes.all_gather_overlap import OverlapPlan, build_overlap_plan, overlap_backward, overlap_forward
from cpref.modes.all_gather_pieces import build_piece_all_gather_plan
from cpref.modes.all_gather_plan import AllGatherPlan, build_all_gather_plan
from cpref.modes.call import CPCall
from cpref.modes.costs import ModeCosts, element_bytes, kept_output_bytes, shard_bytes
from cpref.modes.shared import no_double_backward, padded_rows, whole_documents
from cpref.modes.spec import ModeSpec, Option

__all__ = [
    "AllGatherKVFunc",
    "AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced",
    "all_gather_forward",
    "all_gather_backward",
    "all_gather_plan",
    "run_all_gather",
    "all_gather_costs",
    "MODE",
]


def gather_selected(k, v, plan: AllGatherPlan, comm: Collectives) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather K and V (rank-major) and select each query sequence's keys: `(k_sel, v_sel)`."""
    if plan.kv_index is None:  # P = 1: the local K/V are every key, in order (see the plan)
        return k, v
    if plan.shared is not None:  # only the rows others read, after the local shard (cpref.modes.all_gather_pieces)
        k_src, v_src = (_with_shared(x, plan, comm) for x in (k, v))  # (T_l + P m, Hkv, D | Dv)
        return k_src.index_select(0, plan.kv_index), v_src.index_select(0, plan.kv_index)
    k_all = comm.all_gather(k)  # (T_l, Hkv, D) -> (P T_l, Hkv, D)
    v_all = comm.all_gather(v)  # (T_l, Hkv, Dv) -> (P T_l, Hkv, Dv)
    k_sel = k_all.index_select(0, plan.kv_index)  # (sum kv_len, Hkv, D)
    v_sel = v_all.index_select(0, plan.kv_index)  # (sum kv_len, Hkv, Dv)
    return k_sel, v_sel


def _with_shared(x: torch.Tensor, plan: AllGatherPlan, comm: Collectives) -> torch.Tensor:
    """The local shard followed by every rank's shared rows, rank-major: `(T_l + P m, ...)` (no gather if m = 0)."""
    if not plan.gathered_rows:
        return x
    mine = padded_rows(x, plan.shared, plan.gathered_rows)  # (m, ...): this rank's shared rows, then zeros
    return torch.cat([x, comm.all_gather(mine)])


# --8<-- [start:forward]
def all_gather_forward(q, k, v, plan: AllGatherPlan, comm: Collectives, kernel: AttentionKernel, *, causal: bool, scale: float,
                       sinks=None):  # fmt: skip
    """Forward of KV all-gather CP. Returns `(out, lse, k_sel, v_sel)`; with `sinks`, added to the one call's rows."""
    # 1) gather every rank's K and V, rank-major; 2) pick each query sequence's keys, natural order
    k_sel, v_sel = gather_selected(k, v, plan, comm)  # (sum kv_len, Hkv, D), (sum kv_len, Hkv, Dv)
    # 3) one fused varlen call for all local chunks, bottom-right causal per chunk
    out, lse = kernel.forward(q, k_sel, v_sel, plan.seqs, causal=causal, window=plan.window, scale=scale,
                              out_dtype=None if sinks is None else compute_dtype(q.dtype))  # (T_l, Hq, Dv), (T_l, Hq)
    if sinks is not None:  # the one call sees every key of its rows: the sink enters here, once
        out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
    return out, lse, k_sel, v_sel
# --8<-- [end:forward]


# --8<-- [start:backward]
def all_gather_backward(dout, q, k_sel, v_sel, out, lse, plan: AllGatherPlan, comm: Collectives, kernel: AttentionKernel, *, causal, scale,
                        deterministic: bool = False):  # fmt: skip
    """Backward of KV all-gather CP. Returns `(dq, dk, dv)` for the local shards (`deterministic`: the row sums in
    occurrence layers, `cpref.base.determinism`)."""
    if plan.kv_index is None:  # P = 1: nothing was selected, the kernel's gradients are the local ones
        return kernel.backward(dout, q, k_sel, v_sel, out, lse, plan.seqs, causal=causal, window=plan.window, scale=scale,
                               full_rows=True)  # fmt: skip
    acc, rows = compute_dtype(q.dtype), comm.size * q.shape[0]  # rows of the rank-major buffer: P T_l
    # 1) one fused backward call for all local chunks; dK/dV partials unrounded (float32)
    dq, dk_sel, dv_sel = kernel.backward(
        dout, q, k_sel, v_sel, out, lse, plan.seqs, causal=causal, window=plan.window, scale=scale, full_rows=True,
        grad_dtype=acc,
    )  # (T_l, Hq, D), (sum kv_len, Hkv, D), (sum kv_len, Hkv, Dv); every query sees all its keys here
    if plan.shared is not None:  # the local part stays, the gathered part goes home (cpref.modes.all_gather_pieces)
        dk, dv = (_shared_grad(g, plan, comm, q.shape[0], deterministic) for g in (dk_sel, dv_sel))
        return dq.to(q.dtype), dk.to(k_sel.dtype), dv.to(v_sel.dtype)
    # 2) sum each key row's gradient over this rank's chunks, into a rank-major buffer, in float32
    dk_all = add_rows(dk_sel.new_zeros((rows, *dk_sel.shape[1:])), plan.kv_index, dk_sel, deterministic=deterministic)  # (P T_l, Hkv, D)
    dv_all = add_rows(dv_sel.new_zeros((rows, *dv_sel.shape[1:])), plan.kv_index, dv_sel, deterministic=deterministic)  # (P T_l, Hkv, Dv)
    # 3) sum over ranks, still in float32, and return every row to its owner; round once, at the end
    dk = comm.reduce_scatter(dk_all).to(k_sel.dtype)  # (P T_l, Hkv, D) -> (T_l, Hkv, D)
    dv = comm.reduce_scatter(dv_all).to(v_sel.dtype)  # (P T_l, Hkv, Dv) -> (T_l, Hkv, Dv)
    return dq.to(q.dtype), dk, dv
# --8<-- [end:backward]


def _shared_grad(g_sel: torch.Tensor, plan: AllGatherPlan, comm: Collectives, t_l: int, deterministic: bool) -> torch.Tensor:
    """dK (or dV) of the local shard from the selected keys' partials: the local rows' sums, plus the shared
    rows' sums over the ranks that read them (one reduce-scatter of the gathered part, in float32)."""
    m = plan.gathered_rows
    g_src = add_rows(g_sel.new_zeros((t_l + comm.size * m, *g_sel.shape[1:])), plan.kv_index, g_sel, deterministic=deterministic)
    g = g_src[:t_l]  # (T_l, ...)
    if m:
        g.index_add_(0, plan.shared, comm.reduce_scatter(g_src[t_l:])[: len(plan.shared)])  # (P m) -> (m)
    return g


class AllGatherKVFunc(torch.autograd.Function):
    """Autograd Function: all-gather K/V forward; (gather again,) reduce-scatter dK/dV backward.

    Use through [`cpref.attention`][cpref.api.attention] with `mode="all_gather"`, which
    validates the input and builds the plan first. With an `OverlapPlan` the collectives are
    overlapped with the local keys' calls ([the all-gather overlap][cpref.modes.all_gather_overlap]).
    """

    @staticmethod
    def forward(ctx: Any, q, k, v, plan, comm, kernel, causal: bool, scale: float, save_gathered_kv: bool = False,
                ov: OverlapPlan | None = None, deterministic: bool = False, sinks=None):  # fmt: skip
        """All-gather K/V, one kernel call (or the overlapped two, merged), the sinks added once to the rows; save
        the local shards (or the selected K/V)."""
        ctx.plan, ctx.comm, ctx.kernel, ctx.causal, ctx.scale = plan, comm, kernel, causal, scale
        ctx.gathered, ctx.ov, ctx.deterministic = save_gathered_kv, ov, deterministic
        if ov is not None:  # the merged output kept unrounded: the backward's Delta comes from it (no full rows)
            out, lse, selected = overlap_forward(q, k, v, plan, ov, comm, kernel, causal=causal, scale=scale)
            if sinks is not None:  # once, after the two calls' merge
                out, lse = add_sinks(out, lse, sinks)
            ctx.save_for_backward(q, out, lse, sinks, *(selected if save_gathered_kv else (k, v)))
            return out.to(q.dtype)
        out, lse, k_sel, v_sel = all_gather_forward(q, k, v, plan, comm, kernel, causal=causal, scale=scale, sinks=sinks)
        # default: keep the local shards and gather again in the backward (memory falls as 1/P)
        ctx.save_for_backward(q, out, lse, sinks, *((k_sel, v_sel) if save_gathered_kv else (k, v)))
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        """(Gather K/V again,) one kernel call, index_add_ and reduce-scatter dK/dV (or the overlapped schedule);
        the sinks' gradient from this rank's rows."""
        no_double_backward()
        q, out, lse, sinks, *kv = ctx.saved_tensors
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        if ctx.ov is not None:
            k, v, selected = (None, None, kv) if ctx.gathered else (*kv, None)
            dq, dk, dv = overlap_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.ov, ctx.comm, ctx.kernel,
                                          causal=ctx.causal, scale=ctx.scale, selected=selected,
                                          deterministic=ctx.deterministic)  # fmt: skip
            return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks
        k_sel, v_sel = kv if ctx.gathered else gather_selected(*kv, ctx.plan, ctx.comm)
        dq, dk, dv = all_gather_backward(
            dout.contiguous(), q, k_sel, v_sel, out, lse, ctx.plan, ctx.comm, ctx.kernel,
            causal=ctx.causal, scale=ctx.scale, deterministic=ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks


# The RFC's name for the same Function.
AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced = AllGatherKVFunc


def all_gather_plan(call: CPCall) -> AllGatherPlan:
    """This rank's cached plan for the call: the selecting plan (the RFC's for the chunked layouts, the pieces'
    for stream and balanced), or at `P = 1` the documents over the local K/V."""
    if call.P == 1:  # the documents over the local K/V (the facade's selecting plan has another key)
        return call.plan(("all_gather local", call.window, call.chunk),
                         lambda: AllGatherPlan(None, whole_documents(call.bounds, call.chunk), call.window))
    key = ("all_gather", call.P, call.rank, call.layout, call.causal, str(call.device))  # metadata's facade shares it
    if call.window != NO_WINDOW:
        key += (call.window,)
    if call.chunk is not None:  # chunked attention: only the rows the chunks read travel, in every layout
        return call.plan(key + ("chunk", call.chunk), lambda: build_piece_all_gather_plan(
            call.bounds, call.P, call.rank, call.layout, call.causal, call.device, call.window, call.chunk))
    build = build_all_gather_plan if call.layout in CHUNKED_LAYOUTS else build_piece_all_gather_plan
    return call.plan(key, lambda: build(call.bounds, call.P, call.rank, call.layout, call.causal, call.device, call.window))


def run_all_gather(q, k, v, call: CPCall, comm: Collectives) -> torch.Tensor:
    """Run the mode: this rank's plan from the batch cache (and its overlap split, where the rule says so), then
    the Function; under a mask, the mask's plan ([`cpref.modes.all_gather_mask`][cpref.modes.all_gather_mask])."""
    if call.mask is not None:
        return MaskedAllGatherFunc.apply(q, k, v, mask_gather_plan(call), comm, call.kernel, call.scale,
                                         call.deterministic, call.options["save_gathered_kv"], call.sinks)  # fmt: skip
    plan = all_gather_plan(call)
    ov = None
    if overlaps(call.options["overlap"], call.P, call.window, gathered_rows(plan)):
        key = ("all_gather overlap", call.P, call.rank, call.layout, call.causal, str(call.device))
        ov = call.plan(key, lambda: build_overlap_plan(plan, call.rank, call.bounds.total // call.P, call.causal))
    return AllGatherKVFunc.apply(q, k, v, plan, comm, call.kernel, call.causal, call.scale, call.options["save_gathered_kv"],
                                 ov, call.deterministic, call.sinks)  # fmt: skip


# --8<-- [start:rule]
def overlaps(option: bool, P: int, window: tuple[int, int], gathered: int | None) -> bool:
    """Whether the mode overlaps its collectives (`cpref.modes.all_gather_overlap`) or makes the RFC's one call.

    Only where asked (`overlap=True`: on gloo over two cores its smaller waits did not reliably make up for its
    extra kernel calls, its merge and gloo's copies on the compute cores; `bench/scaling.py` measures both side
    by side, and the performance page shows its last run)
    and where something travels: not at `P = 1`, nor with a layout whose ranks read no other rank's key
    (`gathered == 0`).
    Never under a sliding window, which `overlap=True` is refused with (the split needs every key before a
    query's own piece to be seen by all of it).
    """
    return option and P > 1 and gathered != 0 and window == NO_WINDOW
# --8<-- [end:rule]


def gathered_rows(plan: AllGatherPlan) -> int | None:
    """The rows each rank all-gathers under `plan`: None for the whole shard, else the pieces' `gathered_rows`."""
    return None if plan.shared is None else plan.gathered_rows


def check_all_gather(call: CPCall) -> None:
    """Refuse `overlap=True` under a sliding window, chunked attention or a mask, before any communication."""
    if call.options["overlap"] is True and call.mask is not None and call.P > 1:
        raise CPInputError("mode='all_gather' with overlap=True does not run a mask (its two calls split the keys by "
                           "owner, not by the mask's slices); pass overlap=False with mask=")  # fmt: skip
    if call.options["overlap"] is True and call.chunk is not None and call.P > 1:
        raise CPInputError(
            f"mode='all_gather' with overlap=True: the overlap needs a plain causal or full mask, not chunk={call.chunk} "
            "(a chunk's keys are not all seen by every query of a piece); pass overlap=False to run the one-call "
            "path with chunks"
        )
    if call.options["overlap"] is True and call.window != NO_WINDOW and call.P > 1:
        raise CPInputError(
            f"mode='all_gather' with overlap=True: the overlap needs a plain causal or full mask, not window={call.window} "
            "(a window's keys are not all seen by every query of a piece); pass overlap=False to run the one-call "
            "path under a window"
        )


def all_gather_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows, window,
                     save_gathered_kv, overlap) -> ModeCosts:  # fmt: skip
    """Per-rank traffic, collectives and saved bytes of one layer (the table of `cpref.modes.costs`); with
    `gathered_rows` (stream, balanced: `cpref.modes.all_gather_pieces`) only those rows of each rank travel;
    overlapped (`overlaps`), the same traffic, the output kept unrounded."""
    hq, hkv, d, dv = heads
    t, (b, f) = local_tokens, element_bytes(dtype)
    rows = t if gathered_rows is None else gathered_rows  # what each rank contributes to the all-gather
    kept = kept_output_bytes(2, t, heads, dtype) if overlaps(overlap, P, window, gathered_rows) else 0
    fwd = (P - 1) * rows * hkv * (d + dv) * b
    saved = shard_bytes(t, heads, dtype)
    if save_gathered_kv:  # the query side as usual, and the selected K/V rows instead of the local shards
        saved = t * (b * (hq * d + hq * dv) + f * hq) + selected_kv_rows * hkv * (d + dv) * b
    bwd_ops = Counter(reduce_scatter=2) + (Counter() if save_gathered_kv else Counter(all_gather=2))
    bwd = (0 if save_gathered_kv else fwd) + (P - 1) * rows * hkv * (d + dv) * f  # re-gather, float32 dK/dV
    if rows == 0:  # nothing to gather: no collective at all
        return ModeCosts(0, 0, Counter(), Counter(), saved)
    return ModeCosts(fwd, bwd, Counter(all_gather=2), bwd_ops, saved + kept)


def all_gather_sizes(call: CPCall) -> dict:
    """The K/V rows its one call reads (kept with `save_gathered_kv`) and, where it gathers only what other ranks
    read (stream, balanced), the rows each rank contributes."""
    plan = all_gather_plan(call)
    return {"selected_kv_rows": plan.seqs.cu_kv[-1], "gathered_rows": None if plan.shared is None else plan.gathered_rows}


MODE = ModeSpec(
    name="all_gather",
    order=0,
    run=run_all_gather,
    plan=all_gather_plan,
    collectives=frozenset({"all_gather", "reduce_scatter"}),
    costs=all_gather_costs,
    sizes=all_gather_sizes,
    windows=True,
    variants=frozenset({"chunk", "sinks", "mask"}),
    check=check_all_gather,
    options=(
        Option("save_gathered_kv", False, lambda value: as_bool("save_gathered_kv", value),
               "keep the gathered K/V for the backward instead of gathering them again (faster backward; "
               "activation memory no longer falls with P)"),
        Option("overlap", False, lambda value: as_bool("overlap", value),
               "compute the local keys' attention while the other ranks' K/V travel, and in the backward while they "
               "travel again and their dK/dV go home (not under a window)"),
    ),
)
