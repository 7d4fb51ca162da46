"""`cpref.attention(..., mask=)` in every mode and layout against the FP64 oracle, rank by rank; the kernel's work
and the ring's and all-gather's traffic counted against the mask itself, token by token (issue 57).

The masks: a prefix-LM per document, image spans inside causal documents, shared-prompt groups (a mask across
document boundaries), a causal window written as slices, and random slices of all four kinds, overlapping. The
bugs these catch: a slice cut at the wrong row of a chunk (an off-by-one shift), a bottom-right diagonal taken
top-left, a row seeing two key runs counted once (a lost layer), a key row read but not sent (the halo), a
padding row taken for a token, a sink added in two of a row's calls.
"""

from __future__ import annotations

import random

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.batch.mask_union import KINDS
from cpref.modes.costs import halo_costs
from sim.cluster.harness import CountingKernel, trace_split
from sim.oracle import slice_mask
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths

LENGTHS = [13, 27, 17, 9, 31, 6]  # padded per layout by Sharding.eod_padded
CU = cu_from_lengths(LENGTHS)
T = sum(LENGTHS)
HEADS = (4, 2, 8, 6)  # (Hq, Hkv, D, Dv): GQA and MLA; a2a at P = 4 replicates the key/value heads
NAMES = ("out", "dq", "dk", "dv")


def random_slices(seed: int, n: int = 6) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q0, k0 = rng.randrange(T), rng.randrange(T)
        out.append((q0, rng.randint(q0 + 1, min(T, q0 + 30)), k0, rng.randint(k0 + 1, min(T, k0 + 30)), rng.choice(KINDS)))
    return out


def window_slices(left: int) -> list[tuple]:
    out = []
    for a, b in zip(CU.tolist(), CU.tolist()[1:]):
        w = min(left + 1, b - a)
        out += [(a, a + w, a, a + w, "causal")] + ([(a + w, b, a + w - left, b, "bi_causal")] if b - a > w else [])
    return out


MASKS = {
    "prefix_lm": lambda: cpref.Mask.prefix_lm(CU, [5, 0, 17, 3, 12, 6]),
    "spans": lambda: cpref.Mask.bidirectional_spans(CU, [(2, 9), (20, 33), (45, 50), (70, 85)]),
    "shared_prompt": lambda: cpref.Mask.shared_prompt([(10, [8, 9, 5]), (7, [6, 12]), (16, [12, 18])]),
    "window": lambda: cpref.Mask.from_slices(window_slices(4), T),
    "random": lambda: cpref.Mask.from_slices(random_slices(3), T),
}
MODES = sorted(cpref.MODES)


def options(mode: str, P: int) -> dict:
    """What the mode runs with at P (a2a+p2p: a2a_size 2 at even P, 1 at P = 1)."""
    return cpref.MODES[mode].example_options(P)


LAYOUTS = (*cpref.LAYOUTS, "balanced by the mask")  # the last: Sharding(..., layout="balanced", mask=mask)


def sharding_for(mask: cpref.Mask, P: int, layout: str, cu: torch.Tensor = CU) -> cpref.Sharding:
    by_mask = layout == "balanced by the mask"
    return cpref.Sharding.eod_padded(cu, cp_size=P, layout="balanced" if by_mask else layout, mask=mask if by_mask else None)


def real_index(sharding: cpref.Sharding, rank: int) -> torch.Tensor:
    """Each of the rank's rows' real token, -1 for padding: `(T / P,)`."""
    return sharding.pad(torch.arange(sharding.cu_seqlens[-1]), value=-1)[sharding.global_index(rank)]


@pytest.mark.sweep
@pytest.mark.parametrize("variant", ["plain", "sinks", "softcap"])
@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_mode_and_layout_under_a_mask_is_the_oracle_rank_by_rank(name, mode, layout, P, variant):
    mask = MASKS[name]()
    sharding = sharding_for(mask, P, layout)
    heads = HEADS if P < 8 else (8, 2, 8, 6)  # Ulysses at P = 8 splits 8 query heads
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, heads, seed=7))
    sinks = torch.tensor([3.0, -1.0, 0.5, 20.0, -4.0, 1.0, 0.0, 7.0][: heads[0]], dtype=torch.float64)
    extra = {"sinks": sinks} if variant == "sinks" else \
        {"softcap": 2.0} if variant == "softcap" else {}  # fmt: skip
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, mask=mask, **options(mode, P), **extra)
    oracle = {key: (val.double() if isinstance(val, torch.Tensor) else val) for key, val in extra.items()}
    want = oracle_shards(q, k, v, dout, sharding, mask=mask.dense(), **oracle)
    for r in range(P):
        for i, n in enumerate(NAMES):
            assert_close(results[r][i], want[r][i], torch.float64, msg=f"{name} {mode} {layout} P={P} rank {r} {n}")
    if variant == "sinks":
        from sim.cluster.harness import oracle_padded

        dsinks = oracle_padded(q, k, v, dout, sharding, mask=mask.dense(), **oracle)[4]
        assert_close(sum(res[4] for res in results), dsinks, torch.float64, msg="dsinks")


