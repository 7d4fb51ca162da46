"""Hugging Face interop: checkpoints of the three families and Mistral load, and give Hugging Face's logits.

For each family a small random `transformers` model (2 layers, hidden 64, 4 heads; 2 kv heads
for LLaMA and Qwen3; Qwen3 with head_dim 24 != 64 / 4 and tied embeddings; one LLaMA with
every bias) is saved as `model.safetensors` (`save_pretrained`) and as `pytorch_model.bin`
(`torch.save` of its state dict, the older format), loaded with `load_pretrained`, and run on
one document at CP = 1: the logits equal Hugging Face's in fp32 within 1e-5. Then each
document of a pack gives Hugging Face's logits of that document alone, and bad state dicts
are refused with every offending key listed.

Two cases have sliding windows of `W = 8` keys, shorter than the documents (33 tokens; a pack
of 9, 1 and 17): Qwen3 with a sliding and a full layer (`layer_types`), and Mistral (every
layer). They check Hugging Face's convention too: `W` keys, the token itself included, is
`left = W - 1`; the same weights with `W + 1` keys, or without the window, give other logits.

`transformers` is a test extra (`pip install -e ".[dev]"`); without it these tests skip.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import cpref
from cpref.models import CausalLM, CPContext, ModelConfig, load_pretrained, read_hf_weights
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, T = 300, 33
W = 8  # Hugging Face's sliding_window: keys per query, itself included
COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
THETA_5E4 = {"rope_type": "default", "rope_theta": 5e4}
ROPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CASES = {  # name -> (config class, model class, config kwargs)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_positions=64, n_embd=64, n_layer=2, n_head=4)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(**ROPE, rope_parameters=THETA_5E4)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(**ROPE, attention_bias=True, mlp_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(**ROPE, head_dim=24, tie_word_embeddings=True)),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM", dict(**ROPE, head_dim=24, use_sliding_window=True,
                      sliding_window=W, layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(**ROPE, sliding_window=W)),
}
SLIDING = ("qwen3-sliding", "mistral")


def hf_model(name: str):
    """`random_hf_model` of one of the `CASES`."""
    config_cls, model_cls, kw = CASES[name]
    return random_hf_model(model_cls, getattr(transformers, config_cls)(**COMMON, **kw))


def random_hf_model(model_cls: str, config):
    """A random fp32 Hugging Face model in eval mode; weights ~ N(0, 0.1^2), norm weights ~ 1 + N(0, 0.1^2)."""
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            one = 1.0 if p.dim() == 1 and pname.endswith("weight") else 0.0  # norm weights
            p.copy_(one + 0.1 * torch.randn(p.shape, generator=g))
    return model


def from_memory(hf) -> CausalLM:
    """`load_pretrained` without files: the config dict and the state dict in memory."""
    model = CausalLM(ModelConfig.from_hf(hf.config.to_dict()))
    model.load_hf_state_dict(hf.state_dict())
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    """`(name, hf_model, {format: directory})`: the model saved in both formats."""
    model = hf_model(request.param)
    dirs = {fmt: tmp_path_factory.mktemp(f"{request.param}-{fmt}") for fmt in ("safetensors", "bin")}
    model.save_pretrained(dirs["safetensors"])
    model.config.save_pretrained(dirs["bin"])
    torch.save(model.state_dict(), dirs["bin"] / "pytorch_model.bin")
    return request.param, model, dirs


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]  # (T, V), positions 0..T-1


def tokens_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_logits_equal_hugging_faces_on_one_document(saved, fmt):
    name, hf, dirs = saved
    weights = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}[fmt]
    assert weights in {p.name for p in dirs[fmt].iterdir()}
    model = load_pretrained(dirs[fmt]).eval()
    tokens = tokens_of(T)
    with torch.no_grad():
        ours = model(tokens, torch.arange(T), CPContext.single([0, T]))
    assert_close(ours, hf_logits(hf, tokens), torch.float32, msg=f"{name} from {fmt}")


def test_each_packed_document_gives_hugging_faces_logits_alone(saved):
    name, hf, dirs = saved
    model = load_pretrained(dirs["safetensors"]).eval()
    lengths = [9, 1, 17]
    cu = torch.tensor([0, 9, 10, 27])
    tokens = tokens_of(27, seed=1)
    with torch.no_grad():
        single = CPContext.single(cu)
        ours = model(tokens, single.sharding.positions(0), single)
    for a, n in zip(cu[:-1].tolist(), lengths):
        assert_close(ours[a : a + n], hf_logits(hf, tokens[a : a + n]), torch.float32, msg=f"{name} document at {a}")


def test_a_base_model_state_dict_and_float64_load(saved):
    name, hf, dirs = saved
    prefix = "transformer." if name == "gpt2" else "model."
    tied = hf.config.tie_word_embeddings
    base = {k.removeprefix(prefix): v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    model = load_pretrained(dirs["bin"], dtype=torch.float64)
    model.load_hf_state_dict(base)  # the base model's names, and a tied checkpoint without lm_head.weight
    embed = base["wte.weight" if name == "gpt2" else "embed_tokens.weight"]
    assert model.embed.weight.dtype == torch.float64
    assert torch.equal(model.embed.weight, embed.double())


def logits_with_windows(hf, layer_windows, tokens: torch.Tensor) -> torch.Tensor:
    """Our logits `(T, V)` of one document with `hf`'s weights and the given `layer_windows`."""
    config = dataclasses.replace(ModelConfig.from_hf(hf.config.to_dict()), layer_windows=layer_windows)
    model = CausalLM(config)
    model.load_hf_state_dict(hf.state_dict())
    with torch.no_grad():
        return model.eval()(tokens, torch.arange(tokens.numel()), CPContext.single([0, tokens.numel()]))


