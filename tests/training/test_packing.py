"""Packed documents: deterministic, nothing dropped, labels never cross a document boundary."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.base.errors import CPInputError
from cpref.train.packing import (
    BYTE_VOCAB,
    EOD,
    Pack,
    documents_from_tokens,
    labels_for,
    pack_documents,
    stdlib_documents,
)


def test_stdlib_documents_are_real_deterministic_byte_text():
    first = list(stdlib_documents(limit=5))
    again = list(stdlib_documents(limit=5))
    assert len(first) == 5 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(d.dtype == torch.int64 and 0 <= int(d.min()) and int(d.max()) < 256 for d in first)
    assert BYTE_VOCAB == EOD + 1 == 257


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(2, 32))
def test_packs_hold_every_token_in_order_with_eod_after_each_document(lengths, pack_tokens):
    docs = [torch.arange(n) % 200 + 1 for n in lengths]  # ids never equal EOD
    packs = list(pack_documents(docs, pack_tokens))
    stream = torch.cat([d for doc in docs for d in (doc, torch.tensor([EOD]))])
    whole = len(stream) // pack_tokens
    assert len(packs) == whole  # only an incomplete last pack is dropped
    for n, pack in enumerate(packs):
        assert pack.tokens.shape == (pack_tokens,) and pack.cu_seqlens[0] == 0 and pack.cu_seqlens[-1] == pack_tokens
        assert torch.equal(pack.tokens, stream[n * pack_tokens : (n + 1) * pack_tokens])
        ends = set(pack.cu_seqlens[1:-1].tolist())
        assert {x + 1 for x in range(pack_tokens) if pack.tokens[x] == EOD and x + 1 < pack_tokens} <= ends


def test_labels_stay_inside_documents():
    pack = Pack(torch.tensor([5, 6, EOD, 7, 8, 9, EOD, 4]), torch.tensor([0, 3, 7, 8]))
    labels, mask = labels_for(pack, ignore=-1)
    assert labels.tolist() == [6, EOD, -1, 8, 9, EOD, -1, -1]
    assert mask.tolist() == [1, 1, 0, 1, 1, 1, 0, 0]


def test_your_own_token_stream_splits_at_your_eod():
    tokens = torch.tensor([3, 4, 9, 9, 5, 9, 6])
    assert [d.tolist() for d in documents_from_tokens(tokens, eod=9)] == [[3, 4], [5], [6]]
    with pytest.raises(CPInputError, match="1-D integer tensor"):
        list(documents_from_tokens(torch.ones(2, 2), eod=9))
    with pytest.raises(CPInputError, match="pack_tokens=1 is outside"):
        list(pack_documents([tokens], 1))


def test_a_token_stream_must_be_one_dimensional_and_integer():
    with pytest.raises(CPInputError, match=r"1-D integer tensor, got torch.Size\(\[3\]\)"):
        list(documents_from_tokens(torch.tensor([1.0, 9.0, 2.0]), eod=9))  # 1-D but floating
    with pytest.raises(CPInputError, match=r"1-D integer tensor, got torch.Size\(\[2, 2\]\)"):
        list(documents_from_tokens(torch.tensor([[1, 9], [2, 3]]), eod=9))  # integer but 2-D


def test_packs_end_each_document_with_the_eod_id_given():
    # [1, 2] + 99, [3] + 99: five tokens, one full pack of 5, documents of 3 and 2 tokens
    (pack,) = pack_documents([torch.tensor([1, 2]), torch.tensor([3])], 5, eod=99)
    assert pack.tokens.tolist() == [1, 2, 99, 3, 99] and pack.cu_seqlens.tolist() == [0, 3, 5]


def test_stdlib_documents_are_the_non_empty_standard_library_files_in_sorted_path_order():
    from cpref.train.packing import _stdlib_files

    files = _stdlib_files()
    assert list(files) == sorted(files)
    assert not any("site-packages" in p.parts for p in files)  # third-party packages are not the standard library
    assert all(p.stat().st_size > 0 for p in files)
    docs = list(stdlib_documents(limit=3))
    assert [d.tolist() for d in docs] == [list(p.read_bytes()) for p in files[:3]]  # from the first file on
