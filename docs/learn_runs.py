"""The runs the Learn CP figures are drawn from: cpref on the simulated cluster, recorded as it ran.

A figure of the Learn path shows what a real run did, never what it is supposed to do. `run`
runs a mode forward and backward on `SimCluster(P)` with a recording kernel on every rank and
returns the run: what each kernel call was given, identified by its contents (every row of the
call's `q` and `k` is looked up among the global tensors' (token, head) vectors, so a call is
known by the tokens and heads it saw, not by what the code meant to send it), the scores it
computed, every ring shift's payload where asked, and the cluster's trace. `flows` turns a
trace into the bytes every rank sent to every other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

import cpref
from sim.cluster.harness import mode_trace
from sim.cluster.simcluster import SimCluster


@dataclass
class Call:
    """One kernel call as the kernel saw it.

    Attributes:
        direction: "forward" or "backward".
        q_cells, k_cells: for every row of the call's `q` and `k`, the global `(token, head)` of each of its heads.
        sequences: per sequence of the call, `(query rows, key rows)` as ranges of the call's rows.
        causal: the call's mask.
        work: score entries per head the call computed (`Varlen.work`).
    """

    direction: str
    q_cells: list[list[tuple[int, int]]]
    k_cells: list[list[tuple[int, int]]]
    sequences: list[tuple[range, range]]
    causal: bool
    work: int

    @property
    def q_tokens(self) -> list[int]:
        return [row[0][0] for row in self.q_cells]

    @property
    def k_tokens(self) -> list[int]:
        return [row[0][0] for row in self.k_cells]

    @property
    def q_heads(self) -> list[int]:
        return [h for _, h in self.q_cells[0]]

    @property
    def k_heads(self) -> list[int]:
        return [h for _, h in self.k_cells[0]]


def _table(x: torch.Tensor) -> dict[tuple[float, ...], tuple[int, int]]:
    """`(T, H, D)` -> {the vector of token t, head h: (t, h)}; every vector distinct (random float64)."""
    table = {tuple(x[t, h].tolist()): (t, h) for t in range(x.shape[0]) for h in range(x.shape[1])}
    assert len(table) == x.shape[0] * x.shape[1], "every (token, head) vector is distinct"
    return table


class RecordingKernel:
    """A TorchKernel that records every call it makes (`Call`), knowing the global q and k by their vectors."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        self.inner, self.calls = cpref.TorchKernel(), []
        self._q, self._k = _table(q), _table(k)

    def _record(self, direction: str, q, k, seqs, causal: bool) -> None:
        cells = [[[table[tuple(x[i, j].tolist())] for j in range(x.shape[1])] for i in range(x.shape[0])]
                 for table, x in ((self._q, q.double()), (self._k, k.double()))]  # fmt: skip
        sequences = [(range(a, b), range(c, d)) for a, b, c, d in zip(seqs.cu_q, seqs.cu_q[1:], seqs.cu_kv, seqs.cu_kv[1:])]
        self.calls.append(Call(direction, cells[0], cells[1], sequences, causal, seqs.work(causal)))

    def forward(self, q, k, v, seqs, **kwargs):
        self._record("forward", q, k, seqs, kwargs["causal"])
        return self.inner.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self._record("backward", q, k, seqs, kwargs["causal"])
        return self.inner.backward(dout, q, k, v, out, lse, seqs, **kwargs)


class RecordingComm:
    """A rank's collectives that keep a copy of every ring shift's payload (and the pass it was sent in)."""

    def __init__(self, comm) -> None:
        self._comm, self.shifts, self.phase = comm, [], "forward"

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1):
        self.shifts.append((self.phase, x.detach().clone(), shift))
        return self._comm.send_recv_async(x, shift)


@dataclass
class Run:
    """A forward + backward of one mode on the simulated cluster: inputs, what every rank's kernel and ring did."""

    mode: str
    sharding: cpref.Sharding
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    kernels: list[RecordingKernel]
    comms: list[RecordingComm]
    trace: list = field(default_factory=list)  # the mode's collectives, forward, one barrier, backward
    grads: list = field(default_factory=list)  # per rank (out, dq, dk, dv)

    @property
    def P(self) -> int:
        return self.sharding.cp_size

    def calls(self, rank: int, direction: str = "forward") -> list[Call]:
        return [c for c in self.kernels[rank].calls if c.direction == direction]

    def visible(self, x: int, y: int) -> bool:
        """Causal attention with EOD reset: query token x sees key token y."""
        doc = self._doc
        return doc[x] == doc[y] and y <= x

    @property
    def _doc(self) -> list[int]:
        cu = self.sharding.cu_seqlens_padded
        return [i for i in range(len(cu) - 1) for _ in range(cu[i], cu[i + 1])]

    def scores(self, call: Call) -> set[tuple[int, int]]:
        """The (query token, key token) scores `call` computed; checked against the kernel's own count."""
        q, k, doc = call.q_tokens, call.k_tokens, self._doc
        seen = {(q[i], k[j]) for rows, cols in call.sequences for i in rows for j in cols
                if doc[q[i]] == doc[k[j]] and (k[j] <= q[i] or not call.causal)}  # fmt: skip
        assert len(seen) == call.work, f"the call computed {call.work} scores, its tokens say {len(seen)}"
        return seen

    def owner(self) -> list[int]:
        """`owner[t]`: the rank holding token t."""
        owner = [-1] * self.sharding.total
        for r in range(self.P):
            for t in self.sharding.global_index(r).tolist():
                owner[t] = r
        return owner


