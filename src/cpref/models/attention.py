"""Self-attention of one block: project, (normalise q and k), rotate, `cpref.attention`, project back.

The only call into attention is `cp.attention(q, k, v, window=...)` on THD tensors
`(T_l, H, D)`: this rank's tokens, in the shard's order, and the layer's sliding window
(`config.window(layer)`: none unless `config.layer_windows` gives this layer one). The
projections, the per-head norms and RoPE act on each token alone, so they run on the shard
exactly as on the whole stream; only the scores mix tokens, and `cpref.attention` computes
them over the whole of every document (or of the window inside it), whichever rank holds its
pieces, with the mask of each document and the scale `D ** -0.5`.
"""

from __future__ import annotations

import torch
from torch import nn

from cpref.models.config import ModelConfig
from cpref.models.context import CPContext
from cpref.models.layers import RMSNorm
from cpref.models.rope import CosSin, apply_rope

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with the family's options.

    Parameters: `q (Hq D, E)`, `k (Hkv D, E)`, `v (Hkv D, E)`, `o (E, Hq D)` (biases if
    `attention_bias`), and Qwen3's `q_norm`, `k_norm (D,)`. `window` is the layer's
    `(left, right)`, `(-1, -1)` for full attention.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = config.window(layer)
        e, self.hq, self.hkv, self.d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q = nn.Linear(e, self.hq * self.d, bias=bias)
        self.k = nn.Linear(e, self.hkv * self.d, bias=bias)
        self.v = nn.Linear(e, self.hkv * self.d, bias=bias)
        self.o = nn.Linear(self.hq * self.d, e, bias=bias)
        qk_norm = config.spec.qk_norm
        self.q_norm = RMSNorm(self.d, config.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.d, config.norm_eps) if qk_norm else None

    # --8<-- [start:attention]
    def forward(self, x: torch.Tensor, rope: CosSin | None, cp: CPContext) -> torch.Tensor:
        """`(T_l, E) -> (T_l, E)`; `rope` is `(cos, sin)` of the local tokens, or None (GPT-2)."""
        t = x.shape[0]
        q = self.q(x).view(t, self.hq, self.d)  # (T_l, E) -> (T_l, Hq, D)
        k = self.k(x).view(t, self.hkv, self.d)  # (T_l, E) -> (T_l, Hkv, D)
        v = self.v(x).view(t, self.hkv, self.d)  # (T_l, E) -> (T_l, Hkv, D)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's D dims, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # LLaMA, Qwen3: rotate by each token's position in its document
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = cp.attention(q, k, v, window=self.window)  # (T_l, Hq, D) x (T_l, Hkv, D) -> (T_l, Hq, D), CP group
        return self.o(o.reshape(t, self.hq * self.d))  # (T_l, Hq D) -> (T_l, E)
    # --8<-- [end:attention]
