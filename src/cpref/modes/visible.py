r"""Chunked attention in every plan: each chunk of a document is a document of its own, on the same sharding.

Chunked attention with chunk `C` (Llama 4's chunked layers) lets the query at position $p$ of a document see
only the keys of its own chunk, positions $[\lfloor p / C \rfloor C, (\lfloor p / C \rfloor + 1) C)$, under the
causal mask and window as usual. No window expresses it (the bound jumps at every chunk boundary), but it is
exactly attention over a finer batch: every document cut at its positions $C, 2C, \dots$ into *sub-documents*,
each attended alone. The tokens stay where the layout put them (a model interleaves chunked and full layers over
one sharding, and its positions count from the document's start); only the plans' notion of a document changes:

* a plan that runs whole documents (Ulysses after its exchange, the all-gather mode at `P = 1`, the split modes'
  own documents) runs their chunks instead: [`chunked_sequences`][cpref.modes.visible.chunked_sequences];
* a plan written on the layout's pieces, `(doc, a, z, row)` (the ring that sends only what is read, the
  all-gather over pieces, the hierarchical mode's ring), cuts every piece at the chunk boundaries and keys each
  part by `(doc, chunk)` ([`chunk_pieces`][cpref.modes.visible.chunk_pieces]): a query part then reads only the
  key parts of its own chunk, so a rank receives only the keys a chunk it holds reads, as a window's halo is,
  and a chunk that lies whole on one rank moves nothing.

The kernel sees nothing new: its sequences are shorter, with its causal mask and window as before, on every
kernel (TorchKernel, flash, the NPU's op).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["chunked_sequences", "chunk_pieces", "chunk_real"]

Piece = tuple  # (key, a, z, row): positions [a, z) of a document (key: its index, or (index, chunk)), at row `row`


def chunked_sequences(n: int, pad: int, chunk: int | None) -> list[tuple[int, int]]:
    """`(q_len, kv_len)` of a document of `n` real tokens and `pad` padding ones, rows in order: each chunk of `C`
    real tokens a sequence `(c, c)` seeing itself, then `(0, pad)` the padding keys (seen by no query) and
    `(pad, 0)` the padding queries; empty ones dropped. Without chunks, the document is one sequence.

    Examples:
        >>> chunked_sequences(10, 2, 4)  # chunks [0, 4), [4, 8), [8, 10), then the padding
        [(4, 4), (4, 4), (2, 2), (0, 2), (2, 0)]
        >>> chunked_sequences(10, 0, None)
        [(10, 10)]
    """
    step = n if chunk is None else chunk
    parts = [(min(step, n - a),) * 2 for a in range(0, n, max(step, 1))]
    return [(n_q, n_k) for n_q, n_k in (*parts, (0, pad), (pad, 0)) if n_q or n_k]


def chunk_pieces(pieces: list[Piece], chunk: int | None) -> list[Piece]:
    """Every piece `(doc, a, z, row)` cut at the multiples of `chunk` in `[a, z)`, each part keyed
    `((doc, k), a', z', row')` by its chunk `k` (positions stay the document's). Without chunks, every piece keyed
    `((doc, 0), ...)`, so a plan has one form.

    Examples:
        >>> chunk_pieces([(0, 2, 9, 0), (1, 0, 3, 7)], 4)  # doc 0's positions [2, 9): chunks 0, 1 and 2
        [((0, 0), 2, 4, 0), ((0, 1), 4, 8, 2), ((0, 2), 8, 9, 6), ((1, 0), 0, 3, 7)]
    """
    out = []
    for doc, a, z, row in pieces:
        cuts = [a] if chunk is None else [a, *range((a // chunk + 1) * chunk, z, chunk)]
        for start, end in zip(cuts, [*cuts[1:], z]):
            out.append(((doc, 0 if chunk is None else start // chunk), start, end, row + start - a))
    return out


def chunk_real(real: Callable[[int, int, int], int]) -> Callable[[tuple[int, int], int, int], int]:
    """`real(doc, a, z)` (the real tokens of positions `[a, z)` of a document) for keys `(doc, chunk)`."""
    return lambda key, a, z: real(key[0], a, z)
