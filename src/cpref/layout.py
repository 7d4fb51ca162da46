"""The data model and the CP layouts.

## One data model: THD

A batch is a *packed stream* of documents. Tensors are THD: `q (T, Hq, D)`,
`k (T, Hkv, D)`, `v (T, Hkv, Dv)`, where `T` is the total number of tokens, and
`cu_seqlens` holds the document boundaries with a leading 0: `[0, 8, 20]` is two documents
of 8 and 12 tokens. A token attends only inside its own document (EOD reset), and with a
causal mask only to positions at or before its own. A fixed-length batch `(B, S, H, D)` is
the special case of `B` documents of length `S` ([`bshd_to_thd`][cpref.layout.bshd_to_thd]).

## Layouts over a CP group of `P` ranks

Context parallelism splits *every document* across the `P` ranks of the group, so that
each rank holds `1/P` of every document and every document benefits from the split.

* **contiguous**: document `i` of length `L_i` is cut into `P` equal chunks of
  `c_i = L_i / P` tokens; rank `r` holds chunk `r`.
* **zigzag**: document `i` is cut into `2P` chunks of `c_i = L_i / (2P)` tokens; rank `r`
  holds chunk `r` and chunk `2P - 1 - r`, in that order (the Megatron / MindSpeed /
  TransformerEngine convention).

A rank's local tokens are ordered document by document, and inside a document in the chunk
order above.

--8<-- "src/cpref/layout.py:chunks"

## Why zigzag: causal work per rank

Under a causal mask, query chunk `j` of a document (0-based, chunk size `c`) attends to the
`(j + 1) c` keys of chunks `0..j`, so its work is

$$ W_j = c \\cdot (j + 1) c . $$

With the contiguous layout rank `r` does $W_r = (r + 1) c^2$: the last rank does `P` times
the work of the first, and the slowest rank carries $\\frac{2P}{P + 1}$ of the mean. With
zigzag, rank `r` holds chunks `r` and `2P - 1 - r`:

$$ W_r + W_{2P-1-r} = c^2 \\left[(r + 1) + (2P - r)\\right] = (2P + 1) c^2 , $$

the same on every rank. [`attention_work`][cpref.layout.attention_work] computes these
figures; `make demo` prints them.

## Padding

A document whose length is not a multiple of the layout's granularity (`P` for contiguous,
`2P` for zigzag) cannot be split evenly. cpref never drops or pads silently: it raises
`ValueError` naming the document, and [`pad_to_multiple`][cpref.layout.pad_to_multiple]
pads each document *at its end* (EOD padding). Padding at the end is harmless under a causal
mask, since no real token sees a later position; its loss is masked out
(see `cpref.data`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from cpref.errors import CPInputError

__all__ = [
    "LAYOUTS",
    "as_cu_list",
    "host_ints",
    "layout_multiple",
    "check_divisible",
    "check_rank",
    "local_chunks",
    "global_index",
    "positions",
    "shard",
    "unshard",
    "pad_to_multiple",
    "unpad",
    "attention_work",
    "bshd_to_thd",
    "thd_to_bshd",
]

LAYOUTS = ("contiguous", "zigzag")

CuSeqlens = torch.Tensor | Sequence[int]


def host_ints(cu_seqlens: CuSeqlens) -> list[int]:
    """Boundaries as a list of host ints, from a 1-D integer tensor or a sequence of ints."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise CPInputError(
                f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)} "
                f"dtype {cu_seqlens.dtype}"
            )
        return [int(x) for x in cu_seqlens.tolist()]
    return [int(x) for x in cu_seqlens]


