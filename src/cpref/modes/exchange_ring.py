"""a2a groups and a ring across them: the Function of the hierarchy, and of Ulysses under a mask.

[`HierarchicalFunc`][cpref.modes.exchange_ring.HierarchicalFunc] exchanges heads for tokens inside
each a2a group of `a` consecutive ranks ([`cpref.modes.exchange`][cpref.modes.exchange]), runs ring
attention across the `P / a` groups ([`cpref.modes.ring`][cpref.modes.ring]), and exchanges back;
its page is the hierarchical mode's ([`cpref.modes.hierarchical`][cpref.modes.hierarchical]). It
lives here, below both modes that run it: `a2a+p2p`, and `a2a` under a mask, which is the
hierarchy with one a2a group of all `P` ranks and a ring of one member that runs the mask's calls
on the whole stream ([`run_masked`][cpref.modes.exchange_ring.run_masked],
[`cpref.modes.mask_plan`][cpref.modes.mask_plan]).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from cpref.comm.protocol import Collectives
from cpref.kernels.contract import compute_dtype
from cpref.kernels.sinks import add_sinks, head_slice, on_all_heads, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.exchange import A2APlan, a2a_gather, a2a_scatter, kv_grad_dtype, replicate, scatter_grads
from cpref.modes.hierarchical_split import ring_attend
from cpref.modes.ring import ring_backward, ring_forward, ring_plan, saved_out_dtype
from cpref.modes.shared import head_split, no_double_backward
from cpref.modes.ulysses_pipeline import pipelined_backward, pipelined_forward, pipelines

__all__ = ["subgroups", "HierarchicalFunc", "mask_exchange_plan", "run_masked"]

_SUBGROUPS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[Collectives, Collectives]]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def subgroups(comm: Collectives, a: int) -> tuple[Collectives, Collectives]:
    """`(a2a group, ring)` of this rank for `a2a_size = a`: made once per communicator (two splits)."""
    with _LOCK:
        cached = _SUBGROUPS.get(comm, {}).get(a)
    if cached is not None:
        return cached
    P, p = comm.size, comm.size // a
    a2a = comm.split([list(range(g * a, (g + 1) * a)) for g in range(p)])  # consecutive ranks
    ring = comm.split([list(range(j, P, a)) for j in range(a)])  # one rank of every a2a group
    with _LOCK:
        _SUBGROUPS.setdefault(comm, {})[a] = (a2a, ring)
    return a2a, ring


class HierarchicalFunc(torch.autograd.Function):
    """Autograd Function: a2a in, ring across, a2a out; the backward takes the same way back (in `groups` head
    groups, each group's ring while the next group's exchange travels, when `groups > 1`)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, a2a: A2APlan, ring, a2a_comm, ring_comm, kernel, scale: float, deterministic: bool = False,
                groups: int = 1, sinks=None):  # fmt: skip
        """Ulysses' exchange inside the a2a group, ring attention across the groups (the sinks of this rank's heads
        added once, after the ring's merge), exchange back."""
        ctx.plans, ctx.comms, ctx.kernel, ctx.scale = (a2a, ring), (a2a_comm, ring_comm), kernel, scale
        ctx.dtypes, ctx.deterministic, ctx.groups = (k.dtype, v.dtype), deterministic, groups
        if groups > 1:  # the pipeline: every group's exchange posted, each group's ring while the next travels
            attend, _ = ring_attend(ring, ring_comm, kernel, scale, q.dtype, deterministic)
            out, saved = pipelined_forward(q, k, v, a2a, a2a_comm, kernel, groups, causal=True, scale=scale, attend=attend)
            ctx.save_for_backward(*saved)
            return out
        # 1) inside the a2a group: all the group's tokens for H/a heads, in the zigzag-over-p order
        qg = a2a_gather(q, a2a, a2a_comm)  # (a T_l, Hq/a, D)
        kg = a2a_gather(replicate(k, a2a.replicas), a2a, a2a_comm)  # (a T_l, Hkv'/a, D)
        vg = a2a_gather(replicate(v, a2a.replicas), a2a, a2a_comm)  # (a T_l, Hkv'/a, Dv)
        # 2) across the groups: ring attention over p ranks
        kept, own = saved_out_dtype(q.dtype, ring), head_slice(sinks, a2a_comm.rank, a2a_comm.size)
        out_g, lse_g = ring_forward(qg, kg, vg, ring, ring_comm, kernel, scale=scale,
                                    out_dtype=kept if own is None else compute_dtype(q.dtype))  # (a T_l, Hq/a, Dv)
        if own is not None:
            out_g, lse_g = add_sinks(out_g, lse_g, own)
            out_g = out_g.to(kept)  # as the ring keeps it
        ctx.save_for_backward(qg, kg, vg, out_g, lse_g, own)
        # 3) back to sequence shards of all heads
        return a2a_scatter(out_g.to(q.dtype), a2a, a2a_comm)  # (T_l, Hq, Dv)

    @staticmethod
    def backward(ctx: Any, dout):
        """dout through the exchange, the ring's backward, the gradients back through the exchange."""
        no_double_backward()
        (a2a, ring), (a2a_comm, ring_comm) = ctx.plans, ctx.comms
        if ctx.groups > 1:
            _, attend_backward = ring_attend(ring, ring_comm, ctx.kernel, ctx.scale, dout.dtype, ctx.deterministic)
            grads = pipelined_backward(dout.contiguous(), list(ctx.saved_tensors), a2a, a2a_comm, ctx.kernel, ctx.groups,
                                       causal=True, scale=ctx.scale, attend_backward=attend_backward)  # fmt: skip
            return (*grads, None, None, None, None, None, None, None, None, None)
        qg, kg, vg, out_g, lse_g, own = ctx.saved_tensors
        dout_g = a2a_gather(dout.contiguous(), a2a, a2a_comm)  # (a T_l, Hq/a, Dv)
        dsinks = None if own is None else on_all_heads(sinks_grad(dout_g, out_g, lse_g, own), a2a_comm.rank, a2a_comm.size)
        grads = list(ring_backward(dout_g, qg, kg, vg, out_g, lse_g, ring, ring_comm, ctx.kernel, scale=ctx.scale,
                                   kv_grad_dtype=kv_grad_dtype(a2a, kg.dtype), deterministic=ctx.deterministic))  # fmt: skip
        del dout_g  # freed before the exchanges
        return (*scatter_grads(grads, a2a, a2a_comm, ctx.dtypes), None, None, None, None, None, None, None, None, dsinks)


def mask_exchange_plan(call: CPCall, a: int) -> A2APlan:
    """The exchange of an a2a group of `a` under a mask: no permutation (the mask's calls read the gathered tokens
    rank-major, `cpref.modes.mask_plan.stacked_runs`), the key/value heads replicated where `a` needs it."""
    return A2APlan(None, None, head_split(call.heads[0], call.heads[1], a))


def run_masked(q, k, v, call: CPCall, comm: Collectives, a: int) -> torch.Tensor:
    """The call's mask with a2a groups of `a` ranks and a ring of the `P / a` groups (`a = P`: Ulysses, a ring of
    one); `head_groups` pipelines the exchange as it does without a mask."""
    a2a_comm, ring_comm = subgroups(comm, a)
    ring = ring_plan(call, call.P // a, call.rank // a, call.layout, a)
    groups = call.options["head_groups"] if pipelines(call.options["head_groups"], a) else 1
    return HierarchicalFunc.apply(q, k, v, mask_exchange_plan(call, a), ring, a2a_comm, ring_comm, call.kernel, call.scale,
                                  call.deterministic, groups, call.sinks)  # fmt: skip
