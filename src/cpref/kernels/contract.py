r"""The attention kernel contract.

Every CP algorithm calls attention only through an object with this interface, so the same
algorithm runs on the CPU (`TorchKernel`), on CUDA (`CudaKernel`, PyTorch's flash attention) and
on an Ascend NPU (`NpuKernel`, `torch_npu.npu_fusion_attention`); the contract is shaped to map one-to-one onto the NPU's
TND call.

**Varlen (TND).** `q` is `(T, Hq, D)`, `k` is `(T', Hkv, D)`, `v` is `(T', Hkv, Dv)` with
`Hq % Hkv == 0` (GQA/MQA: query head `h` reads key head `h // (Hq / Hkv)`) and `Dv <= D`
(MLA-style). A [`Varlen`][cpref.kernels.contract.Varlen] cuts the two streams into `N`
independent sequences: sequence `i` has `q_len_i` queries and `kv_len_i` keys, and its
queries see only its keys. Either length may be 0.

**Lengths live on the host.** `Varlen` holds the cumulative lengths as Python ints, so a
kernel never reads a device tensor back to the host (on an accelerator every such read
stalls the stream); a kernel that needs them on the device asks
[`Varlen.tensor`][cpref.kernels.contract.Varlen.tensor], which copies them once per device.
The NPU takes host lists itself (`actual_seq_qlen`). A `Varlen` is built once per batch by the
CP metadata and reused by every layer, and a kernel may cache what it derives from it
(blocks, masks, index tensors) with [`Varlen.cached`][cpref.kernels.contract.Varlen.cached].

**Bottom-right causal.** With `causal=True`, query $x$ of a sequence sees key $y$ iff

$$ y \le x + \mathrm{kv\_len} - \mathrm{q\_len} , $$

i.e. the *last* query is aligned with the *last* key (NPU `sparse_mode=3`,
FlashAttention >= 2.1). A CP rank whose query chunk ends a causal prefix of keys therefore
needs no positional offset at all.

**Sliding windows and shifts.** Query $x$ of sequence $i$ stands at key position
$p = x + \delta_i$, with $\delta_i = \mathrm{kv\_len}_i - \mathrm{q\_len}_i$ (bottom-right) unless the
`Varlen` gives explicit `shifts` (a CP plan whose key block does not end where its queries
end). With `window=(left, right)` ($-1$: unbounded; `causal=True` is `right = 0`) it sees key
$y$ iff

$$ p - \mathrm{left} \le y \le p + \mathrm{right} , $$

the FlashAttention convention, which is the oracle's per-document window when each sequence's
keys and queries are positions of one document. `window=(-1, -1)` without causal is full
attention; a row that sees no key gives `out = 0`, `lse = -inf` as above.

**Outputs.** `out` is `(T, Hq, Dv)` in the input dtype; `lse` is `(T, Hq)`, the natural-log
log-sum-exp of the scaled logits, float32 (float64 for float64 inputs). A row that sees no
key gives `out = 0` and `lse = -inf`, never NaN, and zero gradients. Every returned tensor
belongs to the caller: new storage, never a view of an input, so a caller may accumulate into
it in place (the ring's first block becomes its running output and dQ).

**Partial results in float32.** A caller that sums a kernel's results with others (ring
attention merges `P` partial outputs; dK/dV partials are accumulated) asks for them in the
compute dtype, `forward(..., out_dtype=torch.float32)` and
`backward(..., grad_dtype=torch.float32)`, so that nothing is rounded to bf16 before the
sum is complete. A kernel that computes in float32 returns its accumulators as they are; one
whose hardware op rounds to the input dtype (the NPU) returns that result upcast.

**Backward.** `backward(dout, q, k, v, out, lse, seqs, ...)` returns `(dq, dk, dv)` with the
shapes and dtypes of `q, k, v`. `lse` may be the log-sum-exp of a *longer* row than this
call sees (ring attention passes the row's global lse); the gradients are then those of this
call's share of the row, and they need $\Delta_x = \sum_d dO_{xd} O_{xd}$ of the *whole* row,
which only `out` carries. When every row of the call is whole (all-gather, Ulysses), the
caller says so with `full_rows=True`, and a kernel may compute the same quantity as
$\Delta_x = \sum_y P_{xy}\, dP_{xy}$ from its own float32 probabilities instead: an `out`
rounded to bf16 is what makes gradient errors grow with the logit scale. A kernel that cannot
(the NPU op takes `out`) ignores the flag. `out` may come in the compute dtype (the ring keeps
its merged output in float32 for this reason); a kernel whose op takes it in the input dtype
rounds it.

**Variants.** `softcap=c` (logit soft-capping, Gemma 2) squashes every score to $c \tanh(S / c)$
before the mask and the softmax, in the forward and (with its derivative) in the backward of
every call. A kernel lists what it computes beyond plain attention in an attribute `variants`
(`TorchKernel`: `{"softcap"}`); `cpref.attention` refuses, by name and before any communication,
a variant the kernel does not list. Learnable sinks and chunked attention need nothing of a
kernel: the modes add a sink to a row's lse once ([`cpref.kernels.sinks`][cpref.kernels.sinks]),
and chunked attention is sequences cut at the chunks' boundaries.

**Determinism.** A kernel whose backward gives the same bits on every run, for the same
inputs on the same device, says so with an attribute `deterministic = True`; without it,
`cpref.attention(..., deterministic=True)` refuses the kernel ([`cpref.base.determinism`][cpref.base.determinism]).
`TorchKernel` is (its sums run in program order); `CudaKernel` and `NpuKernel` are when
built with `deterministic=True`.
"""

