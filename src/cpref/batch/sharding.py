"""`Sharding`: one description of how a packed batch is split over a CP group.

A batch is sharded once and attended many times (every layer, forward and backward). What
the sharding needs (the document boundaries, real and padded, the CP size `P` and the layout)
is what attention needs to undo it, so cpref asks for it **once**, as one immutable object:

```python
# given: cu_seqlens, q, k, v; a packed batch whose documents are multiples of 2P = 8 tokens
import cpref, sim
sharding = cpref.Sharding(cu_seqlens, cp_size=4, layout="zigzag")

def on_rank(comm):                                           # every rank of the CP group
    q_r, k_r, v_r = (sharding.shard(t, comm.rank) for t in (q, k, v))  # (T, H, D) -> (T / P, H, D)
    return cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode="p2p")

out = sharding.unshard(sim.SimCluster(4).run(on_rank))       # every rank's -> (T, Hq, Dv)
```

Sharding with one layout and attending with another, or over a group of another size, cannot
be written: `cpref.attention` takes the layout and `P` from the object that sharded the
tensors, and raises if the communicator's size is not `sharding.cp_size`.

Documents whose lengths are not multiples of the layout's granularity (`P` contiguous, `2P`
zigzag, see [`cpref.batch.layout`][cpref.batch.layout]), or a batch whose length is not a multiple of `P`
(stream and balanced), are padded at their end (for stream and balanced: only the last document, at the batch's
end; the arithmetic is [`Boundaries.eod_padded`][cpref.batch.seqlens.Boundaries.eod_padded]):
[`Sharding.eod_padded`][cpref.batch.sharding.Sharding.eod_padded] computes the padded boundaries,
[`pad`][cpref.batch.sharding.Sharding.pad] pads a tensor of the real stream and
[`unpad`][cpref.batch.sharding.Sharding.unpad] drops the padding again;
[`cpref.get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank] does all of it for a
training batch and returns the `Sharding` with this rank's slice.

## Built once, cached, immutable

Building a `Sharding` validates the boundaries (on the host: a tensor is read back once) and
takes the batch's entry in the batch cache ([`cpref.batch.cache`][cpref.batch.cache]), where every mode's
per-rank plan is kept: a second `Sharding` of the same tensor (or of equal lists) shares it.
The object never changes afterwards (an in-place edit of the source tensor is a new batch:
build a new `Sharding`), and two of them are equal when their boundaries, `P` and layout are.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch

from cpref.base.checks import as_choice, as_fill, as_int
from cpref.base.errors import CPInputError
from cpref.batch.cache import CACHE, BatchEntry
from cpref.batch.layout import attention_work, global_index, local_chunks, positions
from cpref.batch.mask import Mask, check_mask
from cpref.batch.seqlens import CHUNKED_LAYOUTS, LAYOUTS, Boundaries, CuSeqlens, layout_multiple

__all__ = ["Sharding"]

V = TypeVar("V")


class Sharding:
    """How one packed batch is sharded: boundaries (real and padded), CP size, layout.

    Args:
        cu_seqlens: global real document boundaries, leading 0 (a 1-D integer tensor or a list).
        cp_size: the CP group size `P`.
        layout: `"zigzag"` (default), `"contiguous"`, `"stream"` or `"balanced"` (see [`cpref.batch.layout`][cpref.batch.layout]).
        cu_seqlens_padded: the padded boundaries that define the shards (each document padded
            at its end to a multiple of the layout's granularity; for stream, the batch padded at its
            end to a multiple of `P`), or None without padding.
        mask: for `layout="balanced"`, the `cpref.Mask` whose work the ranks share evenly (every
            query's visible keys, [`cpref.batch.balanced_mask`][cpref.batch.balanced_mask]); None: the
            causal documents' work. It places the tokens only: `cpref.attention` computes the mask it is given.

    Raises:
        CPInputError: for invalid boundaries, CP size or layout, or a document (for stream: a batch)
            whose (padded) length is not a multiple of the layout's granularity, naming it and the fix.

    Examples:
        >>> s = Sharding([0, 8, 20], cp_size=2, layout="contiguous")
        >>> s.local_tokens, s.local_chunks(1)
        (10, [(0, 4, 8), (1, 14, 20)])
        >>> Sharding.eod_padded([0, 7, 20], cp_size=2).cu_seqlens_padded
        (0, 8, 24)
    """

    __slots__ = ("_entry", "_cp_size", "_layout")

    def __init__(self, cu_seqlens: CuSeqlens, *, cp_size: int, layout: str = "zigzag",
                 cu_seqlens_padded: CuSeqlens | None = None, mask: Mask | None = None) -> None:  # fmt: skip
        P = as_int("cp_size", cp_size, lo=1)
        layout = as_choice("layout", layout, LAYOUTS)
        if mask is not None:
            _check_balance_mask(mask, layout, CACHE.entry(cu_seqlens, cu_seqlens_padded).bounds.real[-1])
        entry = CACHE.entry(cu_seqlens, cu_seqlens_padded, mask=mask)
        entry.bounds.check_divisible(layout, P)
        object.__setattr__(self, "_entry", entry)
        object.__setattr__(self, "_cp_size", P)
        object.__setattr__(self, "_layout", layout)

    @classmethod
    def eod_padded(cls, cu_seqlens: CuSeqlens, *, cp_size: int, layout: str = "zigzag",
                   mask: Mask | None = None) -> "Sharding":  # fmt: skip
        """The sharding of `cu_seqlens` with every document padded at its end to the layout's granularity
        (for `stream` and `balanced`: the last document padded, so that the batch is a multiple of `cp_size`).

        Examples:
            >>> Sharding.eod_padded([0, 5, 8], cp_size=2, layout="contiguous").cu_seqlens_padded
            (0, 6, 10)
            >>> Sharding.eod_padded([0, 5, 8], cp_size=4, layout="stream").cu_seqlens_padded
            (0, 5, 8)
            >>> Sharding.eod_padded([0, 5, 9], cp_size=4, layout="stream").cu_seqlens_padded
            (0, 5, 12)
        """
        P, layout = as_int("cp_size", cp_size, lo=1), as_choice("layout", layout, LAYOUTS)
        # chunked: every document to the layout's granularity; stream, balanced: the batch to a multiple of P
        whole = 1 if layout in CHUNKED_LAYOUTS else P
        bounds = CACHE.entry(cu_seqlens).bounds.eod_padded(layout_multiple(layout, P), batch_multiple=whole)
        return cls(cu_seqlens, cp_size=P, layout=layout, cu_seqlens_padded=bounds.padded, mask=mask)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Sharding is immutable (cannot set {name!r}); build a new one for another batch or setting")

    # ---- what it is -----------------------------------------------------------------------
    @property
    def bounds(self) -> Boundaries:
        """The validated real and padded boundaries (host ints)."""
        return self._entry.bounds

    @property
    def mask(self) -> Mask | None:
        """The mask whose work the balanced layout shares evenly, or None (causal documents)."""
        return self.bounds.mask

    @property
    def cp_size(self) -> int:
        """`P`, the CP group size the batch is sharded over."""
        return self._cp_size

    @property
    def layout(self) -> str:
        """`"zigzag"`, `"contiguous"`, `"stream"` or `"balanced"`."""
        return self._layout

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """The real document boundaries."""
        return self.bounds.real

    @property
    def cu_seqlens_padded(self) -> tuple[int, ...]:
        """The padded boundaries the shards follow (equal to `cu_seqlens` without padding)."""
        return self.bounds.padded

    @property
    def total(self) -> int:
        """`T`, tokens of the padded stream (what is sharded)."""
        return self.bounds.total

    @property
    def local_tokens(self) -> int:
        """`T / P`, tokens of every rank's shard."""
        return self.bounds.total // self._cp_size

    def _key(self) -> tuple:
        return (self.bounds, self._cp_size, self._layout)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sharding) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        """The boundaries written out, or past 8 entries their first three, last one and length (a message stays
        readable whatever the batch): `Sharding([0, 8, 16, ..., 4096] (129 entries), cp_size=2, layout='zigzag')`."""
        padded = f", cu_seqlens_padded={_listed(self.cu_seqlens_padded)}" if self.bounds.is_padded else ""
        mask = f", mask={self.mask!r}" if self.mask is not None else ""
        return f"Sharding({_listed(self.cu_seqlens)}, cp_size={self._cp_size}, layout={self._layout!r}{padded}{mask})"

    def __reduce__(self):
        padded = self.cu_seqlens_padded if self.bounds.is_padded else None
        return (_rebuild, (self.cu_seqlens, self._cp_size, self._layout, padded, self.mask))

    # ---- what it does ---------------------------------------------------------------------
    def local_chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """`(doc, start, end)` of every chunk rank `rank` holds, in local order (padded stream)."""
        return local_chunks(self.bounds, cp_size=self._cp_size, rank=rank, layout=self._layout)

    def global_index(self, rank: int) -> torch.Tensor:
        """Each of rank `rank`'s tokens' index in the padded stream: LongTensor `(T / P,)`."""
        rank = self._rank(rank)
        return self.plan(("global_index", rank), lambda: global_index(self.bounds, cp_size=self._cp_size,
                                                                      rank=rank, layout=self._layout))  # fmt: skip

    def positions(self, rank: int) -> torch.Tensor:
        """Each of rank `rank`'s tokens' position inside its document (for RoPE): LongTensor `(T / P,)`."""
        return positions(self.bounds, cp_size=self._cp_size, rank=self._rank(rank), layout=self._layout)

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of a tensor of the padded stream: `(T, ...) -> (T / P, ...)` along dim 0."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.total:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            real = isinstance(x, torch.Tensor) and _is_real(x, self)
            fix = "; pad it first with sharding.pad(x)" if self.bounds.is_padded and real else ""
            fix = fix or (_transposed({"x": x}, self.total) if isinstance(x, torch.Tensor) else "")
            raise CPInputError(f"x has shape {got} but the sharded stream has {self.total} tokens: dim 0 must "
                               f"hold the whole (padded) stream{fix}")  # fmt: skip
        return x.index_select(0, self.global_index(rank).to(x.device))  # (T/P, ...)

    def check_local(self, **tensors: torch.Tensor) -> None:
        """Raise a `CPInputError` unless every tensor (by name) holds this batch's shard of one rank in dim 0:
        `T / P` tokens. A tensor laid out `(H, T / P, D)`, its tokens in dim 1, is named with its fix."""
        local = self.local_tokens
        if all(t.shape[0] == local for t in tensors.values()):
            return
        held = "/".join(str(t.shape[0]) for t in tensors.values())
        raise CPInputError(f"{'/'.join(tensors)} hold {held} tokens but this rank's shard of {self.total} tokens over "
                           f"cp_size={self._cp_size} has {local}; shard them with sharding.shard(x, comm.rank)"
                           + _transposed(tensors, local))  # fmt: skip

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of [`shard`][cpref.batch.sharding.Sharding.shard]: every rank's shard, in rank order -> `(T, ...)`."""
        if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or len(shards) != self._cp_size:
            got = f"a tensor {tuple(shards.shape)}" if isinstance(shards, torch.Tensor) else (
                f"{len(shards)} shards" if isinstance(shards, Sequence) else type(shards).__name__)  # fmt: skip
            raise CPInputError(f"unshard got {got} but the batch is sharded over cp_size={self._cp_size}; pass a list of "
                               "every rank's shard, in rank order")  # fmt: skip
        first = shards[0]
        for rank, part in enumerate(shards):
            if not isinstance(part, torch.Tensor) or part.dim() < 1:
                got = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
                raise CPInputError(f"shard of rank {rank} is {got}, not a tensor of shape (T / P, ...)")
            if (part.dtype, part.device, part.shape[1:]) != (first.dtype, first.device, first.shape[1:]):
                raise CPInputError(f"shard of rank {rank} is {part.dtype} {tuple(part.shape)} on {part.device}, rank 0's "
                                   f"{first.dtype} {tuple(first.shape)} on {first.device}: every rank's shard must have "
                                   "the same dtype, device and trailing dims")  # fmt: skip
        out = first.new_empty((self.total, *first.shape[1:]))  # (T, ...)
        for rank, part in enumerate(shards):
            if part.shape[0] != self.local_tokens:
                raise CPInputError(f"shard of rank {rank} has {part.shape[0]} tokens, expected {self.local_tokens}")
            out.index_copy_(0, self.global_index(rank).to(part.device), part)
        return out

    def pad(self, x: torch.Tensor, *, value: float | int = 0) -> torch.Tensor:
        """A tensor of the real stream, each document padded at its end with `value`: `(T_real, ...) -> (T, ...)`."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.bounds.real[-1]:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise CPInputError(f"x has shape {got} but cu_seqlens ends at {self.bounds.real[-1]}: pad takes the real stream")
        return self.bounds.pad(x, as_fill("pad value", value, x.dtype))  # (T, ...)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of [`pad`][cpref.batch.sharding.Sharding.pad]: drop each document's tail padding, `(T, ...) -> (T_real, ...)`."""
        b = self.bounds
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.total:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            hint = ("; it is one rank's shard: unshard every rank's first" if isinstance(x, torch.Tensor) and x.dim() >= 1
                    and x.shape[0] == self.local_tokens and self._cp_size > 1 else
                    "; it is already the real stream" if isinstance(x, torch.Tensor) and x.dim() >= 1
                    and x.shape[0] == b.real[-1] else "")  # fmt: skip
            raise CPInputError(f"x has shape {got} but the padded stream has {self.total} tokens: unpad takes the whole "
                               f"padded stream (sharding.unshard of every rank's shard){hint}")  # fmt: skip
        return b.unpad(x)  # (T_real, ...)

    def attention_work(self, rank: int, *, causal: bool = True, exact: bool = False,
                       window: tuple[int, int] = (-1, -1), mask: Mask | None = None) -> int:  # fmt: skip
        """Rank `rank`'s attention work in score entries per head (see [`cpref.batch.layout`][cpref.batch.layout]);
        with `mask`, exactly the pairs the mask shows its queries (`causal` and `window` then unused).

        Examples:
            >>> s, m = Sharding([0, 8], cp_size=2, layout="contiguous"), Mask.prefix_lm([0, 8], [4])
            >>> s.attention_work(0, mask=m), s.attention_work(1, mask=m)  # 4 x 4 keys, then 5 + 6 + 7 + 8
            (16, 26)
        """
        if mask is not None:
            check_mask(mask, self.bounds.real[-1], causal=True, window=(-1, -1), chunk=None)
            real = self.pad(torch.arange(self.bounds.real[-1]), value=-1)[self.global_index(rank)]  # (T / P,)
            return int(mask.visible_per_row(self.bounds.real[-1])[real[real >= 0]].sum())
        return attention_work(self.bounds, cp_size=self._cp_size, rank=self._rank(rank), layout=self._layout,
                              causal=causal, exact=exact, window=window)  # fmt: skip

    @property
    def entry(self) -> BatchEntry:
        """The batch's entry in the batch cache, where the modes keep their per-rank plans."""
        return self._entry

    def plan(self, key: Hashable, build: Callable[[], V]) -> V:
        """The cached plan `key` of this batch at this CP size and layout (built once by `build()`)."""
        return self._entry.plan((self._cp_size, self._layout, *key), build)

    def _rank(self, rank: int) -> int:
        return as_int("rank", rank, lo=0, hi=self._cp_size)


