r"""The hierarchical mode for the stream and balanced layouts: only the documents that span ranks travel.

The hierarchical mode ([`cpref.modes.hierarchical`][cpref.modes.hierarchical]) exchanges every
token of an a2a group, then rings the group's tokens across the groups. With the layouts that
keep documents whole ([`cpref.batch.layout`][cpref.batch.layout]: `balanced`, and every document of
`stream` that does not straddle a rank boundary) most of that traffic is for nothing: a rank
already holds those documents whole, for all heads. As [the split Ulysses][cpref.modes.ulysses_split]
does, this variant splits each rank's rows in two:

* **own** rows (the documents whose real tokens all sit on this rank): one kernel call, all
  heads, no communication;
* **shared** rows (the documents whose real tokens span ranks), padded to the most any rank has,
  $m$ (from the boundaries alone, so every rank agrees). Those $(m, H, X)$ take the hierarchy:
  the exchange inside the a2a group of `a` ranks, to $(a m, H / a, X)$, permuted into stream
  order with the group's padding slots last; then the ring across the `P / a` groups, which
  sends only the rows each group reads ([the ring that sends only what is read][cpref.modes.ring_window]),
  planned over **the shared rows alone**: member `g` holds its group's shared pieces, in stream
  order, then the slots, which see nothing; then the way back. With one group (`a = P`) the ring
  has one member and its plan is one kernel call over the gathered block as it is, the rows no
  query reads (the slots) being keys of a sequence without queries: Ulysses' split, bit for bit.

{{ figure figures/split_traffic.png }}

The two outputs are written into their rows; the backward mirrors it (dK/dV of replicated
key/value heads in float32, as in Ulysses). Per rank the exchange moves Ulysses' traffic over
`a` ranks on $m$ rows instead of $T_l$ (`cpref.modes.costs.exchange_costs` with `gathered_rows`
$= m$), and the ring the halo of the shared documents only (`halo_sizes` of this plan's ring);
a batch whose documents all sit on one rank each moves nothing, unless the ranks of an a2a
group would work unevenly: then a few documents held whole take the group's exchange too, as
in [the split Ulysses' balance](ulysses-split.md#balance), spread over the group only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpref.batch.layout import local_chunks
from cpref.batch.seqlens import Boundaries
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import Varlen, compute_dtype
from cpref.kernels.sinks import add_sinks, head_slice, on_all_heads, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.exchange import A2APlan, a2a_gather, a2a_scatter, kv_grad_dtype, replicate, scatter_grads
from cpref.modes.ring import ring_backward, ring_forward, saved_out_dtype
from cpref.modes.ring_plan import RingPlan
from cpref.modes.ring_window import build_piece_ring_plan
from cpref.modes.shared import head_split, no_double_backward, padded_rows
from cpref.modes.ulysses_pipeline import pipelined_backward, pipelined_forward
from cpref.modes.ulysses_split import gathered_order, split_rows

__all__ = ["SplitHierarchicalPlan", "SplitHierarchicalFunc", "ring_attend", "build_split_hierarchical_plan",
           "group_members", "split_hierarchical_plan"]


@dataclass(frozen=True)
class SplitHierarchicalPlan:
    """One rank's split (module docstring).

    Attributes:
        own: `(n_own,)` local rows of the documents held here whole; `own_seqs` their call's sequences.
        shared: `(c,)` local rows of the documents that span ranks; `rows`: `m`, the rows every rank exchanges.
        exchange: the a2a group's exchange of its `a m` rows into stream order, slots last.
        ring: this group's plan in the ring of `P / a` groups over the shared rows.
        window: the call's window.
    """

    own: torch.Tensor
    own_seqs: Varlen
    shared: torch.Tensor
    rows: int
    exchange: A2APlan
    ring: RingPlan
    window: tuple[int, int]


def build_split_hierarchical_plan(b: Boundaries, P: int, rank: int, layout: str, a: int, hq: int, hkv: int,
                                  causal: bool, window, device, balance: bool = True,
                                  chunk: int | None = None) -> SplitHierarchicalPlan:  # fmt: skip
    """Rank `rank`'s plan with a2a groups of `a` consecutive ranks (no caching); `chunk`: chunked attention."""
    split = split_rows(b, P, rank, layout, device, group=a, causal=causal, window=window, balance=balance, chunk=chunk)
    g, m = rank // a, split.rows
    members, real = group_members(b, P, layout, a, set(split.docs), m)

    order, _ = gathered_order(list(split.ids[g * a : (g + 1) * a]), m, b.total)  # rank-major -> stream order
    perm = None if torch.equal(order, torch.arange(len(order))) else order
    exchange = A2APlan(perm.to(device) if perm is not None else None,
                       torch.argsort(perm).to(device) if perm is not None else None, head_split(hq, hkv, a))  # fmt: skip
    ring = build_piece_ring_plan(real, members, g, causal, window, device, chunk)
    return SplitHierarchicalPlan(split.own, split.own_seqs, split.shared, m, exchange, ring, window)


