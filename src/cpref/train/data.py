r"""The data path for packed EOD batches: pad, shard, and a loss that does not depend on P.

A packed batch holds documents of any length, but the zigzag layout needs every document to
be a multiple of `2P` tokens. [`get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank]
follows MindSpeed's EOD-padding path:

1. pad every document **at its end** to a multiple of the layout's granularity (`2P` for
   zigzag, `P` for contiguous; for stream and balanced only the last document, so that the
   batch is a multiple of `P`), with `pad_token_id` tokens whose loss mask is 0;
2. compute position ids inside each padded document (positions restart at every document,
   for RoPE);
3. slice tokens, labels, loss mask and position ids with the layout;
4. return the batch's [`Sharding`][cpref.batch.sharding.Sharding], which holds both boundary lists
   (the real `cu_seqlens` and the padded `cu_seqlens_padded`), `P` and the layout.

**Padding never changes a real token's result**, because `cpref.attention` receives both
lists with the sharding (see [`cpref.batch.seqlens`][cpref.batch.seqlens]): no query sees a padding key, and a padding query
sees nothing. The causal mask alone protects only causal attention (no real token sees a
later position, and end padding comes after every real token of its document); without the
mask a real query would see the padding keys of its document. The padded tokens' losses are
masked out.

## The loss

The loss must be normalised by the **global** number of loss tokens, not by each rank's own
count, or the loss would depend on how tokens fall on ranks (and a rank holding only padding
would divide by zero):

$$ \mathcal{L} = \frac{\sum_r \sum_{x \in r} \mathrm{mask}_x\, \mathrm{loss}_x}{\sum_r \sum_{x \in r} \mathrm{mask}_x} $$

[`cp_loss`][cpref.train.data.cp_loss] returns rank `r`'s share of this sum, so the shares add up
to $\mathcal{L}$. Each rank back-propagates its own share through its replica of the model,
so the gradient of $\mathcal{L}$ with respect to a replicated parameter is the **sum** of the
ranks' gradients: all-reduce the parameter gradients over the CP group with a **sum**.
Averaging them, as data parallelism does with its per-replica means, would make them `P`
times too small. With data parallelism as well (a DP x CP grid) the same reasoning covers
the whole grid: normalise by the number of loss tokens over **every** rank of the DP x CP
group (and every micro-batch of the step: pass the total as `count`), and all-reduce the
gradients over that group with a **sum**. The loss is then the mean over every token the step
trains on, whatever the DP and CP sizes, which is what makes a run at any DP x CP match a run
on one device that sees the same packs. When no rank holds a loss token the count is 0, and
the loss is 0 with zero gradients, not NaN.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any, Mapping

import torch

from cpref.base.checks import as_fill, as_int
from cpref.base.errors import CPInputError, PeerInputError
from cpref.batch.mask import Mask
from cpref.batch.seqlens import CuSeqlens
from cpref.batch.sharding import Sharding
from cpref.comm.protocol import Collectives, check_comm
from cpref.modes.consistency import exchange

__all__ = ["get_batch_on_this_cp_rank", "cp_loss"]


def get_batch_on_this_cp_rank(
    batch: Mapping[str, torch.Tensor],
    cu_seqlens: CuSeqlens,
    *,
    cp_size: int,
    rank: int,
    layout: str = "zigzag",
    pad_token_id: int = 0,
    mask: Mask | None = None,
) -> dict[str, Any]:
    """EOD-pad a packed batch and return this rank's slice, with the batch's `Sharding`.

    Args:
        batch: `tokens (T,)`, `labels (T,)` and optionally `loss_mask (T,)` (default all ones);
            any other `(T, ...)` tensor is padded with zeros and sliced alike.
        cu_seqlens: real (unpadded) document boundaries, leading 0.
        cp_size: CP group size `P`.
        rank: this rank.
        layout: `"zigzag"` (default), `"contiguous"`, `"stream"` or `"balanced"`.
        pad_token_id: token and label id of the padding.
        mask: the batch's attention mask (a `cpref.Mask` over its real tokens), for `layout="balanced"`: the
            tokens are then placed so that every rank does an equal share of the mask's work
            ([`cpref.batch.balanced_mask`][cpref.batch.balanced_mask]). The other layouts place tokens by their
            own rule and leave it out. Either way the attention computes the mask it is given (`CPContext(mask=)`).

    Returns:
        This rank's `tokens`, `labels`, `loss_mask`, `position_ids` (and other keys), and
        `sharding`: the [`Sharding`][cpref.batch.sharding.Sharding] of the padded batch (real and
        padded boundaries, `P`, layout), what `cpref.attention` and `CPContext` take.

    Examples:
        >>> import torch
        >>> b = get_batch_on_this_cp_rank({"tokens": torch.arange(7), "labels": torch.arange(7)}, [0, 7],
        ...                               cp_size=2, rank=1)
        >>> b["tokens"].tolist(), b["loss_mask"].tolist(), b["sharding"].cu_seqlens_padded
        ([2, 3, 4, 5], [1.0, 1.0, 1.0, 1.0], (0, 8))
    """
    sharding = Sharding.eod_padded(cu_seqlens, cp_size=cp_size, layout=layout, mask=mask if layout == "balanced" else None)
    rank = as_int("rank", rank, lo=0, hi=cp_size)
    pad_token_id = as_int("pad_token_id", pad_token_id)
    if not isinstance(batch, Mapping):
        raise CPInputError(f"batch must be a dict of (T, ...) tensors, got {type(batch).__name__}")
    batch = dict(batch)
    if "tokens" not in batch or "labels" not in batch:
        raise CPInputError(f"batch needs 'tokens' and 'labels', got keys {sorted(batch)}")
    for name, x in batch.items():
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != sharding.cu_seqlens[-1]:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise CPInputError(f"batch[{name!r}] is {got}, but cu_seqlens holds {sharding.cu_seqlens[-1]} tokens: every "
                               "value of the batch must be a (T, ...) tensor of the whole (unpadded) batch")  # fmt: skip
    for name in ("tokens", "labels"):  # padded with pad_token_id: it must fit their dtype as it is
        as_fill("pad_token_id", pad_token_id, batch[name].dtype)
    if "loss_mask" not in batch:
        batch["loss_mask"] = torch.ones_like(batch["tokens"], dtype=torch.float32)
    fill = {"tokens": pad_token_id, "labels": pad_token_id}
    out: dict[str, Any] = {}
    for name, x in batch.items():
        x_pad = sharding.pad(x, value=fill.get(name, 0))  # (T_pad, ...)
        out[name] = sharding.shard(x_pad, rank)  # (T_pad/P, ...)
    out["position_ids"] = sharding.positions(rank)  # (T_pad/P,)
    out["sharding"] = sharding
    return out


def cp_loss(
    token_loss: torch.Tensor, loss_mask: torch.Tensor, comm: Collectives, *, count: torch.Tensor | float | None = None
) -> torch.Tensor:
    """This rank's share of the globally normalised masked mean loss.

    Args:
        token_loss: `(T_l,)` per-token losses of this rank (floating).
        loss_mask: `(T_l,)` 1 for tokens that count, 0 for padding and ignored tokens; the
            same shape as `token_loss` (no broadcasting). A token whose mask is 0 takes no part, even
            if its loss is NaN or inf.
        comm: the group the loss is normalised over (one all-reduce of a scalar count): the
            CP group, or the whole DP x CP group to make the loss the mean over every replica.
        count: the global number of loss tokens, if the caller has it already (e.g. over several
            micro-batches): a number or a one-element tensor, the same on every rank, at least the
            loss tokens of every rank of `comm`. Then no all-reduce is made; the ranks compare it
            in their host exchange (it is read on the host: one synchronisation on an accelerator).

    Returns:
        A scalar whose sum over the CP ranks is the mean loss over all loss tokens; 0 (with
        zero gradient) when no rank has a loss token. Sum the parameter gradients over the
        CP group (see the module docstring).

    Raises:
        CPInputError: for mismatched shapes, a non-floating `token_loss`, or a `count` that is not
            a finite number, is below the loss tokens of the group (`count=0` with loss tokens),
            or differs between ranks: on every rank of `comm` alike. The ranks exchange whether
            their inputs passed, and the count (one host exchange, as in
            [`cpref.modes.consistency`][cpref.modes.consistency]) before the count's all-reduce, so a rank
            whose own inputs fail never leaves the others waiting in it.
    """
    check_comm(comm, fix="pass the group the loss is normalised over: the CP group's (or the DP x CP group's) "
               "collectives, or cpref.SingleRank() without CP")  # fmt: skip
    problem = _loss_input_problem(token_loss, loss_mask, count)
    given = local = 0.0
    if problem is None and count is not None:  # one host read of both
        given, local = torch.stack([torch.as_tensor(count).reshape(()).to(loss_mask.device).double(),
                                    loss_mask.detach().double().sum()]).tolist()  # fmt: skip
        if not (math.isfinite(given) and given >= 0):
            problem, given = f"count must be a finite number >= 0, got {given!r}; {_COUNT_FIX}", 0.0
    if comm.size > 1:  # does every rank's pass? (a rank that raised alone would leave the others waiting)
        device = token_loss.device if isinstance(token_loss, torch.Tensor) else getattr(comm, "device", "cpu")
        row = [int(problem is None), int(count is not None), _bits(given), _bits(local)]
        rows, who = exchange(comm, row, torch.device(device))
        failed = [label for label, (ok, *_) in zip(who, rows) if not ok]
        if failed and problem is None:
            named = "a rank" if who[0] == "lowest code" else ", ".join(failed)
            raise PeerInputError(f"cp_loss: the token_loss / loss_mask of {named} of the group failed validation (that "
                               f"rank's own error names them); rank {comm.rank} raises too, so that no rank waits")  # fmt: skip
        if problem is None:
            problem = _count_problem(rows, who)
    elif problem is None and count is not None and local > given:
        problem = f"count={given:g} is below this rank's {local:g} loss tokens; {_COUNT_FIX}"
    if problem is not None:
        raise CPInputError(problem)
    mask = loss_mask.to(token_loss.dtype)
    if count is None:
        count = comm.all_reduce(mask.sum().detach().reshape(1))  # global number of loss tokens
    count = torch.as_tensor(count, dtype=token_loss.dtype, device=token_loss.device).reshape(())
    # a select, not a product: a masked token's loss of NaN or inf would survive `loss * 0`
    kept = torch.where(mask != 0, token_loss * mask, torch.zeros_like(token_loss))  # (T_l,)
    return kept.sum() / count.clamp_min(1)


_COUNT_FIX = ("count is the loss tokens of every rank (and micro-batch) the loss is normalised over, the same on every "
              "rank; omit it and cp_loss counts them (one all-reduce)")  # fmt: skip


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _count_problem(rows: list[list[int]], who: list[str]) -> str | None:
    """What is wrong with the ranks' `count=` (rows `[ok, given?, count, local tokens]`), or None."""
    if who[0] == "lowest code":  # min and max only: the columns differ where min != max
        differ = [i for i in (1, 2) if rows[0][i] != rows[1][i]]
        if differ:
            return f"cp_loss: the ranks pass different count= (given or not, or its value); {_COUNT_FIX}"
        return None
    if len({row[1] for row in rows}) > 1:
        return ("cp_loss: count= is given on " + ", ".join(w for w, row in zip(who, rows) if row[1]) + " and not on "
                + ", ".join(w for w, row in zip(who, rows) if not row[1]) + f"; {_COUNT_FIX}")  # fmt: skip
    if not rows[0][1]:
        return None
    counts = [struct.unpack("<d", struct.pack("<q", row[2]))[0] for row in rows]
    if len(set(counts)) > 1:
        return "cp_loss: the ranks pass different count=: " + "; ".join(f"{w}: {c:g}" for w, c in zip(who, counts)) + f"; {_COUNT_FIX}"
    total = sum(struct.unpack("<d", struct.pack("<q", row[3]))[0] for row in rows)
    if total > counts[0] * (1 + 1e-12):
        return f"cp_loss: count={counts[0]:g} is below the {total:g} loss tokens of the group's ranks; {_COUNT_FIX}"
    return None


def _loss_input_problem(token_loss: object, loss_mask: object, count: object = None) -> str | None:
    """What is wrong with `cp_loss`'s inputs on this rank, or None."""
    for name, t in (("token_loss", token_loss), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
    if token_loss.shape != loss_mask.shape:
        return (f"token_loss has shape {tuple(token_loss.shape)} but loss_mask {tuple(loss_mask.shape)}; "
                "they must match exactly (one mask entry per token; reshape, do not broadcast)")  # fmt: skip
    if not token_loss.is_floating_point():
        return f"token_loss has dtype {token_loss.dtype}; it must be floating"
    if count is not None:
        ok = isinstance(count, numbers.Real) and not isinstance(count, bool) or (  # NumPy's numbers too
            isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_complex() and count.dtype != torch.bool)  # fmt: skip
        if not ok:
            got = f"a tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor) else repr(count)
            return f"count must be a number or a one-element tensor, got {got}; {_COUNT_FIX}"
        value = float(count) if not isinstance(count, torch.Tensor) else None
        if value is not None and not (math.isfinite(value) and value >= 0):
            return f"count must be a finite number >= 0, got {count!r}; {_COUNT_FIX}"
    return None
