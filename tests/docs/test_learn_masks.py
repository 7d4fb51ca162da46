"""Learn CP page 12, "Masks under CP" (`docs/learn/masks.md`): its example runs, and says what the page says.

The page shows the example's output and draws its figures from the example's values (`docs/learn_masks.py`).
These tests hold each sentence of the page that states a fact to the run: the kinds' alignment, each rank's work
from the slices against the pairs the kernel computed in a real run, zigzag's balance under each mask, and the
traffic table against the simulated cluster's trace, run again through the harness the mode tests use.
"""

from __future__ import annotations

import contextlib
import io
import runpy

import pytest
import torch

import cpref
from sim.cluster.harness import CountingKernel, run_attention, trace_split

LAYOUTS = ("zigzag", "stream")


@pytest.fixture(scope="module")
def example():
    """The example's globals and what it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        names = runpy.run_module("examples.learn.masks", run_name="__main__")
    return names, buffer.getvalue()


def ratio(w: list[int]) -> float:
    return max(w) * len(w) / sum(w)


def test_each_kind_is_drawn_as_its_definition_says(example):
    """The page's table: causal j <= i + Lk - Lq (bottom-right), inv_causal j >= i (top-left), bi_causal both."""
    names, text = example
    Lq, Lk = names["Lq"], names["Lk"]
    assert Lq != Lk
    rule = {"full": lambda i, j: True, "causal": lambda i, j: j <= i + Lk - Lq, "inv_causal": lambda i, j: j >= i,
            "bi_causal": lambda i, j: i <= j <= i + Lk - Lq}  # fmt: skip
    drawn = {line.split(":")[0].strip(): line.split(":")[1].split() for line in text.splitlines()[:4]}
    assert list(drawn) == list(names["KINDS"])
    for kind, rows in drawn.items():
        assert rows == ["".join(".x"[rule[kind](i, j)] for j in range(Lk)) for i in range(Lq)], kind
    # the text's claims: a band Lk - Lq + 1 wide, empty when Lq > Lk; a causal slice's first rows see nothing then
    tall = cpref.Mask.from_slices([(0, Lk, 0, Lq, "bi_causal")], total=Lk).dense()[:Lk, :Lq]
    assert not tall.any()
    causal = cpref.Mask.from_slices([(0, Lk, 0, Lq, "causal")], total=Lk).dense()[:Lk, :Lq]
    assert not causal[: Lk - Lq].any() and causal[Lk - Lq :].any(1).all()


def test_the_prefix_lm_is_a_full_prompt_and_a_causal_rectangle_below_it_per_document(example):
    names, _ = example
    lengths = names["SMALL"]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    want = []
    for a, b in zip(cu, cu[1:]):
        n = (b - a) // 2
        want += [(a, a + n, a, a + n, "full"), (a + n, b, a, b, "causal")]
    assert names["masks"](lengths, window=3)["prefix-LM"].slices == tuple(want)


