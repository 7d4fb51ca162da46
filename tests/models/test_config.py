"""Configs, contexts and forward inputs are validated early, with errors that name the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpref
from cpref.models import FAMILIES, CausalLM, CPContext, ModelConfig
from tests.models.cases import tiny_config

BASE = dict(family="llama", vocab_size=100, hidden_size=32, num_layers=2, num_heads=4)

BAD_CONFIGS = [
    (dict(family="gpt3"), "unknown family 'gpt3'"),
    (dict(vocab_size=0), r"vocab_size=0 is outside \[1, inf\)"),
    (dict(hidden_size=32.0), "hidden_size must be an int, got 32.0 .* pass 32"),
    (dict(num_layers=True), "num_layers must be an int"),
    (dict(num_heads=0), "num_heads=0 is outside"),
    (dict(num_kv_heads=3), r"num_heads=4 is not a multiple of num_kv_heads=3.*choose num_kv_heads in \[1, 2, 4\]"),
    (dict(num_kv_heads=0), "num_kv_heads=0 is outside"),
    (dict(hidden_size=30), r"hidden_size=30 is not divisible by num_heads=4.*pass head_dim explicitly"),
    (dict(head_dim=15), "head_dim=15 is odd, but RoPE"),
    (dict(family="qwen3", head_dim=0), "head_dim=0 is outside"),
    (dict(mlp_size=-1), "mlp_size=-1 is outside"),
    (dict(max_positions=0), "max_positions=0 is outside"),
    (dict(rope_theta=0.0), "rope_theta must be a positive finite number, got 0.0"),
    (dict(norm_eps=float("nan")), "norm_eps must be a positive finite number"),
    (dict(init_std="0.02"), "init_std must be a positive finite number, got '0.02' .str."),
    (dict(tie_embeddings="yes"), "tie_embeddings must be True or False"),
    (dict(attention_bias=1), "attention_bias must be True or False"),
    (dict(mlp_bias=None, attention_bias=0), "attention_bias must be True or False"),
    (dict(layer_windows=(3,)), r"layer_windows=\(3,\) must hold one entry per layer \(num_layers=2\).*\(None, 4095\)"),
    (dict(layer_windows="full"), "layer_windows='full' must hold one entry per layer"),
    (dict(layer_windows=(None, -1)), r"layer_windows\[1\]=-1 \(int\) is neither an int >= 0 nor None; give layer 1"),
    (dict(layer_windows=(3.0, None)), r"layer_windows\[0\]=3.0 \(float\) is neither"),
    (dict(layer_windows=(True, None)), r"layer_windows\[0\]=True \(bool\) is neither"),
]


@pytest.mark.parametrize("overrides, match", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_bad_configs_are_refused_by_name(overrides, match):
    with pytest.raises(cpref.CPInputError, match=match):
        ModelConfig(**{**BASE, **overrides})


def test_layer_windows_are_stored_canonical():
    """A list becomes a tuple; no window in any layer is `None`; each layer's window is cpref.attention's."""
    config = ModelConfig(**BASE, layer_windows=[None, 7])
    assert config.layer_windows == (None, 7)
    assert (config.window(0), config.window(1)) == ((-1, -1), (7, 0))
    assert ModelConfig(**dataclasses.asdict(config)) == config
    assert ModelConfig(**BASE, layer_windows=(None, None)) == ModelConfig(**BASE)
    assert ModelConfig(**BASE, layer_windows=(0, 0)).window(1) == (0, 0)  # a window of one key: the token itself


def test_gpt2_style_may_use_an_odd_head_dim():
    assert ModelConfig(**{**BASE, "family": "gpt2", "hidden_size": 45, "num_heads": 3}).head_dim == 15


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_defaults_are_the_familys_and_a_config_round_trips(family):
    config = ModelConfig(**{**BASE, "family": family})
    spec = FAMILIES[family]
    assert (config.num_kv_heads, config.head_dim, config.mlp_size) == (4, 8, 128)
    assert (config.norm_eps, config.tie_embeddings) == (spec.norm_eps, spec.tie_embeddings)
    assert config.attention_bias == config.mlp_bias == spec.bias
    assert ModelConfig(**dataclasses.asdict(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3


class NotAComm:
    rank, size = 0, 1


FOUR = cpref.Sharding([0, 4], cp_size=1)  # one document of 4 tokens, without CP


BAD_CONTEXTS = [
    (dict(comm=None), "comm must be the CP group's collectives .*CPContext.single"),
    (dict(comm=NotAComm()), r"comm must be the CP group's collectives \(a cpref.Collectives\), got NotAComm"),
    (dict(mode="ring"), "unknown mode 'ring'"),
    (dict(sharding=[0, 4]), "the batch must be described by a cpref.Sharding, got list"),
    (dict(sharding=cpref.Sharding([0, 4], cp_size=2)), "sharded over cp_size=2 .* but the communicator has 1 ranks"),
    (dict(causal="yes"), "causal must be True or False"),
    (dict(options=[("a2a_size", 2)]), "options must be a dict"),
    (dict(options={"softmax_scale": 0.5}), r"options \['softmax_scale'\] are not keyword options.*head_dim \*\* -0.5"),
]


@pytest.mark.parametrize("overrides, match", BAD_CONTEXTS, ids=[m.split()[0] for _, m in BAD_CONTEXTS])
def test_bad_contexts_are_refused(overrides, match):
    kw = dict(comm=cpref.SingleRank(), sharding=FOUR, mode="all_gather")
    with pytest.raises(cpref.CPInputError, match=match):
        CPContext(**{**kw, **overrides})


def test_a_bad_layout_is_refused_where_it_enters():
    """The layout is the sharding's (the one that sharded the tokens): it is refused when the `Sharding` is built."""
    with pytest.raises(cpref.CPInputError, match="unknown layout 'striped'"):
        cpref.Sharding([0, 4], cp_size=1, layout="striped")


