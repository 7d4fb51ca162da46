"""KV all-gather CP (MindSpeed RFC) on the simulated cluster, rank by rank against the FP64 oracle."""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.base.errors import CPInputError, PeerInputError
from sim.cluster.simcluster import SimCluster
from tests.cp.conftest import BF16_FLAT, CountingKernel, largest_bf16_error_over_logit_scales, oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison, random_qkv

HEADS = {  # name: (Hq, Hkv, D, Dv)
    "mha": (4, 4, 16, 16),
    "gqa": (4, 2, 16, 16),
    "mqa": (4, 1, 8, 8),
    "mla": (4, 2, 24, 16),  # GQA with Dk != Dv (field bug 3)
}
NAMES = ("out", "dq", "dk", "dv")


def batch(P, layout, heads, dtype=torch.float64, seed=0):
    """`(sharding, q, k, v, dout)`: three documents of unequal length, sharded over P ranks in `layout`."""
    mult = 2 * P if layout == "zigzag" else P
    sharding = cpref.Sharding(cu_from_lengths([mult * 2, mult * 5, mult]), cp_size=P, layout=layout)
    return (sharding, *attention_inputs(sharding.total, HEADS[heads], dtype=dtype, seed=seed))


def check_against_oracle(results, refs, dtype):
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == dtype
            assert_close(a, b, dtype, msg=f"rank {r} {name}")


@pytest.mark.sweep
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_fp64_every_rank_matches_oracle(P, layout, causal, heads):
    sharding, q, k, v, dout = batch(P, layout, heads)
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal)
    check_against_oracle(results, oracle_shards(q, k, v, dout, sharding, causal=causal), torch.float64)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_low_precision_within_stated_tolerance(P, heads, dtype):
    """Reductions in the input dtype, as NCCL/HCCL do (the simulator must not flatter)."""
    sharding, q, k, v, dout = batch(P, "zigzag", heads, dtype=dtype, seed=3)
    cluster = SimCluster(P, timeout=30.0, reduction="native")
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", cluster=cluster)
    refs = oracle_shards(q.double(), k.double(), v.double(), dout.double(), sharding)
    check_against_oracle(results, refs, dtype)


def test_cp1_and_custom_scale():
    sharding, q, k, v, dout = batch(1, "zigzag", "gqa")
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", softmax_scale=0.3)
    check_against_oracle(results, oracle_shards(q, k, v, dout, sharding, scale=0.3), torch.float64)


def split_trace(trace):
    """Events before and after the barrier that `between` puts at the end of the forward."""
    ops = [ev.op for ev in trace]
    cut = ops.index("barrier")
    return trace[:cut], trace[cut + 1 :]


@pytest.mark.parametrize("save", [False, True], ids=["regather", "saved"])
@pytest.mark.parametrize("P", [2, 4])
def test_kernel_calls_collectives_and_bytes_are_as_documented(P, save):
    """Counted, not timed. Forward: the rank check's fingerprint (first call only), all-gather K, V,
    one kernel call. Backward: (all-gather K, V again: default) + one kernel call + reduce-scatter dK, dV."""
    sharding, q, k, v, dout = batch(P, "zigzag", "mla")
    kernels = [CountingKernel() for _ in range(P)]
    seen = {}

    def end_of_forward(comm):
        comm.barrier()
        seen[comm.rank] = (kernels[comm.rank].forward_calls, kernels[comm.rank].backward_calls)

    _, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", kernels=kernels, between=end_of_forward,
                        save_gathered_kv=save)  # fmt: skip
    assert all(seen[r] == (1, 0) for r in range(P))
    assert all((kern.forward_calls, kern.backward_calls) == (1, 1) for kern in kernels)
    fwd, bwd = split_trace(cluster.trace)
    assert [ev.op for ev in fwd] == ["all_gather"] * 3
    assert fwd[0].dtype == torch.int64 and fwd[0].shape[0] == 1  # the one-row fingerprint
    assert [ev.op for ev in bwd] == ["all_gather"] * (0 if save else 2) + ["reduce_scatter"] * 2
    hq, hkv, d, dv = HEADS["mla"]
    t_l = sharding.local_tokens
    per_tensor = {"k": (P - 1) * t_l * hkv * d * 8, "v": (P - 1) * t_l * hkv * dv * 8}  # fp64
    moved = [ev.bytes_sent for ev in fwd[1:] + bwd]
    want = [per_tensor["k"], per_tensor["v"]] * (1 if save else 2) + [per_tensor["k"], per_tensor["v"]]
    assert moved == [tuple([w] * P) for w in want]
    # (P-1) (T/P) Hkv (D + Dv) elements forward, the documented formula
    assert sum(ev.bytes_sent[0] for ev in fwd[1:]) == (P - 1) * t_l * hkv * (d + dv) * 8


