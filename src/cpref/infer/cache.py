r"""A KV cache spread over the ranks of a CP group: each rank holds its share of every sequence's keys and values.

Serving a long context, the cache outgrows one device as the activations of training do. CP keeps it spread: rank
$r$ holds the tokens the **cache layout** gives it, and never the whole cache. Two layouts, as the serving systems
use them:

| layout | token $t$ on rank | who uses it |
| --- | --- | --- |
| `CacheLayout("interleaved", I)` | $\lfloor t / I \rfloor \bmod P$ | vLLM's decode CP (`cp_kv_cache_interleave_size`); $I = 1$ is SGLang's |
| `CacheLayout("contiguous", C)` | $\lfloor t / C \rfloor$, at most $P - 1$ | a sequence's first $C$ tokens on rank 0, the next $C$ on rank 1, ... |

Interleaved spreads every stretch of a sequence over every rank, so a decode step's work is even whatever the
sequence's length, and a new token lands on each rank in turn. Contiguous keeps a rank's tokens adjacent, and fills
rank $P - 1$ last: a cache of $P \cdot C$ tokens a sequence at most (a longer one is refused, naming $C$).

A rank's share of a sequence of $L$ tokens is $\lceil L / P \rceil$ tokens or fewer in the interleaved layout with
$I = 1$, so its memory is $\frac{L}{P} H_{kv} (D + D_v)$ elements per sequence and layer. Under a sliding window of
$W$ keys (`window=W`: a query at position $p$ sees $p - W \dots p$) a rank keeps only what a later query can still
see: positions $\ge L - W$, at most $\lceil (W + 1) / P \rceil$ per sequence with $I = 1$.

[`KVCache`][cpref.infer.cache.KVCache] is one rank's share, for one layer: `append` takes a sequence's next tokens
(the same on every rank, as a decode step computes them) and keeps the rows the layout gives this rank. Every rank
can tell what every other holds from the lengths alone, so a step that would overflow a rank's `max_tokens` is
refused on every rank alike, before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpref.base.errors import CPInputError

__all__ = ["CACHE_KINDS", "CacheLayout", "KVCache"]

CACHE_KINDS = ("interleaved", "contiguous")


@dataclass(frozen=True)
class CacheLayout:
    """Which rank holds token `t` of a sequence.

    Attributes:
        kind: `"interleaved"` (blocks of `size` tokens dealt to the ranks in turn) or `"contiguous"` (`size` tokens
            a rank, rank 0 first).
        size: interleaved: the block `I` (1: token `t` on rank `t mod P`); contiguous: the tokens `C` a rank holds
            of a sequence, its capacity.
    """

    kind: str = "interleaved"
    size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise CPInputError(f"CacheLayout kind {self.kind!r} is not one of {CACHE_KINDS}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise CPInputError(f"CacheLayout size must be an int >= 1 (tokens), got {self.size!r}")

    def owner(self, positions: torch.Tensor, P: int) -> torch.Tensor:
        """The rank holding each of `positions` (an int64 tensor) in a group of `P` ranks; contiguous positions past
        `P * size` give `P` or more (see `longest`)."""
        if self.kind == "interleaved":
            return torch.div(positions, self.size, rounding_mode="floor") % P
        return torch.div(positions, self.size, rounding_mode="floor")

    def longest(self, P: int) -> int | None:
        """The most tokens a sequence may have over `P` ranks (None: no bound)."""
        return P * self.size if self.kind == "contiguous" else None

    def held(self, rank: int, P: int, start: int, stop: int) -> int:
        """How many of the positions `start .. stop - 1` rank `rank` holds."""
        if stop <= start:
            return 0
        return int((self.owner(torch.arange(start, stop), P) == rank).sum())


@dataclass
class _Sequence:
    k: torch.Tensor  # (n, Hkv, D) this rank's rows, in position order
    v: torch.Tensor  # (n, Hkv, Dv)
    positions: torch.Tensor  # (n,) int64, increasing
    length: int  # tokens of the sequence, over every rank
    kept_from: int = 0  # the first position a later query can still see (a window evicts the rest)


@dataclass
class KVCache:
    """One rank's share of one layer's K/V cache, over a batch of sequences.

    Attributes:
        layout: the `CacheLayout` every rank of the group uses.
        rank: this rank's index in the CP group.
        size: the CP group's size `P`.
        heads: `(Hkv, D, Dv)`: key/value heads, key and value head dims.
        dtype: the dtype of the cached keys and values.
        device: where they live.
        window: `W`, a causal sliding window of `W + 1` keys (the query's own and the `W` before it), or None; the
            cache then keeps only what a later query can see.
        max_tokens: the most rows a rank may hold over all its sequences (the memory the user gives), or None.
    """

    layout: CacheLayout
    rank: int
    size: int
    heads: tuple[int, int, int]
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    window: int | None = None
    max_tokens: int | None = None
    sequences: dict[int, _Sequence] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, CacheLayout):
            raise CPInputError(f"KVCache layout must be a cpref.infer.CacheLayout, got {type(self.layout).__name__}")
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise CPInputError(f"KVCache needs 0 <= rank < size, got rank {self.rank!r} of size {self.size!r}")
        if len(self.heads) != 3 or any(not isinstance(n, int) or n < 1 for n in self.heads):
            raise CPInputError(f"KVCache heads must be (Hkv, D, Dv), positive ints, got {self.heads!r}")
        for name in ("window", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise CPInputError(f"KVCache {name} must be None or an int >= 0, got {value!r}")

    # -- what every rank holds, from the lengths alone ----------------------------------------------------------

    def length(self, seq: int) -> int:
        """The tokens of sequence `seq` so far, over every rank (0 for a sequence it does not hold)."""
        return self.sequences[seq].length if seq in self.sequences else 0

    def _kept_from(self, length: int) -> int:
        """The first position the next query (at `length`) can still see."""
        return 0 if self.window is None else max(0, length - self.window)

    def rows_after(self, grow: dict[int, int], rank: int | None = None) -> int:
        """The rows rank `rank` (default: this one) holds over every sequence once each `seq` of `grow` has grown by
        `grow[seq]` tokens, counting the rows a step holds before its window evicts."""
        rank = self.rank if rank is None else rank
        total = 0
        for seq in set(self.sequences) | set(grow):
            length, new = self.length(seq), grow.get(seq, 0)
            start = self.sequences[seq].kept_from if seq in self.sequences else 0  # what the last eviction left
            total += self.layout.held(rank, self.size, start, length + new)
        return total

    def check_append(self, grow: dict[int, int]) -> None:
        """Raise the `CPInputError` an `append` of `grow[seq]` tokens to each `seq` would: a contiguous cache too
        short, a rank over `max_tokens`. Every rank decides the same from the lengths (no communication)."""
        longest = self.layout.longest(self.size)
        for seq, new in grow.items():
            if new < 0:
                raise CPInputError(f"sequence {seq}: {new} new tokens; give 0 or more")
            if longest is not None and self.length(seq) + new > longest:
                raise CPInputError(
                    f"sequence {seq} would hold {self.length(seq) + new} tokens, more than the contiguous cache's "
                    f"P x C = {self.size} x {self.layout.size} = {longest}; give CacheLayout('contiguous', C) with "
                    f"C >= {-(-(self.length(seq) + new) // self.size)}, or an interleaved layout")
        if self.max_tokens is not None:
            rows = [self.rows_after(grow, r) for r in range(self.size)]
            if max(rows) > self.max_tokens:
                r = rows.index(max(rows))
                raise CPInputError(
                    f"rank {r} would hold {rows[r]} cached tokens, over its max_tokens = {self.max_tokens}; give a "
                    f"larger max_tokens, more ranks, a window, or drop sequences that are done (KVCache.drop)")

    # -- this rank's rows ----------------------------------------------------------------------------------------

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add sequence `seq`'s next `n` tokens, `k (n, Hkv, D)` and `v (n, Hkv, Dv)`, the same on every rank: this
        rank keeps the rows the layout gives it (positions `length .. length + n - 1`)."""
        Hkv, D, Dv = self.heads
        if k.dim() != 3 or tuple(k.shape[1:]) != (Hkv, D) or v.dim() != 3 or tuple(v.shape[1:]) != (Hkv, Dv) \
                or len(k) != len(v):  # fmt: skip
            raise CPInputError(f"KVCache.append: k must be (n, {Hkv}, {D}) and v (n, {Hkv}, {Dv}), got "
                               f"{tuple(k.shape)} and {tuple(v.shape)}")  # fmt: skip
        self.check_append({seq: len(k)})
        old = self.sequences.get(seq)
        length = old.length if old else 0
        positions = torch.arange(length, length + len(k))  # (n,)
        mine = self.layout.owner(positions, self.size) == self.rank  # (n,)
        # the cache holds values, never autograd history  # (n_r, Hkv, D), (n_r, Hkv, Dv)
        k_new, v_new = (x.detach()[mine].to(device=self.device, dtype=self.dtype) for x in (k, v))
        if old is None:
            self.sequences[seq] = _Sequence(k_new, v_new, positions[mine], length + len(k))
        else:
            old.k, old.v = torch.cat([old.k, k_new]), torch.cat([old.v, v_new])
            old.positions = torch.cat([old.positions, positions[mine]])
            old.length = length + len(k)

    def write(self, seq: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Start sequence `seq` of `length` tokens with this rank's rows of it, `k (n, Hkv, D)`, `v (n, Hkv, Dv)` at
        `positions (n,)` (increasing, each one the layout gives this rank): what a prompt's prefill leaves."""
        if seq in self.sequences:
            raise CPInputError(f"sequence {seq} is already in the cache; drop it first (KVCache.drop) to write it anew")
        self.check_append({seq: length})
        mine = self.layout.owner(torch.arange(length), self.size) == self.rank  # (length,)
        if not torch.equal(positions.cpu(), torch.arange(length)[mine]):
            raise CPInputError(f"sequence {seq}: rank {self.rank} must be written exactly the positions its layout "
                               f"gives it, in order")  # fmt: skip
        self.sequences[seq] = _Sequence(k.detach().to(device=self.device, dtype=self.dtype),
                                        v.detach().to(device=self.device, dtype=self.dtype), positions.cpu(), length)  # fmt: skip
        self.evict(seq)

    def evict(self, seq: int) -> None:
        """Drop the rows of `seq` no later query can see (under a window); nothing without one."""
        s = self.sequences[seq]
        s.kept_from = self._kept_from(s.length)
        keep = s.positions >= s.kept_from  # (n,)
        if not bool(keep.all()):
            s.k, s.v, s.positions = s.k[keep], s.v[keep], s.positions[keep]

    def drop(self, seq: int) -> None:
        """Forget sequence `seq` (a finished request), on every rank alike."""
        self.sequences.pop(seq, None)

    def rows(self, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k (n, Hkv, D), v (n, Hkv, Dv), positions (n,))`: this rank's rows of `seq`, in position order."""
        s = self.sequences[seq]
        return s.k, s.v, s.positions

    def tokens(self) -> int:
        """The rows this rank holds, over every sequence."""
        return sum(len(s.positions) for s in self.sequences.values())

    def nbytes(self) -> int:
        """The bytes of this rank's keys and values."""
        return sum(s.k.nbytes + s.v.nbytes for s in self.sequences.values())
