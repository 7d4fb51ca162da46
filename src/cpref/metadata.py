"""Load-balanced THD metadata for KV all-gather CP, and its LRU cache.

After the all-gather, every rank holds K and V of the whole packed stream, but in
**rank-major** order: rank 0's local tokens, then rank 1's, and so on. Rather than
reorder the whole stream back to natural order (and restore it afterwards), each rank builds
one index, `kv_index`, that picks out of the rank-major buffer exactly the keys each of its
query chunks needs, *in natural order*. One `index_select` then feeds one fused varlen
attention call for all of the rank's chunks.

## Where a chunk lives in the rank-major buffer

Let `T_l = T / P` be the local token count, `c_i` the chunk size of document `i`, and
`o_i` the offset of document `i` inside every rank's local buffer ($o_i = m \\sum_{i' < i}
c_{i'}$, with `m` local chunks per document: 2 for zigzag, 1 for contiguous). Chunk `j` of
document `i` is owned by rank `s(j)` at slot `k(j)` of that rank's chunks for the document:

$$ \\text{zigzag: } (s, k) = \\begin{cases} (j, 0) & j < P \\\\ (2P - 1 - j, 1) & j \\ge P
\\end{cases} \\qquad \\text{contiguous: } (s, k) = (j, 0) $$

and starts at row $s\\,T_l + o_i + k\\,c_i$ of the gathered buffer.

--8<-- "src/cpref/metadata.py:chunk_start"

## The causal prefix of a query chunk

Under a causal mask, query chunk `j` needs the keys of chunks `0..j` of its document, in that
order: a prefix of `(j + 1) c_i` keys. Its last query is aligned with its last key, which is
exactly the kernel contract's bottom-right causal mask, so no offsets are needed. Without a
causal mask, the rank's chunks of a document form one query sequence that sees the whole
document.

--8<-- "src/cpref/metadata.py:kv_index"

## The metadata

| key | meaning |
| --- | --- |
| `local_tokens`, `global_tokens` | `T / P` and `T` |
| `kv_index` | LongTensor on `device`: rows of the rank-major K/V, one causal prefix per query chunk |
| `actual_seq_qlen`, `actual_seq_kvlen` | cumulative lengths **without a leading 0** (the NPU's TND lists) |
| `cu_seqlens_q`, `cu_seqlens_kv` | the same with a leading 0, int64 on `device` (the kernel contract's form) |
| `work` | `sum(q_len * kv_len)`: this rank's attention work |

## The cache

Transformer layers call attention with the same `cu_seqlens` many times per step, so the
metadata is cached ([`cpref.cache.IdentityLRU`][cpref.cache.IdentityLRU]): an LRU of capacity
8 keyed by the tensor's **identity and version** (an in-place edit of `cu_seqlens`
invalidates it; lists of ints are keyed by value) plus device, `cp_size`, `rank`, layout and
causality. It holds only lengths and indices, never Q/K/V.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpref.cache import CacheInfo, IdentityLRU
from cpref.errors import CPInputError
from cpref.kernels.contract import Varlen
from cpref.layout import as_cu_list, check_divisible, check_rank, host_ints, layout_multiple

__all__ = [
    "get_thd_load_balanced_cp_metadata",
    "clear_cp_metadata_cache",
    "cache_info",
    "CacheInfo",
    "CACHE_CAPACITY",
]

CACHE_CAPACITY = 8


def _parse_cu(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """Boundaries with a leading 0, from either that form or MindSpeed's ends-only form."""
    ends = host_ints(cu_seqlens)
    if not ends or ends == [0]:
        raise CPInputError(f"cu_seqlens is empty ({ends}); it must hold at least one document end")
    return as_cu_list(ends if ends[0] == 0 else [0] + ends)  # a first element of 0 marks the leading-0 form


def _check_args(cu: list[int], cp_size: int, rank: int, layout: str) -> int:
    layout_multiple(layout, cp_size)  # validates layout and cp_size first
    check_rank(rank, cp_size)
    return check_divisible(cu, layout, cp_size)


