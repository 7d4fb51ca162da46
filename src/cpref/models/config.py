"""Model configs: one frozen dataclass for the three families, validated when built.

A [`ModelConfig`][cpref.models.config.ModelConfig] names a family and its sizes. What the
family changes (positions, norm, MLP, per-head q/k norm, default biases and tying) is data,
one [`Family`][cpref.models.config.Family] each in `FAMILIES`, so the model code has one
skeleton and reads the differences from the config.

Which layers attend in a sliding window is per layer and independent of the family
(`layer_windows`): Mistral slides in every layer, a Qwen3 checkpoint may mix sliding and full
layers, and by default every layer attends to its whole (causal) document.

Fields left `None` take the family's default in `__post_init__` (`num_kv_heads = num_heads`,
`head_dim = hidden_size / num_heads`, `mlp_size = 4 hidden_size`, and the family's eps, bias
and tying), so a built config is fully explicit: `dataclasses.asdict(config)` round-trips
through `ModelConfig(**d)`. (`dataclasses.replace` keeps those resolved values: give them
again when changing the family or the sizes they derive from.)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cpref.base.checks import as_bool, as_choice, as_int
from cpref.base.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW
from cpref.models.hf_config import hf_fields

__all__ = ["Family", "FAMILIES", "ModelConfig"]


@dataclass(frozen=True)
class Family:
    """What one model family builds; the table of the guide page, as data.

    Attributes:
        positions: `"learned"` (an absolute position table added to the embeddings) or
            `"rope"` (rotary embeddings applied to q and k in every layer).
        norm: `"layernorm"` (with bias) or `"rmsnorm"` (weight only).
        mlp: `"gelu"` (up, GELU with the tanh approximation, down) or `"swiglu"`
            (`down(silu(gate x) * up x)`).
        qk_norm: per-head RMSNorm on q and k (over `head_dim`), before RoPE.
        bias: default of `attention_bias` and `mlp_bias`.
        tie_embeddings: default of `tie_embeddings`.
        norm_eps: default of `norm_eps`.
    """

    positions: str
    norm: str
    mlp: str
    qk_norm: bool
    bias: bool
    tie_embeddings: bool
    norm_eps: float


FAMILIES: dict[str, Family] = {
    "gpt2": Family("learned", "layernorm", "gelu", qk_norm=False, bias=True, tie_embeddings=True, norm_eps=1e-5),
    "llama": Family("rope", "rmsnorm", "swiglu", qk_norm=False, bias=False, tie_embeddings=False, norm_eps=1e-6),
    "qwen3": Family("rope", "rmsnorm", "swiglu", qk_norm=True, bias=False, tie_embeddings=False, norm_eps=1e-6),
}


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) or value <= 0:
        raise CPInputError(f"{name} must be a positive finite number, got {value!r} ({type(value).__name__})")
    return float(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model of one family. Dtype-agnostic: cast the built model with `.to(dtype)`.

    Attributes:
        family: `"gpt2"`, `"llama"` or `"qwen3"`; see `FAMILIES`.
        vocab_size: `V`, rows of the token embedding and columns of the logits.
        hidden_size: `E`, the width of the residual stream.
        num_layers: `L`, the number of blocks.
        num_heads: `Hq`, query heads.
        num_kv_heads: `Hkv`, key/value heads (grouped-query attention when `Hkv < Hq`; it must
            divide `Hq`). Default `Hq` (multi-head attention, as GPT-2).
        head_dim: `D`, the width of one head. Default `E / Hq`; Qwen3 sets it explicitly and it
            may differ (q/k/v project `E -> H D`, the output `Hq D -> E`). RoPE needs it even.
        mlp_size: `F`, the MLP's inner width. Default `4 E` (GPT-2's convention).
        max_positions: GPT-2: rows of the learned position table, so every position id must
            be `< max_positions`. RoPE families have no table; the value is only recorded.
        rope_theta: RoPE's base `theta` (frequencies `theta ** (-2i / D)`); unused by GPT-2.
        norm_eps: epsilon of every LayerNorm / RMSNorm. Default: the family's (1e-5 / 1e-6).
        tie_embeddings: the output projection is the token embedding (no `lm_head`).
            Default: the family's (GPT-2 ties; LLaMA and Qwen3 configs say per checkpoint).
        attention_bias: biases on the q, k, v and output projections. Default: the family's.
        mlp_bias: biases on the MLP's projections. Default: the family's.
        layer_windows: a sliding window per layer, `num_layers` entries: layer `i`'s `left`,
            an int >= 0 (the query at position `p` of a document sees its keys `p - left .. p`,
            `left + 1` of them, itself included: `cpref.attention`'s `window=(left, 0)`), or
            `None` (full causal attention in that layer). Default `None`: no window in any
            layer (a tuple of `None`s is stored as `None`). Hugging Face's `sliding_window = W`
            is `left = W - 1`. Under CP only the modes with `cpref.MODES[mode].windows` take one.
        init_std: standard deviation of the random initial matrices (biases start at 0, norm
            weights at 1).

    Raises:
        CPInputError: on any invalid field, naming it and the fix.

    Examples:
        >>> ModelConfig(family="llama", vocab_size=100, hidden_size=32, num_layers=2, num_heads=4).head_dim
        8
        >>> ModelConfig(family="llama", vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=3)
        Traceback (most recent call last):
        ...
        cpref.base.errors.CPInputError: num_heads=4 is not a multiple of num_kv_heads=3: ...

        A causal window of 4096 keys in the second layer only:

        >>> ModelConfig(family="qwen3", vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
        ...             layer_windows=[None, 4095]).layer_windows
        (None, 4095)
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_size: int | None = None
    max_positions: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    layer_windows: tuple[int | None, ...] | None = None
    init_std: float = 0.02

    def __post_init__(self) -> None:
        as_choice("family", self.family, sorted(FAMILIES))
        spec = FAMILIES[self.family]
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_positions"):
            as_int(name, getattr(self, name), lo=1)
        defaults = {
            "num_kv_heads": self.num_heads,
            "mlp_size": 4 * self.hidden_size,
            "norm_eps": spec.norm_eps,
            "tie_embeddings": spec.tie_embeddings,
            "attention_bias": spec.bias,
            "mlp_bias": spec.bias,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._check_heads()
        as_int("mlp_size", self.mlp_size, lo=1)
        for name in ("rope_theta", "norm_eps", "init_std"):
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        for name in ("tie_embeddings", "attention_bias", "mlp_bias"):
            as_bool(name, getattr(self, name))
        self._check_windows()

    def _check_heads(self) -> None:
        hq = self.num_heads
        hkv = as_int("num_kv_heads", self.num_kv_heads, lo=1)
        if hq % hkv:
            raise CPInputError(
                f"num_heads={hq} is not a multiple of num_kv_heads={hkv}: grouped-query attention shares each "
                f"key/value head among num_heads / num_kv_heads query heads; choose num_kv_heads in {_divisors(hq)}"
            )
        if self.head_dim is None:
            if self.hidden_size % hq:
                raise CPInputError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={hq}, so head_dim has no default; "
                    f"pass head_dim explicitly (Qwen3 does) or choose num_heads in {_divisors(self.hidden_size)}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // hq)
        d = as_int("head_dim", self.head_dim, lo=1)
        if self.spec.positions == "rope" and d % 2:
            raise CPInputError(
                f"head_dim={d} is odd, but RoPE (family {self.family!r}) rotates pairs of dims (i, i + D/2); "
                "choose an even head_dim"
            )

    def _check_windows(self) -> None:
        windows, n = self.layer_windows, self.num_layers
        if windows is None:
            return
        example = f"e.g. {tuple([None] * (n - 1) + [4095])} for a window of 4096 keys in the last layer only"
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence) or len(windows) != n:
            raise CPInputError(
                f"layer_windows={windows!r:.60} must hold one entry per layer (num_layers={n}): the layer's window "
                f"left (an int >= 0: left + 1 keys) or None (full attention); {example}, or None for no window"
            )
        for i, left in enumerate(windows):
            if left is not None and (isinstance(left, bool) or not isinstance(left, numbers.Integral) or left < 0):
                raise CPInputError(
                    f"layer_windows[{i}]={left!r} ({type(left).__name__}) is neither an int >= 0 nor None; give layer "
                    f"{i}'s window left (left + 1 keys, itself included) or None for full attention; {example}"
                )
        lefts = tuple(None if left is None else int(left) for left in windows)
        object.__setattr__(self, "layer_windows", lefts if any(left is not None for left in lefts) else None)

    @property
    def spec(self) -> Family:
        """The family's row of `FAMILIES`."""
        return FAMILIES[self.family]

    def window(self, layer: int) -> tuple[int, int]:
        """Layer `layer`'s `window=(left, right)` for `cpref.attention`: `(left, 0)`, or `(-1, -1)` for none."""
        left = None if self.layer_windows is None else self.layer_windows[layer]
        return NO_WINDOW if left is None else (left, 0)

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> "ModelConfig":
        """The config of a Hugging Face `config.json` (a dict) of GPT2Config, LlamaConfig, Qwen3Config or MistralConfig.

        Sliding windows are read per layer into `layer_windows` (see `cpref.models.hf_config`).

        Raises:
            CPInputError: for another model type, or a feature cpref's models do not implement
                (RoPE scaling, another activation, ...), naming the key.
        """
        return cls(**hf_fields(hf_config))
