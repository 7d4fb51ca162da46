r"""The dry run: one rank's step as the mode runs it, counted instead of computed.

The planner never estimates a count. To know what a mode does on a rank (every kernel call with
its work, every collective with its payload, group and peer, what the step saves for the
backward, and which collectives a schedule overlaps with which calls), it runs the mode itself,
`cpref.attention` forward and backward, on **meta tensors** (shapes and dtypes, no storage)
through two stand-ins:

* [`DryComm`][sim.plan.dry.DryComm], a communicator of the collectives protocol that moves
  nothing: each collective returns an empty meta tensor of the shape the real one returns, and
  is recorded with its group (global ranks), input shape and dtype, and shift;
* [`TallyKernel`][sim.plan.dry.TallyKernel], a kernel of the attention contract that computes
  nothing: each call is recorded with its work, the visible (query, key) pairs of its `Varlen`
  ([`Varlen.work`][cpref.kernels.contract.Varlen.work]), and its head counts and dims.

The result is the rank's **timeline**, in program order: `post` (a collective starts), `wait`
(the rank blocks on it; a blocking collective is a `post` and its `wait` back to back) and
`call` (a kernel call). A ring that posts its next shift before a call and waits after it shows
exactly that; a mode that waits at once shows that. The time model
([`sim.plan.model`][sim.plan.model]) reads overlap from this order, not from a per-mode rule.

Because the mode's own code runs, the counts cannot drift from what it does:
`tests/plan/test_dry_run.py` holds every collective of every rank to the simulated cluster's
trace and every call's work to a real run's, for every mode and layout at P = 2 to 8.
The ranks' agreement check (`check_ranks`) is skipped: it moves a row of ints, no payload.

Example:
    >>> import torch, cpref
    >>> from sim.plan.dry import dry_run
    >>> sharding = cpref.Sharding([0, 64], cp_size=2, layout="zigzag")
    >>> run = dry_run("p2p", sharding, 0, heads=(4, 2, 16, 16), dtype=torch.bfloat16)
    >>> [e.kind for e in run.timeline if e.phase == "forward"]
    ['post', 'call', 'wait', 'call']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from cpref.comm.protocol import REDUCE_OPS, check_partition
from cpref.kernels.contract import Varlen, compute_dtype

__all__ = ["Collective", "KernelCall", "Event", "RankRun", "DryComm", "TallyKernel", "band_width", "sequence_width",
           "sequence_amounts", "dry_run"]


@dataclass(frozen=True)
class Collective:
    """One collective as one rank calls it.

    Attributes:
        op: `"all_gather"`, `"reduce_scatter"`, `"all_to_all"`, `"send_recv"` or `"all_reduce"`.
        group: the global ranks of its group, in group order.
        rank: this rank's index in `group`.
        shape, dtype: of this rank's input.
        shift: the ring shift of `send_recv` (0 for the other ops).
    """

    op: str
    group: tuple[int, ...]
    rank: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    shift: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's input."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class KernelCall:
    """One kernel call: its work (visible query-key pairs, per head) and its heads and dims.

    `direction` is `"forward"` or `"backward"` (the kernel's own pass, whatever the step's phase); `band`: the call
    has a sliding window (its keys a band around each row's position); `rows_seeing`: its query rows that see a key;
    `width`: a banded call's widest band, the most keys one of its rows sees ([`band_width`][sim.plan.dry.band_width]),
    0 for a call without a window.
    """

    direction: str
    work: int
    q_rows: int
    kv_rows: int
    hq: int
    hkv: int
    d: int
    dv: int
    band: bool = False
    rows_seeing: int = 0
    width: int = 0

    @property
    def flops(self) -> int:
        """Matrix-product FLOPs: forward $2 w H_q (D + D_v)$ (scores and output), backward
        $2 w H_q (3 D + 2 D_v)$ (scores again, dV, dP, dQ, dK), for $w$ = `work`."""
        per_pair = self.d + self.dv if self.direction == "forward" else 3 * self.d + 2 * self.dv
        return 2 * self.work * self.hq * per_pair


@dataclass(frozen=True)
class Event:
    """One entry of a rank's timeline: `kind` `"post"` / `"wait"` (of collective `index`) or `"call"`."""

    kind: str
    phase: str  # "forward" or "backward": the step's half
    index: int = -1  # the collective's position in RankRun.collectives (post, wait)
    call: KernelCall | None = None


@dataclass(frozen=True)
class RankRun:
    """What one rank does in one forward and backward of one layer.

    Attributes:
        rank: its global rank.
        collectives: every collective it joins, in the order it posts them.
        timeline: posts, waits and kernel calls in program order.
        saved_bytes: bytes the step saves for the backward (autograd's saved tensors).
    """

    rank: int
    collectives: tuple[Collective, ...]
    timeline: tuple[Event, ...]
    saved_bytes: int

    @property
    def calls(self) -> tuple[KernelCall, ...]:
        """Its kernel calls, in order."""
        return tuple(e.call for e in self.timeline if e.kind == "call")


class _Recorder:
    """The shared log of one rank's dry run: collectives and the timeline, with the current phase."""

    def __init__(self) -> None:
        self.collectives: list[Collective] = []
        self.timeline: list[Event] = []
        self.phase = "forward"

    def post(self, collective: Collective) -> int:
        self.collectives.append(collective)
        index = len(self.collectives) - 1
        self.timeline.append(Event("post", self.phase, index))
        return index

    def wait(self, index: int) -> None:
        self.timeline.append(Event("wait", self.phase, index))

    def call(self, call: KernelCall) -> None:
        self.timeline.append(Event("call", self.phase, call=call))


class _Pending:
    """A dry collective in flight: `wait()` records the wait and returns the result."""

    def __init__(self, recorder: _Recorder, index: int, result: torch.Tensor) -> None:
        self._recorder, self._index, self._result = recorder, index, result

    def wait(self) -> torch.Tensor:
        """Record the wait; return the result."""
        self._recorder.wait(self._index)
        return self._result


class DryComm:
    """The collectives protocol, moving nothing: results are empty tensors of the real shapes.

    Args:
        rank: this rank's index in `group`.
        group: the global ranks of the group, in group order.
        recorder: where its collectives go (shared with its sub-groups and the kernel).
    """

    unsupported_ops: frozenset[str] = frozenset()

    def __init__(self, rank: int, group: Sequence[int], recorder: _Recorder) -> None:
        self.group, self.rank, self.size = tuple(group), rank, len(group)
        self.global_rank = self.group[rank]
        self._recorder = recorder

    def __repr__(self) -> str:
        return f"DryComm(rank={self.rank}, group={self.group})"

    def _start(self, op: str, x: torch.Tensor, shape: Sequence[int], shift: int = 0) -> _Pending:
        col = Collective(op, self.group, self.rank, tuple(x.shape), x.dtype, shift)
        out = torch.empty(tuple(shape), dtype=x.dtype, device=x.device)
        return _Pending(self._recorder, self._recorder.post(col), out)

    def all_gather_async(self, x: torch.Tensor) -> _Pending:
        """Recorded; the handle returns `(P n, ...)`."""
        return self._start("all_gather", x, (self.size * x.shape[0], *x.shape[1:]))

    def reduce_scatter_async(self, x: torch.Tensor) -> _Pending:
        """Recorded; the handle returns `(n / P, ...)`."""
        return self._start("reduce_scatter", x, (x.shape[0] // self.size, *x.shape[1:]))

    def all_to_all_async(self, x: torch.Tensor) -> _Pending:
        """Recorded; the handle returns a tensor shaped like `x`."""
        return self._start("all_to_all", x, x.shape)

    def send_recv_async(self, x: torch.Tensor, shift: int = 1) -> _Pending:
        """Recorded with its shift; the handle returns a tensor shaped like `x` (every rank sends the same shape)."""
        return self._start("send_recv", x, x.shape, shift)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Posted and waited for at once."""
        return self.all_gather_async(x).wait()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Posted and waited for at once."""
        return self.reduce_scatter_async(x).wait()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Posted and waited for at once."""
        return self.all_to_all_async(x).wait()

    def send_recv(self, x: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """Posted and waited for at once."""
        return self.send_recv_async(x, shift).wait()

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Posted and waited for at once."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
        return self._start("all_reduce", x, x.shape).wait()

    def barrier(self) -> None:
        """Nothing moves."""

    def split(self, groups: Sequence[Sequence[int]]) -> "DryComm":
        """The sub-group holding this rank, recording into the same log."""
        for part in check_partition(groups, self.size):
            if self.rank in part:
                return DryComm(part.index(self.rank), [self.group[i] for i in part], self._recorder)
        raise AssertionError("check_partition covers every rank")  # pragma: no cover

    def agree(self, row: Sequence[int]) -> list[list[int]]:
        """Every rank's row is this one's: a dry run has one rank."""
        return [list(row)] * self.size


def sequence_width(shift: int, n_q: int, n_k: int, left: int, right: int) -> int:
    r"""The most keys one query row of a sequence sees: `n_q` queries at key positions `p = x + shift`, `n_k` keys, each
    row seeing `[max(0, p - left), min(n_k, p + right + 1))` (`left`, `right` < 0: unbounded; `right` 0 if causal).

    The width is a concave, piecewise linear function of $p$ (a minimum of lines, less a maximum of lines), so its
    largest value is at a breakpoint ($p = l$, $p = n_k - r - 1$) or at the first or last row, clipped to the rows.
    """
    best = 0
    for x in {0, n_q - 1, left - shift, n_k - right - 1 - shift}:
        p = min(max(x, 0), n_q - 1) + shift
        lo = 0 if left < 0 else max(0, p - left)
        hi = n_k if right < 0 else min(n_k, p + right + 1)
        best = max(best, hi - lo)
    return best


def sequence_amounts(shift: np.ndarray, n_q: np.ndarray, n_k: np.ndarray, left: int,
                     right: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    r"""`(work, rows, width)` of many sequences at once (`(n,)` int64 arrays): the visible pairs and the rows that
    see a key (`Varlen.work`'s `_visible_sum`) and `sequence_width`, in closed form over arrays.

    Row $p \in [a, b)$ ($a$ = `shift`, $b = a + n_q$) sees key $y \in [0, n_k)$ iff $-r \le p - y \le l$
    ($l, r$ = `left`, `right`; a negative one unbounded). With $F(c)$ the pairs with $p - y \le c$,
    the work is $F(l) - F(-r - 1)$; $F(c) = H(b - c) - H(a - c)$ for $H(T) = \sum_{t < T} (n_k - \mathrm{clip}(t,
    0, n_k))$ counted from 0: $n_k T$ for $T \le 0$, $T n_k - T (T - 1) / 2$ up to $n_k$, $n_k (n_k + 1) / 2$ beyond.
    A row sees a key iff $-r \le p < n_k + l$. The width's maximum is at a bend, as in `sequence_width`.
    `tests/plan/test_model.py` holds all three to the per-sequence functions."""
    shift, n_q, n_k = (np.asarray(x, dtype=np.int64) for x in (shift, n_q, n_k))
    a, b = shift, shift + n_q

    def H(T: np.ndarray) -> np.ndarray:
        Tc = np.clip(T, 0, n_k)
        return Tc * n_k - Tc * (Tc - 1) // 2 + n_k * np.minimum(T, 0)

    def F(c: np.ndarray) -> np.ndarray:
        return H(b - c) - H(a - c)

    upper = F(b) if left < 0 else F(np.full_like(a, left))  # c >= b: every key of every row
    lower = F(a - n_k - 1) if right < 0 else F(np.full_like(a, -right - 1))  # c < a - n_k: none
    work = np.where((n_q > 0) & (n_k > 0), upper - lower, 0)
    top = b if left < 0 else np.minimum(b, n_k + left)
    bottom = a if right < 0 else np.maximum(a, -right)
    rows = np.where(n_k > 0, np.maximum(top - bottom, 0), 0)
    width = np.zeros_like(a)
    for x in (np.zeros_like(a), n_q - 1, left - shift, n_k - right - 1 - shift):  # the bends, clipped to the rows
        p = np.clip(x, 0, np.maximum(n_q - 1, 0)) + shift
        lo = 0 if left < 0 else np.maximum(0, p - left)
        hi = n_k if right < 0 else np.minimum(n_k, p + right + 1)
        width = np.maximum(width, hi - lo)
    return work, rows, np.where(n_q > 0, width, 0)


def band_width(seqs: Varlen, causal: bool, window: tuple[int, int]) -> int:
    """The most keys one query row of `seqs` sees under `window` (`Varlen.visible`): `sequence_width` of each
    sequence, without a row-by-row scan."""
    left, right = window[0], 0 if causal else window[1]
    return max((sequence_width(seqs.shift(i), seqs.cu_q[i + 1] - seqs.cu_q[i], seqs.cu_kv[i + 1] - seqs.cu_kv[i], left,
                               right) for i in range(seqs.num_seqs) if seqs.cu_q[i + 1] > seqs.cu_q[i]), default=0)  # fmt: skip


class TallyKernel:
    """The attention contract, computing nothing: each call returns empty tensors and is recorded."""

    deterministic = True
    variants = frozenset({"softcap"})

    def __init__(self, recorder: _Recorder) -> None:
        self._recorder = recorder

    def _record(self, direction: str, q, k, v, seqs: Varlen, causal: bool, window) -> None:
        work, window = seqs.work(causal, tuple(window)), tuple(window)
        band = window != (-1, -1)
        self._recorder.call(KernelCall(direction, work, q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                       v.shape[2], band, seqs.rows_seeing(causal, window),
                                       band_width(seqs, causal, window) if band else 0))  # fmt: skip

    def forward(self, q, k, v, seqs: Varlen, *, causal: bool, scale: float, window=(-1, -1), out_dtype=None,
                softcap=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Recorded; empty `(out, lse)`."""
        self._record("forward", q, k, v, seqs, causal, window)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype or q.dtype, device=q.device)
        return out, torch.empty(q.shape[:2], dtype=compute_dtype(q.dtype), device=q.device)

    def backward(self, dout, q, k, v, out, lse, seqs: Varlen, *, causal: bool, scale: float, window=(-1, -1),
                 full_rows=False, grad_dtype=None, softcap=None) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Recorded; empty `(dq, dk, dv)`."""
        self._record("backward", q, k, v, seqs, causal, window)
        return tuple(torch.empty(t.shape, dtype=grad_dtype or t.dtype, device=t.device) for t in (q, k, v))


def dry_run(mode: str, sharding: Any, rank: int, *, heads: tuple[int, int, int, int], dtype: torch.dtype,
            causal: bool = True, window: tuple[int, int] = (-1, -1), chunk: int | None = None,
            softcap: float | None = None, **options: Any) -> RankRun:  # fmt: skip
    """Run `mode` forward and backward on `rank` of `sharding`, counted (see the module docstring).

    Args:
        mode: a name in `cpref.MODES`.
        sharding: the batch (`cpref.Sharding`).
        rank: the global rank to run.
        heads: `(Hq, Hkv, D, Dv)`.
        dtype: the inputs' dtype.
        causal: as `cpref.attention` takes it.
        window: as `cpref.attention` takes it.
        chunk: as `cpref.attention` takes it.
        softcap: as `cpref.attention` takes it.
        **options: the mode's options, as `cpref.attention` takes them.

    Raises:
        CPInputError: as `cpref.attention` refuses the call, naming the value.
    """
    from cpref.api import attention  # the planner sits above the API

    hq, hkv, d, dv = heads
    t = sharding.local_tokens
    recorder = _Recorder()
    comm = DryComm(rank, range(sharding.cp_size), recorder)
    q, k, v = (torch.empty(t, h, x, dtype=dtype, device="meta", requires_grad=True)
               for h, x in ((hq, d), (hkv, d), (hkv, dv)))  # fmt: skip
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x, lambda x: x):
        out = attention(q, k, v, sharding, comm=comm, mode=mode, kernel=TallyKernel(recorder), causal=causal,
                        window=window, chunk=chunk, softcap=softcap, check_ranks=False, **options)  # fmt: skip
    recorder.phase = "backward"
    out.backward(torch.empty_like(out))
    return RankRun(rank, tuple(recorder.collectives), tuple(recorder.timeline), sum(saved))
