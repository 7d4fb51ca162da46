"""Run `cpref.attention` rank by rank on the simulated cluster, and the oracle's answer for each rank.

The one per-rank harness of the repository: `make demo`, the tests and the docs' measured
tables all call [`run_attention`][sim.cluster.harness.run_attention] and
[`oracle_shards`][sim.cluster.harness.oracle_shards], so they cannot drift apart.

Global tensors cover the **padded** stream (`T` tokens, what is sharded). Where the sharding
pads, the oracle is computed on the real documents only and its results are padded back with
zeros: padding rows must come out 0 in `out` and in every gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import cpref
from sim import oracle
from sim.cluster.simcluster import SimCluster

__all__ = ["CountingKernel", "run_attention", "oracle_shards", "oracle_padded", "max_error", "saved_bytes", "trace_split", "mode_trace"]


class CountingKernel:
    """Wraps a kernel and records its calls (one instance per rank): counts, sequences, masks.

    Attributes:
        forward_calls, backward_calls: how many calls each way.
        calls: `(direction, seqs, causal, window)` of every call, in order.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner or cpref.TorchKernel()
        self.forward_calls = self.backward_calls = 0
        self.calls: list[tuple[str, cpref.Varlen, bool, tuple[int, int]]] = []

    @property
    def deterministic(self) -> bool:
        """What the wrapped kernel declares (`cpref.base.determinism`)."""
        return getattr(self.inner, "deterministic", False) is True

    def forward(self, q, k, v, seqs, **kwargs):
        """Record, then call the wrapped kernel's forward."""
        self.forward_calls += 1
        self.calls.append(("forward", seqs, kwargs["causal"], kwargs.get("window", (-1, -1))))
        return self.inner.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        """Record, then call the wrapped kernel's backward."""
        self.backward_calls += 1
        self.calls.append(("backward", seqs, kwargs["causal"], kwargs.get("window", (-1, -1))))
        return self.inner.backward(dout, q, k, v, out, lse, seqs, **kwargs)

    def forward_work(self) -> int:
        """Exact score entries per head of the forward calls made."""
        return sum(seqs.work(causal, window) for kind, seqs, causal, window in self.calls if kind == "forward")

NAMES = ("out", "dq", "dk", "dv")


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    sharding: cpref.Sharding,
    *,
    mode: str,
    kernels: Sequence[Any] | None = None,
    cluster: SimCluster | None = None,
    between: Callable[[Any], None] | None = None,
    **kwargs: Any,
) -> tuple[list[tuple[torch.Tensor, ...]], SimCluster]:
    """Shard the global tensors, run forward (+ backward) on `sharding.cp_size` simulated ranks.

    Args:
        q: global `(T, Hq, D)` queries over the padded stream.
        k: global `(T, Hkv, D)` keys.
        v: global `(T, Hkv, Dv)` values.
        dout: the upstream gradient `(T, Hq, Dv)`, or None for a forward only.
        sharding: the batch's `cpref.Sharding` (boundaries, `P`, layout).
        mode: the CP mode.
        kernels: one kernel per rank (default: `TorchKernel`).
        cluster: the cluster to run on (default: a new `SimCluster(P, timeout=60)`).
        between: called with the rank's comm between forward and backward (e.g. a barrier
            that marks the end of the forward in the trace).
        **kwargs: further `cpref.attention` arguments (`causal`, `softmax_scale`, ...); `sinks`, given, is
            every rank's own copy of the parameter (a leaf of its own, as a replicated weight is).

    Returns:
        `(results, cluster)`: per rank `(out, dq, dk, dv)` (only `(out,)` without `dout`), with `sinks` also
        the rank's gradient of the sinks, `(out, dq, dk, dv, dsinks)`: its rows' share, whose sum over the ranks
        is the whole batch's.
    """
    cluster = SimCluster(sharding.cp_size, timeout=60.0) if cluster is None else cluster
    sinks = kwargs.pop("sinks", None)

    def rank_fn(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank).detach().requires_grad_(dout is not None) for t in (q, k, v))
        kernel = kernels[comm.rank] if kernels else None
        own = {} if sinks is None else {"sinks": sinks.detach().clone().requires_grad_(dout is not None)}
        out = cpref.attention(ql, kl, vl, sharding, comm=comm, mode=mode, kernel=kernel, **kwargs, **own)
        if between is not None:
            between(comm)
        if dout is None:
            return (out.detach(),)
        out.backward(sharding.shard(dout, comm.rank))
        return out.detach(), ql.grad, kl.grad, vl.grad, *((own["sinks"].grad,) if own else ())

    return cluster.run(rank_fn), cluster


