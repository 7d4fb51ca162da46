"""Learn CP, page 5: the ring's forward written out in a few lines, then cpref's
ring forward and backward.

Run from the repository root: `.venv/bin/python -m examples.learn.ring`.
"""

import torch

import cpref
from cpref.kernels.merge import merge_partial
from sim import SimCluster, oracle

P, T, H, D = 4, 32, 2, 16
torch.manual_seed(0)
cu_seqlens = torch.tensor([0, T])  # one document
q, k, v, dout = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(4))
want, _ = oracle.attention(q, k, v, cu_seqlens)  # (T, H, D)
sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout="contiguous")
kernel = cpref.TorchKernel()


# --8<-- [start:by-hand]
def ring_attention(q_r, k_r, v_r, comm):
    """The forward of ring attention, one document, contiguous layout: rank r
    holds block r of P."""
    r, n = comm.rank, len(q_r)
    # every step: T/P queries against one block of T/P keys
    seqs = cpref.Varlen([0, n], [0, n])
    out = lse = None  # the running output and lse, merged step by step
    k_b, v_b = k_r, v_r  # the block held now: at step t, the block of rank r - t
    for t in range(comm.size):
        source = (r - t) % comm.size
        # causal: a later rank's keys are seen by no query here, so that step is
        # skipped
        if source <= r:
            # the own block under the causal mask; an earlier rank's block is
            # seen whole
            out_b, lse_b = kernel.forward(q_r, k_b, v_b, seqs,
                                          causal=source == r, scale=D**-0.5)
            if out is None:
                out, lse = out_b, lse_b
            else:
                merge_partial(out, lse, out_b, lse_b)  # page 4: exact
        # pass the block on to rank r + 1, take rank r - 1's
        if t + 1 < comm.size:
            k_b, v_b = comm.send_recv(k_b), comm.send_recv(v_b)
    return out  # (T/P, H, D)
# --8<-- [end:by-hand]


# --8<-- [start:run]
outs = SimCluster(P).run(lambda comm: ring_attention(
    *(sharding.shard(x, comm.rank) for x in (q, k, v)), comm))
error = max((o - sharding.shard(want, r)).abs().max().item()
            for r, o in enumerate(outs))
print(f"by hand: largest error {error:.1e}")


def with_cpref(comm):
    """cpref's ring (mode p2p) in bf16, forward and backward, a barrier between
    them."""
    q_r, k_r, v_r = (sharding.shard(x, comm.rank).bfloat16().requires_grad_()
                     for x in (q, k, v))
    out = cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="p2p")
    comm.barrier()
    out.backward(sharding.shard(dout, comm.rank).bfloat16())


cluster = SimCluster(P)
cluster.run(with_cpref)
# without the ranks' check that they agree on the call
events = [e for e in cluster.trace if e.param != "host"]
cut = [e.op for e in events].index("barrier")
for name, part in (("forward", events[:cut]), ("backward", events[cut + 1 :])):
    print(f"{name}: {len(part)} shifts:",
          ", ".join(f"{str(e.dtype)[6:]} {e.bytes_sent[0]} B" for e in part))
# --8<-- [end:run]
