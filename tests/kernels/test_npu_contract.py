"""Contract test of `NpuKernel`: the adapter driven end to end against a CPU double of the ops.

This is a contract test, not a hardware test. `tests/kernels/npu_double.py` models
`torch_npu.npu_fusion_attention(_grad)` from their documentation (argument forms, mask rules,
softmax-stat storage) and rejects what the real op rejects; these tests check that `NpuKernel`
builds valid arguments, rewrites the edge cases the op does not take, converts the stats into
the contract's natural-log lse, and so matches the FP64 oracle (`reference`, from the
`TorchKernel` tests) at 1e-10 in float64; with windows and shifts it matches `TorchKernel`'s
explicit path (checked against a dense oracle of the contract's rule in
`tests/cp/test_windows.py`). Whether the NPU itself behaves as documented is checked by
`make test-npu` (`sim.tools.npu_check`) on a machine that has one.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

import cpref
import sim.tools.npu_check
from cpref.base.errors import CPInputError
from cpref.kernels import AttentionKernel, NpuKernel, TorchKernel, Varlen
from cpref.kernels.npu_plan import UNBOUNDED
from sim import oracle
from sim.cluster.harness import oracle_padded, oracle_shards, run_attention
from tests.helpers import assert_close, cu_from_lengths, random_qkv
from tests.kernels.double_helpers import check_global_lse_share, one_thread, run  # noqa: F401 (one_thread: autouse)
from tests.kernels.npu_double import NpuOpsDouble
from tests.kernels.test_torch_kernel import HEADS, check_owned_results, reference

LAYOUTS = ["", "TND"]


def check(q_lens, kv_lens, heads=HEADS["gqa"], dtype=torch.float64, *, causal, seed=0, **kernel_kwargs):
    """NpuKernel over the double vs the oracle on random data; returns the results and the double."""
    hq, hkv, d, dv = heads
    double = NpuOpsDouble()
    kernel = NpuKernel(ops=double, **kernel_kwargs)
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, dtype=dtype, seed=seed)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, dtype=dtype, seed=seed + 1)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, dtype=dtype, seed=seed + 2)[0]
    got = run(kernel, q, k, v, Varlen.from_lengths(q_lens, kv_lens), dout, causal=causal, scale=d**-0.5)
    want = reference(q, k, v, cu_from_lengths(q_lens), cu_from_lengths(kv_lens), dout, causal=causal, scale=d**-0.5)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, g, w, like in zip(("out", "lse", "dq", "dk", "dv"), got, want, (dout, None, q, k, v)):
        assert g.dtype == (stat_dtype if like is None else like.dtype), name
        assert g.shape == w.shape, name
        assert not g.isnan().any(), name
        assert_close(g, w, dtype, name)
    return got, double


@pytest.mark.parametrize("lengths", [[24], [10, 14]], ids=["one-sequence", "several"])
def test_results_belong_to_the_caller(lengths):
    check_owned_results(NpuKernel(ops=NpuOpsDouble()), lengths, torch.float64)


def test_satisfies_the_contract():
    assert isinstance(NpuKernel(ops=NpuOpsDouble()), AttentionKernel)


@pytest.mark.sweep
@pytest.mark.parametrize(
    "dtype, layout", [(torch.float64, ""), (torch.float64, "TND"), (torch.float32, "")], ids=["f64", "f64-TND", "f32"]
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_packed_documents_match_oracle(heads, causal, dtype, layout):
    _, double = check([12, 16, 1, 19, 1], [12, 16, 1, 19, 1], heads, dtype, causal=causal, softmax_layout=layout)
    fwd, bwd = double.calls
    assert fwd["actual_seq_qlen"] == bwd["actual_seq_qlen"] == [12, 28, 29, 48, 49]
    assert fwd["head_num"] == heads[0] and fwd["scale"] == bwd["scale"] == heads[2] ** -0.5
    assert fwd["sparse_mode"] == (3 if causal else 0) and (fwd["atten_mask"] is None) == (not causal)
    assert fwd["softmax_layout"] == bwd["softmax_layout"] == layout


@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fewer_queries_than_keys_is_bottom_right(causal, layout):
    check([10, 1, 33], [40, 25, 33], causal=causal, softmax_layout=layout)


@pytest.mark.parametrize("max_seqs", [2048, 1, 2], ids=lambda n: f"max_seqs={n}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
def test_rows_that_see_no_key_give_zero_and_minus_inf(layout, max_seqs):
    # sequence 0: 7 of 12 rows see no key (causal q > kv); sequence 2: kv_len = 0
    (out, lse, dq, dk, dv), double = check(
        [12, 5, 3, 4], [5, 5, 0, 4], causal=True, softmax_layout=layout, max_seqs_per_call=max_seqs
    )
    dead = torch.tensor([*range(7), 17, 18, 19])
    assert (out[dead] == 0).all() and (lse[dead] == float("-inf")).all() and (dq[dead] == 0).all()
    assert lse[[i for i in range(24) if i not in dead.tolist()]].isfinite().all()
    if max_seqs == 2048:  # the split entries the op saw: (7, 0), (5, 5), (5, 5), (3, 0), (4, 4)
        assert double.calls[0]["actual_seq_qlen"] == [7, 12, 17, 20, 24]
        assert double.calls[0]["actual_seq_kvlen"] == [0, 5, 10, 10, 14]
    assert all(len(c["actual_seq_qlen"]) <= max_seqs for c in double.calls)


@pytest.mark.parametrize("max_seqs", [2048, 1], ids=lambda n: f"max_seqs={n}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kv_len_zero_with_and_without_causal(causal, max_seqs):
    (out, lse, *_), _ = check([3, 4, 2], [0, 6, 0], causal=causal, max_seqs_per_call=max_seqs)
    assert (out[:3] == 0).all() and (lse[:3] == float("-inf")).all() and (lse[7:] == float("-inf")).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_empty_sequences(causal):
    # q_len 0, kv_len 0, both 0 (dropped), a normal sequence, keys only at the end
    (out, lse, *_), double = check([0, 4, 0, 6, 0], [3, 0, 0, 6, 2], causal=causal)
    assert (out[:4] == 0).all() and (lse[:4] == float("-inf")).all()
    assert double.calls[0]["actual_seq_qlen"] == [0, 4, 10, 10] and double.calls[0]["actual_seq_kvlen"] == [3, 3, 9, 11]


@pytest.mark.parametrize("lengths", [([0], [0]), ([0, 0], [3, 4]), ([5, 2], [0, 0])], ids=["nothing", "keys-only", "no-keys"])
def test_calls_where_no_row_sees_a_key_skip_the_op(lengths):
    (out, lse, dq, dk, dv), double = check(*lengths, causal=True)
    assert double.calls == []
    assert (dk == 0).all() and (dv == 0).all() and (lse == float("-inf")).all()


def test_more_than_2048_sequences_split_the_call():
    # 2100 short causal documents; the oracle runs on groups of 100 packed documents (fast)
    rng, causal = random.Random(0), True
    lengths = [rng.randint(1, 3) for _ in range(2100)]
    double = NpuOpsDouble()
    q, k, v = random_qkv(sum(lengths), 2, 1, 8, seed=6)
    dout = random_qkv(sum(lengths), 2, 1, 8, seed=7)[0]
    got = run(NpuKernel(ops=double), q, k, v, Varlen.from_lengths(lengths, lengths), dout, causal=causal, scale=0.3)
    assert [len(c["actual_seq_qlen"]) for c in double.calls] == [2048, 52, 2048, 52]
    want, t0 = [[] for _ in range(5)], 0
    for i in range(0, len(lengths), 100):
        cu = cu_from_lengths(lengths[i : i + 100])
        rows = slice(t0, t0 + int(cu[-1]))
        part = oracle.forward_backward(q[rows], k[rows], v[rows], cu, dout[rows], causal=causal, scale=0.3)
        for acc, x in zip(want, part):
            acc.append(x)
        t0 = rows.stop
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_close(g, torch.cat(w), torch.float64, name)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
def test_global_lse_backward_gives_the_share_of_the_row(heads, layout):
    """The ring case: each query chunk's keys are split into an earlier block (full) and its own
    block (causal diagonal); the two calls' outputs merge by lse, and backward with the *global*
    out and lse gives gradients that sum to the oracle's for the whole row."""
    hq, hkv, d, dv = heads
    kernel = NpuKernel(ops=NpuOpsDouble(), softmax_layout=layout)
    q_lens, early = [6, 9, 4], [10, 0, 3]  # each chunk: q_len queries after `early` earlier keys
    kv_lens = [m + e for m, e in zip(q_lens, early)]
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, seed=3)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, seed=4)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, seed=5)[0]
    check_global_lse_share(kernel, q, k, v, dout, q_lens, early, kv_lens, d)