def group_members(b: Boundaries, P: int, layout: str, a: int, shared: set[int], m: int):
    """`(members, real)`: per a2a group of `a` ranks, the ring member it is: its shared pieces `(doc, start, end,
    row)` in stream order (adjacent pieces of one document merged), then its padding slots as a document past the
    last; and `real(doc, lo, hi)`, the real tokens of positions `[lo, hi)` (none in the slots)."""
    slot_doc = b.num_docs  # the slots: a document past the last, all padding
    members = []
    for h in range(P // a):
        pieces, row = [], 0
        held = sorted(c for r in range(h * a, (h + 1) * a) for c in local_chunks(b, cp_size=P, rank=r, layout=layout))
        for doc, start, end in (c for c in held if c[0] in shared):
            s, e = start - b.padded[doc], end - b.padded[doc]
            if pieces and pieces[-1][0] == doc and pieces[-1][2] == s:  # adjacent pieces of one document: one
                pieces[-1] = (doc, pieces[-1][1], e, pieces[-1][3])
            else:
                pieces.append((doc, s, e, row))
            row += e - s
        members.append(pieces + ([(slot_doc, 0, a * m - row, row)] if a * m > row else []))

    def real(doc: int, lo: int, hi: int) -> int:
        return 0 if doc == slot_doc else b.real_in(doc, lo, hi)

    return members, real


def split_hierarchical_plan(call: CPCall) -> SplitHierarchicalPlan:
    """The cached split plan of this rank."""
    a, balance = call.options["a2a_size"], call.options["balance"]
    key = ("a2a+p2p split", call.P, call.rank, call.layout, a, call.heads[:2], call.causal, call.window, balance,
           str(call.device), call.chunk)  # fmt: skip
    return call.plan(key, lambda: build_split_hierarchical_plan(call.bounds, call.P, call.rank, call.layout, a,
                                                                call.heads[0], call.heads[1], call.causal, call.window,
                                                                call.device, balance, call.chunk))  # fmt: skip


def ring_attend(ring: RingPlan, ring_comm: Collectives, kernel, scale: float, dtype: torch.dtype,
                deterministic: bool):  # fmt: skip
    """`(attend, attend_backward)` of one head group for the pipeline (`cpref.modes.ulysses_pipeline`): the ring
    across the groups on that group's heads, forward and backward (dK/dV in the input dtype: no replicas)."""

    def attend(qg, kg, vg):
        return ring_forward(qg, kg, vg, ring, ring_comm, kernel, scale=scale, out_dtype=saved_out_dtype(dtype, ring))

    def attend_backward(dout_g, qg, kg, vg, out_g, lse_g):
        return ring_backward(dout_g, qg, kg, vg, out_g, lse_g, ring, ring_comm, kernel, scale=scale,
                             deterministic=deterministic)  # fmt: skip

    return attend, attend_backward


class SplitHierarchicalFunc(torch.autograd.Function):
    """Autograd Function: own rows attended here with all heads; shared rows through the hierarchy (in `groups`
    head groups, the own rows' call after their posts, when `groups > 1`: `cpref.modes.ulysses_pipeline`)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan: SplitHierarchicalPlan, a2a_comm: Collectives, ring_comm: Collectives, kernel,
                causal: bool, scale: float, deterministic: bool = False, groups: int = 1, sinks=None):  # fmt: skip
        """The own rows' call with all heads; the shared rows' exchange, ring and exchange back; one output. The
        sinks enter the own rows' call (all heads) and the ring's merged rows (this rank's heads)."""
        ex, m = plan.exchange, plan.rows
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))  # (T_l, Hq, Dv): every row own or shared
        own = [x.index_select(0, plan.own) for x in (q, k, v)]  # (n_own, H, X) each
        saved = [None, None]
        acc = compute_dtype(q.dtype)

        def own_rows() -> None:  # 1) the documents held here: all heads, no communication
            if len(plan.own):
                saved[:] = kernel.forward(*own, plan.own_seqs, causal=causal, window=plan.window, scale=scale,
                                          out_dtype=None if sinks is None else acc)  # fmt: skip
                if sinks is not None:
                    saved[:] = add_sinks(*saved, sinks)
                    saved[0] = saved[0].to(q.dtype)
                out.index_copy_(0, plan.own, saved[0])

        if m and groups > 1:  # 2) the shared documents in head groups, the own rows' call while the first travel
            attend, _ = ring_attend(plan.ring, ring_comm, kernel, scale, q.dtype, deterministic)
            shared, gathered = pipelined_forward(*(padded_rows(x, plan.shared, m) for x in (q, k, v)), ex, a2a_comm,
                                                 kernel, groups, causal=causal, scale=scale, meanwhile=own_rows,
                                                 attend=attend)  # fmt: skip
            out.index_copy_(0, plan.shared, shared[: len(plan.shared)])
            saved += gathered
        else:
            own_rows()
        if m and groups == 1:  # 2) the shared documents: exchange inside the group, ring across the groups, exchange back
            qg = a2a_gather(padded_rows(q, plan.shared, m), ex, a2a_comm)  # (a m, Hq/a, D)
            kg = a2a_gather(replicate(padded_rows(k, plan.shared, m), ex.replicas), ex, a2a_comm)  # (a m, Hkv'/a, D)
            vg = a2a_gather(replicate(padded_rows(v, plan.shared, m), ex.replicas), ex, a2a_comm)  # (a m, Hkv'/a, Dv)
            kept = saved_out_dtype(q.dtype, plan.ring)
            out_g, lse_g = ring_forward(qg, kg, vg, plan.ring, ring_comm, kernel, scale=scale,
                                        out_dtype=kept if sinks is None else acc)  # fmt: skip
            if sinks is not None:  # once, after the ring's merge
                out_g, lse_g = add_sinks(out_g, lse_g, head_slice(sinks, a2a_comm.rank, a2a_comm.size))
                out_g = out_g.to(kept)
            out.index_copy_(0, plan.shared, a2a_scatter(out_g.to(q.dtype), ex, a2a_comm)[: len(plan.shared)])
            saved += [qg, kg, vg, out_g, lse_g]
        ctx.save_for_backward(*own, sinks, *saved)
        ctx.plan, ctx.comms, ctx.kernel, ctx.causal, ctx.scale = plan, (a2a_comm, ring_comm), kernel, causal, scale
        ctx.dtypes, ctx.shapes, ctx.deterministic = (k.dtype, v.dtype), (q.shape, k.shape, v.shape), deterministic
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        """The own rows' backward call; the shared rows' through the hierarchy; the gradients at their rows."""
        no_double_backward()
        plan, kernel, m, (a2a_comm, ring_comm) = ctx.plan, ctx.kernel, ctx.plan.rows, ctx.comms
        q_o, k_o, v_o, sinks, out_o, lse_o, *gathered = ctx.saved_tensors
        dq, dk, dv = (dout.new_empty(shape, dtype=t.dtype) for shape, t in zip(ctx.shapes, (q_o, k_o, v_o)))
        dsinks = None if sinks is None else torch.zeros_like(sinks)  # (Hq,): the own rows' and this rank's heads'

        def own_rows() -> None:  # 1) the own rows: one backward call
            if len(plan.own):
                dout_o = dout.index_select(0, plan.own).contiguous()
                grads = kernel.backward(dout_o, q_o, k_o, v_o, out_o, lse_o,
                                        plan.own_seqs, causal=ctx.causal, window=plan.window, scale=ctx.scale,
                                        full_rows=True)  # fmt: skip
                if sinks is not None:
                    dsinks.add_(sinks_grad(dout_o, out_o, lse_o, sinks))
                for g, own_grad in zip((dq, dk, dv), grads):
                    g.index_copy_(0, plan.own, own_grad.to(g.dtype))

        if m and ctx.groups > 1:  # 2) the shared rows in head groups, the own rows' call while the first travel
            _, attend_backward = ring_attend(plan.ring, ring_comm, kernel, ctx.scale, dout.dtype, ctx.deterministic)
            grads = pipelined_backward(padded_rows(dout, plan.shared, m), gathered, plan.exchange, a2a_comm, kernel,
                                       ctx.groups, causal=ctx.causal, scale=ctx.scale, meanwhile=own_rows,
                                       attend_backward=attend_backward)  # fmt: skip
            for g, shared_grad in zip((dq, dk, dv), grads):
                g.index_copy_(0, plan.shared, shared_grad[: len(plan.shared)].to(g.dtype))
        else:
            own_rows()
        if m and ctx.groups == 1:  # 2) the shared rows: the exchange, the ring's backward, the exchange back
            qg, kg, vg, out_g, lse_g = gathered
            dout_g = a2a_gather(padded_rows(dout, plan.shared, m), plan.exchange, a2a_comm)  # (a m, Hq/a, Dv)
            grads = list(ring_backward(dout_g, qg, kg, vg, out_g, lse_g, plan.ring, ring_comm, kernel, scale=ctx.scale,
                                       kv_grad_dtype=kv_grad_dtype(plan.exchange, kg.dtype),
                                       deterministic=ctx.deterministic))  # fmt: skip
            if sinks is not None:
                own_heads = head_slice(sinks, a2a_comm.rank, a2a_comm.size)
                dsinks.add_(on_all_heads(sinks_grad(dout_g, out_g, lse_g, own_heads), a2a_comm.rank, a2a_comm.size))
            del dout_g
            for g, shared_grad in zip((dq, dk, dv), scatter_grads(grads, plan.exchange, a2a_comm, ctx.dtypes)):
                g.index_copy_(0, plan.shared, shared_grad[: len(plan.shared)].to(g.dtype))
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks
