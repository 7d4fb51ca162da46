"""Tables of the docs, computed at build time by running cpref on the simulated cluster.

Each function takes no input and returns Markdown; `docs/gen_pages.py` appends it to a page.
The figures they show are measured from the cluster's trace, so they cannot drift from the code.
"""

from __future__ import annotations

import torch

import cpref
from sim import summarize
from sim.harness import run_attention

# The all-gather trace example: 2 documents of 16 and 48 tokens, P = 4, GQA, float32.
TRACE_CU = torch.tensor([0, 16, 64])
TRACE_P, TRACE_HQ, TRACE_HKV, TRACE_D = 4, 4, 2, 16


def all_gather_trace() -> str:
    """Run one forward + backward of KV all-gather CP; tabulate its collectives and bytes."""
    P, T = TRACE_P, int(TRACE_CU[-1])
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, TRACE_HQ, TRACE_D, generator=g) for _ in range(2))
    k, v = (torch.randn(T, TRACE_HKV, TRACE_D, generator=g) for _ in range(2))
    _, cluster = run_attention(q, k, v, dout, TRACE_CU, P=P, mode="all_gather", layout="zigzag",
                               check_ranks=False, between=lambda comm: comm.barrier())  # fmt: skip
    # (P-1) (T/P) Hkv (D + Dv) elements per rank for K and V together, 4 bytes each
    formula = (P - 1) * (T // P) * TRACE_HKV * (TRACE_D + TRACE_D) * 4
    rows = [
        f"Measured on the simulated cluster: `cu_seqlens = {TRACE_CU.tolist()}`, `P = {P}`, "
        f"`Hq = {TRACE_HQ}`, `Hkv = {TRACE_HKV}`, `D = Dv = {TRACE_D}`, float32, one forward and backward "
        "(the default schedule; the barrier marks the end of the forward).",
        "",
        "| # | collective | shape per rank | bytes sent per rank | bytes received per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| {i} | `{ev.op}` | `{tuple(ev.shape) if ev.shape else '-'}` | {ev.bytes_sent[0]} | {ev.bytes_recv[0]} |"
        for i, ev in enumerate(cluster.trace)
    ]
    ops = [ev.op for ev in cluster.trace]
    split = ops.index("barrier")
    forward = sum(ev.bytes_sent[0] for ev in cluster.trace[:split])
    backward = sum(ev.bytes_sent[0] for ev in cluster.trace[split + 1 :])
    if ops != ["all_gather"] * 2 + ["barrier"] + ["all_gather"] * 2 + ["reduce_scatter"] * 2:
        raise RuntimeError(f"all-gather CP made the collectives {ops}; the page states 2 + (2 + 2)")
    if (forward, backward) != (formula, 2 * formula):  # the page states the formula: the build fails if the code disagrees
        raise RuntimeError(f"all-gather CP moved {forward} + {backward} bytes per rank; the formula says {formula} + {2 * formula}")
    summary = summarize(cluster.trace)
    rows += [
        "",
        f"Per rank, the forward's two all-gathers move {forward} bytes: exactly the formula's "
        f"$(P-1) \\frac{{T}}{{P}} H_{{kv}} (D + D_v)$ elements of 4 bytes. The backward gathers K and V "
        f"again and reduce-scatters dK and dV: {backward} bytes, twice as much. "
        f"Total per rank: {summary.bytes_sent[0]} bytes sent, {summary.bytes_recv[0]} received.",
    ]
    return "\n".join(rows)


# page -> [(section title, table function)]
TABLES = {"all-gather.md": [("Communication, measured", all_gather_trace)]}