class _SyncCounter:
    """Counts calls of the `torch.Tensor` methods that read a tensor back to the host."""

    NAMES = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count: dict[str, int] = {}
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(t, *args, **kwargs):
            self.count[name] = self.count.get(name, 0) + 1
            return original(t, *args, **kwargs)

        return counted


@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
def test_no_host_sync_after_the_first_call(monkeypatch, layout):
    kernel = NpuKernel(ops=NpuOpsDouble(), softmax_layout=layout, max_seqs_per_call=2)
    q, k, v = random_qkv(24, 4, 2, 8, seed=1)[0], *random_qkv(14, 4, 2, 8, seed=2)[1:]
    seqs, dout = Varlen.from_lengths([12, 5, 3, 4], [5, 5, 0, 4]), torch.randn(24, 4, 8, dtype=torch.float64)
    shifted = Varlen(seqs.cu_q, seqs.cu_kv, shifts=[2, 0, -1, 3])
    cases = [(seqs, True, (-1, -1)), (seqs, False, (-1, -1)), (seqs, True, (2, 0)), (shifted, False, (1, 3))]
    for s, causal, window in cases:  # warm: builds the plans and the mask
        run(kernel, q, k, v, s, dout, causal=causal, scale=0.3, window=window)
    counter = _SyncCounter(monkeypatch)
    for s, causal, window in cases:
        run(kernel, q, k, v, s, dout, causal=causal, scale=0.3, window=window)
    monkeypatch.undo()
    assert counter.count == {}


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0)), (False, (1, 3))],
                         ids=["causal", "full", "causal-window", "window-shifted"])  # fmt: skip
