"""`deterministic=True` (`cpref.base.determinism`): the backward's row sums race-free, the kernels' backward under
PyTorch's deterministic switch, the flag refused with a kernel that cannot honour it.

On the CPU `index_add_` is sequential, so repeatability itself cannot be observed here; what is checked is
the property that makes it hold on CUDA: with the flag, no `index_add_` of any mode's backward names a row
twice (one atomic per element at most), its sums are bit for bit the default's, and the fused kernels' backward
ops run with `torch.are_deterministic_algorithms_enabled()`. `bench/gpu_check.sh` checks two runs bitwise on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.base.determinism import add_rows, occurrence_layers, torch_deterministic
from cpref.base.errors import CPInputError
from cpref.kernels import CudaKernel, NpuKernel, TorchKernel, default_kernel
from cpref.models import CPContext
from sim.cluster.harness import oracle_shards, run_attention
from sim.cluster.simcluster import SimCluster
from tests.helpers import (
    assert_close,
    attention_inputs,
    cu_from_lengths,
    only_the_comparison,
)
from tests.kernels.flash_double import FlashOpsDouble
from tests.kernels.npu_double import NpuOpsDouble

ON_CPU = dict(devices=("cpu",), flash_dtypes=(torch.float64, torch.bfloat16, torch.float16))


@pytest.fixture(autouse=True)
def _fresh_cache_and_switch():
    cpref.clear_cache()
    found = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    cpref.clear_cache()
    torch.use_deterministic_algorithms(found[0], warn_only=found[1])  # the tests that set it check what cpref left


# ---- occurrence layers


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), index=st.lists(st.integers(0, 5), max_size=40), seed=st.integers(0, 2**16))
def test_add_rows_is_the_sequential_sum_in_layers_of_distinct_rows(rows, index, seed):
    index = torch.tensor([i % rows for i in index], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(len(index), 3, generator=g) * torch.logspace(-4, 4, len(index) or 1)[: len(index), None]
    dst = torch.randn(rows, 3, generator=g)
    layers = occurrence_layers(index)
    # every position once, each layer in position order over distinct rows, layer j: j earlier entries of its row
    assert sorted(torch.cat(layers).tolist() if layers else []) == list(range(len(index)))
    for j, positions in enumerate(layers):
        assert positions.tolist() == sorted(positions.tolist())
        assert len(set(index[positions].tolist())) == len(positions)
        for p in positions.tolist():
            assert index[:p].tolist().count(index[p].item()) == j
    # float32 sums of values over eight decades: any other order would differ in the last bits
    want = dst.clone().index_add_(0, index, src)
    assert torch.equal(add_rows(dst.clone(), index, src, deterministic=True), want)
    assert torch.equal(add_rows(dst.clone(), index, src, deterministic=False), want)


def test_add_rows_sums_a_repeated_row_in_position_order():
    """1e8 + 1 - 1e8 in float32 is 0 in this order and 1 in others: the order itself is pinned."""
    src = torch.tensor([[1e8], [1.0], [-1e8], [5.0]])
    index = torch.tensor([0, 0, 0, 1])
    got = add_rows(torch.zeros(2, 1), index, src, deterministic=True)
    assert got.flatten().tolist() == [0.0, 5.0]
    assert [p.tolist() for p in occurrence_layers(index)] == [[0, 3], [1], [2]]


class CountingLayers:
    """`occurrence_layers` counted (the sort and the host read `add_rows` keeps per index tensor)."""

    def __init__(self, monkeypatch) -> None:
        import cpref.base.determinism as det

        self.calls, original = 0, det.occurrence_layers

        def counted(index):
            self.calls += 1
            return original(index)

        monkeypatch.setattr(det, "occurrence_layers", counted)


def test_add_rows_sorts_an_index_once_and_again_only_after_it_changes(monkeypatch):
    """The plans' indices live as long as the batch: a backward after the first pays no sort and no host read. A new
    tensor of the same values, or the same tensor changed in place, gets its own layers: never a stale answer."""
    counter = CountingLayers(monkeypatch)
    index, src = torch.tensor([2, 0, 2, 1, 2]), torch.arange(5.0).reshape(5, 1)
    for _ in range(3):
        assert add_rows(torch.zeros(3, 1), index, src, deterministic=True).flatten().tolist() == [1.0, 3.0, 6.0]
    assert counter.calls == 1
    assert add_rows(torch.zeros(3, 1), index.clone(), src, deterministic=True).flatten().tolist() == [1.0, 3.0, 6.0]
    assert counter.calls == 2  # another tensor: its own layers
    index[1] = 2  # in place: rows 2 2 2 1 2
    assert add_rows(torch.zeros(3, 1), index, src, deterministic=True).flatten().tolist() == [0.0, 3.0, 7.0]
    assert counter.calls == 3
    with torch.inference_mode():
        frozen = torch.tensor([1, 1, 0])  # an inference tensor keeps no version: computed each call, still right
    for _ in range(2):
        assert add_rows(torch.zeros(2, 1), frozen, src[:3], deterministic=True).flatten().tolist() == [2.0, 1.0]
    assert counter.calls == 5


def test_add_rows_forgets_an_index_with_the_tensor():
    import gc

    import cpref.base.determinism as det

    before = len(det._LAYERS)
    index = torch.tensor([0, 0, 1])
    add_rows(torch.zeros(2, 1), index, torch.ones(3, 1), deterministic=True)
    assert len(det._LAYERS) == before + 1
    del index
    gc.collect()
    assert len(det._LAYERS) == before


def test_add_rows_keeps_layers_right_across_threads_sharing_an_index():
    """The simulated ranks share one process and may share a plan's index: every thread gets the right sums."""
    index, src = torch.tensor([1, 0, 1, 1, 0, 2] * 50), torch.randn(300, 4, dtype=torch.float64)
    want = torch.zeros(3, 4, dtype=torch.float64).index_add_(0, index, src)
    results = []

    def worker():
        results.append(all(torch.equal(add_rows(torch.zeros(3, 4, dtype=torch.float64), index, src, deterministic=True), want)
                           for _ in range(20)))  # fmt: skip

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


