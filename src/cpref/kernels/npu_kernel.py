r"""`NpuKernel`: the attention contract on an Ascend NPU, with `torch_npu.npu_fusion_attention`.

The contract (`cpref.kernels.contract`) was shaped after the NPU's fused varlen call, so the
adapter is mostly a table. What is left is the lse, which the op returns in pieces and in its
own storage order, and a few lengths the op is not documented to handle. Sources: the
torch_npu / CANN documentation of `npu_fusion_attention(_grad)` and MindSpeed's
context-parallel code; nothing here has been run on an NPU by its author (see *Unverified*).

**One call.** Every contract argument maps onto one argument of the op in `TND` layout:

| contract | `npu_fusion_attention` / `npu_fusion_attention_grad` |
| --- | --- |
| `q (T, Hq, D)`, `k (T', Hkv, D)`, `v (T', Hkv, Dv)` | `query`, `key`, `value`, `input_layout="TND"` (GQA/MQA native, $D_v \le D \le 768$) |
| $H_q$ | `head_num` (the *query* heads) |
| `scale` $s$ | `scale=s` forward, `scale_value=s` backward (both default to 1.0: always passed) |
| `seqs.cu_q[1:]`, `seqs.cu_kv[1:]` | `actual_seq_qlen`, `actual_seq_kvlen`: host lists, cumulative, no leading 0 |
| `causal=True` | `sparse_mode=3` (bottom-right) with the compressed mask below |
| `causal=False` | `atten_mask=None`: no masking at all, whatever `sparse_mode` says |
| `window=(w, 0)` with `causal=True` | `sparse_mode=4` (band, bottom-right), the compressed mask, `pre_tockens=w`, `next_tockens=0` |
| `window=(left, right)`, `causal=False` | `sparse_mode=4`, `pre_tockens=left`, `next_tockens=right`; a side of $-1$: the default $2^{31} - 1$ |
| `window=(-1, -1)`, `causal=False` | `atten_mask=None`, as without a window |
| `Varlen(shifts=...)`, shift $d$ | `pre_tockens=left - delta`, `next_tockens=right + delta` with $\delta = d - (n_k - n_q)$ (of what the rewrites below leave); one call per run of sequences with the same pair |

**Mask rules.** Bottom-right causal means query $x$ of a sequence with $n_q$ queries and
$n_k$ keys sees key $y$ iff $y \le x + n_k - n_q$. The op takes it as `sparse_mode=3` plus the
*compressed* mask `torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)` (True = hidden),
whatever the sequence lengths; the kernel builds it once per device and reuses it. Rows with
$j < n_q - n_k$ see no key, and the op's documentation disagrees with itself about them, so
the kernel never sends them (next paragraphs).

**Windows and shifts.** `sparse_mode=4` is the band of the same corner: with
`pre_tockens` $a$ and `next_tockens` $b$ query $x$ sees key $y$ iff
$c_x - a \le y \le c_x + b$, $c_x = x + n_k - n_q$, with the same compressed mask. The
contract's query $x$ stands at $p = x + d$ and sees $p - \mathrm{left} \le y \le p + \mathrm{right}$
($\mathrm{right} = 0$ under causal), which is that band with $a = \mathrm{left} - \delta$,
$b = \mathrm{right} + \delta$ and $\delta = d - (n_k - n_q)$: 0 for a bottom-right sequence, so
a window without shifts is one band, `(left, right)`. The op takes one band per call, so the plan cuts the sequences into runs
whose bands agree. A band that is plain causal, $(2^{31} - 1, 0)$, is sent as `sparse_mode=3`,
and one unbounded on both sides with no mask. Plain causal attention (no window, bottom-right)
is exactly the `sparse_mode=3` call above.

**Lengths the op does not get.** The lists are rewritten on the host, once per `Varlen`
and window (`cpref.kernels.npu_plan`): the rows of a sequence that see no key (before its
band reaches key 0, or after it has passed the last key) are split off, as are the keys after
the last one any row sees; under plain causal, a sequence with $n_q > n_k$ becomes
$(n_q - n_k, 0)$ and $(n_k, n_k)$. What is left of each sequence has rows that all see a key,
and a band with both sides $\ge 0$: the op is documented to take a negative side only under
further conditions, and it never gets one. Rows of an entry with no key are *dead*: their
`out` is overwritten with 0 and their `lse` with $-\infty$ through a cached index, and in
backward their `dout` is zeroed, their lse replaced by a finite 0 (so no $-\infty$ reaches the
op) and their `dq` zeroed. Sequences with neither queries nor keys are dropped, neighbours
without queries (or without keys) merge into one, calls with more than 2048 sequences are
split, and a call in which no row sees a key is never made. A sequence with no key at all
stays in the lists as a zero-length sequence, which the op allows.

**Softmax statistics.** The forward returns, per row and head, the max $m$ and the sum
$\ell$ of the *scaled* logits $S = s\, q k^\top$ as float32, each value replicated 8 times in
the last dim:

$$ m = \max_y S_y, \qquad \ell = \sum_y e^{S_y - m}, \qquad \mathrm{lse} = m + \ln \ell . $$

For `TND` the tensors have shape `(T, Hq, 8)`, but by default the data is stored *per
sequence, head-major*: sequence $b$ with $n_b$ rows fills a block laid out `(Hq, n_b, 8)`,
blocks one after another. The kernel reads `m + ln(l)` in storage order and gathers it into
the contract's token-major `lse (T, Hq)` with one cached index (`npu_plan.stat_index`);
with `NpuKernel(softmax_layout="TND")` (torch_npu >= 7.2.0, CANN >= 8.3.RC1) the storage
really is `(T, Hq, 8)` and no gather is needed.

**Backward with a global lse.** The grad op recomputes $P = e^{S - m} / \ell$ from the stats
it is given. Under ring attention the contract's `lse` belongs to a *longer* row than this
call sees, so the kernel passes $m = \mathrm{lse}$ and $\ell = 1$ (scattered back into the
op's storage order), which makes $P = e^{S - \mathrm{lse}}$: exactly this call's share of the
row's probabilities, as in `TorchKernel`. `attention_in` is the `out` the caller passes (the
global output under ring attention), which the op uses for $\Delta = \mathrm{rowsum}(dO \circ O)$.

**No host sync.** Lengths come from the `Varlen` as Python ints; the rewritten lists, the
dead-row index and the stat index are built once per `Varlen` and device and cached on it;
every device op is a slice, gather, fill or concatenation of known size.

**Deterministic backward.** With `NpuKernel(deterministic=True)` the grad op runs under
PyTorch's deterministic switch, which `torch_npu` maps onto the NPU's deterministic computing
(`aclnnFlashAttentionUnpaddingScoreGrad` is on CANN's list of ops it covers); HCCL's
reductions need `HCCL_DETERMINISTIC=true` in the environment as well
([`cpref.base.determinism`][cpref.base.determinism]).

**Unverified** on an NPU (checked on the CPU only, against a double of the ops): the head-major
stat storage, zero-length sequences inside a list (also a `kv_len = 0` one under `sparse_mode=3` or `4`), the 2048 sequences per call,
that `sparse_mode=4` in TND counts its band from each sequence's bottom-right corner,
and that the grad op takes `softmax_max = lse, softmax_sum = 1` as it is documented to. `make test-npu`
(`python -m sim.tools.npu_check`) runs this kernel against the FP64 oracle on an NPU with cases
built to fail loudly on each wrong guess; windowed and shifted cases are not among them yet.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any

import torch

from cpref.base.checks import as_bool
from cpref.base.determinism import torch_deterministic
from cpref.base.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW, Varlen, check_heads, check_window, compute_dtype
from cpref.kernels.npu_plan import CAUSAL, FULL, Call, plan_calls

__all__ = ["NpuKernel"]

MASK_SIZE = 2048  # the compressed causal mask is always 2048 x 2048
MAX_HEAD_DIM = 768
MAX_SEQS_PER_CALL = 2048
STAT_COPIES = 8  # softmax_max / softmax_sum repeat every value 8 times in their last dim
NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _load_torch_npu() -> Any:
    """`import torch_npu`, by name, only when an `NpuKernel` is built (it needs the CANN libraries)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a CANN library failing to load
        raise RuntimeError(
            f"NpuKernel needs torch_npu, which is not importable here ({type(exc).__name__}: {exc}). "
            "Install the CANN toolkit and the torch_npu wheel matching your torch "
            "(pip install torch-npu==<your torch version>), or use TorchKernel on this machine."
        ) from exc


