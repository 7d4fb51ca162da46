"""Learnable sinks (issue 45, GPT-OSS) in every mode, layout and CP size, against the FP64 oracle rank by rank, with
the reduction contract of their gradient.

A sink `s_h` joins every row's softmax denominator exactly once, however many kernel calls and merges a mode makes.
The bugs these catch: a sink added in every ring step or in both of a split mode's calls (counted P times), added
to none (the `TE #2541` bug: ignored, gradient 0), the wrong head's sink after Ulysses' head split, a padding row
given the sink's mass, a gradient all-gathered over a head-sharded group and then summed again (counted P times).
Sinks of about 20 as well as small ones: a sink near 0 changes little and hides bugs.

The contract of the gradient: each rank returns its share, its rows (p2p, all_gather) or its heads of the rows its
exchange gathered (a2a, a2a+p2p), zero elsewhere; the sum over the CP group, what a DP x CP gradient all-reduce
computes, counts every (row, head) once.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from sim.cluster.harness import oracle_padded
from sim.cluster.simcluster import SimCluster
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison

HEADS = (8, 2, 8, 8)  # (Hq, Hkv, D, Dv): GQA, split by a2a at P = 2, 4, 8 (Hkv replicated at P = 4, 8)
NAMES = ("out", "dq", "dk", "dv")
SINKS = {"small": torch.linspace(-0.5, 0.5, 8, dtype=torch.float64),
         "large": torch.tensor([20.0, -20.0, 19.0, 0.0, 21.0, 3.0, 20.5, -2.0], dtype=torch.float64)}  # fmt: skip


def lengths(P: int) -> list[int]:
    return [6 * P + 1, 3 * P, 2, 11 * P]  # padded under the chunked layouts: padding rows get 0 and no gradient


@pytest.mark.sweep
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("causal, window, chunk", [(True, (-1, -1), None), (True, (3, 0), None), (False, (-1, -1), None),
                                                   (False, (2, 3), 5), (True, (-1, -1), 4)],
                         ids=["causal", "causal-window", "full", "full-window-chunk", "causal-chunk"])  # fmt: skip
@pytest.mark.parametrize("sinks", sorted(SINKS))
def test_sinks_in_every_mode_match_the_oracle_rank_by_rank(mode, P, layout, causal, window, chunk, sinks):
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths(P)), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS, seed=P)
    variants = dict(causal=causal, window=window, chunk=chunk, sinks=SINKS[sinks])
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, **variants, **cpref.MODES[mode].example_options(P))
    refs = oracle_shards(q, k, v, dout, sharding, **variants)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} P={P} {layout} rank {r} {name}")
    dsinks = oracle_padded(q, k, v, dout, sharding, **variants)[4]
    assert_close(sum(result[4] for result in results), dsinks, torch.float64, msg=f"{mode} P={P} {layout} dsinks")


@pytest.mark.parametrize("mode, options", [
    ("all_gather", dict(overlap=True)), ("all_gather", dict(save_gathered_kv=True)), ("a2a", dict(balance=False)),
    ("a2a+p2p", dict(a2a_size=1)), ("a2a+p2p", dict(a2a_size=4)), ("a2a+p2p", dict(a2a_size=2, balance=False)),
], ids=str)  # fmt: skip
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
def test_sinks_under_the_modes_options(mode, options, layout):
    """The overlapped all-gather adds the sink after its two calls' merge; the hierarchy as a ring (a2a_size 1) and as
    Ulysses (a2a_size P); the split modes without their balance."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths(P)), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS, seed=7)
    sinks = SINKS["large"]
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, sinks=sinks, **options)
    for r, (got, want) in enumerate(zip(results, oracle_shards(q, k, v, dout, sharding, sinks=sinks))):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} {options} {layout} rank {r} {name}")
    want = oracle_padded(q, k, v, dout, sharding, sinks=sinks)[4]
    assert_close(sum(result[4] for result in results), want, torch.float64, msg=f"{mode} {options} dsinks")


def oracle_share(q, k, v, dout, sharding, rows: torch.Tensor, heads: slice, sinks) -> torch.Tensor:
    """The oracle's gradient of the sinks from the rows `rows` of the padded stream and the heads `heads` only:
    autograd through `oracle.attention` with the upstream gradient zero elsewhere."""
    mask = torch.zeros(sharding.total, sinks.shape[0], 1, dtype=torch.float64)
    mask[rows, heads] = 1.0
    return oracle_padded(q, k, v, dout * mask, sharding, sinks=sinks)[4]


