"""Shared fixtures for CP-mode tests on the simulated cluster (the harness lives in `sim.harness`)."""

from __future__ import annotations

import pytest

import cpref
from sim.harness import oracle_shards, run_attention

__all__ = ["CountingKernel", "run_cp", "oracle_shards"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpref.clear_cache()
    yield
    cpref.clear_cache()


class CountingKernel:
    """Wraps a kernel and counts its forward and backward calls (per rank: one instance each)."""

    def __init__(self, inner=None):
        self.inner = inner or cpref.TorchKernel()
        self.forward_calls = 0
        self.backward_calls = 0
        self.calls: list[tuple[str, cpref.Varlen]] = []

    def forward(self, q, k, v, seqs, **kwargs):
        self.forward_calls += 1
        self.calls.append(("forward", seqs))
        return self.inner.forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self.backward_calls += 1
        self.calls.append(("backward", seqs))
        return self.inner.backward(dout, q, k, v, out, lse, seqs, **kwargs)


def run_cp(q, k, v, dout, cu, *, P, mode, layout, **kw):
    """Shard, run `cpref.attention` forward+backward on P simulated ranks; return (per-rank results, cluster)."""
    return run_attention(q, k, v, dout, cu, P=P, mode=mode, layout=layout, **kw)
