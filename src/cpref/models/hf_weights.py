"""Hugging Face weights -> cpref's models: file reading, name mapping, strict checks.

[`load_pretrained(directory)`][cpref.models.model.load_pretrained] reads a directory as
`save_pretrained` writes it: `config.json` and the weights, `model.safetensors` (read with the
`safetensors` package, imported only then) or `pytorch_model.bin` (read with
`torch.load(weights_only=True)`, which unpickles tensors and nothing else), either one possibly
sharded with its `*.index.json`.

Each Hugging Face tensor becomes one or more of cpref's parameters:

| Hugging Face (`model.layers.i.` / `transformer.h.i.`) | cpref (`blocks.i.`) | how |
| --- | --- | --- |
| `self_attn.{q,k,v,o}_proj` | `attn.{q,k,v,o}` | as is |
| `self_attn.{q,k}_norm` (Qwen3) | `attn.{q,k}_norm` | as is |
| `mlp.{gate,up,down}_proj` | `mlp.{gate,up,down}` | as is |
| `input_layernorm`, `post_attention_layernorm` | `attn_norm`, `mlp_norm` | as is |
| `attn.c_attn` (GPT-2) | `attn.q`, `attn.k`, `attn.v` | split in three, transposed |
| `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj` (GPT-2) | `attn.o`, `mlp.up`, `mlp.down` | transposed |
| `ln_1`, `ln_2` (GPT-2) | `attn_norm`, `mlp_norm` | as is |

GPT-2's `Conv1D` stores its weight as `(in, out)` where `nn.Linear` stores `(out, in)`, hence
the transposes. With tied embeddings the checkpoint may hold `lm_head.weight` as well; it
must then equal the embedding. A state dict of the base model (`GPT2Model`, `LlamaModel`,
no `transformer.` / `model.` prefix) loads too, and the non-parameter buffers older
checkpoints carry (GPT-2's `attn.bias` / `attn.masked_bias` masks, `rotary_emb.inv_freq`)
are skipped. Anything else that is missing, unexpected or of the wrong shape is an error
that lists every such key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

import torch

from cpref.base.errors import CPInputError
from cpref.models.config import ModelConfig

__all__ = ["read_hf_weights", "convert_hf_state_dict", "hf_rules"]

Convert = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
# In order of preference; an index.json lists the shards of a sharded checkpoint.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")  # fmt: skip
SKIPPED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
LLAMA_PIECES = {  # Hugging Face name inside a layer -> cpref's, for LLaMA and Qwen3
    "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
}  # fmt: skip


def _same(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def _conv1d(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t.t(),)  # Conv1D (in, out) -> Linear (out, in); a bias (out,) stays


def _conv1d_qkv(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # weight (E, 3E) = [q | k | v] -> 3 x (E, E), transposed; bias (3E,) -> 3 x (E,)
    return tuple(part.t() for part in t.chunk(3, dim=-1))


def hf_rules(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], Convert]]:
    """`{hf_name: (cpref_names, convert)}` for every tensor a checkpoint of `config` may hold."""
    rules: dict[str, tuple[tuple[str, ...], Convert]] = {}
    if config.family == "gpt2":
        rules["transformer.wte.weight"] = (("embed.weight",), _same)
        rules["transformer.wpe.weight"] = (("pos_embed.weight",), _same)
        for p in ("weight", "bias"):
            rules[f"transformer.ln_f.{p}"] = ((f"norm.{p}",), _same)
            for i in range(config.num_layers):
                hf, me = f"transformer.h.{i}.", f"blocks.{i}."
                rules[f"{hf}ln_1.{p}"] = ((f"{me}attn_norm.{p}",), _same)
                rules[f"{hf}ln_2.{p}"] = ((f"{me}mlp_norm.{p}",), _same)
                rules[f"{hf}attn.c_attn.{p}"] = (tuple(f"{me}attn.{n}.{p}" for n in "qkv"), _conv1d_qkv)
                rules[f"{hf}attn.c_proj.{p}"] = ((f"{me}attn.o.{p}",), _conv1d)
                rules[f"{hf}mlp.c_fc.{p}"] = ((f"{me}mlp.up.{p}",), _conv1d)
                rules[f"{hf}mlp.c_proj.{p}"] = ((f"{me}mlp.down.{p}",), _conv1d)
    else:
        rules["model.embed_tokens.weight"] = (("embed.weight",), _same)
        rules["model.norm.weight"] = (("norm.weight",), _same)
        for i in range(config.num_layers):
            for hf, me in LLAMA_PIECES.items():
                for p in ("weight", "bias"):
                    rules[f"model.layers.{i}.{hf}.{p}"] = ((f"blocks.{i}.{me}.{p}",), _same)
    rules["lm_head.weight"] = (("lm_head.weight",), _same)
    return rules


def _with_prefix(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A base model's state dict (no `transformer.` / `model.` prefix) as the causal LM's."""
    base = "transformer." if config.family == "gpt2" else "model."
    if any(name.startswith(base) for name in state_dict):
        return dict(state_dict)
    return {name if name == "lm_head.weight" else base + name: t for name, t in state_dict.items()}


