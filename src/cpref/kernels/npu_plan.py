r"""The host-side plan of `NpuKernel`: which fused-op calls a `Varlen` becomes.

The contract allows every pair of lengths, every shift and every window; the fused TND op is
documented for fewer (`cpref.kernels.npu_kernel` explains the rules). This module rewrites the
sequence lists on the host, once per [`Varlen`][cpref.kernels.contract.Varlen], into *entries*
the op accepts, each with the *band* it needs, cuts them into calls of at most `max_seqs`
entries with one band each, and builds the two index tensors a call needs on the device.
Nothing here reads a device tensor.

**Bands.** The op masks every sequence of a call alike, relative to its bottom-right corner:
with `pre_tockens` $a$ and `next_tockens` $b$, query $x$ of an entry with $n_q$ queries and $n_k$
keys sees key $y$ iff

$$ c_x - a \le y \le c_x + b, \qquad c_x = x + n_k - n_q . $$

The contract's query $x$ stands at $p = x + d$ (shift $d$) and sees
$p - \mathrm{left} \le y \le p + \mathrm{right}$ (`window=(left, right)`, $\mathrm{right} = 0$ under
causal). With $\delta = d - (n_k - n_q)$ that is the band

$$ a = \mathrm{left} - \delta, \qquad b = \mathrm{right} + \delta , $$

an unbounded side ($-1$) being the op's default $2^{31} - 1$ (`UNBOUNDED`). Plain causal is the
band $(2^{31} - 1, 0)$ and full attention $(2^{31} - 1, 2^{31} - 1)$.

**Entries.** The visible keys $[\mathrm{lo}, \mathrm{hi})$ of `Varlen.visible` never decrease
with $x$, so the rows that see a key are one run $[x_0, x_1)$, and the keys past the last of them,
$[y_1, n_k)$, are seen by nobody. Sequence $i$ becomes:

| sequence | entries | why |
| --- | --- | --- |
| $n_q = n_k = 0$ | none | it covers no row of either stream |
| no row sees a key | $(n_q, 0)$, $(0, n_k)$ | nothing for the op to compute |
| otherwise | $(x_0, 0)$, $(x_1 - x_0, y_1)$ with its band, $(0, n_k - y_1)$, $(n_q - x_1, 0)$ | rows that see no key never reach the op |

(entries of length 0 are left out). Rows before $x_0$ see no key because their band ends before
key 0, rows from $x_1$ because it starts after the last key; the op's documentation disagrees
with itself about such rows (and allows a negative $a$ or $b$ only under further conditions),
so the kernel never sends them. Cutting them off and the keys past $y_1$ makes both sides of
the band $\ge 0$: the last row sees key $y_1 - 1$ (so $b \ge 0$), and it sees a key (so $a \ge 0$). Under plain causal this
is the split of a sequence with $n_q > n_k$ into $(n_q - n_k, 0)$ and $(n_k, n_k)$, as the op's
`q_len <= kv_len` rule for `sparse_mode=3` asks.

Neighbouring entries that hold no query, or no key, merge into one (their rows see nothing
either way). Rows of an entry with $n_k = 0$ are *dead*: the op's values there are not
trusted, the kernel overwrites them through the call's `dead` index.

**Calls.** Consecutive entries are taken into one call while their bands agree (an entry
without a query or a key has no band and joins any call) and there are at most `max_seqs` of
them; a call covers one contiguous range of query rows and one of key rows, so its tensors are
slices (views) of the kernel's inputs. A call in which no row sees a key is not sent to the op
at all. The kernel sends a call of band `FULL` without a mask, one of band `CAUSAL` as
`sparse_mode=3`, and any other as `sparse_mode=4` with its two sides. Entries of different
bands need different calls: a windowed `Varlen` whose sequences are shifted differently (a
non-causal window's all-gather or ring calls, say) may take one call per sequence.

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

from cpref.kernels.contract import NO_WINDOW, Varlen

__all__ = ["Call", "Entry", "UNBOUNDED", "FULL", "CAUSAL", "entries", "plan_calls", "stat_index"]

UNBOUNDED = 2147483647  # the op's default pre_tockens / next_tockens: no bound on that side
FULL = (UNBOUNDED, UNBOUNDED)  # the band of full attention
CAUSAL = (UNBOUNDED, 0)  # the band of bottom-right causal attention (sparse_mode=3)


class Entry(NamedTuple):
    """One sequence of the op's lists: its lengths, and the band it needs (None: no row sees a key)."""

    q_len: int
    kv_len: int
    band: tuple[int, int] | None  # (pre_tockens, next_tockens), relative to the bottom-right corner


