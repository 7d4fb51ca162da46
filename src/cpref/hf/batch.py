r"""The batches Hugging Face users have, as this rank's cpref batch: `shard_batch`.

Two forms of batch come out of `transformers`' data path, and
[`shard_batch`][cpref.hf.batch.shard_batch] takes both, or a mix:

* **padded**: `input_ids (B, L)` with an `attention_mask (B, L)` that is 1 on each row's tokens
  and 0 on its padding (a tokenizer's `padding=True`, on either side); each row is a document;
* **flattened**: `input_ids (1, T)` with `position_ids (1, T)` that restart at 0 at every
  document (`DataCollatorWithFlattening`, for padding-free packed training; its
  `cu_seq_lens_q`/`_k`, `max_length_q`/`_k` and `seq_idx` are checked against the documents
  and dropped). Rows of a padded batch may be packs of several documents too.

`labels (B, L)` follow `transformers`' convention: a token's own id (the model predicts it
from the tokens before), `-100` where no loss is taken; without them, the `input_ids`. The
documents of every row, in row order, become one packed sequence, and then:

1. a token's label is the **next** token's label of the same document, and a document's last
   token has none (its loss mask is 0), as the model's own shift gives per row, and as
   `DataCollatorWithFlattening`'s `-100` at every document's first label gives over a pack (with
   padding on the left, the model's own shift also has the pad before a row's first token
   predict it, unless that label is `-100`: a document's first token has no token before it here);
2. [`cpref.get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank] pads every
   document for the layout and keeps this rank's shard of everything.

$$ \text{labels}'_i = \begin{cases} \text{labels}_{i+1} & i + 1 \text{ in the document of } i
   \text{ and } \text{labels}_{i+1} \ne -100 \\ \text{(masked)} & \text{otherwise} \end{cases} $$

{{ figure figures/hf_batch.png }}

The result is what `get_batch_on_this_cp_rank` returns: `tokens`, `labels` (already the next
tokens, for `cpref.cp_loss`), `loss_mask`, `position_ids`, the batch's `sharding`, and any other
per-token tensor of the batch (`token_type_ids`, ...) sliced alike; and `shift_labels`, the same
labels with `-100` where no loss is taken, for the model's own loss:
`model(..., shift_labels=b["shift_labels"][None], cp=cp).loss`.

**Not `labels=`.** A `transformers` causal LM shifts its `labels=` itself, so these labels, already
shifted, would be shifted a second time: one token off, silently. The batch's `sharding` (a
[`BatchSharding`][cpref.hf.batch.BatchSharding], equal to the plain `Sharding`) remembers this
rank's labels, and the model-level checks ([`cpref.hf.guard`][cpref.hf.guard]) refuse them as
`labels=`, naming `shift_labels=` (on every rank alike, before any communication).

**`labels=input_ids`** (the shard's `tokens`) is the other way: the model's own labels, shifted
by cpref over the batch ([`cpref.hf.labels`][cpref.hf.labels]). The `BatchSharding` also remembers
where the batch's rows end, so that they are shifted inside each row, as `transformers` shifts a
padded batch: the loss is `transformers`' own on the batch with `-100` at its padding. A row padded
on its left is the one case it cannot be: `transformers` has the pad before the row's first token
predict it, and that pad is dropped here; such labels are refused, naming the fix (`-100` at
each row's first token, or `shift_labels`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cpref.base.errors import CPInputError
from cpref.batch.sharding import Sharding
from cpref.train.data import get_batch_on_this_cp_rank

__all__ = ["shard_batch", "documents", "BatchSharding"]

IGNORE = -100  # transformers' ignore_index
_DERIVED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def shard_batch(batch: Mapping[str, Any], *, cp_size: int, rank: int, layout: str = "zigzag",
                pad_token_id: int = 0) -> dict[str, Any]:  # fmt: skip
    """A padded or flattened `transformers` batch -> this rank's cpref batch (see the module docstring).

    Args:
        batch: `input_ids (B, L)` (or `(L,)`), and optionally `attention_mask`, `position_ids`,
            `labels` of the same shape and other per-token tensors `(B, L, ...)`.
        cp_size: the CP group size `P`.
        rank: this rank.
        layout: `"zigzag"` (default), `"contiguous"`, `"stream"` or `"balanced"`.
        pad_token_id: token and label id of the padding cpref adds.

    Returns:
        `get_batch_on_this_cp_rank`'s dict: `tokens`, `labels` (the next tokens), `loss_mask`,
        `position_ids`, `sharding` (a `BatchSharding`) and the other per-token tensors, each
        `(T / P, ...)`; and `shift_labels (T / P,)`, the labels with -100 where `loss_mask` is 0.

    Raises:
        CPInputError: for a batch without `input_ids`, non-integer ids, tensors of another shape, a
            float mask, positions or labels, a mask that is not 0/1 or has holes inside a row's
            tokens, positions that do not restart at 0 and count up by 1, boundaries of the
            collator's that are not the documents, `shift_labels` in the batch, or no token at all.

    Examples:
        >>> import torch
        >>> b = shard_batch({"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
        ...                  "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])},
        ...                 cp_size=1, rank=0, layout="contiguous")
        >>> b["tokens"].tolist(), b["labels"].tolist(), b["loss_mask"].tolist(), b["sharding"].cu_seqlens
        ([5, 6, 7, 8, 9], [6, 7, 0, 9, 0], [1.0, 1.0, 0.0, 1.0, 0.0], (0, 3, 5))
    """
    ids, tensors = _rows(batch)
    cu, rows = documents(ids, tensors.get("attention_mask"), tensors.get("position_ids"))
    _check_derived(batch, cu, rows)
    take = torch.cat([torch.arange(a, b) for a, b in rows])  # (T,) flat indices of the documents' tokens, in order
    labels = tensors.get("labels", ids).reshape(-1)[take]  # (T,)
    nxt = torch.cat([labels[1:], labels.new_full((1,), IGNORE)])  # (T,) the next token's label
    ends = torch.tensor(cu[1:]) - 1  # each document's last token
    nxt[ends] = IGNORE  # it has no next token in its document
    mask = nxt != IGNORE
    out = {"tokens": ids.reshape(-1)[take], "labels": torch.where(mask, nxt, pad_token_id), "loss_mask": mask.float()}
    for name, x in tensors.items():
        if name not in ("input_ids", "attention_mask", "position_ids", "labels"):
            out[name] = x.reshape(-1, *x.shape[2:])[take]  # (T, ...)
    b = get_batch_on_this_cp_rank(out, cu, cp_size=cp_size, rank=rank, layout=layout, pad_token_id=pad_token_id)
    b["shift_labels"] = b["labels"].masked_fill(b["loss_mask"] == 0, IGNORE)  # (T / P,) for shift_labels=
    ends, firsts = _row_marks(rows, ids.shape[1])  # where labels= are shifted inside each row (cpref.hf.labels)
    b["sharding"] = BatchSharding.of(b["sharding"], rank, b["labels"], b["loss_mask"], ends, firsts, out["tokens"],
                                     out.get("token_type_ids"))  # fmt: skip
    return b


def _row_marks(rows: list[tuple[int, int]], L: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stream index of every batch row's last token, and of the first token of every row padded on its left.

    `rows` are `documents`' flat index ranges `[a, e)` of the `(B, L)` batch, in stream order (a batch row may
    hold several documents: row `a // L`)."""
    ends, firsts, at = [], [], 0
    for i, (a, e) in enumerate(rows):
        if (i == 0 or rows[i - 1][0] // L != a // L) and a % L:  # a row's first token, with padding before it
            firsts.append(at)
        at += e - a
        if i + 1 == len(rows) or rows[i + 1][0] // L != a // L:  # a row's last token
            ends.append(at - 1)
    return tuple(ends), tuple(firsts)


class BatchSharding(Sharding):
    """The `Sharding` of a batch `shard_batch` made, which also holds this rank's `labels` and `loss_mask`, and
    where the batch's rows end and start.

    It is the batch's `Sharding` (equal to it, the same plans; pickled or copied, a `BatchSharding` still); what
    it adds is what tells its labels (already the next tokens) if a forward gets them as `labels=`, and the
    rows that `labels=` are shifted inside ([`cpref.hf.labels`][cpref.hf.labels]).

    Attributes:
        rank: the rank whose `labels` and `loss_mask` it holds.
        labels: `shard_batch`'s labels `(T / P,)` of that rank (the next tokens).
        loss_mask: their loss mask `(T / P,)`.
        row_ends: the index in the real (unpadded) stream of every batch row's last token, in order.
        left_firsts: the index in the real stream of the first token of every row padded on its left.
        tokens: the whole batch's token ids `(T,)`, in stream order (where its image tokens are: `cpref.hf.masks`).
        token_types: the whole batch's `token_type_ids` `(T,)` in stream order, or None (the masks of
            [`cpref.hf.masks`][cpref.hf.masks] are built from them).
    """

    __slots__ = ("rank", "labels", "loss_mask", "row_ends", "left_firsts", "tokens", "token_types")

    @classmethod
    def of(cls, sharding: Sharding, rank: int, labels: torch.Tensor, loss_mask: torch.Tensor,
           row_ends: tuple[int, ...], left_firsts: tuple[int, ...], tokens: torch.Tensor | None = None,
           token_types: torch.Tensor | None = None) -> BatchSharding:  # fmt: skip
        """`sharding`, holding rank `rank`'s `labels` and `loss_mask` `(T / P,)`, the rows' marks and the batch's
        token ids and types `(T,)` too."""
        made = object.__new__(cls)
        for name in Sharding.__slots__:
            object.__setattr__(made, name, object.__getattribute__(sharding, name))
        values = (rank, labels, loss_mask, tuple(row_ends), tuple(left_firsts), tokens, token_types)
        for name, value in zip(cls.__slots__, values):
            object.__setattr__(made, name, value)
        return made

    def __reduce__(self):
        """Pickled (and deep-copied) with its labels and rows: a batch made in a `DataLoader` worker keeps them."""
        plain = Sharding.__reduce__(self)
        extra = tuple(getattr(self, name) for name in BatchSharding.__slots__)
        return (_rebuild_batch, (plain, extra))

    def left_padded_firsts(self, rank: int) -> torch.Tensor:
        """Which of rank `rank`'s tokens are the first of a row padded on its left: bool `(T / P,)`."""
        flag = torch.zeros(self.cu_seqlens[-1], dtype=torch.bool)  # (T_real,)
        flag[list(self.left_firsts)] = True
        return self.shard(self.pad(flag, value=False), rank)  # (T / P,)

    def made_labels(self, labels: torch.Tensor, input_ids: torch.Tensor | None, rank: int) -> bool:
        """Whether a forward's `labels` on rank `rank` are these labels (on the loss tokens), not the tokens' own ids."""
        where = self.loss_mask != 0  # (T / P,)
        if rank != self.rank or labels.numel() != where.numel() or not bool(where.any()):
            return False
        given = labels.reshape(-1).to(where.device)[where].long()  # (loss tokens,)
        if not torch.equal(given, self.labels[where].long()):
            return False
        own = None if input_ids is None else input_ids.reshape(-1).to(where.device)[where].long()
        return own is None or not torch.equal(given, own)  # ids equal to their next ones: labels the model may shift


def _rows(batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`input_ids (B, L)` and every per-token tensor of `batch` as `(B, L, ...)`, checked."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise CPInputError(f"shard_batch needs a batch with an input_ids tensor, got {keys}")
    ids = batch["input_ids"]
    ids = ids[None] if ids.dim() == 1 else ids  # (B, L)
    if ids.dim() != 2 or ids.is_floating_point() or ids.numel() == 0:
        raise CPInputError(f"input_ids must be integer token ids (B, L), got {tuple(ids.shape)} {ids.dtype}")
    if "shift_labels" in batch:
        raise CPInputError("shard_batch makes shift_labels itself, from labels (shifted inside every document); "
                           "pass labels (transformers' convention: each token's own id), or none for the input_ids")  # fmt: skip
    tensors = {}
    for name, given in batch.items():
        if name in _DERIVED or not isinstance(given, torch.Tensor):
            continue
        x = given[None] if given.dim() == 1 and batch["input_ids"].dim() == 1 else given
        if tuple(x.shape[:2]) != tuple(ids.shape):
            raise CPInputError(f"{name} has shape {tuple(x.shape)} but input_ids {tuple(ids.shape)}: every per-token "
                               "tensor of the batch must match input_ids in its first dims")  # fmt: skip
        if name in ("attention_mask", "position_ids", "labels") and x.is_floating_point():
            raise CPInputError(f"{name} must be an integer tensor, got {x.dtype}")
        tensors[name] = x.cpu()
    return ids.cpu(), tensors


def documents(ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> tuple[list[int], list[tuple[int, int]]]:  # fmt: skip
    """The documents of a batch `(B, L)`: their `cu_seqlens` in the packed sequence, and each one's flat index range.

    A row's tokens are where `attention_mask` is 1 (one run of them: padding on either side); they
    are split where `position_ids` restart at 0.

    Examples:
        >>> documents(torch.zeros(1, 6), position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]))
        ([0, 3, 5, 6], [(0, 3), (3, 5), (5, 6)])
        >>> documents(torch.zeros(2, 3), attention_mask=torch.tensor([[0, 1, 1], [1, 0, 0]]))
        ([0, 2, 3], [(1, 3), (3, 4)])
    """
    B, L = ids.shape
    mask = torch.ones(B, L, dtype=torch.long) if attention_mask is None else attention_mask.long()
    if not ((mask == 0) | (mask == 1)).all():
        raise CPInputError("attention_mask must hold 1 (token) and 0 (padding) only")
    cu, rows = [0], []
    for b in range(B):
        where = mask[b].nonzero().flatten()  # (n,) the row's tokens
        if where.numel() == 0:
            continue  # a row of padding only
        lo, hi = int(where[0]), int(where[-1]) + 1
        if hi - lo != where.numel():
            raise CPInputError(f"attention_mask row {b} has padding between its tokens (columns {lo} to {hi - 1}); "
                               "padding goes on one side of a row, documents of a pack are told by position_ids")  # fmt: skip
        starts = [lo]
        if position_ids is not None:
            pos = position_ids[b, lo:hi].long()  # (n,)
            first = (pos == 0).nonzero().flatten()  # (d,) each document's first token in the row's run
            if first.numel() == 0 or int(first[0]) != 0 or not torch.equal(pos, _restarting(first, hi - lo)):
                raise CPInputError(f"position_ids of row {b} must restart at 0 at every document and count up by 1 "
                                   f"(got {pos[:8].tolist()}...); cpref numbers every document from 0")  # fmt: skip
            starts = [lo + int(i) for i in first]
        for a, e in zip(starts, starts[1:] + [hi]):
            rows.append((b * L + a, b * L + e))
            cu.append(cu[-1] + e - a)
    if len(cu) == 1:
        raise CPInputError("the batch holds no token: every attention_mask entry is 0")
    return cu, rows


def _restarting(first: torch.Tensor, n: int) -> torch.Tensor:
    """Positions `(n,)` that restart at 0 at every index of `first` (which starts with 0)."""
    doc = torch.zeros(n, dtype=torch.long)
    doc[first] = 1
    return torch.arange(n) - first[doc.cumsum(0) - 1]  # (n,) index minus its document's first index


def _check_derived(batch: Mapping[str, Any], cu: list[int], rows: list[tuple[int, int]]) -> None:
    """The collator's boundary arguments must describe the documents found."""
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if batch.get(key) is not None:
            got = [int(v) for v in torch.as_tensor(batch[key]).reshape(-1).tolist()]
            if got != cu:
                raise CPInputError(f"{key}={got[:8]} are not the boundaries {cu[:8]} of the batch's documents "
                                   "(from its attention_mask and position_ids)")  # fmt: skip
    if batch.get("seq_idx") is not None:
        seq = torch.as_tensor(batch["seq_idx"]).reshape(-1)
        want = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([e - a for a, e in rows]))
        take = torch.cat([torch.arange(a, e) for a, e in rows])
        if seq.numel() <= int(take.max()) or not torch.equal(seq[take].long(), want):
            raise CPInputError("seq_idx does not number the batch's documents in order (from its attention_mask and "
                               "position_ids)")  # fmt: skip


def _rebuild_batch(plain: tuple, extra: tuple) -> BatchSharding:
    rebuild, args = plain
    return BatchSharding.of(rebuild(*args), *extra)
