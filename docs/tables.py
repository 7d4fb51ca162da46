"""Tables of the docs, computed at build time by running cpref on the simulated cluster.

Each function takes no input and returns Markdown; `docs/gen_pages.py` appends it to a page.
The figures they show are measured from the cluster's trace, so they cannot drift from the code.
"""

from __future__ import annotations

import torch

import cpref
from sim import SimCluster, summarize

# The all-gather trace example: 2 documents of 16 and 48 tokens, P = 4, GQA, float32.
TRACE_CU = torch.tensor([0, 16, 64])
TRACE_P, TRACE_HQ, TRACE_HKV, TRACE_D = 4, 4, 2, 16


def all_gather_trace() -> str:
    """Run one forward + backward of KV all-gather CP; tabulate its collectives and bytes."""
    P, T = TRACE_P, int(TRACE_CU[-1])
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, TRACE_HQ, TRACE_D, generator=g) for _ in range(2))
    k, v = (torch.randn(T, TRACE_HKV, TRACE_D, generator=g) for _ in range(2))

    def rank_fn(comm):
        local = [cpref.shard(t, TRACE_CU, cp_size=P, rank=comm.rank, layout="zigzag").requires_grad_() for t in (q, k, v)]
        out = cpref.attention(*local, TRACE_CU, comm=comm, mode="all_gather")
        out.backward(cpref.shard(dout, TRACE_CU, cp_size=P, rank=comm.rank, layout="zigzag"))

    cluster = SimCluster(P)
    cluster.run(rank_fn)
    formula = 2 * (P - 1) * (T // P) * TRACE_HKV * TRACE_D * 4  # 2 (P-1) (T/P) Hkv D elements, 4 bytes each
    rows = [
        f"Measured on the simulated cluster: `cu_seqlens = {TRACE_CU.tolist()}`, `P = {P}`, "
        f"`Hq = {TRACE_HQ}`, `Hkv = {TRACE_HKV}`, `D = Dv = {TRACE_D}`, float32, one forward and backward.",
        "",
        "| # | collective | shape per rank | bytes sent per rank | bytes received per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| {i} | `{ev.op}` | `{tuple(ev.shape)}` | {ev.bytes_sent[0]} | {ev.bytes_recv[0]} |"
        for i, ev in enumerate(cluster.trace)
    ]
    summary = summarize(cluster.trace)
    forward = sum(ev.bytes_sent[0] for ev in cluster.trace if ev.op == "all_gather")
    if forward != formula:  # the page states the formula: fail the build if the code disagrees
        raise RuntimeError(f"all-gather forward moved {forward} bytes per rank, the formula says {formula}")
    rows += [
        "",
        f"Per rank, the forward's two all-gathers move {forward} bytes, exactly the formula's "
        f"$2 (P-1) \\frac{{T}}{{P}} H_{{kv}} D$ elements; the backward's reduce-scatters move the same. "
        f"Total per rank: {summary.bytes_sent[0]} bytes sent, {summary.bytes_recv[0]} received.",
    ]
    return "\n".join(rows)


# page -> [(section title, table function)]
TABLES = {"all-gather.md": [("Communication, measured", all_gather_trace)]}
