r"""The Ulysses pipeline (`head_groups=n`): the exchange in head groups, one group's attention while the next travels.

[Ulysses][cpref.modes.ulysses] waits for its three all-to-alls before its one kernel call, and
for the output's after it: nothing overlaps them. Attention is independent per head, so each
rank's share of the heads can be cut again, into `n` **head groups**, each exchanged and
attended on its own. A group's all-to-alls are posted (`all_to_all_async`), and while group
$c + 1$ travels, group $c$ is attended and its output sent home:

```
post   q,k,v of groups 0 .. n-1
wait   group 0  -> attend group 0 -> post its output
wait   group 1  -> attend group 1 -> post its output     (group 0's output travels meanwhile)
...
wait   every output; put the heads back in order
```

Only the first group's inputs and the last group's output are waited for with nothing to
do: about $\frac{2}{n}$ of the exchange's volume instead of all of it. The backward runs the
same pipeline on `dout` in and `dq`, `dk`, `dv` out.

{{ figure figures/ulysses_pipeline.png }}

## Head groups

Rank $r$'s head group $c$ of rank $j$'s heads is $j \frac{H}{a} + c \frac{H}{a n} + i$,
$0 \le i < \frac{H}{a n}$, for the query and (after any replication) the key/value heads
alike, so a group's query heads read exactly its own key/value heads (query heads are
grouped by the key/value head they read). The heads split if `n` divides each rank's
key/value heads $\frac{H'_{kv}}{a}$; `cpref.attention` refuses any other `head_groups`
before any communication, naming the ones that work. With $H_{kv} \le P$ (GQA with few
key/value heads, MQA) that is only `n = 1`: a pipeline never sees replicated key/value heads,
so its dK and dV go home in the input dtype, as the one exchange's do without replicas.

--8<-- "src/cpref/modes/ulysses_pipeline.py:groups"

## What it costs

The same bytes as the one exchange, in $4n$ all-to-alls each way instead of $4$ (costs
`forward_ops`, `backward_ops`), and $n$ kernel calls each way, of $\frac{1}{n}$ of the work
each (the same total). The saved tensors are the one exchange's, in $n$ pieces. Whether the
smaller calls and the extra collectives pay for what they hide is measured side by side in
`bench/scaling.py` (the performance page); the default is `head_groups=1`, the one exchange.

With the stream and balanced layouts ([split Ulysses][cpref.modes.ulysses_split]) the
shared rows take the pipeline, and the own rows' call, which needs no exchange, runs after the
first groups are posted, before the first wait.

The hierarchy ([a2a+p2p][cpref.modes.hierarchical]) runs the same pipeline inside its a2a
groups: what attends one group there is the ring across the groups (`attend` and
`attend_backward` below), not one kernel call.
"""

from __future__ import annotations

from typing import Callable

import torch

from cpref.comm.protocol import Collectives, Pending
from cpref.kernels.contract import AttentionKernel
from cpref.modes.exchange import A2APlan

__all__ = ["pipelines", "group_heads", "ungroup", "post_groups", "pipelined_forward", "pipelined_backward",
           "head_groups_that_work"]


def pipelines(groups: int, P: int) -> bool:
    """Whether the exchange runs in head groups: only where asked (`head_groups > 1`) and there is an exchange
    (`P > 1`)."""
    return groups > 1 and P > 1


def head_groups_that_work(hkv_per_rank: int) -> list[int]:
    """The `head_groups` that split `hkv_per_rank` key/value heads evenly: its divisors."""
    return [n for n in range(1, hkv_per_rank + 1) if hkv_per_rank % n == 0]


