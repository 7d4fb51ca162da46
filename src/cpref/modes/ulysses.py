r"""Ulysses (a2a): trade the sequence split for a head split, attend locally, trade back.

Attention is independent per head. So instead of moving keys to queries, DeepSpeed-Ulysses
(Jacobs et al. 2023) moves **heads**: an all-to-all turns "every rank holds $\frac{T}{P}$
tokens of all $H$ heads" into "every rank holds all $T$ tokens of $\frac{H}{P}$ heads". Each
rank then computes ordinary attention over the whole packed stream for its heads, with no
further communication, and a second all-to-all turns the output back into sequence shards.

$$ (\tfrac{T}{P}, H, D) \xrightarrow{\text{all-to-all}} (T, \tfrac{H}{P}, D)
   \xrightarrow{\text{attention}} (T, \tfrac{H}{P}, D_v) \xrightarrow{\text{all-to-all}} (\tfrac{T}{P}, H, D_v) $$

{{ figure figures/ulysses_exchange.png }}

## The exchange

Rank $r$ splits its heads into `P` groups and sends group $j$ of all its tokens to rank $j$;
it receives, from every rank $r'$, its own head group for rank $r'$'s tokens. The received
tokens are **rank-major**: rank 0's local tokens, then rank 1's. Under the zigzag or the
contiguous layout that is not document order, so a permutation computed once per batch puts
them in natural order (and its inverse puts the output back), and one varlen kernel call
covers every document, each sequence seeing whole rows (`full_rows=True`).

--8<-- "src/cpref/modes/exchange.py:exchange"

With the stream and balanced layouts, whose ranks hold most documents whole, only the
documents that span ranks take the exchange; the others are attended where they are, with all
heads ([Ulysses for stream and balanced][cpref.modes.ulysses_split]).

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

## In head groups

With `head_groups=n` the exchange runs in `n` groups of each rank's heads, posted with
`all_to_all_async`, so that one group's call runs while the next group travels
([Ulysses in head groups][cpref.modes.ulysses_pipeline]): the same bytes, `n` times the
all-to-alls and the kernel calls. The default is the one exchange (`head_groups=1`).

## Cost per rank

Forward: all-to-alls of `q`, `k`, `v` and of the output, each moving $\frac{P - 1}{P}$ of the
tensor: $\frac{P-1}{P} \frac{T}{P} (H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v)$ elements, with
$H'_{kv} = \max(H_{kv}, P)$ when heads are replicated. With $D = D_v$ and GQA group size
$G = H_q / H_{kv}$, that is $\frac{G + 1}{P}$ times the forward traffic of all-gather or ring:
forward only, Ulysses moves less when $G + 1 < P$. The backward moves the same volume (dout in;
dq, dk, dv out, in the input dtype), except that replicated heads' dk and dv go out in float32
(see Heads), while all-gather's backward moves three times its forward in bf16 (K and V gathered
again, dK and dV reduce-scattered in float32): forward + backward in bf16, Ulysses moves
$\frac{G + 1}{2P}$ times all-gather's bytes, less once $P > \frac{G + 1}{2}$ ([the rules,
recomputed from these formulas][rules-of-thumb-recomputed] on the page of which mode when).
Saved for backward: the gathered `q, k, v`, the head-split output and its lse, as many elements
as the local shards, so memory falls as $1/P$, except for replicated key/value heads: with
$H_{kv} < P$ every rank keeps $T (D + D_v)$ elements of K/V whatever `P` is. One kernel call
each way.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from cpref.base.checks import as_bool, as_int
from cpref.base.errors import CPInputError
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import compute_dtype
from cpref.kernels.sinks import add_sinks, head_slice, on_all_heads, sinks_grad
from cpref.modes.call import CPCall
from cpref.modes.costs import ModeCosts, exchange_costs
from cpref.modes.exchange import A2APlan, a2a_gather, a2a_plan, a2a_scatter, kv_grad_dtype, replicate, scatter_grads
from cpref.modes.exchange_ring import run_masked
from cpref.modes.shared import head_split, no_double_backward
from cpref.modes.spec import ModeSpec, Option
from cpref.modes.ulysses_pipeline import head_groups_that_work, pipelined_backward, pipelined_forward, pipelines
from cpref.modes.ulysses_split import BALANCE_DOC, SplitUlyssesFunc, split_plan

__all__ = ["UlyssesFunc", "check_a2a_heads", "check_head_groups", "pipelines", "run_ulysses", "ulysses_plan",
           "ulysses_costs", "MODE"]


def check_a2a_heads(hq: int, hkv: int, a: int, P: int, what: str) -> None:
    """Raise unless `a` ranks can split `hq` query heads and `hkv` key/value heads (see the docstring)."""
    if head_split(hq, hkv, a) is not None:
        return
    works = [n for n in range(1, hq + 1) if head_split(hq, hkv, n) is not None]
    raise CPInputError(
        f"{what} splits heads over {a} ranks (P = {P}), but Hq = {hq}, Hkv = {hkv} cannot be split so: "
        f"it needs Hq % {a} == 0 and Hkv % {a} == 0 or {a} % Hkv == 0; sizes that work: {works}"
    )


class UlyssesFunc(torch.autograd.Function):
    """Autograd Function: all-to-all q, k, v and out forward; all-to-all dout, dq, dk, dv backward
    (in `groups` head groups, pipelined with the kernel, when `groups > 1`: `cpref.modes.ulysses_pipeline`)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, plan: A2APlan, comm, kernel, causal: bool, scale: float, groups: int = 1, sinks=None):
        """Exchange heads for tokens, one kernel call over the whole stream (the sinks of this rank's heads added
        to its whole rows), exchange back."""
        ctx.plan, ctx.comm, ctx.kernel, ctx.causal, ctx.scale, ctx.groups = plan, comm, kernel, causal, scale, groups
        ctx.sinks = sinks is not None
        ctx.dtypes = (k.dtype, v.dtype)
        if groups > 1:
            out, saved = pipelined_forward(q, k, v, plan, comm, kernel, groups, causal=causal, scale=scale)
            ctx.save_for_backward(*saved)
            return out
        # 1) heads out, tokens in: every rank holds the whole stream for H/P heads, in natural order
        qg = a2a_gather(q, plan, comm)  # (T, Hq/P, D)
        kg = a2a_gather(replicate(k, plan.replicas), plan, comm)  # (T, Hkv'/P, D)
        vg = a2a_gather(replicate(v, plan.replicas), plan, comm)  # (T, Hkv'/P, Dv)
        # 2) one varlen call over every document, padding seen by no query
        own = head_slice(sinks, comm.rank, comm.size)  # (Hq/P,): the sinks of this rank's heads, or None
        out_g, lse_g = kernel.forward(qg, kg, vg, plan.attend, causal=causal, window=plan.window, scale=scale,
                                      out_dtype=None if own is None else compute_dtype(q.dtype))  # (T, Hq/P, Dv)
        if own is not None:  # every row is whole here: the sink enters once
            out_g, lse_g = add_sinks(out_g, lse_g, own)
            out_g = out_g.to(q.dtype)
        # 3) tokens out, heads in
        ctx.save_for_backward(qg, kg, vg, out_g, lse_g, own)
        return a2a_scatter(out_g, plan, comm)  # (T_l, Hq, Dv)

    @staticmethod
    def backward(ctx: Any, dout):
        """The same exchanges for dout, dq, dk, dv around one backward kernel call."""
        no_double_backward()
        plan, comm = ctx.plan, ctx.comm
        if ctx.groups > 1:
            grads = pipelined_backward(dout.contiguous(), list(ctx.saved_tensors), plan, comm, ctx.kernel, ctx.groups,
                                       causal=ctx.causal, scale=ctx.scale)  # fmt: skip
            return (*grads, None, None, None, None, None, None, None)
        qg, kg, vg, out_g, lse_g, own = ctx.saved_tensors
        # 1) the upstream gradient takes the same way as q
        dout_g = a2a_gather(dout.contiguous(), plan, comm)  # (T, Hq/P, Dv)
        # the sinks' gradient: this rank's heads, over every row of the stream (zero on the other heads)
        dsinks = None if own is None else on_all_heads(sinks_grad(dout_g, out_g, lse_g, own), comm.rank, comm.size)
        # 2) one backward call; every row is whole, so Delta comes from float32 probabilities
        grads = list(ctx.kernel.backward(
            dout_g, qg, kg, vg, out_g, lse_g, plan.attend, causal=ctx.causal, window=plan.window, scale=ctx.scale,
            full_rows=True,
            grad_dtype=kv_grad_dtype(plan, kg.dtype),
        ))  # dQ (T, Hq/P, D), dK (T, Hkv'/P, D), dV (T, Hkv'/P, Dv): what the exchange moves
        grads[0] = grads[0].to(qg.dtype)  # dQ in the input dtype; dK/dV of replicated heads unrounded
        del dout_g  # freed before the exchanges
        # 3) back to sequence shards; replicated key/value heads sum their gradients (in float32)
        return (*scatter_grads(grads, plan, comm, ctx.dtypes), None, None, None, None, None, None, dsinks)


