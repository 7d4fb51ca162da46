"""What `sim verify` counts an implementation moving and computing (`sim.tools.verify.wire`), and the report.

The bytes of every collective API are checked against the cost model by hand on 2 gloo processes; cpref's four
modes, counted at the dispatcher on gloo, move exactly what the simulated cluster's trace of the same call says;
the work of PyTorch's fused attention calls is counted pair by pair (top-left causal, a boolean or additive mask);
PyTorch's ring and cpref's p2p are measured side by side in one run, their balance exact (contiguous 1.50, zigzag
1.00); `--balance` fails an unbalanced layout; `--forward-only` verifies an implementation without a backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpref
from sim.cluster.harness import run_attention
from sim.cluster.trace import summarize
from sim.tools import verify
from sim.tools.launch import launch
from sim.tools.verify.cases import Setup, build_cases, make_batch
from sim.tools.verify.cli import main
from sim.tools.verify.table import summary
from sim.tools.verify.wire import Tally, Wire, WorkKernel, balance, causal_pairs, traffic_table
from tests.backends import wire_ranks

IMPL = "sim.tools.verify.peer_torch_ring:attention"

# bytes each rank sends, by sim.cluster.trace's cost model at P = 2, with 32-byte inputs (8 float32 elements)
EXPECTED = {
    "all_gather_into_tensor": ((32, 32), {"all_gather": 1}),  # (P - 1) n
    "all_gather": ((32, 32), {"all_gather": 1}),
    "reduce_scatter_tensor": ((16, 16), {"reduce_scatter": 1}),  # (P - 1) / P N
    "all_to_all_single": ((16, 16), {"all_to_all": 1}),  # the own half stays home
    "all_to_all_single uneven": ((24, 16), {"all_to_all": 1}),  # 3 rows of 8 bytes leave rank 0, 2 leave rank 1
    "batch_isend_irecv 32 B / 16 B": ((32, 16), {"send_recv": 1}),
    "send / recv": ((32, 0), None),  # the receiver sends nothing
    "all_reduce": ((32, 32), {"all_reduce": 1}),  # 2 (P - 1) / P N
    "funcol all_gather_tensor": ((32, 32), {"all_gather": 1}),
    "funcol all_to_all_single": ((16, 16), {"all_to_all": 1}),
    "funcol reduce_scatter_tensor": ((16, 16), {"reduce_scatter": 1}),
    "funcol all_reduce": ((32, 32), {"all_reduce": 1}),
    "a collective in the backward": ((32, 32), {"all_gather": 1}),
    "reduce_scatter (list)": ((16, 16), {"reduce_scatter": 1}),
    "scatter from rank 0": ((32, 0), {"scatter": 1}),  # the root sends the other rank its chunk
    "gather to rank 0": ((0, 32), {"gather": 1}),
    "functional isend / irecv, batch_p2p_ops": ((64, 32), {"send_recv": 2}),  # each: 32 B of rank 0, 16 B of rank 1
    "all_to_all (list) 8 B each": ((8, 8), {"all_to_all": 1}),
    "all_gather_coalesced 2 x 32 B": ((64, 64), {"all_gather": 1}),  # one call, two inputs
    "coalesced all_gather_into_tensor 2 x 32 B": ((64, 64), {"all_gather": 1}),
    "funcol all_gather coalesced 2 x 32 B": ((64, 64), {"all_gather": 1}),
    "funcol reduce_scatter coalesced 2 x 32 B": ((32, 32), {"reduce_scatter": 1}),
    "funcol all_reduce coalesced 2 x 32 B": ((64, 64), {"all_reduce": 1}),
}


@pytest.fixture(scope="module")
def counted():
    """Every call of `wire_ranks` counted on each of 2 ranks (one launch)."""
    return launch(wire_ranks.count_each, 2, timeout=60.0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_collective_is_priced_by_the_cost_model(counted, name):
    (sent0, sent1), calls = EXPECTED[name]
    assert (counted[0][name][0], counted[1][name][0]) == (sent0, sent1)
    if calls is None:  # send / recv: one send on rank 0, nothing on rank 1
        assert counted[0][name][1] == {"send_recv": 1} and counted[1][name][1] == {}
    else:
        assert counted[0][name][1] == counted[1][name][1] == calls
    assert counted[0][name][2] == counted[1][name][2] == {}


def test_a_collective_the_model_does_not_price_is_named_not_dropped(counted):
    """A broadcast moves bytes the cost model has no rule for: it is listed as not priced, and sends 0 in the total."""
    for rank in (0, 1):
        assert counted[rank]["broadcast"] == (0, {}, {"broadcast_": 1})


def test_nothing_is_counted_outside_the_wire(counted):
    assert counted[0]["outside"] == counted[1]["outside"] == (0, {}, {})


def _flash(q, k, v, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kwargs)


@pytest.mark.parametrize("rows,keys", [(5, 5), (3, 7), (7, 3)])
def test_sdpa_work_is_the_pairs_of_a_top_left_causal_block(rows, keys):
    """Query i sees keys 0..i (SDPA's is_causal), counted per query head of every batch entry, pair by pair."""
    q, k = torch.randn(2, 3, rows, 4), torch.randn(2, 3, keys, 4)  # (B, H, L, E), (B, H, S, E)
    tally = Tally()
    with Wire(tally):
        F.scaled_dot_product_attention(q, k, k, is_causal=True)
    by_hand = sum(min(i + 1, keys) for i in range(rows))
    assert causal_pairs(rows, keys) == by_hand
    assert tally.work == 2 * 3 * by_hand and tally.attended


def test_sdpa_work_counts_the_pairs_a_mask_lets_through_and_the_backward_not_at_all():
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    allowed = torch.rand(6, 6) < 0.5
    allowed[:, 0] = True  # every query sees a key
    for mask, kind in ((allowed, "bool"), (torch.zeros(6, 6).masked_fill(~allowed, float("-inf")), "additive")):
        tally = Tally()
        with Wire(tally):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
        assert tally.work == 2 * int(allowed.sum()), kind  # two heads, the forward only
    full = Tally()
    with Wire(full):
        _flash(q.detach(), q.detach(), q.detach())
    assert full.work == 2 * 6 * 6


@pytest.mark.parametrize("op", ["flash", "efficient", "cudnn"])
def test_the_gpu_fused_ops_are_counted_too(op):
    """The CUDA flash, efficient and cuDNN ops (on meta tensors: shapes only, no GPU): 2 heads of 5 causal rows."""
    q = torch.empty(1, 2, 5, 8, device="meta")
    ops = torch.ops.aten
    call = {"flash": lambda: ops._scaled_dot_product_flash_attention(q, q, q, 0.0, True),
            "efficient": lambda: ops._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True),
            "cudnn": lambda: ops._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, True, False)}[op]  # fmt: skip
    tally = Tally()
    with Wire(tally):
        call()
    assert tally.work == 2 * causal_pairs(5, 5) == 30