def _transposed(tensors: dict[str, torch.Tensor], tokens: int) -> str:
    """A hint naming the tensors whose dim 1, not dim 0, holds the expected `tokens` (laid out `(H, T, D)`), or ""."""
    turned = [name for name, t in tensors.items() if t.dim() >= 2 and t.shape[0] != tokens and t.shape[1] == tokens]
    if not turned:
        return ""
    return (f"; {', '.join(turned)} {'has' if len(turned) == 1 else 'have'} the {tokens} tokens in dim 1, as if laid out "
            "(heads, tokens, head dim), but dim 0 is the tokens, (tokens, heads, head dim): pass "
            + ", ".join(f"{name}.transpose(0, 1)" for name in turned))  # fmt: skip


def _listed(values: Sequence[int]) -> str:
    """`values` as a list, or past 8 entries its first three, last one and length: `[0, 8, 16, ..., 4096] (129 entries)`."""
    if len(values) <= 8:
        return repr(list(values))
    return f"[{', '.join(map(str, values[:3]))}, ..., {values[-1]}] ({len(values)} entries)"


def _is_real(x: torch.Tensor, sharding: Sharding) -> bool:
    return x.dim() >= 1 and x.shape[0] == sharding.bounds.real[-1]


def _rebuild(cu_seqlens, cp_size, layout, cu_seqlens_padded, mask=None) -> Sharding:
    return Sharding(list(cu_seqlens), cp_size=cp_size, layout=layout, cu_seqlens_padded=cu_seqlens_padded, mask=mask)


def _check_balance_mask(mask: Any, layout: str, total: int) -> None:
    """A mask for the layout to balance: a `cpref.Mask` over this batch, given with `layout="balanced"`."""
    check_mask(mask, total, causal=True, window=(-1, -1), chunk=None)
    if layout != "balanced":
        raise CPInputError(f"mask= balances the 'balanced' layout's work, but layout={layout!r} places tokens by "
                           "its own rule; pass layout='balanced' with the mask, or leave mask out (cpref.attention "
                           "takes the mask to compute in its own mask=)")  # fmt: skip

