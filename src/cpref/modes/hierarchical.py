r"""Hierarchical a2a+p2p CP: Ulysses inside groups of `a` ranks, a ring across the `p` groups.

Ulysses is limited by the head count and moves a lot when `P` is small relative to the GQA
group; the ring moves only K/V but needs `P` steps. The hierarchy (USP, Fang & Zhao 2024)
takes a bit of each: a CP group of $P = a \cdot p$ ranks is cut into `p` **a2a groups** of
`a` consecutive ranks, and the ranks at the same place in every a2a group form a **ring** of
`p` ranks:

$$ \text{a2a group } g = \{g a, \dots, g a + a - 1\}, \qquad
   \text{ring } j = \{j, j + a, \dots, j + (p - 1) a\}, \qquad r = g a + j . $$

Inside its a2a group a rank exchanges heads for tokens (`cpref.modes.ulysses`): it then holds
every token of its group for $\frac{H}{a}$ heads. Across the ring it runs ring attention
(`cpref.modes.ring`) on those tokens, in `p` steps. The output takes the way back. The
sub-groups are made once per communicator with `comm.split` and reused.

{{ figure figures/hierarchical_schedule.png }}

## Zigzag nests

After the exchange, a2a group `g` holds the chunks of its `a` ranks. Under zigzag over
`P`, rank $ga + j$ holds chunks $ga + j$ and $2P - 1 - ga - j$ of every document, so the
group holds

$$ \{ga, \dots, ga + a - 1\} \cup \{2P - (g + 1) a, \dots, 2P - 1 - ga\}, $$

two runs of `a` consecutive chunks. With chunks `a` times larger (a document cut into $2p$
pieces) these are pieces $g$ and $2p - 1 - g$: **exactly the zigzag layout over `p` ranks**,
rank `g`. (Contiguous nests the same way: the group holds piece `g` of `p`.) So a precomputed
permutation turns the gathered tokens into that layout's local order, and the ring level runs
the zigzag ring over `p` ranks unchanged: every ring step is balanced too. The permutation is
built from global token ids and checks the nesting as it is built.

With `a = 1` the exchange does nothing and this is the ring (`p2p`); with `a = P` the ring
has one step and this is Ulysses (`a2a`): both reduce exactly, bit for bit (over stream and
balanced too, below).

## Stream and balanced

The layouts that keep documents whole do not nest this way, and most of their documents need
no exchange at all: for them the mode runs [its split form][cpref.modes.hierarchical_split],
which attends to a rank's whole documents at home and takes only the documents that span
ranks through the exchange and the ring.

## In head groups

With `head_groups=n` the exchange inside the a2a group runs as [Ulysses in head
groups][cpref.modes.ulysses_pipeline] does: every group's all-to-alls of q, k and v posted at
once, and while group $c + 1$ travels, group $c$ runs **its own ring** across the groups, its
output posted home under the next group's ring. The backward takes `dout` the same way and
sends each group's dq, dk, dv home under the next group's ring backward. The ring's shifts
stay hidden behind the ring's own steps, as without groups; the groups hide the exchange:

```
post  q,k,v of groups 0 .. n-1          (inside the a2a group)
wait  group 0 -> its ring over p groups -> post its output
wait  group 1 -> its ring over p groups -> post its output
wait  every output; heads back in order
```

{{ figure figures/hierarchical_pipeline.png }}

The same bytes at both levels in `n` times the all-to-alls and the ring's shifts (`n` rings,
each on $\frac{1}{n}$ of the heads), and `n` times the kernel calls of the shared rows, each
of $\frac{1}{n}$ of the work; the heads must split evenly (`n` dividing each rank's
$\frac{H_{kv}}{a}$ key/value heads, none replicated), else the call is refused before any
communication, naming the `head_groups` that work. With `a = 1` there is no exchange and the
option changes nothing. The stream and balanced layouts' own rows are attended after the
first posts, before the first wait. The values are the one exchange's to within a few units
of FP64's last place (4 eps of a tensor's largest value), not bit for bit: a ring step's calls
on fewer heads round differently. At CP = 2 the ring has one rank, and in every layout this is
Ulysses' pipeline bit for bit (whose timing the performance page shows); the default is
`head_groups=1`.

## Cost per rank

Forward: the a2a traffic of Ulysses over `a` ranks,
$\frac{a - 1}{a} \frac{T}{P} (H_q D + H'_{kv} D + H'_{kv} D_v + H_q D_v)$ elements, plus the
ring's over `p` ranks on the gathered blocks, $(p - 1) \frac{T}{P} H'_{kv} (D + D_v)$, with
$H'_{kv} = \max(H_{kv}, a)$. Backward: the same a2a volume (dK/dV in float32 when heads are
replicated, as in Ulysses), and the ring's $(p - 1) \frac{T}{P} H'_{kv} (D + D_v)$ in the
input dtype plus $p \frac{T}{P} H'_{kv} (D + D_v)$ float32 elements of dK/dV. Saved for backward: the gathered q, k, v, out and lse, as many
elements as the local shards; `out` in float32 when the ring has more than one step, as the
ring keeps it (see the ring's Precision).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from cpref.base.checks import as_bool, as_int
from cpref.base.errors import CPInputError
from cpref.batch.seqlens import CHUNKED_LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.modes.call import CPCall
from cpref.modes.costs import ModeCosts, combine, exchange_costs, halo_costs, kept_output_bytes, ring_costs
from cpref.modes.exchange import A2APlan, a2a_plan
from cpref.modes.exchange_ring import HierarchicalFunc, mask_exchange_plan, run_masked, subgroups
from cpref.modes.hierarchical_split import SplitHierarchicalFunc, SplitHierarchicalPlan, split_hierarchical_plan
from cpref.modes.ring import ring_plan
from cpref.modes.ring_plan import RingPlan
from cpref.modes.shared import head_split
from cpref.modes.spec import ModeSpec, Option
from cpref.modes.ulysses import check_a2a_heads, check_head_groups, check_sinks_in_one_exchange
from cpref.modes.ulysses_pipeline import pipelines
from cpref.modes.ulysses_split import BALANCE_DOC

__all__ = ["HierarchicalFunc", "subgroups", "run_hierarchical", "check_hierarchical", "example_a2a_size",
           "hierarchical_plan", "hierarchical_costs", "MODE"]

def example_a2a_size(P: int) -> int:
    """The a2a group size to suggest, and that the tools and tests take when none is given: 2 for an
    even `P` (2 x 2 at `P = 4`: both levels of the hierarchy do something), 1 (the ring) for an odd one."""
    return 2 if P % 2 == 0 else 1


def check_hierarchical(call: CPCall) -> None:
    """The mode's constraints: `a2a_size` given and dividing P, and `a` ranks able to split the heads."""
    a = call.options["a2a_size"]  # parsed: None or an int >= 1
    if a is None:
        raise CPInputError(
            f"mode 'a2a+p2p' needs a2a_size, the all-to-all group size dividing P = {call.P} "
            f"(e.g. a2a_size={example_a2a_size(call.P)}); a2a_size=1 is the ring, a2a_size=P is Ulysses"
        )
    if call.P % a:
        sizes = [d for d in range(1, call.P + 1) if call.P % d == 0]
        raise CPInputError(f"a2a_size={a} does not divide the CP size P = {call.P}; choose one of {sizes}")
    check_a2a_heads(call.heads[0], call.heads[1], a, call.P, f"mode 'a2a+p2p' with a2a_size={a}")
    check_head_groups(call.options["head_groups"], call.heads[0], call.heads[1], a, f"mode 'a2a+p2p' (a2a_size={a})",
                      f"a = {a} ranks of an a2a group")  # fmt: skip
    check_sinks_in_one_exchange(call, f"mode 'a2a+p2p' (a2a_size={a})")


