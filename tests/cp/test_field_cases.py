"""The field's own test cases (`notes/field.md`): its packed batch, its head dims and its fp32
tolerance, every mode, rank by rank.

Peer systems test fp32 CP at atol 2e-6 / rtol 1e-5 against the same op without CP, on batches
like `cu_seqlens = [0, 120, 1248, 4232]` and head dims 64 to 256 (MLA 192/128). The other CP
tests use small head dims and FP64; these run what the field runs.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from sim import SimCluster
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import TOL, cu_from_lengths, random_qkv

P = 4
MODES = {"all_gather": {}, "p2p": {}, "a2a": {}, "a2a+p2p": {"a2a_size": 2}}
NAMES = ("out", "dq", "dk", "dv")
FIELD_CU = torch.tensor([0, 120, 1248, 4232])  # documents of 120, 1128 and 2984 tokens: multiples of 2P


def field_sharding(cp_size=P):
    """The field's batch over `cp_size` ranks, zigzag (built per test: every test starts with an empty cache)."""
    return cpref.Sharding(FIELD_CU, cp_size=cp_size)


@pytest.fixture(scope="module")
def field_batch():
    """GQA, D = 64, fp32 on the field's batch, with each rank's shard of the fp32 run without CP
    (the same kernel at P = 1: the field's reference), computed once for every mode. (The kernel
    itself is checked against the FP64 oracle in tests/kernels; here what CP adds to it.)"""
    T, (hq, hkv, d, dv) = int(FIELD_CU[-1]), (8, 2, 64, 64)
    q, k, v = random_qkv(T, hq, hkv, d, dv, dtype=torch.float32, seed=0)
    dout = random_qkv(T, hq, hq, dv, dtype=torch.float32, seed=1)[0]
    cpref.clear_cache()
    (whole,), _ = run_cp(q, k, v, dout, field_sharding(1), mode="all_gather")
    sharding = field_sharding()
    without_cp = [[sharding.shard(t, r) for t in whole] for r in range(P)]
    return (q, k, v, dout), without_cp


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fp32_on_the_field_batch_matches_the_run_without_cp_at_the_field_tolerance(field_batch, mode):
    """Each rank's out, dq, dk, dv against the same kernel without CP at atol 2e-6 / rtol 1e-5 (the
    field's fp32 tolerance): CP's gathers, merges and reductions add no more than fp32 rounding."""
    (q, k, v, dout), without_cp = field_batch
    results, _ = run_cp(q, k, v, dout, field_sharding(), mode=mode, **MODES[mode])
    for r in range(P):
        for name, got, plain in zip(NAMES, results[r], without_cp[r]):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, plain, atol=2e-6, rtol=1e-5, msg=lambda m, r=r, name=name: f"{mode} rank {r} {name}\n{m}")


FIELD_HEADS = {  # (Hq, Hkv, D, Dv)
    "mha-12x64": (12, 12, 64, 64),
    "gqa-128": (8, 2, 128, 128),
    "gqa-256": (4, 2, 256, 256),
    "mla-192/128": (4, 1, 192, 128),
}


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", sorted(FIELD_HEADS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_field_head_dims_match_the_oracle_in_every_mode(mode, heads, dtype):
    """Head dims 64 to 256 and MLA's 192/128 (K/V heads replicated where Ulysses needs it), on three
    short documents at P = 4, with cross-rank sums rounded as NCCL and HCCL round them: every rank
    within the dtype's tolerance of the FP64 oracle (bf16 with GQA: 3.5e-2, TransformerEngine's)."""
    hq, hkv, d, dv = FIELD_HEADS[heads]
    sharding = cpref.Sharding(cu_from_lengths([24, 40, 64]), cp_size=P)
    q, k, v = random_qkv(sharding.total, hq, hkv, d, dv, dtype=dtype, seed=2)
    dout = random_qkv(sharding.total, hq, hq, dv, dtype=dtype, seed=3)[0]
    cluster = SimCluster(P, timeout=30.0, reduction="native")
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, cluster=cluster, **MODES[mode])
    refs = oracle_shards(*(t.double() for t in (q, k, v, dout)), sharding)
    tol = 3.5e-2 if dtype == torch.bfloat16 and hkv < hq else TOL[dtype]
    for r in range(P):
        for name, got, want in zip(NAMES, results[r], refs[r]):
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda m, r=r, name=name: f"rank {r} {name}\n{m}")