@pytest.mark.parametrize("mode", ["p2p", "all_gather", "a2a", "a2a+p2p"])
def test_each_rank_returns_its_share_and_the_group_sum_counts_it_once(mode):
    """Zigzag, P = 4, large sinks: p2p's and all_gather's rank r returns the gradient of its own rows, all heads;
    a2a's the gradient of its heads (Hq / P of them) over every row; a2a+p2p (a2a_size 2) of its heads over the rows
    of its a2a group. Each is the oracle's over exactly that part, and they sum to the whole."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths(P)), cp_size=P)
    q, k, v, dout = attention_inputs(sharding.total, (8, 8, 8, 8), seed=5)
    sinks = SINKS["large"]
    options = cpref.MODES[mode].example_options(P)
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, sinks=sinks, **options)
    a = {"p2p": 1, "all_gather": 1, "a2a": P, "a2a+p2p": options.get("a2a_size")}[mode]
    for r in range(P):
        group = range(r // a * a, (r // a + 1) * a)  # the ranks whose rows its exchange gathered
        rows = torch.cat([sharding.global_index(g) for g in group])
        j = r % a
        heads = slice(j * 8 // a, (j + 1) * 8 // a)
        want = oracle_share(q, k, v, dout, sharding, rows, heads, sinks)
        assert_close(results[r][4], want, torch.float64, msg=f"{mode} rank {r}")
        assert torch.all(results[r][4][[h for h in range(8) if h not in range(8)[heads]]] == 0)
    total = oracle_padded(q, k, v, dout, sharding, sinks=sinks)[4]
    assert_close(sum(res[4] for res in results), total, torch.float64, msg=mode)


def test_after_a_dp_x_cp_step_the_sinks_gradient_is_the_models_without_cp_counted_once():
    """2 DP replicas x CP 2 (a2a, the head-sharded mode whose trap it is) on 4 simulated ranks: each replica its own
    batch, each rank its own copy of the sinks; the step's gradient all-reduce over all 4 ranks (DP x CP, as the
    model's other weights) gives the sum of the two batches' gradients without CP, each counted once."""
    P, dp = 2, 2
    shardings = [cpref.Sharding.eod_padded(cu_from_lengths(lens), cp_size=P) for lens in ([20, 12], [9, 30])]
    batches = [attention_inputs(s.total, HEADS, seed=10 + i) for i, s in enumerate(shardings)]
    sinks = SINKS["large"]

    def rank(comm):
        replica, r = divmod(comm.rank, P)
        cp = comm.split([list(range(d * P, (d + 1) * P)) for d in range(dp)])  # the CP groups: consecutive ranks
        sharding, (q, k, v, dout) = shardings[replica], batches[replica]
        own = sinks.clone().requires_grad_()
        ql, kl, vl = (sharding.shard(t, r).requires_grad_() for t in (q, k, v))
        out = cpref.attention(ql, kl, vl, sharding, comm=cp, mode="a2a", sinks=own)
        out.backward(sharding.shard(dout, r))
        return comm.all_reduce(own.grad)  # the step's DP x CP gradient sum

    grads = SimCluster(P * dp, timeout=60.0).run(rank)
    want = sum(oracle_padded(*batch, s, sinks=sinks)[4] for batch, s in zip(batches, shardings))
    for g in grads:
        assert_close(g, want, torch.float64, msg="DP x CP sum")


@pytest.mark.parametrize("mode, options", [("a2a", dict(head_groups=2)), ("a2a+p2p", dict(a2a_size=2, head_groups=2))])
def test_sinks_with_pipelined_head_groups_are_refused_on_every_rank_before_any_communication(mode, options):
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=2)
    q, k, v, _ = attention_inputs(sharding.total, (8, 8, 8, 8))
    cluster = SimCluster(2, timeout=30.0)

    def rank(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank) for t in (q, k, v))
        with pytest.raises(CPInputError, match="head_groups=2 does not run learnable sinks.*pass head_groups=1"):
            cpref.attention(ql, kl, vl, sharding, comm=comm, mode=mode, sinks=SINKS["small"], **options)

    cluster.run(rank)
    assert only_the_comparison(cluster.trace)


def test_frozen_sinks_are_taken_and_get_no_gradient_while_q_does():
    """A frozen `nn.Parameter` (a LoRA fine-tune freezes the base weights) is taken as it is: q, k, v get the
    sinked gradients, the sinks none; a plain tensor without grad is refused (`test_variants.py`)."""
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=2)
    q, k, v, dout = attention_inputs(sharding.total, HEADS)
    frozen = torch.nn.Parameter(SINKS["large"].clone(), requires_grad=False)

    def rank(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v))
        cpref.attention(ql, kl, vl, sharding, comm=comm, mode="p2p", sinks=frozen).backward(sharding.shard(dout, comm.rank))
        return ql.grad

    grads = SimCluster(2, timeout=30.0).run(rank)
    want = oracle_shards(q, k, v, dout, sharding, sinks=SINKS["large"])
    for r in range(2):
        assert_close(grads[r], want[r][1], torch.float64, msg=f"rank {r} dq")
    assert frozen.grad is None


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
def test_sinks_in_bf16_are_within_bf16s_tolerance_of_the_oracle(mode, layout):
    """bf16 inputs, float32 sinks of about 20, P = 2, MHA: every rank within bf16's tolerance of the FP64 oracle.
    The calls whose rows are whole recompute their float32 output for Delta (`full_rows`); normalized over the call's
    keys alone, without the sink, it made dQ and dK wrong by up to 0.66 in all_gather and the split modes, and at
    P = 1 alike, so a comparison with P = 1 could not see it."""
    P = 2
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([24, 56, 16]), cp_size=P, layout=layout)
    q, k, v, dout = (t.bfloat16() for t in attention_inputs(sharding.total, (4, 4, 16, 16), seed=2))
    sinks = torch.tensor([20.0, -20.0, 5.0, 0.0])
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, sinks=sinks, **cpref.MODES[mode].example_options(P))
    exact = [t.double() for t in (q, k, v, dout)]
    for r, (got, want) in enumerate(zip(results, oracle_shards(*exact, sharding, sinks=sinks.double()))):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.bfloat16, msg=f"{mode} {layout} rank {r} {name}")
    dsinks = oracle_padded(*exact, sharding, sinks=sinks.double())[4]
    assert_close(sum(res[4] for res in results), dsinks, torch.bfloat16, msg=f"{mode} {layout} dsinks")
