r"""KV all-gather under a mask: gather only the rows another rank's queries read, then the mask's calls.

`mode="all_gather"` with `mask=` keeps the mode's shape (one all-gather of K and V forward, a
reduce-scatter of dK and dV backward) and lets the mask decide what travels, as the all-gather
over pieces does for the layouts that keep documents whole
([`cpref.modes.all_gather_pieces`][cpref.modes.all_gather_pieces]):

1. **What travels.** Rank $s$'s **shared rows** $S_s$ are the rows of its shard that some other
   rank's queries see under the mask (from the calls of every pair of ranks,
   [`cpref.modes.mask_plan`][cpref.modes.mask_plan]). Every rank sends its $S_s$, zero-padded to
   $m = \max_s |S_s|$ rows, in one all-gather: $P m$ rows of K and of V arrive, and
   $m \le T / P$. A prefix-LM or image-span batch of many short documents, each on a rank or two,
   moves only the rows of the documents that straddle ranks; a causal batch in zigzag still
   moves everything.
2. **The calls.** The rank's keys are its own shard followed by the gathered rows; its queries'
   calls under the mask read them by index, and their partial results merge by lse (one call
   where the mask makes one).
3. **Backward.** The calls' dK/dV land in the same buffer, in float32; the own part stays, the
   gathered part is reduce-scattered (each rank gets the sums for its $m$ slots) and added at
   its shared rows; rounded once.

Per rank: forward $P m (D + D_v) H_{kv}$ elements received; backward that again (K/V gathered
again, as the default all-gather keeps only the local shards) and the $P m$ rows of dK/dV
reduce-scattered in float32. With `save_gathered_kv=True` the gathered rows are kept instead.
`overlap=True` is refused with a mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpref.batch.layout import local_chunks
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import compute_dtype
from cpref.kernels.sinks import add_sinks, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.mask_plan import Run, mask_calls, runs
from cpref.modes.ring import ring_backward, ring_forward, saved_out_dtype
from cpref.modes.ring_plan import RingCall, RingPlan, RingStep
from cpref.modes.ring_window import reading_the_block
from cpref.modes.shared import no_double_backward, padded_rows

__all__ = ["MaskGatherPlan", "mask_gather_plan", "MaskedAllGatherFunc"]


@dataclass(frozen=True)
class MaskGatherPlan:
    """One rank's all-gather under a mask.

    Attributes:
        shared: `(|S_r|,)` the rows of this rank's shard that other ranks read, sorted.
        m: the rows every rank sends, `max_s |S_s|` (0: nothing travels).
        calls: a ring of one step over the keys `[own shard; P m gathered rows]` (`cpref.modes.ring`).
    """

    shared: torch.Tensor
    m: int
    calls: RingPlan


def mask_gather_plan(call: CPCall) -> MaskGatherPlan:
    """This rank's plan, from the batch cache (module docstring)."""

    def build() -> MaskGatherPlan:
        b, P, t_l = call.bounds, call.P, call.bounds.total // call.P
        mine = [runs(b, local_chunks(b, cp_size=P, rank=r, layout=call.layout)) for r in range(P)]
        slices = call.mask.slices
        # 1) the rows of every rank's shard that another rank reads
        shared = []
        for s in range(P):
            read = [c.rows for r in range(P) if r != s for c in mask_calls(slices, mine[r], mine[s], t_l)]
            shared.append(torch.unique(torch.cat(read)) if read else torch.zeros(0, dtype=torch.int64))
        m = max(len(rows) for rows in shared)
        # 2) this rank's keys: its shard, then every other rank's shared rows at their slots (each row one token)
        keys = list(mine[call.rank])
        for s in range(P):
            if s != call.rank:
                keys += _rows_as_runs(shared[s], mine[s], t_l + s * m)
        calls = mask_calls(slices, mine[call.rank], keys, t_l)
        if len(calls) == 1 and (whole := reading_the_block(calls[0].seqs, calls[0].rows, t_l + P * m)) is not None:
            steps = (RingCall(whole, calls[0].causal, None, calls[0].window),)  # every key as it is: whole rows
        else:
            steps = tuple(RingCall(c.seqs, c.causal, c.rows.to(call.device), c.window) for c in calls)
        return MaskGatherPlan(shared[call.rank].to(call.device), m, RingPlan((RingStep(call.rank, steps),)))

    return call.plan(("all_gather mask", call.P, call.rank, call.layout, str(call.device), call.mask), build)