def test_sdpa_on_its_math_backend_is_counted_as_a_function_once():
    """GQA with a mask runs SDPA's math backend on a CPU (matmuls, no fused op): counted at the function; a fused
    op behind a function call is not counted twice (the causal test above)."""
    q, k = torch.randn(8, 6, 4), torch.randn(4, 6, 4)  # (Hq, L, E), (Hkv, S, E)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    tally = Tally()
    with Wire(tally):
        F.scaled_dot_product_attention(q, k, k, attn_mask=allowed, enable_gqa=True)
    assert tally.work == 8 * 21


def test_sdpa_is_not_counted_where_the_wire_is_told_the_work_comes_from_the_kernel():
    tally = Tally()
    with Wire(tally, attention=False):
        _flash(*(torch.randn(1, 2, 4, 4) for _ in range(3)))
    assert (tally.work, tally.attended) == (0, False)


def test_work_kernel_counts_the_kernels_exact_entries_times_query_heads():
    """cpref at P = 1 through the counting kernel: the sharding's exact work per head, times Hq."""
    cu = torch.tensor([0, 40, 100])
    sharding = cpref.Sharding(cu, cp_size=1, layout="contiguous")
    q, k = torch.randn(100, 8, 16), torch.randn(100, 4, 16)
    for window in ((-1, -1), (9, 0)):
        tally = Tally()
        run_attention(
            q, k, k, None, sharding, mode="p2p", kernels=[WorkKernel(cpref.TorchKernel(), tally)], window=window
        )
        assert tally.work == 8 * sharding.attention_work(0, exact=True, window=window)


def test_balance_is_the_largest_work_over_the_mean():
    ranks = [Tally(work=w, attended=True) for w in (30, 10)]
    assert balance(ranks) == 1.5
    assert balance([Tally(), Tally()]) is None  # nothing attended: not measured
    assert balance([Tally(work=0, attended=True), Tally(attended=True)]) == 1.0
    line = traffic_table([("x", "impl", [ranks])], limit=1.4).splitlines()[-1]
    assert "1.50 unbalanced" in line and "not measured" in traffic_table([("x", "impl", [[Tally()]])])


