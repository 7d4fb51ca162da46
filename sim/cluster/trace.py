r"""Traces: one structured event per completed collective, and the bytes it moves.

The simulated cluster records every collective that completes as a frozen
[`CollectiveEvent`][sim.cluster.trace.CollectiveEvent] (one event per call of the *group*, not one
per rank) in `SimCluster.trace`. Traces are data: tests assert on them, docs and reports
render them, [`summarize`][sim.cluster.trace.summarize] totals them.

## Cost model

Byte counts follow the bandwidth-optimal algorithms (ring / pairwise exchange), in which every
rank sends exactly as much as it receives. For a group of $P$ ranks, with $n$ the bytes of one
rank's input ($N = P n$ where the input is split into $P$ chunks):

| op | bytes sent = bytes received, per rank |
| --- | --- |
| `all_gather` of $n$ bytes | $(P - 1)\, n$ |
| `reduce_scatter` of $N = P n$ bytes | $(P - 1)\, n = \frac{P - 1}{P} N$ |
| `all_to_all` of $N$ bytes | $\frac{P - 1}{P} N$ (the chunk for oneself stays home) |
| `send_recv` of $n$ bytes, `shift` | $n$ if $\mathrm{shift} \bmod P \ne 0$, else $0$ |
| `all_reduce` of $N$ bytes | $2 \frac{P - 1}{P} N$ (ring: reduce-scatter, then all-gather) |
| `barrier`, `split` | $0$ |

`reduce_scatter` and `all_to_all` require $P \mid$ dim 0, so their counts are exact integers;
for `all_reduce` the count is rounded down to whole bytes when $P \nmid N$.

Example:
    >>> from sim.cluster.trace import traffic
    >>> traffic("all_gather", size=4, nbytes=8)   # 3 peers x 8 bytes
    24
    >>> traffic("all_reduce", size=4, nbytes=32)  # 2 x 3/4 x 32
    48
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["CollectiveEvent", "TraceSummary", "summarize", "traffic"]


@dataclass(frozen=True)
class CollectiveEvent:
    """One completed collective of one group.

    Attributes:
        op: `"all_gather"`, `"reduce_scatter"`, `"all_to_all"`, `"send_recv"`, `"all_reduce"`,
            `"barrier"` or `"split"`.
        group: the global ranks of the group, in the group's rank order.
        seq: the call's sequence number on this group (0 for the group's first collective).
        dtype: dtype of the input (`None` for `barrier` and `split`).
        shape: shape of each rank's input; identical on all ranks (`None` for `barrier`, `split`).
        bytes_sent: bytes each member sends, indexed by rank in the group (see the cost model).
        bytes_recv: bytes each member receives, indexed by rank in the group.
        param: the call's extra argument, e.g. `"shift=1"`, `"op=max"`, `"groups=((0, 1),)"`.
    """

    op: str
    group: tuple[int, ...]
    seq: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    bytes_sent: tuple[int, ...]
    bytes_recv: tuple[int, ...]
    param: str = ""


def traffic(op: str, size: int, nbytes: int, shift: int = 1) -> int:
    """Bytes one rank sends (and receives) in `op`, under the bandwidth-optimal model.

    Args:
        op: the collective's name.
        size: the group size `P`.
        nbytes: bytes of one rank's input.
        shift: the ring shift of `send_recv` (ignored by the other ops).

    Returns:
        The byte count of the module docstring's table.

    Raises:
        ValueError: if `op` is not a collective of `cpref.comm.protocol.Collectives`.
    """
    p = size
    if op == "all_gather":
        return (p - 1) * nbytes  # (P - 1) n
    if op in ("reduce_scatter", "all_to_all"):
        return (p - 1) * nbytes // p  # (P - 1) / P * N
    if op == "send_recv":
        return nbytes if shift % p != 0 else 0
    if op == "all_reduce":
        return 2 * (p - 1) * nbytes // p  # 2 (P - 1) / P * N
    if op in ("barrier", "split"):
        return 0
    raise ValueError(f"traffic: unknown collective {op!r}; expected one of the Collectives methods")


@dataclass(frozen=True)
class TraceSummary:
    """Per-rank byte totals and per-op event counts of a trace.

    Attributes:
        bytes_sent: `{global rank: total bytes sent}` over all events the rank took part in.
        bytes_recv: `{global rank: total bytes received}`.
        counts: `{op: number of events}` (one per group call, not per rank).
    """

    bytes_sent: dict[int, int]
    bytes_recv: dict[int, int]
    counts: dict[str, int]

    def table(self) -> str:
        """Render the per-rank totals as a Markdown table."""
        rows = ["| rank | bytes sent | bytes received |", "| --- | --- | --- |"]
        rows += [f"| {g} | {self.bytes_sent[g]} | {self.bytes_recv[g]} |" for g in sorted(self.bytes_sent)]
        return "\n".join(rows)


def summarize(events: Iterable[CollectiveEvent]) -> TraceSummary:
    """Total the bytes of `events` per global rank and count the events per op.

    Args:
        events: trace events, e.g. `SimCluster.trace`.

    Returns:
        A `TraceSummary`; ranks appear in it once they take part in any event.

    Examples:
        >>> ev = CollectiveEvent("all_gather", (0, 1), 0, torch.float32, (2,), (8, 8), (8, 8))
        >>> s = summarize([ev, ev])
        >>> s.bytes_sent, s.counts
        ({0: 16, 1: 16}, {'all_gather': 2})
    """
    sent: Counter[int] = Counter()
    recv: Counter[int] = Counter()
    counts: Counter[str] = Counter()
    for ev in events:
        counts[ev.op] += 1
        for g, s, r in zip(ev.group, ev.bytes_sent, ev.bytes_recv):
            sent[g] += s
            recv[g] += r
    ranks = sorted(set(sent) | set(recv))
    return TraceSummary({g: sent[g] for g in ranks}, {g: recv[g] for g in ranks}, dict(counts))
