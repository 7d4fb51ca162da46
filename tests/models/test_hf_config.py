"""`ModelConfig.from_hf`: Hugging Face config dicts of both transformers generations map, the rest is refused by name.

The dicts are written out here (as `save_pretrained` writes them), so these tests need no
`transformers`.
"""

from __future__ import annotations

import pytest

import cpref
from cpref.models import ModelConfig

GPT2 = {
    "model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": None,
    "n_positions": 128, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True,
}  # fmt: skip
LLAMA_V5 = {
    "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048,
}  # fmt: skip
LLAMA_V4 = {**{k: v for k, v in LLAMA_V5.items() if k not in ("rope_parameters", "head_dim")},
            "rope_theta": 500000.0, "rope_scaling": None}  # fmt: skip
QWEN3 = {**LLAMA_V5, "model_type": "qwen3", "head_dim": 24, "use_sliding_window": False, "sliding_window": None,
         "layer_types": ["full_attention", "full_attention"], "tie_word_embeddings": True}  # fmt: skip

QWEN3_SLIDING = {**QWEN3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28,
                 "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
MISTRAL = {**{k: v for k, v in LLAMA_V5.items() if k not in ("attention_bias", "mlp_bias")},
           "model_type": "mistral", "sliding_window": 8}  # fmt: skip


def test_gpt2():
    c = ModelConfig.from_hf(GPT2)
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gpt2", 64, 2, 4, 4, 16)
    assert (c.mlp_size, c.max_positions, c.tie_embeddings, c.attention_bias, c.mlp_bias) == (256, 128, True, True, True)


@pytest.mark.parametrize("hf", [LLAMA_V5, LLAMA_V4], ids=["transformers-5", "transformers-4"])
def test_llama_from_either_generation(hf):
    c = ModelConfig.from_hf(hf)
    assert (c.family, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_size) == ("llama", 4, 2, 16, 96)
    assert (c.rope_theta, c.norm_eps, c.tie_embeddings, c.attention_bias) == (500000.0, 1e-6, False, False)


def test_qwen3_keeps_its_explicit_head_dim_and_tying():
    c = ModelConfig.from_hf(QWEN3)
    assert (c.family, c.head_dim, c.tie_embeddings, c.spec.qk_norm) == ("qwen3", 24, True, True)
    without = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert ModelConfig.from_hf(without).head_dim == 128  # Qwen3Config's default


def test_qwen3_sliding_windows_are_read_as_qwen3config_reads_them():
    """A window of `W` keys is `left = W - 1`; `layer_types` says which layers slide, else `max_window_layers`."""
    assert ModelConfig.from_hf(QWEN3_SLIDING).layer_windows == (7, None)
    inferred = {k: v for k, v in QWEN3_SLIDING.items() if k != "layer_types"}
    assert ModelConfig.from_hf({**inferred, "max_window_layers": 1}).layer_windows == (None, 7)  # layers >= 1 slide
    assert ModelConfig.from_hf(inferred).layer_windows is None  # max_window_layers 28 >= both layers: none slides
    assert ModelConfig.from_hf({**inferred, "max_window_layers": 0, "sliding_window": None}).layer_windows is None
    off = {**inferred, "use_sliding_window": False, "max_window_layers": 0}  # the switch off: sliding_window unused
    assert ModelConfig.from_hf(off).layer_windows is None
    assert ModelConfig.from_hf({**QWEN3, "sliding_window": 4096}).layer_windows is None


def test_mistral_is_llama_with_a_window_in_every_layer():
    c = ModelConfig.from_hf(MISTRAL)
    assert (c.family, c.num_kv_heads, c.head_dim, c.layer_windows) == ("llama", 2, 16, (7, 7))
    assert not c.attention_bias and not c.mlp_bias
    assert ModelConfig.from_hf({**MISTRAL, "attention_bias": True}).attention_bias is False  # MistralConfig has none
    assert ModelConfig.from_hf({**MISTRAL, "sliding_window": None}).layer_windows is None
    assert ModelConfig.from_hf({k: v for k, v in MISTRAL.items() if k != "sliding_window"}).layer_windows == (4095,) * 2
    assert ModelConfig.from_hf({**MISTRAL, "layer_types": ["sliding_attention"] * 2}).layer_windows == (7, 7)
    defaults = {k: v for k, v in MISTRAL.items() if k not in ("max_position_embeddings", "head_dim")}
    assert (ModelConfig.from_hf(defaults).max_positions, ModelConfig.from_hf(defaults).head_dim) == (131072, 16)


REFUSED = [
    ({"model_type": "gemma2"}, "model_type='gemma2'.*reads gpt2 \\(GPT2Config\\), llama \\(LlamaConfig\\), qwen3.*mistral"),
    ({**GPT2, "activation_function": "relu"}, "activation_function='relu'"),
    ({**GPT2, "scale_attn_weights": False}, "scale_attn_weights=false"),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2, "add_cross_attention": True}, "add_cross_attention"),
    ({**LLAMA_V4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling rope_type='linear'"),
    ({**LLAMA_V5, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({**LLAMA_V5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({**LLAMA_V5, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**LLAMA_V5, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({**QWEN3, "layer_types": ["full_attention", "sliding_attention"]},
     "sliding_attention layers but sliding_window=None \\(use_sliding_window=False\\).*use_sliding_window: true"),
    ({**QWEN3_SLIDING, "sliding_window": 0}, "sliding_window=0 .*an int >= 1"),
    ({**QWEN3_SLIDING, "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types \\['full_attention', 'chunked_attention'\\] for num_hidden_layers=2.*other attention kinds"),
    ({**QWEN3_SLIDING, "layer_types": ["sliding_attention"]}, "for num_hidden_layers=2"),
    ({**MISTRAL, "layer_types": ["full_attention", "sliding_attention"]},
     "MistralForCausalLM ignores them and runs 'sliding_attention' in every layer.*ministral"),
    ({**MISTRAL, "sliding_window": 8.0}, "sliding_window=8.0"),
    ({k: v for k, v in LLAMA_V5.items() if k != "hidden_size"}, "has no 'hidden_size'; it is required"),
    ({**LLAMA_V5, "num_attention_heads": 3}, "num_heads=3 is not a multiple of num_kv_heads=2"),
]


@pytest.mark.parametrize("hf, match", REFUSED, ids=range(len(REFUSED)))
def test_unsupported_features_are_refused_by_name(hf, match):
    with pytest.raises(cpref.CPInputError, match=match):
        ModelConfig.from_hf(hf)


def test_a_non_dict_is_refused():
    with pytest.raises(cpref.CPInputError, match="hf_config must be the dict of a config.json, got str"):
        ModelConfig.from_hf("config.json")
