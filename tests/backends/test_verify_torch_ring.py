"""PyTorch's own ring attention (`sim.tools.verify.peer_torch_ring`) through `sim verify`, and what it finds.

One launch of 2 gloo processes runs every case `make test` checks (one document of 256 tokens, CP 2): fp32, bf16,
fp16 and fp64 in the contiguous and zigzag layouts, causal and full, with PyTorch's defaults; bf16 and fp64 with
`convert_to_f32=False`; fp32 with `rotate="alltoall"`. The fp64 finding is shown again without CP, on a gloo world of
this one process against the FP64 oracle; the zigzag layout is checked against PyTorch's own head-tail balancer; the
cases the ring cannot run raise `NotImplementedError` before any communication. The figures of the page's section
(docs/verify-reference.md, "PyTorch's ring") are read back from it and re-measured: pass and fail
exactly, ratios to 0.05, errors to 25 %. `make test-all` adds CP 4, DP 2 x CP 2 (strided), CP 3, and the
failing fp16 row at two other seeds.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as pytorch_cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

import cpref
from sim import oracle
from sim.tools import verify
from sim.tools.verify.cases import Case, Setup, build_cases
from sim.tools.verify.peer_torch_ring import attention, pytorch_order, ring_options, unsupported

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "verify-reference.md"
IMPL = "sim.tools.verify.peer_torch_ring:attention"
EXACT = "convert_to_f32=False"  # --impl-option convert_to_f32=False: the merge and the backward's sums in the dtype
ALLTOALL = "rotate=alltoall"  # --impl-option rotate='alltoall' (PyTorch's set_rotate_method("alltoall"))
SETUP = Setup(docs=(256,))  # one document: Hq = 8, Hkv = 4, D = 32, seed 0
LAYOUTS = ("contiguous", "zigzag")


def cases(cp: int = 2, strided: bool = False) -> list[Case]:
    """The launch's cases (see the module docstring)."""
    out = []
    for causal in (True, False):
        out += build_cases(["p2p"], LAYOUTS, ("fp32", "bf16", "fp16", "fp64"), cp=cp, strided=strided, causal=causal,
                           impls=(IMPL,))  # fmt: skip
    out += build_cases(["p2p"], LAYOUTS, ("bf16", "fp64"), cp=cp, strided=strided, impls=(IMPL,),
                       impl_options={"convert_to_f32": False})  # fmt: skip
    return out + build_cases(["p2p"], LAYOUTS, ("fp32",), cp=cp, strided=strided, impls=(IMPL,),
                             impl_options={"rotate": "alltoall"})  # fmt: skip


def exact(case: Case) -> bool:
    """Whether the case runs the ring with `--impl-option convert_to_f32=False`."""
    return ("convert_to_f32", False) in case.impl_options


def rows_by_case(report) -> dict:
    """`{(impl or its option, layout, dtype, causal, world rank): row}`."""
    named = lambda c: "/".join(f"{k}={v}" for k, v in c.impl_options) or c.impl  # noqa: E731
    return {(named(r.case), r.case.layout, r.case.dtype, r.case.causal, r.rank): r for r in report.rows}


@pytest.fixture(scope="module")
def cp2():
    """Every case at CP 2, one launch of 2 processes."""
    return rows_by_case(verify.run(cases(), SETUP, nproc=2, timeout=60.0, progress=False))


