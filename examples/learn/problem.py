"""Learn CP, page 1: a sequence split over ranks, attended without communication,
is wrong.

Run from the repository root: `.venv/bin/python -m examples.learn.problem`.
"""

# --8<-- [start:problem]
import torch

import cpref
from sim import SimCluster, oracle

P, T, H, D = 4, 32, 2, 16  # ranks, tokens, heads, head dim
torch.manual_seed(0)
cu_seqlens = torch.tensor([0, T])  # one document of T tokens
q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
# (T, H, D): every query against all its earlier keys
want, _ = oracle.attention(q, k, v, cu_seqlens)

# Rank r holds tokens r T/P .. (r + 1) T/P - 1 of q, k and v (the contiguous
# layout).
sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout="contiguous")


def alone(r):
    """Rank r attends its queries to the keys it holds, and to no others."""
    q_r, k_r, v_r = (sharding.shard(x, r) for x in (q, k, v))  # (T/P, H, D) each
    # its T/P tokens, as if they were the document
    as_if_whole = cpref.Sharding([0, T // P], cp_size=1)
    return cpref.attention(q_r, k_r, v_r, as_if_whole, comm=cpref.SingleRank(),
                           mode="all_gather")


def with_cp(comm):
    """Every rank runs this; `comm` is its CP group, through which the keys it
    lacks arrive."""
    q_r, k_r, v_r = (sharding.shard(x, comm.rank) for x in (q, k, v))
    return cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="all_gather")


errors = {}  # each rank's largest error, alone and with CP
for name, outs in (("alone", [alone(r) for r in range(P)]),
                   ("with CP", SimCluster(P).run(with_cp))):
    errors[name] = [(out - sharding.shard(want, r)).abs().max().item()
                    for r, out in enumerate(outs)]
    print(f"{name:>8}: largest error of rank 0..{P - 1}:",
          " ".join(f"{e:.1e}" for e in errors[name]))
# --8<-- [end:problem]
