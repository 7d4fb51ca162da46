r"""The fused CPU path's plan: which calls of PyTorch's fused attention a `Varlen` takes.

[`torch_fused`][cpref.kernels.torch_fused] runs these calls; this module only decides them,
from host integers, once per [`Varlen`][cpref.kernels.contract.Varlen]. A call is a
[`Run`][cpref.kernels.torch_fused_plan.Run]: `count` equally spaced *parts* of `rows` queries
and `keys` keys, one strided batch of the op.

**Plain calls** (no window; bottom-right, or no causal mask, where shifts change nothing): one
part per sequence, or a causal square and the keys before it, merged by lse (see the fused
path's docstring), `plan_runs`.

**Shifted causal calls** (no window, explicit shifts), `plan_shifted_runs`: row $x$ of a
sequence with shift $\delta$ sees the keys $[0, \min(n_k, x + \delta + 1))$, so its rows fall in
three ranges, none of which needs a mask: the rows before $\max(0, -\delta)$ see no key (never
computed); the rows up to $f = n_k - 1 - \delta$ see a prefix growing by one key a row, a
bottom-right causal block over the keys $[0, f + \delta)$ (a causal square and the keys before it,
as a plain call); the rows from $f$ on see every key, one unmasked part. Those two parts share
keys, whose gradients the fused path adds up. The ring over pieces (the stream and balanced
layouts, `cpref.modes.ring_window`) makes such calls: a piece's queries against an earlier
piece of their document see all of it, so they take these unmasked parts rather than the band
path's masked tiles (slower on the same scores: `bench/scaling.py` times the balanced ring).

**Bands** (a sliding window), `plan_band_runs`. Row $x$ of a sequence sees
the keys $[\mathrm{lo}_x, \mathrm{hi}_x)$ of [`Varlen.visible`][cpref.kernels.contract.Varlen.visible],
and both bounds grow by 0 or 1 from one row to the next. The rows are cut into tiles of $R$;
the tile $[a, b)$ needs the keys $[\mathrm{lo}_a, \mathrm{hi}_{b-1})$, and every one of its rows
sees the middle $[c_0, c_1) = [\mathrm{lo}_{b-1}, \mathrm{hi}_a)$. A tile is cut into

* the **middle**, all its rows over $[c_0, c_1)$: no mask;
* the **left edge** $[\mathrm{lo}_a, c_0)$ for the rows with $\mathrm{lo}_x < c_0$ (a prefix) and the
  **right edge** $[c_1, \mathrm{hi}_{b-1})$ for those with $\mathrm{hi}_x > c_1$ (a suffix), each at most
  $R - 1$ keys wide, with an additive mask, merged into the middle by lse;

or, where the band is narrower than the tile ($c_1 \le c_0$), one masked part over all its
keys. Every row of a part sees at least one of its keys (no row is all $-\infty$ in the op), the
masks are at most $R \times 2R$ whatever the band, and a row costs at most
$\max_x (\mathrm{hi}_x - \mathrm{lo}_x) + R - 1$ scores, the width of its band plus the tile:
$w + R$ under a causal window of $w + 1$ keys, against $T / 2$ on average without one. The
interior tiles of a document are alike (same shape, same mask, $R$ rows and $R$ keys apart),
so each kind is one run: a 32k-token document is a handful of calls, not one per tile. The parts
of a run write disjoint rows (the two edges of a short tile can have one shape: two runs) and
may share keys, whose gradients the fused path adds up.
"""

from __future__ import annotations

from typing import NamedTuple

from cpref.kernels.contract import NO_WINDOW, Varlen

__all__ = ["Run", "plan_runs", "plan_shifted_runs", "plan_band_runs", "band_rows", "is_plain", "is_shifted"]

Seen = tuple[tuple[int, int], ...]  # per row of a part: the keys [lo, hi) it sees, relative to the part's first key


class Run(NamedTuple):
    """`count` sequence parts of `rows` queries and `keys` keys, equally spaced: one fused call."""

    q0: int  # first query row of the first part
    q_step: int  # rows between the starts of consecutive parts
    k0: int  # first key row of the first part
    k_step: int
    count: int
    rows: int
    keys: int
    causal: bool  # a causal square (rows == keys), else every key is visible (or `seen` says which)
    merge: bool  # part of rows that an earlier run wrote: merged into them by lse
    seen: Seen | None = None  # a band part's mask (the same in every part of the run); None: none


def is_plain(seqs: Varlen, causal: bool, window: tuple[int, int]) -> bool:
    """Whether `plan_runs` applies: no window, and bottom-right (or no mask, where shifts change nothing)."""
    return window == NO_WINDOW and (seqs.bottom_right or not causal)


def is_shifted(seqs: Varlen, causal: bool, window: tuple[int, int]) -> bool:
    """Whether `plan_shifted_runs` applies: no window, causal, and some explicit shift that is not bottom-right."""
    return window == NO_WINDOW and causal and not seqs.bottom_right


def _parts(q0: int, q1: int, k0: int, k1: int, causal: bool) -> list[tuple[int, int, int, int, bool, bool]]:
    """`(q start, k start, rows, keys, causal, merge)` of one sequence's fused calls."""
    n_q, n_k = q1 - q0, k1 - k0
    if n_q == 0 or n_k == 0:
        return []
    if not causal:
        return [(q0, k0, n_q, n_k, False, False)]
    if n_q >= n_k:  # query x sees y <= x - (n_q - n_k): the first n_q - n_k rows see nothing
        return [(q1 - n_k, k0, n_k, n_k, True, False)]
    # keys [k1 - n_q, k1): a causal square; keys [k0, k1 - n_q): visible to every row, merged after
    return [(q0, k1 - n_q, n_q, n_q, True, False), (q0, k0, n_q, n_k - n_q, False, True)]


def _progressions(starts: list[tuple[int, int]], rows: int) -> list[tuple[int, int, int, int, int]]:
    """Cut `starts` into maximal runs advancing by one `(q, k)` step: `(q0, q_step, k0, k_step, count)`.

    A run's parts write disjoint query rows (`q_step >= rows`); their keys may overlap.
    """
    runs, i = [], 0
    while i < len(starts):
        (q0, k0), j = starts[i], i + 1
        step = (starts[j][0] - q0, starts[j][1] - k0) if j < len(starts) else (1, 1)
        while j < len(starts) and step[0] >= rows and (starts[j][0] - starts[j - 1][0], starts[j][1] - starts[j - 1][1]) == step:
            j += 1
        runs.append((q0, step[0], k0, step[1], j - i))
        i = j
    return runs


def _group(parts, max_period: int) -> list[Run]:
    """Runs of `parts` `(q start, k start, rows, keys, causal, merge, seen)`: grouped by shape, cut into
    equally spaced runs; merges last.

    Parts of one shape that alternate between patterns (the all-gather plan's chunk `j` and
    chunk `2P - 1 - j` of every document) are split into `period` interleaved lists first;
    the period from 1 to `max_period` that gives the fewest runs wins.
    """
    shapes: dict[tuple, list[tuple[int, int]]] = {}
    for qs, ks, *shape in parts:
        shapes.setdefault(tuple(shape), []).append((qs, ks))
    runs = []
    for (rows, keys, square, merge, seen), starts in shapes.items():
        periods = range(1, min(max_period, len(starts)) + 1)
        best = min(([r for p in range(period) for r in _progressions(starts[p::period], rows)] for period in periods), key=len)
        runs += [Run(q0, q_step, k0, k_step, count, rows, keys, square, merge, seen) for q0, q_step, k0, k_step, count in best]
    return sorted(runs, key=lambda run: run.merge)  # stable: every part that writes its rows before those merged into them


def plan_runs(seqs: Varlen, causal: bool, max_period: int = 4) -> list[Run]:
    """The fused calls of a plain `seqs` (see `is_plain`): one part per sequence, or its causal square and the
    keys before it."""
    parts = [(*p, None) for q0, q1, k0, k1 in seqs.pairs() for p in _parts(q0, q1, k0, k1, causal)]
    return _group(parts, max_period)


