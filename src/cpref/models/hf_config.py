"""Hugging Face `config.json` -> the fields of a [`ModelConfig`][cpref.models.config.ModelConfig].

[`ModelConfig.from_hf`][cpref.models.config.ModelConfig.from_hf] builds the config from them;
this module knows Hugging Face's keys and nothing of the config class (no import circle).

Reads the dict of a `GPT2Config`, `LlamaConfig`, `Qwen3Config` or `MistralConfig` as
`save_pretrained` writes it (transformers 4.x keeps `rope_theta` / `rope_scaling` at the top
level, 5.x nests them in `rope_parameters`; both are read). Mistral is the LLaMA family
without biases, with a sliding window in every layer. A key this module does not read cannot
change the forward pass of these models (dropouts, token ids, caching); every key that could
and that cpref's models do not implement is refused by name, never ignored:

| family | refused |
| --- | --- |
| all | `quantization_config` |
| gpt2 | `activation_function` other than the tanh GELU, `scale_attn_weights: false`, `scale_attn_by_inverse_layer_idx`, `add_cross_attention` |
| llama, qwen3, mistral | `hidden_act` other than `silu`, RoPE scaling (`rope_type` other than `default`), `partial_rotary_factor` < 1 |
| qwen3 | a `layer_types` entry other than `full_attention` / `sliding_attention`; `sliding_attention` layers without a window (`use_sliding_window: false` or `sliding_window: null`) |
| mistral | `layer_types` other than every layer's `sliding_attention` (`full_attention` without a window): `MistralForCausalLM` ignores them, alternating layers are another model |

## Sliding windows

Hugging Face's `sliding_window = W` lets a token see the `W` keys up to and including itself
(the mask keeps key `j` for query `i` when `i - W < j <= i`), so it is `left = W - 1` in
`ModelConfig.layer_windows` (`cpref.attention`'s `window=(W - 1, 0)`); the parity tests
check it against the models of transformers 5 at `W` and `W + 1` keys. Which layers slide:

- Qwen3 (as `Qwen3Config` reads the file): the window is `sliding_window` if
  `use_sliding_window`, else none; layer `i` slides where `layer_types[i]` is
  `"sliding_attention"`, and without `layer_types` where `i >= max_window_layers` (the first
  `max_window_layers` layers are full), when there is a window.
- Mistral: every layer slides, unless `sliding_window` is null (every layer full).

Missing optional keys take the defaults of the transformers classes (Mistral's
`sliding_window` 4096, Qwen3's `max_window_layers` 28).
"""

from __future__ import annotations

from typing import Any, Mapping

from cpref.base.checks import as_int
from cpref.base.errors import CPInputError

__all__ = ["hf_fields", "HF_MODEL_TYPES"]

# model_type -> (the transformers config class, its causal-LM class)
HF_MODEL_TYPES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def _refuse_unless(ok: bool, family: str, what: str) -> None:
    if not ok:
        raise CPInputError(f"this {family} config.json uses {what}, which cpref.models does not implement")


def _need(hf: Mapping[str, Any], key: str, family: str) -> Any:
    if hf.get(key) is None:
        raise CPInputError(f"this {family} config.json has no {key!r}; it is required (is the file complete?)")
    return hf[key]


