"""The attention kernel contract.

Every CP algorithm calls attention only through an object with this interface, so the same
algorithm runs on the CPU (`TorchKernel`), on CUDA (`TorchKernel`) and on an Ascend NPU
(`npu_fusion_attention`, a later issue), and the contract is shaped to map one-to-one onto
the NPU's TND call.

**Varlen (TND).** `q` is `(T, Hq, D)`, `k` is `(T', Hkv, D)`, `v` is `(T', Hkv, Dv)` with
`Hq % Hkv == 0` (GQA/MQA: query head `h` reads key head `h // (Hq / Hkv)`) and `Dv <= D`
(MLA-style). `cu_seqlens_q` / `cu_seqlens_kv` (leading 0, same length `N + 1`) cut the
streams into `N` independent sequences; sequence `i` has `q_len_i` queries and `kv_len_i`
keys, and its queries see only its keys.

**Bottom-right causal.** With `causal=True`, query `j` of sequence `i` sees key `t` iff

$$ t \\le j + \\mathrm{kv\\_len}_i - \\mathrm{q\\_len}_i , $$

i.e. the *last* query is aligned with the *last* key (NPU `sparse_mode=3`,
FlashAttention >= 2.1). A CP rank whose query chunk ends a causal prefix of keys therefore
needs no positional offset at all.

**Outputs.** `out` is `(T, Hq, Dv)` in the input dtype; `lse` is `(T, Hq)`, the natural-log
log-sum-exp of the scaled logits, float32 (float64 for float64 inputs). A row that sees no
key gives `out = 0` and `lse = -inf`, never NaN.

**Backward.** `backward(dout, q, k, v, out, lse, ...)` returns `(dq, dk, dv)` with the shapes
and dtypes of `q, k, v`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["AttentionKernel"]


@runtime_checkable
class AttentionKernel(Protocol):
    """Varlen attention with bottom-right causal masking, returning `out` and `lse`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out (T, Hq, Dv), lse (T, Hq))`."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` shaped and typed like `(q, k, v)`."""
        ...
