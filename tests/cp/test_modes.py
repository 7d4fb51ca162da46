"""The ring (p2p), Ulysses (a2a) and hierarchical (a2a+p2p) modes on the simulated cluster, rank by
rank against the FP64 oracle, in both layouts, causal and not, MHA/GQA/MQA and Dv < D."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from sim import SimCluster
from tests.cp.conftest import BF16_FLAT, CountingKernel, largest_bf16_error_over_logit_scales, oracle_shards, run_cp
from tests.helpers import HEADS, TOL, assert_close, attention_inputs, cu_from_lengths, random_qkv

# name -> (mode, extra arguments, CP sizes)
CONFIGS = {
    "p2p": ("p2p", {}, (2, 4, 8)),
    "a2a": ("a2a", {}, (2, 4, 8)),
    "a2a+p2p:a=2": ("a2a+p2p", {"a2a_size": 2}, (4, 8)),
    "a2a+p2p:a=4": ("a2a+p2p", {"a2a_size": 4}, (8,)),
}
NAMES = ("out", "dq", "dk", "dv")


def batch(lengths, heads, dtype=torch.float64, seed=0):
    cu = cu_from_lengths(lengths)
    return (cu, *attention_inputs(int(cu[-1]), HEADS[heads], dtype=dtype, seed=seed))


def check(config, P, layout, causal, lengths, heads, dtype=torch.float64, seed=0, reduction="exact"):
    mode, extra, _ = CONFIGS[config]
    cu, q, k, v, dout = batch(lengths, heads, dtype, seed)
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
    cluster = SimCluster(P, timeout=30.0, reduction=reduction)
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, cluster=cluster, **extra)
    refs = oracle_shards(*(t.double() for t in (q, k, v, dout)), sharding, causal=causal)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == dtype and a.shape == b.shape
            if dtype == torch.bfloat16 and HEADS[heads][1] < HEADS[heads][0]:
                tol = 3.5e-2  # bf16 with GQA: TransformerEngine's tolerance
                torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=lambda m, r=r, name=name: f"rank {r} {name}\n{m}")
            else:
                assert_close(a, b, dtype, msg=f"{config} P={P} {layout} causal={causal} {heads} rank {r} {name}")


@pytest.mark.sweep
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if 4 in CONFIGS[c][2]])
def test_fp64_every_rank_matches_oracle_at_cp4(config, layout, causal, heads):
    check(config, 4, layout, causal, [16, 8, 40], heads)


@pytest.mark.parametrize("P", [2, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=3, deadline=None)
@given(
    units=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    causal=st.booleans(),
    heads=st.sampled_from(sorted(HEADS)),
)
def test_fp64_random_document_mixes(config, P, layout, units, causal, heads):
    if P not in CONFIGS[config][2]:
        return
    mult = 2 * P if layout == "zigzag" else P  # units of 1 give documents of exactly 2P (zigzag) tokens
    check(config, P, layout, causal, [u * mult for u in units], heads, seed=len(units))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_28_documents_at_cp8(config):
    g = torch.Generator().manual_seed(28)
    lengths = (torch.randint(1, 4, (28,), generator=g) * 16).tolist()
    check(config, 8, "zigzag", True, lengths, "gqa")


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("P", [4, 8])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_low_precision_within_tolerance_with_native_reductions(config, P, heads, dtype):
    if P not in CONFIGS[config][2]:
        pytest.skip(f"{config} is defined for P in {CONFIGS[config][2]}")
    check(config, P, "zigzag", True, [64, 32, 96], heads, dtype, seed=5, reduction="native")


def max_error(config, P, dtype):
    mode, extra, _ = CONFIGS[config]
    cu, q, k, v, dout = batch([512, 256], "gqa", dtype, seed=3)
    sharding = cpref.Sharding(cu, cp_size=P)
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, cluster=SimCluster(P, reduction="native"), **extra)
    refs = oracle_shards(*(t.double() for t in (q, k, v, dout)), sharding)
    return max(((a.double() - b).abs() / (1 + b.abs())).max().item() for got, want in zip(results, refs) for a, b in zip(got, want))


def test_ring_bf16_backward_error_does_not_grow_with_p():
    """Field bug 4: blocks merged in float32, dK/dV accumulated in float32: P = 2, 4, 8 side by side."""
    errors = [max_error("p2p", P, torch.bfloat16) for P in (2, 4, 8)]
    assert max(errors) <= 1.2 * errors[0] < TOL[torch.bfloat16], errors


@pytest.mark.parametrize("P", [2, 4])
def test_hierarchical_reduces_bit_for_bit_to_ring_and_ulysses(P):
    cu, q, k, v, dout = batch([8 * P, 4 * P], "gqa", torch.bfloat16)
    sharding = cpref.Sharding(cu, cp_size=P)
    run = lambda mode, **kw: run_cp(q, k, v, dout, sharding, mode=mode, **kw)[0]  # noqa: E731
    for a, twin in ((1, run("p2p")), (P, run("a2a"))):
        for got, want in zip(run("a2a+p2p", a2a_size=a), twin):
            assert all(torch.equal(x, y) for x, y in zip(got, want)), f"a2a_size={a}"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P, a", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_the_layout_over_p_nests_inside_the_layout_over_P(P, a, layout):
    """After the exchange, a2a group g holds exactly rank g's chunks of the layout over P / a ranks."""
    cu, p = cu_from_lengths([2 * P * 3, 2 * P]), P // a
    over_P, over_p = cpref.Sharding(cu, cp_size=P, layout=layout), cpref.Sharding(cu, cp_size=p, layout=layout)
    for g in range(p):
        held = torch.cat([over_P.global_index(g * a + j) for j in range(a)])
        nested = over_p.global_index(g)
        assert torch.equal(held.sort().values, nested.sort().values)


