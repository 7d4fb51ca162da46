r"""Ring attention (p2p): K and V travel around the CP ring, partial results merge by their lse.

Each rank keeps its queries; the K/V blocks circulate. At step $t = 0, \dots, P - 1$ rank
$r$ holds the block that started on rank $(r - t) \bmod P$ and computes its queries' attention
against it; between steps every rank sends its block to rank $r + 1$ and receives the block of
rank $r - 1$ (`send_recv`, shift 1). Each step's partial result merges into the rank's running
output by log-sum-exp. No rank ever holds more than two blocks: memory stays at $\frac{T}{P}$
rows whatever `P` is, the point of ring attention (Liu et al. 2023). Here is a real forward on
the simulated cluster, step by step:

{{ figure figures/ring_forward.png }}

## The forward

A step computes what the step's plan says (`cpref.modes.ring_plan`): one varlen kernel call
for every document, with the causal work skipping of the layout. In the zigzag layout every
rank does the same work at every step; in the contiguous one a rank skips the blocks of the
ranks after it, and the last rank works at every step:

{{ figure figures/ring_schedule.png }}

The kernel returns the block's output $O_b$ and log-sum-exp $\mathrm{lse}_b$ unrounded (float32;
float64 for float64 inputs). The first block's are the running $(O, \mathrm{lse})$; every later
one is folded in by [`merge_partial`][cpref.kernels.merge.merge_partial], both right-hand sides
from the values before the step ([Merging partial results][cpref.kernels.merge]):

$$ O \leftarrow \sigma(\mathrm{lse} - \mathrm{lse}_b)\, O + \sigma(\mathrm{lse}_b - \mathrm{lse})\, O_b , \qquad
   \mathrm{lse} \leftarrow \max(\mathrm{lse}, \mathrm{lse}_b) + \log\left(1 + e^{-|\mathrm{lse} - \mathrm{lse}_b|}\right) . $$

The shift of step $t + 1$ is **posted before** step $t$ computes (`send_recv_async`), and
waited for only after: on real process groups the transfer of the next block runs while the
kernel works on the current one. The block being sent is never modified, as the protocol
requires.

--8<-- "src/cpref/modes/ring.py:forward"

Under a sliding window, or with the stream or balanced layout, each rank receives, directly
from the ranks whose keys it reads, only the rows it reads: [the ring under a sliding
window][cpref.modes.ring_window], the same Function on another plan.

## The backward

The backward recomputes every block from the saved **global** lse (the kernel contract's
backward with the row's full lse gives this call's share of the gradients). $dQ$ stays home
and accumulates. $dK$ and $dV$ travel with their block: at step $t$ the rank adds its share to
the block's accumulator, which then moves on with the block; after the last step one more
shift brings every accumulator home, holding the contributions of all `P` ranks. The
accumulators are float32 (float64 for float64 inputs) and are rounded to the input dtype
once, at their owner, so bf16 error does not grow with `P`. A real backward, step by step:

{{ figure figures/ring_backward.png }}

--8<-- "src/cpref/modes/ring.py:backward"

## Cost per rank

Forward: $P - 1$ shifts of the packed K/V block, $(P - 1) \frac{T}{P} H_{kv} (D + D_v)$ elements
in the input dtype, and one kernel call per step that has work ($P$ zigzag, $r + 1$ contiguous
causal). Backward: $P - 1$ K/V shifts again plus $P$ shifts of the float32 dK/dV accumulators,
$P \frac{T}{P} H_{kv} (D + D_v)$ elements of 4 bytes. Saved for backward: the local `q, k, v`,
`out` (float32, see Precision) and the float32 lse,
$\frac{T}{P}\big(b\,(H_q D + H_{kv} D + H_{kv} D_v) + 4 H_q D_v + 4 H_q\big)$ bytes for
$P > 1$, falling as $1/P$.

## Precision

**The output kept for the backward.** The block outputs come from the kernel in float32
(`out_dtype`), the merge runs in float32, and the output is rounded once. No kernel call of the
backward sees a whole row, so the kernel cannot recompute the row's output (`full_rows`); it
computes $\Delta = \mathrm{rowsum}(dO \circ O)$ from the output it is given. The Function
therefore keeps the merged output **unrounded** (float32) for the backward, at
$T_l H_q D_v (f - b)$ more saved bytes than the rounded one. $\Delta$ from a bf16 $O$ would make
gradient errors grow with the logit scale: the partial gradient $dS = P \circ (dP - \Delta)$ is
a small difference of large terms wherever attention is peaked. Measured on three documents of
about 130 tokens in bf16 at 4 times the default scale, $P = 4$: the largest dQ error is 0.05
from a bf16 $O$ (twice bf16's 2.5e-2 tolerance) and 0.003 from the float32 one, as at $P = 1$.
The NPU's fused op takes its `attention_in` in the input dtype, so on Ascend $\Delta$ still
comes from the rounded output.

**The merged lse at large logits.** The backward recomputes every probability from the row's
merged lse, $P_{xy} = e^{S_{xy} - \mathrm{lse}_x}$, so an error $\delta$ in $\mathrm{lse}_x$ is a
relative error of about $\delta$ in every probability of the row, and in its share of
$dV = P^\top dO$ directly. A float32 lse of magnitude $2^e$ is held to steps of $2^{e - 23}$:
$2^{-10}$ at logits of $10^4$ (inputs x100 at $D = 16$), $\frac{1}{8}$ at $10^6$ (x1000).
Without CP the kernel returns $\mathrm{lse} = m + \log \ell$ with $m$ the row's largest float32
logit, which is exactly $m$ where one key dominates: there $e^{S - \mathrm{lse}} = 1$ exactly.
The merge above keeps that: its lse is the larger of the two plus a term in $[0, \log 2]$ taken
from their difference, so a dominating block's lse and output come through bit for bit, and
otherwise it rounds once. The equivalent form
$\mathrm{lse} \leftarrow \mathrm{lse} - \log\sigma(\mathrm{lse} - \mathrm{lse}_b)$ does not: for a
dominating block it computes $\mathrm{lse} + (\mathrm{lse}_b - \mathrm{lse})$, two roundings at
the magnitude of $|\mathrm{lse}| + |\mathrm{lse}_b|$ (blocks of opposite signs are common at such
logits), up to a step off $\mathrm{lse}_b$: every probability of the row up to 13 % off at
$10^6$. Measured in float32 on three documents of 24 to 64 tokens, $D = 16$, $P = 2$ and 4, the
worst of three batches (relative error $\max|x - x^\ast| / \max|x^\ast|$ against FP64):

| inputs | dV at $P = 1$ | ring, merging by $-\log\sigma$ | ring, merging as above |
| --- | --- | --- | --- |
| x100 | 9.2e-5 | 7.5e-4 | 9.2e-5 |
| x1000 | 9.1e-8 | 8.5e-2 | 1.3e-7 |

What is left is the kernel contract's float32 lse: each block's lse comes rounded once (half a
step), where $P = 1$ weighs the keys of a row by their logits within one call. Over the
batches every mode stays within 1.4 times the error of the kernel without CP, inputs x1 to
x1000, fp32 and bf16 (`tests/cp/test_relative_precision.py`; the criterion is the `vs P=1`
column of `python -m sim verify`, at most 2). A float64 running lse changes nothing
measurable, at $P = 8$ neither, since the blocks' lse arrive rounded; a kernel returning each
block's maximum and sum would remove that rounding, but PyTorch's fused op returns only the
float32 lse.
"""

