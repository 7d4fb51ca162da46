r"""`CudaKernel`: the attention contract on CUDA through PyTorch's own flash attention.

On a GPU the explicit path of [`TorchKernel`][cpref.kernels.torch_kernel] is correct but slow
(its blocks are many small matrix products; the fused path is CPU-only). `CudaKernel` calls the
FlashAttention-2 varlen kernels that PyTorch ships, `torch.ops.aten._flash_attention_forward`
and `_flash_attention_backward`, which take the packed stream as it is: one call over every
sequence each way for the plain causal or full mask. What flash cannot do goes to
`TorchKernel`'s explicit path, by the rule below.

**One call.** Every contract argument maps onto one argument of the ops:

| contract | `_flash_attention_forward` / `_flash_attention_backward` |
| --- | --- |
| `q (T, Hq, D)`, `k (T', Hkv, D)`, `v (T', Hkv, Dv)` | `query`, `key`, `value`, 3-D (the varlen form), GQA/MQA native |
| `Dv < D` | `value` zero-padded to `D` (and `out`, `dout` in the backward), `out[..., :Dv]`, `dv[..., :Dv]`: exact, the padded columns are zeros |
| a call's sequences | `cum_seq_q`, `cum_seq_k`: int32 on the device, with the leading 0 (built once per `Varlen`, cached on it) |
| the longest sequences | `max_q`, `max_k`: host ints |
| `causal=True` | `is_causal=True`: bottom-right aligned (FlashAttention >= 2.1) |
| a band `(a, b)` of the plan | `window_size_left=a`, `window_size_right=b` (`-1`: unbounded), from the same corner |
| `scale` | `scale`, always passed |
| `lse (T, Hq)` | `softmax_logsumexp (Hq, T)`, float32, transposed (and back, for the backward's `logsumexp`) |
| dropout | `dropout_p=0.0`; the backward's `rng_state` and `unused`: zeros, as PyTorch's `varlen_attn` passes them |

**Calls.** Flash has one corner, the bottom right, and one window a call. The contract's
shifts and windows are rewritten on the host exactly as for the NPU's fused op
([`cpref.kernels.npu_plan`][cpref.kernels.npu_plan]: query $x$ at $p = x + d$ seeing
$p - \mathrm{left} \le y \le p + \mathrm{right}$ is the band
$(\mathrm{left} - \delta, \mathrm{right} + \delta)$ of its bottom-right corner,
$\delta = d - (n_k - n_q)$), with the rows that see no key and the keys no row sees split off,
both sides of every band $\ge 0$, and consecutive sequences of one band in one call: plain
causal or full attention is one call, a window one call (bottom-right sequences share their
band), a ring or all-gather plan with shifts one call per run of equal bands.

**Rows that see no key.** The plan splits them off into sequences without keys, so the op
never computes a row with nothing to see in a sequence that has keys (flash's lse there would
be $+\infty$, not the contract's $-\infty$). What the op writes for a sequence without keys is
not documented, so those rows are overwritten through the plan's `dead` index: `out = 0` and
`lse = -inf` in the forward, `dq = 0` in the backward, whose lse there is sent as a finite 0,
so that no $-\infty$ reaches the op.

**Backward with a global lse.** The op recomputes $P = e^{S - \mathrm{lse}}$ from the lse it
is given and $\Delta = \mathrm{rowsum}(dO \circ O)$ from the `out` it is given, so the ring's
global lse and merged output give exactly this call's share of each row's gradients, as in
`TorchKernel`. `out` is rounded to the input dtype first (the op takes one dtype), so the
caller's float32 output is used as bf16 for $\Delta$; `full_rows` changes nothing here.
`out_dtype` and `grad_dtype` return the op's results (in the input dtype) upcast, as the
contract allows for an op that rounds.

**Which path.** A call takes flash when (`CudaKernel.path`):

* its tensors are on a CUDA device (`devices`);
* its dtype is float16 or bfloat16 (flash computes in nothing else; float32 and float64 take
  the explicit path, in float32 and float64);
* its head dim $D$ is a multiple of 8 and at most 256;
* it is not soft-capped (`softcap=`: PyTorch's flash ops have no soft-capping).

Everything else runs on `fallback` (default `TorchKernel()`, whose explicit path is the one
that runs on a GPU), with the same contract; `CudaKernel.calls` counts both.

**Deterministic backward.** Flash's backward sums dQ over key blocks with atomics; with
`CudaKernel(deterministic=True)` (the default kernel of `cpref.attention(..., deterministic=True)`)
its op runs under PyTorch's deterministic switch, which is how `_flash_attention_backward`
is asked for its deterministic algorithm ([`cpref.base.determinism`][cpref.base.determinism]).

**Unverified** on a GPU (checked on the CPU only, against a double of the two ops, `tests/kernels/flash_double.py`, written from their
documented semantics): that flash's lse is $+\infty$ for a row that sees no key, that it takes
zero-length sequences, and its numerics. `bench/gpu_check.sh` runs the checks on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from cpref.base.checks import as_bool
from cpref.base.determinism import torch_deterministic
from cpref.base.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW, Varlen, check_softcap, check_window, compute_dtype
from cpref.kernels.npu_plan import CAUSAL, UNBOUNDED, Call, plan_calls
from cpref.kernels.torch_checks import check_inputs
from cpref.kernels.torch_kernel import TorchKernel

__all__ = ["CudaKernel", "FLASH_DTYPES", "MAX_HEAD_DIM", "default_kernel"]

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_ENTRIES = 2**31 - 1  # the op has no limit on sequences per call
_OPS = ("_flash_attention_forward", "_flash_attention_backward")


class CudaKernel:
    """The attention contract through flash attention on CUDA; see the module docstring.

    Args:
        ops: where the two ops live (default `torch.ops.aten`); the tests pass a CPU double.
        fallback: the kernel of the calls flash does not take (default `TorchKernel()`).
        devices: the device types flash runs on (default `("cuda",)`).
        flash_dtypes: the dtypes flash takes (default float16, bfloat16).
        deterministic: run flash's backward in its deterministic algorithm (inside
            `cpref.base.determinism.torch_deterministic`: the op reads PyTorch's global switch); the fallback must
            declare `deterministic = True` too.

    Raises:
        CPInputError: if `ops` lacks one of the two ops, or `deterministic` is set with a fallback that does
            not declare it.

    Examples:
        ```python
        # run by tests/kernels/test_cuda_contract.py::test_the_modes_run_on_the_kernel_rank_by_rank
        kernel = cpref.CudaKernel()
        out = cpref.attention(q, k, v, sharding, comm=comm, mode="p2p", kernel=kernel)  # q, k, v bf16 on CUDA
        kernel.calls  # Counter({'flash forward': 1, 'flash backward': 1}) after one step of one layer at P = 1
        ```
    """

    def __init__(self, *, ops: Any = None, fallback: Any = None, devices: tuple[str, ...] = ("cuda",),
                 flash_dtypes: tuple[torch.dtype, ...] = FLASH_DTYPES, deterministic: bool = False) -> None:  # fmt: skip
        ops = torch.ops.aten if ops is None else ops
        for name in _OPS:
            if not callable(getattr(ops, name, None)):
                raise CPInputError(f"ops={ops!r} has no function {name}; pass torch.ops.aten or an object with both ops")
        self.ops, self.fallback = ops, TorchKernel() if fallback is None else fallback
        self.devices, self.flash_dtypes = tuple(devices), tuple(flash_dtypes)
        self.deterministic = as_bool("deterministic", deterministic)
        if self.deterministic and getattr(self.fallback, "deterministic", False) is not True:
            raise CPInputError(
                f"CudaKernel(deterministic=True) with fallback, an instance of {type(self.fallback).__qualname__}, which does not declare "
                "deterministic = True: its calls would not be repeatable; leave fallback unset (TorchKernel) or pass one that is"
            )
        self.calls: Counter = Counter()  # "flash forward", "fallback backward", ...: calls made, by path
        self._lock = threading.Lock()  # ranks of the simulated cluster may share a kernel

    def __repr__(self) -> str:
        return f"CudaKernel(fallback={self.fallback!r}, devices={self.devices}, deterministic={self.deterministic})"

    @property
    def variants(self) -> frozenset:
        """What it computes beyond plain attention: its fallback's (flash here has no soft-capping; those calls fall
        back)."""
        return frozenset(getattr(self.fallback, "variants", ()))

    def path(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen, softcap: float | None = None) -> str:
        """`"flash"`, or why the call takes the fallback (the module docstring's rule)."""
        if softcap is not None:
            return f"softcap {softcap} (PyTorch's flash ops have no soft-capping)"
        if q.device.type not in self.devices:
            return f"device {q.device.type} (flash runs on {', '.join(self.devices)})"
        if q.dtype not in self.flash_dtypes:
            return f"dtype {q.dtype} (flash takes {', '.join(map(str, self.flash_dtypes))})"
        if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
            return f"head dim {q.shape[-1]} (flash takes multiples of 8 up to {MAX_HEAD_DIM})"
        return "flash"

    def _count(self, what: str) -> None:
        with self._lock:
            self.calls[what] += 1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen, *, causal: bool, scale: float,
                window: tuple[int, int] = NO_WINDOW, out_dtype: torch.dtype | None = None,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Return `(out (T, Hq, Dv), lse (T, Hq))`; see `AttentionKernel.forward`."""
        check_inputs(q, k, v, seqs)
        window, softcap = check_window(window, causal), check_softcap(softcap)
        if self.path(q, k, v, seqs, softcap) != "flash":
            self._count("fallback forward")
            capped = {} if softcap is None else {"softcap": softcap}
            return self.fallback.forward(q, k, v, seqs, causal=causal, scale=scale, window=window, out_dtype=out_dtype,
                                         **capped)  # fmt: skip
        self._count("flash forward")
        d, dv, cdt = q.shape[-1], v.shape[-1], compute_dtype(q.dtype)
        kp, vp = (_padded(x, d) for x in (k, v))  # (T', Hkv, D): V padded to D
        outs, lses = [], []
        for c in _calls(seqs, causal, window, q.device):
            if not c.call.live:  # no row sees a key: out = 0, lse = -inf, without calling the op
                outs.append(q.new_zeros((c.call.rows.stop - c.call.rows.start, q.shape[1], d)))
                lses.append(torch.full((c.call.rows.stop - c.call.rows.start, q.shape[1]), float("-inf"), dtype=cdt, device=q.device))
                continue
            # 1) the op over this call's rows and keys (slices of contiguous tensors: contiguous)
            out, lse, *_ = self.ops._flash_attention_forward(
                q[c.call.rows].contiguous(), kp[c.call.keys], vp[c.call.keys], c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0,
                c.causal, False, scale=float(scale), window_size_left=c.left, window_size_right=c.right,
            )  # fmt: skip  # out (T_c, Hq, D), lse (Hq, T_c)
            # 2) the contract's forms: (T_c, Hq) lse; rows of sequences without keys: 0 and -inf, whatever the op wrote
            lse = lse.transpose(0, 1).to(cdt)
            if c.call.dead is not None:
                out, lse = out.index_fill(0, c.call.dead, 0.0), lse.index_fill(0, c.call.dead, float("-inf"))
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
        return out[..., :dv].to(out_dtype or q.dtype).contiguous(), lse.contiguous()

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seqs: Varlen, *, causal: bool, scale: float, window: tuple[int, int] = NO_WINDOW,
                 full_rows: bool = False, grad_dtype: torch.dtype | None = None,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Return `(dq, dk, dv)` shaped like `(q, k, v)`; see `AttentionKernel.backward`."""
        check_inputs(q, k, v, seqs)
        window, softcap = check_window(window, causal), check_softcap(softcap)
        if self.path(q, k, v, seqs, softcap) != "flash":
            self._count("fallback backward")
            capped = {} if softcap is None else {"softcap": softcap}
            return self.fallback.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=scale, window=window,
                                          full_rows=full_rows, grad_dtype=grad_dtype, **capped)  # fmt: skip
        self._count("flash backward")
        d, dv = q.shape[-1], v.shape[-1]
        # 1) one dtype, V, O and dO padded to D; a finite 0 where the contract's lse is -inf (rows without keys)
        kp, vp, dop, op = (_padded(x.to(q.dtype), d) for x in (k, v, dout, out))
        stats = lse.to(compute_dtype(q.dtype)).masked_fill(lse == float("-inf"), 0.0)  # (T, Hq)
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        grads = []
        for c in _calls(seqs, causal, window, q.device):
            r, y = c.call.rows, c.call.keys
            if not c.call.live:  # no row sees a key: zero gradients
                grads.append(tuple(torch.zeros((s.stop - s.start, x.shape[1], d), dtype=q.dtype, device=q.device)
                                   for s, x in ((r, q), (y, k), (y, k))))  # fmt: skip
                continue
            # 2) the op over this call's rows and keys (its deterministic algorithm, if asked: a global switch)
            with torch_deterministic() if self.deterministic else contextlib.nullcontext():
                dq, dk, dvp = self.ops._flash_attention_backward(
                    dop[r], q[r].contiguous(), kp[y], vp[y], op[r], stats[r].transpose(0, 1).contiguous(), c.cu_q,
                    c.cu_k, c.max_q, c.max_k, 0.0, c.causal, rng, unused, scale=float(scale), window_size_left=c.left,
                    window_size_right=c.right,
                )  # fmt: skip
            grads.append((dq if c.call.dead is None else dq.index_fill(0, c.call.dead, 0.0), dk, dvp))
        dq, dk, dvp = grads[0] if len(grads) == 1 else tuple(torch.cat(g) for g in zip(*grads))
        # 3) the contract's shapes and dtypes
        return dq.to(grad_dtype or q.dtype), dk.to(grad_dtype or k.dtype), dvp[..., :dv].to(grad_dtype or v.dtype).contiguous()


