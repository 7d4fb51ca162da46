r"""The head-for-token exchange of Ulysses and of the hierarchical mode's a2a level, and its plan.

The functions here are [Ulysses'][cpref.modes.ulysses] exchange, shared with the hierarchical mode
([`cpref.modes.hierarchical`][cpref.modes.hierarchical]) and the split Ulysses of the stream and
balanced layouts ([`cpref.modes.ulysses_split`][cpref.modes.ulysses_split]); their page explains them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpref.batch.layout import global_index, group_chunks
from cpref.batch.seqlens import Boundaries
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import NO_WINDOW, Varlen, compute_dtype
from cpref.modes.call import CPCall
from cpref.modes.shared import head_split, whole_documents

__all__ = ["A2APlan", "a2a_permutation", "a2a_plan", "a2a_gather", "a2a_scatter", "replicate", "kv_grad_dtype",
           "unreplicate", "scatter_grads"]


@dataclass(frozen=True)
class A2APlan:
    """The permutation of one a2a group's gathered tokens, and the attention on them.

    Attributes:
        perm: `(a T_l,)` positions in the rank-major gathered buffer, in the wanted order
            (None where that order already is the wanted one).
        inv_perm: the inverse permutation (None with `perm`).
        replicas: how many times each key/value head is replicated before the exchange.
        attend: the kernel call over the gathered stream (Ulysses: whole documents).
    """

    perm: torch.Tensor | None
    inv_perm: torch.Tensor | None
    replicas: int
    attend: Varlen | None = None
    window: tuple[int, int] = NO_WINDOW


def a2a_permutation(b: Boundaries, P: int, a: int, g: int, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(perm, inv_perm)`: gathered tokens of a2a group `g` (ranks `g a .. g a + a - 1`) into the stream order
    of the group's pieces (`cpref.batch.layout.group_chunks`: the layout over `P / a` ranks at rank `g` for the
    chunked layouts and stream; natural order when `a == P`)."""
    received = torch.cat([global_index(b, cp_size=P, rank=g * a + j, layout=layout) for j in range(a)])  # (a T_l,)
    wanted = torch.cat([torch.arange(s, e) for _, s, e in group_chunks(b, cp_size=P, group=a, g=g, layout=layout)])
    where = torch.full((b.total,), -1, dtype=torch.int64)
    where[received] = torch.arange(len(received))  # global token -> row of the gathered buffer
    perm = where[wanted]
    assert (perm >= 0).all(), "the group's tokens are exactly the chunks of the layout over P / a ranks"
    if torch.equal(perm, torch.arange(len(perm))):
        return None, None  # already in the wanted order (a = 1, or P = 1)
    return perm.to(device), torch.argsort(perm).to(device)


def a2a_plan(call: CPCall, a: int, g: int, hkv: int, with_attention: bool) -> A2APlan:
    """The cached exchange plan of a2a group `g` (and, for Ulysses, its attention call)."""

    def build() -> A2APlan:
        perm, inv = a2a_permutation(call.bounds, call.P, a, g, call.layout, call.device)
        attend = whole_documents(call.bounds, call.chunk) if with_attention else None
        return A2APlan(perm, inv, head_split(call.heads[0], hkv, a), attend, call.window if with_attention else NO_WINDOW)

    key = ("a2a", call.P, a, g, call.layout, call.causal, hkv, with_attention, str(call.device))
    if with_attention and (call.window != NO_WINDOW or call.chunk is not None):
        key += (call.window, call.chunk)
    return call.plan(key, build)


# --8<-- [start:exchange]
def a2a_gather(x: torch.Tensor, plan: A2APlan, comm: Collectives) -> torch.Tensor:
    """Sequence shards of all heads -> all tokens of this rank's heads: `(T_l, H, X) -> (a T_l, H/a, X)`."""
    a = comm.size
    if a > 1:
        t_l, h, d = x.shape
        x = x.reshape(t_l, a, h // a, d).transpose(0, 1).reshape(a * t_l, h // a, d)  # chunk j: head group j
        x = comm.all_to_all(x)  # (a T_l, H/a, X), rank-major
    return x if plan.perm is None else x.index_select(0, plan.perm)  # rank-major -> wanted order


def a2a_scatter(y: torch.Tensor, plan: A2APlan, comm: Collectives) -> torch.Tensor:
    """Inverse of `a2a_gather`: `(a T_l, H/a, X) -> (T_l, H, X)`."""
    a = comm.size
    y = y if plan.inv_perm is None else y.index_select(0, plan.inv_perm)  # wanted order -> rank-major
    if a == 1:
        return y
    n, h, d = y.shape
    y = comm.all_to_all(y.contiguous())  # chunk s: my tokens, head group s
    return y.reshape(a, n // a, h, d).transpose(0, 1).reshape(n // a, a * h, d)  # (T_l, H, X)
# --8<-- [end:exchange]


def replicate(x: torch.Tensor, replicas: int) -> torch.Tensor:
    """Each key/value head `replicas` times, adjacent: `(T, Hkv, X) -> (T, Hkv * replicas, X)`."""
    return x if replicas == 1 else x.repeat_interleave(replicas, dim=1)


def kv_grad_dtype(plan: A2APlan, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype replicated key/value heads' gradients travel in: the compute dtype, so that the
    replicas' partials are summed unrounded (see the module docstring); None (the input dtype)
    without replicas."""
    return compute_dtype(dtype) if plan.replicas > 1 else None


def unreplicate(dx: torch.Tensor, replicas: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum the replicas' gradients back (in float32, then rounded once): `(T, Hkv * R, X) -> (T, Hkv, X)`."""
    if replicas == 1:
        return dx.to(dtype)
    t, h, d = dx.shape
    return dx.reshape(t, h // replicas, replicas, d).to(compute_dtype(dtype)).sum(2).to(dtype)


def scatter_grads(grads: list[torch.Tensor], plan: A2APlan, comm: Collectives, dtypes) -> tuple[torch.Tensor, ...]:
    """`[dQ, dK, dV]` of this rank's heads back to sequence shards, each freed once sent; replicated K/V heads summed.

    `(a T_l, H/a, X) -> (T_l, H, X)` each; `grads` is emptied, so the caller holds no reference
    to a gradient already exchanged.
    """
    dq = a2a_scatter(grads.pop(0), plan, comm)  # (T_l, Hq, D)
    dk = unreplicate(a2a_scatter(grads.pop(0), plan, comm), plan.replicas, dtypes[0])  # (T_l, Hkv, D)
    dv = unreplicate(a2a_scatter(grads.pop(0), plan, comm), plan.replicas, dtypes[1])  # (T_l, Hkv, Dv)
    return dq, dk, dv
