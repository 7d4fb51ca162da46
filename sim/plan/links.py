r"""Where a collective's bytes go: the peers a rank sends to, and over which link level.

Ranks sit on nodes of `ranks_per_node` consecutive global ranks (rank $r$ on node
$\lfloor r / n \rfloor$, as `torchrun` and the launchers number them). Two ranks of one node
talk over the **intra**-node link (NVLink, HCCS), two of different nodes over the **inter**-node
link (InfiniBand, RoCE).

Each collective runs the bandwidth-optimal algorithm the simulated cluster's cost model counts
([`sim.cluster.trace`][sim.cluster.trace]), so a rank sends in total what the trace says it does; this
module says to whom. For a group $g_0, \dots, g_{P-1}$, rank $i$ with an input of $n$ bytes:

| op | sends | to |
| --- | --- | --- |
| `all_gather` | $(P - 1)\, n$ | its ring successor $g_{i+1}$ ($P - 1$ steps of $n$) |
| `reduce_scatter` | $(P - 1)\, n / P$ | its ring successor ($P - 1$ steps of $n / P$) |
| `all_reduce` | $\lfloor 2 (P - 1)\, n / P \rfloor$ | its ring successor (reduce-scatter, then all-gather) |
| `all_to_all` | $n / P$ to each | every other member (pairwise exchange) |
| `send_recv`, shift $s$ | $n$ ($0$ if $P \mid s$) | $g_{i+s}$ |

Example:
    >>> from sim.plan.dry import Collective
    >>> import torch
    >>> c = Collective("all_to_all", tuple(range(16)), 3, (16, 8), torch.float32)  # 512 bytes
    >>> link_bytes(c, ranks_per_node=8)  # 7 peers on its node, 8 on the other
    {'intra': 224, 'inter': 256}
"""

from __future__ import annotations

from sim.plan.dry import Collective

__all__ = ["LEVELS", "sends", "link_bytes", "level"]

LEVELS = ("intra", "inter")


def level(a: int, b: int, ranks_per_node: int) -> str:
    """The link between global ranks `a` and `b`: `"intra"` on one node, else `"inter"`."""
    return "intra" if a // ranks_per_node == b // ranks_per_node else "inter"


def sends(c: Collective) -> list[tuple[int, int]]:
    """`(peer global rank, bytes)` rank `c.rank` sends in `c`, under the bandwidth-optimal algorithms."""
    P, i, n = len(c.group), c.rank, c.nbytes
    if P == 1:
        return []
    successor = c.group[(i + 1) % P]
    if c.op == "all_gather":
        return [(successor, (P - 1) * n)]
    if c.op == "reduce_scatter":
        return [(successor, (P - 1) * (n // P))]
    if c.op == "all_reduce":
        return [(successor, 2 * (P - 1) * n // P)]
    if c.op == "all_to_all":
        return [(c.group[j], n // P) for j in range(P) if j != i]
    if c.op == "send_recv":
        return [] if c.shift % P == 0 else [(c.group[(i + c.shift) % P], n)]
    raise ValueError(f"unknown collective {c.op!r}")


def link_bytes(c: Collective, ranks_per_node: int) -> dict[str, int]:
    """`{level: bytes}` rank `c.rank` sends in `c` over each link level."""
    me, out = c.group[c.rank], dict.fromkeys(LEVELS, 0)
    for peer, nbytes in sends(c):
        out[level(me, peer, ranks_per_node)] += nbytes
    return out