@pytest.mark.parametrize("name", SLIDING)
def test_a_window_of_w_keys_is_left_w_minus_1(name):
    """Only `left = W - 1` gives Hugging Face's logits: one key more, one less or no window do not, so the
    parity of the sliding cases above is the window's, not an accident of short documents."""
    hf = hf_model(name)
    windows = ModelConfig.from_hf(hf.config.to_dict()).layer_windows
    assert windows == {"qwen3-sliding": (W - 1, None), "mistral": (W - 1, W - 1)}[name]
    tokens = tokens_of(T)
    want = hf_logits(hf, tokens)
    assert_close(logits_with_windows(hf, windows, tokens), want, torch.float32, msg=name)
    for shift in (1, -1):  # W + 1 and W - 1 keys
        other = tuple(None if left is None else left + shift for left in windows)
        assert not torch.allclose(logits_with_windows(hf, other, tokens), want, atol=1e-3), f"{name} {other}"
    assert not torch.allclose(logits_with_windows(hf, None, tokens), want, atol=1e-3), f"{name} without a window"
    short = tokens[:W]  # a document no longer than the window: the window changes nothing
    assert_close(logits_with_windows(hf, None, short), hf_logits(hf, short), torch.float32, msg=f"{name} short")


def test_qwen3_max_window_layers_slides_the_layers_from_it_on():
    """Without `layer_types` in the file (transformers 4's Qwen3Config wrote none), layers `>= max_window_layers`
    slide: read so, the logits are those of Hugging Face's model, whose config derived its own `layer_types`."""
    config = transformers.Qwen3Config(**COMMON, **ROPE, head_dim=24, use_sliding_window=True, sliding_window=W,
                                      max_window_layers=1)  # fmt: skip
    assert config.layer_types == ["full_attention", "sliding_attention"]
    hf = random_hf_model("Qwen3ForCausalLM", config)
    windows = ModelConfig.from_hf({k: v for k, v in config.to_dict().items() if k != "layer_types"}).layer_windows
    assert windows == (None, W - 1)
    tokens = tokens_of(T, seed=2)
    want = hf_logits(hf, tokens)
    assert_close(logits_with_windows(hf, windows, tokens), want, torch.float32)
    assert not torch.allclose(logits_with_windows(hf, (W - 1, None), tokens), want, atol=1e-3)  # the other layer


def test_bad_state_dicts_are_refused_listing_every_key():
    hf = hf_model("llama")
    model = from_memory(hf)
    sd = dict(hf.state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # the config has no attention bias
    sd["model.extra.weight"] = torch.zeros(3)
    sd["model.norm.weight"] = torch.ones(63)
    before = model.embed.weight.clone()
    with pytest.raises(cpref.CPInputError) as err:
        model.load_hf_state_dict(sd)
    msg = str(err.value)
    assert "missing: blocks.1.mlp.up.weight" in msg
    assert "unexpected: model.layers.0.self_attn.q_proj.bias, model.extra.weight" in msg
    assert "wrong shape: model.norm.weight -> norm.weight: (63,), expected (64,)" in msg
    assert torch.equal(model.embed.weight, before)  # nothing copied


def test_a_tied_head_that_differs_from_the_embedding_is_refused():
    hf = hf_model("qwen3")
    model = from_memory(hf)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"] += 1
    with pytest.raises(cpref.CPInputError, match="tie_word_embeddings is true but lm_head.weight differs"):
        model.load_hf_state_dict(sd)


def test_sharded_checkpoints_load(tmp_path):
    hf = hf_model("gpt2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = tokens_of(T)
    with torch.no_grad():
        ours = load_pretrained(tmp_path)(tokens, torch.arange(T), CPContext.single([0, T]))
    assert_close(ours, hf_logits(hf, tokens), torch.float32)


def test_missing_files_and_a_missing_safetensors_package_are_clear(tmp_path, monkeypatch):
    with pytest.raises(cpref.CPInputError, match="has no config.json"):
        load_pretrained(tmp_path)
    with pytest.raises(cpref.CPInputError, match="holds none of .*model.safetensors"):
        read_hf_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="needs the safetensors package .*pip install safetensors.*pytorch_model.bin"):
        read_hf_weights(tmp_path)
