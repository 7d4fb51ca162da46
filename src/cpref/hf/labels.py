r"""Labels under CP: `labels=` shifted over the unsharded batch inside each row, and labels already shifted refused.

A causal LM in `transformers` takes `labels=` as each token's own id and shifts them itself: the
label of token $j$ is token $j + 1$'s. On a shard that shift would pair each token with the next
one *of the shard* (across the pieces a layout gives a rank) and leave the shard's last token
unlabelled. The [guard][cpref.hf.guard] runs two steps of its forward pre-hook from here:

**Step 1, on the rank's own inputs, before any communication** ([`check_labels`][cpref.hf.labels.check_labels]).
`labels` and `shift_labels` must be this rank's `T / P` integer labels; only causal LMs shift
(`labels=` of any other head is refused: [`cpref.cp_loss`][cpref.train.data.cp_loss] normalises a
head's loss over the batch); and labels that are **already the next tokens** are refused, since
the model would shift them a second time, silently (every token learning the one after next):

* the labels of [`shard_batch`][cpref.hf.batch.shard_batch], recognised by their values (its
  sharding remembers them), named with their fix `shift_labels=batch["shift_labels"][None]`;
* any others, [`get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank]'s or
  Megatron's: at every pair of neighbouring real tokens of one document on the shard
  ([`next_tokens`][cpref.hf.labels.next_tokens]), a label that is not ignored equals the next
  token's id, and not every one equals its own token's id. Where a label is both the tokens
  repeat, and shifting or not gives the same loss; labels that equal their own ids
  (`transformers`' convention) are never refused.

And of a [`shard_batch`][cpref.hf.batch.shard_batch] batch padded on the left, labels that
label a row's first token are refused: `transformers`' own shift has the pad before it predict it
(unless that label is `-100`), a prediction from no token of the row that cpref cannot make, since
`shard_batch` dropped the padding. The fix it names: `shift_labels=batch["shift_labels"][None]`, or
`-100` at every row's first token.

A rank whose labels are refused raises in step 1; the guard's agreement row makes every other
rank raise too, so no rank waits in a collective.

**Step 5, over the batch** ([`loss_arguments`][cpref.hf.labels.loss_arguments]). The ranks
all-gather their label shards (`T / P` ints each) and shift them over the unsharded, unpadded
stream, exactly as the model does without CP, so each rank gets `shift_labels` for its tokens;
`num_items_in_batch` (when not given) is the number of loss tokens of the whole batch. The
model's `loss` on a rank is then that rank's share: the shares add up to the mean over the batch.
With `shift_labels` and no `num_items_in_batch`, the count is one all-reduce, and `shift_labels`
alone are handed on as `labels` too (`transformers` computes a loss only where labels are given).

The stream is shifted **inside each row** of the batch: a `shard_batch` batch remembers where its
rows end ([`BatchSharding`][cpref.hf.batch.BatchSharding]`.row_ends`), and a row's last token
predicts nothing, as in `transformers`' shift of a padded `(B, L)` batch, where it predicts the
padding (`-100`) or nothing. So `labels=input_ids` of a padded batch is `transformers`' loss on that
batch with `-100` at the padding, and of a flattened one (one row) its loss on that row, across
the row's documents as `transformers` shifts it (labels with `-100` at every document's first
token, as `DataCollatorWithFlattening` makes them, keep the documents apart). Any other
sharding's stream is one row: `transformers`' loss on the packed `(1, T)` sequence.

$$ \text{shift\_labels}_i = \begin{cases} \text{labels}_{g(i) + 1} & g(i) \text{ not a row's last} \\
   -100 & \text{otherwise} \end{cases}, \qquad \text{loss}_r = \frac{\sum_{i \in r}
   \ell_i}{\#\{i : \text{shift\_labels}_i \ne -100\}} $$

where $g(i)$ is token $i$'s index in the unpadded stream.
"""

from __future__ import annotations

from typing import Any

import torch

from cpref.base.errors import CPInputError
from cpref.batch.layout import local_chunks
from cpref.batch.sharding import Sharding
from cpref.hf.batch import BatchSharding
from cpref.hf.layer import CP

__all__ = ["check_labels", "next_tokens", "loss_arguments", "causal_lm"]