from __future__ import annotations

from typing import Any

import torch

from cpref.base.determinism import add_rows
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import NO_WINDOW, AttentionKernel, compute_dtype
from cpref.kernels.merge import merge_partial
from cpref.kernels.sinks import add_sinks, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.costs import ModeCosts, halo_costs, kept_output_bytes, ring_costs, shard_bytes
from cpref.modes.mask_plan import mask_ring_plan, stacked_runs
from cpref.modes.ring_plan import RingCall, RingPlan, build_ring_plan
from cpref.modes.ring_window import build_window_ring_plan, halo_backward, halo_forward
from cpref.modes.shared import no_double_backward
from cpref.modes.spec import ModeSpec

__all__ = ["RingFunc", "ring_forward", "ring_backward", "ring_plan", "run_ring", "saved_out_dtype", "p2p_plan",
           "p2p_costs", "MODE"]


def _block(kv: torch.Tensor, call: RingCall, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's keys and values from the packed block `(T_l, Hkv, D + Dv)`."""
    kv = kv if call.kv_index is None else kv.index_select(0, call.kv_index)  # (T', Hkv, D + Dv)
    return kv[..., :d], kv[..., d:]  # (T', Hkv, D), (T', Hkv, Dv)


# --8<-- [start:forward]
def ring_forward(q, k, v, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float, out_dtype=None):
    """Forward of ring attention. Returns `(out (T_l, Hq, Dv), lse (T_l, Hq))`, out in `out_dtype`
    (default: the input dtype; the compute dtype gives the unrounded merged output)."""
    if plan.halo is not None:  # a sliding window: only the ranks and rows it reaches (cpref.modes.ring_window)
        return halo_forward(q, k, v, plan, comm, kernel, scale=scale, out_dtype=out_dtype)
    acc, d, S = compute_dtype(q.dtype), k.shape[-1], len(plan.steps)
    if plan.whole_rows:  # a ring of one: one kernel call on the own block sees every key
        call = plan.steps[0].calls[0]
        return kernel.forward(q, k, v, call.seqs, causal=call.causal, window=call.window, scale=scale, out_dtype=out_dtype)
    out = lse = None  # the running (T_l, Hq, Dv) output and (T_l, Hq) lse: the first block's, then merged
    kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv): one block travels
    for t, step in enumerate(plan.steps):
        # 1) post the shift that brings the next block, before computing on this one
        pending = comm.send_recv_async(kv) if t + 1 < S else None
        # 2) this block's share of every query's attention (nothing if the step is skipped)
        for call in step.calls:
            kb, vb = _block(kv, call, d)
            out_b, lse_b = kernel.forward(q, kb, vb, call.seqs, causal=call.causal, window=call.window, scale=scale,
                                          out_dtype=acc)  # fmt: skip
            # 3) merge by log-sum-exp, in float32 (the first block computed is the running result)
            if out is None:
                out, lse = out_b, lse_b
            else:
                merge_partial(out, lse, out_b, lse_b)
        # 4) the block of rank (r - t - 1) mod P
        if pending is not None:
            kv = pending.wait()
    if out is None:  # no step computed anything (no query sees a key): out 0, lse -inf
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    return out.to(out_dtype or q.dtype), lse
# --8<-- [end:forward]