def _shifted_parts(q0: int, q1: int, k0: int, k1: int, shift: int) -> list[tuple[int, int, int, int, bool, bool]]:
    """`(q start, k start, rows, keys, causal, merge)` of a causal sequence whose query `x` sees keys `y <= x + shift`."""
    n_q, n_k = q1 - q0, k1 - k0
    if n_q == 0 or n_k == 0:
        return []
    first = max(0, -shift)  # rows before it see no key
    full = min(n_q, max(first, n_k - 1 - shift))  # from this row on, every key
    parts = _parts(q0 + first, q0 + full, k0, k0 + full + shift, True) if full > first else []  # the growing prefix
    return parts + ([(q0 + full, k0, n_q - full, n_k, False, False)] if full < n_q else [])


def plan_shifted_runs(seqs: Varlen, max_period: int = 4) -> list[Run]:
    """The fused calls of a causal `seqs` with explicit shifts and no window (see `is_shifted`): no masks."""
    parts = [(*p, None) for i, (q0, q1, k0, k1) in enumerate(seqs.pairs()) for p in _shifted_parts(q0, q1, k0, k1, seqs.shift(i))]
    return _group(parts, max_period)


def band_rows(width: int) -> int:
    """`R`, the rows of a band tile for a band `width` keys wide: a quarter of it, a power of two in [16, 256].

    A row costs `width + R - 1` scores (see the module docstring), so `R` follows the band, but
    at least 16 rows, for the op's matrix products, and at most 256, the op's own query tile.
    """
    return min(256, max(16, 1 << max(0, (width // 4).bit_length() - 1)))


def _seen(bounds: list[tuple[int, int]], k_start: int, k_end: int) -> Seen | None:
    """Each row's `[lo, hi)` clipped to the part's keys `[k_start, k_end)`, relative to `k_start`; None where every
    row sees every key (no mask)."""
    seen = tuple((max(lo, k_start) - k_start, min(hi, k_end) - k_start) for lo, hi in bounds)
    return None if all(s == (0, k_end - k_start) for s in seen) else seen


def _band_parts(seen: list[tuple[int, int]], q0: int, k0: int, rows: int) -> list[tuple]:
    """The parts `(q start, k start, rows, keys, False, merge, seen)` of one sequence whose row `x` sees
    its keys `seen[x]`, in tiles of `rows` (see the module docstring)."""
    seeing = [x for x, (lo, hi) in enumerate(seen) if hi > lo]  # an interval: lo and hi never decrease
    parts = []
    for a in range(seeing[0], seeing[-1] + 1, rows) if seeing else ():
        b = min(a + rows, seeing[-1] + 1)
        lo, hi, c0, c1 = seen[a][0], seen[b - 1][1], seen[b - 1][0], seen[a][1]  # tile keys [lo, hi), middle [c0, c1)
        if c1 <= c0:  # a band narrower than the tile: one masked part over all its keys
            parts.append((q0 + a, k0 + lo, b - a, hi - lo, False, False, _seen(seen[a:b], lo, hi)))
            continue
        parts.append((q0 + a, k0 + c0, b - a, c1 - c0, False, False, None))  # every row sees every key: no mask
        n_left = sum(seen[x][0] < c0 for x in range(a, b))  # rows [a, a + n_left) see keys before c0
        if n_left:
            parts.append((q0 + a, k0 + lo, n_left, c0 - lo, False, True, _seen(seen[a : a + n_left], lo, c0)))
        n_right = sum(seen[x][1] > c1 for x in range(a, b))  # rows [b - n_right, b) see keys from c1 on
        if n_right:
            parts.append((q0 + b - n_right, k0 + c1, n_right, hi - c1, False, True, _seen(seen[b - n_right : b], c1, hi)))
    return parts


def plan_band_runs(
    seqs: Varlen, causal: bool, window: tuple[int, int], rows: int | None = None, max_period: int = 4
) -> list[Run]:
    """The fused calls of a windowed or shifted `seqs`: every sequence's band in tiles of `rows` query rows
    (default `band_rows` of the widest row of the call), masked at its edges; merges last."""
    seen = [[seqs.visible(i, x, causal, window) for x in range(q1 - q0)] for i, (q0, q1, _, _) in enumerate(seqs.pairs())]
    width = max((hi - lo for rows_seen in seen for lo, hi in rows_seen), default=0)
    rows = rows or band_rows(width)
    parts = [p for (q0, _, k0, _), s in zip(seqs.pairs(), seen) for p in _band_parts(s, q0, k0, rows)]
    return _group(parts, max_period)