def test_every_layer_makes_one_host_rank_check_then_the_mode():
    """The fingerprint exchange runs on every call, over the host (`agree`), before the mode's gathers."""
    P = 2
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        for _ in range(3):
            cpref.attention(*local, sharding, comm=comm, mode="all_gather")

    cluster = SimCluster(P, timeout=30.0)
    cluster.run(rank_fn)
    assert [ev.op for ev in cluster.trace] == ["all_gather"] * 9
    assert [ev.param == "host" for ev in cluster.trace] == [True, False, False] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_gathers_the_input_dtype_and_reduce_scatters_float32_partials(dtype):
    """K/V travel in the input dtype; the dK/dV partials are summed over ranks in float32 (4 bytes
    an element) and only the result is rounded to the input dtype (see Precision)."""
    P = 4
    sharding, q, k, v, dout = batch(P, "zigzag", "gqa", dtype=dtype)
    results, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", check_ranks=False)
    rs = [ev for ev in cluster.trace if ev.op == "reduce_scatter"]
    t_l, hkv, d = sharding.local_tokens, HEADS["gqa"][1], HEADS["gqa"][2]
    assert len(rs) == 2 and all(ev.dtype == torch.float32 for ev in rs)
    assert all(ev.bytes_sent == tuple([(P - 1) * t_l * hkv * d * 4] * P) for ev in rs)  # 4 bytes an element
    assert all(ev.dtype == dtype for ev in cluster.trace if ev.op == "all_gather" and ev.dtype.is_floating_point)
    assert all(g.dtype == dtype for rank in results for g in rank)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_bf16_dk_dv_errors_do_not_grow_with_the_logit_scale_or_P(P):
    """A key's partial gradients grow with the logit scale and cancel across ranks: summed over
    ranks in bf16, their rounding errors would survive in the small sum (0.03 at 4x the default
    scale and P = 4, past the 2.5e-2 tolerance). Summed in float32 and rounded once, every
    result stays within a quarter of the tolerance, as at P = 1 (the kernel's own test). The
    backward's full_rows is needed at every P, P = 1 included: Delta from the rounded output
    would let dQ grow with the scale too."""
    assert largest_bf16_error_over_logit_scales("all_gather", P, HEADS["gqa"]) < BF16_FLAT


def saved_bytes(P, save, heads="mla", dtype=torch.float64):
    """Bytes each rank's attention saves for backward, measured with saved-tensor hooks."""
    sharding, q, k, v, _ = batch(P, "zigzag", heads, dtype=dtype)
    totals = {}

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v)]
        packed = []

        def pack(x):
            packed.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            cpref.attention(*local, sharding, comm=comm, mode="all_gather", save_gathered_kv=save, check_ranks=False)
        totals[comm.rank] = sum(packed)

    SimCluster(P, timeout=30.0).run(rank_fn)
    return sharding, totals