def test_every_mask_is_the_union_of_its_slices_and_the_window_is_window_s_mask(example):
    names, _ = example
    from sim.oracle import slice_mask, visibility_mask

    for name, mask in names["masks"](names["SMALL"], window=3).items():
        dense = slice_mask(mask.slices, mask.total)
        assert torch.equal(dense, mask.dense()) and int(dense.sum()) == mask.visible_pairs(), name
    cu = torch.tensor([0, *torch.tensor(names["SMALL"]).cumsum(0).tolist()])
    window = names["masks"](names["SMALL"], window=3)["window"]
    assert torch.equal(window.dense(), visibility_mask(cu, window=(3, 0)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_each_ranks_work_from_the_slices_is_what_the_kernel_computed(example, layout):
    """The page: in p2p a rank computes exactly its rows' pairs; in a2a every rank's work is equal under any mask."""
    names, _ = example
    P, cu, works = names["P"], names["cu"], names["works"]
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
    q, k, v = (torch.randn(cu[-1], h, 8, dtype=torch.float64) for h in (4, 4, 4))
    for name, mask in names["MASKS"].items():
        for mode in ("p2p", "a2a"):
            kernels = [CountingKernel() for _ in range(P)]
            run_attention(q, k, v, None, sharding, mode=mode, mask=mask, kernels=kernels)
            got = [kernel.forward_work() for kernel in kernels]
            want = works[name, layout] if mode == "p2p" else [mask.visible_pairs()] * P  # a2a: every row, H/P heads
            assert got == want, (name, mode)


def test_zigzag_balances_causal_documents_and_the_shared_prompt_not_every_mask(example):
    names, text = example
    works = names["works"]
    assert ratio(works["causal documents", "zigzag"]) == 1.0 < 1.5 < ratio(works["causal documents", "contiguous"])
    assert ratio(works["shared prompt", "zigzag"]) == 1.0
    for name in ("prefix-LM", "image spans", "window"):
        assert ratio(works[name, "zigzag"]) > 1.05, name
    prefix, window = works["prefix-LM", "zigzag"], works["window", "zigzag"]
    assert prefix[0] == max(prefix) and window[0] == min(window)  # the front chunks: heaviest, lightest
    for (name, layout), w in works.items():  # the printed lines are these values
        assert f"{name:>16} {layout:>10}: {w}, slowest / mean {ratio(w):.2f}" in text


def test_the_layout_balanced_by_each_mask_is_within_five_percent(example):
    """The page: balanced by the mask, every mask of the batch within 5% of the mean (the prefix-LM, the spans and the
    window, which zigzag misses, included), and the works are the kernel's."""
    names, _ = example
    P, cu, works = names["P"], names["cu"], names["works"]
    q, k, v = (torch.randn(cu[-1], 4, 8, dtype=torch.float64) for _ in range(3))
    for name, mask in names["MASKS"].items():
        assert ratio(works[name, "by mask"]) <= 1.05, name
        sharding = cpref.Sharding(cu, cp_size=P, layout="balanced", mask=mask)
        kernels = [CountingKernel() for _ in range(P)]
        run_attention(q, k, v, None, sharding, mode="p2p", mask=mask, kernels=kernels)
        assert [kernel.forward_work() for kernel in kernels] == works[name, "by mask"], name


def test_the_table_is_the_trace_run_again(example):
    """Every cell: the bytes each rank sent, forward + backward, as the harness reads them from a new run's trace;
    and the printed table shows them in KiB."""
    names, text = example
    P, cu, moved, shown = names["P"], names["cu"], names["moved"], names["SHOWN"]
    q, k, v = names["q"], names["k"], names["v"]
    dout = torch.randn(cu[-1], q.shape[1], v.shape[2]).bfloat16()
    for layout in LAYOUTS:
        sharding = cpref.Sharding(cu, cp_size=P, layout=layout)
        for mode in cpref.MODES:
            for name, mask in shown.items():
                _, cluster = run_attention(q, k, v, dout, sharding, mode=mode, mask=mask,
                                           between=lambda comm: comm.barrier(), **cpref.MODES[mode].example_options(P))
                got = [sum(half[0] for half in trace_split(cluster.trace, r)) for r in range(P)]
                assert got == moved[layout, mode, name], (layout, mode, name)
            row = next(line for line in text.splitlines() if line.split()[:2] == [layout, mode])
            assert row.split()[2:] == [f"{min(c) / 1024:g}" + ("" if min(c) == max(c) else f"-{max(c) / 1024:g}")
                                       for c in (moved[layout, mode, name] for name in shown)]  # fmt: skip


def test_what_the_page_says_each_mode_moves(example):
    names, _ = example
    P, cu, moved, shown = names["P"], names["cu"], names["moved"], list(names["SHOWN"])
    k, v = names["k"], names["v"]
    busiest = {key: max(val) for key, val in moved.items()}
    masked = shown[1:]
    # zigzag: every mask moves what the causal documents move, in every mode
    for mode in cpref.MODES:
        assert {busiest["zigzag", mode, name] for name in masked} == {busiest["zigzag", mode, "causal"]}, mode
    # without a mask the ring's dK/dV travel one float32 block more (p2p; a2a+p2p's ring across its groups)
    block = cu[-1] // P * k.shape[1] * (k.shape[2] + v.shape[2]) * 4  # a2a+p2p: a2a_size x the rows, / a2a_size heads
    for mode, extra in (("p2p", block), ("a2a+p2p", block), ("all_gather", 0), ("a2a", 0)):
        assert busiest["zigzag", mode, "no mask"] - busiest["zigzag", mode, "causal"] == extra, mode
    # a2a moves heads: the same under every mask and layout
    assert len({busiest[layout, "a2a", name] for layout in LAYOUTS for name in shown}) == 1
    # stream: only what is read across the cuts; prompts and images that straddle one read forward, answers
    # read their prompt wherever it is
    for mode in ("p2p", "all_gather"):
        got = {name: busiest["stream", mode, name] for name in shown}
        assert got["no mask"] == got["causal"] < got["prefix-LM"] and got["causal"] < got["spans"], mode
        assert got["shared"] > 2 * got["causal"] and got["shared"] > max(got["prefix-LM"], got["spans"]), mode
        assert got["causal"] < busiest["zigzag", mode, "causal"] / 2, mode
    assert len({busiest["stream", "a2a+p2p", name] for name in shown}) == 1


def test_the_figures_draw_the_examples_values():
    figures = pytest.importorskip("docs.figures")
    learn_masks = pytest.importorskip("docs.learn_masks")
    for path, draw in learn_masks.FIGURES.items():
        fig = draw()
        figures.check_readable(fig, path)
        figures.plt.close(fig)