def hf_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a Hugging Face config dict; see the module docstring for what is refused."""
    if not isinstance(hf, Mapping):
        raise CPInputError(f"hf_config must be the dict of a config.json, got {type(hf).__name__}")
    family = hf.get("model_type")
    if family not in HF_MODEL_TYPES:
        known = ", ".join(f"{t} ({cfg})" for t, (cfg, _) in HF_MODEL_TYPES.items())
        raise CPInputError(
            f"config.json has model_type={family!r} (architectures {hf.get('architectures')}); "
            f"cpref.models reads {known}"
        )
    _refuse_unless(hf.get("quantization_config") is None, family, "quantization_config (a quantized checkpoint)")
    if family == "gpt2":
        return _gpt2(hf)
    fields = _rope_family(hf, family)
    num_layers = as_int("num_hidden_layers", fields["num_layers"], lo=1)
    return {**fields, "layer_windows": _layer_windows(hf, family, num_layers)}


def _gpt2(hf: Mapping[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    _refuse_unless(act in GELU_TANH, "gpt2", f"activation_function={act!r} (the MLP here is GELU(tanh): {GELU_TANH})")
    _refuse_unless(hf.get("scale_attn_weights", True), "gpt2", "scale_attn_weights=false (unscaled attention logits)")
    _refuse_unless(not hf.get("scale_attn_by_inverse_layer_idx", False), "gpt2", "scale_attn_by_inverse_layer_idx")
    _refuse_unless(not hf.get("add_cross_attention", False), "gpt2", "add_cross_attention (an encoder-decoder)")
    hidden = _need(hf, "n_embd", "gpt2")
    return dict(
        family="gpt2",
        vocab_size=_need(hf, "vocab_size", "gpt2"),
        hidden_size=hidden,
        num_layers=_need(hf, "n_layer", "gpt2"),
        num_heads=_need(hf, "n_head", "gpt2"),
        mlp_size=hf.get("n_inner") or 4 * hidden,
        max_positions=hf.get("n_positions", 1024),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=True,
        mlp_bias=True,
    )


def _rope_theta(hf: Mapping[str, Any], family: str) -> float:
    """`theta` from `rope_parameters` (transformers 5) or `rope_theta` (4.x), refusing any scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise CPInputError(f"this {family} config.json has per-layer rope parameters {params!r}; one RoPE is supported")
    kind = params.get("rope_type", params.get("type", "default"))
    _refuse_unless(kind == "default", family, f"RoPE scaling rope_type={kind!r} (only plain RoPE, rope_type 'default')")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _refuse_unless(partial == 1.0, family, f"partial_rotary_factor={partial} (RoPE on every dim only)")
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def _rope_family(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    _refuse_unless(act == "silu", family, f"hidden_act={act!r} (the SwiGLU MLP here uses silu)")
    hidden, heads = _need(hf, "hidden_size", family), _need(hf, "num_attention_heads", family)
    head_dim = hf.get("head_dim") or (128 if family == "qwen3" else None)  # Qwen3Config's default is 128
    biased = family != "mistral"  # MistralConfig has no attention_bias / mlp_bias: no biases anywhere
    return dict(
        family="llama" if family == "mistral" else family,
        vocab_size=_need(hf, "vocab_size", family),
        hidden_size=hidden,
        num_layers=_need(hf, "num_hidden_layers", family),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_size=_need(hf, "intermediate_size", family),
        max_positions=hf.get("max_position_embeddings", {"qwen3": 32768, "mistral": 131072}.get(family, 2048)),
        rope_theta=_rope_theta(hf, family),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=biased and hf.get("attention_bias", False),
        mlp_bias=biased and hf.get("mlp_bias", False),
    )


def _layer_windows(hf: Mapping[str, Any], family: str, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's window `left` (`W - 1` for Hugging Face's `sliding_window = W`), None where it is full."""
    if family == "llama":
        return None
    given = hf.get("layer_types")
    if given is not None and (not isinstance(given, (list, tuple)) or len(given) != num_layers
                              or not set(given) <= set(LAYER_TYPES)):  # fmt: skip
        raise CPInputError(
            f"this {family} config.json has layer_types {given!r:.200} for num_hidden_layers={num_layers}; "
            f"cpref.models reads a list of one of {LAYER_TYPES} per layer (other attention kinds are not implemented)"
        )
    if family == "mistral":  # MistralForCausalLM: the window in every layer, whatever layer_types says
        w = hf.get("sliding_window", 4096)
        types = ["full_attention" if w is None else "sliding_attention"] * num_layers
        _refuse_unless(given is None or list(given) == types, family,
                       f"layer_types {list(given or ())} (MistralForCausalLM ignores them and runs {types[0]!r} in "
                       "every layer; alternating layers are another model, e.g. model_type 'ministral')")  # fmt: skip
    else:  # qwen3, as Qwen3Config.__post_init__ reads the file
        w = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        first = as_int("max_window_layers", hf.get("max_window_layers", 28), lo=0)  # the first `first` layers are full
        types = given or [
            "sliding_attention" if w is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    if "sliding_attention" in types and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        switch = f" (use_sliding_window={hf.get('use_sliding_window', False)})" if family == "qwen3" else ""
        raise CPInputError(
            f"this {family} config.json has sliding_attention layers but sliding_window={w!r}{switch}, which is no "
            "window (Hugging Face builds no mask for it); set sliding_window to the window's keys, an int >= 1 (and "
            "use_sliding_window: true for qwen3), or make those layers full_attention"
        )
    return tuple(w - 1 if kind == "sliding_attention" else None for kind in types)
