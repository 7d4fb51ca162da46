"""Counted, not timed: every mode's bytes, collectives, kernel calls and saved memory per rank equal
the analytic figures its page states (`cpref.modes.costs`), for every layout and head configuration."""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.api import mode_costs
from cpref.modes.shared import head_split
from sim.cluster.harness import saved_bytes, trace_split
from tests.cp.conftest import CountingKernel, run_cp
from tests.helpers import HEADS, attention_inputs, cu_from_lengths, random_qkv

CONFIGS = [  # (mode, options, P)
    ("all_gather", {}, 4),
    ("all_gather", {"save_gathered_kv": True}, 4),
    ("all_gather", {"overlap": True}, 4),
    ("all_gather", {"overlap": True, "save_gathered_kv": True}, 2),
    ("p2p", {}, 2),
    ("p2p", {}, 4),
    ("a2a", {}, 4),
    ("a2a", {}, 8),
    ("a2a", {"head_groups": 2}, 2),  # per rank: 4 key/value heads of MHA, 1 of the others (fit: 1 group)
    ("a2a", {"head_groups": 2}, 4),
    ("a2a+p2p", {"a2a_size": 2}, 4),
    ("a2a+p2p", {"a2a_size": 2}, 8),
    ("a2a+p2p", {"a2a_size": 4}, 8),
    ("a2a+p2p", {"a2a_size": 2, "head_groups": 2}, 4),  # a ring per head group
]
IDS = [f"{m}-P{P}" + "".join(f"-{k}={v}" for k, v in o.items()) for m, o, P in CONFIGS]


def fit(mode, options, heads, P):
    """`options` with `head_groups` lowered to 1 where the heads do not split into that many groups per rank."""
    n, a = options.get("head_groups"), options.get("a2a_size", P)  # the heads split over the exchange's ranks
    if n is None or (heads[1] * head_split(heads[0], heads[1], a) // a) % n == 0:
        return options
    return {**options, "head_groups": 1}


def steps_with_work(mode, options, P, rank, layout, causal):
    """Kernel calls `(forward, backward)`: one for all-gather and Ulysses (overlapped: a local and, where the rank
    reads another's keys, a remote call; the backward's local call in two halves unless the K/V are kept), one per
    ring step that has work."""
    if mode == "all_gather" and options.get("overlap"):
        remote = not (layout == "contiguous" and causal and rank == 0)  # contiguous rank 0 reads only its own keys
        return 1 + remote, (1 if options.get("save_gathered_kv") else 2) + remote
    if mode == "a2a":
        n = options.get("head_groups", 1)
        return n, n
    if mode == "all_gather":
        return 1, 1
    a = options.get("a2a_size", 1)
    p, g = P // a, rank // a
    calls = g + 1 if layout == "contiguous" and causal else p
    groups = options.get("head_groups", 1) if a > 1 else 1  # a ring per head group
    return groups * calls, groups * calls


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("mode, options, P", CONFIGS, ids=IDS)
def test_bytes_collectives_and_kernel_calls_equal_the_documented_costs(mode, options, P, heads, layout, causal):
    options = fit(mode, options, HEADS[heads], P)
    sharding = cpref.Sharding(cu_from_lengths([2 * P * 3, 2 * P]), cp_size=P, layout=layout)
    dtype = torch.bfloat16  # 2-byte payload, 4-byte float32 accumulators: the formulas must tell them apart
    q, k, v, dout = attention_inputs(sharding.total, HEADS[heads], dtype=dtype)
    kernels = [CountingKernel() for _ in range(P)]
    _, cluster = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, kernels=kernels, check_ranks=False,
                        between=lambda comm: comm.barrier(), **options)  # fmt: skip
    for r in range(P):
        want = mode_costs(mode, sharding, heads=HEADS[heads], dtype=dtype, rank=r, causal=causal, **options)
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), f"rank {r}"
        assert (fwd_ops, bwd_ops) == (dict(want.forward_ops), dict(want.backward_ops)), f"rank {r}"
        calls = steps_with_work(mode, options, P, r, layout, causal)
        assert (kernels[r].forward_calls, kernels[r].backward_calls) == calls, f"rank {r}"


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("mode, options, P", CONFIGS, ids=IDS)
def test_saved_bytes_for_backward_equal_the_formula(mode, options, P, heads, dtype):
    options = fit(mode, options, HEADS[heads], P)
    sharding = cpref.Sharding(cu_from_lengths([2 * P * 3, 2 * P]), cp_size=P)
    q, k, v, _ = attention_inputs(sharding.total, HEADS[heads], dtype=dtype)
    measured = saved_bytes(q, k, v, sharding, mode=mode, check_ranks=False, **options)
    for r in range(P):
        want = mode_costs(mode, sharding, heads=HEADS[heads], dtype=dtype, rank=r, **options)
        assert measured[r] == want.saved_bytes, f"rank {r}"


@pytest.mark.parametrize("mode, options", [("p2p", {}), ("a2a", {}), ("a2a+p2p", {"a2a_size": 2}), ("all_gather", {})])
def test_saved_memory_falls_as_one_over_p(mode, options):
    """Memory is what CP is for: each rank saves 1/P of the layer's activations (MHA: no head replicated)."""
    per_rank = {}
    for P in (2, 4, 8):
        sharding = cpref.Sharding(cu_from_lengths([128]), cp_size=P)
        q, k, v = random_qkv(128, 8, 8, 8)
        per_rank[P] = saved_bytes(q, k, v, sharding, mode=mode, check_ranks=False, **options)[0]
    assert per_rank[2] == 2 * per_rank[4] == 4 * per_rank[8]


def test_ulysses_replicated_kv_heads_do_not_shrink_with_p():
    """With Hkv < P every rank keeps P replicated heads of T/P tokens: K/V memory stays T Hkv' / P = T."""
    kv = {}
    for P in (2, 4, 8):
        q, k, v = random_qkv(128, 8, 1, 8)  # MQA: one key/value head, replicated P times
        total = saved_bytes(q, k, v, cpref.Sharding(cu_from_lengths([128]), cp_size=P), mode="a2a", check_ranks=False)[0]
        q_out_lse = (128 // P) * (8 * (8 * 8 + 8 * 8) + 8 * 8)  # q, out (fp64) and lse: fall as 1/P
        kv[P] = total - q_out_lse
    assert kv[2] == kv[4] == kv[8] == 128 * (8 + 8) * 8  # T (D + Dv) elements of 8 bytes, whatever P