class Call(NamedTuple):
    """One fused-op call: its slices of the packed streams, its host lists and band, its device indices."""

    rows: slice  # query rows [q0, q1) of the packed stream
    keys: slice  # key rows [k0, k1) of the packed stream
    seq_qlen: list[int]  # actual_seq_qlen: cumulative, no leading 0, relative to rows.start
    seq_kvlen: list[int]  # actual_seq_kvlen: the same for keys
    band: tuple[int, int]  # (pre_tockens, next_tockens) of every entry of the call: FULL, CAUSAL or a band
    live: bool  # False: no row of the call sees a key, the op is not called
    dead: torch.Tensor | None  # (R,) call rows that see no key; None when there are none
    stat_index: torch.Tensor | None  # (T_c * Hq,) storage row of each (t, h); None: stats are token-major


def _split(n_q: int, n_k: int, shift: int, left: int, right: int) -> list[Entry]:
    """The entries of one sequence (module docstring), zero-length ones included."""
    # row x sees a key iff p + right >= 0 and p - left <= n_k - 1, with p = x + shift
    x0 = 0 if right < 0 else min(n_q, max(0, -right - shift))
    x1 = n_q if left < 0 else max(x0, min(n_q, n_k + left - shift))
    if n_k == 0 or x0 == x1:
        return [Entry(n_q, 0, None), Entry(0, n_k, None)]
    y1 = n_k if right < 0 else min(n_k, x1 + shift + right)  # one past the last row's last key
    # delta = shift - (kv_len - q_len) of the kept rows [x0, x1) over the keys [0, y1)
    delta = x0 + shift - (y1 - (x1 - x0))
    # pre = left - delta, next = right + delta (both >= 0 here); -1 is unbounded
    pre = UNBOUNDED if left < 0 else min(UNBOUNDED, left - delta)
    nxt = UNBOUNDED if right < 0 else min(UNBOUNDED, right + delta)
    return [Entry(x0, 0, None), Entry(x1 - x0, y1, (pre, nxt)), Entry(0, n_k - y1, None), Entry(n_q - x1, 0, None)]


def entries(seqs: Varlen, causal: bool, window: tuple[int, int] = NO_WINDOW) -> list[Entry]:
    """The entries the op sees, after the rewrites in the module docstring (`window` canonical, as `check_window` gives it)."""
    left, right = window[0], 0 if causal else window[1]
    out: list[Entry] = []
    for i, (q0, q1, k0, k1) in enumerate(seqs.pairs()):
        for e in _split(q1 - q0, k1 - k0, seqs.shift(i), left, right):
            if e.q_len == 0 and e.kv_len == 0:
                continue  # covers no row
            if out and (e.q_len == 0 == out[-1].q_len or e.kv_len == 0 == out[-1].kv_len):
                out[-1] = Entry(out[-1].q_len + e.q_len, out[-1].kv_len + e.kv_len, None)  # keys-only or dead neighbours merge
            else:
                out.append(e)
    return out


def _groups(found: list[Entry], max_seqs: int) -> list[list[Entry]]:
    """Consecutive entries cut into calls: at most `max_seqs` each, one band each (band-less entries join any)."""
    groups: list[list[Entry]] = [[]]
    band = None  # the band of the open call, once it has a live entry
    for e in found:
        if len(groups[-1]) == max_seqs or (e.band is not None and band is not None and e.band != band):
            groups.append([])
            band = None
        groups[-1].append(e)
        band = e.band if e.band is not None else band
    return groups


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
    seqs: Varlen, *, causal: bool, hq: int, device: torch.device, head_major_stats: bool, max_seqs: int,
    window: tuple[int, int] = NO_WINDOW,
) -> list[Call]:  # fmt: skip
    """The calls for `seqs`: always at least one, covering every query and key row in order.

    Args:
        seqs: the contract's sequences (host ints), with their shifts.
        causal: bottom-right causal masking (the window's right side is 0).
        hq: query heads, for the softmax-stat index.
        device: where the index tensors go (copied once: the plan is cached on `seqs`).
        head_major_stats: build `stat_index` (the op's default TND stat storage).
        max_seqs: at most this many entries per call.
        window: the contract's `(left, right)`, canonical (`check_window`).
    """
    calls, q0, k0 = [], 0, 0
    for part in _groups(entries(seqs, causal, window), max_seqs):
        q_lens, kv_lens = [e.q_len for e in part], [e.kv_len for e in part]
        q1, k1 = q0 + sum(q_lens), k0 + sum(kv_lens)
        band = next((e.band for e in part if e.band is not None), None)
        dead, index = None, None
        if band is not None:  # live: some row sees a key
            starts = [0, *accumulate(q_lens)]
            rows = [r for s, e in zip(starts, part) if e.kv_len == 0 for r in range(s, s + e.q_len)]
            dead = torch.tensor(rows, dtype=torch.int64).to(device) if rows else None  # (R,)
            index = stat_index(q_lens, hq).to(device) if head_major_stats else None  # (T_c * Hq,)
        calls.append(Call(slice(q0, q1), slice(k0, k1), list(accumulate(q_lens)), list(accumulate(kv_lens)),
                          band or FULL, band is not None, dead, index))  # fmt: skip
        q0, k0 = q1, k1
    return calls