from __future__ import annotations

import math
import numbers
import threading
from itertools import accumulate
from typing import Any, Callable, Hashable, Protocol, Sequence, TypeVar, runtime_checkable

import torch

from cpref.base.checks import host_ints
from cpref.base.errors import CPInputError

__all__ = ["AttentionKernel", "Varlen", "FLOAT_DTYPES", "NO_WINDOW", "compute_dtype", "check_heads", "check_window",
           "check_softcap", "SoftCapped"]

NO_WINDOW = (-1, -1)  # full attention (or plain causal): no bound on either side


def check_window(window: Any, causal: bool) -> tuple[int, int]:
    """`window` as `(left, right)` ints >= -1, canonical: under `causal` a window is `(w, 0)`, and one that bounds
    nothing (`left = -1`) is `NO_WINDOW`, plain causal attention.

    Raises:
        CPInputError: for anything but a pair of ints >= -1, or `causal=True` with `right > 0`, naming the fix.
    """
    fix = "pass window=(left, right) with ints >= -1 (-1: unbounded), e.g. (127, 0) with causal=True: a window of 128 keys"
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence) or len(window) != 2:
        raise CPInputError(f"window={window!r:.40} is not a pair; {fix}")
    for side, value in zip(("left", "right"), window):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < -1:
            raise CPInputError(f"window={tuple(window)!r}: {side}={value!r} is not an int >= -1; {fix}")
    left, right = int(window[0]), int(window[1])
    if causal and right > 0:
        raise CPInputError(f"window={(left, right)} with causal=True: a causal query sees no later key, so right must be "
                           f"0 or -1; pass causal=False for a window with right={right} keys after each query")  # fmt: skip
    if causal:  # a causal window bounds only the left side; without one it is plain causal
        return NO_WINDOW if left < 0 else (left, 0)
    return left, right



def check_softcap(softcap: Any) -> float | None:
    """`softcap` as a float `c > 0` (logits become `c tanh(S / c)`), or None for none.

    Raises:
        CPInputError: for anything but None or a finite number > 0, naming the fix.
    """
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap <= 0:
        raise CPInputError(f"softcap={softcap!r} must be a finite number > 0 (logits become softcap * tanh(S / softcap), "
                           "Gemma 2's is 50.0), or None for no soft-capping")  # fmt: skip
    return float(softcap)


