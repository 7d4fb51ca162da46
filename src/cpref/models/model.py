"""The decoder-only model: one block skeleton, three families.

`CausalLM(config)` builds embeddings, `L` pre-norm blocks, a final norm and the output
projection; the family (`config.spec`) picks the pieces of every `Block`. The forward takes
this rank's tokens and their positions and returns this rank's logits, in the shard's token
order; the CP setting comes in with every call (`cp`), never stored.

Weights start from `seed` with a generator of their own, so every rank of a CP or DP group
that builds `CausalLM(config, seed=s)` holds the same replica without touching torch's global
random state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from cpref.api import MODES
from cpref.base.errors import CPInputError
from cpref.models.attention import SelfAttention
from cpref.models.config import ModelConfig
from cpref.models.context import CPContext
from cpref.models.hf_weights import convert_hf_state_dict, read_hf_weights
from cpref.models.layers import make_mlp, make_norm
from cpref.models.rope import CosSin, rope_cos_sin

__all__ = ["Block", "CausalLM"]

INDEX_DTYPES = (torch.int64, torch.int32)


class Block(nn.Module):
    """A pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; block `layer` of the model."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(config, config.hidden_size)
        self.attn = SelfAttention(config, layer)  # with the layer's sliding window, if it has one
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.mlp = make_mlp(config)

    # --8<-- [start:block]
    def forward(self, x: torch.Tensor, rope: CosSin | None, cp: CPContext) -> torch.Tensor:
        """`(T_l, E) -> (T_l, E)`."""
        x = x + self.attn(self.attn_norm(x), rope, cp)  # LayerNorm / RMSNorm; MHA / GQA; RoPE, q/k norm
        x = x + self.mlp(self.mlp_norm(x))  # GELU(tanh) MLP or SwiGLU
        return x
    # --8<-- [end:block]


class CausalLM(nn.Module):
    """A GPT-2, LLaMA (Mistral: with `layer_windows`) or Qwen3 style decoder-only LM whose attention is `cpref.attention`.

    Args:
        config: the family and sizes.
        seed: seed of the initial weights (normal with `config.init_std`, biases 0, norms 1).

    Examples:
        >>> import torch, cpref
        >>> from cpref.models import CausalLM, CPContext, ModelConfig
        >>> model = CausalLM(ModelConfig(family="qwen3", vocab_size=50, hidden_size=32, num_layers=2,
        ...                              num_heads=4, num_kv_heads=2, head_dim=16))
        >>> cu = [0, 3, 8]  # two documents, of 3 and 5 tokens
        >>> tokens = torch.tensor([5, 9, 2, 7, 7, 1, 3, 4])
        >>> positions = cpref.Sharding(cu, cp_size=1).positions(0)
        >>> positions.tolist()
        [0, 1, 2, 0, 1, 2, 3, 4]
        >>> model(tokens, positions, CPContext.single(cu)).shape
        torch.Size([8, 50])
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise CPInputError(f"config must be a cpref.models.ModelConfig, got {type(config).__name__}")
        self.config = config
        e = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, e)
        self.pos_embed = nn.Embedding(config.max_positions, e) if config.spec.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.num_layers))
        self.norm = make_norm(config, e)
        self.lm_head = None if config.tie_embeddings else nn.Linear(e, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Matrices ~ N(0, init_std^2) drawn in a fixed order from `seed`; biases 0; norm weights 1."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * self.config.init_std)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)

    # --8<-- [start:forward]
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, cp: CPContext) -> torch.Tensor:
        """This rank's logits.

        Args:
            tokens: `(T_l,)` this rank's token ids, in the shard's order.
            position_ids: `(T_l,)` each token's position inside its document (restarting at 0
                at every document), e.g. `sharding.positions(rank)` or `get_batch_on_this_cp_rank`'s.
            cp: the CP setting of this batch; `CPContext.single(cu_seqlens)` for CP = 1.

        Returns:
            `(T_l, V)` logits, in the order of `tokens`.
        """
        self._check_inputs(tokens, position_ids, cp)
        x = self.embed(tokens)  # (T_l,) -> (T_l, E)
        rope = None
        if self.pos_embed is not None:  # GPT-2: learned absolute positions
            x = x + self.pos_embed(position_ids)  # (T_l, E)
        else:  # LLaMA, Qwen3: RoPE inside every attention
            rope = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)  # (T_l, D) x 2
        for block in self.blocks:
            x = block(x, rope, cp)  # (T_l, E)
        x = self.norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight  # (V, E)
        return F.linear(x, head)  # (T_l, E) -> (T_l, V)
    # --8<-- [end:forward]

    def _check_inputs(self, tokens: torch.Tensor, position_ids: torch.Tensor, cp: CPContext) -> None:
        if not isinstance(cp, CPContext):
            raise CPInputError(
                f"cp must be a cpref.models.CPContext, got {type(cp).__name__}; "
                "for CP = 1 pass CPContext.single(cu_seqlens)"
            )
        for name, t in (("tokens", tokens), ("position_ids", position_ids)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CPInputError(f"{name} must be a 1-D int64 (or int32) tensor (T_l,) for this rank's tokens, got {got}")
        if tokens.shape != position_ids.shape:
            raise CPInputError(f"tokens {tuple(tokens.shape)} and position_ids {tuple(position_ids.shape)} must match")
        self._check_windows(cp)
        if tokens.device.type != "cpu" or tokens.numel() == 0:
            return  # range checks only where they cost no host-device synchronisation
        limits = [("tokens", tokens, self.config.vocab_size, "vocab_size")]
        if self.pos_embed is not None:
            table = "max_positions (GPT-2's learned table)"
            limits.append(("position_ids", position_ids, self.config.max_positions, table))
        for name, t, n, what in limits:
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= n:
                raise CPInputError(f"{name} span [{lo}, {hi}] but must lie in [0, {n}), {what}; shorten or re-tokenize")

    def _check_windows(self, cp: CPContext) -> None:
        """Before the first layer: a mode that takes no window would refuse only at the first sliding layer."""
        windows = self.config.layer_windows or ()
        sliding = [layer for layer, left in enumerate(windows) if left is not None]
        if sliding and not MODES[cp.mode].windows:
            takes = [name for name, spec in MODES.items() if spec.windows]
            raise CPInputError(
                f"layers {sliding} of this model attend in a sliding window (layer_windows={windows}), which "
                f"mode={cp.mode!r} does not take yet; run it with a mode that does: {takes}"
            )

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict of this family into the model (cast to its dtype and device).

        Raises:
            CPInputError: listing missing, unexpected and mis-shaped keys; nothing is copied then.
        """
        converted = convert_hf_state_dict(state_dict, self.config, dict(self.named_parameters()))
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(converted[name])


def load_pretrained(directory: str | Path, *, dtype: torch.dtype | None = None):
    """A `CausalLM` built from a Hugging Face checkpoint directory (`config.json` and weights).

    Args:
        directory: what `save_pretrained` wrote (a local directory; nothing is downloaded).
        dtype: cast the loaded model to it; default: the weights land in the model's default
            dtype (`torch.get_default_dtype()`, float32).

    Raises:
        CPInputError: for an unsupported config, missing files, or keys that do not fit.
        ImportError: for `model.safetensors` without the `safetensors` package.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CPInputError(f"{directory} has no config.json; pass the directory save_pretrained wrote")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    model = CausalLM(config)
    model.load_hf_state_dict(read_hf_weights(directory))
    return model if dtype is None else model.to(dtype)
