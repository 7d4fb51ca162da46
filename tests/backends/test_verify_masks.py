"""`python -m sim verify --mask`: every case under masks built from its documents (issue 57), rank by rank on gloo.

Two launches of 2 processes: cpref itself passes every mask in every mode (zigzag, padded); an `--impl` that takes
`mask=` and runs causal documents instead (accelerate #4177: a mask silently replaced by `is_causal=True`) fails
every row by errors of order 1, an exact plain-torch implementation reading `mask.slices` passes, and one without a
`mask` parameter is skipped with a note. The rest needs no process: the flag's parsing and refusals, the masks made
of the documents, and the ground truth and the baselines under a mask against the dense oracle.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.batch.mask_union import KINDS
from sim.cluster.harness import oracle_padded
from sim.tools import verify
from sim.tools.verify import cases_from_args, parse_args
from sim.tools.verify.baselines import eager, packed_sdpa
from sim.tools.verify.cases import Case, Setup, case_mask, lengths, make_batch
from sim.tools.verify.masks import MASKS, blocks, mask_of, masked_oracle, random_slices
from sim.tools.verify.rank import mask_call
from tests.backends.verify_impls import visible

MODES = sorted(cpref.MODES)
SMALL = ["--docs", "24,56,16", "--timeout", "30", "--no-progress"]
IMPLS = "tests.backends.verify_impls"
SETUP = Setup(docs=(24, 56, 16))


def table(out: str) -> tuple[list[str], list[list[str]]]:
    """The table's header and its rows, split on whitespace."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] in (["mode", "layout"], ["impl", "mode"]))
    rows = [line.split() for line in lines[head + 2 :] if line and not line[0].isdigit() and not line.startswith(" ")]
    return lines[head].split(), [row for row in rows if row[-1] in ("pass", "FAIL")]


def test_cpref_passes_every_mask_in_every_mode(capsys):
    """cpref on 2 gloo ranks, every mode, zigzag with padding, fp32: every mask passes on every rank, the table has a
    `mask` column, the opening line names the masks, and the random mask's slices are printed with its seed."""
    argv = ["--nproc", "2", "--mode", "all", "--layout", "zigzag", "--padded", "--mask", "all", *SMALL]
    assert verify.main(argv) == 0
    out = capsys.readouterr().out
    assert "mask prefix-lm,spans,shared-prompt,random, seed 0;" in out
    head, rows = table(out)
    assert head[:5] == ["mode", "layout", "dtype", "pad", "mask"]
    assert len(rows) == len(MODES) * len(MASKS) * 2 and all(row[-1] == "pass" for row in rows), out
    masks = [row[5] if row[1] == "a2a_size=2" else row[4] for row in rows]  # a2a+p2p's option takes a column
    assert sorted(set(masks)) == sorted(MASKS) and {row[0] for row in rows} == set(MODES)
    real = lengths(SETUP, Case("p2p", "zigzag", "fp32", cp=2, padded=True))[0]  # 23, 55, 15
    assert f"zigzag cp2 pad T={sum(real)}: {random_slices(0, sum(real))}" in out


def test_an_impl_that_ignores_the_mask_fails_one_that_reads_it_passes_one_without_it_is_skipped(capsys):
    """p2p on 2 gloo ranks, padded, fp32: `ignores_mask` (takes mask=, runs causal documents) fails every row under
    every mask, by errors of order 1 under prefix-lm and spans (held to itself at CP size 1, its `vs P=1` is 1: the
    fixed tolerance against the masked truth catches it); `blockwise_masked` passes; `takes_no_mask` is skipped."""
    argv = ["--nproc", "2", "--mode", "p2p", "--layout", "zigzag", "--padded", "--mask", "all", *SMALL,
            "--impl", f"{IMPLS}:blockwise_masked", "--impl", f"{IMPLS}:ignores_mask", "--impl", f"{IMPLS}:takes_no_mask"]  # fmt: skip
    assert verify.main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"note: --mask all: --impl {IMPLS}:takes_no_mask skipped (does not take mask=): 4 case(s);")
    head, rows = table(out)
    assert head[:7] == ["impl", "mode", "layout", "dtype", "pad", "mask", "baseline"]
    assert len(rows) == 2 * len(MASKS) * 2 and not any(row[0].endswith("takes_no_mask") for row in rows)
    for row in rows:  # impl mode layout dtype pad mask baseline cp rank dp r out dq dk dv tol err/tol vs-P=1 (2) oracle
        impl, out_err, tol, ratio = row[0].split(":")[1], float(row[11]), float(row[15]), row[17]
        assert (float(row[16]) <= 1) == (row[-1] == "pass"), row
        assert row[-1] == ("pass" if impl == "blockwise_masked" else "FAIL"), row
        if impl == "ignores_mask":  # its run at CP size 1 drops the mask too: only the tolerance sees it
            assert out_err > 0.5 and tol == 1e-5 and ratio == "1.00", row