def check_ulysses(call: CPCall) -> None:
    """The mode's own constraints: the heads split over all P ranks, and into `head_groups` groups on each."""
    check_a2a_heads(call.heads[0], call.heads[1], call.P, call.P, "mode 'a2a'")
    check_head_groups(call.options["head_groups"], call.heads[0], call.heads[1], call.P)
    check_sinks_in_one_exchange(call, "mode 'a2a'")


def check_sinks_in_one_exchange(call: CPCall, what: str) -> None:
    """Refuse learnable sinks with `head_groups > 1`: the pipelined exchange's calls do not add them."""
    if call.sinks is not None and call.options["head_groups"] > 1:
        raise CPInputError(
            f"{what} with head_groups={call.options['head_groups']} does not run learnable sinks (its pipelined "
            "exchange's calls do not add them); pass head_groups=1 (the default) with sinks"
        )


def check_head_groups(n: int, hq: int, hkv: int, P: int, what: str = "mode 'a2a'", ranks: str | None = None) -> None:
    """Raise unless `n` head groups split evenly the key/value heads each of the `P` ranks of the exchange holds
    (`cpref.modes.ulysses_pipeline`); `what` and `ranks` name the mode and its exchange's ranks in the message."""
    per_rank = hkv * head_split(hq, hkv, P) // P  # key/value heads on each rank after the exchange
    if per_rank % n:
        raise CPInputError(
            f"{what} with head_groups={n}: each of the {ranks or f'P = {P} ranks'} holds {per_rank} key/value head(s) "
            f"after the exchange (Hq = {hq}, Hkv = {hkv}), which {n} groups cannot split evenly; head_groups that work: "
            f"{head_groups_that_work(per_rank)}"
        )