# --8<-- [start:backward]
def ring_backward(dout, q, k, v, out, lse, plan: RingPlan, comm: Collectives, kernel: AttentionKernel, *, scale: float,
                  kv_grad_dtype=None, deterministic: bool = False):  # fmt: skip
    """Backward of ring attention. Returns `(dq, dk, dv)` for the local shards, dK/dV in `kv_grad_dtype`
    (default: the input dtypes; the compute dtype gives them unrounded, for a caller that sums them);
    `deterministic`: duplicated rows summed in occurrence layers (`cpref.base.determinism`)."""
    if plan.halo is not None:  # a sliding window (cpref.modes.ring_window)
        return halo_backward(dout, q, k, v, out, lse, plan, comm, kernel, scale=scale, kv_grad_dtype=kv_grad_dtype,
                             deterministic=deterministic)  # fmt: skip
    acc, d, S = compute_dtype(q.dtype), k.shape[-1], len(plan.steps)
    if plan.whole_rows:  # a ring of one: one kernel call, whose rows are whole
        call = plan.steps[0].calls[0]
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, call.seqs, causal=call.causal, window=call.window,
                                     scale=scale, full_rows=True, grad_dtype=kv_grad_dtype)  # fmt: skip
        return dq.to(q.dtype), dk, dv
    kv = torch.cat([k, v], dim=-1)  # (T_l, Hkv, D + Dv)
    home = (1 - S) % comm.size  # after the last step, the accumulators go back to their owners (1: the ring closes)
    dq = None  # (T_l, Hq, D), stays home: the first block's share, then summed
    dkv = None  # (T_l, Hkv, D + Dv): the accumulator of the block held now (the own block first)
    pending_dkv = None
    for t, step in enumerate(plan.steps):
        # 1) post the next K/V block
        pending_kv = comm.send_recv_async(kv) if t + 1 < S else None
        # 2) this block's share of the gradients, recomputed from the global lse, one call at a time
        dkv_b = None
        for call in step.calls:
            kb, vb = _block(kv, call, d)
            dq_b, dk_b, dv_b = kernel.backward(
                dout, q, kb, vb, out, lse, call.seqs, causal=call.causal, window=call.window, scale=scale, grad_dtype=acc
            )  # (T_l, Hq, D), (T', Hkv, D), (T', Hkv, Dv)
            dq = dq_b if dq is None else dq.add_(dq_b)
            part = torch.cat([dk_b, dv_b], dim=-1)  # (T', Hkv, D + Dv)
            del dq_b, dk_b, dv_b, kb, vb  # freed before the next kernel call
            if call.kv_index is not None:  # back to the block's rows, adding up duplicated rows
                part = add_rows(part.new_zeros(kv.shape) if dkv_b is None else dkv_b, call.kv_index, part,
                                deterministic=deterministic)  # fmt: skip
            elif dkv_b is not None:
                part = dkv_b.add_(part)
            dkv_b = part  # (T_l, Hkv, D + Dv)
        # 3) the accumulator of the block held now arrives from the previous rank; add this share
        if pending_dkv is not None:
            dkv = pending_dkv.wait()
        if dkv is None:  # step 0 without a share: the own block's gradient starts at 0
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device) if dkv_b is None else dkv_b
        elif dkv_b is not None:
            dkv += dkv_b
        dkv_b = None  # freed before the next step's kernel call
        # 4) pass it on with the block; after the last step this brings it home (a ring of one step never left it)
        pending_dkv = comm.send_recv_async(dkv, 1 if t + 1 < S else home) if S > 1 else None
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:
        dkv = pending_dkv.wait()  # (T_l, Hkv, D + Dv): every rank's contributions to the own block
    dq = torch.zeros(q.shape, dtype=acc, device=q.device) if dq is None else dq  # no step computed: zero
    return dq.to(q.dtype), dkv[..., :d].to(kv_grad_dtype or k.dtype), dkv[..., d:].to(kv_grad_dtype or v.dtype)
