"""Shared fixtures for CP-mode tests on the simulated cluster."""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.metadata import clear_cp_metadata_cache
from sim import oracle
from sim.cluster import SimCluster


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cp_metadata_cache()
    yield
    clear_cp_metadata_cache()


class CountingKernel:
    """Wraps a kernel and counts its forward and backward calls (per rank: one instance each)."""

    def __init__(self, inner=None):
        self.inner = inner or cpref.TorchKernel()
        self.forward_calls = 0
        self.backward_calls = 0

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.backward_calls += 1
        return self.inner.backward(*args, **kwargs)


def run_cp(q, k, v, dout, cu, *, P, mode, layout, causal=True, kernels=None, **kw):
    """Shard, run `cpref.attention` forward+backward on P simulated ranks; return (per-rank results, cluster)."""

    def rank_fn(comm):
        shard = lambda x: cpref.shard(x, cu, cp_size=P, rank=comm.rank, layout=layout)  # noqa: E731
        ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
        kernel = kernels[comm.rank] if kernels else None
        out = cpref.attention(ql, kl, vl, cu, comm=comm, mode=mode, layout=layout, causal=causal, kernel=kernel, **kw)
        out.backward(shard(dout))
        return out.detach(), ql.grad, kl.grad, vl.grad

    cluster = SimCluster(P, timeout=30.0)
    return cluster.run(rank_fn), cluster


def oracle_shards(q, k, v, dout, cu, *, P, layout, causal=True, scale=None):
    """The FP64 oracle's out, dq, dk, dv, cut into every rank's shard."""
    out, _, dq, dk, dv = oracle.forward_backward(q, k, v, cu, dout, causal=causal, scale=scale)
    return [[cpref.shard(t, cu, cp_size=P, rank=r, layout=layout) for t in (out, dq, dk, dv)] for r in range(P)]
