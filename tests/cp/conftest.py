"""Shared fixtures for CP-mode tests on the simulated cluster (the harness lives in `sim.cluster.harness`)."""

from __future__ import annotations

import pytest
import torch

import cpref
from sim.cluster.harness import CountingKernel, oracle_shards, run_attention
from sim.cluster.simcluster import SimCluster
from tests.helpers import TOL, cu_from_lengths, random_qkv

__all__ = ["CountingKernel", "run_cp", "oracle_shards", "largest_bf16_error_over_logit_scales"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    cpref.clear_cache()
    yield
    cpref.clear_cache()


def run_cp(q, k, v, dout, sharding, *, mode, **kw):
    """Shard, run `cpref.attention` forward+backward on P simulated ranks; return (per-rank results, cluster)."""
    return run_attention(q, k, v, dout, sharding, mode=mode, **kw)


def largest_bf16_error_over_logit_scales(mode, P, heads, factors=(1.0, 2.5, 4.0), **extra) -> float:
    """The largest |error| / (1 + |reference|) of any rank's out, dq, dk, dv in bf16 against the FP64
    oracle, over logit scales `factor * D^-0.5`: three documents of 120-152 tokens, zigzag, causal,
    cross-rank sums rounded as NCCL and HCCL round them (`reduction="native"`). At P = 1 the kernel
    keeps it under a quarter of the bf16 tolerance at every scale; a mode that rounds a partial sum
    (of outputs, Delta's inputs or gradients) before it is complete lets it grow with the scale."""
    sharding = cpref.Sharding(cu_from_lengths([120, 128, 152]), cp_size=P)  # multiples of 2P for P <= 4, zigzag
    hq, hkv, d, dv = heads
    q, k, v = random_qkv(400, hq, hkv, d, dv, dtype=torch.bfloat16, seed=1)
    dout = random_qkv(400, hq, hq, dv, dtype=torch.bfloat16, seed=2)[0]
    worst = 0.0
    for factor in factors:
        scale = factor * d**-0.5
        cluster = SimCluster(P, timeout=30.0, reduction="native")
        results, _ = run_cp(q, k, v, dout, sharding, mode=mode, cluster=cluster, softmax_scale=scale, **extra)
        refs = oracle_shards(q.double(), k.double(), v.double(), dout.double(), sharding, scale=scale)
        for got, want in zip(results, refs):
            for a, b in zip(got, want):
                worst = max(worst, ((a.double() - b).abs() / (1 + b.abs())).max().item())
    return worst


BF16_FLAT = TOL[torch.bfloat16] / 4  # what the kernel holds at P = 1 at every scale