def check_labels(model: torch.nn.Module, call: dict, s: Sharding, rank: int, what: str) -> None:
    """The guard's step 1 for the loss arguments: this rank's integer labels, of a causal LM, not shifted already."""
    for key in ("labels", "shift_labels"):
        y = call.get(key)
        if y is None:
            continue
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.numel() != s.local_tokens:
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise CPInputError(f"{what}: {key} must be this rank's {s.local_tokens} integer labels (1, T_l), got {got}")
        if key == "labels" and not causal_lm(model):
            raise CPInputError(f"{what}: labels= under CP are shifted for causal LMs only; compute this head's loss "
                               "from its outputs with cpref.cp_loss (normalised over the whole batch)")  # fmt: skip
        if key != "labels" or call.get("shift_labels") is not None:
            continue
        if isinstance(s, BatchSharding) and s.made_labels(y, call.get("input_ids"), rank):
            raise CPInputError(f"{what}: labels= are cpref.hf.shard_batch's labels, which are already the next tokens: "
                               "the model would shift them a second time; pass shift_labels=batch['shift_labels'][None] "
                               "instead (batch = cpref.hf.shard_batch(...))")  # fmt: skip
        if next_tokens(y, call.get("input_ids"), s, rank, call.get("ignore_index", -100)):
            raise CPInputError(f"{what}: labels= are already the next tokens (each is the input id of the token after "
                               "it in its document, as cpref.get_batch_on_this_cp_rank's and Megatron's labels are): the "
                               "model would shift them a second time; pass them as shift_labels= (with -100 where "
                               "loss_mask is 0), or pass labels=input_ids")  # fmt: skip
        if isinstance(s, BatchSharding):
            _check_left_padded(y, s, rank, call.get("ignore_index", -100), what)


def _check_left_padded(labels: torch.Tensor, s: BatchSharding, rank: int, ignore: int, what: str) -> None:
    """`labels=` of a row padded on its left must ignore the row's first token: `transformers`' own shift has the pad
    before it predict it, from no token of the row, and `shard_batch` dropped that pad."""
    hit = s.left_padded_firsts(rank).to(labels.device) & (labels.reshape(-1) != ignore)  # (T_l,)
    if bool(hit.any()):
        raise CPInputError(f"{what}: labels= label the first token of {int(hit.sum())} rows padded on their left on rank "
                           f"{rank} (the first at shard token {int(hit.nonzero()[0, 0])}): transformers' own shift has "
                           "the padding before a row's first token predict it, which cpref cannot (shard_batch drops "
                           "the padding); pass shift_labels=batch['shift_labels'][None], or labels with "
                           f"{ignore} at every row's first token")  # fmt: skip


def next_tokens(labels: torch.Tensor, ids: Any, s: Sharding, rank: int, ignore: int) -> bool:
    """Whether this rank's `labels` are the next tokens' ids already: at every pair of neighbours of one document
    (`_neighbours`) whose label is not `ignore`, the label is the next token's id, and not every one is its own token's
    (where each is both, the tokens repeat, and shifting or not gives the same loss)."""
    if not isinstance(ids, torch.Tensor) or ids.numel() != s.local_tokens:
        return False  # inputs_embeds: no ids to compare with
    i = _neighbours(s, rank).to(labels.device)  # (n,)
    y, x = labels.reshape(-1).long(), ids.reshape(-1).to(labels.device).long()  # (T_l,) each
    given = y[i] != ignore  # (n,)
    if not bool(given.any()):
        return False
    label, following, own = y[i][given], x[i + 1][given], x[i][given]
    return bool((label == following).all()) and not bool((label == own).all())


def _neighbours(s: Sharding, rank: int) -> torch.Tensor:
    """Rank `rank`'s local rows `i` whose row `i + 1` is the next real token of the same document: LongTensor `(n,)`
    (a piece's real tokens come first, its padding after them)."""

    def build() -> torch.Tensor:
        b, rows, at = s.bounds, [], 0
        for doc, start, end in local_chunks(b, cp_size=s.cp_size, rank=rank, layout=s.layout):
            real = b.real_in(doc, start - b.padded[doc], end - b.padded[doc])
            rows.append(torch.arange(at, at + max(real - 1, 0)))
            at += end - start
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)

    return s.plan(("hf_neighbours", rank), build)


def causal_lm(model: torch.nn.Module) -> bool:
    """Whether `model` is a causal LM, whose loss shifts its labels."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def loss_arguments(model: torch.nn.Module, call: dict, cp: CP) -> None:
    """The guard's step 5: `shift_labels` over the unsharded stream, and the batch's loss tokens."""
    labels, shift = call.get("labels"), call.get("shift_labels")
    if labels is None and shift is not None and causal_lm(model):
        labels = call["labels"] = shift  # transformers computes a loss only where labels are given
    if labels is None:
        return
    s, comm, ignore = cp.sharding, cp.comm, call.get("ignore_index", -100)
    if shift is None:
        every = comm.all_gather(labels.reshape(-1).long())  # (P T_l,) every rank's labels
        stream = s.unpad(s.unshard(list(every.split(s.local_tokens))))  # (T_real,) in stream order
        # the label of token j is the next one's: labels[j + 1], the last one's ignored
        nxt = torch.cat([stream[1:], stream.new_full((1,), ignore)])  # (T_real,)
        if isinstance(s, BatchSharding):  # a row's last token: the next token in the stream is another row's
            nxt[list(s.row_ends)] = ignore
        call["shift_labels"] = s.shard(s.pad(nxt, value=ignore), comm.rank).view(1, -1)  # (1, T_l)
        if call.get("num_items_in_batch") is None:
            call["num_items_in_batch"] = (nxt != ignore).sum()
    elif call.get("num_items_in_batch") is None:
        mine = (shift.reshape(-1) != ignore).sum().reshape(1)  # (1,) this rank's loss tokens
        call["num_items_in_batch"] = comm.all_reduce(mine).reshape(())
