"""Learn CP, page 3: all-gather CP written out in a few lines, then cpref's mode
and its trace.

Run from the repository root: `.venv/bin/python -m examples.learn.all_gather`.
"""

import torch

import cpref
from sim import SimCluster, oracle

P, T, H, D = 4, 32, 2, 16
torch.manual_seed(0)
cu_seqlens = torch.tensor([0, T])  # one document
q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
want, _ = oracle.attention(q, k, v, cu_seqlens)  # (T, H, D)
sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout="contiguous")
kernel = cpref.TorchKernel()


# --8<-- [start:by-hand]
def all_gather_attention(q_r, k_r, v_r, comm):
    """The forward of all-gather CP, one document, contiguous layout: rank r
    holds tokens r T/P .. (r + 1) T/P - 1."""
    # (T/P, H, D) -> (T, H, D): every rank's, in order
    k_all, v_all = comm.all_gather(k_r), comm.all_gather(v_r)
    # causal: rank r's queries see the first (r + 1) T/P keys
    n = (comm.rank + 1) * len(q_r)
    # one sequence: T/P queries against n keys
    seqs = cpref.Varlen([0, len(q_r)], [0, n])
    # bottom-right causal: the last query is aligned with the last key, so
    # query x sees keys 0 .. r T/P + x
    out, lse = kernel.forward(q_r, k_all[:n], v_all[:n], seqs, causal=True,
                              scale=D**-0.5)
    return out  # (T/P, H, D)
# --8<-- [end:by-hand]


# --8<-- [start:run]
def by_hand(comm):
    return all_gather_attention(
        *(sharding.shard(x, comm.rank) for x in (q, k, v)), comm)


outs = SimCluster(P).run(by_hand)
error = max((o - sharding.shard(want, r)).abs().max().item()
            for r, o in enumerate(outs))
print(f"by hand: largest error {error:.1e}")


def with_cpref(comm):
    """cpref's all_gather mode, forward and backward, a barrier between them to
    mark the end of the forward."""
    q_r, k_r, v_r = (sharding.shard(x, comm.rank).requires_grad_()
                     for x in (q, k, v))
    out = cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="all_gather")
    comm.barrier()
    out.sum().backward()


cluster = SimCluster(P)
cluster.run(with_cpref)
for event in cluster.trace:
    # leave out the ranks' check that they agree on the call
    if event.param != "host":
        print(f"{event.op:>14} {str(event.shape or ''):>12} "
              f"{event.bytes_sent[0]:>5} bytes sent per rank")
# --8<-- [end:run]