# --8<-- [start:groups]
def group_heads(x: torch.Tensor, a: int, n: int, c: int) -> torch.Tensor:
    """Head group `c` of every destination's heads, ready for the all-to-all: `(T_l, H, X) -> (a T_l, H/(a n), X)`."""
    t_l, h, d = x.shape
    x = x.reshape(t_l, a, n, h // (a * n), d)[:, :, c]  # (T_l, a, H/(a n), X): group c of rank j's heads
    return x.transpose(0, 1).reshape(a * t_l, h // (a * n), d)  # chunk j goes to rank j


def ungroup(parts: list[torch.Tensor], a: int) -> torch.Tensor:
    """Inverse of `group_heads` over every group, after the return all-to-all: `n x (a T_l, h, X) -> (T_l, a n h, X)`."""
    n, (rows, h, d) = len(parts), parts[0].shape
    x = torch.stack([p.reshape(a, rows // a, h, d) for p in parts], dim=1)  # (a, n, T_l, h, X): from rank s, group c
    return x.permute(2, 0, 1, 3, 4).reshape(rows // a, a * n * h, d)  # head s H/a + c H/(a n) + i
# --8<-- [end:groups]


def _arrived(pending: Pending, plan: A2APlan) -> torch.Tensor:
    """A group's rank-major tokens, in the plan's order."""
    x = pending.wait()
    return x if plan.perm is None else x.index_select(0, plan.perm)


def _send_home(y: torch.Tensor, plan: A2APlan, comm: Collectives) -> Pending:
    """Post a group's result back to the ranks its tokens came from (the plan's order undone first)."""
    y = y if plan.inv_perm is None else y.index_select(0, plan.inv_perm)
    return comm.all_to_all_async(y.contiguous())


def post_groups(xs: tuple[torch.Tensor, ...], n: int, comm: Collectives) -> list[list[Pending]]:
    """Post the all-to-alls of every head group of every tensor of `xs`, group by group: `[group][tensor]`."""
    return [[comm.all_to_all_async(group_heads(x, comm.size, n, c)) for x in xs] for c in range(n)]


def pipelined_forward(q, k, v, plan: A2APlan, comm: Collectives, kernel: AttentionKernel, n: int, *, causal: bool,
                      scale: float, meanwhile: Callable[[], None] | None = None, attend: Callable | None = None):  # fmt: skip
    """The forward in `n` head groups. Returns `(out, saved)`: `(T_l, Hq, Dv)` and each group's
    `(qg, kg, vg, out_g, lse_g)`, in group order. `meanwhile()` runs after the posts, before the first wait;
    `attend(qg, kg, vg) -> (out_g, lse_g)` attends one group (default: one kernel call over the plan's stream;
    the hierarchy passes its ring, `cpref.modes.hierarchical`). The output goes home in `q`'s dtype."""
    assert plan.replicas == 1, "head groups split each rank's own key/value heads: none is replicated"
    if attend is None:
        def attend(qg, kg, vg):
            return kernel.forward(qg, kg, vg, plan.attend, causal=causal, window=plan.window, scale=scale)
    # 1) every group's q, k, v posted
    posted = post_groups((q, k, v), n, comm)
    if meanwhile is not None:
        meanwhile()
    saved, home = [], []
    for group in posted:
        # 2) group c arrives (groups after it still travelling): attend it over the whole stream
        qg, kg, vg = (_arrived(p, plan) for p in group)  # (a T_l, Hq/(a n), D), (a T_l, Hkv'/(a n), D | Dv)
        out_g, lse_g = attend(qg, kg, vg)
        # 3) its output posted home while the next group is attended
        home.append(_send_home(out_g.to(q.dtype), plan, comm))
        saved += [qg, kg, vg, out_g, lse_g]
    # 4) every output back; heads in order
    return ungroup([p.wait() for p in home], comm.size), saved  # (T_l, Hq, Dv)


def pipelined_backward(dout, saved: list[torch.Tensor], plan: A2APlan, comm: Collectives, kernel: AttentionKernel,
                       n: int, *, causal: bool, scale: float, meanwhile: Callable[[], None] | None = None,
                       attend_backward: Callable | None = None):  # fmt: skip
    """The backward in `n` head groups from the forward's `saved`. Returns `(dq, dk, dv)` for the local rows.
    `attend_backward(dout_g, qg, kg, vg, out_g, lse_g) -> (dq_g, dk_g, dv_g)`, in the input dtype, is one group's
    backward (default: one kernel call, as `pipelined_forward`'s)."""
    if attend_backward is None:
        def attend_backward(dout_g, qg, kg, vg, out_g, lse_g):
            return kernel.backward(dout_g, qg, kg, vg, out_g, lse_g, plan.attend, causal=causal, window=plan.window,
                                   scale=scale, full_rows=True)  # fmt: skip
    # 1) every group's dout posted
    posted = [group[0] for group in post_groups((dout,), n, comm)]
    if meanwhile is not None:
        meanwhile()
    home = []
    for c, pending in enumerate(posted):
        # 2) group c's backward call while the next group's dout travels
        grads = attend_backward(_arrived(pending, plan), *saved[5 * c: 5 * c + 5])
        # 3) its gradients posted home (in the input dtype: the kernel's default `grad_dtype`)
        home.append([_send_home(g, plan, comm) for g in grads])
    # 4) every gradient back, heads in order
    return tuple(ungroup([group[i].wait() for group in home], comm.size) for i in range(3))
