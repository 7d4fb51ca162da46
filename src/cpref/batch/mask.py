r"""Masks: which keys each query of the packed batch sees, as a list of slices.

Text pretraining needs one mask: causal inside each document. The workloads that need long
context most need others: a multimodal model attends bidirectionally inside an image's tokens
and causally elsewhere; a prefix-LM's prompt sees itself whole; an RL batch packs one prompt
before several answers that each see the prompt and themselves only, a mask that crosses the
boundaries between documents. A `Mask` says any of them, as MagiAttention does: a **union of
slices** $(q_0, q_1, k_0, k_1, \text{kind})$ over the global token indices of the real (unpadded)
packed batch, each a rectangle of the score matrix cut by the kind's diagonals. With local
indices $i = x - q_0$ and $j = y - k_0$, $L_q = q_1 - q_0$, $L_k = k_1 - k_0$:

| kind | query $i$ sees key $j$ iff | drawn |
| --- | --- | --- |
| `full` | always | the whole rectangle |
| `causal` | $j \le i + L_k - L_q$ | below the diagonal through the bottom-right corner (the kernel contract's causal) |
| `inv_causal` | $j \ge i$ | above the diagonal through the top-left corner |
| `bi_causal` | both | the band between them |

A pair two slices cover counts once (write a causal document and a full image span inside it,
and the span is bidirectional); a query no slice reaches sees nothing and gives 0, as padding
does. Windows and chunks are masks too: a causal window of $w$ keys before each query is a
`causal` slice over the first $w + 1$ rows and a `bi_causal` one of width $w + 1$ below it.

`.slices` is the mask **normalised**: the same pairs as disjoint slices of the four kinds, in row
order, merged where rows continue each other ([`cpref.batch.mask_union`][cpref.batch.mask_union]),
so a mask reads as what it is:

```python
>>> import cpref
>>> cpref.Mask.prefix_lm([0, 6, 10], prefix_lengths=[2, 4]).slices  # the prompts full, the answers causal
((0, 2, 0, 2, 'full'), (2, 6, 0, 6, 'causal'), (6, 10, 6, 10, 'full'))
>>> cpref.Mask.bidirectional_spans([0, 10], spans=[(3, 6)]).slices  # an image at tokens 3..5
((0, 3, 0, 3, 'causal'), (3, 6, 0, 6, 'full'), (6, 10, 0, 10, 'causal'))
>>> cpref.Mask.shared_prompt([(3, [2, 2])]).slices  # one prompt of 3, two answers of 2
((0, 5, 0, 5, 'causal'), (5, 7, 0, 3, 'full'), (5, 7, 5, 7, 'causal'))

```

The second answer sees the prompt (`full`) and itself (`causal`), and not the first answer.

**Attention under a mask.** `cpref.attention(..., mask=mask)` runs it in every mode and layout,
in place of `causal`, `window` and `chunk`; every rank computes exactly the pairs the mask shows
of its queries, and the ring and the all-gather move only the key rows some query of another rank
sees ([masks in the modes][cpref.modes.mask_plan]):

```python
# given: cu_seqlens, q, k, v; a packed batch (every document a multiple of 2P = 4 tokens)
import sim

cu = cu_seqlens.tolist()
mask = cpref.Mask.prefix_lm(cu, prefix_lengths=[min(4, b - a) for a, b in zip(cu, cu[1:])])  # 4-token prompts
sharding = cpref.Sharding(cu, cp_size=2, layout="zigzag")
shards = sim.SimCluster(2).run(lambda comm: cpref.attention(
    *(sharding.shard(x, comm.rank) for x in (q, k, v)), sharding, comm=comm, mode="p2p", mask=mask))
out = sharding.unshard(shards)  # (T, Hq, Dv), exactly the dense oracle's under the mask
```

**Constructors.** [`from_slices`][cpref.batch.mask.Mask.from_slices] (any slices),
[`causal_documents`][cpref.batch.mask.Mask.causal_documents] (today's default),
[`prefix_lm`][cpref.batch.mask.Mask.prefix_lm], [`bidirectional_spans`][cpref.batch.mask.Mask.bidirectional_spans],
[`shared_prompt`][cpref.batch.mask.Mask.shared_prompt], [`from_dense`][cpref.batch.mask.Mask.from_dense]
(a `(T, T)` boolean matrix) and [`from_mask_mod`][cpref.batch.mask.Mask.from_mask_mod] (FlexAttention's
`mask_mod(b, h, q_idx, kv_idx)`, evaluated a block of rows at a time, never as a $T \times T$ matrix).
Every one validates what it is given and names the value and the fix.

**How it is tested** (`tests/cpref/test_mask.py`): the normal form of random slices of every
kind, overlapping, holds exactly the pairs of the kinds' definitions (evaluated densely, pair
by pair, in `sim.oracle.slice_mask`) with none twice; a dense mask and a `mask_mod` give back
the slices of the constructors; a window written as slices is `window=`'s mask; the
constructors' slices are the ones shown above; bad input is refused by name.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, Iterable, Sequence

import torch

from cpref.base.checks import host_ints
from cpref.base.errors import CPInputError
from cpref.batch import mask_union
from cpref.batch.mask_union import KINDS, Piece

__all__ = ["Mask", "KINDS", "check_mask"]

Slice = tuple[int, int, int, int, str]
_BLOCK_ELEMENTS = 1 << 22  # elements of one block of rows that from_dense / from_mask_mod reads at once


class Mask:
    """Which keys each query of a packed batch of `total` tokens sees: a union of slices (module docstring).

    Build one with a constructor (`Mask.from_slices`, `Mask.causal_documents`, ...), not directly.

    Attributes:
        slices: the normalised slices `(q_start, q_end, k_start, k_end, kind)`: disjoint, in row order.
        total: the batch's real tokens `T`, or None where the mask was given without it (`from_slices`).
    """

    __slots__ = ("slices", "total", "_digest")

    def __init__(self, slices: tuple[Slice, ...], total: int | None) -> None:
        object.__setattr__(self, "slices", slices)
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "_digest", None)

    @property
    def digest(self) -> int:
        """A 56-bit digest of the slices and the total, the same in every process (the ranks' comparison's column)."""
        if self._digest is None:
            data = repr((self.slices, self.total)).encode()
            object.__setattr__(self, "_digest", int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little"))
        return self._digest

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Mask cannot be changed ({name}); build another")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mask) and (self.slices, self.total) == (other.slices, other.total)

    def __hash__(self) -> int:
        return hash((self.slices, self.total))

    def __reduce__(self):
        return Mask, (self.slices, self.total)

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, self.slices[:3])) + (f", ... ({len(self.slices)} slices)" if len(self.slices) > 3 else "")
        return f"Mask([{shown}], total={self.total})"

    # --8<-- [start:from_slices]
    @classmethod
    def from_slices(cls, slices: Iterable[Sequence[Any]], total: int | None = None) -> "Mask":
        """The union of `slices`, each `(q_start, q_end, k_start, k_end, kind)` over the real batch's tokens.

        Args:
            slices: the slices; `kind` one of `"full"`, `"causal"`, `"inv_causal"`, `"bi_causal"`.
            total: the batch's real tokens `T` (every slice must lie inside it); None: checked against the
                batch `cpref.attention` is called on.

        Raises:
            CPInputError: a slice that is not five values, an index that is not an int, an empty or reversed
                range, a slice past `total`, an unknown kind, or no slice at all.

        Examples:
            >>> Mask.from_slices([(0, 8, 0, 8, "causal"), (2, 5, 2, 5, "full")]).slices  # a span in a document
            ((0, 2, 0, 2, 'causal'), (2, 5, 0, 5, 'full'), (5, 8, 0, 8, 'causal'))
        """
        if total is not None:
            total = _count("total", total, lo=1)
        given = _checked(slices, total)
        return cls(mask_union.normalise(given), total)
    # --8<-- [end:from_slices]

    @classmethod
    def causal_documents(cls, cu_seqlens: Any) -> "Mask":
        """Causal attention inside each document of `cu_seqlens`: what `cpref.attention` does without a mask.

        Examples:
            >>> Mask.causal_documents([0, 3, 7]).slices
            ((0, 3, 0, 3, 'causal'), (3, 7, 3, 7, 'causal'))
        """
        cu = _boundaries(cu_seqlens)
        return cls.from_slices([(a, b, a, b, "causal") for a, b in zip(cu, cu[1:])], cu[-1])

    @classmethod
    def prefix_lm(cls, cu_seqlens: Any, prefix_lengths: Sequence[int]) -> "Mask":
        """A prefix-LM per document (PaliGemma): its first `prefix_lengths[i]` tokens see each other whole, the rest
        causally (the prefix included); a length of 0 is a causal document, the document's length a full one."""
        cu = _boundaries(cu_seqlens)
        lengths = host_ints(prefix_lengths, "prefix_lengths", "pass one prefix length per document, e.g. [16, 0, 8]")
        if len(lengths) != len(cu) - 1:
            raise CPInputError(f"prefix_lengths has {len(lengths)} entries for {len(cu) - 1} documents; pass one per "
                               "document (0 for a causal one)")  # fmt: skip
        out = []
        for i, (a, b, n) in enumerate(zip(cu, cu[1:], lengths)):
            if not 0 <= n <= b - a:
                raise CPInputError(f"prefix_lengths[{i}] = {n} is outside document {i} of {b - a} tokens; pass 0 .. {b - a}")
            out += [(a, b, a, b, "causal")] + ([(a, a + n, a, a + n, "full")] if n else [])
        return cls.from_slices(out, cu[-1])

    @classmethod
    def bidirectional_spans(cls, cu_seqlens: Any, spans: Iterable[Sequence[int]]) -> "Mask":
        """Causal documents in which each span `(start, end)` (global, inside one document: an image's or a clip's
        tokens) sees itself whole, as Gemma 3's image tokens do; the tokens after a span see it causally."""
        cu = _boundaries(cu_seqlens)
        out: list[Slice] = [(a, b, a, b, "causal") for a, b in zip(cu, cu[1:])]
        for n, span in enumerate(spans):
            a, b = _pair(f"spans[{n}]", span)
            doc = next((i for i in range(len(cu) - 1) if cu[i] <= a < cu[i + 1]), None)
            if doc is None or not a < b <= cu[doc + 1]:
                raise CPInputError(f"spans[{n}] = ({a}, {b}) is not a non-empty range inside one document of "
                                   f"cu_seqlens {_short(cu)}; pass (start, end) with start < end in one document")  # fmt: skip
            out.append((a, b, a, b, "full"))
        return cls.from_slices(out, cu[-1])

    @classmethod
    def shared_prompt(cls, groups: Iterable[tuple[int, Sequence[int]]]) -> "Mask":
        """Shared-prompt packing (GRPO groups, SFT with several answers): each group `(prompt, answers)` is a prompt of
        `prompt` tokens then answers of `answers[i]` tokens, laid end to end; the prompt is causal, and each answer
        sees the whole prompt and itself causally, never another answer. Groups follow each other in the stream."""
        out, at = [], 0
        for g, group in enumerate(groups):
            if not isinstance(group, Sequence) or len(group) != 2:
                raise CPInputError(f"groups[{g}] is {group!r:.60}; pass (prompt length, [answer lengths])")
            p = _count(f"groups[{g}] prompt length", group[0], lo=1)
            answers = host_ints(group[1], f"groups[{g}] answers", "pass a list of answer lengths, e.g. [12, 30]")
            out.append((at, at + p, at, at + p, "causal"))
            a = at + p
            for given in answers:
                n = _count(f"groups[{g}] answer length", given, lo=1)
                out += [(a, a + n, at, at + p, "full"), (a, a + n, a, a + n, "causal")]
                a += n
            at = a
        if not out:
            raise CPInputError("shared_prompt: no group; pass groups such as [(prompt_length, [answer lengths])]")
        return cls.from_slices(out, at)

    @classmethod
    def from_dense(cls, dense: torch.Tensor) -> "Mask":
        """The mask of a `(T, T)` boolean matrix, `dense[x, y]` True where query `x` sees key `y`.

        Examples:
            >>> Mask.from_dense(torch.ones(3, 3, dtype=torch.bool).tril()).slices
            ((0, 3, 0, 3, 'causal'),)
        """
        if not isinstance(dense, torch.Tensor) or dense.dtype != torch.bool or dense.dim() != 2 or \
                dense.shape[0] != dense.shape[1] or dense.shape[0] < 1:  # fmt: skip
            got = f"{tuple(dense.shape)} {dense.dtype}" if isinstance(dense, torch.Tensor) else type(dense).__name__
            raise CPInputError(f"from_dense takes a square (T, T) torch.bool matrix, got {got}; pass mask.bool() of "
                               "shape (T, T), True where a query sees a key")  # fmt: skip
        T = dense.shape[0]
        return cls._from_rows(T, lambda r0, r1: dense[r0:r1].cpu())

    @classmethod
    def from_mask_mod(cls, mask_mod: Callable[..., torch.Tensor], total: int, heads: int = 1) -> "Mask":
        """The mask of a FlexAttention `mask_mod(b, h, q_idx, kv_idx)` over `total` tokens, evaluated a block of rows
        at a time (`q_idx` a column, `kv_idx` a row of indices); `heads > 1` checks that every head has one mask.

        Raises:
            CPInputError: a result that is not a boolean tensor of the block's shape, or heads whose masks differ.
        """
        T, heads = _count("total", total, lo=1), _count("heads", heads, lo=1)
        kv, b = torch.arange(T)[None, :], torch.zeros((), dtype=torch.long)

        def rows(r0: int, r1: int) -> torch.Tensor:
            q = torch.arange(r0, r1)[:, None]
            first = _evaluated(mask_mod, b, 0, q, kv, (r1 - r0, T))
            for h in range(1, heads):
                other = _evaluated(mask_mod, b, h, q, kv, (r1 - r0, T))
                if not torch.equal(first, other):
                    x, y = (first != other).nonzero()[0].tolist()
                    raise CPInputError(f"mask_mod is not head-independent: head {h} and head 0 differ at query {r0 + x}, "
                                       f"key {y}; cpref takes one mask for every head")  # fmt: skip
            return first

        return cls._from_rows(T, rows)

    @classmethod
    def _from_rows(cls, T: int, rows: Callable[[int, int], torch.Tensor]) -> "Mask":
        """From a boolean `(r1 - r0, T)` block of rows at a time: each row's runs of True, merged into slices."""
        step, parts = max(1, _BLOCK_ELEMENTS // T), []
        for r0 in range(0, T, step):
            block = rows(r0, min(T, r0 + step))  # (B, T) bool
            edges = torch.diff(torch.nn.functional.pad(block.to(torch.int8), (1, 1)), dim=1)  # (B, T + 1)
            starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()  # in row order
            parts += [Piece(r0 + x, r0 + x + 1, (0, a), (0, e - 1)) for (x, a), (_, e) in zip(starts, ends)]
        return cls(tuple(sorted(mask_union.canonical(p) for p in mask_union.runs(parts))), T)

    def visible_pairs(self) -> int:
        """The pairs (query, key) the mask shows: the attention work of one head, forward.

        Examples:
            >>> Mask.causal_documents([0, 3, 7]).visible_pairs()  # 1 + 2 + 3, then 1 + 2 + 3 + 4
            16
        """
        total = 0
        for sl in self.slices:
            for a, b, lo, hi in mask_union.atoms(*sl):  # row x sees hi(x) - lo(x) + 1 keys, linear in x
                first, slope, n = hi[1] - lo[1] + 1 + (hi[0] - lo[0]) * a, hi[0] - lo[0], b - a
                total += n * first + slope * n * (n - 1) // 2
        return total

    def visible_per_row(self, total: int | None = None) -> torch.Tensor:
        """How many keys each query sees: LongTensor `(T,)`, the work of each row (its sum is `visible_pairs()`).

        Args:
            total: the batch's real tokens, where the mask was given without it (`from_slices`).

        Examples:
            >>> Mask.prefix_lm([0, 5], prefix_lengths=[3]).visible_per_row().tolist()  # the prompt sees itself whole
            [3, 3, 3, 4, 5]
        """
        T = self.total if self.total is not None else total
        if T is None:
            raise CPInputError("this mask was built without total=: pass visible_per_row(total=T)")
        out = torch.zeros(T, dtype=torch.int64)
        for sl in self.slices:
            for a, b, lo, hi in mask_union.atoms(*sl):  # rows [a, b) see keys lo(x) .. hi(x), each end linear in x
                out[a:b] += hi[1] - lo[1] + 1 + (hi[0] - lo[0]) * torch.arange(a, b)
        return out

    def dense(self) -> torch.Tensor:
        """The `(T, T)` boolean matrix of the mask (for small batches: tests, figures)."""
        T = self.total if self.total is not None else max(max(q1, k1) for q0, q1, k0, k1, _ in self.slices)
        out = torch.zeros(T, T, dtype=torch.bool)
        x, y = torch.arange(T)[:, None], torch.arange(T)[None, :]
        for q0, q1, k0, k1, kind in self.slices:
            d_lo, d_hi = mask_union.band(q0, q1, k0, k1, kind)
            d = y[:, k0:k1] - x[q0:q1]  # (Lq, Lk): key minus query, global
            out[q0:q1, k0:k1] |= (d >= (d_lo if d_lo is not None else -T)) & (d <= (d_hi if d_hi is not None else T))
        return out


def check_mask(mask: Any, total: int, *, causal: bool, window: tuple[int, int], chunk: int | None) -> Mask | None:
    """`mask` if it is a `Mask` over a batch of `total` real tokens, given without `causal=False`, `window=` or
    `chunk=` (a mask replaces them: windows and chunks are masks too); None stays None.

    Raises:
        CPInputError: naming what is wrong and the fix.
    """
    if mask is None:
        return None
    if not isinstance(mask, Mask):
        raise CPInputError(f"mask is {type(mask).__name__}, not a cpref.Mask; build one with cpref.Mask.from_slices, "
                           "Mask.prefix_lm, Mask.bidirectional_spans, Mask.shared_prompt, Mask.from_dense or "
                           "Mask.from_mask_mod")  # fmt: skip
    given = [name for name, on in (("causal=False", not causal), (f"window={window}", window != (-1, -1)),
                                   (f"chunk={chunk}", chunk is not None)) if on]  # fmt: skip
    if given:
        raise CPInputError(f"mask= replaces causal, window and chunk, but {', '.join(given)} was given too; write the "
                           "window or the chunks into the mask's slices (a window is a causal slice over a document's "
                           "first rows and a bi_causal band below), or leave mask out")  # fmt: skip
    if mask.total is not None and mask.total != total:
        raise CPInputError(f"the mask is over a batch of {mask.total} tokens, this batch has {total} real tokens (the "
                           "sharding's cu_seqlens[-1]); build the mask for this batch")  # fmt: skip
    reach = max((max(sl[1], sl[3]) for sl in mask.slices), default=0)
    if reach > total:
        raise CPInputError(f"the mask reaches token {reach - 1}, past this batch of {total} real tokens (its slices "
                           "index the real, unpadded batch); build the mask for this batch")  # fmt: skip
    return mask


def _count(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise CPInputError(f"{name} is {value!r}, not an int; pass an int >= {lo}")
    try:
        n = operator.index(value)
    except TypeError:
        raise CPInputError(f"{name} is {value!r:.40} ({type(value).__name__}), not an int; pass an int >= {lo}") from None
    if n < lo:
        raise CPInputError(f"{name} is {n}; pass an int >= {lo}")
    return n


def _pair(name: str, value: Any) -> tuple[int, int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise CPInputError(f"{name} is {value!r:.40}; pass (start, end)")
    return _count(f"{name} start", value[0], lo=0), _count(f"{name} end", value[1], lo=0)


def _short(cu: Sequence[int]) -> str:
    return str(list(cu)) if len(cu) <= 8 else f"[{cu[0]}, {cu[1]}, ..., {cu[-1]}] ({len(cu)} entries)"


def _boundaries(cu_seqlens: Any) -> list[int]:
    cu = host_ints(cu_seqlens, "cu_seqlens")
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise CPInputError(f"cu_seqlens {_short(cu)} must start at 0 and increase strictly (one entry per document "
                           "boundary, no empty document); pass boundaries like [0, 8, 20]")  # fmt: skip
    return cu


def _checked(slices: Iterable[Sequence[Any]], total: int | None) -> list[Slice]:
    """The slices as tuples of ints and a kind, each a non-empty rectangle inside `[0, total)` (see `from_slices`)."""
    if isinstance(slices, (str, bytes, torch.Tensor)) or not isinstance(slices, Iterable):
        raise CPInputError(f"slices is {type(slices).__name__}; pass a list of (q_start, q_end, k_start, k_end, kind)")
    out = []
    for n, sl in enumerate(slices):
        if isinstance(sl, (str, bytes)) or not isinstance(sl, Sequence) or len(sl) != 5:
            raise CPInputError(f"slices[{n}] is {sl!r:.60}; pass (q_start, q_end, k_start, k_end, kind)")
        *ends, kind = sl
        q0, q1, k0, k1 = (_count(f"slices[{n}] {what}", v, lo=0) for what, v in
                          zip(("q_start", "q_end", "k_start", "k_end"), ends))  # fmt: skip
        if kind not in KINDS:
            raise CPInputError(f"slices[{n}] has kind {kind!r:.40}; pass one of {list(KINDS)}")
        if not (q0 < q1 and k0 < k1):
            raise CPInputError(f"slices[{n}] = {tuple(sl)!r} is empty or reversed: it needs q_start < q_end and "
                               "k_start < k_end")  # fmt: skip
        if total is not None and max(q1, k1) > total:
            raise CPInputError(f"slices[{n}] = {tuple(sl)!r} reaches past the batch of {total} tokens; the indices are "
                               "global token indices of the real (unpadded) batch, 0 .. total")  # fmt: skip
        out.append((q0, q1, k0, k1, kind))
    if not out:
        raise CPInputError("a mask needs at least one slice; a query no slice reaches sees nothing")
    return out


def _evaluated(mask_mod: Callable[..., Any], b: torch.Tensor, h: int, q: torch.Tensor, kv: torch.Tensor,
               shape: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    got = mask_mod(b, torch.tensor(h), q, kv)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
        raise CPInputError(f"mask_mod returned {type(got).__name__}"
                           f"{'' if not isinstance(got, torch.Tensor) else ' of ' + str(got.dtype)}; it must return "
                           "a torch.bool tensor (FlexAttention's convention)")  # fmt: skip
    try:
        return torch.broadcast_to(got, shape)
    except RuntimeError:
        raise CPInputError(f"mask_mod returned shape {tuple(got.shape)} for a block of {shape[0]} query indices (a "
                           f"column) and {shape[1]} key indices (a row); it must be elementwise in q_idx and "
                           "kv_idx") from None  # fmt: skip