def test_zigzag_ring_steps_are_balanced_in_the_kernel_calls_made():
    """Every step t >= 1 computes 2 c^2 scores per document on every rank; step 0 2 c^2 + c."""
    P, lengths = 4, [8 * 2, 8 * 5, 8]  # chunks of c = 2, 5, 1
    cu, q, k, v, dout = batch(lengths, "gqa")
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, cpref.Sharding(cu, cp_size=P), mode="p2p", kernels=kernels)
    cs = [n // (2 * P) for n in lengths]
    for kern in kernels:
        forward = [(seqs, causal) for kind, seqs, causal, _ in kern.calls if kind == "forward"]
        assert len(forward) == P  # one call per step, none skipped
        work = [seqs.work(causal) for seqs, causal in forward]
        assert work == [sum(2 * c * c + c for c in cs)] + [sum(2 * c * c for c in cs)] * (P - 1)


def test_contiguous_causal_ring_skips_later_blocks():
    """Rank r computes at steps 0..r only: blocks from later ranks are skipped, no kernel call."""
    P = 4
    cu, q, k, v, dout = batch([16, 32], "gqa")
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, cpref.Sharding(cu, cp_size=P, layout="contiguous"), mode="p2p", kernels=kernels)
    assert [(kern.forward_calls, kern.backward_calls) for kern in kernels] == [(r + 1, r + 1) for r in range(P)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_rank_holding_only_padding_gives_zeros_not_nan(config):
    """Field bug 6: with P = 8 and short documents, some ranks hold nothing but padding."""
    mode, extra, sizes = CONFIGS[config]
    P = max(sizes)
    sharding = cpref.Sharding(cu_from_lengths([3, 1]), cp_size=P, cu_seqlens_padded=cu_from_lengths([16, 16]))
    hq, hkv, d, dv = HEADS["gqa"]
    q, k, v = random_qkv(32, hq, hkv, d, dv)
    dout = random_qkv(32, hq, hq, dv, seed=1)[0]
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, **extra)
    refs = oracle_shards(q, k, v, dout, sharding)
    assert any(all((t == 0).all() for t in ref) for ref in refs)  # some rank has only padding
    for got, want in zip(results, refs):
        for a, b in zip(got, want):
            assert a.isfinite().all()
            assert_close(a, b, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_rank_holding_only_padding_gives_exact_zeros_in_low_precision(config, dtype):
    """Field bug 6 in bf16/fp16 with the sums of NCCL/HCCL (`reduction="native"`): documents of 3
    and 1 real tokens, each padded to 16, at P = 8 zigzag (chunks of one token): rank r holds
    tokens r and 15 - r of each, so ranks 3-7 hold only padding. Their output and every gradient
    are exactly 0 (no query and no key of theirs is seen), with no NaN anywhere on any rank."""
    mode, extra, sizes = CONFIGS[config]
    P = max(sizes)
    sharding = cpref.Sharding(cu_from_lengths([3, 1]), cp_size=P, cu_seqlens_padded=cu_from_lengths([16, 16]))
    hq, hkv, d, dv = HEADS["gqa"]
    q, k, v = random_qkv(32, hq, hkv, d, dv, dtype=dtype)
    dout = random_qkv(32, hq, hq, dv, dtype=dtype, seed=1)[0]
    cluster = SimCluster(P, timeout=30.0, reduction="native")
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, cluster=cluster, **extra)
    real = torch.zeros(32, dtype=torch.bool)
    real[[0, 1, 2, 16]] = True  # the real tokens of the padded stream
    padding_only = [r for r in range(P) if not sharding.shard(real, r).any()]
    assert padding_only == [3, 4, 5, 6, 7]
    for r, got in enumerate(results):
        for name, t in zip(NAMES, got):
            assert t.dtype == dtype and not t.isnan().any() and t.isfinite().all(), f"rank {r} {name}"
            if r in padding_only:
                assert (t == 0).all(), f"rank {r} {name}"


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_698_token_document_padded_to_704_at_cp4(config):
    """Field bug 2: tail padding in THD ring attention mis-detected; here exact and deterministic."""
    mode, extra, sizes = CONFIGS[config]
    if 4 not in sizes:
        pytest.skip("defined at P = 8 only")
    sharding = cpref.Sharding(cu_from_lengths([698, 120]), cp_size=4, cu_seqlens_padded=cu_from_lengths([704, 120]))
    hq, hkv, d, dv = HEADS["gqa"]
    q, k, v = random_qkv(824, hq, hkv, d, dv)
    dout = random_qkv(824, hq, hq, dv, seed=1)[0]
    first, _ = run_cp(q, k, v, dout, sharding, mode=mode, **extra)
    refs = oracle_shards(q, k, v, dout, sharding)
    second, _ = run_cp(q, k, v, dout, sharding, mode=mode, **extra)
    for a_rank, b_rank, ref in zip(first, second, refs):
        for a, b, w in zip(a_rank, b_rank, ref):
            assert torch.equal(a, b)
            assert_close(a, w, torch.float64)