# --8<-- [end:backward]


class RingFunc(torch.autograd.Function):
    """Autograd Function: K/V around the ring forward; K/V and dK/dV around the ring backward."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan, comm, kernel, scale: float, deterministic: bool = False, sinks=None):
        """`ring_forward`, the sinks added once to the merged rows; save the local q, k, v, the output (unrounded,
        see Precision) and the global lse."""
        saved = saved_out_dtype(q.dtype, plan)
        out, lse = ring_forward(q, k, v, plan, comm, kernel, scale=scale,
                                out_dtype=saved if sinks is None else compute_dtype(q.dtype))  # fmt: skip
        if sinks is not None:  # once, after every step's merge (cpref.kernels.sinks)
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out.to(saved), lse, sinks)
        ctx.plan, ctx.comm, ctx.kernel, ctx.scale, ctx.deterministic = plan, comm, kernel, scale, deterministic
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout):
        """`ring_backward`: K/V and their dK/dV accumulators around the ring once more; the sinks' gradient from
        this rank's rows."""
        no_double_backward()
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.comm, ctx.kernel, scale=ctx.scale,
                                   deterministic=ctx.deterministic)  # fmt: skip
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, None, None, None, dsinks


def saved_out_dtype(dtype: torch.dtype, plan: RingPlan) -> torch.dtype:
    """The dtype the backward's output is kept in: the compute dtype when the ring has more than one
    step (no kernel call sees a whole row, so the kernel computes Delta from this output), else
    the input dtype (the one call recomputes its rows itself, `full_rows`)."""
    return dtype if plan.whole_rows else compute_dtype(dtype)


