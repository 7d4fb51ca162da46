"""Quickstart: context-parallel attention over 4 simulated ranks, checked against the FP64 oracle.

Run it from the repository root with `.venv/bin/python -m examples.quickstart` (after `make demo`
or `make test` has made .venv).
"""

# --8<-- [start:quickstart]
import torch

import cpref
from sim import SimCluster, oracle

P = 4  # ranks in the CP group
torch.manual_seed(0)

# 1) A packed batch: three documents of 100, 256 and 44 tokens, 8 query heads,
#    2 key/value heads.
cu_seqlens = torch.tensor([0, 100, 356, 400])
T, Hq, Hkv, D = 400, 8, 2, 64
q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)

# 2) One description of how the batch is sharded, built once: its boundaries,
#    the CP size and the layout. The zigzag layout cuts every document into 2P
#    chunks, so eod_padded pads each one at its end to a multiple of 2P; the
#    padding stays out of attention.
sharding = cpref.Sharding.eod_padded(cu_seqlens, cp_size=P, layout="zigzag")
# (T, H, D) -> (T_padded, H, D)
q_pad, k_pad, v_pad = (sharding.pad(x) for x in (q, k, v))


# 3) What every rank runs: take its shard, attend (the sharding tells attention
#    how), back-propagate.
def rank_program(comm):
    q_r, k_r, v_r = (
        sharding.shard(x, comm.rank).requires_grad_()
        for x in (q_pad, k_pad, v_pad)
    )
    out = cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="p2p")
    out.sum().backward()
    return out.detach(), q_r.grad


# 4) Run it on P simulated ranks (threads of this process), then put the shards
#    back together.
results = SimCluster(P).run(rank_program)
# (T, Hq, D): padding dropped
out = sharding.unpad(sharding.unshard([o for o, _ in results]))
dq = sharding.unpad(sharding.unshard([g for _, g in results]))

# 5) The same attention without CP, in float64: the definition of right.
grad_out = torch.ones(T, Hq, D, dtype=torch.float64)
ref_out, _, ref_dq, _, _ = oracle.forward_backward(q, k, v, cu_seqlens, grad_out)
print(
    f"out: {tuple(out.shape)}, "
    f"largest error against the FP64 oracle {(out - ref_out).abs().max():.1e}"
)
print(
    f"dq:  {tuple(dq.shape)}, "
    f"largest error against the FP64 oracle {(dq - ref_dq).abs().max():.1e}"
)
# --8<-- [end:quickstart]