GROUPINGS = {"consecutive": [[0, 1, 2, 3], [4, 5, 6, 7]], "strided": [[0, 2, 4, 6], [1, 3, 5, 7]]}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("config", ["p2p", "a2a", "a2a+p2p:a=2"])
def test_dp2_x_cp4_groups_run_concurrently_with_their_own_batches(config, grouping):
    """A world of 8 as two CP groups of 4; peers always come from group ranks, never world ranks."""
    mode, extra, _ = CONFIGS[config]
    groups = GROUPINGS[grouping]
    batches = [batch([16, 48], "gqa", seed=1), batch([32, 8, 24], "gqa", seed=2)]  # one per DP replica
    shardings = [cpref.Sharding(cu, cp_size=4) for cu, *_ in batches]

    def rank_fn(world):
        cp = world.split(groups)
        dp_index = next(i for i, g in enumerate(groups) if world.rank in g)
        (_, q, k, v, dout), sharding = batches[dp_index], shardings[dp_index]
        ql, kl, vl = (sharding.shard(t, cp.rank).requires_grad_() for t in (q, k, v))
        out = cpref.attention(ql, kl, vl, sharding, comm=cp, mode=mode, **extra)
        out.backward(sharding.shard(dout, cp.rank))
        return dp_index, cp.rank, (out.detach(), ql.grad, kl.grad, vl.grad)

    cluster = SimCluster(8, timeout=30.0)
    results = cluster.run(rank_fn)
    for dp_index, cp_rank, got in results:
        refs = oracle_shards(*batches[dp_index][1:], shardings[dp_index])[cp_rank]
        for name, a, b in zip(NAMES, got, refs):
            assert_close(a, b, torch.float64, msg=f"dp {dp_index} cp rank {cp_rank} {name}")
    # every collective of the attention stays inside one CP group (or its sub-groups)
    for ev in cluster.trace:
        if ev.op not in ("split",) and len(ev.group) < 8:
            assert any(set(ev.group) <= set(g) for g in groups), ev


def test_two_models_with_different_cp_settings_in_one_process_do_not_interfere():
    """Field bug 9: no process-wide state: interleaved calls with other modes, layouts, a2a sizes, batches."""
    P = 4
    setups = [("a2a+p2p", {"a2a_size": 2}, "zigzag", [16, 48]), ("a2a+p2p", {"a2a_size": 4}, "contiguous", [8, 24]),
              ("p2p", {}, "contiguous", [40]), ("a2a", {}, "zigzag", [32, 16, 16])]  # fmt: skip
    data = [batch(lengths, "gqa", seed=i) for i, (*_, lengths) in enumerate(setups)]
    shardings = [cpref.Sharding(cu, cp_size=P, layout=layout) for (_, _, layout, _), (cu, *_) in zip(setups, data)]

    def rank_fn(comm):
        outs = []
        for _round in range(2):
            for (mode, extra, _, _), (_, q, k, v, _), sharding in zip(setups, data, shardings):
                local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
                outs.append(cpref.attention(*local, sharding, comm=comm, mode=mode, **extra))
        return outs

    results = SimCluster(P, timeout=30.0).run(rank_fn)
    for r, outs in enumerate(results):
        for i, out in enumerate(outs):
            (_, q, k, v, dout), sharding = data[i % 4], shardings[i % 4]
            want = oracle_shards(q, k, v, dout, sharding)[r][0]
            assert_close(out, want, torch.float64, msg=f"call {i} rank {r}")