@pytest.mark.parametrize("P", [2, 4, 8])
def test_saved_bytes_for_backward_equal_the_formula_of_each_schedule(P):
    hq, hkv, d, dv = HEADS["mla"]
    b, lse_b = 8, 8  # fp64 values, fp64 lse
    sharding, lean = saved_bytes(P, save=False)
    t_l = sharding.local_tokens
    assert lean == {r: t_l * (b * (hq * d + hkv * d + hkv * dv + hq * dv) + lse_b * hq) for r in range(P)}
    _, full = saved_bytes(P, save=True)
    for r in range(P):
        kv_len = cpref.get_thd_load_balanced_cp_metadata(sharding.cu_seqlens, P, r)["actual_seq_kvlen"][-1]
        assert full[r] == t_l * (b * (hq * d + hq * dv) + lse_b * hq) + kv_len * b * hkv * (d + dv)
        assert kv_len > t_l * P  # the selected K/V: more rows than the whole stream


def test_default_saved_memory_falls_as_one_over_p():
    per_token = None
    for P in (2, 4, 8):
        sharding, lean = saved_bytes(P, save=False)
        total = sharding.total  # batch() grows the stream with P: normalise per token of the stream
        ratio = lean[0] * P / total
        per_token = ratio if per_token is None else per_token
        assert ratio == per_token


@pytest.mark.parametrize(
    "mutate, match",
    [  # (q, k, v, sharding) -> the same with one bad; bad boundaries fail where they enter, in cpref.Sharding(...)
        (lambda q, k, v, s: (q[:, :3], k, v, s), r"heads: q has 3, k 2"),
        (lambda q, k, v, s: (q, k, torch.cat([v, v], -1), s), r"Dq == Dk >= Dv"),
        (lambda q, k, v, s: (q[:-1], k, v, s), r"q/k/v hold 15/16/16 tokens but this rank's shard of 32 tokens"),
        (lambda q, k, v, s: (q, k, v.float(), s), r"share dtype"),
        (lambda q, k, v, s: (q, k, v, [0, 6, 32]),
         r"document 0 has length 6, not a multiple of 4.*Sharding\.eod_padded.*cu_seqlens_padded"),
        (lambda q, k, v, s: (q, k, v, [0, 32, 32]), r"strictly increasing"),
        (lambda q, k, v, s: (q[0], k, v, s), r"q must be a THD tensor"),
        (lambda q, k, v, s: (q.long(), k, v, s), r"q has dtype torch.int64"),
    ],
)
def test_bad_input_fails_on_every_rank_before_any_communication(mutate, match):
    P = 2
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        ql, kl, vl, bad = mutate(*local, sharding)
        bad = bad if isinstance(bad, cpref.Sharding) else cpref.Sharding(bad, cp_size=P)  # bad boundaries: raises
        return cpref.attention(ql, kl, vl, bad, comm=comm, mode="all_gather")

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match=match):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize(
    "layout, kwargs, match",
    [  # the layout enters with the sharding: a bad one fails in cpref.Sharding(...), on every rank
        (None, dict(mode="ring"), r"unknown mode 'ring'"),
        ("striped", dict(mode="all_gather"), r"unknown layout 'striped'"),
        (None, dict(mode="all_gather", a2a_size=2), r"a2a_size=2 is only used by mode .*, not mode='all_gather'"),
        (None, dict(mode="all_gather", softmax_scale=-1.0), r"softmax_scale must be None or a positive"),
    ],
)
def test_bad_arguments_fail_before_communication(layout, kwargs, match):
    P = 2
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        described = sharding if layout is None else cpref.Sharding(sharding.cu_seqlens, cp_size=P, layout=layout)
        return cpref.attention(*local, described, comm=comm, **kwargs)

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match=match):
        cluster.run(rank_fn)
    assert only_the_comparison(cluster.trace), cluster.trace


