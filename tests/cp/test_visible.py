"""`cpref.modes.visible`: the cut of documents and pieces at the chunks' boundaries every plan uses for chunked
attention. The parts tile what they cut, in order, each inside one chunk of the document's positions, at the rows
they came from; a sequence's queries see exactly the keys of their chunk (the oracle's rule)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpref.modes.visible import chunk_pieces, chunk_real, chunked_sequences

pieces_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 30), st.integers(0, 100)),
                     max_size=5)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(pieces_st, st.one_of(st.none(), st.integers(1, 12)))
def test_chunk_pieces_tile_each_piece_inside_one_chunk_at_its_rows(raw, chunk):
    pieces = [(doc, a, a + n, row) for doc, a, n, row in raw]
    parts = chunk_pieces(pieces, chunk)
    assert parts == [part for piece in pieces for part in chunk_pieces([piece], chunk)]  # piece by piece, in order
    for doc, a, z, row in pieces:
        mine = chunk_pieces([(doc, a, z, row)], chunk)
        assert all(key[0] == doc and r - start == row - a for key, start, _, r in mine)  # its document, its rows
        assert mine[0][1] == a and mine[-1][2] == z  # starts and ends with the piece
        assert all(x[2] == y[1] for x, y in zip(mine, mine[1:]))  # no gap, no overlap
        for (_, k), start, end, _ in mine:
            if chunk is None:
                assert k == 0 and (start, end) == (a, z)
            else:  # inside chunk k, and cut only where a chunk ends
                assert k * chunk <= start < end <= (k + 1) * chunk
                assert end == z or end % chunk == 0
    assert len(parts) == sum(1 if chunk is None else (z - 1) // chunk - a // chunk + 1 for _, a, z, _ in pieces)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(0, 7), st.one_of(st.none(), st.integers(1, 12)))
def test_chunked_sequences_are_the_chunks_then_the_padding(n, pad, chunk):
    seqs = chunked_sequences(n, pad, chunk)
    real = [s for s in seqs if s[0] and s[1]]
    assert sum(q for q, _ in seqs) == n + pad and sum(k for _, k in seqs) == n + pad
    assert all(q == k for q, k in real) and sum(q for q, _ in real) == n  # each chunk sees itself
    assert [q for q, _ in real] == ([] if n == 0 else [min(chunk or n, n - a) for a in range(0, n, chunk or n)])
    assert seqs[len(real):] == [s for s in ((0, pad), (pad, 0)) if pad]  # the padding keys, then its queries


def test_chunk_real_reads_the_document_of_a_chunk_key():
    assert chunk_real(lambda doc, a, z: 100 * doc + z - a)((3, 7), 2, 5) == 303
