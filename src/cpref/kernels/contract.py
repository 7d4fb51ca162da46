r"""The attention kernel contract.

Every CP algorithm calls attention only through an object with this interface, so the same
algorithm runs on the CPU and on CUDA (`TorchKernel`) and on an Ascend NPU (`NpuKernel`,
`torch_npu.npu_fusion_attention`); the contract is shaped to map one-to-one onto the NPU's
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
"""

from __future__ import annotations

import threading
from itertools import accumulate
from typing import Any, Callable, Hashable, Protocol, Sequence, TypeVar, runtime_checkable

import torch

from cpref.errors import CPInputError

__all__ = ["AttentionKernel", "Varlen", "FLOAT_DTYPES", "compute_dtype", "check_heads"]

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
        CPInputError: unless both start at 0, never decrease, and have the same length.

    Examples:
        >>> seqs = Varlen.from_lengths([2, 4], [2, 10])
        >>> seqs.cu_q, seqs.cu_kv, seqs.actual_seq_kvlen
        ((0, 2, 6), (0, 2, 12), [2, 12])
    """

    __slots__ = ("cu_q", "cu_kv", "_derived", "_lock")

    def __init__(self, cu_q: Sequence[int], cu_kv: Sequence[int] | None = None) -> None:
        self.cu_q = tuple(int(x) for x in cu_q)
        self.cu_kv = self.cu_q if cu_kv is None else tuple(int(x) for x in cu_kv)
        for name, cu in (("cu_q", self.cu_q), ("cu_kv", self.cu_kv)):
            if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise CPInputError(f"Varlen: {name}={list(cu)[:8]} must start at 0 and never decrease")
        if len(self.cu_q) != len(self.cu_kv):
            raise CPInputError(f"Varlen: cu_q has {len(self.cu_q)} entries, cu_kv {len(self.cu_kv)}; need one each per sequence")
        self._derived: dict[Hashable, Any] = {}
        self._lock = threading.RLock()  # reentrant: a build may use another derived entry

    @classmethod
    def from_lengths(cls, q_lens: Sequence[int], kv_lens: Sequence[int]) -> "Varlen":
        """From per-sequence lengths instead of cumulative ones."""
        return cls([0, *accumulate(q_lens)], [0, *accumulate(kv_lens)])

    def __repr__(self) -> str:
        return f"Varlen(cu_q={list(self.cu_q)}, cu_kv={list(self.cu_kv)})"

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

    def work(self, causal: bool) -> int:
        """Score entries the call computes per query head (masked entries not counted)."""
        total = 0
        for q0, q1, k0, k1 in self.pairs():
            n_q, n_k = q1 - q0, k1 - k0
            if not causal:
                total += n_q * n_k
            else:  # row j sees min(n_k, j + 1 + n_k - n_q) keys, when that is positive
                total += sum(max(0, min(n_k, j + 1 + n_k - n_q)) for j in range(n_q))
        return total

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
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out (T, Hq, Dv), lse (T, Hq))`; `out` in `out_dtype` (default: the input dtype)."""
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
        full_rows: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` shaped like `(q, k, v)`, in `grad_dtype` (default: their dtypes).

        `full_rows`: see the module docstring.
        """
        ...
