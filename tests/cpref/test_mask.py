"""`cpref.Mask`: slices of four kinds, their union normalised, the constructors users write, and bad input.

The reference is `sim.oracle.slice_mask`, the kinds' definitions read pair by pair; cpref's normal form
(`cpref.batch.mask_union`) must hold exactly its pairs, with none covered twice.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref import CPInputError, Mask
from cpref.batch import mask as mask_module
from cpref.batch.mask_union import KINDS
from sim.oracle import slice_mask, visibility_mask


@st.composite
def slices_st(draw, most_tokens: int = 24, most_slices: int = 5):
    T = draw(st.integers(1, most_tokens))
    out = []
    for _ in range(draw(st.integers(1, most_slices))):
        q0, k0 = draw(st.integers(0, T - 1)), draw(st.integers(0, T - 1))
        q1, k1 = draw(st.integers(q0 + 1, T)), draw(st.integers(k0 + 1, T))
        out.append((q0, q1, k0, k1, draw(st.sampled_from(KINDS))))
    return T, out


def coverage(slices, T) -> torch.Tensor:
    """How many of `slices` show each pair."""
    return sum((slice_mask([s], T).int() for s in slices), torch.zeros(T, T, dtype=torch.int32))


@settings(max_examples=400, deadline=None)
@given(slices_st())
def test_the_normal_form_holds_exactly_the_union_of_the_slices_with_no_pair_twice(case):
    T, given_slices = case
    mask = Mask.from_slices(given_slices, T)
    want = slice_mask(given_slices, T)
    assert torch.equal(coverage(mask.slices, T), want.int())  # every pair once, no other pair
    assert torch.equal(mask.dense(), want)
    assert mask.visible_pairs() == int(want.sum())
    assert list(mask.slices) == sorted(mask.slices)  # in row order
    for q0, q1, k0, k1, kind in mask.slices:  # every row of a normalised slice sees a key
        assert kind in KINDS and 0 <= q0 < q1 <= T and 0 <= k0 < k1 <= T
        assert slice_mask([(q0, q1, k0, k1, kind)], T)[q0:q1].any(dim=1).all()


@settings(max_examples=200, deadline=None)
@given(slices_st())
def test_a_dense_mask_read_row_by_row_gives_the_same_pairs_and_the_normal_form_is_stable(case):
    T, given_slices = case
    dense = slice_mask(given_slices, T)
    from_dense = Mask.from_dense(dense)
    assert torch.equal(coverage(from_dense.slices, T), dense.int())
    if from_dense.slices:  # (slices that show no pair give an empty mask)
        assert Mask.from_slices(given_slices, T) == from_dense  # the normal form is the pairs', however given
        assert Mask.from_slices(from_dense.slices, T) == from_dense  # and a fixed point


DOCS = [0, 7, 19, 20, 33]


@pytest.mark.parametrize("mask", [
    Mask.causal_documents(DOCS),
    Mask.prefix_lm(DOCS, prefix_lengths=[3, 0, 1, 13]),
    Mask.bidirectional_spans(DOCS, spans=[(2, 5), (8, 9), (12, 19), (25, 30)]),
    Mask.shared_prompt([(4, [3, 5, 2]), (2, [6])]),
], ids=["causal", "prefix_lm", "spans", "shared_prompt"])  # fmt: skip
def test_a_constructors_mask_read_back_from_its_dense_matrix_or_its_mask_mod_is_the_same_mask(mask, monkeypatch):
    """The normal form does not depend on how the mask was given: its slices, its dense matrix read row by row, or
    a FlexAttention mask_mod over it (evaluated three rows at a time here, to cross blocks)."""
    assert Mask.from_dense(mask.dense()) == mask
    monkeypatch.setattr(mask_module, "_BLOCK_ELEMENTS", 3 * mask.total)
    dense = mask.dense()
    assert Mask.from_mask_mod(lambda b, h, q, kv: dense[q, kv], mask.total) == mask


def test_the_constructors_slices_are_the_masks_they_name():
    # a slice of one row is written full (every kind shows the same there)
    assert Mask.causal_documents(DOCS).slices == ((0, 7, 0, 7, "causal"), (7, 19, 7, 19, "causal"),
                                                   (19, 20, 19, 20, "full"), (20, 33, 20, 33, "causal"))  # fmt: skip
    # a prefix of 3 (full), then causal over the whole document; a prefix of 0 is causal; one of the whole is full
    assert Mask.prefix_lm(DOCS, [3, 0, 1, 13]).slices == (
        (0, 3, 0, 3, "full"), (3, 7, 0, 7, "causal"), (7, 19, 7, 19, "causal"), (19, 20, 19, 20, "full"),
        (20, 33, 20, 33, "full"))  # fmt: skip
    # a span: causal before it, the span sees the document up to its end, causal after it
    assert Mask.bidirectional_spans([0, 12], [(4, 8)]).slices == (
        (0, 4, 0, 4, "causal"), (4, 8, 0, 8, "full"), (8, 12, 0, 12, "causal"))  # fmt: skip
    # two groups: each answer sees its group's prompt and itself; the first answer follows its prompt (one causal)
    assert Mask.shared_prompt([(2, [2, 1]), (1, [1])]).slices == (
        (0, 4, 0, 4, "causal"), (4, 5, 0, 2, "full"), (4, 5, 4, 5, "full"), (5, 7, 5, 7, "causal"))  # fmt: skip


@pytest.mark.parametrize("left", [0, 1, 3, 6, 40])
def test_a_window_written_as_slices_is_the_mask_of_window(left):
    """A causal window of `left + 1` keys: a causal slice over a document's first rows, a bi_causal band below."""
    slices = []
    for a, b in zip(DOCS, DOCS[1:]):
        w = min(left + 1, b - a)  # rows that see the document's start
        slices += [(a, a + w, a, a + w, "causal")] + ([(a + w, b, a + w - left, b, "bi_causal")] if b - a > w else [])
    mask, want = Mask.from_slices(slices, DOCS[-1]), visibility_mask(torch.tensor(DOCS), causal=True, window=(left, 0))
    assert torch.equal(mask.dense(), want) and mask == Mask.from_dense(want)