def hierarchical_plan(call: CPCall) -> tuple[A2APlan, RingPlan] | SplitHierarchicalPlan:
    """`(exchange, ring)`: this rank's a2a group exchange plan and its plan in the ring of `P / a` groups; for the
    stream and balanced layouts, the split plan (`cpref.modes.hierarchical_split`: only the documents that span
    ranks travel); under a mask, the group's tokens rank-major and the mask's ring (`cpref.modes.mask_plan`)."""
    a = call.options["a2a_size"]
    g = call.rank // a  # this rank's place in its ring: the index of its a2a group
    if call.mask is not None:
        return mask_exchange_plan(call, a), ring_plan(call, call.P // a, g, call.layout, a)
    if call.layout not in CHUNKED_LAYOUTS and call.P > 1:
        return split_hierarchical_plan(call)
    return a2a_plan(call, a, g, call.heads[1], with_attention=False), ring_plan(call, call.P // a, g, call.layout, a)


def run_hierarchical(q, k, v, call: CPCall, comm: Collectives) -> torch.Tensor:
    """Run the mode: the sub-groups, the exchange and ring plans, then the Function (under a mask,
    [`run_masked`][cpref.modes.exchange_ring.run_masked])."""
    a = call.options["a2a_size"]
    if call.mask is not None:
        return run_masked(q, k, v, call, comm, a)
    a2a_comm, ring_comm = subgroups(comm, a)
    plan = hierarchical_plan(call)
    groups = call.options["head_groups"] if pipelines(call.options["head_groups"], a) else 1
    if isinstance(plan, SplitHierarchicalPlan):
        return SplitHierarchicalFunc.apply(q, k, v, plan, a2a_comm, ring_comm, call.kernel, call.causal, call.scale,
                                           call.deterministic, groups, call.sinks)  # fmt: skip
    exchange, ring = plan
    return HierarchicalFunc.apply(q, k, v, exchange, ring, a2a_comm, ring_comm, call.kernel, call.scale, call.deterministic,
                                  groups, call.sinks)  # fmt: skip


def hierarchical_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows, window, a2a_size,
                       head_groups=1, balance=True) -> ModeCosts:  # fmt: skip
    """Per-rank traffic, collectives and saved bytes of one layer: the exchange over `a`, a ring of `P / a`; in
    `head_groups` groups, the same bytes in that many times every collective (an exchange and a ring per group);
    `balance` is in `gathered_rows` and `halo_sizes` (the split plan's)."""
    a = a2a_size
    if a is None or P % a:
        raise CPInputError(f"mode 'a2a+p2p' has costs for an a2a_size dividing P = {P}, got {a}")
    costs = _ungrouped_costs(P, local_tokens, heads, dtype, halo_sizes, gathered_rows, a)
    if not pipelines(head_groups, a):
        return costs
    forward, backward = (Counter({op: n * head_groups for op, n in ops.items()}) for ops in (costs.forward_ops, costs.backward_ops))
    return ModeCosts(costs.forward_bytes, costs.backward_bytes, forward, backward, costs.saved_bytes)


def _ungrouped_costs(P, t, heads, dtype, halo_sizes, gathered_rows, a) -> ModeCosts:
    """`hierarchical_costs` of the one exchange."""
    exchange = exchange_costs(a, t if gathered_rows is None else gathered_rows, heads, dtype)
    h = heads[1] * head_split(heads[0], heads[1], a)  # key/value heads after the exchange's replication
    if gathered_rows is not None:  # stream, balanced: the split plan, the own rows at home (an upper bound, as a2a's)
        own = exchange_costs(1, t, heads, dtype)  # an exchange over one rank: no traffic, the saved rows
        if not gathered_rows:
            return own
        own = own.saved_bytes
        halo = halo_costs(halo_sizes or (0,), heads, h // a, dtype)  # None: a ring of one, which sends nothing
        return combine(exchange, halo, saved=own + exchange.saved_bytes + kept_output_bytes(P // a, gathered_rows, heads, dtype))
    if halo_sizes is not None:  # a window: the halo shifts over the ring of P / a groups, rows of h / a heads
        halo = halo_costs(halo_sizes, heads, h // a, dtype)
        return combine(exchange, halo, saved=exchange.saved_bytes + kept_output_bytes(2, t, heads, dtype))
    ring = ring_costs(P // a, t, h, heads, dtype)
    return combine(exchange, ring, saved=exchange.saved_bytes + kept_output_bytes(P // a, t, heads, dtype))


def _a2a_size(value: Any) -> int:
    return as_int("a2a_size", value, lo=1)


# --8<-- [start:declaration]
def hierarchical_sizes(call: CPCall) -> dict:
    """For stream and balanced, the shared rows each rank exchanges (the split plan's); the rows the ring across the
    `P / a` groups shifts, where it sends only what is read."""
    plan = hierarchical_plan(call)
    if isinstance(plan, SplitHierarchicalPlan):
        halo = plan.ring.halo
        return {"gathered_rows": plan.rows, "halo_sizes": None if halo is None else halo.sizes}
    _, ring = plan
    halo = ring.halo if call.P > call.options["a2a_size"] else None  # a ring of one member sends nothing
    return {"halo_sizes": None if halo is None else halo.sizes}


MODE = ModeSpec(
    name="a2a+p2p",
    order=3,
    run=run_hierarchical,
    plan=hierarchical_plan,
    collectives=frozenset({"all_to_all", "send_recv"}),
    costs=hierarchical_costs,
    sizes=hierarchical_sizes,
    options=(
        Option("a2a_size", None, _a2a_size, "the all-to-all group size `a` dividing P (Ulysses inside groups of `a` "
               "consecutive ranks, the ring across the P / a groups); required", example=example_a2a_size),
        Option("head_groups", 1, lambda value: as_int("head_groups", value, lo=1),
               "the exchange in that many head groups, each group's ring while the next group's exchange travels "
               "(`cpref.modes.ulysses_pipeline`); 1: the one exchange"),
        Option("balance", True, lambda value: as_bool("balance", value), BALANCE_DOC),
    ),
    check=check_hierarchical,
    windows=True,
    variants=frozenset({"chunk", "sinks", "mask"}),
)
# --8<-- [end:declaration]
