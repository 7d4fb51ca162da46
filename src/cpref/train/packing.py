"""Packed training data: documents, an end-of-document token, fixed-size packs with `cu_seqlens`.

Long-context training feeds the model *packs*: documents laid end to end in a stream of a
fixed number of tokens, with `cu_seqlens` marking where each document ends, so that no compute
is spent on padding between sequences and attention never crosses a document
(`cpref.batch.layout`). This module builds such packs deterministically.

## Documents

A document is a 1-D tensor of token ids. [`stdlib_documents`][cpref.train.packing.stdlib_documents]
gives real text with nothing to download and nothing copied into the repository: the source
files of the Python standard library this interpreter runs, one file a document, in sorted
path order, as **byte-level tokens** (ids 0..255, so the vocabulary needs no tokenizer). Your
own data plugs in through [`documents_from_tokens`][cpref.train.packing.documents_from_tokens]: a
flat token stream (e.g. `torch.load("tokens.pt", weights_only=True)` of a 1-D integer tensor
written by your tokenizer) with documents separated by your end-of-document id.

## Packs

[`pack_documents`][cpref.train.packing.pack_documents] appends the end-of-document token to every
document and fills packs of `pack_tokens` tokens greedily, in order; a document that does not
fit in the space left is cut, and its rest starts the next pack as a document of its own (no
token is dropped, no pack is padded, except the very last, which is dropped if incomplete).
Pack `n` is the same on every call: the data position of a run is just the number of packs
consumed, which a checkpoint stores.

## Labels

Inside a document, token `x` predicts token `x + 1`; the last token of a document (its
end-of-document token, or the last token of a cut piece) predicts nothing, so a label never
crosses a boundary. [`labels_for`][cpref.train.packing.labels_for] returns the labels and the loss
mask; `cpref.get_batch_on_this_cp_rank` then pads and shards them with the tokens.
"""

from __future__ import annotations

import functools
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from cpref.base.checks import as_int
from cpref.base.errors import CPInputError

__all__ = ["BYTE_VOCAB", "EOD", "Pack", "stdlib_documents", "documents_from_tokens", "pack_documents", "labels_for"]

EOD = 256  # the end-of-document id after the 256 byte values
BYTE_VOCAB = 257  # byte-level vocabulary: 256 bytes and EOD


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    """The standard library's non-empty `.py` files, sorted (listed once per process: a walk is slow)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = tuple(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > 0))
    if not files:
        raise CPInputError(f"no .py files under the standard library at {root}; pass your own documents instead")
    return files


def stdlib_documents(limit: int | None = None) -> Iterator[torch.Tensor]:
    """The `.py` files of this interpreter's standard library, sorted by path, as byte tokens.

    Args:
        limit: stop after this many documents (None: all of them).
    """
    for path in _stdlib_files()[:limit]:
        yield torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).to(torch.int64)  # (n,)


def documents_from_tokens(tokens: torch.Tensor, eod: int) -> Iterator[torch.Tensor]:
    """Split a flat token stream at every `eod` id (the hook for your own tokenized data).

    Args:
        tokens: `(N,)` integer token ids, documents separated by `eod` (a trailing one optional).
        eod: the end-of-document id; it is not part of the documents returned.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise CPInputError(f"tokens must be a 1-D integer tensor, got {getattr(tokens, 'shape', type(tokens).__name__)}")
    ends = (tokens == eod).nonzero().flatten().tolist() + [len(tokens)]
    start = 0
    for end in ends:
        if end > start:
            yield tokens[start:end]
        start = end + 1


@dataclass(frozen=True)
class Pack:
    """One pack: `tokens (pack_tokens,)` and its document boundaries `cu_seqlens` (leading 0); `mask`, its attention
    mask where it is not causal inside each document (a `cpref.Mask`: a shared prompt, a prefix), or None."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    mask: Any = None


def pack_documents(documents: Iterable[torch.Tensor], pack_tokens: int, *, eod: int = EOD) -> Iterator[Pack]:
    """Fill packs of `pack_tokens` tokens with the documents, each followed by `eod` (see the docstring)."""
    pack_tokens = as_int("pack_tokens", pack_tokens, lo=2)
    buffer: list[torch.Tensor] = []
    lengths: list[int] = []
    room = pack_tokens
    for doc in documents:
        rest = torch.cat([doc.to(torch.int64), torch.tensor([eod])])  # (n + 1,)
        while len(rest):
            piece, rest = rest[:room], rest[room:]  # a document cut at the pack's end goes on in the next
            buffer.append(piece)
            lengths.append(len(piece))
            room -= len(piece)
            if room == 0:
                yield Pack(torch.cat(buffer), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
                buffer, lengths, room = [], [], pack_tokens


def labels_for(pack: Pack, *, ignore: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(labels, loss_mask)` of a pack: each token's next token in its document; the last token of
    every document gets label `ignore` and mask 0."""
    tokens, cu = pack.tokens, pack.cu_seqlens
    labels = torch.roll(tokens, -1)  # (T,): token x + 1 of the stream
    mask = torch.ones(len(tokens), dtype=torch.float32)
    last = cu[1:] - 1  # the last token of every document predicts nothing
    labels[last], mask[last] = ignore, 0.0
    return labels, mask
