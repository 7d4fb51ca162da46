"""Guarantees every CP mode keeps (parametrized over `cpref.MODES`, so a new mode inherits them).

* padding (a `Sharding` with `cu_seqlens_padded`) is invisible: real rows equal the oracle on the unpadded
  documents, padding rows are 0 in the output and every gradient, causal or not;
* no host-device synchronisation after the first layer of a step;
* the ranks' arguments are compared once per batch, and a disagreement is the same clear
  error on every rank, before the mode communicates;
* one backward only, refused clearly before any backward communication.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpref
from cpref.modes.consistency import FIELDS
from sim import SimCluster
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, only_the_comparison, random_qkv

MODES = sorted(cpref.MODES)
# head counts every mode accepts at P = 1, 2, 3, 4 (Ulysses splits heads: 12 | Hq, and Hkv | 12 or Hkv = 1)
HEADS = {"mha": (12, 12, 8, 8), "gqa": (24, 12, 8, 8), "mqa": (12, 1, 8, 8), "mla": (12, 1, 12, 8)}


def extra(mode: str, P: int) -> dict:
    """The mode's own arguments at CP size `P`, as the mode declares them (the hierarchical mode's a2a group size)."""
    return cpref.MODES[mode].example_options(P)


def padded_batch(lengths, P, layout, heads, seed=0, dtype=torch.float64):
    """`(sharding, q, k, v, dout)`: real lengths (any), padded at each document's end to the layout's multiple."""
    mult = 2 * P if layout == "zigzag" else P
    cu_pad = cu_from_lengths([-(-n // mult) * mult for n in lengths])
    sharding = cpref.Sharding(cu_from_lengths(lengths), cp_size=P, layout=layout, cu_seqlens_padded=cu_pad)
    return (sharding, *attention_inputs(sharding.total, HEADS[heads], dtype=dtype, seed=seed))


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=10, deadline=None)
@given(
    P=st.sampled_from([1, 2, 3, 4]),
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
    heads=st.sampled_from(sorted(HEADS)),
)
@example(P=4, lengths=[1], layout="zigzag", causal=True, heads="gqa")  # ranks 1-3 hold only padding: no step has work
def test_padding_is_invisible_to_real_tokens(mode, P, lengths, layout, causal, heads):
    sharding, q, k, v, dout = padded_batch(lengths, P, layout, heads, seed=len(lengths))
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, **extra(mode, P))
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"rank {r} {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_padding_rows_are_exactly_zero_and_real_rows_ignore_padding_values(mode, causal):
    """Huge values in the padding rows must not leak: real results are bitwise those of zero padding."""
    P = 2
    sharding, q, k, v, dout = padded_batch([5, 11], P, "zigzag", "gqa")
    pad = torch.ones(sharding.total, dtype=torch.bool)
    pad[torch.cat([torch.arange(a, a + n) for a, n in zip(sharding.cu_seqlens_padded[:-1], [5, 11])])] = False
    runs = []
    for fill in (0.0, 1e4):
        qf, kf, vf, df = (t.masked_fill(pad[:, None, None], fill) for t in (q, k, v, dout))
        runs.append(run_cp(qf, kf, vf, df, sharding, mode=mode, causal=causal, **extra(mode, P))[0])
    for r in range(P):
        local_pad = sharding.shard(pad, r)
        for a, b in zip(runs[0][r], runs[1][r]):
            assert torch.equal(a, b)
            assert (a[local_pad] == 0).all()


class HostSyncCounter:
    """Counts calls that copy a tensor to the host (each one a stream stall on an accelerator)."""

    METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return original(tensor, *args, **kwargs)

        return counted


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_no_host_sync_after_the_first_layer(mode, padded, monkeypatch):
    """Layer 1 builds the plans (and checks the ranks); layers 2..L forward and every backward sync nothing."""
    P, L = 2, 3
    sharding, q, k, v, dout = padded_batch([5, 11] if padded else [8, 16], P, "zigzag", "gqa")  # [8, 16]: no padding
    assert sharding.bounds.is_padded == padded
    counter = {}

    def rank_fn(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v))
        d = sharding.shard(dout, comm.rank)
        attend = lambda x: cpref.attention(x, kl, vl, sharding, comm=comm, mode=mode, **extra(mode, P))  # noqa: E731
        outs = [attend(ql)]
        comm.barrier()
        if comm.rank == 0:
            counter["sync"] = HostSyncCounter(monkeypatch)
        comm.barrier()
        for _ in range(L - 1):
            outs.append(attend(outs[-1] * 0.5 + ql))
        sum((o * d).sum() for o in outs).backward()
        return ql.grad

    grads = SimCluster(P, timeout=30.0).run(rank_fn)
    calls = list(counter["sync"].calls)
    monkeypatch.undo()  # the assertions below may read tensors
    assert calls == []
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def disagreeing(mode, what):
    """A rank program where rank 1 passes something different from rank 0 (same shapes): the
    boundaries and the layout in its `Sharding`, the rest in its `cpref.attention` call."""
    P = 2
    q, k, v = random_qkv(32, 4, 2, 8)
    base = dict(cu_seqlens=torch.tensor([0, 8, 32]), cu_seqlens_padded=None, layout="zigzag")
    ranks = {
        "nothing": ({}, {}),
        "causal": ({}, dict(causal=False)),
        "softmax_scale": ({}, dict(softmax_scale=0.3)),
        "layout": ({}, dict(layout="contiguous")),
        "cu_seqlens": ({}, dict(cu_seqlens=torch.tensor([0, 16, 32]))),  # same total, other documents
        "cu_seqlens_padded": tuple(dict(cu_seqlens=torch.tensor([0, 5, 21]), cu_seqlens_padded=torch.tensor(p))
                                   for p in ([0, 8, 32], [0, 16, 32])),  # same real documents, other padding
    }[what]  # fmt: skip
    shardings, calls = [], []  # per rank: its Sharding and its other arguments
    for r in range(P):
        kw = {**base, **ranks[r]}
        cu, cu_pad, layout = kw.pop("cu_seqlens"), kw.pop("cu_seqlens_padded"), kw.pop("layout")
        shardings.append(cpref.Sharding(cu, cp_size=P, layout=layout, cu_seqlens_padded=cu_pad))
        calls.append(kw)

    def rank_fn(comm, check_ranks=True):
        sharding = shardings[comm.rank]
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        return cpref.attention(*local, sharding, comm=comm, mode=mode, check_ranks=check_ranks, **calls[comm.rank],
                               **extra(mode, P))  # fmt: skip

    return P, rank_fn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["causal", "softmax_scale", "layout", "cu_seqlens", "cu_seqlens_padded"])
def test_ranks_that_disagree_get_the_same_clear_error_before_the_mode_communicates(mode, what):
    P, rank_fn = disagreeing(mode, what)
    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match=rf"pass different arguments to cpref.attention[\s\S]*  {what}: rank 0"):
        cluster.run(rank_fn)  # the same message on every rank: run() re-raises it unchanged
    # the comparison (and, where boundaries differ, the exchange of their values that names them)
    assert only_the_comparison(cluster.trace[:1]) and all(ev.param == "host" for ev in cluster.trace), cluster.trace


def test_the_rank_check_names_the_values_it_can_show():
    P, rank_fn = disagreeing("all_gather", "causal")
    with pytest.raises(ValueError, match=r"causal: rank 0: True; rank 1: False"):
        SimCluster(P, timeout=30.0).run(rank_fn)
    P, rank_fn = disagreeing("all_gather", "softmax_scale")
    with pytest.raises(ValueError, match=r"softmax_scale: rank 0: 0.353553390593\d*; rank 1: 0.3\n"):
        SimCluster(P, timeout=30.0).run(rank_fn)


@pytest.mark.parametrize("mode", MODES)
def test_the_rank_check_can_be_switched_off(mode):
    """Every rank passes check_ranks=False on the first call (compared once: that is how they agree
    on it); the later calls are not compared, so disagreeing ones give wrong results, unchecked."""
    P, rank_fn = disagreeing(mode, "softmax_scale")
    _, same_fn = disagreeing(mode, "nothing")
    cluster = SimCluster(P, timeout=30.0)
    cluster.run(lambda comm: (same_fn(comm, check_ranks=False), rank_fn(comm, check_ranks=False), rank_fn(comm, check_ranks=False)))
    assert [ev.param for ev in cluster.trace].count("host") == 1


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_is_refused_clearly_on_every_rank(mode):
    P = 2
    sharding, (q, k, v) = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=P), random_qkv(32, 4, 2, 8)

    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v)]
        out = cpref.attention(*local, sharding, comm=comm, mode=mode, **extra(mode, P))
        before = len(cluster.trace)
        try:
            torch.autograd.grad(out.sum(), local, create_graph=True)
        finally:
            assert len(cluster.trace) == before  # refused before any backward collective

    cluster = SimCluster(P, timeout=30.0)
    with pytest.raises(ValueError, match="differentiable once.*create_graph"):
        cluster.run(rank_fn)


class LimitedComm:
    """A communicator like HCCL with 3, 5, 6 or 7 ranks: no tensor all-gather or reduce-scatter."""

    unsupported_ops = frozenset({"all_gather", "reduce_scatter"})

    def __init__(self, comm):
        self._comm, self.rank, self.size = comm, comm.rank, comm.size

    def all_gather(self, x):
        raise AssertionError("all_gather called on a backend without it")

    def reduce_scatter(self, x):
        raise AssertionError("reduce_scatter called on a backend without it")

    def all_gather_async(self, x):
        raise AssertionError("all_gather_async called on a backend without all_gather")

    def reduce_scatter_async(self, x):
        raise AssertionError("reduce_scatter_async called on a backend without reduce_scatter")

    def all_to_all(self, x):
        return self._comm.all_to_all(x)

    def all_to_all_async(self, x):
        return self._comm.all_to_all_async(x)

    def send_recv(self, x, shift=1):
        return self._comm.send_recv(x, shift)

    def send_recv_async(self, x, shift=1):
        return self._comm.send_recv_async(x, shift)

    def all_reduce(self, x, op="sum"):
        return self._comm.all_reduce(x, op)

    def barrier(self):
        self._comm.barrier()

    def split(self, groups):
        return self._comm.split(groups)


@pytest.mark.parametrize("mode", MODES)
def test_backend_limits_refuse_a_mode_before_any_communication(mode):
    P = 2
    sharding, (q, k, v) = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=P), random_qkv(32, 4, 2, 8)
    def rank_fn(comm):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        return cpref.attention(*local, sharding, comm=LimitedComm(comm), mode=mode, **extra(mode, P))

    cluster = SimCluster(P, timeout=30.0)
    needs = cpref.MODES[mode].collectives & LimitedComm.unsupported_ops
    if needs:
        with pytest.raises(ValueError, match=rf"mode='{mode}' needs \['all_gather', 'reduce_scatter'\], which this communicator"):
            cluster.run(rank_fn)
        assert only_the_comparison(cluster.trace), cluster.trace  # its two all-reduces tell each other
    else:  # the mode runs; the rank check uses two all-reduces instead of its all-gather
        cluster.run(rank_fn)
        check = [ev.op for ev in cluster.trace if ev.dtype == torch.int64]
        assert check == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("mode", MODES)
def test_metadata_is_built_once_per_batch_not_per_layer(mode):
    """Layer 1 builds every plan a rank needs; layers 2..4 only hit the cache."""
    P = 4
    sharding, (q, k, v) = cpref.Sharding(cu_from_lengths([16, 48]), cp_size=P), random_qkv(64, 12, 12, 8)
    shards = [[sharding.shard(t, r) for t in (q, k, v)] for r in range(P)]
    sharded = cpref.cache_info().misses  # the shards' index plans, built before any layer
    built = {}

    def rank_fn(comm):
        for layer in range(4):
            cpref.attention(*shards[comm.rank], sharding, comm=comm, mode=mode, **extra(mode, P))
            comm.barrier()
            if comm.rank == 0:
                built[layer] = cpref.cache_info().misses - sharded
            comm.barrier()

    SimCluster(P, timeout=30.0).run(rank_fn)
    assert built[0] >= 1 and built[0] == built[1] == built[2] == built[3]  # Ulysses: one plan for the group


@pytest.mark.parametrize("mode", MODES)
def test_autocast_does_not_lower_the_attention_precision(mode):
    """Under bf16 autocast the kernel must still sum in float32: bitwise the same as without autocast."""
    P = 2
    sharding = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=P)
    q, k, v = (t.bfloat16() for t in random_qkv(32, 12, 12, 8, dtype=torch.float32))

    def rank_fn(comm, autocast):
        local = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return cpref.attention(*local, sharding, comm=comm, mode=mode, **extra(mode, P))

    plain = SimCluster(P).run(lambda comm: rank_fn(comm, False))
    under = SimCluster(P).run(lambda comm: rank_fn(comm, True))
    assert all(torch.equal(a, b) for a, b in zip(plain, under))


@pytest.mark.parametrize("fast", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("mode", MODES)
def test_autocast_does_not_change_the_attention_gradients(mode, fast):
    """The forward under bf16 autocast, the backward outside it (where training loops call it, see
    `cpref.api`): out, dq, dk and dv bitwise the same as without autocast, with the CPU's fused path
    and with the explicit one, whose float32 matmuls CPU autocast would lower to bf16 (a forward
    so lowered saves another output and lse, from which the backward recomputes)."""
    P = 2
    sharding = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=P)
    q, k, v = (t.bfloat16() for t in random_qkv(32, 12, 12, 8, dtype=torch.float32))
    dout = random_qkv(32, 12, 12, 8, dtype=torch.float32, seed=1)[0].bfloat16()

    def rank_fn(comm, autocast):
        local = [sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = cpref.attention(*local, sharding, comm=comm, mode=mode, kernel=cpref.TorchKernel(fast=fast), **extra(mode, P))
        out.backward(sharding.shard(dout, comm.rank))
        return (out.detach(), *(t.grad for t in local))

    plain = SimCluster(P).run(lambda comm: rank_fn(comm, False))
    under = SimCluster(P).run(lambda comm: rank_fn(comm, True))
    for r, (got, want) in enumerate(zip(under, plain)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), f"{mode} rank {r} {name}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", MODES)
def test_activation_recomputation_gives_the_same_gradients(mode, reentrant):
    """Under `torch.utils.checkpoint` (the recomputation the InfiniTrain PR trains with) the forward
    runs again inside the backward, collectives included: gradients bitwise those of a plain run,
    the recomputed forward communicates exactly as the first, the ranks' comparison included (it
    runs on every call), and the first call's setup (the hierarchical mode's group splits) is not
    repeated."""
    from torch.utils.checkpoint import checkpoint

    P = 2
    cu = cu_from_lengths([8, 24])
    q, k, v = random_qkv(32, 12, 12, 8)
    dout = random_qkv(32, 12, 12, 8, seed=1)[0]

    def rank_fn(comm, recompute):
        local = [sharding.shard(t, comm.rank).requires_grad_() for t in (q, k, v)]
        attend = lambda *qkv: cpref.attention(*qkv, sharding, comm=comm, mode=mode, **extra(mode, P))  # noqa: E731
        out = checkpoint(attend, *local, use_reentrant=reentrant) if recompute else attend(*local)
        comm.barrier()  # the end of the forward in the trace
        out.backward(sharding.shard(dout, comm.rank))
        return (out.detach(), *(t.grad for t in local))

    runs = {}
    for recompute in (False, True):
        cpref.clear_cache()
        sharding = cpref.Sharding(cu, cp_size=P)  # after the clear: each run builds its plans afresh
        cluster = SimCluster(P, timeout=30.0)
        runs[recompute] = (cluster.run(lambda comm, again=recompute: rank_fn(comm, again)), [e for e in cluster.trace])
    (plain, plain_trace), (again, again_trace) = runs[False], runs[True]
    for r, (got, want) in enumerate(zip(again, plain)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{mode} rank {r} {name}"
    # plain: F, barrier, B; recomputed: F, barrier, F again without the first call's setup (the
    # hierarchical mode's splits: cached), then the same B
    ops = lambda events: [(e.op, e.dtype, e.shape, e.param) for e in events]  # noqa: E731
    cut = [e.op for e in plain_trace].index("barrier")
    forward, backward = ops(plain_trace[: cut + 1]), ops(plain_trace[cut + 1 :])
    again_forward = [ev for ev in forward[:-1] if ev[0] != "split"]
    assert ("all_gather", torch.int64, (1, len(FIELDS)), "host") in again_forward  # compared again
    assert again_forward and ops(again_trace) == forward + again_forward + backward


@pytest.mark.parametrize("heads", ["gqa", "mla"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_on_the_npu_kernel_rank_by_rank(mode, layout, heads):
    """The NPU adapter through each mode, against a CPU double of the fused op that holds it to the
    op's documented arguments (tests/kernels/npu_double.py): the all-gather's one TND call over
    both chunks, the ring's merged float32 output passed back to the op, Ulysses' head-split
    calls, padding-only sequences. Every rank matches the FP64 oracle."""
    from cpref.kernels import NpuKernel
    from tests.kernels.npu_double import NpuOpsDouble

    P = 4
    sharding, q, k, v, dout = padded_batch([5, 17, 2], P, layout, heads, seed=3)
    doubles = [NpuOpsDouble() for _ in range(P)]
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, kernels=[NpuKernel(ops=d) for d in doubles], **extra(mode, P))
    ops = {call["op"] for d in doubles for call in d.calls}
    assert ops == {"forward", "backward"}, ops  # the op (its double) did the work
    refs = oracle_shards(q, k, v, dout, sharding)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} {layout} rank {r} {name}")
