"""Learn CP, page 8: the hierarchical mode (a2a+p2p) on 4 simulated ranks, and
the groups its collectives ran on.

Run from the repository root: `.venv/bin/python -m examples.learn.hierarchy`.
"""

# --8<-- [start:run]
import torch

import cpref
from sim import SimCluster, oracle

P, T, H, D = 4, 32, 4, 16
# a2a_size: Ulysses inside groups of A ranks, a ring across the P / A groups
A = 2
torch.manual_seed(0)
cu_seqlens = torch.tensor([0, T])
q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
want, _ = oracle.attention(q, k, v, cu_seqlens)  # (T, H, D)
sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout="zigzag")


def program(comm):
    q_r, k_r, v_r = (sharding.shard(x, comm.rank) for x in (q, k, v))
    return cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="a2a+p2p",
                           a2a_size=A)


cluster = SimCluster(P)
outs = cluster.run(program)
error = max((o - sharding.shard(want, r)).abs().max().item()
            for r, o in enumerate(outs))
print(f"largest error {error:.1e}")
# (collective, group) -> [calls, bytes each rank sent]; the groups run
# concurrently, so sorted
calls = {}
for e in cluster.trace:
    # made once per communicator: the a2a groups, then the rings
    if e.op == "split":
        print(f"split into {e.param.removeprefix('groups=')}")
    # leave out the ranks' check that they agree on the call
    elif e.param != "host":
        total = calls.setdefault((e.op, e.group), [0, 0])
        total[0], total[1] = total[0] + 1, total[1] + e.bytes_sent[0]
for (op, group), (n, nbytes) in sorted(calls.items()):
    print(f"{op} on ranks {group}: {n} call{'s' * (n > 1)}, "
          f"{nbytes} B sent per rank")
# --8<-- [end:run]