def ulysses_plan(call: CPCall):
    """The group's exchange plan and its one kernel call, from the batch cache; for the stream and balanced
    layouts, the split plan (`cpref.modes.ulysses_split`: only the documents that span ranks travel)."""
    if call.layout not in CHUNKED_LAYOUTS and call.P > 1:
        return split_plan(call)
    return a2a_plan(call, call.P, 0, call.heads[1], with_attention=True)


def run_ulysses(q, k, v, call: CPCall, comm: Collectives) -> torch.Tensor:
    """Run the mode: the plan, then the Function; under a mask, the hierarchy with one a2a group of all P ranks (its
    ring of one member runs the mask's calls on the whole stream, `cpref.modes.mask_plan`)."""
    if call.mask is not None:
        return run_masked(q, k, v, call, comm, call.P)
    plan = ulysses_plan(call)
    func = UlyssesFunc if isinstance(plan, A2APlan) else SplitUlyssesFunc
    groups = call.options["head_groups"] if pipelines(call.options["head_groups"], call.P) else 1
    return func.apply(q, k, v, plan, comm, call.kernel, call.causal, call.scale, groups, call.sinks)


def ulysses_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows, window,
                  head_groups, balance=True) -> ModeCosts:  # fmt: skip
    """Per-rank traffic, collectives and saved bytes of one layer: the exchange over all P ranks. With
    `gathered_rows` (stream, balanced: `cpref.modes.ulysses_split`) the exchange of those `m` rows; its saved
    bytes are then an upper bound (every local row counted as an own row, and the `m` exchanged ones). In
    `head_groups` groups (`cpref.modes.ulysses_pipeline`) the same bytes in that many times the all-to-alls."""
    if gathered_rows is None:
        return _grouped(exchange_costs(P, local_tokens, heads, dtype), head_groups, P)
    own = exchange_costs(1, local_tokens, heads, dtype)  # an exchange over one rank: no traffic, the saved rows
    if not gathered_rows:
        return own
    shared = _grouped(exchange_costs(P, gathered_rows, heads, dtype), head_groups, P)
    return ModeCosts(shared.forward_bytes, shared.backward_bytes, shared.forward_ops, shared.backward_ops,
                     own.saved_bytes + shared.saved_bytes)  # fmt: skip


def _grouped(costs: ModeCosts, groups: int, P: int) -> ModeCosts:
    """`costs` with each collective called once per head group, where the exchange is pipelined."""
    if not pipelines(groups, P):
        return costs
    ops = Counter({op: count * groups for op, count in costs.forward_ops.items()})
    return ModeCosts(costs.forward_bytes, costs.backward_bytes, ops, Counter(ops), costs.saved_bytes)


def ulysses_sizes(call: CPCall) -> dict:
    """For stream and balanced, the rows of the documents that span ranks each rank exchanges (the split plan's)."""
    plan = ulysses_plan(call)
    return {"gathered_rows": None if isinstance(plan, A2APlan) else plan.rows}


MODE = ModeSpec(
    name="a2a",
    order=2,
    run=run_ulysses,
    plan=ulysses_plan,
    collectives=frozenset({"all_to_all"}),
    costs=ulysses_costs,
    sizes=ulysses_sizes,
    options=(
        Option("head_groups", 1, lambda value: as_int("head_groups", value, lo=1),
               "the exchange in that many head groups, each group's attention while the next travels "
               "(`cpref.modes.ulysses_pipeline`); 1: the one exchange"),
        Option("balance", True, lambda value: as_bool("balance", value), BALANCE_DOC),
    ),
    check=check_ulysses,
    windows=True,
    variants=frozenset({"chunk", "sinks", "mask"}),
)
