r"""The data model and the CP layouts.

## One data model: THD

A batch is a *packed stream* of documents. Tensors are THD: `q (T, Hq, D)`,
`k (T, Hkv, D)`, `v (T, Hkv, Dv)`, where `T` is the total number of tokens, and
`cu_seqlens` holds the document boundaries with a leading 0: `[0, 8, 20]` is two documents
of 8 and 12 tokens. A token attends only inside its own document (EOD reset), and with a
causal mask only to positions at or before its own. A fixed-length batch in the BSHD format
(batch, sequence, heads, dim) is the special case of equal documents ([`bshd_to_thd`][cpref.batch.layout.bshd_to_thd]).

## Layouts over a CP group of `P` ranks

Context parallelism splits the batch across the `P` ranks of the group. Four layouts say how,
drawn here on one small batch and defined below: contiguous and zigzag split *every document*,
so that each rank holds `1/P` of every document and every document benefits from the split;
stream and balanced cut the packed batch instead, and leave whole every document they do
not cut.

{{ figure figures/layouts.png }}

* **contiguous**: document `i` of length `L_i` is cut into `P` equal chunks of
  `c_i = L_i / P` tokens; rank `r` holds chunk `r`.
* **zigzag**: document `i` is cut into `2P` chunks of `c_i = L_i / (2P)` tokens; rank `r`
  holds chunk `r` and chunk `2P - 1 - r`, in that order (the Megatron / MindSpeed /
  TransformerEngine convention).

A rank's local tokens are ordered document by document, and inside a document in the chunk
order above.

--8<-- "src/cpref/batch/layout.py:chunks"

* **stream**: the packed batch as one stream of $T$ tokens, cut into `P` equal contiguous pieces
  of $T / P$: rank `r` holds tokens $[rT/P, (r+1)T/P)$, and documents may straddle ranks. No
  document needs padding; only the batch must be a multiple of `P` (padded at its end, the last
  document's padding). This is how DeepSpeed-Ulysses, ring-flash-attention's "llama3"
  all-gather and picotron shard a packed batch, and it makes their implementations verifiable
  here (`sim verify --impl ... --layout stream`). Its causal work is as unbalanced as
  contiguous's, for the whole batch at once: a rank's queries see every earlier key of their
  documents, so the last rank of a long document does the most.

* **balanced**: a plan computed from the boundaries and `P` alone ([the balanced layout][cpref.batch.balanced]):
  every rank holds the same number of tokens (the batch padded at its end only), short
  documents stay whole on one rank and only the heaviest are cut, in symmetric pairs whose
  uneven shares make each rank's causal work within 2% of the mean. A document held whole
  costs the ring no communication.

Every layout is, per rank, a list of **pieces** `(doc, start, end)` in local order
([`local_chunks`][cpref.batch.layout.local_chunks]): two per document and rank for zigzag, one for
contiguous, for stream one for each document that overlaps the rank's range, and for balanced
the pieces of its plan (whole documents, and pieces of the cut ones). The data
path (shard, unshard, positions) and the modes' plans for stream and balanced are written on the pieces;
the chunked layouts keep their direct chunk arithmetic (the MindSpeed RFC's indexing), which
the tests check against the pieces.

## Why zigzag: causal work per rank

Work is counted in **score entries per head**, two ways that agree on zigzag and differ on
contiguous:

* the **block metric** `sum(q_len * kv_len)` over a rank's query chunks, with the causal
  prefix as `kv_len` (the MindSpeed RFC's measure, and what a kernel that computes whole
  blocks spends);
* the **exact count**: the query at position $\mathrm{pos}$ of a document sees $\mathrm{pos} + 1$
  keys, so the rank's work is the sum of $\mathrm{pos} + 1$ over its query tokens (what a kernel that skips masked scores
  spends).

{{ figure figures/attention_mask.png }}

Query chunk `j` of a document (0-based, chunk size $c$) covers positions $[jc, (j+1)c)$:

$$ W^{\mathrm{block}}_j = c \cdot (j + 1) c, \qquad W^{\mathrm{exact}}_j = \sum_{\mathrm{pos} = jc}^{(j+1)c - 1} (\mathrm{pos} + 1)
   = j c^2 + \tfrac{c (c + 1)}{2} . $$

With the contiguous layout rank `r` holds chunk `r` of `P`: the last rank does the most
work, and the slowest rank carries, of the mean,

$$ \frac{2P}{P + 1} \text{ (block)}, \qquad \to \frac{2P - 1}{P} \text{ (exact, for large } c) , $$

1.6 and 1.75 at `P = 4`. With zigzag, rank `r` holds chunks `r` and `2P - 1 - r` of `2P`:

$$ W_r + W_{2P-1-r} = (2P + 1) c^2 \text{ (block)}, \qquad (2P - 1) c^2 + c (c + 1) \text{ (exact)}, $$

the same on every rank under both metrics. [`attention_work`][cpref.batch.layout.attention_work]
computes both; `make demo` prints them.

{{ figure figures/work.png }}

**With a sliding window** `(left, right)` (`cpref.attention`'s, $r = 0$ under causal) the query
at position $p$ of a document of $n$ tokens sees the keys $[\max(0, p - \ell), \min(n, p + r + 1))$,
so the exact count is

$$ W^{\mathrm{exact}} = \sum_{p} \big(\min(n, p + r + 1) - \max(0, p - \ell)\big) , $$

$w + 1$ keys for every causal query past the first $w$ of a window `(w, 0)`: every rank does
about $(w + 1) \frac{T}{P}$ whatever the layout, so with a window much smaller than the chunks
the contiguous layout is balanced on its own, and zigzag balances only the first $w$ positions
of each document (where queries see fewer keys). The block metric counts each chunk's queries
against the key range their windows span, $(z - a)(\min(n, z + r) - \max(0, a - \ell))$ for the
real queries $[a, z)$ of a chunk.

## Padding

A document whose length is not a multiple of the layout's granularity (`P` for contiguous,
`2P` for zigzag) cannot be split evenly. cpref never drops or pads silently: it raises
`ValueError` naming the document. Pad each document *at its end* (EOD padding):
[`Sharding.eod_padded`][cpref.batch.sharding.Sharding.eod_padded] computes the padded boundaries and
keeps both lists, the real ones (`cu_seqlens`) and the padded ones, which define the shards
(`cu_seqlens_padded`, see [`cpref.batch.seqlens`][cpref.batch.seqlens]). Padding is then invisible to
attention, causal or not, and its loss is masked out (see `cpref.train.data`).

## This module and `Sharding`

The functions here are the layout's arithmetic, on the boundaries that define the shards
(the padded ones) and an explicit `cp_size`, `rank` and `layout`. Code that shards data for
attention goes through one [`cpref.Sharding`][cpref.batch.sharding.Sharding] per batch, whose methods
call them, so that the layout, `P` and the boundaries are given once.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cpref.base.checks import as_bool, as_int
from cpref.base.errors import CPInputError
from cpref.batch.balanced import balanced_pieces
from cpref.batch.seqlens import CHUNKED_LAYOUTS, LAYOUTS, Boundaries, CuSeqlens, layout_multiple

__all__ = [
    "LAYOUTS",
    "layout_multiple",
    "chunk_ids",
    "chunk_owner",
    "CHUNKED_LAYOUTS",
    "local_chunks",
    "group_chunks",
    "global_index",
    "positions",
    "shard",
    "unshard",
    "pad_to_multiple",
    "unpad",
    "attention_work",
    "chunk_work",
    "bshd_to_thd",
    "thd_to_bshd",
]

# --8<-- [start:chunks]
def chunk_ids(rank: int, cp_size: int, layout: str) -> list[int]:
    """The chunks of every document that rank `rank` holds, in local order: `[r]` or `[r, 2P-1-r]`
    (`[0]`, the whole document, without CP)."""
    return [rank] if layout == "contiguous" or cp_size == 1 else [rank, 2 * cp_size - 1 - rank]


def chunk_owner(j: int, cp_size: int, layout: str) -> tuple[int, int]:
    """`(rank, slot)`: who holds chunk `j` of a document, and where among its chunks of it."""
    if layout == "contiguous" or j < cp_size:
        return j, 0
    return 2 * cp_size - 1 - j, 1
# --8<-- [end:chunks]


def _bounds(cu_seqlens: CuSeqlens | Boundaries) -> Boundaries:
    return cu_seqlens if isinstance(cu_seqlens, Boundaries) else Boundaries.parse(cu_seqlens)


def local_chunks(cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, rank: int, layout: str) -> list[tuple[int, int, int]]:
    """The global token ranges rank `rank` holds, in local order: the layout's pieces.

    Returns:
        A list of `(doc, start, end)`: document index and half-open range in the (padded) stream.
    """
    b = _bounds(cu_seqlens)
    mult = b.check_divisible(layout, cp_size)
    rank = as_int("rank", rank, lo=0, hi=cp_size)
    if layout == "stream":  # the rank's piece of the stream, cut at the document boundaries
        lo, hi = rank * b.total // cp_size, (rank + 1) * b.total // cp_size
        ends = [(doc, max(lo, b.padded[doc]), min(hi, b.padded[doc + 1])) for doc in range(b.num_docs)]
        return [(doc, s, e) for doc, s, e in ends if e > s]
    if layout == "balanced" and cp_size > 1:  # the plan of cpref.batch.balanced
        return list(balanced_pieces(b, cp_size)[rank])
    out = []
    for doc in range(b.num_docs):
        c = b.padded_len(doc) // mult  # chunk size c_i
        out += [(doc, b.padded[doc] + j * c, b.padded[doc] + (j + 1) * c) for j in chunk_ids(rank, cp_size, layout)]
    return out


def group_chunks(cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, group: int, g: int, layout: str) -> list[tuple[int, int, int]]:
    """The pieces the `group` consecutive ranks `g group .. (g + 1) group - 1` hold together: theirs, in stream
    order, adjacent ones merged. For contiguous, zigzag and stream these hold the tokens of the layout over
    `cp_size / group` ranks at rank `g`, in its order (zigzag nests: `cpref.modes.hierarchical`); for balanced,
    the union."""
    b = _bounds(cu_seqlens)
    group = as_int("group", group, lo=1)
    if as_int("cp_size", cp_size, lo=1) % group:
        raise CPInputError(f"group={group} does not divide cp_size={cp_size}: the groups are of consecutive ranks")
    g = as_int("g", g, lo=0, hi=cp_size // group)
    pieces = sorted(p for r in range(g * group, (g + 1) * group) for p in local_chunks(b, cp_size=cp_size, rank=r, layout=layout))
    out: list[tuple[int, int, int]] = []
    for doc, s, e in pieces:
        if out and out[-1][0] == doc and out[-1][2] == s:
            out[-1] = (doc, out[-1][1], e)
        else:
            out.append((doc, s, e))
    return out


def global_index(cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """Each local token's index in the global stream: LongTensor `(T / P,)`."""
    ranges = [torch.arange(s, e) for _, s, e in local_chunks(cu_seqlens, cp_size=cp_size, rank=rank, layout=layout)]
    return torch.cat(ranges)  # (T/P,)