def test_no_data_dependent_op_runs_on_the_meta_device(causal, window):
    """Meta tensors have shapes but no values: any op whose size depends on data would fail."""
    kernel = NpuKernel(ops=NpuOpsDouble(), max_seqs_per_call=2)
    q, k, v = (torch.empty(n, h, 8, device="meta") for n, h in ((24, 4), (14, 2), (14, 2)))
    seqs = Varlen.from_lengths([12, 5, 3, 4], [5, 5, 0, 4], shifts=None if causal else [2, 0, -1, 3])
    dout = torch.empty(24, 4, 8, device="meta")
    out, lse, dq, dk, dv = run(kernel, q, k, v, seqs, dout, causal=causal, scale=0.3, window=window)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == ((24, 4, 8), (24, 4), q.shape, k.shape, v.shape)


def test_mask_is_built_once_per_device():
    double = NpuOpsDouble()
    kernel = NpuKernel(ops=double)
    for lengths in ([4, 6], [3], [1, 1, 1]):
        q, k, v = random_qkv(sum(lengths), 2, 1, 8)
        run(kernel, q, k, v, Varlen.from_lengths(lengths, lengths), torch.randn_like(q), causal=True, scale=0.3)
    masks = {id(c["atten_mask"]) for c in double.calls}
    assert len(double.calls) == 6 and len(masks) == 1 and list(kernel._masks) == ["cpu"]


def test_missing_torch_npu_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    with pytest.raises(RuntimeError, match=r"torch_npu, which is not importable.*pip install torch-npu"):
        NpuKernel()


def test_bad_inputs_raise_cp_input_error():
    kernel = NpuKernel(ops=NpuOpsDouble())
    q, k, v = random_qkv(6, 2, 1, 800)
    with pytest.raises(CPInputError, match="D=800 exceeds the fused op's 768"):
        kernel.forward(q, k, v, Varlen([0, 6]), causal=True, scale=0.1)
    q, k, v = random_qkv(6, 2, 1, 8, 16)
    with pytest.raises(CPInputError, match="Dq == Dk >= Dv"):
        kernel.forward(q, k, v, Varlen([0, 6]), causal=True, scale=0.1)
    q, k, v = random_qkv(6, 2, 1, 8)
    with pytest.raises(CPInputError, match="share a float dtype"):
        kernel.forward(q, k.float(), v, Varlen([0, 6]), causal=True, scale=0.1)
    with pytest.raises(CPInputError, match="seqs cover 5 queries"):
        kernel.forward(q, k, v, Varlen([0, 5], [0, 6]), causal=True, scale=0.1)
    with pytest.raises(CPInputError, match="scale must be a Python float"):
        kernel.forward(q, k, v, Varlen([0, 6]), causal=True, scale=torch.tensor(0.1))
    with pytest.raises(CPInputError, match="softmax_layout"):
        NpuKernel(ops=NpuOpsDouble(), softmax_layout="BNSD")
    with pytest.raises(CPInputError, match="max_seqs_per_call"):
        NpuKernel(ops=NpuOpsDouble(), max_seqs_per_call=4096)
    with pytest.raises(CPInputError, match="no function npu_fusion_attention"):
        NpuKernel(ops=object())