# ---- every mode's backward


class IndexAddRecorder:
    """Replaces `torch.Tensor.index_add_` (all threads: the simulated ranks) and records, per call, whether its
    index names a row twice."""

    def __init__(self, monkeypatch) -> None:
        self.repeats: list[bool] = []
        self._lock, original = threading.Lock(), torch.Tensor.index_add_

        def recording(tensor, dim, index, source, **kwargs):
            with self._lock:
                self.repeats.append(index.numel() != index.unique().numel())
            return original(tensor, dim, index, source, **kwargs)

        monkeypatch.setattr(torch.Tensor, "index_add_", recording)


CASES = [  # (mode, P, layout, options, window): every mode, the plans with index_add_ in their backward
    ("all_gather", 2, "zigzag", {}, (-1, -1)),
    ("all_gather", 4, "balanced", {}, (-1, -1)),
    ("all_gather", 2, "zigzag", {"overlap": True}, (-1, -1)),
    ("all_gather", 4, "balanced", {"overlap": True}, (-1, -1)),
    ("all_gather", 4, "zigzag", {}, (3, 0)),
    ("p2p", 4, "zigzag", {}, (-1, -1)),
    ("p2p", 4, "balanced", {}, (-1, -1)),
    ("p2p", 2, "zigzag", {}, (5, 0)),
    ("a2a", 2, "zigzag", {}, (-1, -1)),
    ("a2a", 4, "balanced", {"head_groups": 2}, (-1, -1)),
    ("a2a+p2p", 4, "zigzag", {"a2a_size": 2}, (-1, -1)),
    ("a2a+p2p", 4, "balanced", {"a2a_size": 2}, (-1, -1)),
    ("a2a+p2p", 4, "zigzag", {"a2a_size": 2, "head_groups": 2}, (-1, -1)),  # a ring per head group
    ("a2a+p2p", 4, "balanced", {"a2a_size": 2, "head_groups": 2}, (-1, -1)),
]
# where the default backward adds a row twice: a key read by two of a rank's sequences (both zigzag chunks of a
# document, pieces of one document, a window's shifted blocks); Ulysses attends whole sequences, without index_add_
REPEATS_BY_DEFAULT = {"all_gather", "p2p", "a2a+p2p"}


