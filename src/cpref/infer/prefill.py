r"""Prefill: a prompt no device holds, attended as the training forward without its backward, its K/V left in the cache.

A prompt of $T$ tokens is sharded over the CP group as for training ([`cpref.Sharding`][cpref.batch.sharding.Sharding], any layout,
packed documents: one sequence each) and attended by any mode of `cpref.attention` under `torch.no_grad()`: nothing
is kept for a backward. Its keys and values then move from the training layout, which balances the causal work of
the prompt, to the **cache layout**, which decode needs ([`cpref.infer.cache`][cpref.infer.cache]): one all-to-all.

Every rank knows where every row goes from the sharding and the cache layout alone (row $x$ of rank $s$ is the
stream's token `sharding.global_index(s)[x]`, of document $i$ at position $p$; it goes to `layout.owner(p)`), so the
all-to-all needs no exchange of counts: each rank sends rank $d$ its rows for $d$, padded to the largest such count
$m$ over every pair of ranks, $P m H_{kv} (D + D_v)$ elements in all. The padding of an EOD-padded batch is not
written. After it, rank $r$ holds its share of every document, $\frac{T}{P} H_{kv} (D + D_v)$ elements with
`CacheLayout("interleaved", 1)`, and never the whole cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cpref.api import attention
from cpref.base.errors import CPInputError
from cpref.batch.sharding import Sharding
from cpref.infer.cache import KVCache
from cpref.modes.consistency import agree

__all__ = ["write_prompt", "prefill_attention"]


def _rows(sharding: Sharding, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(doc, pos)` of each of rank `rank`'s rows, `(T / P,)` each; `pos = -1` for padding."""
    idx = sharding.global_index(rank)  # (T / P,) in the padded stream
    padded = torch.tensor(sharding.cu_seqlens_padded)  # (N + 1,)
    real = torch.tensor(sharding.cu_seqlens)  # (N + 1,)
    doc = torch.searchsorted(padded, idx, right=True) - 1  # (T / P,)
    pos = idx - padded[doc]  # (T / P,) position in its document
    return doc, torch.where(pos < real[doc + 1] - real[doc], pos, -1)


def _plan(sharding: Sharding, cache: KVCache) -> list[list[torch.Tensor]]:
    """`sends[s][d]`: the local rows rank `s` sends rank `d` (indices into its shard), the same on every rank."""
    P, sends = sharding.cp_size, []
    for s in range(P):
        _, pos = _rows(sharding, s)
        to = torch.where(pos >= 0, cache.layout.owner(pos.clamp(min=0), P), -1)  # (T / P,) destination, -1: padding
        sends.append([torch.nonzero(to == d).flatten() for d in range(P)])
    return sends


def write_prompt(k: torch.Tensor, v: torch.Tensor, sharding: Sharding, cache: KVCache, comm: Any, *,
                 seqs: Sequence[int]) -> None:  # fmt: skip
    """Write a prompt's keys and values, sharded as `sharding` shards them, into the cache spread over `comm`'s ranks.

    Args:
        k: this rank's shard of the keys, `(T / P, Hkv, D)`.
        v: its shard of the values, `(T / P, Hkv, Dv)`.
        sharding: the prompt's `cpref.Sharding` (its documents, any layout), the same on every rank.
        cache: this rank's `KVCache`; each document starts a sequence of it.
        comm: the CP group's collectives.
        seqs: the sequence id of each document of the batch, in order.

    Raises:
        CPInputError: on every rank alike before anything moves, for shapes, ids or a cache that would overflow.
    """
    # 1) check, shared so that every rank raises alike
    P, Hkv, D, Dv = comm.size, *cache.heads
    lengths = [b - a for a, b in zip(sharding.cu_seqlens, sharding.cu_seqlens[1:])]
    error = None
    try:
        if sharding.cp_size != P or cache.size != P or cache.rank != comm.rank:
            raise CPInputError(f"the sharding ({sharding.cp_size} ranks), the cache (rank {cache.rank} of {cache.size}) "
                               f"and the group (rank {comm.rank} of {P}) must agree")  # fmt: skip
        n = len(sharding.global_index(comm.rank))
        if tuple(k.shape) != (n, Hkv, D) or tuple(v.shape) != (n, Hkv, Dv):
            raise CPInputError(f"k and v must be this rank's shards, ({n}, {Hkv}, {D}) and ({n}, {Hkv}, {Dv}), got "
                               f"{tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
        seqs = list(seqs)
        if len(seqs) != len(lengths) or len(set(seqs)) != len(seqs):
            raise CPInputError(f"seqs must give each of the batch's {len(lengths)} documents its own id, got {seqs!r}")
        held = [seq for seq in seqs if seq in cache.sequences]
        if held:
            raise CPInputError(f"sequences {held} are already in the cache; drop them first (KVCache.drop)")
        cache.check_append(dict(zip(seqs, lengths)))
    except CPInputError as e:
        error = e
    agree(comm, error)
    # 2) where every row goes, from the sharding and the layout alone
    sends = _plan(sharding, cache)
    m = max(len(rows) for per_rank in sends for rows in per_rank)  # the largest count over every pair of ranks
    kv = torch.cat([k.detach(), v.detach()], dim=-1).to(cache.dtype)  # (T / P, Hkv, D + Dv)
    out = kv.new_zeros(P, m, Hkv, D + Dv)  # (P, m, Hkv, D + Dv): chunk d for rank d, padded
    for d, rows in enumerate(sends[comm.rank]):
        out[d, : len(rows)] = kv[rows]
    # 3) one all-to-all: chunk s of what arrives holds rank s's rows for this rank
    got = comm.all_to_all(out.view(P * m, Hkv, D + Dv)).view(P, m, Hkv, D + Dv)
    # 4) this rank's rows of each document, in position order
    docs, positions, rows = [], [], []
    for s in range(P):
        doc, pos = _rows(sharding, s)
        mine = sends[s][comm.rank]  # (n_s,) rank s's rows that came here, in its order
        docs.append(doc[mine])
        positions.append(pos[mine])
        rows.append(got[s, : len(mine)])
    doc, pos, kv_got = torch.cat(docs), torch.cat(positions), torch.cat(rows)  # (n,), (n,), (n, Hkv, D + Dv)
    for i, seq in enumerate(seqs):
        at = torch.nonzero(doc == i).flatten()
        order = at[torch.argsort(pos[at])]
        cache.write(seq, kv_got[order, :, :D], kv_got[order, :, D:], pos[order], lengths[i])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharding: Sharding, cache: KVCache,
                      comm: Any, *, seqs: Sequence[int], mode: str, **options: Any) -> torch.Tensor:  # fmt: skip
    """Attend a prompt sharded as `sharding` shards it, forward only (nothing kept for a backward), with `mode` and its
    `options` as `cpref.attention` takes them, and write its keys and values into `cache` (`write_prompt`).

    The cache's window, if it has one, is the attention's: `window=(W, 0)`, causal. Returns this rank's output shard,
    `(T / P, Hq, Dv)`.
    """
    error = None
    if cache.window is not None:
        if options.get("window", (cache.window, 0)) != (cache.window, 0):
            error = CPInputError(f"window={options['window']!r} is not the cache's window ({cache.window}, 0); leave "
                                 f"it out or give that one")  # fmt: skip
        options = {**options, "window": (cache.window, 0)}
    agree(comm, error)
    with torch.no_grad():
        out = attention(q, k, v, sharding, comm=comm, mode=mode, **options)
    write_prompt(k, v, sharding, cache, comm, seqs=seqs)
    return out