def run(mode: str, cu: list[int], P: int, layout: str, heads=(4, 2, 8, 8), *, dtype=torch.float64, seed: int = 0,
        **options: Any) -> Run:  # fmt: skip
    """`mode` forward and backward on `SimCluster(P)`, every rank's kernel calls and ring shifts recorded; the inputs
    are drawn in float64 and rounded to `dtype`, which the mode runs in."""
    hq, hkv, d, dv = heads
    T, g = cu[-1], torch.Generator().manual_seed(seed)
    q, dout = torch.randn(T, hq, d, generator=g, dtype=torch.float64), torch.randn(T, hq, dv, generator=g, dtype=torch.float64)
    k, v = torch.randn(T, hkv, d, generator=g, dtype=torch.float64), torch.randn(T, hkv, dv, generator=g, dtype=torch.float64)
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
    q, k, v, dout = (x.to(dtype).double() for x in (q, k, v, dout))  # values every dtype holds exactly
    kernels = [RecordingKernel(q, k) for _ in range(P)]
    comms: list[Any] = [None] * P

    def rank_fn(comm):
        recording = comms[comm.rank] = RecordingComm(comm)
        local = [sharding.shard(x.to(dtype), comm.rank).requires_grad_() for x in (q, k, v)]
        out = cpref.attention(*local, sharding, comm=recording, mode=mode, kernel=kernels[comm.rank],
                              check_ranks=False, **options)  # fmt: skip
        comm.barrier()  # the end of the forward, in the trace
        recording.phase = "backward"
        out.backward(sharding.shard(dout.to(dtype), comm.rank))
        return out.detach(), *(x.grad for x in local)

    cluster = SimCluster(P, timeout=60.0)
    grads = cluster.run(rank_fn)
    return Run(mode, sharding, q, k, v, dout, kernels, comms, mode_trace(cluster), grads)


def split_trace(trace: list) -> tuple[list, list]:
    """`(forward, backward)` events of a `run`'s trace (cut at its barrier), without `split`s."""
    cut = [ev.op for ev in trace].index("barrier")
    return ([ev for ev in trace[:cut] if ev.op != "split"], [ev for ev in trace[cut + 1 :] if ev.op != "split"])


def flows(events: list, P: int) -> torch.Tensor:
    """`(P, P)`: the bytes each rank sent to each other in `events`, whose data went where.

    All-gather: each rank's input to every other; reduce-scatter and all-to-all: chunk j to rank j;
    send_recv: to the rank `shift` on. A rank's row sums to the bytes the trace says it sent.
    """
    sent = torch.zeros(P, P, dtype=torch.int64)
    for ev in events:
        group, n = ev.group, len(ev.group)
        if ev.op in ("barrier", "split") or n == 1:
            continue
        nbytes = torch.Size(ev.shape).numel() * torch.empty(0, dtype=ev.dtype).element_size()
        for i, src in enumerate(group):
            if ev.op == "send_recv":
                shift = int(ev.param.removeprefix("shift="))
                if shift % n:
                    sent[src, group[(i + shift) % n]] += nbytes
                continue
            each = nbytes if ev.op == "all_gather" else nbytes // n
            for dst in group:
                if dst != src:
                    sent[src, dst] += each
    totals = [sum(ev.bytes_sent[ev.group.index(r)] for ev in events if r in ev.group) for r in range(P)]
    assert sent.sum(1).tolist() == totals, f"flows {sent.sum(1).tolist()} != the trace's {totals}"
    return sent


def ops_text(events: list, rank: int = 0) -> str:
    """'2 all-gathers + 2 reduce-scatters': the collectives `rank` took part in, from a list of trace events."""
    names = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all",
             "send_recv": "shift"}  # fmt: skip
    counts: dict[str, int] = {}
    for ev in events:
        if ev.op in names and rank in ev.group:
            key = names[ev.op]
            counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{n} {op}{'s' * (n > 1)}" for op, n in counts.items())


@functools.cache
def example(name: str) -> dict:
    """The globals of `examples/learn/<name>.py` after running it (its output swallowed): a figure draws what
    the page's own example computed. Cached: read, never changed."""
    import contextlib
    import io
    import runpy

    with contextlib.redirect_stdout(io.StringIO()):
        return runpy.run_module(f"examples.learn.{name}", run_name="__main__")