@pytest.mark.parametrize("mode, P, layout, options, window", CASES, ids=str)
def test_every_mode_adds_distinct_rows_and_the_same_bits_when_deterministic(monkeypatch, mode, P, layout, options, window):
    lengths = [9 * P, 3, 5 * P + 1]
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (16, 8, 8, 8), dtype=torch.float32, seed=P)
    results, repeats = {}, {}
    for flag in (False, True):
        recorder = IndexAddRecorder(monkeypatch)
        results[flag], _ = run_attention(q, k, v, dout, sharding, mode=mode, window=window, deterministic=flag, **options)
        repeats[flag] = recorder.repeats
        monkeypatch.undo()
    assert not any(repeats[True]), f"{sum(repeats[True])} of {len(repeats[True])} index_add_ calls name a row twice"
    # bit for bit the default's sums (the CPU's index_add_ is sequential), and right
    refs = oracle_shards(*(t.double() for t in (q, k, v, dout)), sharding, window=window)
    for r in range(P):
        for name, a, b, want in zip(("out", "dq", "dk", "dv"), results[False][r], results[True][r], refs[r]):
            assert torch.equal(a, b), f"rank {r} {name}"
            assert_close(b, want, torch.float32, f"rank {r} {name}")
    if mode in REPEATS_BY_DEFAULT:
        assert any(repeats[False]), "the default backward should add some row twice here: the case checks nothing"
    else:
        assert not repeats[False]


def test_the_cases_reach_repeated_rows_in_each_backward_that_has_them():
    """The list above is not vacuous: every mode that sums with index_add_ appears with a plan that repeats rows."""
    assert {mode for mode, *_ in CASES} == set(cpref.MODES)
    assert REPEATS_BY_DEFAULT < set(cpref.MODES)


# ---- the kernels


def recording(double: type, forward: str, backward: str) -> type:
    """A subclass of a kernel's op double that records PyTorch's deterministic switch as each op sees it, in
    `switch`: `(op, enabled, warn_only)` per call."""

    def seen(op: str, method: str):
        def call(self, *args, **kwargs):
            state = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
            self.switch.append((op, *state))
            return getattr(double, method)(self, *args, **kwargs)

        return call

    def init(self) -> None:
        double.__init__(self)
        self.switch = []

    return type(f"Recording{double.__name__}", (double,), {"__init__": init, forward: seen("forward", forward),
                                                           backward: seen("backward", backward)})  # fmt: skip


RecordingFlash = recording(FlashOpsDouble, "_flash_attention_forward", "_flash_attention_backward")
RecordingNpu = recording(NpuOpsDouble, "npu_fusion_attention", "npu_fusion_attention_grad")


def kernels(deterministic: bool):
    flash, npu = RecordingFlash(), RecordingNpu()
    return [(CudaKernel(ops=flash, deterministic=deterministic, **ON_CPU), flash),
            (NpuKernel(ops=npu, deterministic=deterministic), npu)]  # fmt: skip


def one_step(kernel, dtype=torch.bfloat16):
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=1)
    q, k, v, dout = attention_inputs(24, (4, 2, 16, 16), dtype=dtype)
    return run_attention(q, k, v, dout, sharding, mode="all_gather", kernels=[kernel], deterministic=kernel.deterministic)