def oracle_padded(q, k, v, dout, sharding: cpref.Sharding, *, causal=True, scale=None, window=(-1, -1), **variants):
    """The oracle's `(out, dq, dk, dv)` over the padded stream: real rows exact, padding rows 0; `variants`:
    `softcap`, `chunk`, `sinks` (the oracle's arguments; with `sinks`, `dsinks` is the tuple's fifth)."""
    cu = torch.tensor(sharding.cu_seqlens)
    real = [sharding.unpad(t) for t in (q, k, v, dout)] if sharding.bounds.is_padded else [q, k, v, dout]
    out, _, dq, dk, dv, *dsinks = oracle.forward_backward(*real[:3], cu, real[3], causal=causal, scale=scale,
                                                          window=window, **variants)  # fmt: skip
    if sharding.bounds.is_padded:
        out, dq, dk, dv = (sharding.pad(t) for t in (out, dq, dk, dv))  # (T, ...): padding rows 0
    return (out, dq, dk, dv, *dsinks)


def oracle_shards(q, k, v, dout, sharding: cpref.Sharding, *, causal=True, scale=None, window=(-1, -1), **variants):
    """The oracle's `(out, dq, dk, dv)`, cut into every rank's shard: `[rank][tensor]` (the sinks' gradient, which
    no rank holds alone, is `oracle_padded`'s)."""
    full = oracle_padded(q, k, v, dout, sharding, causal=causal, scale=scale, window=window, **variants)[:4]
    return [[sharding.shard(t, r) for t in full] for r in range(sharding.cp_size)]


def max_error(results, refs) -> float:
    """The largest absolute difference over every rank and tensor (compared in float64)."""
    return max((a.double() - b.double()).abs().max().item() for got, want in zip(results, refs) for a, b in zip(got, want))


def saved_bytes(q, k, v, sharding: cpref.Sharding, *, mode: str, **kwargs: Any) -> list[int]:
    """Bytes each rank's `cpref.attention` saves for its backward, measured with saved-tensor hooks."""

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v)]
        packed: list[int] = []

        def pack(x: torch.Tensor) -> torch.Tensor:
            packed.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            cpref.attention(*local, sharding, comm=comm, mode=mode, **kwargs)
        return sum(packed)

    return SimCluster(sharding.cp_size, timeout=60.0).run(rank_fn)


def mode_trace(cluster) -> list:
    """The cluster's trace without the ranks' comparison of their arguments (`param == "host"`,
    one host exchange per call, `cpref.modes.consistency`): what the mode itself communicated."""
    return [ev for ev in cluster.trace if ev.param != "host"]


def trace_split(trace, rank: int) -> tuple[tuple[int, dict[str, int]], tuple[int, dict[str, int]]]:
    """`((bytes, ops), (bytes, ops))` of one global rank before and after the first barrier.

    The barrier is what `run_attention(..., between=lambda comm: comm.barrier())` puts at the
    end of the forward; `split` and `barrier` events are not counted as ops, nor the ranks'
    comparison of their arguments (`param == "host"`, `cpref.modes.consistency`), which is no mode's cost.
    """
    cut = next(i for i, ev in enumerate(trace) if ev.op == "barrier")
    halves = []
    for events in (trace[:cut], trace[cut + 1 :]):
        total, ops = 0, {}
        for ev in events:
            if rank in ev.group and ev.op not in ("split", "barrier") and ev.param != "host":
                total += ev.bytes_sent[ev.group.index(rank)]
                ops[ev.op] = ops.get(ev.op, 0) + 1
        halves.append((total, ops))
    return halves[0], halves[1]
