r"""Load-balanced THD metadata for KV all-gather CP, and its LRU cache.

After the all-gather, every rank holds K and V of the whole packed stream, but in
**rank-major** order: rank 0's local tokens, then rank 1's, and so on. Rather than
reorder the whole stream back to natural order (and restore it afterwards), each rank builds
one index, `kv_index`, that picks out of the rank-major buffer exactly the keys each of its
query chunks needs, *in natural order*. One `index_select` then feeds one fused varlen
attention call for all of the rank's chunks.

## Where a chunk lives in the rank-major buffer

Let `T_l = T / P` be the local token count, `c_i` the chunk size of document `i`, and
`o_i` the offset of document `i` inside every rank's local buffer: every rank holds $L/P$
tokens of a document of $L$ tokens, so $o_i = \sum_{i' < i} L_{i'} / P$. Chunk `j` of
document `i` is owned by rank $r'$, at slot $\kappa$ (0 or 1) of that rank's chunks of the
document:

$$ \text{zigzag: } (r', \kappa) = \begin{cases} (j, 0) & j < P \\ (2P - 1 - j, 1) & j \ge P
\end{cases} \qquad \text{contiguous: } (r', \kappa) = (j, 0) $$

and starts at row $r' T_l + o_i + \kappa\, c_i$ of the gathered buffer.

--8<-- "src/cpref/metadata.py:chunk_start"

## The causal prefix of a query chunk

Under a causal mask, query chunk `j` needs the keys of chunks `0..j` of its document, in that
order: a prefix of `(j + 1) c_i` keys. Its last query is aligned with its last key, which is
exactly the kernel contract's bottom-right causal mask, so no offsets are needed. Without a
causal mask, the rank's chunks of a document form one query sequence that sees the whole
document.

--8<-- "src/cpref/metadata.py:kv_index"

## Padding

With `cu_seqlens_padded` (see [`cpref.seqlens`][cpref.seqlens]), a document of `n` real
tokens is sharded by its padded length, and its padding (positions `n` and later) must stay
out of attention. Padding is a suffix of the document, so the real queries of a query chunk
are a prefix of it, and so are the real queries of a rank's chunks of a document in local
order (if chunk `r` holds padding, chunk `2P - 1 - r` holds nothing else). Each query
sequence is therefore cut in two: its real queries, with keys that end at the last real
query (causal) or at `n` (not causal), so that no padding key is ever selected; and its
padding queries, as a sequence with **no keys**, which the kernel contract answers with
`out = 0`, `lse = -inf` and zero gradients. Without padding nothing changes.

## The metadata

[`AllGatherPlan`][cpref.metadata.AllGatherPlan] is immutable (the ranks of the simulated
cluster share it); `get_thd_load_balanced_cp_metadata` returns a read-only view of it with
the RFC's keys:

| key | meaning |
| --- | --- |
| `local_tokens`, `global_tokens` | `T / P` and `T` (padded) |
| `kv_index` | LongTensor on `device`: rows of the rank-major K/V, one key sequence per query sequence |
| `seqs` | the kernel's [`Varlen`][cpref.kernels.contract.Varlen]: host lengths of the query and key sequences |
| `actual_seq_qlen`, `actual_seq_kvlen` | cumulative lengths **without a leading 0** (the NPU's TND lists) |
| `cu_seqlens_q`, `cu_seqlens_kv` | the same with a leading 0, int64 on `device` |
| `work` | `sum(q_len * kv_len)` over the query sequences: this rank's attention work (block metric) |

**`P = 1`.** A single rank holds every document whole and in natural order (both layouts), so
its own K/V already are the keys in the right order. The plan then also carries `local_seqs`:
each document as one sequence over the local stream (its padding keys seen by no query, its
padding queries seeing no key), which lets the all-gather mode skip the gather, the select and
the `index_add_`. The RFC keys above are unchanged.

## The cache

Transformer layers call attention with the same `cu_seqlens` many times per step, so the
metadata lives in the batch cache ([`cpref.cache`][cpref.cache]): an LRU of capacity 8
batches keyed by each boundary tensor's **identity and version** (an in-place edit of
`cu_seqlens` invalidates it; lists of ints are keyed by value), holding per batch the plan of
every (`cp_size`, rank, layout, causality, device) asked for. It holds only lengths and
indices, never Q/K/V. The arguments are validated on every call, cached or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from cpref.cache import CACHE, CacheInfo, cache_info, clear_cache
from cpref.checks import as_bool, as_choice, as_int
from cpref.errors import CPInputError
from cpref.kernels.contract import Varlen
from cpref.layout import LAYOUTS, chunk_ids, chunk_owner
from cpref.seqlens import Boundaries

__all__ = [
    "AllGatherPlan",
    "all_gather_plan",
    "build_all_gather_plan",
    "get_thd_load_balanced_cp_metadata",
    "clear_cp_metadata_cache",
    "cache_info",
    "CacheInfo",
    "CACHE_CAPACITY",
    "as_device",
]

CACHE_CAPACITY = CACHE.capacity


@dataclass(frozen=True)
class AllGatherPlan:
    """One rank's metadata for KV all-gather CP (immutable; see the module docstring).

    Attributes:
        local_tokens: `T / P`.
        global_tokens: `T` (padded).
        kv_index: `(sum kv_len,)` rows of the rank-major K/V each key sequence reads, on the device.
        seqs: the kernel call's query and key sequences, host lengths.
        work: `sum(q_len * kv_len)` over the sequences.
        local_seqs: `P = 1` only (else None): the documents as sequences over the local K/V
            themselves, for a call without gather or select.
    """

    local_tokens: int
    global_tokens: int
    kv_index: torch.Tensor
    seqs: Varlen
    work: int
    local_seqs: Varlen | None = None

    @property
    def kernel_seqs(self) -> Varlen:
        """The sequences of the mode's kernel call: `local_seqs` at `P = 1`, else `seqs`."""
        return self.seqs if self.local_seqs is None else self.local_seqs

    def as_mapping(self) -> Mapping[str, Any]:
        """A read-only view with the MindSpeed RFC's keys."""
        device = self.kv_index.device
        return MappingProxyType({
            "local_tokens": self.local_tokens,
            "global_tokens": self.global_tokens,
            "kv_index": self.kv_index,
            "seqs": self.seqs,
            "actual_seq_qlen": self.seqs.actual_seq_qlen,
            "actual_seq_kvlen": self.seqs.actual_seq_kvlen,
            "cu_seqlens_q": self.seqs.tensor("cu_q", device),
            "cu_seqlens_kv": self.seqs.tensor("cu_kv", device),
            "work": self.work,
        })  # fmt: skip