def test_context_options_are_read_only_and_single_is_cp1():
    options = {"a2a_size": 2}
    cp = CPContext(comm=cpref.SingleRank(), sharding=FOUR, mode="a2a+p2p", options=options)
    options["a2a_size"] = 4  # the caller's dict: copied, not shared
    assert cp.options["a2a_size"] == 2
    with pytest.raises(TypeError):
        cp.options["a2a_size"] = 4
    single = CPContext.single([0, 3])
    assert (single.cp_size, single.sharding.cp_size, single.mode) == (1, 1, "all_gather")
    assert single.sharding.local_chunks(0) == [(0, 0, 3)]  # the one rank holds the (odd) document whole, in place
    assert not single.sharding.bounds.is_padded and single.kernel is None


def test_a_mode_option_given_to_another_mode_fails_at_the_first_attention():
    model = CausalLM(tiny_config("llama"))
    cp = CPContext(comm=cpref.SingleRank(), sharding=FOUR, mode="p2p", options={"a2a_size": 2})
    with pytest.raises(cpref.CPInputError, match="a2a_size=2 is only used by mode a2a\\+p2p"):
        model(torch.arange(4), torch.arange(4), cp)


BAD_INPUTS = [
    (lambda t, p, cp: (t.float(), p, cp), "tokens must be a 1-D int64 \\(or int32\\) tensor"),
    (lambda t, p, cp: (t[None], p, cp), "tokens must be a 1-D int64 .*got \\(1, 6\\)"),
    (lambda t, p, cp: (t, p[:5], cp), "tokens \\(6,\\) and position_ids \\(5,\\) must match"),
    (lambda t, p, cp: (t, p, [0, 6]), "cp must be a cpref.models.CPContext, got list"),
    (lambda t, p, cp: (t + 64, p, cp), r"tokens span \[64, 69\] but must lie in \[0, 64\), vocab_size"),
    (lambda t, p, cp: (t, p + 60, cp), r"position_ids span \[60, 65\] but must lie in \[0, 64\), max_positions"),
]


@pytest.mark.parametrize("make, match", BAD_INPUTS, ids=range(len(BAD_INPUTS)))
def test_bad_forward_inputs_are_refused(make, match):
    model = CausalLM(tiny_config("gpt2"))
    with pytest.raises(cpref.CPInputError, match=match):
        model(*make(torch.arange(6), torch.arange(6), CPContext.single([0, 6])))


def test_shards_of_the_wrong_size_are_refused_by_attention():
    model = CausalLM(tiny_config("qwen3"))
    with pytest.raises(cpref.CPInputError, match="q/k/v hold 6/6/6 tokens but this rank's shard of 8"):
        model(torch.arange(6), torch.arange(6), CPContext.single([0, 8]))