def test_a_ring_rank_whose_steps_see_no_key_returns_zero_rows_and_minus_infinity_lse():
    """`ring_forward` keeps the kernel contract for rows that see no key (`out` 0, `lse` -inf),
    also on a rank where no step has work at all (one 1-token document at P = 4: ranks 1-3 hold
    only padding), so that a caller merging its result by lse gives those rows no weight."""
    from cpref.kernels import TorchKernel
    from cpref.modes.ring import ring_forward
    from cpref.modes.ring_plan import build_ring_plan

    P = 4
    sharding = cpref.Sharding([0, 1], cp_size=P, cu_seqlens_padded=[0, 8])
    q, k, v = random_qkv(8, 4, 2, 8, 6)

    def rank_fn(comm):
        plan = build_ring_plan(sharding.bounds, P, comm.rank, "zigzag", True, q.device)
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        return plan, ring_forward(*local, plan, comm, TorchKernel(), scale=0.5)

    for r, (plan, (out, lse)) in enumerate(SimCluster(P).run(rank_fn)):
        if r == 0:  # token 0 sees itself: out = its value, lse = its own logit
            assert torch.equal(out[0], v[0].repeat_interleave(2, dim=0)) and lse[0].isfinite().all()
        else:
            assert all(step.calls == () for step in plan.steps), r
            assert out.shape == (2, 4, 6) and (out == 0).all() and (lse == float("-inf")).all(), r



@pytest.mark.parametrize("config, P", [("p2p", 1), ("p2p", 4), ("a2a+p2p:a=2", 4)])
def test_ring_bf16_gradients_do_not_grow_with_the_logit_scale(config, P):
    """No backward call of a ring sees a whole row, so the kernel's Delta comes from the output the
    Function kept. Kept in bf16, dQ's error at 4x the default scale reaches 0.05 at P = 4 (twice
    the tolerance); kept in float32, every result stays within a quarter of the tolerance, as at
    P = 1, where the ring is one call that recomputes its whole rows (`full_rows`). GQA heads
    that split over the a2a group without replication."""
    mode, extra, _ = CONFIGS[config]
    assert largest_bf16_error_over_logit_scales(mode, P, HEADS["gqa"], **extra) < BF16_FLAT


@pytest.mark.parametrize("config", ["a2a", "a2a+p2p:a=2"])
def test_replicated_heads_bf16_gradients_do_not_grow_with_the_logit_scale(config):
    """MQA over an all-to-all: the key/value head is replicated, and its gradient is the sum of
    the replicas' partials. Rounded to bf16 before the sum, dK's error at 4x the default scale
    grows to 0.02 (Ulysses, P = 4) and 0.03 (a = 2); sent unrounded and summed in float32, every
    result stays within a quarter of the tolerance, as at P = 1."""
    mode, extra, _ = CONFIGS[config]
    assert largest_bf16_error_over_logit_scales(mode, 4, HEADS["mqa"], **extra) < BF16_FLAT


