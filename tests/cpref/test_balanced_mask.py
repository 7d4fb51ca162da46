"""The `balanced` layout given a mask (`cpref.batch.balanced_mask`): a partition of the padded stream with
exactly `T / P` tokens a rank, whose per-rank mask work is within the tolerance of the mean where zigzag's is not;
the Sharding that carries the mask (validation, equality, cache, pickling, the ranks' comparison); and attention
without a mask on such a sharding (issue 57).

The bugs these catch: a block handed to two ranks or to none, a rank over its room, the work of a block counted on
padding rows, pieces of one document left unmerged or out of stream order, a sharding balanced by one mask reusing
the plan of another (a stale cache entry), ranks balanced by different masks running on silently.
"""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.base.errors import CPInputError
from cpref.batch.balanced_mask import TOLERANCE, _assign, _whole_and_fill
from cpref.batch.mask_union import KINDS
from tests.cp.conftest import oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs


def long_tailed(seed: int, docs: int = 60) -> list[int]:
    """A pack of documents whose lengths follow a long tail (a few long, many short), as pretraining data does."""
    rng = random.Random(seed)
    lengths = [min(3000, max(2, int(rng.paretovariate(1.2) * 40))) for _ in range(docs)]
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def pack_masks(cu: list[int], seed: int) -> dict[str, cpref.Mask]:
    """The masks of the issue over one pack: prompts of random lengths, an image span in every document of 4
    tokens or more, shared-prompt groups of a prompt and two answers."""
    rng, lengths = random.Random(seed), [b - a for a, b in zip(cu, cu[1:])]
    groups = [(lengths[i], lengths[i + 1 : i + 3]) for i in range(0, len(lengths) - 2, 3)]
    return {
        "prefix_lm": cpref.Mask.prefix_lm(cu, [rng.randint(0, n) for n in lengths]),
        "spans": cpref.Mask.bidirectional_spans(cu, [(a + (b - a) // 4, a + (b - a) // 2)
                                                     for a, b in zip(cu, cu[1:]) if b - a >= 4]),  # fmt: skip
        "shared_prompt": cpref.Mask.shared_prompt(groups),
    }


def imbalance(sharding: cpref.Sharding, mask: cpref.Mask) -> float:
    """The busiest rank's mask work over the mean."""
    work = [sharding.attention_work(r, mask=mask) for r in range(sharding.cp_size)]
    return max(work) * sharding.cp_size / sum(work)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_the_mask_balanced_layout_is_within_the_tolerance_where_zigzag_is_not(P, seed, capsys):
    """On long-tailed packs under prefix-LM, image spans and shared prompts: the busiest rank does at most
    (1 + TOLERANCE) the mean of the mask's work (the issue asks 1.05), printed beside zigzag's and the causal
    `balanced` layout's, which balance causal documents and miss it here (the largest of them over all three masks
    is asserted beyond 1.05, which is why the layout exists)."""
    cu, worst_other = long_tailed(seed), 1.0
    for name, mask in pack_masks(cu, seed).items():
        total = mask.total
        cu_m = [c for c in cu if c <= total]
        ours = imbalance(cpref.Sharding.eod_padded(cu_m, cp_size=P, layout="balanced", mask=mask), mask)
        others = {layout: imbalance(cpref.Sharding.eod_padded(cu_m, cp_size=P, layout=layout), mask)
                  for layout in ("zigzag", "balanced")}  # fmt: skip
        with capsys.disabled():
            print(f"\n{name} P={P} seed {seed}: max/mean by the mask {ours:.3f}, zigzag {others['zigzag']:.3f}, "
                  f"causal balanced {others['balanced']:.3f}", end="")  # fmt: skip
        assert ours <= 1 + TOLERANCE, name
        worst_other = max(worst_other, *others.values())
    if P == 8:
        assert worst_other > 1.05


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    T, P = cu[-1], draw(st.integers(2, 8))
    slices = []
    for _ in range(draw(st.integers(1, 6))):
        q0, k0 = draw(st.integers(0, T - 1)), draw(st.integers(0, T - 1))
        q1, k1 = draw(st.integers(q0 + 1, T)), draw(st.integers(k0 + 1, T))
        slices.append((q0, q1, k0, k1, draw(st.sampled_from(KINDS))))
    return cu, P, cpref.Mask.from_slices(slices, T)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_every_padded_token_is_on_exactly_one_rank_and_every_rank_holds_its_share(batch):
    """The plan is a partition of the padded stream into `T / P` tokens a rank, in stream order, merged, inside
    documents; the ranks' mask work sums to the mask's visible pairs (no pair lost, none counted twice, none on
    padding), and no smaller block size would have been tried had a larger one balanced."""
    cu, P, mask = batch
    sharding = cpref.Sharding.eod_padded(cu, cp_size=P, layout="balanced", mask=mask)
    b, seen = sharding.bounds, []
    for r in range(P):
        pieces = sharding.local_chunks(r)
        assert sum(e - s for _, s, e in pieces) == sharding.local_tokens
        assert [s for _, s, _ in pieces] == sorted(s for _, s, _ in pieces)
        for (d0, _, e0), (d1, s1, _) in zip(pieces, pieces[1:]):
            assert not (d0 == d1 and e0 == s1), "adjacent pieces of one document not merged"
        for doc, s, e in pieces:
            assert b.padded[doc] <= s < e <= b.padded[doc + 1]
        seen += sharding.global_index(r).tolist()
    assert sorted(seen) == list(range(b.total))
    assert sum(sharding.attention_work(r, mask=mask) for r in range(P)) == mask.visible_pairs()


def test_the_plan_cuts_the_fewest_heaviest_documents_that_balance_and_keeps_the_rest_whole():
    """Steps 1 to 3: the plan is that of the smallest pool (the c heaviest documents by the mask's work) whose
    fill balances; only pooled documents are cut, and the pool is shared out in at most two runs a rank."""
    lengths = [5 + (7 * i) % 9 for i in range(30)] + [90, 60]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mask = cpref.Mask.prefix_lm(cu, [n // 2 for n in lengths])
    P = 4
    sharding = cpref.Sharding.eod_padded(cu, cp_size=P, layout="balanced", mask=mask)
    b, T_l = sharding.bounds, sharding.local_tokens
    work = b.pad(mask.visible_per_row(), value=0)
    docs = [int(work[a:e].sum()) for a, e in zip(b.padded, b.padded[1:])]
    order, cap = sorted(range(len(docs)), key=lambda i: (-docs[i], i)), (1 + TOLERANCE) * sum(docs) / P
    plans = {c: _whole_and_fill(b, P, T_l, work, order[:c], order[c:]) for c in range(len(docs) + 1)}
    first = next(c for c in range(len(docs) + 1) if max(plans[c][1]) <= cap)
    assert [sharding.attention_work(r, mask=mask) for r in range(P)] == plans[first][1]
    assert 0 < first < len(docs) // 4  # a few documents cut, most whole
    holders = {}
    for r in range(P):
        for doc, _, _ in sharding.local_chunks(r):
            holders.setdefault(doc, set()).add(r)
    cut = {doc for doc, ranks in holders.items() if len(ranks) > 1}
    pooled = set(order[:first]) | {doc for r in range(P) for doc, *_ in plans[first][0][r]} - {
        doc for r in range(P) for doc, a, e in plans[first][0][r] if (a, e) == (b.padded[doc], b.padded[doc + 1])}
    assert cut <= pooled and len(cut) <= first + P


def test_blocks_balance_where_no_pool_does():
    """Step 4: a mask whose heavy rows sit in one document's first half; no pool balances two ranks (the pool's
    ends are its document's ends), blocks of the halved size do."""
    from cpref.batch.balanced_mask import block_sizes

    mask = cpref.Mask.from_slices([(0, 40, 0, 40, "full"), (40, 80, 40, 80, "bi_causal")], 80)
    sharding = cpref.Sharding([0, 80], cp_size=2, layout="balanced", mask=mask)
    b = sharding.bounds
    prefix = [0, *torch.cumsum(b.pad(mask.visible_per_row(), value=0), 0).tolist()]
    work = [sharding.attention_work(r, mask=mask) for r in range(2)]
    assert max(work) <= (1 + TOLERANCE) * sum(work) / 2
    assert max(work) == max(_assign(b, 2, 40, prefix, next(g for g in block_sizes(40) if max(_assign(
        b, 2, 40, prefix, g)[1]) <= (1 + TOLERANCE) * sum(work) / 2))[1])


def test_a_mask_that_cannot_be_balanced_gives_its_least_busy_busiest_rank():
    """One query sees 100 keys, the others none: no layout can split a row, so the busiest rank does all of it;
    the plan is still a partition, and `attention_work` says so."""
    mask = cpref.Mask.from_slices([(0, 1, 0, 100, "full")], 100)
    sharding = cpref.Sharding([0, 100], cp_size=2, layout="balanced", mask=mask)
    assert sorted(sharding.attention_work(r, mask=mask) for r in range(2)) == [0, 100]
    assert sorted(sharding.global_index(0).tolist() + sharding.global_index(1).tolist()) == list(range(100))


def test_the_sharding_carries_its_mask_its_cache_entry_and_its_comparison():
    cu = [0, 13, 40, 57]
    m1, m2 = cpref.Mask.prefix_lm(cu, [5, 0, 17]), cpref.Mask.bidirectional_spans(cu, [(2, 9)])
    s1 = cpref.Sharding.eod_padded(cu, cp_size=2, layout="balanced", mask=m1)
    again = cpref.Sharding.eod_padded(cu, cp_size=2, layout="balanced", mask=m1)
    s2 = cpref.Sharding.eod_padded(cu, cp_size=2, layout="balanced", mask=m2)
    plain = cpref.Sharding.eod_padded(cu, cp_size=2, layout="balanced")
    assert s1 == again and s1.entry is again.entry and s1.mask is m1 and plain.mask is None
    assert s1 != s2 and s1.entry is not s2.entry and s1 != plain and s1.entry is not plain.entry
    assert pickle.loads(pickle.dumps(s1)) == s1
    assert "mask=Mask([(0, 5, 0, 5, 'full')" in repr(s1)


@pytest.mark.parametrize("given, words", [
    ({"layout": "zigzag"}, "mask= balances the 'balanced' layout's work, but layout='zigzag'"),
    ({"mask": "prefix"}, "mask is str, not a cpref.Mask"),
    ({"mask": cpref.Mask.causal_documents([0, 4, 9])}, "the mask is over a batch of 9 tokens, this batch has 57"),
])  # fmt: skip
def test_a_bad_balancing_mask_is_refused_naming_the_fix(given, words):
    arguments = {"cp_size": 2, "layout": "balanced", "mask": cpref.Mask.prefix_lm([0, 13, 40, 57], [5, 0, 17])}
    with pytest.raises(CPInputError) as err:
        cpref.Sharding.eod_padded([0, 13, 40, 57], **{**arguments, **given})
    assert words in str(err.value)


@pytest.mark.parametrize("mode", sorted(cpref.MODES))
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_attention_without_a_mask_on_a_mask_balanced_sharding_is_the_oracle(mode, window):
    """A model's other layers (causal, windowed) run on the tokens placed by the mask: every mode's unmasked
    path takes the plan's pieces as it takes balanced's (many pieces a rank, several of one document)."""
    cu = [0, 13, 40, 57, 60, 91]
    mask = cpref.Mask.shared_prompt([(13, [27, 17]), (3, [31])])
    sharding = cpref.Sharding.eod_padded(cu, cp_size=4, layout="balanced", mask=mask)
    assert max(len(sharding.local_chunks(r)) for r in range(4)) > 1
    q, k, v, dout = (sharding.pad(t) for t in attention_inputs(91, (4, 4, 8, 8), seed=2))
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, window=window, **cpref.MODES[mode].example_options(4))
    want = oracle_shards(q, k, v, dout, sharding, window=window)
    for r in range(4):
        for i in range(4):
            assert_close(results[r][i], want[r][i], torch.float64, msg=f"{mode} rank {r} output {i}")


def test_ranks_balanced_by_different_masks_are_named_on_every_rank():
    """Two ranks whose shardings were balanced by different masks hold different tokens: the comparison's
    `layout's mask` column names them before any communication."""
    from sim.cluster.simcluster import SimCluster

    cu = [0, 13, 40, 57]
    masks = [cpref.Mask.prefix_lm(cu, [5, 0, 17]), cpref.Mask.bidirectional_spans(cu, [(2, 9)])]
    q, k, v, _ = attention_inputs(57, (4, 4, 8, 8))

    def rank_fn(comm):
        sharding = cpref.Sharding.eod_padded(cu, cp_size=2, layout="balanced", mask=masks[comm.rank])
        shards = [sharding.shard(sharding.pad(t), comm.rank) for t in (q, k, v)]
        with pytest.raises(CPInputError) as err:
            cpref.attention(*shards, sharding, comm=comm, mode="p2p")
        return str(err.value)

    messages = SimCluster(2).run(rank_fn)
    assert messages[0] == messages[1] and "  layout's mask: rank 0: digest" in messages[0]
