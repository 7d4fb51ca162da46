r"""Rotary position embeddings (RoPE), as LLaMA and Qwen3 apply them to q and k.

RoFormer (Su et al., 2021, <https://arxiv.org/abs/2104.09864>) encodes a token's position
$p$ by rotating its query and key. Hugging Face's LLaMA and Qwen3 pair dim $i$ with dim
$i + D/2$ (the "rotate half" convention, not adjacent pairs) and rotate each pair by the
angle $p\,\omega_i$:

$$ \omega_i = \theta^{-2i/D}, \qquad
   \begin{pmatrix} x'_i \\ x'_{i+D/2} \end{pmatrix} =
   \begin{pmatrix} \cos p\omega_i & -\sin p\omega_i \\ \sin p\omega_i & \cos p\omega_i \end{pmatrix}
   \begin{pmatrix} x_i \\ x_{i+D/2} \end{pmatrix}, \qquad 0 \le i < D/2 . $$

A rotation by $p_q$ of the query and by $p_k$ of the key leaves their dot product a
function of $p_q - p_k$ alone, so attention sees relative positions. Under CP that is what
makes sharding harmless: a rank needs nothing but **each of its tokens' true position inside
its document** (`position_ids`, from [`Sharding.positions`][cpref.batch.sharding.Sharding.positions] or
[`cpref.get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank]); whichever rank
computes a score, the two rotations it multiplies are those of the unsharded model.

The angles are computed in float32 (float64 for a float64 model) and the cosines and sines
cast to the model's dtype, as Hugging Face does.
"""

from __future__ import annotations

import torch

__all__ = ["CosSin", "rope_cos_sin", "apply_rope"]

CosSin = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (T_l, D)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> CosSin:
    """`(cos, sin)`, each `(T_l, D)`: every local token's rotation, once per forward (the layers share it)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    # w_i = theta ** (-2i / D)
    i2 = torch.arange(0, head_dim, 2, dtype=work, device=position_ids.device)  # 2i, (D/2,)
    inv_freq = 1.0 / theta ** (i2 / head_dim)  # (D/2,)
    angles = position_ids.to(work)[:, None] * inv_freq[None, :]  # (T_l, 1) x (1, D/2) -> (T_l, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T_l, D): dims i and i + D/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of `x`: `(T_l, H, D)` with `cos, sin (T_l, D)` -> `(T_l, H, D)`."""
    x1, x2 = x.chunk(2, dim=-1)  # (T_l, H, D/2) each
    # (x_i, x_{i+D/2}) -> (x_i cos - x_{i+D/2} sin, x_{i+D/2} cos + x_i sin)
    rotated = torch.cat([-x2, x1], dim=-1)  # (T_l, H, D)
    # in the angles' precision, back to x's dtype (under bf16 autocast q and k stay bf16, like v)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
