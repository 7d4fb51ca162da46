"""Hugging Face `config.json` -> the fields of a [`ModelConfig`][cpref.models.config.ModelConfig].

[`ModelConfig.from_hf`][cpref.models.config.ModelConfig.from_hf] builds the config from them;
this module knows Hugging Face's keys and nothing of the config class (no import circle).

Reads the dict of a `GPT2Config`, `LlamaConfig` or `Qwen3Config` as `save_pretrained` writes
it (transformers 4.x keeps `rope_theta` / `rope_scaling` at the top level, 5.x nests them in
`rope_parameters`; both are read). A key this module does not read cannot change the forward
pass of these models (dropouts, token ids, caching); every key that could and that cpref's
models do not implement is refused by name, never ignored:

| family | refused |
| --- | --- |
| all | `quantization_config` |
| gpt2 | `activation_function` other than the tanh GELU, `scale_attn_weights: false`, `scale_attn_by_inverse_layer_idx`, `add_cross_attention` |
| llama, qwen3 | `hidden_act` other than `silu`, RoPE scaling (`rope_type` other than `default`), `partial_rotary_factor` < 1 |
| qwen3 | sliding windows (`use_sliding_window`, a `sliding_attention` layer type) |

Missing optional keys take the defaults of the transformers classes.
"""

from __future__ import annotations

from typing import Any, Mapping

from cpref.errors import CPInputError

__all__ = ["hf_fields", "HF_MODEL_TYPES"]

# model_type -> (the transformers config class, its causal-LM class)
HF_MODEL_TYPES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
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
    return _gpt2(hf) if family == "gpt2" else _rope_family(hf, family)


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
    if family == "qwen3":
        _refuse_unless(not hf.get("use_sliding_window", False), family, "use_sliding_window (sliding-window attention)")
        kinds = sorted(set(hf.get("layer_types") or ["full_attention"]))
        _refuse_unless(kinds == ["full_attention"], family, f"layer_types {kinds} (full attention in every layer only)")
    hidden, heads = _need(hf, "hidden_size", family), _need(hf, "num_attention_heads", family)
    head_dim = hf.get("head_dim") or (128 if family == "qwen3" else None)  # Qwen3Config's default is 128
    return dict(
        family=family,
        vocab_size=_need(hf, "vocab_size", family),
        hidden_size=hidden,
        num_layers=_need(hf, "num_hidden_layers", family),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_size=_need(hf, "intermediate_size", family),
        max_positions=hf.get("max_position_embeddings", 32768 if family == "qwen3" else 2048),
        rope_theta=_rope_theta(hf, family),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
    )