def _rows_as_runs(rows: torch.Tensor, block: list[Run], at: int) -> list[Run]:
    """The runs of the gathered copy of a block's rows `rows` (sorted), placed from row `at` on: each row's token,
    consecutive ones joined."""
    out: list[Run] = []
    for i, row in enumerate(rows.tolist()):
        run = next(r for r in block if r.row <= row < r.row + r.n)  # the rows read are real tokens: in a run
        start = run.start + row - run.row
        if out and out[-1].row + out[-1].n == at + i and out[-1].start + out[-1].n == start:
            out[-1] = Run(out[-1].row, out[-1].start, out[-1].n + 1)
        else:
            out.append(Run(at + i, start, 1))
    return out


def _keys(x: torch.Tensor, plan: MaskGatherPlan, comm: Collectives) -> torch.Tensor:
    """The own shard followed by every rank's shared rows, rank-major: `(T_l + P m, ...)`."""
    if not plan.m:
        return x
    return torch.cat([x, comm.all_gather(padded_rows(x, plan.shared, plan.m))])


def _home(g: torch.Tensor, plan: MaskGatherPlan, comm: Collectives, t_l: int) -> torch.Tensor:
    """dK (or dV) of the own shard from the buffer's: the own part, plus the shared rows' sums over the ranks."""
    out = g[:t_l].clone()  # (T_l, ...)
    if plan.m:
        out.index_add_(0, plan.shared, comm.reduce_scatter(g[t_l:].contiguous())[: len(plan.shared)])  # (P m) -> (m)
    return out


class MaskedAllGatherFunc(torch.autograd.Function):
    """Autograd Function: the shared rows all-gathered, the mask's calls, merged; dK/dV of the shared rows
    reduce-scattered home."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan: MaskGatherPlan, comm, kernel, scale: float, deterministic: bool = False,
                save_gathered_kv: bool = False, sinks=None):  # fmt: skip
        """Gather, one ring step of the mask's calls over the keys, the sinks added once to the merged rows."""
        kk, vk = _keys(k, plan, comm), _keys(v, plan, comm)  # (T_l + P m, Hkv, D), (T_l + P m, Hkv, Dv)
        saved = saved_out_dtype(q.dtype, plan.calls)
        out, lse = ring_forward(q, kk, vk, plan.calls, comm, kernel, scale=scale,
                                out_dtype=saved if sinks is None else compute_dtype(q.dtype))  # fmt: skip
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, out.to(saved), lse, sinks, *((kk, vk) if save_gathered_kv else (k, v)))
        ctx.plan, ctx.comm, ctx.kernel, ctx.scale, ctx.deterministic = plan, comm, kernel, scale, deterministic
        ctx.gathered, ctx.t_l = save_gathered_kv, k.shape[0]
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout):
        """(Gather again,) the calls' backward into the keys' buffer in float32, the shared rows' sums home."""
        no_double_backward()
        q, out, lse, sinks, kx, vx = ctx.saved_tensors
        plan, comm = ctx.plan, ctx.comm
        kk, vk = (kx, vx) if ctx.gathered else (_keys(kx, plan, comm), _keys(vx, plan, comm))
        dq, dkk, dvk = ring_backward(dout.contiguous(), q, kk, vk, out, lse, plan.calls, comm, ctx.kernel,
                                     scale=ctx.scale, kv_grad_dtype=compute_dtype(q.dtype),
                                     deterministic=ctx.deterministic)  # fmt: skip
        dk, dv = (_home(g, plan, comm, ctx.t_l).to(q.dtype) for g in (dkk, dvk))
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, None, None, None, None, dsinks
