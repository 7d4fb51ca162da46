"""Learn CP, page 2: the four collectives CP uses, on 4 simulated ranks, and the
bytes each moves.

Run from the repository root: `.venv/bin/python -m examples.learn.collectives`.
"""

# --8<-- [start:collectives]
import torch

from sim import SimCluster

P = 4


def inputs(r):
    """Rank r's tensors name their owner: `x` is [r, r], chunk j of `c` is
    10 r + j."""
    x = torch.full((2,), float(r))  # (2,)
    # (P,): one chunk per rank
    c = 10.0 * r + torch.arange(P, dtype=torch.float32)
    return x, c


def program(comm):
    """What every rank runs."""
    x, c = inputs(comm.rank)
    return {
        # (2,) -> (2 P,): every rank's x, in rank order
        "all_gather": comm.all_gather(x),
        # (P,) -> (1,): chunk r, summed over the ranks
        "reduce_scatter": comm.reduce_scatter(c),
        # (P,) -> (P,): chunk j goes to rank j; slot s holds rank s's
        "all_to_all": comm.all_to_all(c),
        # x of rank r - 1 (x goes to rank r + 1): the ring shift
        "send_recv": comm.send_recv(x),
    }


cluster = SimCluster(P)
results = cluster.run(program)  # one dict per rank
# one event per collective, with the bytes every rank sent
for event in cluster.trace:
    print(f"{event.op}: {event.bytes_sent[0]} bytes sent by every rank")
    for r in range(P):
        print(f"    rank {r} gets "
              f"{[int(e) for e in results[r][event.op].tolist()]}")
# --8<-- [end:collectives]
