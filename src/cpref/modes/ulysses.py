r"""Ulysses (a2a): trade the sequence split for a head split, attend locally, trade back.

Attention is independent per head. So instead of moving keys to queries, DeepSpeed-Ulysses
(Jacobs et al. 2023) moves **heads**: an all-to-all turns "every rank holds $\frac{T}{P}$
tokens of all $H$ heads" into "every rank holds all $T$ tokens of $\frac{H}{P}$ heads". Each
rank then computes ordinary attention over the whole packed stream for its heads, with no
further communication, and a second all-to-all turns the output back into sequence shards.

$$ (\tfrac{T}{P}, H, D) \xrightarrow{\text{all-to-all}} (T, \tfrac{H}{P}, D)
   \xrightarrow{\text{attention}} (T, \tfrac{H}{P}, D_v) \xrightarrow{\text{all-to-all}} (\tfrac{T}{P}, H, D_v) $$

## The exchange

Rank $r$ splits its heads into `P` groups and sends group $j$ of all its tokens to rank $j$;
it receives, from every rank $r'$, its own head group for rank $r'$'s tokens. The received
tokens are **rank-major**: rank 0's local tokens, then rank 1's. Under the zigzag or the
contiguous layout that is not document order, so a permutation computed once per batch puts
them in natural order (and its inverse puts the output back), and one varlen kernel call
covers every document, each sequence seeing whole rows (`full_rows=True`).

--8<-- "src/cpref/modes/ulysses.py:exchange"

## Heads

The head split needs `P` to divide $H_q$. Key/value heads must be split alike: with
$H_{kv} \bmod P = 0$ each rank gets $\frac{H_{kv}}{P}$ of them, exactly those its query heads
read. With fewer key/value heads than ranks (GQA, MQA) each is **replicated** $\frac{P}{H_{kv}}$
times before the exchange (requires $P \bmod H_{kv} = 0$), so every rank receives the one
key/value head of its query heads; the gradients of the replicas are summed back. Any other
combination raises `ValueError` before any communication, naming the CP sizes that work.

The replicas' gradients are partial sums (each over its own query heads) that grow with the
logit scale and partly cancel, so they travel back **unrounded** (float32, from the kernel's
`grad_dtype`) and are summed in float32 before the one rounding to the input dtype: twice the
bytes for dK and dV, only when heads are replicated. Rounded to bf16 before the sum, the
largest dK error at 4 times the default scale and `P = 4` (MQA) was 0.02 against 0.003 at
`P = 1`; unrounded it is 0.003.

## Cost per rank

Forward: all-to-alls of `q`, `k`, `v` and of the output, each moving $\frac{P - 1}{P}$ of the
tensor: $\frac{P-1}{P} \frac{T}{P} (H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v)$ elements, with
$H'_{kv} = \max(H_{kv}, P)$ when heads are replicated. With $D = D_v$ and GQA group size
$G = H_q / H_{kv}$, that is $\frac{G + 1}{P}$ times the traffic of all-gather or ring: Ulysses
moves less exactly when $G + 1 < P$. The backward moves the same volume (dout in; dq, dk, dv
out, in the input dtype), except that replicated heads' dk and dv go out in float32 (see Heads).
Saved for backward: the gathered `q, k, v`, the head-split output and its lse, as many elements
as the local shards, so memory falls as $1/P$, except for replicated key/value heads: with
$H_{kv} < P$ every rank keeps $T (D + D_v)$ elements of K/V whatever `P` is. One kernel call
each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpref.call import CPCall
from cpref.comm import Collectives
from cpref.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW, Varlen, compute_dtype
from cpref.layout import global_index, group_chunks
from cpref.costs import ModeCosts, exchange_costs
from cpref.modes.shared import head_split, no_double_backward, whole_documents
from cpref.modes.spec import ModeSpec
from cpref.seqlens import Boundaries

__all__ = ["A2APlan", "UlyssesFunc", "a2a_gather", "a2a_scatter", "a2a_plan", "check_a2a_heads", "run_ulysses", "scatter_grads",
           "ulysses_plan", "ulysses_costs", "MODE"]


def check_a2a_heads(hq: int, hkv: int, a: int, P: int, what: str) -> None:
    """Raise unless `a` ranks can split `hq` query heads and `hkv` key/value heads (see the docstring)."""
    if head_split(hq, hkv, a) is not None:
        return
    works = [n for n in range(1, hq + 1) if head_split(hq, hkv, n) is not None]
    raise CPInputError(
        f"{what} splits heads over {a} ranks (P = {P}), but Hq = {hq}, Hkv = {hkv} cannot be split so: "
        f"it needs Hq % {a} == 0 and Hkv % {a} == 0 or {a} % Hkv == 0; sizes that work: {works}"
    )


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
    of the group's pieces (`cpref.layout.group_chunks`: the layout over `P / a` ranks at rank `g` for the
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
        attend = whole_documents(call.bounds) if with_attention else None
        return A2APlan(perm, inv, head_split(call.heads[0], hkv, a), attend, call.window if with_attention else NO_WINDOW)

    key = ("a2a", call.P, a, g, call.layout, call.causal, hkv, with_attention, str(call.device))
    return call.plan(key + ((call.window,) if with_attention and call.window != NO_WINDOW else ()), build)


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


class UlyssesFunc(torch.autograd.Function):
    """Autograd Function: all-to-all q, k, v and out forward; all-to-all dout, dq, dk, dv backward."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan: A2APlan, comm, kernel, causal: bool, scale: float):
        """Exchange heads for tokens, one kernel call over the whole stream, exchange back."""
        # 1) heads out, tokens in: every rank holds the whole stream for H/P heads, in natural order
        qg = a2a_gather(q, plan, comm)  # (T, Hq/P, D)
        kg = a2a_gather(replicate(k, plan.replicas), plan, comm)  # (T, Hkv'/P, D)
        vg = a2a_gather(replicate(v, plan.replicas), plan, comm)  # (T, Hkv'/P, Dv)
        # 2) one varlen call over every document, padding seen by no query
        out_g, lse_g = kernel.forward(qg, kg, vg, plan.attend, causal=causal, window=plan.window, scale=scale)  # (T, Hq/P, Dv)
        # 3) tokens out, heads in
        ctx.save_for_backward(qg, kg, vg, out_g, lse_g)
        ctx.plan, ctx.comm, ctx.kernel, ctx.causal, ctx.scale = plan, comm, kernel, causal, scale
        ctx.dtypes = (k.dtype, v.dtype)
        return a2a_scatter(out_g, plan, comm)  # (T_l, Hq, Dv)

    @staticmethod
    def backward(ctx: Any, dout):
        """The same exchanges for dout, dq, dk, dv around one backward kernel call."""
        no_double_backward()
        qg, kg, vg, out_g, lse_g = ctx.saved_tensors
        plan, comm = ctx.plan, ctx.comm
        # 1) the upstream gradient takes the same way as q
        dout_g = a2a_gather(dout.contiguous(), plan, comm)  # (T, Hq/P, Dv)
        # 2) one backward call; every row is whole, so Delta comes from float32 probabilities
        grads = list(ctx.kernel.backward(
            dout_g, qg, kg, vg, out_g, lse_g, plan.attend, causal=ctx.causal, window=plan.window, scale=ctx.scale,
            full_rows=True,
            grad_dtype=kv_grad_dtype(plan, kg.dtype),
        ))  # dQ (T, Hq/P, D), dK (T, Hkv'/P, D), dV (T, Hkv'/P, Dv): what the exchange moves
        grads[0] = grads[0].to(qg.dtype)  # dQ in the input dtype; dK/dV of replicated heads unrounded
        del dout_g  # freed before the exchanges
        # 3) back to sequence shards; replicated key/value heads sum their gradients (in float32)
        return (*scatter_grads(grads, plan, comm, ctx.dtypes), None, None, None, None, None)


def check_ulysses(call: CPCall) -> None:
    """The mode's own constraint: the heads split over all P ranks."""
    check_a2a_heads(call.heads[0], call.heads[1], call.P, call.P, "mode 'a2a'")


def ulysses_plan(call: CPCall) -> A2APlan:
    """The group's exchange plan and its one kernel call, from the batch cache."""
    return a2a_plan(call, call.P, 0, call.heads[1], with_attention=True)


def run_ulysses(q, k, v, call: CPCall, comm: Collectives) -> torch.Tensor:
    """Run the mode: the plan, then the Function."""
    return UlyssesFunc.apply(q, k, v, ulysses_plan(call), comm, call.kernel, call.causal, call.scale)


def ulysses_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows) -> ModeCosts:
    """Per-rank traffic, collectives and saved bytes of one layer: the exchange over all P ranks."""
    return exchange_costs(P, local_tokens, heads, dtype)


MODE = ModeSpec(
    name="a2a",
    order=2,
    run=run_ulysses,
    plan=ulysses_plan,
    collectives=frozenset({"all_to_all"}),
    costs=ulysses_costs,
    check=check_ulysses,
    windows=True,
)
