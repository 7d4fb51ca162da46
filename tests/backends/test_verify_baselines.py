"""`sim verify --impl` holds an implementation to its own attention without CP, and still catches CP faults (issue 42).

`tests.backends.verify_impls.blockwise` is a plain-torch CP attention, exact as CP but computing `q @ k^T` in the
input dtype, as most implementations written on torch do. Against cpref's kernel (float32 scores, the baseline
of every `--impl` row on the main this was filed against) its bf16 rows fail the `vs P=1` column with no CP fault
at all; against itself at CP size 1 (the default now) they pass, while each bug CP implementations really have
fails: a merge carried in bf16 across the ring's steps, a wrong lse correction, an off-by-one causal block, a
missing dK/dV reduction, a stale rank's K/V. One launch of 4 gloo processes runs them all (small documents, a
few seconds). Then `--nproc 1` (the implementation without CP against FP64), the fallback where an
implementation refuses one rank, a local attention named with `--baseline`, and the shipped peers' adapters.
"""

from __future__ import annotations

import pytest
import torch

from sim.tools import verify
from sim.tools.verify.cases import Case, Setup

IMPLS = "tests.backends.verify_impls"
SETUP = Setup(docs=(100, 250, 38))
BUGS = ["blockwise_bf16_merge", "blockwise_wrong_lse", "blockwise_off_by_one", "blockwise_no_dk_reduction",
        "blockwise_stale_kv"]  # fmt: skip


def rows(report, impl: str) -> list:
    return [r for r in report.rows if r.case.impl == f"{IMPLS}:{impl}"]


def test_exact_in_bf16_passes_against_itself_and_every_bug_fails():
    cases = [Case("all_gather", "zigzag", "bf16", 4, impl=f"{IMPLS}:{name}") for name in ["blockwise", *BUGS]]
    report = verify.run(cases, SETUP, nproc=4, timeout=120.0)
    exact = rows(report, "blockwise")
    assert all(r.ok and r.baseline == "impl" for r in exact), [(r.ratio, r.status) for r in exact]
    assert max(r.ratio for r in exact) < 1.8  # with a margin: the exact implementation is no near miss
    for name in BUGS[1:]:  # wrong on every rank, by far
        assert all(not r.ok and r.ratio > 10 for r in rows(report, name)), (name, [(r.ratio, r.status) for r in rows(report, name)])
    merge = rows(report, "blockwise_bf16_merge")  # within every fixed tolerance but one: only the ratio sees it
    assert sum(r.ratio > 2 for r in merge) >= 3 and all(r.errors["out"] < r.tol for r in merge)


def test_against_cprefs_kernel_an_exact_bf16_implementation_fails():
    """The symptom of the issue: held to cpref's float32-score kernel, an exact peer's bf16 rows fail."""
    case = Case("a2a", "stream", "bf16", 2, impl=f"{IMPLS}:blockwise")
    kernel = verify.run([case], Setup(docs=SETUP.docs, baseline="kernel"), nproc=2, timeout=60.0)
    itself = verify.run([case], SETUP, nproc=2, timeout=60.0)
    assert [r.baseline for r in kernel.rows] == ["kernel", "kernel"] and not kernel.ok
    assert itself.ok and max(r.ratio for r in itself.rows) < max(r.ratio for r in kernel.rows) / 1.5


def test_nproc_1_is_the_implementation_without_cp_against_fp64():
    report = verify.run([Case("all_gather", "zigzag", "bf16", 1, impl=f"{IMPLS}:blockwise")], SETUP, nproc=1,
                        timeout=60.0)  # fmt: skip
    (row,) = report.rows
    assert row.ok and row.baseline == "impl" and row.ratio == pytest.approx(1.0)  # the same computation, twice


def test_an_implementation_that_refuses_one_rank_falls_back_to_sdpa_or_a_named_local_attention(capsys):
    case = Case("all_gather", "zigzag", "fp32", 2, impl=f"{IMPLS}:raises_without_cp")
    report = verify.run([case], SETUP, nproc=2, timeout=60.0)
    assert report.ok and [r.baseline for r in report.rows] == ["sdpa", "sdpa"]
    assert "the implementation raised at CP size 1 (RuntimeError: needs at least two ranks); baseline sdpa" in report.rows[0].note
    assert "baseline" in report.format().splitlines()[0]  # the table shows what each row was held to
    named = Setup(docs=SETUP.docs, baseline=f"{IMPLS}:local_blockwise")
    report = verify.run([Case("all_gather", "zigzag", "bf16", 2, impl=f"{IMPLS}:raises_without_cp")], named, nproc=2,
                        timeout=60.0)  # fmt: skip
    assert report.ok and {r.baseline for r in report.rows} == {f"{IMPLS}:local_blockwise"}


def test_a_baseline_that_is_not_one_is_refused_before_any_process_starts(capsys):
    for bad, match in (("flash", "baseline must be auto, impl, sdpa, kernel or package.module:function"),
                       ("nowhere.mod:fn", "ModuleNotFoundError")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            verify.parse_args(["--baseline", bad])
        assert exit.value.code == 2 and match in capsys.readouterr().err


def test_deepspeeds_distributed_attention_verifies_on_packed_batches():
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[dev]' installs it)")
    cases = [Case("a2a", "stream", dtype, 2, padded=padded, impl="sim.tools.verify.peers:deepspeed_ulysses")
             for dtype in ("fp32", "bf16") for padded in (False, True)]  # fmt: skip
    report = verify.run(cases, SETUP, nproc=2, timeout=120.0)
    assert report.ok, report.format()
    assert {r.baseline for r in report.rows} == {"impl"}


def test_deepspeeds_adapter_refuses_a_layout_it_cannot_describe():
    from sim.tools.verify.peers import deepspeed_ulysses
    import cpref

    with pytest.raises(ValueError, match="run it with --layout stream"):
        deepspeed_ulysses(*[torch.zeros(4, 2, 8)] * 3, cpref.Sharding([0, 8], cp_size=2), process_group=None)


def test_yunchang_does_not_run_on_the_cpu_for_the_reason_the_docs_give():
    """sim.tools.verify.peers ships no yunchang adapter: its PyTorch backends call a flash op without a CPU kernel.
    Should a later yunchang or PyTorch run there, this fails, and the adapter is due."""
    pytest.importorskip("yunchang", reason="yunchang is not installed (pip install -e '.[dev]' installs it)")
    from yunchang.kernels.attention import pytorch_attn_forward

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention.*'CPU' backend"):
        pytorch_attn_forward(q, q, q, causal=True)