class _FlashCall(NamedTuple):
    """One op call: the plan's call (its rows, keys, band, dead rows) and the op's arguments for it."""

    call: Call
    cu_q: torch.Tensor | None  # (E + 1,) int32 on the device, with the leading 0
    cu_k: torch.Tensor | None
    max_q: int
    max_k: int
    causal: bool  # the band is bottom-right causal
    left: int  # window_size_left (-1: unbounded)
    right: int  # window_size_right


def _calls(seqs: Varlen, causal: bool, window: tuple[int, int], device: torch.device) -> list[_FlashCall]:
    """The op calls for `seqs` (`cpref.kernels.npu_plan`'s rewrite: one band a call, rows that see no key split off),
    with their device lengths; built once per `Varlen`, mask and device and cached on it."""

    def build() -> list[_FlashCall]:
        out = []
        for call in plan_calls(seqs, causal=causal, window=window, hq=1, device=device, head_major_stats=False,
                               max_seqs=MAX_ENTRIES):  # fmt: skip
            cu_q, cu_k = [0, *call.seq_qlen], [0, *call.seq_kvlen]
            tensors = [torch.tensor(cu, dtype=torch.int32, device=device) for cu in (cu_q, cu_k)] if call.live else [None, None]
            maxima = [max((b - a for a, b in zip(cu, cu[1:])), default=0) for cu in (cu_q, cu_k)]
            pre, nxt = call.band
            out.append(_FlashCall(call, *tensors, *maxima, call.band == CAUSAL, -1 if pre == UNBOUNDED else pre,
                                  0 if call.band == CAUSAL else -1 if nxt == UNBOUNDED else nxt))  # fmt: skip
        return out

    return seqs.cached(("CudaKernel.calls", bool(causal), window, str(device)), build)


def default_kernel(device: Any, *, deterministic: bool = False) -> Any:
    """The kernel `cpref.attention` uses when none is given: `CudaKernel(deterministic=...)` for tensors on a CUDA
    device (flash, and the explicit path where flash cannot go), `TorchKernel()` elsewhere (always deterministic)."""
    return CudaKernel(deterministic=deterministic) if getattr(device, "type", None) == "cuda" else TorchKernel()


def _padded(x: torch.Tensor, d: int) -> torch.Tensor:
    """`x (T, H, X)` contiguous, zero-padded in its last dim to `d`: `(T, H, d)`."""
    return (x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))).contiguous()