class SoftCapped:
    """`kernel` with every call soft-capped at `softcap`: what `cpref.attention(..., softcap=c)` hands the modes,
    which call it as they call any kernel, so that no mode computes a score without the cap.

    Examples:
        >>> from cpref.kernels import TorchKernel
        >>> SoftCapped(TorchKernel(), 50.0)
        SoftCapped(TorchKernel(block_size=None, max_block_elements=16777216, fast=True), softcap=50.0)
    """

    def __init__(self, kernel: Any, softcap: float) -> None:
        self.kernel, self.softcap = kernel, check_softcap(softcap)
        self.deterministic = getattr(kernel, "deterministic", False)

    def __repr__(self) -> str:
        return f"SoftCapped({self.kernel!r}, softcap={self.softcap})"

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's forward, soft-capped."""
        return self.kernel.forward(*args, softcap=self.softcap, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's backward, soft-capped."""
        return self.kernel.backward(*args, softcap=self.softcap, **kwargs)


V = TypeVar("V")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the inputs cpref.attention takes


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums accumulate in: float64 for float64 inputs, float32 for every other float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise `CPInputError` unless `q (T, Hq, D)`, `k (T', Hkv, D)`, `v (T', Hkv, Dv)` fit together.

    Needs 3-d tensors, `Hkv >= 1`, `Hq % Hkv == 0`, `D >= 1`, `1 <= Dv <= D`, and `k`, `v`
    with the same tokens and heads. Shared by `cpref.attention` and the kernels.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CPInputError(f"{name} must be a THD tensor (tokens, heads, dim), got {shape}")
    (_, hq, d), (tk, hkv, dk), (tv, hv, dv) = q.shape, k.shape, v.shape
    if hkv < 1 or hv != hkv or hq < 1 or hq % hkv:
        raise CPInputError(
            f"heads: q has {hq}, k {hkv}, v {hv}; need k and v alike, at least one, and Hq % Hkv == 0"
        )
    if d < 1 or dv < 1 or d != dk or dv > dk:
        raise CPInputError(f"head dims: q {d}, k {dk}, v {dv}; need Dq == Dk >= Dv >= 1")
    if tk != tv:
        raise CPInputError(f"k has {tk} tokens but v has {tv}; they must be the same keys")


class Varlen:
    """The sequences of one varlen kernel call, as host ints; built once, reused by every layer.

    Args:
        cu_q: cumulative query lengths with a leading 0, e.g. `[0, 2, 6]`.
        cu_kv: cumulative key lengths, same length as `cu_q`; default `cu_q` (self-attention).

    Raises:
        CPInputError: unless both are lists of ints (or 1-D integer tensors) that start at 0, never decrease,
            and have the same length.

    Examples:
        >>> seqs = Varlen.from_lengths([2, 4], [2, 10])
        >>> seqs.cu_q, seqs.cu_kv, seqs.actual_seq_kvlen
        ((0, 2, 6), (0, 2, 12), [2, 12])
    """

    __slots__ = ("cu_q", "cu_kv", "shifts", "_derived", "_lock")

    def __init__(self, cu_q: Sequence[int], cu_kv: Sequence[int] | None = None, shifts: Sequence[int] | None = None) -> None:
        fix = "pass cumulative lengths like [0, 2, 6]: a list of ints or a 1-D integer tensor"
        self.cu_q = tuple(host_ints(cu_q, "Varlen: cu_q", fix))  # ints only: "abc", None or 2.5 are refused by name
        self.cu_kv = self.cu_q if cu_kv is None else tuple(host_ints(cu_kv, "Varlen: cu_kv", fix))
        self.shifts = None if shifts is None else tuple(host_ints(shifts, "Varlen: shifts", "pass one int per sequence"))
        for name, cu in (("cu_q", self.cu_q), ("cu_kv", self.cu_kv)):
            if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise CPInputError(f"Varlen: {name}={list(cu)[:8]} must start at 0 and never decrease")
        if len(self.cu_q) != len(self.cu_kv):
            raise CPInputError(f"Varlen: cu_q has {len(self.cu_q)} entries, cu_kv {len(self.cu_kv)}; need one each per sequence")
        if self.shifts is not None and len(self.shifts) != len(self.cu_q) - 1:
            raise CPInputError(f"Varlen: {len(self.shifts)} shifts for {len(self.cu_q) - 1} sequences; need one per sequence")
        self._derived: dict[Hashable, Any] = {}
        self._lock = threading.RLock()  # reentrant: a build may use another derived entry

    @classmethod
    def from_lengths(cls, q_lens: Sequence[int], kv_lens: Sequence[int], shifts: Sequence[int] | None = None) -> "Varlen":
        """From per-sequence lengths instead of cumulative ones."""
        return cls([0, *accumulate(q_lens)], [0, *accumulate(kv_lens)], shifts)

    def __repr__(self) -> str:
        shifts = "" if self.shifts is None else f", shifts={list(self.shifts)}"
        return f"Varlen(cu_q={list(self.cu_q)}, cu_kv={list(self.cu_kv)}{shifts})"

    def shift(self, i: int) -> int:
        """`delta_i`: query `x` of sequence `i` stands at key position `x + delta_i` (default bottom-right, `kv_len - q_len`)."""
        return self.shift_default(i) if self.shifts is None else self.shifts[i]

    @property
    def bottom_right(self) -> bool:
        """Whether every sequence is aligned bottom-right (no explicit shift differs from `kv_len - q_len`)."""
        return self.shifts is None or all(self.shift_default(i) == d for i, d in enumerate(self.shifts))

    def shift_default(self, i: int) -> int:
        """The bottom-right shift of sequence `i`, `kv_len - q_len`."""
        return (self.cu_kv[i + 1] - self.cu_kv[i]) - (self.cu_q[i + 1] - self.cu_q[i])

    def visible(self, i: int, x: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> tuple[int, int]:
        """`[lo, hi)`: the keys of sequence `i` its query `x` sees (see the module docstring; `lo >= hi`: none)."""
        n_k, p = self.cu_kv[i + 1] - self.cu_kv[i], x + self.shift(i)
        left, right = window
        right = 0 if causal else right
        lo = 0 if left < 0 else max(0, p - left)
        hi = n_k if right < 0 else min(n_k, p + right + 1)
        return lo, hi

    @property
    def num_seqs(self) -> int:
        """The number of sequences `N`."""
        return len(self.cu_q) - 1

    @property
    def total_q(self) -> int:
        """Query rows of the call, `T`."""
        return self.cu_q[-1]

    @property
    def total_kv(self) -> int:
        """Key rows of the call, `T'`."""
        return self.cu_kv[-1]

    @property
    def actual_seq_qlen(self) -> list[int]:
        """Cumulative query lengths without the leading 0 (the NPU's TND list)."""
        return list(self.cu_q[1:])

    @property
    def actual_seq_kvlen(self) -> list[int]:
        """Cumulative key lengths without the leading 0 (the NPU's TND list)."""
        return list(self.cu_kv[1:])

    def pairs(self) -> list[tuple[int, int, int, int]]:
        """`(q0, q1, k0, k1)` of every sequence: its query rows `[q0, q1)` and key rows `[k0, k1)`."""
        return list(zip(self.cu_q[:-1], self.cu_q[1:], self.cu_kv[:-1], self.cu_kv[1:]))

    def work(self, causal: bool, window: tuple[int, int] = (-1, -1)) -> int:
        """Score entries the call computes per query head (masked entries not counted): the sum over every row of
        the keys `visible` gives it, in closed form per sequence (`_visible_sum`), not row by row."""
        return self._visible(causal, window)[1]

    def rows_seeing(self, causal: bool, window: tuple[int, int] = (-1, -1)) -> int:
        """Query rows that see at least one key (the rest are never computed), in closed form as `work`."""
        return self._visible(causal, window)[0]

    def _visible(self, causal: bool, window: tuple[int, int]) -> tuple[int, int]:
        left, right = window
        right = 0 if causal else right
        rows = total = 0
        for i, (q0, q1, k0, k1) in enumerate(self.pairs()):
            n, w = _visible_sum(self.shift(i), q1 - q0, k1 - k0, left, right)
            rows, total = rows + n, total + w
        return rows, total

    def cached(self, key: Hashable, build: Callable[[], V]) -> V:
        """`build()` once per `key` for this `Varlen` (thread-safe); kernels keep derived data here."""
        with self._lock:
            if key not in self._derived:
                self._derived[key] = build()
            return self._derived[key]

    def tensor(self, which: str, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """`cu_q` or `cu_kv` (`which`) as a tensor on `device`, copied there once and cached."""
        if which not in ("cu_q", "cu_kv"):
            raise CPInputError(f"Varlen.tensor: which must be 'cu_q' or 'cu_kv', got {which!r}")
        device = torch.device(device)
        return self.cached(("tensor", which, str(device), dtype), lambda: torch.tensor(getattr(self, which), dtype=dtype, device=device))


@runtime_checkable
class AttentionKernel(Protocol):
    """Varlen attention with bottom-right causal masking, returning `out` and `lse`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: Varlen,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        out_dtype: torch.dtype | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out (T, Hq, Dv), lse (T, Hq))`; `out` in `out_dtype` (default: the input dtype).

        `softcap`: only for a kernel whose `variants` lists it (see the module docstring); callers pass it only
        when it is set.
        """
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        seqs: Varlen,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        full_rows: bool = False,
        grad_dtype: torch.dtype | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` shaped like `(q, k, v)`, in `grad_dtype` (default: their dtypes).

        `full_rows`, `softcap`: see the module docstring.
        """
        ...


def _visible_sum(shift: int, n_q: int, n_k: int, left: int, right: int) -> tuple[int, int]:
    """`(rows, sum)`: the rows with `hi(p) > lo(p)` and `sum_x max(0, hi(p) - lo(p))` over the rows `x < n_q` at key
    positions `p = x + shift`, with
    `lo(p) = max(0, p - left)` (0 for `left < 0`) and `hi(p) = min(n_k, p + right + 1)` (`n_k` for `right < 0`):
    `Varlen.visible`'s row widths. Both ends are piecewise linear in `p` with slopes 0 and 1, so the width is linear
    between their kinks; each linear piece's positive part is an arithmetic series."""
    a, b = shift, shift + n_q  # positions [a, b)
    inner = ([left] if left >= 0 else []) + ([n_k - right - 1] if right >= 0 else [])  # where lo or hi bends
    kinks = sorted({a, b, *(k for k in inner if a < k < b)})

    def width(p: int) -> int:  # hi - lo, without the clip at 0
        lo = 0 if left < 0 else max(0, p - left)
        hi = n_k if right < 0 else min(n_k, p + right + 1)
        return hi - lo

    rows = total = 0
    for u, v in zip(kinks, kinks[1:]):  # width is linear on [u, v): w(u) + s (p - u)
        w0, s = width(u), (width(v - 1) - width(u)) // max(1, v - 1 - u)
        if s == 0:
            total += max(0, w0) * (v - u)
            rows += (v - u) if w0 > 0 else 0
            continue
        # the integers p in [u, v) where w0 + s (p - u) > 0
        if s > 0:
            first, last = max(u, u + (-w0) // s + 1), v - 1
        else:
            first, last = u, min(v - 1, u + (w0 - 1) // (-s))
        if first <= last:
            n = last - first + 1
            total += n * (w0 + s * (first - u)) + s * n * (n - 1) // 2
            rows += n
    return rows, total