@pytest.mark.parametrize("argv, message", [
    (["--mask", "causal-lm"], "mask ['causal-lm'] unknown; choose from prefix-lm, spans, shared-prompt, random or all"),
    (["--mask", ""], "mask '' unknown; choose from prefix-lm, spans, shared-prompt, random or all"),
    (["--mask", "spans", "--no-causal"], "--mask spans with --no-causal: a mask replaces causal, window and chunk"),
    (["--mask", "random", "--window", "7,0"], "--mask random with --window 7,0: a mask replaces causal, window"),
    (["--mask", "all", "--chunk", "16"], "--mask all with --chunk 16: a mask replaces causal, window and chunk"),
    (["--mask", "spans", "--baseline", f"{IMPLS}:takes_no_mask"], f"--baseline {IMPLS}:takes_no_mask does not take mask="),
])  # fmt: skip
def test_a_bad_mask_flag_is_refused_naming_the_valid_ones(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        verify.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_mode_that_cannot_run_a_mask_is_refused_before_any_process(capsys):
    """cpref's own refusal (`check_mode(..., mask=True)`), as the ranks would give it, in one line with status 2."""
    assert verify.main(["--mask", "spans", "--mode", "all_gather", "--option", "overlap=True", "--docs", "64"]) == 2
    assert "mode='all_gather' with overlap=True does not run a mask" in capsys.readouterr().err


def test_mask_makes_a_case_per_mask_and_none_without_it():
    args = parse_args(["--mask", "prefix-lm,shared-prompt", "--layout", "zigzag", "--mode", "p2p"])
    assert [(c.mask, c.label) for c in cases_from_args(args, world=2)] == [
        ("prefix-lm", "p2p/zigzag/fp32/cp2/mask=prefix-lm"), ("shared-prompt", "p2p/zigzag/fp32/cp2/mask=shared-prompt")]
    assert {c.mask for c in cases_from_args(parse_args([]), world=2)} == {None}  # default: today's cases
    with pytest.raises(ValueError, match="mask spans with a window: a mask replaces causal, window and chunk"):
        Case("p2p", "zigzag", "fp32", cp=2, window=(3, 0), mask="spans")


def test_every_call_gets_the_mask_and_keeps_causal_and_window_s_defaults():
    """What the ranks' calls (and the run without CP) receive under `--mask`: `mask=` the `cpref.Mask`, `causal` and
    `window` as `cpref.attention` reads them under a mask (their defaults); without `--mask`, no `mask` at all."""
    case = Case("p2p", "zigzag", "fp32", cp=2, padded=True, mask="spans")
    assert mask_call(SETUP, case) == {"mode": "p2p", "causal": True, "window": (-1, -1), "mask": case_mask(SETUP, case)}
    assert "mask" not in mask_call(SETUP, Case("p2p", "zigzag", "fp32", cp=2))


def test_an_impl_without_mask_alone_is_refused_and_run_refuses_it_before_any_process(capsys):
    assert verify.main(["--mask", "spans", "--mode", "p2p", "--impl", f"{IMPLS}:takes_no_mask"]) == 2
    out, err = capsys.readouterr()
    assert "skipped (does not take mask=)" in out and "no case left to run, every --impl skipped" in err
    with pytest.raises(ValueError, match=f"--impl {IMPLS}:takes_no_mask does not take mask="):
        verify.run([Case("p2p", "zigzag", "fp32", cp=2, impl=f"{IMPLS}:takes_no_mask", mask="spans")], SETUP)


def test_the_masks_are_made_of_the_case_s_documents():
    real = (23, 55, 15)
    cu = [0, 23, 78, 93]
    assert mask_of("prefix-lm", real, 0) == cpref.Mask.prefix_lm(cu, [11, 27, 7])  # a prompt per document
    assert mask_of("spans", real, 0) == cpref.Mask.bidirectional_spans(cu, [(5, 11), (36, 50), (81, 85)])
    shared = mask_of("shared-prompt", real, 0)  # the first document the prompt, the others its answers
    assert shared == cpref.Mask.shared_prompt([(23, [55, 15])])
    assert any(k1 <= 23 < q0 for q0, q1, k0, k1, _ in shared.slices)  # across document boundaries
    drawn = random_slices(5, 93)
    assert mask_of("random", real, 5) == cpref.Mask.from_slices(drawn, 93) and drawn == random_slices(5, 93)
    assert drawn != random_slices(6, 93) and sorted(s[4] for s in drawn) == sorted(KINDS * 2)  # 8: 2 of each kind
    overlap = lambda a, b: a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]  # noqa: E731
    assert all(overlap(drawn[i - 1], drawn[i]) for i in range(1, len(drawn), 2))
    assert mask_of("shared-prompt", (9,), 0) == cpref.Mask.shared_prompt([(4, [5])])  # one document: halves
    case = Case("a2a", "zigzag", "fp32", cp=2, padded=True, mask="random")  # every process builds the same
    assert case_mask(Setup(docs=(24, 56, 16), seed=5), case) == mask_of("random", real, 5)