class NpuKernel:
    """The attention contract with `torch_npu.npu_fusion_attention(_grad)` in TND layout.

    Args:
        ops: an object with the two functions `npu_fusion_attention` and
            `npu_fusion_attention_grad`; default: the imported `torch_npu` (tests pass a double).
        softmax_layout: `""` for the op's default head-major TND stat storage, or `"TND"`
            (torch_npu >= 7.2.0) for truly token-major stats.
        max_seqs_per_call: at most this many sequences per op call; longer lists are split.
        deterministic: run the grad op inside `cpref.base.determinism.torch_deterministic` (torch_npu's deterministic
            computing, which covers the fused attention's grad); the collectives' reductions need
            `HCCL_DETERMINISTIC=true` as well.

    Raises:
        RuntimeError: if `ops` is None and torch_npu cannot be imported.
        CPInputError: for a bad `softmax_layout`, `max_seqs_per_call` or `ops`.

    Examples:
        >>> kernel = NpuKernel()  # doctest: +SKIP
        >>> out, lse = kernel.forward(q, k, v, Varlen([0, 2, 6]), causal=True, scale=0.125)  # doctest: +SKIP
    """

    variants = frozenset()  # npu_fusion_attention has no soft-capping: cpref.attention refuses softcap= with it

    def __init__(self, *, ops: Any = None, softmax_layout: str = "", max_seqs_per_call: int = MAX_SEQS_PER_CALL,
                 deterministic: bool = False) -> None:  # fmt: skip
        if softmax_layout not in ("", "TND"):
            raise CPInputError(f"softmax_layout={softmax_layout!r}: use '' (the op's default) or 'TND' (torch_npu >= 7.2.0)")
        if isinstance(max_seqs_per_call, bool) or not isinstance(max_seqs_per_call, int) or not 1 <= max_seqs_per_call <= MAX_SEQS_PER_CALL:
            raise CPInputError(f"max_seqs_per_call={max_seqs_per_call!r} must be an int in 1..{MAX_SEQS_PER_CALL}")
        ops = _load_torch_npu() if ops is None else ops
        for name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
            if not callable(getattr(ops, name, None)):
                raise CPInputError(f"ops={ops!r} has no function {name}; pass torch_npu or an object with both ops")
        self.ops = ops
        self.softmax_layout = softmax_layout
        self.max_seqs_per_call = max_seqs_per_call
        self.deterministic = as_bool("deterministic", deterministic)
        self._masks: dict[str, torch.Tensor] = {}  # device -> compressed causal mask
        self._lock = threading.Lock()  # ranks of the simulated cluster may share a kernel

    def __repr__(self) -> str:
        return (f"NpuKernel(softmax_layout={self.softmax_layout!r}, max_seqs_per_call={self.max_seqs_per_call}, "
                f"deterministic={self.deterministic})")  # fmt: skip

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen, *, causal: bool, scale: float,
        window: tuple[int, int] = NO_WINDOW, out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out (T, Hq, Dv), lse (T, Hq))`; see `AttentionKernel.forward`.

        The op rounds `out` to the input dtype; with `out_dtype` it is returned upcast.
        """
        calls = self._plan(q, k, v, seqs, causal, window, scale)
        parts = [self._forward_call(q[c.rows], k[c.keys], v[c.keys], c, scale) for c in calls]  # row slices: views
        out, lse = parts[0] if len(parts) == 1 else (torch.cat([o for o, _ in parts]), torch.cat([m for _, m in parts]))
        return out.to(out_dtype or out.dtype), lse  # (T, Hq, Dv), (T, Hq)

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
        window: tuple[int, int] = NO_WINDOW,
        full_rows: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` shaped like `(q, k, v)`; see `AttentionKernel.backward`.

        `full_rows` is accepted and ignored: the grad op computes its row sums from `out`.
        The op rounds the gradients to the input dtype; with `grad_dtype` they are returned upcast.
        """
        calls = self._plan(q, k, v, seqs, causal, window, scale)
        out = out.to(q.dtype)  # the op takes attention_in in the input dtype
        parts = [
            self._backward_call(dout[c.rows], q[c.rows], k[c.keys], v[c.keys], out[c.rows], lse[c.rows], c, scale)
            for c in calls
        ]
        grads = parts[0] if len(parts) == 1 else tuple(torch.cat(g) for g in zip(*parts))  # (T, Hq, D), (T', Hkv, D|Dv)
        return tuple(g.to(grad_dtype or g.dtype) for g in grads)

    def _forward_call(self, q, k, v, call: Call, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cdt = compute_dtype(q.dtype)
        if not call.live:  # no row sees a key: out = 0, lse = -inf, without calling the op
            return q.new_zeros(*q.shape[:2], v.shape[2]), torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
        # 1) the fused op: out (T_c, Hq, Dv), stats (T_c, Hq, 8) in storage order
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no-ops for row slices of contiguous inputs
        out, smax, ssum, *_ = self.ops.npu_fusion_attention(
            q, k, v, q.shape[1], "TND", scale=float(scale), **self._call_kwargs(call, q.device)
        )
        # 2) lse = max + ln(sum), from the first of the 8 copies, still in storage order
        lse = smax[..., 0].to(cdt) + ssum[..., 0].to(cdt).log()  # (T_c, Hq)
        if call.stat_index is not None:  # head-major storage -> token-major
            lse = lse.reshape(-1).index_select(0, call.stat_index).view(q.shape[:2])  # (T_c*Hq,) -> (T_c, Hq)
        # 3) dead rows see no key: out = 0, lse = -inf (both tensors are ours: in place)
        if call.dead is not None:
            out.index_fill_(0, call.dead, 0)  # (T_c, Hq, Dv)
            lse.index_fill_(0, call.dead, float("-inf"))  # (T_c, Hq)
        return out, lse

    def _backward_call(self, dout, q, k, v, out, lse, call: Call, scale: float):
        if not call.live:  # no row sees a key: no gradient
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # 1) dead rows: no gradient flows in, and a finite lse (never -inf) goes to the op
        q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))  # no-ops for contiguous inputs
        if call.dead is not None:
            dout = dout.index_fill(0, call.dead, 0)  # (T_c, Hq, Dv)
            lse = lse.index_fill(0, call.dead, 0.0)  # (T_c, Hq)
        # 2) softmax_max = lse and softmax_sum = 1, so the op recomputes P = exp(S - lse)
        smax = self._stats_from_lse(lse, call, compute_dtype(q.dtype))  # (T_c, Hq, 8)
        with torch_deterministic() if self.deterministic else contextlib.nullcontext():
            dq, dk, dv, *_ = self.ops.npu_fusion_attention_grad(
                q, k, v, dout, q.shape[1], "TND",
                softmax_max=smax, softmax_sum=torch.ones_like(smax), attention_in=out, scale_value=float(scale),
                **self._call_kwargs(call, q.device),
            )  # fmt: skip
        # 3) dead rows keep a zero dq
        if call.dead is not None:
            dq.index_fill_(0, call.dead, 0)  # (T_c, Hq, D)
        return dq, dk, dv

    def _stats_from_lse(self, lse: torch.Tensor, call: Call, dtype: torch.dtype) -> torch.Tensor:
        """Token-major `lse (T_c, Hq)` as the op's `softmax_max (T_c, Hq, 8)`, in its storage order."""
        t, hq = lse.shape
        flat = lse.to(dtype).reshape(-1)  # (T_c*Hq,) token-major
        if call.stat_index is not None:  # storage row stat_index[i] holds token-major entry i
            flat = torch.empty_like(flat).index_copy_(0, call.stat_index, flat)  # (T_c*Hq,) storage order
        return flat.view(t, hq, 1).expand(t, hq, STAT_COPIES).contiguous()  # (T_c, Hq, 8)

    def _call_kwargs(self, call: Call, device: torch.device) -> dict[str, Any]:
        """The keywords forward and backward share: lists, mask, sparse mode and tokens (from the call's band), stat layout."""
        kwargs: dict[str, Any] = {"actual_seq_qlen": call.seq_qlen, "actual_seq_kvlen": call.seq_kvlen}
        if call.band == FULL:  # no mask: full attention within every sequence
            kwargs.update(atten_mask=None, sparse_mode=0)
        elif call.band == CAUSAL:  # bottom-right causal: sparse mode 3 and the compressed mask
            kwargs.update(atten_mask=self._mask(device), sparse_mode=3)
        else:  # a bottom-right band: sparse mode 4, the compressed mask, and the band's two sides
            pre, nxt = call.band
            kwargs.update(atten_mask=self._mask(device), sparse_mode=4, pre_tockens=pre, next_tockens=nxt)
        if self.softmax_layout:  # older torch_npu has no such keyword: pass it only when asked
            kwargs["softmax_layout"] = self.softmax_layout
        return kwargs

    def _mask(self, device: torch.device) -> torch.Tensor:
        """The compressed bottom-right causal mask on `device` (True = hidden), built once per device."""
        with self._lock:
            key = str(device)
            if key not in self._masks:
                ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device)  # (2048, 2048)
                self._masks[key] = torch.triu(ones, diagonal=1)  # (2048, 2048)
            return self._masks[key]

    def _plan(self, q, k, v, seqs: Varlen, causal: bool, window: tuple[int, int], scale: float) -> list[Call]:
        """Validate on the host, then the calls for `seqs` (built once per Varlen, mask, heads, device)."""
        window = check_window(window, causal)
        _check(q, k, v, seqs, scale)
        key = ("NpuKernel.plan", bool(causal), window, q.shape[1], str(q.device), self.softmax_layout, self.max_seqs_per_call)
        return seqs.cached(
            key,
            lambda: plan_calls(
                seqs, causal=bool(causal), window=window, hq=q.shape[1], device=q.device,
                head_major_stats=not self.softmax_layout, max_seqs=self.max_seqs_per_call,
            ),
        )  # fmt: skip


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen, scale: float) -> None:
    """Raise `CPInputError` for inputs the fused op cannot take; host-side only."""
    check_heads(q, k, v)
    if not isinstance(seqs, Varlen):
        raise CPInputError(f"seqs must be a cpref.kernels.Varlen (host lengths), got {type(seqs).__name__}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise CPInputError(f"NpuKernel: q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "npu" and q.dtype not in NPU_DTYPES:
        raise CPInputError(f"NpuKernel: dtype {q.dtype} is not supported by the fused op; cast to one of {NPU_DTYPES}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise CPInputError(f"NpuKernel: head dim D={q.shape[2]} exceeds the fused op's {MAX_HEAD_DIM}; use TorchKernel for it")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise CPInputError(f"NpuKernel: scale must be a Python float (the op takes a host double), got {type(scale).__name__}")
    if seqs.total_q != q.shape[0] or seqs.total_kv != k.shape[0]:
        raise CPInputError(
            f"NpuKernel: seqs cover {seqs.total_q} queries and {seqs.total_kv} keys, "
            f"but q has {q.shape[0]} rows and k {k.shape[0]}"
        )

