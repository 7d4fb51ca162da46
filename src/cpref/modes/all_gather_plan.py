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

--8<-- "src/cpref/modes/all_gather_plan.py:chunk_start"

## The causal prefix of a query chunk

Under a causal mask, query chunk `j` needs the keys of chunks `0..j` of its document, in that
order: a prefix of `(j + 1) c_i` keys. Its last query is aligned with its last key, which is
exactly the kernel contract's bottom-right causal mask, so no offsets are needed. Without a
causal mask, the rank's chunks of a document form one query sequence that sees the whole
document.

--8<-- "src/cpref/modes/all_gather_plan.py:kv_index"

## Padding

With `cu_seqlens_padded` (see [`cpref.batch.seqlens`][cpref.batch.seqlens]), a document of `n` real
tokens is sharded by its padded length, and its padding (positions `n` and later) must stay
out of attention. Padding is a suffix of the document, so the real queries of a query chunk
are a prefix of it, and so are the real queries of a rank's chunks of a document in local
order (if chunk `r` holds padding, chunk `2P - 1 - r` holds nothing else). Each query
sequence is therefore cut in two: its real queries, with keys that end at the last real
query (causal) or at `n` (not causal), so that no padding key is ever selected; and its
padding queries, as a sequence with **no keys**, which the kernel contract answers with
`out = 0`, `lse = -inf` and zero gradients. Without padding nothing changes.

## The metadata

[`AllGatherPlan`][cpref.modes.all_gather_plan.AllGatherPlan] is immutable (the ranks of the
simulated cluster share it); the MindSpeed facade
[`get_thd_load_balanced_cp_metadata`][cpref.modes.metadata.get_thd_load_balanced_cp_metadata] returns a
read-only view of it with the RFC's keys:

| key | meaning |
| --- | --- |
| `local_tokens`, `global_tokens` | `T / P` and `T` (padded) |
| `kv_index` | LongTensor on `device`: rows of the rank-major K/V, one key sequence per query sequence |
| `seqs` | the kernel's [`Varlen`][cpref.kernels.contract.Varlen]: host lengths of the query and key sequences |
| `actual_seq_qlen`, `actual_seq_kvlen` | cumulative lengths **without a leading 0** (the NPU's TND lists) |
| `cu_seqlens_q`, `cu_seqlens_kv` | the same with a leading 0, int64 on `device` |
| `work` | `sum(q_len * kv_len)` over the query sequences: this rank's attention work (block metric) |

**`P = 1`.** A single rank holds every document whole and in natural order, so its own K/V
already are the keys in the right order: the mode's plan at `P = 1` has no `kv_index` and its
sequences are the documents over the local stream
([`whole_documents`][cpref.modes.shared.whole_documents]: padding keys seen by no query,
padding queries seeing no key), so the mode skips the gather, the select and the `index_add_`.
The facade's RFC keys are those of the selecting plan at every `P`.

## The cache

Transformer layers call attention with the same batch many times per step, so the plan, like
the ring's, lives in the batch cache ([`cpref.batch.cache`][cpref.batch.cache]): an LRU of capacity 8
batches keyed by each boundary tensor's **identity and version** (an in-place edit of
`cu_seqlens` invalidates it; lists of ints are keyed by value), holding per batch the plan of
every (`cp_size`, rank, layout, causality, device) asked for. It holds only lengths and
indices, never Q/K/V. The arguments are validated on every call, cached or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from cpref.batch.layout import chunk_ids, chunk_owner
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import NO_WINDOW, Varlen

__all__ = ["AllGatherPlan", "build_all_gather_plan"]