def test_a_windowed_document_normalises_to_the_slices_one_would_write():
    assert Mask.from_dense(visibility_mask(torch.tensor([0, 12]), causal=True, window=(3, 0))).slices == (
        (0, 4, 0, 4, "causal"), (4, 12, 1, 12, "bi_causal"))  # fmt: skip
    # window=(0, 0): every token sees itself, across the documents too: one diagonal
    assert Mask.from_dense(visibility_mask(torch.tensor(DOCS), causal=True, window=(0, 0))).slices == (
        (0, 33, 0, 33, "bi_causal"),)  # fmt: skip


def test_chunks_written_as_slices_are_the_mask_of_chunk():
    C, slices = 4, []
    for a, b in zip(DOCS, DOCS[1:]):
        slices += [(s, min(s + C, b), s, min(s + C, b), "causal") for s in range(a, b, C)]
    assert torch.equal(Mask.from_slices(slices).dense(), visibility_mask(torch.tensor(DOCS), chunk=C))


def test_a_mask_of_many_documents_is_one_slice_each():
    cu = [0]
    for n in range(5000):
        cu.append(cu[-1] + 1 + n % 37)
    mask = Mask.causal_documents(cu)
    assert len(mask.slices) == 5000 and mask.visible_pairs() == sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))


def test_a_mask_is_a_value():
    a, b = Mask.prefix_lm([0, 5], [2]), Mask.from_slices([(0, 5, 0, 5, "causal"), (0, 2, 0, 2, "full")], 5)
    assert a == b and hash(a) == hash(b) and pickle.loads(pickle.dumps(a)) == a
    assert a != Mask.from_slices(a.slices)  # another total: None
    with pytest.raises(AttributeError, match="cannot be changed"):
        a.slices = ()
    assert repr(Mask.causal_documents(DOCS)) == ("Mask([(0, 7, 0, 7, 'causal'), (7, 19, 7, 19, 'causal'), "
                                                 "(19, 20, 19, 20, 'full'), ... (4 slices)], total=33)")  # fmt: skip


@pytest.mark.parametrize("build, words", [
    (lambda: Mask.from_slices([(0, 4, 0, 4)]), "pass (q_start, q_end, k_start, k_end, kind)"),
    (lambda: Mask.from_slices([(0, 4, 0, 4, "diagonal")]), "kind 'diagonal'"),
    (lambda: Mask.from_slices([(3, 3, 0, 4, "full")]), "empty or reversed"),
    (lambda: Mask.from_slices([(0, 4, 4, 2, "full")]), "empty or reversed"),
    (lambda: Mask.from_slices([(0, 4, 0, 9, "full")], 8), "reaches past the batch of 8 tokens"),
    (lambda: Mask.from_slices([(0, 4.0, 0, 4, "full")]), "slices[0] q_end is 4.0, not an int"),
    (lambda: Mask.from_slices([(-1, 4, 0, 4, "full")]), "slices[0] q_start is -1"),
    (lambda: Mask.from_slices([]), "at least one slice"),
    (lambda: Mask.from_slices("full"), "slices is str"),
    (lambda: Mask.causal_documents([0, 4, 4]), "increase strictly"),
    (lambda: Mask.prefix_lm([0, 4, 9], [2]), "prefix_lengths has 1 entries for 2 documents"),
    (lambda: Mask.prefix_lm([0, 4, 9], [2, 6]), "prefix_lengths[1] = 6 is outside document 1 of 5 tokens"),
    (lambda: Mask.bidirectional_spans([0, 4, 9], [(3, 6)]), "spans[0] = (3, 6) is not a non-empty range inside one"),
    (lambda: Mask.shared_prompt([(0, [3])]), "groups[0] prompt length is 0"),
    (lambda: Mask.shared_prompt([(2, [3, 0])]), "groups[0] answer length is 0"),
    (lambda: Mask.from_dense(torch.ones(3, 4, dtype=torch.bool)), "square (T, T) torch.bool"),
    (lambda: Mask.from_dense(torch.ones(3, 3)), "square (T, T) torch.bool"),
    (lambda: Mask.from_mask_mod(lambda b, h, q, kv: q >= kv, 0), "total is 0"),
    (lambda: Mask.from_mask_mod(lambda b, h, q, kv: (q >= kv).int(), 4), "must return a torch.bool tensor"),
    (lambda: Mask.from_mask_mod(lambda b, h, q, kv: torch.ones(2, 2, dtype=torch.bool), 4), "elementwise"),
    (lambda: Mask.from_mask_mod(lambda b, h, q, kv: (q >= kv) & (h == 0), 4, heads=2),
     "head 1 and head 0 differ at query 0, key 0"),
])  # fmt: skip
def test_bad_input_is_refused_naming_the_value_and_the_fix(build, words):
    with pytest.raises(CPInputError) as err:
        build()
    assert words in str(err.value)