def test_one_rank_with_a_bad_shard_fails_every_rank_in_the_comparison():
    """Field bug 12: rank 2 alone fails validation while the others enter the ranks' comparison.
    It meets them there, marked invalid, so each raises a CPInputError naming rank 2 at once; a
    rank left waiting would show here as a PeerFailure (the simulator's stand-in for a hang)."""
    from sim import ClusterFailure

    P = 4
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        if comm.rank == 2:
            local[0] = local[0][:-2]
        return cpref.attention(*local, sharding, comm=comm, mode="all_gather")

    cluster = SimCluster(P, timeout=20.0)
    start = time.monotonic()
    with pytest.raises(ClusterFailure) as info:
        cluster.run(rank_fn)
    assert time.monotonic() - start < 10.0
    errors, n = info.value.errors, sharding.local_tokens  # n: a shard's tokens
    assert type(errors[2]) is CPInputError and f"q/k/v hold {n - 2}/{n}/{n} tokens" in str(errors[2])
    assert info.value.root_rank == 2  # the rank whose own input failed, not a follow-on
    for r in (0, 1, 3):
        assert type(errors[r]) is PeerInputError, errors[r]
        assert "the inputs of rank 2 of the CP group failed validation" in str(errors[r])
        assert f"rank {r} raises too" in str(errors[r])
    assert only_the_comparison(cluster.trace) and cluster.trace, cluster.trace


def test_a_rank_failing_on_a_later_layer_meets_the_others_in_its_comparison():
    """Every call is compared, a later layer's too: ranks failing there send their invalid rows
    to that comparison, and nothing of the mode."""
    P = 2
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")  # one sharding for both calls: one cache entry

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        cpref.attention(*local, sharding, comm=comm, mode="all_gather")  # layer 1: the ranks compare
        comm.barrier()
        n = len(cluster.trace)
        with pytest.raises(CPInputError, match="tokens"):
            cpref.attention(local[0][:-1], *local[1:], sharding, comm=comm, mode="all_gather")  # layer 2, every rank
        return n

    cluster = SimCluster(P, timeout=20.0)
    n = cluster.run(rank_fn)[0]
    assert only_the_comparison(cluster.trace[n:]) and cluster.trace[n:], cluster.trace[n:]


def test_metadata_is_cached_across_layers():
    P = 2
    sharding, q, k, v, _ = batch(P, "zigzag", "gqa")
    shards = [[sharding.shard(t, r) for t in (q, k, v)] for r in range(P)]  # shard first: its index plans count too
    before = cpref.cache_info()

    def rank_fn(comm):
        for _ in range(3):  # three "layers", same sharding
            cpref.attention(*shards[comm.rank], sharding, comm=comm, mode="all_gather")

    SimCluster(P, timeout=30.0).run(rank_fn)
    info = cpref.cache_info()
    assert (info.misses - before.misses, info.hits - before.hits, info.size) == (P, 2 * P, 1)  # one plan per rank, one entry


def test_rfc_alias_is_the_same_function():
    assert cpref.AttnFuncWithCPAndKVAllGatherForTHDLoadBalanced is cpref.AllGatherKVFunc


def test_28_documents_at_cp8():
    """A field-sized mix: 28 packed documents of uneven length over 8 ranks, FP64."""
    P = 8
    g = torch.Generator().manual_seed(28)
    sharding = cpref.Sharding(cu_from_lengths((torch.randint(1, 5, (28,), generator=g) * 2 * P).tolist()), cp_size=P)
    q, k, v = random_qkv(sharding.total, 4, 2, 8, seed=5)
    dout = random_qkv(sharding.total, 4, 4, 8, seed=6)[0]
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather")
    check_against_oracle(results, oracle_shards(q, k, v, dout, sharding), torch.float64)


@settings(max_examples=12, deadline=None)
@given(
    P=st.sampled_from([1, 2, 3, 4]),
    units=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
    heads=st.sampled_from(sorted(HEADS)),
)
def test_property_random_documents_match_oracle(P, units, layout, causal, heads):
    mult = 2 * P if layout == "zigzag" else P
    sharding = cpref.Sharding(cu_from_lengths([u * mult for u in units]), cp_size=P, layout=layout)
    hq, hkv, d, dv = HEADS[heads]
    q, k, v = random_qkv(sharding.total, hq, hkv, d, dv, seed=len(units))
    dout = random_qkv(sharding.total, hq, hq, dv, seed=7)[0]
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", causal=causal)
    check_against_oracle(results, oracle_shards(q, k, v, dout, sharding, causal=causal), torch.float64)