def build_all_gather_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, device: torch.device) -> AllGatherPlan:
    """Compute one rank's plan (no caching). See the module docstring for the formulas."""
    mult = b.check_divisible(layout, P)
    m = mult // P  # local chunks per document: 2 (zigzag) or 1 (contiguous)
    T_l = b.total // P

    # --8<-- [start:chunk_start]
    def chunk_start(o_i: int, c_i: int, j: int) -> int:
        """Row of chunk j of a document in the rank-major buffer."""
        s, k = chunk_owner(j, P, layout)  # owner rank, slot
        return s * T_l + o_i + k * c_i
    # --8<-- [end:chunk_start]

    def prefix(o_i: int, c_i: int, n_keys: int) -> list[torch.Tensor]:
        """Rows of the document's first `n_keys` keys, in natural order."""
        return [torch.arange(chunk_start(o_i, c_i, t), chunk_start(o_i, c_i, t) + min(c_i, n_keys - t * c_i))
                for t in range(-(-n_keys // c_i))]  # fmt: skip

    # --8<-- [start:kv_index]
    pieces, q_lens, kv_lens = [], [], []

    def add(n_q: int, keys: list[torch.Tensor]) -> None:
        n_k = sum(len(x) for x in keys)
        if n_q and n_k == 0 and q_lens and kv_lens[-1] == 0:
            q_lens[-1] += n_q  # padding rows next to padding rows: one sequence with no keys
        elif n_q:
            pieces.extend(keys)
            q_lens.append(n_q)
            kv_lens.append(n_k)

    o_i = 0  # offset of document i inside every rank's local buffer
    for i in range(b.num_docs):
        c_i, n = b.padded_len(i) // mult, b.real_len(i)  # chunk size, real tokens
        mine = chunk_ids(rank, P, layout)
        real = [min(max(n - j * c_i, 0), c_i) for j in mine]  # real queries of each local chunk
        if causal:  # each chunk's real queries see the prefix up to its last real query
            for j, r_j in zip(mine, real):
                add(r_j, prefix(o_i, c_i, j * c_i + r_j) if r_j else [])
                add(c_i - r_j, [])  # its padding queries see nothing
        else:  # the rank's real queries of the document see every real key of it
            add(sum(real), prefix(o_i, c_i, n) if sum(real) else [])
            add(m * c_i - sum(real), [])
        o_i += m * c_i
    kv_index = (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)).to(device)  # (sum kv_len,)
    # --8<-- [end:kv_index]

    seqs = Varlen.from_lengths(q_lens, kv_lens)
    local_seqs = _whole_documents(b) if P == 1 else None
    return AllGatherPlan(T_l, b.total, kv_index, seqs, sum(a * z for a, z in zip(q_lens, kv_lens)), local_seqs)


def _whole_documents(b: Boundaries) -> Varlen:
    """Every document as one sequence of the local stream (`P = 1`): real queries see its real keys."""
    q_lens, kv_lens = [], []
    for i in range(b.num_docs):
        n, pad = b.real_len(i), b.padded_len(i) - b.real_len(i)
        # (n, n): the document; (0, pad): its padding keys, seen by no query; (pad, 0): its padding queries
        for n_q, n_k in ((n, n), (0, pad), (pad, 0)):
            if n_q or n_k:
                q_lens.append(n_q)
                kv_lens.append(n_k)
    return Varlen.from_lengths(q_lens, kv_lens)


def as_device(device: Any) -> torch.device:
    """`device` as a `torch.device` (default CPU), or a clear error."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CPInputError(f"device {device!r} is not a torch device ({exc}); pass e.g. 'cpu' or 'cuda:0'") from None


def all_gather_plan(entry, P: int, rank: int, layout: str, causal: bool, device: torch.device) -> AllGatherPlan:
    """The cached plan of one rank for a batch entry of `cpref.cache`."""
    key = ("all_gather", P, rank, layout, causal, str(device))
    return entry.plan(key, lambda: build_all_gather_plan(entry.bounds, P, rank, layout, causal, device))


def get_thd_load_balanced_cp_metadata(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    rank: int,
    device: torch.device | str | None = None,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
) -> Mapping[str, Any]:
    """Metadata of one rank for KV all-gather CP on a packed THD batch (cached).

    Args:
        cu_seqlens: document boundaries, with a leading 0 (`[0, 8, 24]`) or in MindSpeed's
            ends-only form (`[8, 24]`); a tensor or a sequence of ints. The real boundaries
            when `cu_seqlens_padded` is given, else the padded ones.
        cp_size: the CP group size `P >= 1`.
        rank: this rank, in `[0, P)`.
        device: where `kv_index` and the `cu_seqlens_*` tensors live (default CPU).
        layout: `"zigzag"` (the RFC's symmetric split) or `"contiguous"`.
        causal: causal prefixes (default) or whole documents.
        cu_seqlens_padded: the padded boundaries that define the shards, if there is padding.

    Returns:
        A read-only mapping (shared by the cache). Keys in the module docstring.

    Raises:
        AssertionError: (as `CPInputError`, also a `ValueError`) for invalid boundaries, a
            document length not divisible by the layout's multiple, `cp_size < 1` or a rank
            outside `[0, cp_size)`; checked on every call, cached or not.

    Examples:
        >>> meta = get_thd_load_balanced_cp_metadata([0, 8], cp_size=2, rank=0)
        >>> meta["actual_seq_qlen"], meta["actual_seq_kvlen"], meta["kv_index"].tolist()
        ([2, 4], [2, 10], [0, 1, 0, 1, 4, 5, 6, 7, 2, 3])
    """
    P = as_int("cp_size", cp_size, lo=1)
    rank = as_int("rank", rank, lo=0, hi=P)
    layout, causal, device = as_choice("layout", layout, LAYOUTS), as_bool("causal", causal), as_device(device)
    entry = CACHE.entry(cu_seqlens, cu_seqlens_padded, ends_only_ok=True)
    return all_gather_plan(entry, P, rank, layout, causal, device).as_mapping()


def clear_cp_metadata_cache() -> None:
    """Empty the batch cache (metadata of every mode, validated boundaries) and reset its statistics."""
    clear_cache()
