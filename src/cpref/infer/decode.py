r"""Decode over a KV cache spread over the ranks: each rank attends the new queries to its share, the shares merge by lse.

A decode step has a handful of new tokens per sequence (one; or `k` drafted ones under speculative decoding) and a
cache of up to millions. The new tokens' hidden states are small, so every rank of the CP group computes them alike
(the model's layers outside attention run replicated); only the cache is spread ([`KVCache`][cpref.infer.cache]).
Rank $r$ attends every new query to the keys it holds, $K_r$, and returns a partial output and its lse,

$$ \mathrm{lse}_r = \log \sum_{y \in K_r} e^{S_y}, \qquad O_r = \sum_{y \in K_r} e^{S_y - \mathrm{lse}_r}\, v_y , $$

and the rows merge exactly as the ring's blocks do ([the merge][cpref.kernels.merge]):
$\mathrm{lse} = \log \sum_r e^{\mathrm{lse}_r}$, $O = \sum_r e^{\mathrm{lse}_r - \mathrm{lse}} O_r$. A rank that holds
no key a row sees gives $\mathrm{lse}_r = -\infty$ and adds nothing.

A step, on every rank:

1. check the step, alike on every rank and before anything moves: its own arguments (shapes, sequences the cache
   holds, a cache that would overflow), then that every rank passes the same sequences, lengths, new tokens, heads
   and options (a rank a token behind the others would be silently wrong);
2. append the new tokens' K/V to the cache: the rank the layout names keeps each;
3. one kernel call: each new query against this rank's rows it sees (the cached ones, the new ones up to itself,
   within the window), as one sequence per query row;
4. one all-gather of every rank's `(out, lse)`, in float32 (float64 for float64), packed in one tensor:
   $P \cdot N H_q (D_v + 1)$ elements for $N$ new queries;
5. the merge, in rank order, so every rank gets the same bits; the sinks once; rounded once to the input dtype;
6. the window's eviction: what no later query can see is dropped.

The all-gather carries every rank's partial outputs to every rank: each rank sends $(P - 1) N H_q (D_v + 1)$
elements (the cost model's bandwidth-optimal all-gather), which grow with $P$ while its attention work, its share of
the cache, falls as $1 / P$. The step's only other traffic is the check's host exchange of a few integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cpref.base.errors import CPInputError
from cpref.infer.cache import KVCache
from cpref.kernels import Varlen, compute_dtype, default_kernel
from cpref.kernels.merge import merge_partial
from cpref.kernels.sinks import add_sinks
from cpref.modes.consistency import agree, check_same

__all__ = ["decode_attention"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, comm, seqs: Sequence[int],
           sinks: torch.Tensor | None, kernel, softcap: float | None) -> CPInputError | None:  # fmt: skip
    """This rank's arguments, checked without communication: the error every rank will raise, or None."""
    Hkv, D, Dv = cache.heads
    try:
        if comm.size != cache.size or comm.rank != cache.rank:
            raise CPInputError(f"the cache was built for rank {cache.rank} of {cache.size}; this rank is {comm.rank} "
                               f"of {comm.size}: give each rank its own KVCache(rank=comm.rank, size=comm.size)")  # fmt: skip
        seqs = list(seqs)
        if not seqs or len(set(seqs)) != len(seqs):
            raise CPInputError(f"seqs must name each sequence of the step once, got {seqs!r}")
        if q.dim() != 3 or q.shape[-1] != D or q.shape[1] % Hkv or len(q) % len(seqs):
            raise CPInputError(f"q must be (N, Hq, {D}) with Hq a multiple of Hkv = {Hkv} and N new tokens for each "
                               f"of the {len(seqs)} sequences, got {tuple(q.shape)}")  # fmt: skip
        n = len(q) // len(seqs)
        if tuple(k.shape) != (len(q), Hkv, D) or tuple(v.shape) != (len(q), Hkv, Dv):
            raise CPInputError(f"k and v must be ({len(q)}, {Hkv}, {D}) and ({len(q)}, {Hkv}, {Dv}) (the new tokens' "
                               f"keys and values), got {tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
        if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
            raise CPInputError(f"sinks must be ({q.shape[1]},), one per query head, got {tuple(sinks.shape)}")
        missing = [seq for seq in seqs if seq not in cache.sequences]
        if missing:
            raise CPInputError(f"sequences {missing} are not in the cache: prefill their prompt first "
                               f"(cpref.infer.prefill_attention, or write_prompt)")  # fmt: skip
        if softcap is not None and "softcap" not in getattr(kernel, "variants", ()):
            raise CPInputError(f"softcap needs a kernel that lists it in its variants; {type(kernel).__name__} does "
                               f"not: pass kernel=cpref.TorchKernel()")  # fmt: skip
        cache.check_append(dict.fromkeys(seqs, n))
    except CPInputError as error:
        return error
    return None


def _local_call(q: torch.Tensor, cache: KVCache, seqs: list[int], n: int):
    """`(k, v, Varlen)`: for each new query row (sequence by sequence), this rank's rows it sees, one sequence a row."""
    ks, vs, kv_lens = [], [], []
    for seq in seqs:
        k_s, v_s, pos = cache.rows(seq)  # (n_s, Hkv, D), (n_s, Hkv, Dv), (n_s,) increasing
        first = cache.length(seq) - n  # the position of the step's first new token
        for j in range(n):
            p = first + j
            lo = 0 if cache.window is None else p - cache.window
            # the rows at positions lo .. p: a slice of the sorted positions
            a, b = (int(torch.searchsorted(pos, x, right=right)) for x, right in ((lo, False), (p, True)))
            ks.append(k_s[a:b])
            vs.append(v_s[a:b])
            kv_lens.append(b - a)
    seqs_varlen = Varlen.from_lengths([1] * len(q), kv_lens)
    return torch.cat(ks), torch.cat(vs), seqs_varlen  # (sum kv_lens, Hkv, D), (.., Hkv, Dv)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, comm: Any, *,
                     seqs: Sequence[int], kernel: Any = None, scale: float | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None, check_ranks: bool = True) -> torch.Tensor:  # fmt: skip
    """Attend a decode step's new queries over the cache spread on `comm`'s ranks, and append their keys and values.

    Args:
        q: `(N, Hq, D)`, the step's new queries: `n = N / len(seqs)` for each sequence of `seqs`, in that order, the
            same on every rank.
        k: `(N, Hkv, D)`, the new tokens' keys, appended to the cache.
        v: `(N, Hkv, Dv)`, their values.
        cache: this rank's `KVCache` (its layout, rank and size those of `comm`).
        comm: the CP group's collectives.
        seqs: the sequences of the step, each once, each one the cache holds.
        kernel: the attention kernel (default: the device's).
        scale: the logit scale (default `D ** -0.5`).
        sinks: `(Hq,)` learnable sink logits, added once per row after the merge.
        softcap: logit soft-capping's `c` (the kernel must list `"softcap"` in its `variants`).
        check_ranks: compare the step across the ranks first (one host exchange); False skips it.

    Returns:
        `(N, Hq, Dv)` in `q`'s dtype, the same on every rank: each new query attends, causally, the sequence's keys up
        to its own position (within the cache's window).

    Raises:
        CPInputError: on every rank alike, before anything moves, for a step one rank's arguments get wrong or the
            ranks disagree on.
    """
    # 1) check: this rank's arguments, shared so that every rank raises alike; then what the ranks pass
    kernel = default_kernel(q.device) if kernel is None else kernel
    error = _check(q, k, v, cache, comm, seqs, sinks, kernel, softcap)
    if check_ranks:
        agree(comm, error)
        check_same(comm, "decode_attention", {
            "seqs": list(seqs), "lengths": [cache.length(s) for s in seqs], "new queries": tuple(q.shape),
            "heads": cache.heads, "layout": cache.layout, "window": cache.window, "scale": scale,
            "softcap": softcap, "sinks": None if sinks is None else sinks.double().tolist(), "dtype": str(q.dtype)})
    elif error is not None:
        raise error
    seqs = list(seqs)
    n = len(q) // len(seqs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # 2) the new tokens' keys and values: the rank the layout names keeps each
    for i, seq in enumerate(seqs):
        cache.append(seq, k[i * n : (i + 1) * n], v[i * n : (i + 1) * n])
    # 3) this rank's share of every row: one kernel call, a query row a sequence
    k_r, v_r, rows = _local_call(q, cache, seqs, n)
    wide = compute_dtype(q.dtype)
    extra = {} if softcap is None else {"softcap": softcap}
    out_r, lse_r = kernel.forward(q, k_r.to(q.dtype), v_r.to(q.dtype), rows, causal=False, scale=scale,
                                  out_dtype=wide, **extra)  # (N, Hq, Dv), (N, Hq)  # fmt: skip
    # 4) every rank's (out, lse), in one all-gather
    packed = torch.cat([out_r, lse_r.to(wide).unsqueeze(-1)], dim=-1)  # (N, Hq, Dv + 1)
    every = comm.all_gather(packed).view(comm.size, *packed.shape)  # (P, N, Hq, Dv + 1)
    # 5) merge in rank order: the same bits on every rank
    out, lse = every[0, ..., :-1].clone(), every[0, ..., -1].clone()  # (N, Hq, Dv), (N, Hq)
    for r in range(1, comm.size):
        merge_partial(out, lse, every[r, ..., :-1], every[r, ..., -1])
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    # 6) what no later query can see
    for seq in seqs:
        cache.evict(seq)
    return out.to(q.dtype)