def test_the_harness_passes_on_the_cpu_with_the_double(capsys):
    """`make test-npu`'s case list and table, run through the double in float64 (no NPU needed)."""
    names = ("packed-mla-causal", "no-key-rows", "empty-sequences-full", "ring-global-lse", "ring-stats-TND",
             "window-causal", "window-full-asymmetric", "window-shifted", "window-shifted-full")
    cases = [c for c in sim.tools.npu_check.CASES if c.name in names]
    rows = sim.tools.npu_check.run_cases(lambda layout: NpuKernel(ops=NpuOpsDouble(), softmax_layout=layout),
                                   torch.device("cpu"), [torch.float64], cases=cases, small=True)  # fmt: skip
    print(sim.tools.npu_check.format_table(rows))
    assert len(rows) == len(names) and all(r.status == "pass" for r in rows), capsys.readouterr().out


def test_make_test_npu_without_an_npu_prints_one_line(capsys):
    assert sim.tools.npu_check.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no Ascend NPU found")


def test_an_output_passed_unrounded_is_rounded_for_the_op():
    """The contract lets a caller pass `out` in the compute dtype (the ring keeps its merged output
    in float32); the op takes `attention_in` in the input dtype, so the kernel rounds it first:
    the gradients are those of the rounded output, bit for bit."""
    kernel, seqs = NpuKernel(ops=NpuOpsDouble()), Varlen.from_lengths([10, 14], [10, 14])
    q, k, v = random_qkv(24, 4, 2, 8, dtype=torch.bfloat16)
    dout = random_qkv(24, 4, 4, 8, dtype=torch.bfloat16, seed=1)[0]
    out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=0.3, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    wide = kernel.backward(dout, q, k, v, out, lse, seqs, causal=True, scale=0.3)
    rounded = kernel.backward(dout, q, k, v, out.to(torch.bfloat16), lse, seqs, causal=True, scale=0.3)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(wide, rounded))


# --- sliding windows and shifts: sparse_mode=4 ---------------------------------------------------

EXPLICIT = TorchKernel(fast=False)  # the contract's masks, checked against a dense oracle in tests/cp/test_windows.py
WINDOWS = [(True, (0, 0)), (True, (1, 0)), (True, (3, 0)), (True, (40, 0)), (True, (-1, 0)), (False, (0, 0)),
           (False, (2, 2)), (False, (1, 4)), (False, (4, 1)), (False, (-1, 2)), (False, (3, -1)), (False, (-1, -1))]  # fmt: skip
WINDOW_IDS = [f"{'causal' if c else 'full'}{w}" for c, w in WINDOWS]


def check_banded(q_lens, kv_lens, shifts=None, heads=HEADS["gqa"], *, causal, window, seed=0, **kernel_kwargs):
    """NpuKernel over the double vs TorchKernel's explicit path, forward and backward in float64, with a window
    and shifts; returns the sequences, the results and the double."""
    hq, hkv, d, dv = heads
    double, seqs = NpuOpsDouble(), Varlen.from_lengths(q_lens, kv_lens, shifts)
    q = random_qkv(sum(q_lens), hq, hkv, d, dv, seed=seed)[0]
    _, k, v = random_qkv(sum(kv_lens), hq, hkv, d, dv, seed=seed + 1)
    dout = random_qkv(sum(q_lens), hq, hkv, dv, seed=seed + 2)[0]
    kwargs = dict(causal=causal, scale=d**-0.5, window=window)
    got = run(NpuKernel(ops=double, **kernel_kwargs), q, k, v, seqs, dout, **kwargs)
    want = run(EXPLICIT, q, k, v, seqs, dout, **kwargs)
    for name, g, w, like in zip(("out", "lse", "dq", "dk", "dv"), got, want, (dout, None, q, k, v)):
        assert g.dtype == (torch.float64 if like is None else like.dtype) and g.shape == w.shape, name
        assert not g.isnan().any(), name
        assert_close(g, w, torch.float64, f"{name} causal={causal} window={window}")
    return seqs, got, double


