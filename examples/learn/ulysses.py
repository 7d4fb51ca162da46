"""Learn CP, page 7: Ulysses written out in a few lines (one document,
contiguous, MHA), then cpref's mode.

Run from the repository root: `.venv/bin/python -m examples.learn.ulysses`.
"""

import torch

import cpref
from sim import SimCluster, oracle

P, T, H, D = 4, 32, 8, 16  # H heads, a multiple of P
torch.manual_seed(0)
cu_seqlens = torch.tensor([0, T])  # one document
q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
want, _ = oracle.attention(q, k, v, cu_seqlens)  # (T, H, D)
sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout="contiguous")
kernel = cpref.TorchKernel()


# --8<-- [start:by-hand]
def tokens_to_heads(x, comm):
    """(T/P, H, D), all heads of my tokens -> (T, H/P, D), all tokens of my
    heads."""
    n, h, d, P = *x.shape, comm.size
    # (P, T/P, H/P, D): head group j goes to rank j
    x = x.reshape(n, P, h // P, d).transpose(0, 1)
    # every rank's tokens of my heads, in rank order
    return comm.all_to_all(x.reshape(P * n, h // P, d))


def heads_to_tokens(y, comm):
    """(T, H/P, D), all tokens of my heads -> (T/P, H, D), all heads of my
    tokens."""
    t, h, d, P = *y.shape, comm.size
    # block j: my tokens of rank j's heads
    y = comm.all_to_all(y).reshape(P, t // P, h, d)
    return y.transpose(0, 1).reshape(t // P, P * h, d)  # (T/P, H, D)


def ulysses_attention(q_r, k_r, v_r, comm):
    # (T, H/P, D) each
    q_h, k_h, v_h = (tokens_to_heads(x, comm) for x in (q_r, k_r, v_r))
    # the whole document, as without CP, for H/P heads
    seqs = cpref.Varlen([0, T])
    # (T, H/P, D)
    out_h, _ = kernel.forward(q_h, k_h, v_h, seqs, causal=True, scale=D**-0.5)
    return heads_to_tokens(out_h, comm)  # (T/P, H, D)
# --8<-- [end:by-hand]


# --8<-- [start:run]
cluster = SimCluster(P)
outs = cluster.run(lambda comm: ulysses_attention(
    *(sharding.shard(x, comm.rank) for x in (q, k, v)), comm))
error = max((o - sharding.shard(want, r)).abs().max().item()
            for r, o in enumerate(outs))
print(f"by hand: largest error {error:.1e}")
print("by hand:",
      ", ".join(f"{e.op} {e.bytes_sent[0]} B" for e in cluster.trace))

cluster = SimCluster(P)
cluster.run(lambda comm: cpref.attention(
    *(sharding.shard(x, comm.rank) for x in (q, k, v)), sharding, comm=comm,
    mode="a2a"))  # fmt: skip
print("cpref a2a:", ", ".join(f"{e.op} {e.bytes_sent[0]} B"
                              for e in cluster.trace if e.param != "host"))
# --8<-- [end:run]