@pytest.mark.parametrize("before", [(False, False), (False, True), (True, True)], ids=["off", "off-warn", "warn-only"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_fused_backward_runs_under_the_strict_switch_only_when_asked(deterministic, before):
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for kernel, ops in kernels(deterministic):
        one_step(kernel)
        forwards = [s[1:] for s in ops.switch if s[0] == "forward"]
        backwards = [s[1:] for s in ops.switch if s[0] == "backward"]
        assert forwards and backwards, type(kernel).__name__
        assert set(forwards) == {before}, type(kernel).__name__  # the forward is left alone
        assert set(backwards) == {(True, False) if deterministic else before}, type(kernel).__name__
        # restored as found
        assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_the_switch_already_strictly_on_stays_on():
    torch.use_deterministic_algorithms(True)
    for kernel, ops in kernels(True):
        one_step(kernel)
        assert {s[1:] for s in ops.switch} == {(True, False)}
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def test_the_switch_stays_on_until_the_last_thread_leaves():
    """Simulated ranks share the process: one rank leaving must not turn the switch off under another's op."""
    entered, first_left = threading.Barrier(2), threading.Event()
    seen = {}

    def first():
        with torch_deterministic():
            entered.wait()
        first_left.set()

    def second():
        with torch_deterministic():
            entered.wait()
            first_left.wait()
            seen["after the first left"] = torch.are_deterministic_algorithms_enabled()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after the first left": True}
    assert not torch.are_deterministic_algorithms_enabled()


def test_every_mode_runs_the_fused_backward_deterministically_rank_by_rank():
    """The flag reaches the kernel from every mode on the simulated cluster (P = 2, bf16, the flash double)."""
    sharding = cpref.Sharding(cu_from_lengths([32, 16]), cp_size=2)
    q, k, v, dout = attention_inputs(48, (4, 2, 16, 16), dtype=torch.bfloat16)
    for mode in cpref.MODES:
        doubles = [RecordingFlash() for _ in range(2)]
        kernels_ = [CudaKernel(ops=d, deterministic=True, **ON_CPU) for d in doubles]
        run_attention(q, k, v, dout, sharding, mode=mode, kernels=kernels_, deterministic=True,
                      **cpref.MODES[mode].example_options(2))  # fmt: skip
        for r, d in enumerate(doubles):
            assert {s[1] for s in d.switch if s[0] == "backward"} == {True}, (mode, r)
            assert {s[1] for s in d.switch if s[0] == "forward"} == {False}, (mode, r)


def test_the_kernels_declare_what_they_can():
    assert TorchKernel().deterministic is True and TorchKernel(fast=False).deterministic is True
    assert CudaKernel(ops=FlashOpsDouble()).deterministic is False
    assert CudaKernel(ops=FlashOpsDouble(), deterministic=True).deterministic is True
    assert default_kernel(torch.device("cuda"), deterministic=True).deterministic is True
    assert default_kernel(torch.device("cuda")).deterministic is False
    assert isinstance(default_kernel(torch.device("cpu"), deterministic=True), TorchKernel)
    with pytest.raises(CPInputError, match="deterministic must be True or False"):
        CudaKernel(ops=FlashOpsDouble(), deterministic="yes")
    with pytest.raises(CPInputError, match="deterministic must be True or False"):
        NpuKernel(ops=NpuOpsDouble(), deterministic=1)
    with pytest.raises(CPInputError, match=r"with fallback, an instance of CudaKernel, which does not declare deterministic = True"):
        CudaKernel(ops=FlashOpsDouble(), fallback=CudaKernel(ops=FlashOpsDouble()), deterministic=True)
    assert "deterministic=True" in repr(NpuKernel(ops=NpuOpsDouble(), deterministic=True))


# ---- refusals


class Undeclared:
    """A kernel that does not say whether its backward is repeatable."""

    def __init__(self) -> None:
        self.inner = TorchKernel()

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


@pytest.mark.parametrize("kernel, match", [
    (Undeclared, r"deterministic=True needs a kernel whose backward is repeatable, but an instance of Undeclared does not.*cpref.CudaKernel\(deterministic=True\)"),
    (lambda: CudaKernel(ops=FlashOpsDouble(), **ON_CPU), r"does not declare deterministic = True"),
    (None, r"deterministic must be True or False, got 'yes'"),
])  # fmt: skip
def test_a_kernel_that_cannot_is_refused_on_every_rank_before_any_communication(kernel, match):
    sharding = cpref.Sharding(cu_from_lengths([8, 8]), cp_size=2)
    q, k, v, dout = attention_inputs(16, (4, 2, 8, 8))
    cluster = SimCluster(2, timeout=10.0)
    flag = "yes" if kernel is None else True
    kernels_ = None if kernel is None else [kernel() for _ in range(2)]
    with pytest.raises(CPInputError, match=match):  # one error, the same on both ranks (else a ClusterFailure)
        run_attention(q, k, v, dout, sharding, mode="p2p", kernels=kernels_, cluster=cluster, deterministic=flag)
    assert only_the_comparison(cluster.trace)


def test_a_models_context_carries_the_flag():
    sharding = cpref.Sharding(cu_from_lengths([8]), cp_size=1)
    q, k, v, _ = attention_inputs(8, (4, 2, 8, 8))
    cp = CPContext(comm=cpref.SingleRank(), sharding=sharding, mode="all_gather", options={"deterministic": True},
                   kernel=Undeclared())  # fmt: skip
    with pytest.raises(CPInputError, match="deterministic=True needs a kernel"):
        cp.attention(q, k, v)
    ok = CPContext(comm=cpref.SingleRank(), sharding=sharding, mode="all_gather", options={"deterministic": True})
    assert ok.attention(q, k, v).shape == (8, 4, 8)


@pytest.mark.parametrize("P", [2, 4])
def test_the_zigzag_all_gather_index_has_two_layers_and_contiguous_one(P):
    """What the page says the flag costs the RFC's plan: one extra index_add_ under zigzag, none under contiguous."""
    from cpref.modes.all_gather_plan import build_all_gather_plan

    for layout, layers in (("zigzag", 2), ("contiguous", 1)):
        sharding = cpref.Sharding.eod_padded(cu_from_lengths([8 * P, 3, 20 * P]), cp_size=P, layout=layout)
        for r in range(P):
            plan = build_all_gather_plan(sharding.bounds, P, r, layout, True, torch.device("cpu"))
            assert len(occurrence_layers(plan.kv_index)) == layers, (layout, r)