def convert_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: ModelConfig, params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face state dict onto `params` (cpref's names and shapes): `{cpref_name: tensor}`.

    Raises:
        CPInputError: listing every missing, unexpected or mis-shaped key.
    """
    if not isinstance(state_dict, Mapping) or not all(isinstance(t, torch.Tensor) for t in state_dict.values()):
        raise CPInputError(f"state_dict must map names to tensors, got {type(state_dict).__name__}")
    sd = {name: t for name, t in _with_prefix(state_dict, config).items() if not name.endswith(SKIPPED)}
    embed_key = "transformer.wte.weight" if config.family == "gpt2" else "model.embed_tokens.weight"
    if config.tie_embeddings and "lm_head.weight" in sd:
        head = sd.pop("lm_head.weight")
        if embed_key in sd and not torch.equal(head, sd[embed_key]):
            raise CPInputError(f"tie_word_embeddings is true but lm_head.weight differs from {embed_key}; "
                               "set tie_word_embeddings to false in config.json")
    rules, out, unexpected, wrong = hf_rules(config), {}, [], []
    for name, t in sd.items():
        targets, convert = rules.get(name, ((), _same))
        if not targets or any(n not in params for n in targets):
            unexpected.append(name)
            continue
        for target, part in zip(targets, convert(t)):
            if tuple(part.shape) != tuple(params[target].shape):
                wrong.append(f"{name} -> {target}: {tuple(part.shape)}, expected {tuple(params[target].shape)}")
            out[target] = part
    missing = [n for n in params if n not in out]
    if missing or unexpected or wrong:
        lines = [f"  {what}: {', '.join(names)}" for what, names in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]  # fmt: skip
        raise CPInputError(
            f"the state dict does not fit this {config.family} model (config {config}):\n" + "\n".join(lines)
            + "\nDoes config.json belong to these weights?"
        )
    return out


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ImportError(
            f"reading {path.name} needs the safetensors package (a dependency of cpref: pip install safetensors), "
            "or save the checkpoint as pytorch_model.bin"
        ) from None
    return load_file(str(path))


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a `save_pretrained` directory (safetensors first, then torch's format), on CPU."""
    directory = Path(directory)
    found = [name for name in WEIGHT_FILES if (directory / name).is_file()]
    if not found:
        raise CPInputError(f"{directory} holds none of {list(WEIGHT_FILES)}; pass the directory save_pretrained wrote")
    name = found[0]
    files = [name]
    if name.endswith(".index.json"):
        files = sorted(set(json.loads((directory / name).read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        path = directory / file
        if file.endswith(".safetensors"):
            state.update(_safetensors_load(path))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state
