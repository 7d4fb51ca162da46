r"""The host-side plan of `NpuKernel`: which fused-op calls a `Varlen` becomes.

The contract allows every pair of lengths; the fused TND op is documented for fewer
(`cpref.kernels.npu_kernel` explains the rules). This module rewrites the sequence lists on
the host, once per [`Varlen`][cpref.kernels.contract.Varlen], into *entries* the op accepts,
cuts them into calls of at most `max_seqs` entries, and builds the two index tensors a call
needs on the device. Nothing here reads a device tensor.

**Entries.** Sequence $i$ with $n_q$ queries and $n_k$ keys becomes:

| sequence | entries | why |
| --- | --- | --- |
| $n_q = n_k = 0$ | none | it covers no row of either stream |
| causal, $n_q > n_k > 0$ | $(n_q - n_k, 0)$, $(n_k, n_k)$ | under `sparse_mode=3` keep $q \le kv$: the first $n_q - n_k$ rows see no key |
| anything else | $(n_q, n_k)$ | zero lengths are allowed by the op |

Neighbouring entries that hold no query, or no key, merge into one (their rows see nothing
either way). Rows of an entry with $n_k = 0$ are *dead*: the op's values there are not
trusted, the kernel overwrites them through the call's `dead` index.

**Calls.** Entries are taken `max_seqs` at a time; a call covers one contiguous range of
query rows and one of key rows, so its tensors are slices (views) of the kernel's inputs. A
call in which no row sees a key is not sent to the op at all.

**Softmax-stat index.** By default the op stores its row statistics for TND per entry,
head-major: entry $e$ with $n_e$ rows starting at row $c_e$ of the call owns storage rows
$[c_e H_q, (c_e + n_e) H_q)$ laid out as $(H_q, n_e)$. The statistic of query row $t$
(local position $t - c_e$) and head $h$ is therefore storage row

$$ r(t, h) = c_e H_q + h\, n_e + (t - c_e). $$

`stat_index` holds $r$ for every `(t, h)` in token-major order, `(T_c * H_q,)`.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch

from cpref.kernels.contract import Varlen

__all__ = ["Call", "entries", "plan_calls", "stat_index"]


class Call(NamedTuple):
    """One fused-op call: its slices of the packed streams, its host lists and device indices."""

    rows: slice  # query rows [q0, q1) of the packed stream
    keys: slice  # key rows [k0, k1) of the packed stream
    seq_qlen: list[int]  # actual_seq_qlen: cumulative, no leading 0, relative to rows.start
    seq_kvlen: list[int]  # actual_seq_kvlen: the same for keys
    live: bool  # False: no row of the call sees a key, the op is not called
    dead: torch.Tensor | None  # (R,) call rows that see no key; None when there are none
    stat_index: torch.Tensor | None  # (T_c * Hq,) storage row of each (t, h); None: stats are token-major


def entries(seqs: Varlen, causal: bool) -> list[tuple[int, int]]:
    """`(q_len, kv_len)` of every entry the op sees, after the rewrites in the module docstring."""
    out: list[tuple[int, int]] = []
    for q0, q1, k0, k1 in seqs.pairs():
        n_q, n_k = q1 - q0, k1 - k0
        parts = [(n_q - n_k, 0), (n_k, n_k)] if causal and n_q > n_k > 0 else [(n_q, n_k)]
        for n_q, n_k in parts:
            if n_q == 0 and n_k == 0:
                continue  # covers no row
            if out and (n_q == 0 == out[-1][0] or n_k == 0 == out[-1][1]):
                out[-1] = (out[-1][0] + n_q, out[-1][1] + n_k)  # keys-only or dead neighbours merge
            else:
                out.append((n_q, n_k))
    return out


def stat_index(q_lens: list[int], hq: int) -> torch.Tensor:
    """`r(t, h)` of the module docstring for entries with `q_lens` rows, `(T_c * Hq,)` int64 on the CPU."""
    lens = torch.tensor(q_lens, dtype=torch.int64)  # (E,)
    starts = torch.cumsum(lens, 0) - lens  # (E,) c_e
    entry = torch.repeat_interleave(torch.arange(len(q_lens)), lens)  # (T_c,) entry of each row
    c, n = starts[entry].unsqueeze(1), lens[entry].unsqueeze(1)  # (T_c, 1) each
    local = torch.arange(int(lens.sum())).unsqueeze(1) - c  # (T_c, 1) t - c_e
    # r(t, h) = c_e Hq + h n_e + (t - c_e)
    return (c * hq + torch.arange(hq) * n + local).reshape(-1)  # (T_c, Hq) -> (T_c * Hq,)


def plan_calls(
    seqs: Varlen, *, causal: bool, hq: int, device: torch.device, head_major_stats: bool, max_seqs: int
) -> list[Call]:
    """The calls for `seqs`: always at least one, covering every query and key row in order.

    Args:
        seqs: the contract's sequences (host ints).
        causal: bottom-right causal masking (changes the rewrites).
        hq: query heads, for the softmax-stat index.
        device: where the index tensors go (copied once: the plan is cached on `seqs`).
        head_major_stats: build `stat_index` (the op's default TND stat storage).
        max_seqs: at most this many entries per call.
    """
    found = entries(seqs, causal)
    calls, q0, k0 = [], 0, 0
    for i in range(0, max(len(found), 1), max_seqs):
        part = found[i : i + max_seqs]
        q_lens, kv_lens = [a for a, _ in part], [b for _, b in part]
        q1, k1 = q0 + sum(q_lens), k0 + sum(kv_lens)
        live = any(a and b for a, b in part)
        dead, index = None, None
        if live:
            starts = [0, *accumulate(q_lens)]
            rows = [r for s, (a, b) in zip(starts, part) if b == 0 for r in range(s, s + a)]
            dead = torch.tensor(rows, dtype=torch.int64).to(device) if rows else None  # (R,)
            index = stat_index(q_lens, hq).to(device) if head_major_stats else None  # (T_c * Hq,)
        calls.append(Call(slice(q0, q1), slice(k0, k1), list(accumulate(q_lens)), list(accumulate(kv_lens)), live, dead, index))
        q0, k0 = q1, k1
    return calls
