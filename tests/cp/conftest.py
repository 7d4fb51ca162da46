"""Shared fixtures for CP-mode tests on the simulated cluster (the harness lives in `sim.harness`)."""

from __future__ import annotations

import pytest

import cpref
from sim.harness import CountingKernel, oracle_shards, run_attention

__all__ = ["CountingKernel", "run_cp", "oracle_shards"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpref.clear_cache()
    yield
    cpref.clear_cache()


def run_cp(q, k, v, dout, cu, *, P, mode, layout, **kw):
    """Shard, run `cpref.attention` forward+backward on P simulated ranks; return (per-rank results, cluster)."""
    return run_attention(q, k, v, dout, cu, P=P, mode=mode, layout=layout, **kw)