@pytest.mark.sweep
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MASKS))
def test_the_kernel_computes_exactly_the_pairs_the_mask_shows(name, mode, layout):
    """Per rank, the forward calls' work (exact pairs per head) is the mask's pairs of the rows the rank computes:
    its own rows (all_gather, p2p: `sharding.attention_work(r, mask=)`), every row (a2a: all heads' split), its a2a
    group's rows (a2a+p2p)."""
    P, mask = 4, MASKS[name]()
    sharding = sharding_for(mask, P, layout)
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, HEADS))
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, None, sharding, mode=mode, mask=mask, kernels=kernels, **options(mode, P))
    per_row = mask.dense().sum(1)  # (T,): the keys each query sees
    for r, kernel in enumerate(kernels):
        rows = {"a2a": range(P), "a2a+p2p": range(r // 2 * 2, r // 2 * 2 + 2)}.get(mode, [r])
        real = torch.cat([real_index(sharding, s) for s in rows])
        assert kernel.forward_work() == int(per_row[real[real >= 0]].sum()), f"rank {r}"
        if mode in ("p2p", "all_gather"):
            assert kernel.forward_work() == sharding.attention_work(r, mask=mask), f"rank {r}"


SHORT = [5 + (7 * i) % 9 for i in range(30)]  # many short documents: most stay on one rank under stream, balanced
SHORT_CU = cu_from_lengths(SHORT)
SHORT_MASKS = {
    "prefix_lm": lambda: cpref.Mask.prefix_lm(SHORT_CU, [n // 2 for n in SHORT]),
    "spans": lambda: cpref.Mask.bidirectional_spans(SHORT_CU, [(a + 1, a + 3) for a in SHORT_CU[:-1].tolist()]),
    "shared_prompt": lambda: cpref.Mask.shared_prompt([(SHORT[i], [SHORT[i + 1], SHORT[i + 2]]) for i in range(0, 30, 3)]),
}


def reads(mask: cpref.Mask, sharding: cpref.Sharding, reader: int, owner: int) -> set[int]:
    """The rows of `owner`'s shard whose token some query of `reader` sees under the mask (the oracle's matrix)."""
    dense, mine, theirs = mask.dense(), real_index(sharding, reader), real_index(sharding, owner)
    seen = dense[mine[mine >= 0]].any(0)  # (T,): the tokens the reader's queries see
    return {row for row, token in enumerate(theirs.tolist()) if token >= 0 and bool(seen[token])}


@pytest.mark.parametrize("layout", ["stream", "balanced", "zigzag", "balanced by the mask"])
@pytest.mark.parametrize("name", sorted(SHORT_MASKS))
def test_the_ring_sends_each_block_only_the_rows_its_reader_sees(name, layout):
    """p2p under a mask, many short documents: at each distance d where some rank reads a key of the block d ranks
    back, one shift of the most rows any block sends there (`R_d`, from the oracle's matrix); nothing else travels.
    Backward: the shifts again and the dK/dV of those rows home. Far less than the classic ring's P - 1 blocks."""
    P, mask = 4, SHORT_MASKS[name]()
    sharding = sharding_for(mask, P, layout, SHORT_CU)
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(sum(SHORT), HEADS))
    _, cluster = run_cp(q, k, v, dout, sharding, mode="p2p", mask=mask, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    sizes = {d: max(len(reads(mask, sharding, (s + d) % P, s)) for s in range(P)) for d in range(1, P)}
    shifts = (0, *(d for d, n in sizes.items() if n))
    want = halo_costs(tuple(sizes.get(d, 0) for d in shifts), HEADS, HEADS[1], torch.float64)
    full = halo_costs((0, *(sharding.local_tokens,) * (P - 1)), HEADS, HEADS[1], torch.float64)  # the classic ring
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), f"rank {r}"
        assert fwd_ops == dict(want.forward_ops) and bwd_ops == dict(want.backward_ops), f"rank {r}"
    if layout in ("stream", "balanced") and name != "shared_prompt":  # documents kept whole: little travels
        assert want.forward_bytes < full.forward_bytes / 4


@pytest.mark.parametrize("layout", ["stream", "balanced", "zigzag", "balanced by the mask"])
@pytest.mark.parametrize("name", sorted(SHORT_MASKS))
def test_the_all_gather_moves_only_the_rows_another_rank_sees(name, layout):
    """all_gather under a mask, many short documents: each rank contributes the rows of its shard another rank's
    queries see, padded to the most of any rank (m, from the oracle's matrix): (P - 1) m rows of K and V forward,
    again backward with their float32 dK/dV reduce-scattered; where documents stay whole, a fraction of a shard."""
    from cpref.api import mode_costs

    P, mask = 4, SHORT_MASKS[name]()
    sharding = sharding_for(mask, P, layout, SHORT_CU)
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(sum(SHORT), HEADS))
    _, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", mask=mask, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    m = max(len(set().union(*(reads(mask, sharding, r, s) for r in range(P) if r != s))) for s in range(P))
    want = mode_costs("all_gather", P=P, local_tokens=sharding.local_tokens, heads=HEADS, dtype=torch.float64,
                      selected_kv_rows=0, halo_sizes=None, gathered_rows=m)  # fmt: skip
    if layout in ("stream", "balanced") and name != "shared_prompt":  # documents kept whole: little travels
        assert 0 < m < sharding.local_tokens / 4
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert (fwd, bwd) == (want.forward_bytes, want.backward_bytes), f"rank {r}"
        assert fwd_ops == dict(want.forward_ops) and bwd_ops == dict(want.backward_ops), f"rank {r}"


def test_a_causal_documents_mask_is_the_default_call_bit_for_bit_and_makes_its_one_call():
    """`Mask.causal_documents(cu)` is what `cpref.attention` does without a mask: the same bits at P = 1, and one
    kernel call each way (a causal document over its own rows is one sequence of one call)."""
    sharding = cpref.Sharding(CU, cp_size=1)
    q, k, v, dout = attention_inputs(T, HEADS)
    kernels = [CountingKernel()]
    plain, _ = run_cp(q, k, v, dout, sharding, mode="p2p")
    masked, _ = run_cp(q, k, v, dout, sharding, mode="p2p", mask=cpref.Mask.causal_documents(CU), kernels=kernels)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], masked[0]))
    assert (kernels[0].forward_calls, kernels[0].backward_calls) == (1, 1)