def test_bitwise_deterministic_across_runs():
    sharding, q, k, v, dout = batch(4, "zigzag", "gqa", dtype=torch.bfloat16, seed=9)
    first, _ = run_cp(q, k, v, dout, sharding, mode="all_gather")
    second, _ = run_cp(q, k, v, dout, sharding, mode="all_gather")
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("P", [2, 4])
def test_bf16_gradients_stay_within_tolerance_at_a_large_logit_scale(P):
    """Every query's keys are in its one kernel call (full_rows): bf16 error does not grow with the scale."""
    sharding, q, k, v, dout = batch(P, "zigzag", "gqa", dtype=torch.bfloat16, seed=11)
    scale = 3.0 * HEADS["gqa"][2] ** -0.5
    cluster = SimCluster(P, timeout=30.0, reduction="native")
    results, _ = run_cp(q, k, v, dout, sharding, mode="all_gather", cluster=cluster, softmax_scale=scale)
    refs = oracle_shards(q.double(), k.double(), v.double(), dout.double(), sharding, scale=scale)
    check_against_oracle(results, refs, torch.bfloat16)


def test_a_key_row_is_in_at_most_two_key_sequences_of_a_rank():
    """What makes the float32 index_add_ a sum of at most two partials per rank (see Precision)."""
    for P, layout, causal in [(4, "zigzag", True), (4, "contiguous", True), (4, "zigzag", False)]:
        cu = batch(P, layout, "gqa")[0].cu_seqlens
        for r in range(P):
            kv_index = cpref.get_thd_load_balanced_cp_metadata(cu, P, r, layout=layout, causal=causal)["kv_index"]
            assert torch.bincount(kv_index).max() <= (2 if layout == "zigzag" and causal else 1)