def positions(cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """Each local token's position inside its document (for RoPE): LongTensor `(T / P,)`."""
    b = _bounds(cu_seqlens)
    chunks = local_chunks(b, cp_size=cp_size, rank=rank, layout=layout)
    return torch.cat([torch.arange(s - b.padded[d], e - b.padded[d]) for d, s, e in chunks])  # (T/P,)


def shard(x: torch.Tensor, cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's shard of a packed tensor: `(T, ...) -> (T / P, ...)` along dim 0."""
    b = _bounds(cu_seqlens)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != b.total:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CPInputError(f"x has shape {got} but cu_seqlens ends at {b.total}: dim 0 must hold the whole stream")
    idx = global_index(b, cp_size=cp_size, rank=rank, layout=layout).to(x.device)
    return x.index_select(0, idx)  # (T/P, ...)


def unshard(shards: Sequence[torch.Tensor], cu_seqlens: CuSeqlens | Boundaries, *, layout: str) -> torch.Tensor:
    """Inverse of [`shard`][cpref.batch.layout.shard]: every rank's shard, in rank order -> `(T, ...)`."""
    b = _bounds(cu_seqlens)
    cp_size = len(shards)
    first = shards[0]
    out = first.new_empty((b.total, *first.shape[1:]))  # (T, ...)
    for rank, part in enumerate(shards):
        idx = global_index(b, cp_size=cp_size, rank=rank, layout=layout).to(part.device)
        if part.shape[0] != idx.numel():
            raise CPInputError(f"shard of rank {rank} has {part.shape[0]} tokens, expected {idx.numel()}")
        out.index_copy_(0, idx, part)
    return out


def pad_to_multiple(
    x: torch.Tensor, cu_seqlens: CuSeqlens, multiple: int, *, value: float | int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """EOD padding: pad each document at its end to a multiple of `multiple` tokens.

    Returns:
        `(x_padded, cu_seqlens_padded)`; the padded tokens hold `value`. Pass
        `cu_seqlens_padded` to `cpref.attention` beside the real `cu_seqlens`.
    """
    b = _bounds(cu_seqlens)
    multiple = as_int("multiple", multiple, lo=1)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != b.total:
        raise CPInputError(f"x has {x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else '?'} tokens but cu_seqlens ends at {b.total}")
    padded = b.eod_padded(multiple)
    return padded.pad(x, value), torch.tensor(padded.padded, dtype=torch.int64)


def unpad(x_padded: torch.Tensor, cu_seqlens_padded: CuSeqlens, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Inverse of [`pad_to_multiple`][cpref.batch.layout.pad_to_multiple]: drop each document's tail padding."""
    return Boundaries.parse(cu_seqlens, cu_seqlens_padded).unpad(x_padded)


def attention_work(
    cu_seqlens: CuSeqlens | Boundaries, *, cp_size: int, rank: int, layout: str, causal: bool = True,
    exact: bool = False, window: tuple[int, int] = (-1, -1),
) -> int:
    """Attention work of one rank, in score entries per head (see the module docstring).

    Args:
        cu_seqlens: the boundaries that define the shards, or a `Boundaries` (then padding
            tokens count as absent: padding queries see nothing, no query sees padding keys).
        exact: count the scores of visible (query, key) pairs; default: the block metric
            `sum(q_len * kv_len)` over the rank's query chunks.
        window: `(left, right)` sliding window (`cpref.attention`'s); the block metric is then
            each chunk's queries against the key range their window spans.
    """
    b = _bounds(cu_seqlens)
    causal, exact = as_bool("causal", causal), as_bool("exact", exact)
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence) or len(window) != 2:
        raise CPInputError(f"window must be a pair (left, right) of ints >= -1 (-1: unbounded), got {window!r}")
    window = tuple(as_int(f"window[{i}]", w, lo=-1) for i, w in enumerate(window))
    return sum(chunk_work(b, doc, s, e, causal=causal, exact=exact, window=window)
               for doc, s, e in local_chunks(b, cp_size=cp_size, rank=rank, layout=layout))  # fmt: skip


def chunk_work(b: Boundaries, doc: int, start: int, end: int, *, causal: bool = True, exact: bool = False,
               window: tuple[int, int] = (-1, -1)) -> int:  # fmt: skip
    """Attention work of the queries of one piece `(doc, start, end)` (`[start, end)` in the padded stream)
    against their document, in score entries per head: `attention_work`'s term for it (padding counts as absent)."""
    a = start - b.padded[doc]  # the chunk's first position
    z = a + b.real_in(doc, a, end - b.padded[doc])  # real query positions [a, z)
    if z == a:
        return 0
    if tuple(window) != (-1, -1):
        return _window_work(a, z, b.real_len(doc), causal, window, exact)
    if not causal:
        return (z - a) * b.real_len(doc)
    if exact:
        return (z * (z + 1) - a * (a + 1)) // 2  # sum of (p + 1) for p in [a, z)
    return (z - a) * z  # the chunk's real queries against its causal prefix


def _window_work(a: int, z: int, n: int, causal: bool, window: tuple[int, int], exact: bool) -> int:
    """Work of the real queries at positions `[a, z)` of a document of `n` real tokens under a window."""
    left, right = window
    right = 0 if causal else right
    p = torch.arange(a, z)  # (z - a,) positions of the queries
    lo = p.sub(left).clamp_(min=0) if left >= 0 else torch.zeros_like(p)  # first key each sees
    hi = p.add(right + 1).clamp_(max=n) if right >= 0 else torch.full_like(p, n)  # one past its last
    return int((hi - lo).sum()) if exact else (z - a) * int(hi[-1] - lo[0])


def bshd_to_thd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-length batch `(B, S, ...)` as `B` packed documents: `((B S, ...), cu_seqlens)`."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or 0 in x.shape[:2]:  # B = 0: no document, no cu_seqlens
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CPInputError(f"bshd_to_thd takes a batch (B, S, ...) of B >= 1 documents of S >= 1 tokens, got {got}")
    b, s = x.shape[0], x.shape[1]
    return x.reshape(b * s, *x.shape[2:]), torch.arange(0, (b + 1) * s, s, dtype=torch.int64)


def thd_to_bshd(x: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Inverse of [`bshd_to_thd`][cpref.batch.layout.bshd_to_thd]; every document must have one length."""
    b = _bounds(cu_seqlens)
    lengths = {b.padded_len(i) for i in range(b.num_docs)}
    if len(lengths) != 1:
        raise CPInputError(f"documents have lengths {sorted(lengths)}; a (B, S, ...) batch needs one")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != b.total:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CPInputError(f"x has shape {got} but cu_seqlens holds {b.total} tokens: thd_to_bshd takes (T, ...) of them")
    s = lengths.pop()
    return x.reshape(b.num_docs, s, *x.shape[1:])  # (B, S, ...)
