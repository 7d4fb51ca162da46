"""Document boundaries of a packed batch, real and padded, validated once.

A packed batch is described by two boundary lists, the convention of TransformerEngine and
Megatron packed sequences:

* `cu_seqlens`, the **real** boundaries: `[0, 7, 20]` is a document of 7 tokens and one of 13;
* `cu_seqlens_padded`, the **padded** boundaries that define the shards: with every document
  padded at its end to a multiple of `2P = 8`, `[0, 8, 24]`. Absent, there is no padding and
  both lists are equal.

[`Boundaries`][cpref.batch.seqlens.Boundaries] holds both as host ints. Everything that depends on
the batch (layouts, metadata, kernel sequences) is computed from it, and it is built once per
batch ([`cpref.batch.cache`][cpref.batch.cache]), not once per layer.

**Padding is invisible.** Padding tokens sit at the end of their document, and cpref treats
them as absent from attention: no query sees a padding key, a padding query sees no key
(its output is 0), and every gradient of a padding row is 0. This holds with or without the
causal mask; without it, a real query would otherwise see the padding keys of its document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cpref.base.checks import as_choice, as_int, host_ints
from cpref.base.errors import CPInputError

__all__ = ["Boundaries", "CuSeqlens", "LAYOUTS", "CHUNKED_LAYOUTS", "layout_multiple"]

CuSeqlens = torch.Tensor | Sequence[int]


def _check_cu(cu: list[int], name: str) -> tuple[int, ...]:
    if len(cu) < 2 or cu[0] != 0:
        raise CPInputError(
            f"{name} must start with 0 and hold at least one document, got {cu[:8]}; "
            "pass document boundaries like [0, 8, 20]"
        )
    for i in range(len(cu) - 1):
        if cu[i + 1] <= cu[i]:
            raise CPInputError(
                f"{name} must be strictly increasing: document {i} spans [{cu[i]}, {cu[i + 1]}), "
                f"length {cu[i + 1] - cu[i]}; drop empty documents"
            )
    return tuple(cu)


LAYOUTS = ("contiguous", "zigzag", "stream", "balanced")
CHUNKED_LAYOUTS = ("contiguous", "zigzag")  # the layouts that cut every document into P or 2P equal chunks


def layout_multiple(layout: str, cp_size: int) -> int:
    """The granularity a document length must be a multiple of: `P` (contiguous), `2P` (zigzag), 1 (stream and
    balanced, whose constraint is on the whole batch: see `Boundaries.check_divisible`).

    The layouts themselves are `cpref.batch.layout`'s; the rule lives here, below it, because
    `Boundaries.check_divisible` applies it (`cpref.batch.layout` re-exports it).

    Without CP (`cp_size = 1`) it is 1 in every layout: the one rank holds every document whole
    and in order, so there is nothing to balance and no length to pad.
    """
    as_choice("layout", layout, LAYOUTS)
    P = as_int("cp_size", cp_size, lo=1)
    if P == 1 or layout not in CHUNKED_LAYOUTS:
        return 1
    return (2 if layout == "zigzag" else 1) * P


@dataclass(frozen=True)
class Boundaries:
    """Validated real and padded document boundaries, as host ints (leading 0).

    Attributes:
        real: the real boundaries `cu_seqlens`.
        padded: the padded boundaries `cu_seqlens_padded` (equal to `real` without padding).

    Examples:
        >>> b = Boundaries.parse([0, 7, 20], [0, 8, 24])
        >>> b.num_docs, b.total, b.real_len(1), b.padded_len(1)
        (2, 24, 13, 16)
    """

    real: tuple[int, ...]
    padded: tuple[int, ...]
    mask: Any = None  # the cpref.Mask whose work the balanced layout evens out (None: causal documents)

    def __post_init__(self) -> None:
        """Validate both lists, whoever built the object (`Boundaries("x", "y")` is refused like `parse`'s input)."""
        real = _check_cu(host_ints(self.real, "cu_seqlens"), "cu_seqlens")
        padded = _check_cu(host_ints(self.padded, "cu_seqlens_padded"), "cu_seqlens_padded")
        if len(real) != len(padded):
            raise CPInputError(
                f"cu_seqlens has {len(real) - 1} documents but cu_seqlens_padded {len(padded) - 1}; "
                "they must describe the same documents"
            )
        for i in range(len(real) - 1):
            if padded[i + 1] - padded[i] < real[i + 1] - real[i]:
                raise CPInputError(
                    f"document {i} has {real[i + 1] - real[i]} real tokens but only "
                    f"{padded[i + 1] - padded[i]} padded ones; cu_seqlens_padded must pad every document at its end"
                )
        object.__setattr__(self, "real", real)  # host ints, as tuples: hashable, the batch cache's key
        object.__setattr__(self, "padded", padded)

    @classmethod
    def parse(cls, cu_seqlens: Any, cu_seqlens_padded: Any = None, *, ends_only_ok: bool = False,
              mask: Any = None) -> "Boundaries":  # fmt: skip
        """Validate both lists (`cu_seqlens_padded=None`: no padding); `ends_only_ok` also accepts MindSpeed's form
        without the leading 0; `mask`, a `cpref.Mask` checked by the caller, is the work the balanced layout evens.

        Raises:
            CPInputError: naming the offending list and entry.
        """
        lists = []
        for name, src in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
            if src is None and name == "cu_seqlens_padded":
                lists.append(lists[0])
                continue
            cu = host_ints(src, name)
            if ends_only_ok and cu and cu[0] != 0:
                cu = [0] + cu  # a first element other than 0 marks the ends-only form
            lists.append(cu)
        return cls(*lists, mask)

    @property
    def num_docs(self) -> int:
        """The number of documents `N`."""
        return len(self.real) - 1

    @property
    def total(self) -> int:
        """Tokens in the padded stream, `T` (what is sharded)."""
        return self.padded[-1]

    @property
    def is_padded(self) -> bool:
        """Whether any document carries padding."""
        return self.real != self.padded

    def real_len(self, i: int) -> int:
        """Real tokens of document `i`."""
        return self.real[i + 1] - self.real[i]

    def padded_len(self, i: int) -> int:
        """Padded tokens of document `i`, `L_i`."""
        return self.padded[i + 1] - self.padded[i]

    def real_in(self, i: int, start: int, end: int) -> int:
        """Real tokens among positions `[start, end)` of document `i` (its padding is a suffix: `[n_i, L_i)`)."""
        return max(0, min(end, self.real_len(i)) - start)

    def eod_padded(self, multiple: int, *, batch_multiple: int = 1) -> "Boundaries":
        """The real documents, each padded at its end to a multiple of `multiple` tokens, the last one further so
        that the batch is a multiple of `batch_multiple` (EOD padding: padding never precedes a real token).

        Examples:
            >>> Boundaries.parse([0, 5, 8]).eod_padded(2).padded
            (0, 6, 10)
            >>> Boundaries.parse([0, 5, 9]).eod_padded(1, batch_multiple=4).padded
            (0, 5, 12)
        """
        padded = [0]
        for i in range(self.num_docs):
            padded.append(padded[-1] + -(-self.real_len(i) // multiple) * multiple)  # ceil to a multiple
        padded[-1] = -(-padded[-1] // batch_multiple) * batch_multiple  # the last document takes the batch's padding
        return Boundaries(self.real, tuple(padded), self.mask)

    def pad(self, x: torch.Tensor, value: float | int = 0) -> torch.Tensor:
        """A tensor of the real stream with each document's padding after it, filled with `value`:
        `(T_real, ...) -> (T, ...)` along dim 0 (its length is the caller's to check)."""
        if not self.is_padded:
            return x
        pieces = []
        for i in range(self.num_docs):
            pieces.append(x[self.real[i] : self.real[i + 1]])  # (n_i, ...) the document
            pieces.append(x.new_full((self.padded_len(i) - self.real_len(i), *x.shape[1:]), value))  # its tail padding
        return torch.cat(pieces)  # (T, ...)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of [`pad`][cpref.batch.seqlens.Boundaries.pad]: each document's real tokens of a tensor of the padded
        stream, `(T, ...) -> (T_real, ...)`."""
        return torch.cat([x[self.padded[i] : self.padded[i] + self.real_len(i)] for i in range(self.num_docs)])

    def check_divisible(self, layout: str, cp_size: int) -> int:
        """Raise unless every padded length is a multiple of the layout's granularity (for `stream` and `balanced`:
        unless the batch's length is a multiple of `cp_size`); return the granularity."""
        mult = layout_multiple(layout, cp_size)
        if layout not in CHUNKED_LAYOUTS and self.total % cp_size:
            raise CPInputError(
                f"the batch has {self.total} tokens, not a multiple of cp_size={cp_size}: the {layout} layout gives "
                f"every rank {self.total}/{cp_size} tokens; pad the batch at its end: build the sharding with "
                f"cpref.Sharding.eod_padded(cu_seqlens, cp_size={cp_size}, layout={layout!r}), which pads the last "
                f"document, and pad the tensors with sharding.pad(x) (padding then stays out of attention)"
            )
        for i in range(self.num_docs):
            n = self.padded_len(i)
            if n % mult:
                raise CPInputError(
                    f"document {i} has length {n}, not a multiple of {mult} (the {layout} layout over "
                    f"cp_size={cp_size}); pad every document at its end: build the sharding with "
                    f"cpref.Sharding.eod_padded(cu_seqlens, cp_size={cp_size}, layout={layout!r}), which computes the "
                    f"padded boundaries (cu_seqlens_padded), and pad the tensors with sharding.pad(x) (padding then "
                    f"stays out of attention)"
                )
        return mult