SETUP = Setup(docs=(256,))  # one document: PyTorch's ring takes no boundaries
MODES = build_cases(sorted(cpref.MODES), ["zigzag"], ["fp32"], cp=2, a2a_size=2)


@pytest.fixture(scope="module")
def side_by_side():
    """PyTorch's ring (contiguous and zigzag, fp32, CP 2) with cpref's p2p beside it, and cpref's four modes, in one
    launch of 2 processes."""
    ring = build_cases(["p2p"], ["contiguous", "zigzag"], ["fp32"], cp=2, impls=(IMPL,))
    return verify.run(ring + MODES, SETUP, nproc=2, timeout=60.0, progress=False)


def test_cprefs_modes_counted_on_gloo_move_what_the_simulated_cluster_traces(side_by_side):
    """The same call, forward and backward: bytes per rank at the dispatcher on gloo == the simulated trace's."""
    measured = {case.mode: group for case, (group,) in side_by_side.traffic if case.impl == "cpref"}
    assert sorted(measured) == sorted(cpref.MODES)
    for case in MODES:
        batch = make_batch(SETUP, case, 0)
        assert batch.q.dtype == torch.float32  # the case's dtype: the bytes of the same call
        _, cluster = run_attention(batch.q, batch.k, batch.v, batch.dout, batch.sharding, mode=case.mode,
                                   **dict(case.options))  # fmt: skip
        trace = summarize(cluster.trace)
        # TorchComm.split checks that the ranks split alike: an all-reduce of an int64 pair (16 bytes, 2 (P-1)/P of
        # them sent) the simulated split (0 bytes) does not make
        checks = 16 * trace.counts.get("split", 0)
        assert [t[0].sent for t in measured[case.mode]] == [trace.bytes_sent[r] + checks for r in range(2)], case.mode
        calls = {op: n for op, n in trace.counts.items() if op != "split"}
        if checks:
            calls["all_reduce"] = calls.get("all_reduce", 0) + trace.counts["split"]
        assert [dict(t[0].calls) for t in measured[case.mode]] == [calls] * 2, case.mode


def test_pytorchs_ring_beside_cpref_p2p_work_and_bytes(side_by_side):
    """Both attend the same pairs: contiguous puts the document's end on rank 1 (balance 24640 over the mean of
    8256 and 24640, 1.498...), zigzag none; at CP 2 PyTorch's ring (all-gathers, all-to-alls) sends as many bytes
    of K, V and their gradients as cpref's p2p (sends)."""
    ring = {case.layout: group for case, (group,) in side_by_side.traffic if case.impl == IMPL}
    triangle, square = 128 * 129 // 2, 128 * 128  # pairs of one rank's 128 queries, causal and full
    heads = SETUP.heads[0]
    for layout, expected in (("contiguous", [triangle, triangle + square]), ("zigzag", None)):
        impl, beside = [t[0] for t in ring[layout]], [t[1] for t in ring[layout]]
        assert [t.work for t in beside] == [t.work for t in impl]
        if expected:
            assert [t.work for t in impl] == [heads * w for w in expected]
            assert balance(impl) == pytest.approx(24640 / ((8256 + 24640) / 2))
        else:
            assert balance(impl) == balance(beside) == 1.0
        # cpref checks the ranks' arguments agree first: an all-gather of 18 int64 (144 bytes) a rank
        assert {t.sent for t in impl} == {512 * 1024} and {t.sent for t in beside} == {512 * 1024 + 144}
        assert set(impl[0].calls) == {"all_gather", "all_to_all"} and "send_recv" in beside[0].calls


def test_the_report_prints_the_peer_then_cpref_and_flags_contiguous(side_by_side):
    lines = traffic_table(side_by_side.traffic_rows()).splitlines()
    ring = [i for i, line in enumerate(lines) if line.startswith("p2p/contiguous/fp32/cp2 ")]
    assert len(ring) == 1 and "torch-ring" in lines[ring[0]] and "1.50 unbalanced" in lines[ring[0]]
    assert lines[ring[0] + 1].split()[:2] == ["cpref", "p2p"] and "512 KiB" in lines[ring[0] + 1]
    assert side_by_side.unbalanced(1.1) == [
        c.label for c, _ in side_by_side.traffic if c.impl == IMPL and c.layout == "contiguous"
    ]


