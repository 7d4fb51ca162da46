"""What the modes share, below all of them: one home for each, so no mode imports a sibling for it.

* [`no_double_backward`][cpref.modes.shared.no_double_backward]: every mode's autograd Function
  is differentiable once, and says so before its backward communicates;
* [`whole_documents`][cpref.modes.shared.whole_documents]: the kernel's sequences when one call
  sees every document whole, in order (Ulysses after its exchange; the all-gather mode at
  `P = 1`);
* [`head_split`][cpref.modes.shared.head_split]: whether, and with how many replicas of each
  key/value head, `a` ranks split the heads (Ulysses, the hierarchical mode, their costs).

The partial-result merge, which the kernels use as well, lives further down, in
[`cpref.kernels.merge`][cpref.kernels.merge].
"""

from __future__ import annotations

import torch

from cpref.base.errors import CPInputError
from cpref.batch.seqlens import Boundaries
from cpref.kernels.contract import Varlen
from cpref.modes.visible import chunked_sequences

__all__ = ["no_double_backward", "whole_documents", "document_sequences", "padded_rows", "head_split"]


def no_double_backward() -> None:
    """Raise before any backward communication if the caller asked for a differentiable backward."""
    if torch.is_grad_enabled():
        raise CPInputError(
            "cpref.attention is differentiable once: its backward cannot itself be differentiated "
            "(create_graph=True / double backward); call backward without create_graph"
        )


def whole_documents(b: Boundaries, chunk: int | None = None) -> Varlen:
    """Every document as one sequence of the (padded) stream in order: real queries see its real keys; with
    `chunk`, every chunk of a document a sequence of its own (`cpref.modes.visible`).

    Examples:
        >>> whole_documents(Boundaries.parse([0, 3, 5], [0, 4, 6]))  # (3, 3) doc 0, (0, 1) its padding keys, (1, 0) its padding query, (2, 2) doc 1
        Varlen(cu_q=[0, 3, 3, 4, 6], cu_kv=[0, 3, 4, 4, 6])
        >>> whole_documents(Boundaries.parse([0, 3, 5], [0, 4, 6]), chunk=2)  # doc 0 in chunks of 2 and 1
        Varlen(cu_q=[0, 2, 3, 3, 4, 6], cu_kv=[0, 2, 3, 4, 4, 6])
    """
    lens = [seq for i in range(b.num_docs) for seq in document_sequences(b.real_len(i), b.padded_len(i) - b.real_len(i), chunk)]
    return Varlen.from_lengths([n_q for n_q, _ in lens], [n_k for _, n_k in lens])


def document_sequences(n: int, pad: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """`(q_len, kv_len)` of a document of `n` real tokens and `pad` padding ones, rows in order: `(n, n)` the
    document (with `chunk`, one `(c, c)` per chunk), `(0, pad)` its padding keys, seen by no query, `(pad, 0)` its
    padding queries; empty ones dropped."""
    return chunked_sequences(n, pad, chunk)


def padded_rows(x: torch.Tensor, rows: torch.Tensor, m: int) -> torch.Tensor:
    """`x[rows]` followed by zero rows up to `m` (a payload every rank sends at one shape): `(m, ...)`, the rows
    gathered straight into it and only the tail zeroed (one pass over the payload)."""
    out = x.new_empty((m, *x.shape[1:]))
    torch.index_select(x, 0, rows, out=out[: len(rows)])
    out[len(rows) :].zero_()
    return out


def head_split(hq: int, hkv: int, a: int) -> int | None:
    """How many times each key/value head is replicated so that `a` ranks split the heads, or None if they cannot.

    Each of the `a` ranks takes $H_q / a$ query heads (so `a` must divide $H_q$) and the key/value
    heads those read: $H_{kv} / a$ of them if `a` divides $H_{kv}$ (1, no replica), else, with
    fewer key/value heads than ranks, each one replicated $a / H_{kv}$ times (`a % Hkv == 0`).

    Examples:
        >>> head_split(8, 8, 4), head_split(8, 2, 4), head_split(8, 1, 4), head_split(8, 3, 4), head_split(6, 6, 4)
        (1, 2, 4, None, None)
    """
    if hq % a:
        return None
    if hkv % a == 0:
        return 1
    return a // hkv if a % hkv == 0 else None
