"""The pieces a block plugs in: norms and MLPs, chosen by the family (see `FAMILIES`).

| piece | GPT-2 | LLaMA, Qwen3 |
| --- | --- | --- |
| norm | `LayerNorm` (weight and bias) | [`RMSNorm`][cpref.models.layers.RMSNorm] (weight) |
| MLP | [`GeluMLP`][cpref.models.layers.GeluMLP]: `down(gelu_tanh(up x))` | [`SwiGLU`][cpref.models.layers.SwiGLU]: `down(silu(gate x) * up x)` |

Parameter names follow the roles (`up`, `gate`, `down`), not any checkpoint's names; the
Hugging Face loader maps between them (`cpref.models.hf_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpref.models.config import ModelConfig

__all__ = ["RMSNorm", "GeluMLP", "SwiGLU", "make_norm", "make_mlp"]


class RMSNorm(nn.Module):
    r"""Root-mean-square norm (Zhang and Sennrich, 2019) over the last dim, with a learned scale.

    $$ y = w \odot \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} $$

    Computed in at least float32 and cast back before the scale, as Hugging Face's LLaMA does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., dim)` normalised by its root mean square, times the weight."""
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        # x / sqrt(mean(x^2) + eps)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        # the input's dtype out: under bf16 autocast a float32 weight must not promote q and k
        return (self.weight * h.to(x.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        """The size and epsilon, as `print(model)` shows them."""
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GeluMLP(nn.Module):
    """GPT-2's MLP: `E -> F`, GELU with the tanh approximation, `F -> E`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.mlp_size, bias=config.mlp_bias)
        self.down = nn.Linear(config.mlp_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(T, E) -> (T, E)`: up, GELU (tanh), down."""
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (T_l, E) -> (T_l, F) -> (T_l, E)


class SwiGLU(nn.Module):
    """LLaMA's gated MLP (Shazeer, 2020): `down(silu(gate x) * up x)`, `E -> F -> E`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.mlp_size, bias=config.mlp_bias)
        self.up = nn.Linear(config.hidden_size, config.mlp_size, bias=config.mlp_bias)
        self.down = nn.Linear(config.mlp_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(T, E) -> (T, E)`: silu(gate) * up, then down."""
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (T_l, E) -> (T_l, F) -> (T_l, E)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The family's norm over `dim` features."""
    if config.spec.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps)


def make_mlp(config: ModelConfig) -> nn.Module:
    """The family's MLP."""
    return GeluMLP(config) if config.spec.mlp == "gelu" else SwiGLU(config)