def test_whole_documents_on_one_rank_are_flagged_and_the_balanced_layout_is_not():
    """The field's lost balance (a balancer that kept documents whole, #189902): cpref's stream layout over four
    documents puts the long one's end on rank 1, and the report flags it; the balanced layout (cuts the heaviest
    document in zigzag pairs) passes --balance's default, 1.10. cpref's work is counted at its kernel, exactly."""
    setup = Setup(docs=(300, 60, 40, 100))
    report = verify.run(build_cases(["p2p"], ["stream", "balanced"], ["fp32"], cp=2), setup, nproc=2, progress=False)
    worst = {case.layout: balance([t[0] for t in group]) for case, (group,) in report.traffic}
    sharding = {case.layout: make_batch(setup, case, 0).sharding for case, _ in report.traffic}
    for layout, b in worst.items():
        works = [sharding[layout].attention_work(r, exact=True) for r in range(2)]
        assert b == pytest.approx(max(works) / (sum(works) / 2))
    assert worst["stream"] > 1.1 >= worst["balanced"]
    assert report.unbalanced(1.1) == [c.label for c, _ in report.traffic if c.layout == "stream"]


def test_balance_fails_the_run_and_the_last_line_says_why(capsys):
    """`--balance`: the contiguous ring (1.50) fails the run, exit status 1, on the one line a CI job reads."""
    argv = ["--nproc", "2", "--peer", "torch-ring", "--docs", "256", "--no-progress"]
    assert main(argv + ["--layout", "zigzag", "--balance"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("verification passed: 2 of 2 rank rows pass")
    assert main(argv + ["--balance", "1.6"]) == 0  # 1.50 is within 1.6
    capsys.readouterr()
    assert main(argv + ["--balance"]) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("verification FAILED: 4 of 4 rank rows pass") and "1 case(s) above balance 1.1" in last


def test_the_summary_line_counts_and_worsts():
    rows = verify.run(build_cases(["p2p"], ["zigzag"], ["bf16"], cp=2), Setup(docs=(64,)), nproc=2, progress=False)
    line, status = summary(rows)
    worst = max(r.share for r in rows.rows)
    assert status == 0 and line == (f"verification passed: 2 of 2 rank rows pass, worst err/tol {worst:.2f}, "
                                    f"worst vs P=1 {max(r.ratio for r in rows.rows):.2f}")  # fmt: skip


def test_the_summary_line_without_ratios_with_failures_and_skips():
    """fp64 rows have no vs P=1 (the figure is left out); failures and skipped rows are counted where there are any;
    a run of skipped rows only fails."""
    from sim.tools.verify.table import Report, Row

    case = build_cases(["p2p"], ["zigzag"], ["fp64"], cp=2)[0]
    row = lambda status, share, errors=True: Row(case, 0, 0, 0, {"out": 1e-12} if errors else {}, 1e-9, 1e-12,
                                                 status, share=share)  # noqa: E731  # fmt: skip
    line, status = summary(Report([row("pass", 0.25), row("FAIL", 3.5), row("skipped", 0.0, errors=False)]))
    assert (line, status) == ("verification FAILED: 1 of 2 rank rows pass, 1 fail, 1 skipped, worst err/tol 3.50", 1)
    line, status = summary(Report([row("skipped", 0.0, errors=False)] * 2))
    assert status == 1 and line.startswith("verification FAILED: nothing verified, every case skipped (2 rank rows")


def test_forward_only_verifies_an_implementation_without_a_backward(capsys):
    """An output that requires no grad fails a normal run ("does not require grad") and passes --forward-only,
    where dq, dk and dv are not computed (shown as -) and the bytes are the forward's."""
    argv = ["--nproc", "2", "--impl", "tests.backends.verify_impls:no_backward", "--mode", "all_gather",
            "--layout", "zigzag", "--docs", "64,30", "--no-progress"]  # fmt: skip
    assert main(argv) == 1
    assert "(no backward run: out does not require grad on CP ranks 0, 1)" in capsys.readouterr().out
    assert main(argv + ["--forward-only"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("tests.backends.verify_impls:no_backward ")]
    assert len(rows) == 2 and all(r[-9:-6] == ["-", "-", "-"] and r[-1] == "pass" for r in rows), rows
    assert "(forward; sim.tools.verify.wire)" in out