@pytest.mark.parametrize("given, words", [
    ({"causal": False}, "mask= replaces causal, window and chunk, but causal=False was given"),
    ({"window": (3, 0)}, "window=(3, 0) was given too"),
    ({"chunk": 8}, "chunk=8 was given too"),
    ({"mask": "causal"}, "mask is str, not a cpref.Mask"),
    ({"mask": cpref.Mask.causal_documents([0, 4, 9])}, "the mask is over a batch of 9 tokens, this batch has 103"),
    ({"mask": cpref.Mask.from_slices([(0, 4, 100, 104, "full")])}, "the mask reaches token 103, past this batch of 103"),
    ({"overlap": True}, "overlap=True does not run a mask"),
])  # fmt: skip
def test_a_bad_mask_is_refused_on_every_rank_before_any_communication(given, words):
    sharding = cpref.Sharding.eod_padded(CU, cp_size=2, layout="zigzag")
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, HEADS))
    arguments = {"mask": MASKS["prefix_lm"](), **given}
    with pytest.raises(CPInputError) as err:
        run_cp(q, k, v, dout, sharding, mode="all_gather", **arguments)
    assert words in str(err.value)


def test_ranks_with_different_masks_are_named_on_every_rank():
    from sim.cluster.simcluster import SimCluster

    sharding = cpref.Sharding.eod_padded(CU, cp_size=2, layout="zigzag")
    q, k, v, _ = (sharding.pad(t) for t in attention_inputs(T, HEADS))
    masks = [MASKS["prefix_lm"](), MASKS["spans"]()]

    def rank_fn(comm):
        shards = [sharding.shard(t, comm.rank) for t in (q, k, v)]
        with pytest.raises(CPInputError) as err:
            cpref.attention(*shards, sharding, comm=comm, mode="p2p", mask=masks[comm.rank])
        return str(err.value)

    messages = SimCluster(2).run(rank_fn)
    assert messages[0] == messages[1] and "  mask: rank 0: digest" in messages[0]


def test_slice_mask_is_the_dense_matrix_the_tests_compare_with():
    """The oracle's matrix of a mask is the kinds' definitions of its slices (the tests above use `mask.dense()`)."""
    for build in MASKS.values():
        mask = build()
        assert torch.equal(mask.dense(), slice_mask(mask.slices, T))


@pytest.mark.parametrize("mode, opts", [("a2a", {"head_groups": 2}), ("a2a+p2p", {"a2a_size": 2, "head_groups": 2}),
                                        ("all_gather", {"save_gathered_kv": True})])  # fmt: skip