@pytest.mark.sweep
@pytest.mark.parametrize("layout", LAYOUTS, ids=["head-major", "TND"])
@pytest.mark.parametrize("heads", [HEADS["gqa"], HEADS["mla"]], ids=["gqa", "mla"])
@pytest.mark.parametrize("causal, window", WINDOWS, ids=WINDOW_IDS)
def test_windows_match_the_contract(causal, window, heads, layout):
    """Bottom-right sequences (more queries than keys, fewer, one query, none, no keys), every kind of window."""
    _, _, double = check_banded([7, 12, 1, 9, 0, 5], [7, 5, 4, 14, 3, 0], None, heads, causal=causal, window=window,
                                softmax_layout=layout)  # fmt: skip
    modes = {c["sparse_mode"] for c in double.calls}
    assert modes == ({0} if window == (-1, -1) else {3} if causal and window[0] < 0 else {4}), modes


@pytest.mark.sweep
@pytest.mark.parametrize("max_seqs", [2048, 1, 2], ids=lambda n: f"max_seqs={n}")
@pytest.mark.parametrize("causal, window", WINDOWS, ids=WINDOW_IDS)
def test_shifts_match_the_contract_and_rows_that_see_no_key_give_zero(causal, window, max_seqs):
    """Keys that start before their queries, end after them, lie wholly before or after them: rows outside
    every band are split off (out 0, lse -inf, dq 0), and every call has one band."""
    q_lens, kv_lens, shifts = [6, 7, 5, 4, 3, 6], [10, 7, 6, 3, 2, 4], [5, -2, 3, 9, -4, -1]
    seqs, (out, lse, dq, _, _), double = check_banded(q_lens, kv_lens, shifts, causal=causal, window=window,
                                                      max_seqs_per_call=max_seqs)  # fmt: skip
    spans = [(q0 + x, seqs.visible(i, x, causal, window)) for i, (q0, q1, _, _) in enumerate(seqs.pairs())
             for x in range(q1 - q0)]  # fmt: skip
    blind = [row for row, (lo, hi) in spans if hi <= lo]
    assert blind or window == (-1, -1)  # the case has rows that see no key
    assert (out[blind] == 0).all() and (lse[blind] == float("-inf")).all() and (dq[blind] == 0).all()
    for c in double.calls:
        assert len(c["actual_seq_qlen"]) <= max_seqs
        if c["sparse_mode"] == 4:
            assert 0 <= c["pre_tockens"] <= UNBOUNDED and 0 <= c["next_tockens"] <= UNBOUNDED


def test_the_calls_follow_the_bands():
    """Known cases, call by call. Full attention with window (1, 1): sequence 0 is bottom-right, band (1, 1);
    sequence 1's queries stand 2 keys early (delta = -2), so its last key is seen by none and is split off,
    and the rest is band (2, 0); sequence 2 is sequence 0 again; no row of sequence 3 sees a key. Causal,
    shifts [2, 1, 4] of 5 keys for 3 queries: bottom-right; one early (its last key split off); two late."""
    M = UNBOUNDED
    cases = [  # (q_lens, kv_lens, shifts, causal, window): [(sparse_mode, pre, next, seq_qlen, seq_kvlen), ...]
        (([4, 4, 4, 3], [6, 6, 6, 2], [2, 0, 2, 5], False, (1, 1)),
         [(4, 1, 1, [4], [6]), (4, 2, 0, [4, 4], [5, 6]), (4, 1, 1, [4, 7, 7], [6, 6, 8])]),
        (([3, 3, 3], [5, 5, 5], [2, 1, 4], True, (2, 0)), [(4, 2, 0, [3, 6, 6], [5, 9, 10]), (4, 0, 2, [3], [5])]),
        (([3, 3, 3], [5, 5, 5], [2, 1, 4], True, (-1, -1)), [(3, M, M, [3, 6, 6], [5, 9, 10]), (4, M, 2, [3], [5])]),
        (([3, 3, 3], [5, 5, 5], [2, 1, 4], False, (-1, -1)), [(0, M, M, [3, 6, 9], [5, 10, 15])]),
    ]  # fmt: skip
    for (q_lens, kv_lens, shifts, causal, window), want in cases:
        _, _, double = check_banded(q_lens, kv_lens, shifts, causal=causal, window=window)
        got = [(c["sparse_mode"], c["pre_tockens"], c["next_tockens"], c["actual_seq_qlen"], c["actual_seq_kvlen"])
               for c in double.calls]  # fmt: skip
        assert [c["op"] for c in double.calls] == ["forward"] * len(want) + ["backward"] * len(want)
        assert got == want + want, (q_lens, shifts, causal, window)
        assert all((c["atten_mask"] is None) == (c["sparse_mode"] == 0) for c in double.calls)