def page_rows() -> dict[tuple, tuple[float, float, str]]:
    """The page's table under "PyTorch's ring" (its header starts `| ring option`):
    `{(impl, dtype, causal, layout, rank): (largest error, vs P=1, result)}`."""
    section = PAGE.read_text().split("## PyTorch's ring", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table and table[0].startswith("| ring option"), "the page's table is missing"
    rows = {}
    for line in table[2:]:
        option, dtype, mask, layout, rank, err, ratio, result = (c.strip(" `") for c in line.strip("|").split("|"))
        impl = {"default": IMPL, "convert_to_f32=False": EXACT}[option]
        rows[(impl, dtype, mask == "causal", layout, int(rank))] = (float(err), float(ratio), result)
    return rows


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_fp32_bf16_fp16_pass_at_cp2_in_both_layouts_causal_and_full(cp2, dtype):
    """Every row passes but the ones the page's table lists as failing (re-measured there)."""
    failing = {key for key, (_, _, result) in page_rows().items() if result == "FAIL"}
    rows = [row for (impl, _, dt, _, _), row in cp2.items() if impl == IMPL and dt == dtype]
    assert len(rows) == 2 * 2 * 2  # layouts x causal/full x ranks
    for r in rows:
        listed = (IMPL, dtype, r.case.causal, r.case.layout, r.rank) in failing
        assert r.ok != listed and r.baseline == "impl", (r.case.label, r.rank, r.status, r.ratio)


def test_rotate_alltoall_gives_the_allgather_result_bit_for_bit(cp2):
    """The rotation moves the same blocks another way: the same errors to the last bit, in both layouts."""
    for layout in LAYOUTS:
        for rank in (0, 1):
            assert cp2[(ALLTOALL, layout, "fp32", True, rank)].errors == cp2[(IMPL, layout, "fp32", True, rank)].errors


def test_fp64_comes_back_at_float32_accuracy_and_convert_to_f32_false_restores_it(cp2):
    """PyTorch's default merge (convert_to_f32=True) casts fp64 blocks to float32: every fp64 row fails, about 1e-7
    off (err/tol in the thousands); with convert_to_f32=False every row passes at fp64's own rounding."""
    for (impl, _, dtype, _, _), row in cp2.items():
        if dtype != "fp64":
            continue
        if impl == IMPL:
            assert not row.ok and 5e-8 < max(row.errors.values()) < 1e-6 and row.share > 1000, row
        else:
            assert impl == EXACT and row.ok and row.oracle < 1e-14, row


def test_the_pages_table(cp2):
    """The page's rows, re-measured: with convert_to_f32=False the bf16 merge runs in bf16 and the one rank that
    merges two blocks in the contiguous layout fails the vs P=1 column (held to the same ring at CP size 1, which
    merges nothing), where PyTorch's default passes it; and the one fp16 row that fails with the defaults."""
    rows = page_rows()
    assert len(rows) == 9
    for (impl, dtype, causal, layout, rank), (err, ratio, result) in rows.items():
        row = cp2[(impl, layout, dtype, causal, rank)]
        assert row.status == result, (impl, dtype, layout, rank, row)
        assert abs(row.ratio - ratio) <= 0.05, (impl, dtype, layout, rank, row.ratio)
        assert abs(max(row.errors.values()) / err - 1) <= 0.25, (impl, dtype, layout, rank, row.errors)
    assert cp2[(EXACT, "contiguous", "bf16", True, 1)].ratio > 2 > cp2[(IMPL, "contiguous", "bf16", True, 1)].ratio


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """A gloo world of this one process: PyTorch's ring at CP size 1, no CP at all."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("torch_ring") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp64_is_float32_with_no_cp_at_all(solo, causal):
    """THE FINDING, on one process against the FP64 oracle: PyTorch's ring returns fp64 at float32 accuracy (every
    entry of the output and the gradients a float32 number), and convert_to_f32=False gives fp64 back."""
    g = torch.Generator().manual_seed(0)
    T = 256
    q, k, v, dout = (torch.randn(T, h, 32, generator=g, dtype=torch.float64) for h in (8, 4, 4, 8))
    truth = oracle.forward_backward(q, k, v, torch.tensor([0, T]), dout, causal=causal)  # out, lse, dq, dk, dv
    sharding = cpref.Sharding([0, T], cp_size=1, layout="zigzag")
    before = vars(pytorch_cp._cp_options).copy()
    err = {}
    for f32 in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, sharding, process_group=solo, mode="p2p", causal=causal, convert_to_f32=f32)
        out.backward(dout)
        got = (out.detach(), *(t.grad for t in leaves))
        err[f32] = max((a - b).abs().max().item() for a, b in zip(got, (truth[0], *truth[2:])))
        as_f32 = all(torch.equal(t, t.float().double()) for t in got)
        assert out.dtype == torch.float64 and as_f32 == f32  # rounded through float32 exactly where it merges there
    assert 1e-8 < err[True] < 1e-6 and err[False] < 1e-14, err
    assert vars(pytorch_cp._cp_options) == before  # PyTorch's global options as the adapter found them


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_zigzag_over_one_document_is_pytorchs_head_tail_order(P):
    """cpref's zigzag over one document is PyTorch's `_HeadTailLoadBalancer` order (and its contiguous layout
    PyTorch's unbalanced chunks), so the adapter hands PyTorch's ring shards in the order it expects."""
    T = 16 * P
    head_tail = _HeadTailLoadBalancer(T, P, "cpu")._generate_indices()[0].long().view(P, T // P)  # (P, T / P)
    for layout, expected in (("zigzag", head_tail), ("contiguous", torch.arange(T).view(P, -1))):
        sharding = cpref.Sharding([0, T], cp_size=P, layout=layout)
        held = torch.stack([sharding.global_index(r) for r in range(P)])  # (P, T / P)
        assert torch.equal(held, expected), layout
    assert torch.equal(pytorch_order(T, P, head_tail=True), head_tail)


ONE = cpref.Sharding([0, 64], cp_size=2, layout="zigzag")
UNSUPPORTED = {  # what the call holds -> (sharding, call keywords, the reason's words)
    "several documents": (cpref.Sharding([0, 24, 64], cp_size=2, layout="zigzag"), {}, "one document"),
    "padding": (cpref.Sharding.eod_padded([0, 62], cp_size=2, layout="zigzag"), {}, "no padding mask"),
    "a window": (ONE, {"window": (15, 0)}, "no sliding window"),
    "a mask": (ONE, {"mask": cpref.Mask.prefix_lm(torch.tensor([0, 64]), [32])}, "takes no mask"),
    "soft-capping": (ONE, {"softcap": 30.0}, "no softcap"),
    "sinks": (ONE, {"sinks": torch.zeros(8)}, "no sinks"),
    "chunks": (ONE, {"chunk": 16}, "no chunk"),
}


@pytest.mark.parametrize("given", list(UNSUPPORTED))
def test_unsupported_cases_raise_before_any_communication(given):
    """Each case the ring cannot run raises NotImplementedError naming why, before touching the process group (here
    not a group at all: any use of it would raise something else)."""
    sharding, call, words = UNSUPPORTED[given]
    q = torch.randn(32, 8, 16)
    k = torch.randn(32, 4, 16)
    with pytest.raises(NotImplementedError, match=words):
        attention(q, k, k, sharding, process_group=object(), mode="p2p", **call)


def test_other_orders_dtypes_and_devices_are_refused_with_the_reason():
    shuffled = SimpleNamespace(cu_seqlens=(0, 8), cu_seqlens_padded=(0, 8), mask=None, cp_size=2, total=8,
                               layout="mine", global_index=lambda r: torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]][r]))  # fmt: skip
    assert "neither of PyTorch's orders" in unsupported(shuffled, torch.float32)
    assert "dtype torch.int32" in unsupported(ONE, torch.int32)
    assert "device cuda" in unsupported(ONE, torch.float32, "cuda")
    assert unsupported(cpref.Sharding([0, 64], cp_size=2, layout="stream"), torch.float16) == ""  # contiguous order


def test_options_ring_ones_read_verifier_ones_ignored_unknown_ones_refused_by_name():
    assert ring_options({}) == ring_options({"convert_to_f32": True, "rotate": "allgather"})  # PyTorch's defaults
    assert ring_options({"a2a_size": 2, "head_groups": 1, "convert_to_f32": "false"}).convert_to_f32 is False
    assert ring_options({"rotate": "alltoall"}).rotate == "alltoall"
    for options, words in (({"rotate": "ring"}, "rotate='ring'"), ({"convert_to_f32": "maybe"}, "convert_to_f32"),
                           ({"load_balance": True}, "no option load_balance")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            ring_options(options)


@pytest.mark.full
def test_cp4_and_dp2_x_cp2_strided_pass():
    """CP 4, and DP 2 x CP 2 on the non-consecutive groups {0, 2} and {1, 3}: with PyTorch's defaults fp32, bf16, fp16
    pass (but CP group 0's repeat of the page's fp16 row: the same batch); fp64 fails at float32 accuracy and passes
    with convert_to_f32=False, as at CP 2."""
    report = verify.run(cases(4) + cases(2, strided=True), SETUP, nproc=4, timeout=120.0, progress=False)
    page_fp16 = lambda r: (r.case.dtype, r.case.causal, r.case.layout, r.case.cp, r.dp, r.cp_rank) == (  # noqa: E731
        "fp16", False, "zigzag", 2, 0, 0)
    assert all(r.ok != page_fp16(r) for r in report.rows if not exact(r.case) and r.case.dtype != "fp64")
    assert all(r.ok == exact(r.case) for r in report.rows if r.case.dtype == "fp64")


@pytest.mark.full
def test_cp3_passes():
    rows = rows_by_case(verify.run(cases(3), Setup(docs=(252,)), nproc=3, timeout=120.0, progress=False))
    assert all(r.ok for r in rows.values() if r.case.dtype != "fp64" and not exact(r.case))


@pytest.mark.full
@pytest.mark.parametrize("seed", [1, 2])
def test_fp16_full_zigzag_passes_at_other_seeds(seed):
    """The page's one failing fp16 row (seed 0) passes at seeds 1 and 2: at most 1.53."""
    report = verify.run(build_cases(["p2p"], ["zigzag"], ["fp16"], cp=2, causal=False, impls=(IMPL,)),
                        Setup(docs=(256,), seed=seed), nproc=2, timeout=60.0, progress=False)  # fmt: skip
    assert report.ok and max(r.ratio for r in report.rows) <= 1.53 + 0.05, [(r.rank, r.ratio) for r in report.rows]