@pytest.mark.parametrize("name", ["shared_prompt", "random"])
def test_the_modes_options_run_under_a_mask(mode, opts, name):
    """Ulysses' pipelined head groups (in a2a and in a2a+p2p) and all-gather's kept K/V under a mask: the oracle's."""
    P, mask = 4, MASKS[name]()
    sharding = cpref.Sharding.eod_padded(CU, cp_size=P, layout="zigzag")
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, (8, 8, 8, 6), seed=3))  # 2 KV heads a rank at P = 4
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, mask=mask, **opts)
    want = oracle_shards(q, k, v, dout, sharding, mask=mask.dense())
    for r in range(P):
        for i, n in enumerate(NAMES):
            assert_close(results[r][i], want[r][i], torch.float64, msg=f"{mode} {opts} rank {r} {n}")


@pytest.mark.sweep
@pytest.mark.parametrize("logits", [1, 30], ids=["x1", "x30"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["prefix_lm", "shared_prompt", "random"])
def test_under_a_mask_every_mode_is_within_twice_the_error_of_the_kernel_without_cp(name, mode, dtype, logits):
    """fp32 and bf16 at logits x1 and x30: every rank's out, dq, dk, dv at P = 2 and 4, zigzag, over three batches,
    at most twice as far from the FP64 oracle as the same kernel at P = 1 under the same mask (the `vs P=1`
    criterion, `sim.tools.verify.truth.precision_ratio`); cross-rank sums rounded as NCCL rounds them."""
    from sim.cluster.simcluster import SimCluster
    from sim.tools.verify.truth import RATIO_LIMIT, precision_ratio

    mask = MASKS[name]()
    for P in (2, 4):
        sharding = cpref.Sharding.eod_padded(CU, cp_size=P, layout="zigzag")
        whole = cpref.Sharding.eod_padded(CU, cp_size=1, layout="zigzag")
        got, plain, truth = ([[] for _ in NAMES] for _ in range(3))
        for seed in range(3):
            q, k, v, dout = attention_inputs(T, HEADS, seed=seed)
            q, k, v = (t * logits**0.5 for t in (q, k, v))
            q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
            results, _ = run_cp(*(sharding.pad(t) for t in (q, k, v, dout)), sharding, mode=mode, mask=mask,
                                cluster=SimCluster(P, timeout=30.0, reduction="native"), **options(mode, P))  # fmt: skip
            alone, _ = run_cp(q, k, v, dout, whole, mode="p2p", mask=mask)
            want = oracle_shards(*(t.double() for t in (q, k, v, dout)), whole, mask=mask.dense())[0]
            for i in range(len(NAMES)):
                got[i].append(sharding.unpad(sharding.unshard([results[r][i] for r in range(P)])))
                plain[i].append(alone[0][i])
                truth[i].append(want[i])
        ratios = {n: precision_ratio(g, p, t, dtype) for n, g, p, t in zip(NAMES, got, plain, truth)}
        assert max(ratios.values()) <= RATIO_LIMIT, f"{name} {mode} P = {P}: CP error / P = 1 error {ratios}"


def chunk_slices(chunk: int) -> list[tuple]:
    """Chunked attention written as slices: in each document, causal inside every run of `chunk` positions."""
    bounds = CU.tolist()
    return [(s, min(s + chunk, b), s, min(s + chunk, b), "causal") for a, b in zip(bounds, bounds[1:])
            for s in range(a, b, chunk)]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("written, given", [(lambda: window_slices(4), {"window": (4, 0)}),
                                            (lambda: chunk_slices(8), {"chunk": 8})], ids=["window", "chunk"])
def test_a_window_or_chunks_written_as_slices_are_window_and_chunk(mode, written, given):
    """Windows and chunks are masks too: the mask of their slices gives what `window=` and `chunk=` give, every
    rank's output and gradients, at P = 4 in zigzag."""
    P = 4
    sharding = cpref.Sharding.eod_padded(CU, cp_size=P, layout="zigzag")
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, HEADS, seed=5))
    masked, _ = run_cp(q, k, v, dout, sharding, mode=mode, mask=cpref.Mask.from_slices(written(), T), **options(mode, P))
    plain, _ = run_cp(q, k, v, dout, sharding, mode=mode, **given, **options(mode, P))
    for r in range(P):
        for i, n in enumerate(NAMES):
            assert_close(masked[r][i], plain[r][i], torch.float64, msg=f"{mode} rank {r} {n}")


def test_a_mask_plan_is_built_once_per_sharding_and_mask():
    """The plan is cached per (sharding, mask): a second call with an equal mask builds nothing, another mask does."""
    sharding = cpref.Sharding.eod_padded(CU, cp_size=2, layout="zigzag")
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(T, HEADS))
    run_cp(q, k, v, dout, sharding, mode="p2p", mask=MASKS["spans"]())
    before = cpref.cache_info().misses
    run_cp(q, k, v, dout, sharding, mode="p2p", mask=MASKS["spans"]())  # an equal mask, built again
    assert cpref.cache_info().misses == before
    run_cp(q, k, v, dout, sharding, mode="p2p", mask=MASKS["prefix_lm"]())
    assert cpref.cache_info().misses > before