def test_a_window_that_bounds_nothing_is_the_call_without_one():
    """`window=(-1, 0)` with causal, `(-1, -1)`, and shifts equal to bottom-right: bitwise the plain call, same records."""
    q_lens, kv_lens = [12, 5, 3, 4], [5, 9, 0, 4]
    q, k, v = random_qkv(24, 4, 2, 8, seed=1)[0], *random_qkv(18, 4, 2, 8, seed=2)[1:]
    dout = random_qkv(24, 4, 4, 8, seed=3)[0]
    plain, same = Varlen.from_lengths(q_lens, kv_lens), Varlen.from_lengths(q_lens, kv_lens, [-7, 4, -3, 0])
    for causal, window in ((True, (-1, 0)), (True, (-1, -1)), (False, (-1, -1))):
        runs = []
        for seqs, w in ((plain, (-1, -1)), (same, (-1, -1)), (plain, window)):
            double = NpuOpsDouble()
            runs.append((run(NpuKernel(ops=double), q, k, v, seqs, dout, causal=causal, scale=0.3, window=w), double.calls))
        records = lambda calls: [{**c, "atten_mask": c["atten_mask"] is not None} for c in calls]  # noqa: E731
        (base, base_calls), *others = runs
        for results, calls in others:
            assert all(torch.equal(a, b) for a, b in zip(results, base))
            assert records(calls) == records(base_calls)
        assert {c["sparse_mode"] for c in base_calls} == ({3} if causal else {0})


@pytest.mark.sweep
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("causal, window", [(True, (3, 0)), (False, (2, 5))], ids=["causal(3,0)", "full(2,5)"])
@pytest.mark.parametrize("mode", ["all_gather", "p2p"])
def test_windowed_modes_run_on_the_npu_kernel_rank_by_rank(mode, causal, window, layout):
    """The modes' windowed kernel calls (all-gather's one call with shifted key spans, the ring's per-step calls
    over halos) through NpuKernel and the double: band calls made, every rank equal to the FP64 oracle."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([5, 17, 2, 11]), cp_size=P, layout=layout)
    q, k, v = random_qkv(sharding.total, 4, 2, 8, seed=3)
    dout = random_qkv(sharding.total, 4, 4, 8, seed=4)[0]
    doubles = [NpuOpsDouble() for _ in range(P)]
    results, _ = run_attention(q, k, v, dout, sharding, mode=mode, kernels=[NpuKernel(ops=d) for d in doubles],
                               causal=causal, window=window)  # fmt: skip
    assert any(c["sparse_mode"] == 4 for d in doubles for c in d.calls)  # the op's band did the work
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal, window=window)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} {layout} window={window} rank {r} {name}")


@pytest.mark.sweep
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
def test_sinks_and_chunks_run_on_the_npu_kernel_rank_by_rank(mode, layout):
    """Learnable sinks and chunked attention ask nothing of a kernel (the modes add a sink to a row's lse once, and
    cut their sequences at the chunks): through NpuKernel and the double, every mode matches the FP64 oracle rank by
    rank, the sinks' gradient summed over the ranks included. Soft-capping, which the op lacks, is refused by name
    (`tests/cp/test_variants.py`)."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([5, 17, 2, 11]), cp_size=P, layout=layout)
    q, k, v = random_qkv(sharding.total, 4, 2, 8, seed=3)
    dout = random_qkv(sharding.total, 4, 4, 8, seed=4)[0]
    sinks = torch.tensor([20.0, -2.0, 5.0, 0.5], dtype=torch.float64)
    kernels = [NpuKernel(ops=NpuOpsDouble()) for _ in range(P)]
    results, _ = run_attention(q, k, v, dout, sharding, mode=mode, kernels=kernels, chunk=6, sinks=sinks,
                               **cpref.MODES[mode].example_options(P))  # fmt: skip
    refs = oracle_shards(q, k, v, dout, sharding, chunk=6, sinks=sinks)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} {layout} rank {r} {name}")
    dsinks = oracle_padded(q, k, v, dout, sharding, chunk=6, sinks=sinks)[4]
    assert_close(sum(res[4] for res in results), dsinks, torch.float64, msg=f"{mode} {layout} dsinks")