def as_cu_list(cu_seqlens: CuSeqlens) -> list[int]:
    """Validate document boundaries and return them as host ints.

    Args:
        cu_seqlens: 1-D, leading 0, strictly increasing (every document non-empty).

    Raises:
        ValueError: naming the offending entry.
    """
    cu = host_ints(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        raise CPInputError(
            f"cu_seqlens must start with 0 and hold at least one document, got {cu[:8]}; "
            "pass document boundaries like [0, 8, 20]"
        )
    for i in range(len(cu) - 1):
        if cu[i + 1] <= cu[i]:
            raise CPInputError(
                f"cu_seqlens must be strictly increasing: document {i} spans "
                f"[{cu[i]}, {cu[i + 1]}), length {cu[i + 1] - cu[i]}; drop empty documents"
            )
    return cu


def layout_multiple(layout: str, cp_size: int) -> int:
    """The granularity a document length must be a multiple of: `P` or `2P`."""
    if layout not in LAYOUTS:
        raise CPInputError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise CPInputError(f"cp_size must be an int >= 1, got {cp_size!r}")
    return 2 * cp_size if layout == "zigzag" else cp_size


def check_divisible(cu: list[int], layout: str, cp_size: int) -> int:
    """Raise unless every document length is a multiple of the layout's granularity; return it."""
    mult = layout_multiple(layout, cp_size)
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n % mult:
            raise CPInputError(
                f"document {i} has length {n}, not a multiple of {mult} (the {layout} layout "
                f"over cp_size={cp_size}); pad it: cpref.pad_to_multiple(x, cu_seqlens, {mult})"
            )
    return mult


def check_rank(rank: int, cp_size: int) -> None:
    """Raise unless `0 <= rank < cp_size`."""
    if not isinstance(rank, int) or not 0 <= rank < cp_size:
        raise CPInputError(f"rank {rank!r} is outside [0, cp_size={cp_size})")


# --8<-- [start:chunks]
def local_chunks(cu_seqlens: CuSeqlens, *, cp_size: int, rank: int, layout: str) -> list[tuple[int, int, int]]:
    """The global token ranges rank `rank` holds, in local order.

    Returns:
        A list of `(doc, start, end)`: document index and half-open range in the stream.
    """
    cu = as_cu_list(cu_seqlens)
    mult = check_divisible(cu, layout, cp_size)
    check_rank(rank, cp_size)
    chunk_ids = [rank] if layout == "contiguous" else [rank, 2 * cp_size - 1 - rank]
    out = []
    for doc in range(len(cu) - 1):
        c = (cu[doc + 1] - cu[doc]) // mult  # chunk size c_i
        for j in chunk_ids:
            out.append((doc, cu[doc] + j * c, cu[doc] + (j + 1) * c))
    return out
# --8<-- [end:chunks]


def global_index(cu_seqlens: CuSeqlens, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """Each local token's index in the global stream: LongTensor `(T / P,)`."""
    ranges = [torch.arange(s, e) for _, s, e in local_chunks(cu_seqlens, cp_size=cp_size, rank=rank, layout=layout)]
    return torch.cat(ranges)  # (T/P,)


def positions(cu_seqlens: CuSeqlens, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """Each local token's position inside its document (for RoPE): LongTensor `(T / P,)`."""
    cu = as_cu_list(cu_seqlens)
    chunks = local_chunks(cu, cp_size=cp_size, rank=rank, layout=layout)
    return torch.cat([torch.arange(s - cu[d], e - cu[d]) for d, s, e in chunks])  # (T/P,)


def shard(x: torch.Tensor, cu_seqlens: CuSeqlens, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's shard of a packed tensor: `(T, ...) -> (T / P, ...)` along dim 0."""
    cu = as_cu_list(cu_seqlens)
    if x.shape[0] != cu[-1]:
        raise CPInputError(f"x has {x.shape[0]} tokens but cu_seqlens ends at {cu[-1]}")
    idx = global_index(cu, cp_size=cp_size, rank=rank, layout=layout).to(x.device)
    return x.index_select(0, idx)  # (T/P, ...)


def unshard(shards: Sequence[torch.Tensor], cu_seqlens: CuSeqlens, *, layout: str) -> torch.Tensor:
    """Inverse of [`shard`][cpref.layout.shard]: every rank's shard, in rank order -> `(T, ...)`."""
    cu = as_cu_list(cu_seqlens)
    cp_size = len(shards)
    first = shards[0]
    out = first.new_empty((cu[-1], *first.shape[1:]))  # (T, ...)
    for rank, part in enumerate(shards):
        idx = global_index(cu, cp_size=cp_size, rank=rank, layout=layout).to(part.device)
        if part.shape[0] != idx.numel():
            raise CPInputError(f"shard of rank {rank} has {part.shape[0]} tokens, expected {idx.numel()}")
        out.index_copy_(0, idx, part)
    return out


def pad_to_multiple(
    x: torch.Tensor, cu_seqlens: CuSeqlens, multiple: int, *, value: float | int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """EOD padding: pad each document at its end to a multiple of `multiple` tokens.

    Returns:
        `(x_padded, cu_seqlens_padded)`; the padded tokens hold `value`.
    """
    cu = as_cu_list(cu_seqlens)
    if not isinstance(multiple, int) or multiple < 1:
        raise CPInputError(f"multiple must be an int >= 1, got {multiple!r}")
    if x.shape[0] != cu[-1]:
        raise CPInputError(f"x has {x.shape[0]} tokens but cu_seqlens ends at {cu[-1]}")
    pieces, cu_pad = [], [0]
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        padded = -(-n // multiple) * multiple  # ceil to a multiple
        pieces.append(x[cu[i] : cu[i + 1]])
        pieces.append(x.new_full((padded - n, *x.shape[1:]), value))
        cu_pad.append(cu_pad[-1] + padded)
    return torch.cat(pieces), torch.tensor(cu_pad, dtype=torch.int64)


def unpad(x_padded: torch.Tensor, cu_seqlens_padded: CuSeqlens, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Inverse of [`pad_to_multiple`][cpref.layout.pad_to_multiple]: drop each document's tail padding."""
    cu_p, cu = as_cu_list(cu_seqlens_padded), as_cu_list(cu_seqlens)
    if len(cu_p) != len(cu):
        raise CPInputError(f"{len(cu_p) - 1} padded documents but {len(cu) - 1} real ones")
    pieces = []
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if cu_p[i + 1] - cu_p[i] < n:
            raise CPInputError(f"padded document {i} is shorter than its real length {n}")
        pieces.append(x_padded[cu_p[i] : cu_p[i] + n])
    return torch.cat(pieces)


def attention_work(
    cu_seqlens: CuSeqlens, *, cp_size: int, rank: int, layout: str, causal: bool = True
) -> int:
    """Attention work of one rank: `sum(q_len * kv_len)` over its local query chunks."""
    cu = as_cu_list(cu_seqlens)
    work = 0
    for doc, s, e in local_chunks(cu, cp_size=cp_size, rank=rank, layout=layout):
        kv_len = (e - cu[doc]) if causal else (cu[doc + 1] - cu[doc])  # causal prefix or whole doc
        work += (e - s) * kv_len
    return work


def bshd_to_thd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-length batch `(B, S, ...)` as `B` packed documents: `((B S, ...), cu_seqlens)`."""
    b, s = x.shape[0], x.shape[1]
    return x.reshape(b * s, *x.shape[2:]), torch.arange(0, (b + 1) * s, s, dtype=torch.int64)


def thd_to_bshd(x: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Inverse of [`bshd_to_thd`][cpref.layout.bshd_to_thd]; every document must have one length."""
    cu = as_cu_list(cu_seqlens)
    lengths = {cu[i + 1] - cu[i] for i in range(len(cu) - 1)}
    if len(lengths) != 1:
        raise CPInputError(f"documents have lengths {sorted(lengths)}; a (B, S, ...) batch needs one")
    s = lengths.pop()
    return x.reshape(len(cu) - 1, s, *x.shape[1:])  # (B, S, ...)