class OrderKernel(CountingKernel):
    """A `CountingKernel` that also writes its calls into the rank's ordered event log."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def forward(self, q, k, v, seqs, **kwargs):
        self.log.append("kernel")
        return super().forward(q, k, v, seqs, **kwargs)

    def backward(self, dout, q, k, v, out, lse, seqs, **kwargs):
        self.log.append("kernel")
        return super().backward(dout, q, k, v, out, lse, seqs, **kwargs)


def ring_events(monkeypatch, P, mode, extra):
    """Run forward and backward on P ranks; per rank, the (forward, backward) event logs: "kernel"
    for a kernel call, ("post", i) for the i-th `send_recv_async` of the pass, ("wait", i) when its
    handle is waited on."""
    from sim.cluster.simcluster import SimComm

    logs = [[] for _ in range(P)]
    posted = [0] * P  # send_recv_async calls of the current pass, per rank
    real_post = SimComm.send_recv_async

    def post(self, x, shift=1):
        log, i = logs[self.global_rank], posted[self.global_rank]
        posted[self.global_rank] += 1
        log.append(("post", i))
        handle = real_post(self, x, shift)
        real_wait = handle.wait
        handle.wait = lambda: log.append(("wait", i)) or real_wait()
        return handle

    def between(comm):  # end of the forward: the backward numbers its shifts from 0 again
        logs[comm.global_rank].append("|")
        posted[comm.global_rank] = 0

    monkeypatch.setattr(SimComm, "send_recv_async", post)
    cu, q, k, v, dout = batch([16 * P, 8 * P], "gqa")  # zigzag: every ring step has work
    run_cp(q, k, v, dout, cpref.Sharding(cu, cp_size=P), mode=mode, kernels=[OrderKernel(log) for log in logs],
           between=between, **extra)  # fmt: skip
    cut = [log.index("|") for log in logs]
    return [(log[:c], log[c + 1 :]) for log, c in zip(logs, cut)]


POST, WAIT = (lambda i: ("post", i)), (lambda i: ("wait", i))
# ring.py, forward: at step t < n - 1 post the shift of the next K/V block, compute, then wait
RING4_FORWARD = [POST(0), "kernel", WAIT(0), POST(1), "kernel", WAIT(1), POST(2), "kernel", WAIT(2), "kernel"]
# backward, step t: post the next K/V (t < n - 1), compute, wait for the held block's dK/dV
# accumulator (t > 0), post it on, wait for the K/V; one more wait brings the accumulators home
RING4_BACKWARD = [
    POST(0), "kernel", POST(1), WAIT(0),  # t = 0: K/V #0, the own block's dK/dV goes out as #1
    POST(2), "kernel", WAIT(1), POST(3), WAIT(2),  # t = 1
    POST(4), "kernel", WAIT(3), POST(5), WAIT(4),  # t = 2
    "kernel", WAIT(5), POST(6),  # t = 3: no next K/V; the last accumulator shift brings them home
    WAIT(6),
]
RING2_FORWARD = [POST(0), "kernel", WAIT(0), "kernel"]
RING2_BACKWARD = [POST(0), "kernel", POST(1), WAIT(0), "kernel", WAIT(1), POST(2), WAIT(2)]


@pytest.mark.parametrize(
    "mode, P, extra, expected",
    [
        ("p2p", 4, {}, (RING4_FORWARD, RING4_BACKWARD)),
        ("a2a+p2p", 4, {"a2a_size": 2}, (RING2_FORWARD, RING2_BACKWARD)),  # a ring of P / 2 = 2 groups
        ("a2a+p2p", 8, {"a2a_size": 2}, (RING4_FORWARD, RING4_BACKWARD)),  # a ring of 4 groups
    ],
    ids=["p2p-P4", "a2a+p2p-P4-a2", "a2a+p2p-P8-a2"],
)
def test_the_ring_posts_the_next_shift_before_the_kernel_and_waits_after_it(monkeypatch, mode, P, extra, expected):
    """The overlap of `cpref.modes.ring`: on every rank, at every step, forward and backward, the
    shift bringing the next block (and, backward, the dK/dV accumulator going on) is posted before
    the kernel runs on the current block and waited on only after it, in exactly this order."""
    for r, (forward, backward) in enumerate(ring_events(monkeypatch, P, mode, extra)):
        assert forward == expected[0], f"rank {r} forward"
        assert backward == expected[1], f"rank {r} backward"


def test_a_non_causal_ring_step_reads_the_block_as_it_arrived_in_one_sequence_per_document():
    """Contiguous, P = 2, documents of 4 and 2 tokens: every buffer holds 2 rows of document 0, then 1
    of document 1. Without the mask each query sees all of the sender's rows of its document, so the
    key ranges [0, 2) and [2, 3) tile the block: no index, no empty sequence, 2 * 2 + 1 * 1 = 5 scores."""
    from cpref.modes.ring_plan import build_ring_plan

    b = cpref.Boundaries.parse([0, 4, 6])
    for rank in range(2):
        plan = build_ring_plan(b, 2, rank, "contiguous", False, torch.device("cpu"))
        assert len(plan.steps) == 2
        got = [(s.source, s.calls[0].seqs.cu_q, s.calls[0].seqs.cu_kv, s.calls[0].causal, s.calls[0].kv_index, s.work)
               for s in plan.steps]  # fmt: skip
        assert got == [(src, (0, 2, 3), (0, 2, 3), False, None, 5) for src in (rank, 1 - rank)]


def test_build_ring_plan_refuses_a_document_the_layout_cannot_split():
    from cpref.modes.ring_plan import build_ring_plan

    with pytest.raises(ValueError, match=r"document 0 has length 6, not a multiple of 4"):
        build_ring_plan(cpref.Boundaries.parse([0, 6]), 2, 0, "zigzag", True, torch.device("cpu"))
