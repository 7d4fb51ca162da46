"""Attention variants in every mode (issue 45), rank by rank against the FP64 oracle on the simulated cluster.

Soft-capping: every kernel call of every mode is capped (the call's kernel is `SoftCapped`), forward and backward, in
every layout, at P = 1, 2, 4 and 8, with GQA and MLA head dims, causal or not, with a window or without; logits at 4
times the default scale, so that a cap of 3 changes most of them (a mode that skipped the cap in one of its calls, say
the ring's off-diagonal steps, fails here). Padded documents: padding rows get 0.
"""

from __future__ import annotations

import re

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from sim.cluster.simcluster import SimCluster
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison

HEADS = {"gqa": (8, 2, 8, 8), "mla": (8, 2, 12, 8)}  # (Hq, Hkv, D, Dv): a2a splits them at P = 2, 4, 8
NAMES = ("out", "dq", "dk", "dv")


@pytest.mark.sweep
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (5, 0)), (False, (-1, -1)), (False, (3, 2))],
                         ids=["causal", "causal-window", "full", "full-window"])  # fmt: skip
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_soft_capping_in_every_mode_matches_the_oracle_rank_by_rank(mode, P, layout, causal, window, heads):
    lengths = [6 * P + 1, 3 * P, 2]  # the first and the last padded under the chunked layouts
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS[heads], seed=P)
    scale, cap = 4 * HEADS[heads][2] ** -0.5, 3.0
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, window=window, softmax_scale=scale,
                        softcap=cap, **cpref.MODES[mode].example_options(P))  # fmt: skip
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal, window=window, scale=scale, softcap=cap)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} P={P} {layout} window={window} rank {r} {name}")


def rank_1_alone(extra: dict, *, grad: bool) -> tuple[list[str], SimCluster]:
    """`cpref.attention` (p2p) on 2 simulated ranks, rank 1 alone passing `extra`: `(each rank's error or "ran",
    cluster)`; `grad`: the shards require grad."""
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=2)
    q, k, v, _ = attention_inputs(sharding.total, HEADS["gqa"])
    cluster = SimCluster(2, timeout=30.0)

    def rank(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank).requires_grad_(grad) for t in (q, k, v))
        try:
            cpref.attention(ql, kl, vl, sharding, comm=comm, mode="p2p", **(extra if comm.rank == 1 else {}))
        except CPInputError as exc:
            return str(exc)
        return "ran"

    return cluster.run(rank), cluster


@pytest.mark.parametrize("bad, match", [
    (dict(softcap=0.0), "softcap=0.0 must be a finite number > 0"),
    (dict(softcap=float("nan")), "softcap=nan must be a finite number > 0"),
    (dict(softcap=30.0, kernel=cpref.kernels.npu_kernel.NpuKernel.__new__(cpref.kernels.npu_kernel.NpuKernel)),
     "softcap=30.0 needs a kernel that soft-caps its logits, but an instance of NpuKernel"),
    (dict(chunk=0), "chunk=0 must be an int >= 1"),
    (dict(chunk=2.5), "chunk=2.5 must be an int >= 1"),
    (dict(sinks=torch.zeros(3, dtype=torch.float64)), r"sinks has shape \(3,\)"),
    (dict(sinks=[0.0] * 8), "sinks is list, not a tensor"),
    (dict(sinks=torch.zeros(8, dtype=torch.float64)), "sinks do not require grad while q does"),
])  # fmt: skip
def test_a_bad_variant_is_refused_on_every_rank_before_any_communication(bad, match):
    """One rank alone passes it: that rank names the value, the others name that rank; nothing but the ranks'
    comparison was communicated."""
    results, cluster = rank_1_alone(bad, grad=True)
    assert "rank 1" in results[0] and match.split(" ")[0].split("=")[0] in results[1], results
    assert re.search(match, results[1]), results[1]
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize("theirs", [dict(chunk=4), dict(softcap=30.0), dict(sinks=torch.zeros(8, dtype=torch.float64))],
                         ids=["chunk", "softcap", "sinks"])  # fmt: skip
def test_ranks_that_pass_different_variants_are_named_before_any_communication(theirs):
    """Rank 1 alone chunks, caps or adds sinks: every rank raises naming the variants' column, before the mode
    communicates (a rank that computed another attention would run other collectives, or none of them wrong)."""
    results, cluster = rank_1_alone(theirs, grad=False)
    assert all("variants (softcap, chunk, sinks): rank 0: digest" in r for r in results), results
    assert only_the_comparison(cluster.trace), cluster.trace