@pytest.mark.parametrize("mask", MASKS)
def test_the_truth_and_the_baselines_under_a_mask_are_the_dense_oracle(mask):
    """`masked_oracle` (one block of `blocks` at a time) equals the oracle over the whole padded batch under the mask's
    matrix, with sinks and soft-capping; SDPA and eager attention (the fallback baselines) and the docs' `visible`
    take the mask, in float64."""
    case = Case("p2p", "zigzag", "fp64", cp=2, padded=True, mask=mask)
    batch, m = make_batch(SETUP, case, 0), case_mask(SETUP, case)
    sinks = torch.tensor([3.0, -1.0, 0.5, 20.0, 0.0, 1.0, -2.0, 4.0], dtype=torch.float64)
    got = masked_oracle(batch, m, sinks=sinks, softcap=5.0)
    want = oracle_padded(batch.q, batch.k, batch.v, batch.dout, batch.sharding, mask=m.dense(), sinks=sinks, softcap=5.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    assert all(b[1] <= a[0] for a, b in zip(blocks(m)[1:], blocks(m)))  # disjoint, in order
    plain = masked_oracle(batch, m)[0]  # (T, Hq, D)
    for local in (packed_sdpa, eager):
        torch.testing.assert_close(local(batch.q, batch.k, batch.v, batch.sharding, mask=m), plain, atol=1e-12, rtol=1e-12)
    token = batch.sharding.pad(torch.arange(batch.sharding.cu_seqlens[-1]), value=-1)
    dense = visible(m, batch.sharding)
    assert torch.equal(dense[token >= 0][:, token >= 0], m.dense()) and not dense[token < 0].any()


@pytest.mark.full
def test_deepspeeds_adapter_passes_every_mask():
    """DeepSpeed-Ulysses' adapter gives the mask to its local SDPA (the whole stream): every mask passes, padded, fp32."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[dev]' installs it)")
    cases = [Case("a2a", "stream", "fp32", 2, padded=True, impl="sim.tools.verify.peers:deepspeed_ulysses", mask=m)
             for m in MASKS]  # fmt: skip
    report = verify.run(cases, Setup(docs=(24, 56, 16, 40)), nproc=2, timeout=120.0)
    assert report.ok and len(report.rows) == 2 * len(MASKS), report.format()