def ring_plan(call: CPCall, P: int, rank: int, layout: str, group: int = 1) -> RingPlan:
    """The cached ring plan of member `rank` in a ring of `P` over the call's batch (under its window and chunks, if any);
    each member a group of `group` consecutive ranks (the ring of `a2a+p2p`) holding `cpref.batch.layout.group_chunks`.
    Under a mask, a member's buffer holds its ranks' shards one after the other (rank-major, as the exchange leaves
    them)."""
    if call.mask is not None:  # a mask: the calls its slices make, and the rows they read (cpref.modes.mask_plan)
        return call.plan(("ring mask", P, rank, layout, group, str(call.device), call.mask), lambda: mask_ring_plan(
            call.mask.slices, [stacked_runs(call.bounds, P * group, layout, range(m * group, (m + 1) * group))
                               for m in range(P)], rank, call.device))  # fmt: skip
    if P == 1:  # one member holds the batch in natural order, one sequence a document, whatever the layout
        layout, group = "contiguous", 1
    key = ("ring", P, rank, layout, call.causal, str(call.device))
    if call.window != NO_WINDOW or call.chunk is not None or layout not in CHUNKED_LAYOUTS:
        # only the rows each rank reads (ring_window); chunked attention's as a window's (cpref.modes.visible)
        return call.plan(key + (call.window, group, call.chunk), lambda: build_window_ring_plan(
            call.bounds, P, rank, layout, call.causal, call.window, call.device, group, call.chunk))  # fmt: skip
    # the chunked layouts nest: a group of `group` ranks holds the layout's chunks over P members (group_chunks)
    return call.plan(key, lambda: build_ring_plan(call.bounds, P, rank, layout, call.causal, call.device))


def p2p_plan(call: CPCall) -> RingPlan:
    """This rank's plan in the ring of all P ranks, from the batch cache."""
    return ring_plan(call, call.P, call.rank, call.layout)


def run_ring(q, k, v, call: CPCall, comm: Collectives) -> torch.Tensor:
    """Run the mode: this rank's ring plan, then the Function."""
    return RingFunc.apply(q, k, v, p2p_plan(call), comm, call.kernel, call.scale, call.deterministic, call.sinks)


def p2p_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows, window) -> ModeCosts:
    """Per-rank traffic, collectives and saved bytes of one layer: a ring of P (or, under a window, the shifts
    of `halo_sizes` rows), the output kept unrounded."""
    if halo_sizes is not None:
        ring = halo_costs(halo_sizes, heads, heads[1], dtype)
        saved = shard_bytes(local_tokens, heads, dtype) + kept_output_bytes(2, local_tokens, heads, dtype)
        return ModeCosts(ring.forward_bytes, ring.backward_bytes, ring.forward_ops, ring.backward_ops, saved)
    ring = ring_costs(P, local_tokens, heads[1], heads, dtype)
    saved = shard_bytes(local_tokens, heads, dtype) + kept_output_bytes(P, local_tokens, heads, dtype)
    return ModeCosts(ring.forward_bytes, ring.backward_bytes, ring.forward_ops, ring.backward_ops, saved)


def p2p_sizes(call: CPCall) -> dict:
    """The rows its shifts carry, where the plan sends only what is read (a window, stream, balanced)."""
    halo = p2p_plan(call).halo
    return {"halo_sizes": None if halo is None else halo.sizes}


MODE = ModeSpec(
    name="p2p",
    order=1,
    run=run_ring,
    plan=p2p_plan,
    collectives=frozenset({"send_recv"}),
    costs=p2p_costs,
    sizes=p2p_sizes,
    windows=True,
    variants=frozenset({"chunk", "sinks", "mask"}),
)