@dataclass(frozen=True)
class AllGatherPlan:
    """One rank's metadata for KV all-gather CP (immutable; see the module docstring).

    Attributes:
        kv_index: `(sum kv_len,)` rows of the rank-major K/V each key sequence reads, on the device;
            None where the local K/V are the keys as they are (the mode's plan at `P = 1`).
        seqs: the kernel call's query and key sequences, host lengths (with explicit shifts
            where a window's key range does not end at its queries' end).
        window: the kernel call's `(left, right)` window (`(-1, -1)`: none).
        shared: None: the all-gather moves every rank's whole shard and `kv_index` points into the rank-major
            buffer (the chunked layouts). Else the rows of the local shard that other ranks read, which alone
            are gathered, zero-padded to `gathered_rows` on every rank; `kv_index` then points into the local
            shard followed by the gathered rows, rank-major (`cpref.modes.all_gather_pieces`).
        gathered_rows: the rows every rank contributes to the all-gather (with `shared`).
        kv_rows: `kv_index` on the host, as the plan built it (the overlap's split reads it there: no copy back
            from a device, and none from the planner's meta tensors, `sim.plan.dry`).
    """

    kv_index: torch.Tensor | None
    seqs: Varlen
    window: tuple[int, int] = NO_WINDOW
    shared: torch.Tensor | None = None
    gathered_rows: int = 0
    kv_rows: torch.Tensor | None = None

    def as_mapping(self, P: int) -> Mapping[str, Any]:
        """A read-only view with the MindSpeed RFC's keys (of a selecting plan, over `P` ranks)."""
        device = self.kv_index.device
        cu_q, cu_kv = self.seqs.cu_q, self.seqs.cu_kv
        q_lens = [z - a for a, z in zip(cu_q, cu_q[1:])]
        kv_lens = [z - a for a, z in zip(cu_kv, cu_kv[1:])]
        return MappingProxyType({
            "local_tokens": sum(q_lens),
            "global_tokens": P * sum(q_lens),
            "kv_index": self.kv_index,
            "seqs": self.seqs,
            "actual_seq_qlen": self.seqs.actual_seq_qlen,
            "actual_seq_kvlen": self.seqs.actual_seq_kvlen,
            "cu_seqlens_q": self.seqs.tensor("cu_q", device),
            "cu_seqlens_kv": self.seqs.tensor("cu_kv", device),
            "work": sum(n_q * n_k for n_q, n_k in zip(q_lens, kv_lens)),
        })  # fmt: skip


def build_all_gather_plan(b: Boundaries, P: int, rank: int, layout: str, causal: bool, device: torch.device,
                          window: tuple[int, int] = NO_WINDOW) -> AllGatherPlan:  # fmt: skip
    """Compute one rank's selecting plan (no caching). See the module docstring for the formulas."""
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

    def span(o_i: int, c_i: int, lo: int, hi: int) -> list[torch.Tensor]:
        """Rows of the document's keys at positions `[lo, hi)`, in natural order (a window's keys)."""
        return [torch.arange(chunk_start(o_i, c_i, t) + max(lo - t * c_i, 0), chunk_start(o_i, c_i, t) + min(hi - t * c_i, c_i))
                for t in range(lo // c_i, -(-hi // c_i))]  # fmt: skip

    # --8<-- [start:kv_index]
    pieces, q_lens, kv_lens, shifts = [], [], [], []

    def add(n_q: int, keys: list[torch.Tensor], shift: int | None = None) -> None:
        n_k = sum(len(x) for x in keys)
        if n_q and n_k == 0 and q_lens and kv_lens[-1] == 0:
            q_lens[-1] += n_q  # padding rows next to padding rows: one sequence with no keys
            shifts[-1] = -q_lens[-1]
        elif n_q:
            pieces.extend(keys)
            q_lens.append(n_q)
            kv_lens.append(n_k)
            shifts.append(n_k - n_q if shift is None else shift)  # bottom-right unless given

    o_i = 0  # offset of document i inside every rank's local buffer
    for i in range(b.num_docs):
        c_i, n = b.padded_len(i) // mult, b.real_len(i)  # chunk size, real tokens
        mine = chunk_ids(rank, P, layout)
        real = [b.real_in(i, j * c_i, (j + 1) * c_i) for j in mine]  # real queries of each local chunk
        if window != NO_WINDOW:  # each chunk's real queries [a, z) see the keys [a - left, z + right) of the document
            left, right = window
            for j, r_j in zip(mine, real):
                a, z = j * c_i, j * c_i + r_j
                lo, hi = (0 if left < 0 else max(0, a - left)), (n if right < 0 else min(n, z + right))
                add(r_j, span(o_i, c_i, lo, hi) if r_j else [], a - lo)  # query a stands at key a - lo
                add(c_i - r_j, [])
        elif causal:  # each chunk's real queries see the prefix up to its last real query
            for j, r_j in zip(mine, real):
                add(r_j, prefix(o_i, c_i, j * c_i + r_j) if r_j else [])
                add(c_i - r_j, [])  # its padding queries see nothing
        else:  # the rank's real queries of the document see every real key of it
            add(sum(real), prefix(o_i, c_i, n) if sum(real) else [])
            add(m * c_i - sum(real), [])
        o_i += m * c_i
    kv_rows = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)  # (sum kv_len,), on the host
    kv_index = kv_rows.to(device)
    # --8<-- [end:kv_index]

    seqs = Varlen.from_lengths(q_lens, kv_lens, shifts if window != NO_WINDOW else None)
    return AllGatherPlan(kv_index, seqs, window, kv_rows=kv_rows)