def test_dk_partials_are_summed_unrounded_and_rounded_once():
    """A key row in two of a rank's key sequences: its two partials are summed in float32 and the sum is
    rounded to bf16 once. a = 1 + 3 2^-10 and b = 3 2^-10: round(a + b) = 1 + 2^-7, but rounding
    each partial first gives round(round(a) + b) = 1."""
    from types import SimpleNamespace

    from cpref.modes.all_gather import all_gather_backward
    from cpref.modes.all_gather_plan import build_all_gather_plan

    plan = build_all_gather_plan(cpref.Boundaries.parse([0, 8]), 2, 0, "zigzag", True, torch.device("cpu"))
    first, second = [i for i, row in enumerate(plan.kv_index.tolist()) if row == 0]  # key row 0, twice

    class PartialsKernel:
        def backward(self, dout, q, k, v, out, lse, seqs, *, grad_dtype=None, **kw):
            dk = torch.zeros(k.shape, dtype=torch.float32)
            dk[first], dk[second] = 1 + 3 * 2**-10, 3 * 2**-10
            dk = dk.to(grad_dtype or k.dtype)  # a kernel returns its partials in grad_dtype, else rounded
            return torch.zeros(q.shape, dtype=grad_dtype or q.dtype), dk, torch.zeros_like(dk)

    local = SimpleNamespace(size=2, reduce_scatter=lambda x: x[: len(x) // 2].clone())  # this rank's rows only
    bf = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731
    q, k_sel = bf(4, 1, 2), bf(len(plan.kv_index), 1, 2)
    _, dk, _ = all_gather_backward(bf(4, 1, 2), q, k_sel, k_sel, bf(4, 1, 2), torch.zeros(4, 1), plan, local,
                                   PartialsKernel(), causal=True, scale=1.0)  # fmt: skip
    assert dk.dtype == torch.bfloat16 and dk[0, 0, 0].item() == 1 + 2**-7


def zigzag_kv_index(sharding, rank):
    """The rows of the rank-major gathered K/V that rank `rank`'s queries see, derived from the
    module docstring: for every document (chunk size c), each local query chunk j (r, then
    2P - 1 - r) sees the causal prefix of (j + 1) c keys of its document, in natural order."""
    P, cu = sharding.cp_size, sharding.cu_seqlens
    gathered = torch.cat([sharding.global_index(s) for s in range(P)])  # (T,)
    row_of = torch.argsort(gathered)  # global token -> its row in the rank-major buffer
    rows = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // (2 * P)
        for j in (rank, 2 * P - 1 - rank):
            rows.append(row_of[start : start + (j + 1) * c])
    return torch.cat(rows)


@pytest.mark.parametrize("save", [False, True], ids=["regather", "saved"])
@pytest.mark.parametrize("P", [2, 4])
def test_the_index_ops_at_p_above_one_are_one_select_and_one_add_per_tensor_of_the_planned_rows(monkeypatch, P, save):
    """Rank-major direct indexing (the module docstring, idea 2), three packed documents, zigzag:
    the forward selects K and V once each (`gather_selected`: 2 `index_select`); the backward
    gathers them again and selects them once each (2 more, none with `save_gathered_kv`) and
    scatters dK and dV back once each (`all_gather_backward`: 2 `index_add_`). Every index is the
    rank's causal prefixes, (2P + 1) c rows per document, into the rank-major buffer of all T rows:
    no full reorder of K/V (a T-row permutation) and no restore of the output (no `index_copy_`,
    no select on the T/P output rows)."""
    import threading

    sharding, q, k, v, dout = batch(P, "zigzag", "gqa")
    T = sharding.total
    # shard before patching: sharding.shard itself is an index_select
    shards = [[sharding.shard(t, r) for t in (q, k, v, dout)] for r in range(P)]
    where = threading.local()
    calls = []  # (rank, pass, op, rows of the tensor indexed, index)
    for name in ("index_select", "index_add_", "index_copy_"):
        real = getattr(torch.Tensor, name)

        def logged(self, dim, index, *args, _real=real, _name=name, **kwargs):
            calls.append((getattr(where, "rank", None), getattr(where, "phase", None), _name, self.shape[dim], index.clone()))
            return _real(self, dim, index, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, logged)

    def rank_fn(comm):
        where.rank, where.phase = comm.rank, "forward"
        ql, kl, vl, dl = (t.clone() for t in shards[comm.rank])
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        out = cpref.attention(ql, kl, vl, sharding, comm=comm, mode="all_gather", save_gathered_kv=save)
        where.phase = "backward"
        out.backward(dl)
        return out.detach()

    SimCluster(P, timeout=30.0).run(rank_fn)
    # all_gather.py: forward = gather_selected (k_sel, v_sel: 2 index_select); backward = gather_selected
    # again unless save_gathered_kv (2 or 0), then all_gather_backward's dk_all, dv_all (2 index_add_)
    expected_ops = {"forward": ["index_select"] * 2, "backward": ["index_select"] * (0 if save else 2) + ["index_add_"] * 2}
    cu = sharding.cu_seqlens
    c = [(e - s) // (2 * P) for s, e in zip(cu[:-1], cu[1:])]  # chunk sizes 2, 5, 1
    for r in range(P):
        want = zigzag_kv_index(sharding, r)
        assert len(want) == (2 * P + 1) * sum(c)
        for phase in ("forward", "backward"):
            mine = [call for call in calls if call[:2] == (r, phase)]
            assert [op for _, _, op, _, _ in mine] == expected_ops[phase], f"rank {r} {phase}"
            for _, _, op, rows, index in mine:
                assert rows == T and torch.equal(index, want), f"rank {r} {phase} {op}"
    assert {rank for rank, *_ in calls} == set(range(P))  # nothing outside the ranks' calls