def _build(cu: list[int], cp_size: int, rank: int, device: torch.device, layout: str, causal: bool) -> dict[str, Any]:
    """Compute the metadata (no caching). See the module docstring for the formulas."""
    P, mult = cp_size, _check_args(cu, cp_size, rank, layout)
    m = mult // P  # local chunks per document: 2 (zigzag) or 1 (contiguous)
    T = cu[-1]
    T_l = T // P
    mine = [rank, 2 * P - 1 - rank] if m == 2 else [rank]

    # --8<-- [start:chunk_start]
    def chunk_start(o_i: int, c_i: int, j: int) -> int:
        """Row of chunk j of a document in the rank-major buffer."""
        s, k = (j, 0) if j < P else (2 * P - 1 - j, 1)  # owner rank, slot
        return s * T_l + o_i + k * c_i
    # --8<-- [end:chunk_start]

    # --8<-- [start:kv_index]
    pieces, q_lens, kv_lens = [], [], []
    o_i = 0  # offset of document i inside every rank's local buffer
    for i in range(len(cu) - 1):
        c_i = (cu[i + 1] - cu[i]) // mult
        if causal:  # one query chunk per entry, seeing chunks 0..j in natural order
            for j in mine:
                pieces += [torch.arange(chunk_start(o_i, c_i, t), chunk_start(o_i, c_i, t) + c_i) for t in range(j + 1)]
                q_lens.append(c_i)
                kv_lens.append((j + 1) * c_i)
        else:  # the rank's chunks of the document form one query sequence seeing it all
            pieces += [torch.arange(chunk_start(o_i, c_i, t), chunk_start(o_i, c_i, t) + c_i) for t in range(mult)]
            q_lens.append(m * c_i)
            kv_lens.append(mult * c_i)
        o_i += m * c_i
    kv_index = torch.cat(pieces).to(device)  # (sum kv_len,) rows of the rank-major K/V
    # --8<-- [end:kv_index]

    cum_q, cum_kv = _cumsum(q_lens), _cumsum(kv_lens)
    return {
        "local_tokens": T_l,
        "global_tokens": T,
        "kv_index": kv_index,
        "actual_seq_qlen": cum_q,
        "actual_seq_kvlen": cum_kv,
        "cu_seqlens_q": torch.tensor([0] + cum_q, dtype=torch.int64, device=device),
        "cu_seqlens_kv": torch.tensor([0] + cum_kv, dtype=torch.int64, device=device),
        "seqs": Varlen([0] + cum_q, [0] + cum_kv),
        "work": sum(a * b for a, b in zip(q_lens, kv_lens)),
    }


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


_CACHE: IdentityLRU[dict[str, Any]] = IdentityLRU(CACHE_CAPACITY)


def get_thd_load_balanced_cp_metadata(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    rank: int,
    device: torch.device | str | None = None,
    *,
    layout: str = "zigzag",
    causal: bool = True,
) -> dict[str, Any]:
    """Metadata of one rank for KV all-gather CP on a packed THD batch (cached).

    Args:
        cu_seqlens: padded document boundaries, with a leading 0 (`[0, 8, 24]`) or in
            MindSpeed's ends-only form (`[8, 24]`); a tensor or a sequence of ints.
        cp_size: the CP group size `P >= 1`.
        rank: this rank, in `[0, P)`.
        device: where `kv_index` and the `cu_seqlens_*` tensors live (default CPU).
        layout: `"zigzag"` (the RFC's symmetric split) or `"contiguous"`.
        causal: causal prefixes (default) or whole documents.

    Returns:
        A dict, shared with the cache: treat it as read-only. Keys in the module docstring.

    Raises:
        AssertionError: (as `CPInputError`, also a `ValueError`) for empty or non-increasing
            `cu_seqlens`, a document length not divisible by the layout's multiple,
            `cp_size < 1` or a rank outside `[0, cp_size)`.

    Examples:
        >>> meta = get_thd_load_balanced_cp_metadata([0, 8], cp_size=2, rank=0)
        >>> meta["actual_seq_qlen"], meta["actual_seq_kvlen"], meta["kv_index"].tolist()
        ([2, 4], [2, 10], [0, 1, 0, 1, 4, 5, 6, 7, 2, 3])
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    extra = (str(device), cp_size, rank, layout, bool(causal))
    return _CACHE.get_or_build(
        cu_seqlens, extra, lambda: _build(_parse_cu(cu_seqlens), cp_size, rank, device, layout, bool(causal))
    )


def clear_cp_metadata_cache() -> None:
    """Empty the metadata cache and reset its statistics."""
    _CACHE.clear()


def cache_info() -> CacheInfo:
    """Hits, misses, current size and capacity of the metadata cache."""
    return _CACHE.info()
