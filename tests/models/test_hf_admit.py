"""Which Hugging Face models cpref runs, decided when the model is built (`cpref.hf.admit`).

Tiny random models of the families whose attention cpref cannot compute, or whose own code reads a token by
its index in the sequence: each built with `attn_implementation="cpref"` is refused there (or at its first
forward, where only the built layers tell), naming the class and why, instead of computing something else.
On main Llama 4's chunked layers ran as full causal attention (logits 120% off) and StableLm was refused only
at its first forward, blaming a missing `cp=`. A Llama 4 text model whose layers are all full, without
temperature tuning, runs and gives Hugging Face's logits; the wrapped method answers every other name as before.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cpref
import cpref.hf
from sim import SimCluster
from tests.helpers import assert_close
from tests.models.test_hf_parity import random_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
LLAMA4 = dict(TINY, num_hidden_layers=4, intermediate_size_mlp=96, num_local_experts=2, head_dim=16)


def built(model_cls: str, config_cls: str, **kw):
    cpref.hf.register()
    config = getattr(transformers, config_cls)(**kw, attn_implementation=cpref.hf.NAME)
    return getattr(transformers, model_cls)(config)


@pytest.mark.parametrize("model_cls, config_cls, kw, match", [
    ("StableLmForCausalLM", "StableLmConfig", dict(TINY), "StableLmForCausalLM cannot run attn_implementation='cpref': "
     "its attention layers do not hand the forward's keyword arguments on"),
    ("LlamaForSequenceClassification", "LlamaConfig", dict(TINY), "its head \\(ForSequenceClassification\\) reads "
     "tokens by their index"),
    ("BertForQuestionAnswering", "BertConfig", dict(TINY), "its head \\(ForQuestionAnswering\\)"),
    ("Llama4ForCausalLM", "Llama4TextConfig", dict(LLAMA4, layer_types=["full_attention"] * 4),
     "attention temperature tuning \\(attn_temperature_tuning=True, on the NoPE layers \\[3\\]\\)"),
    ("Lfm2ForCausalLM", "Lfm2Config", dict(TINY, full_attn_idxs=[1]), "'conv' \\(layers 0\\)"),
    ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", dict(TINY, num_hidden_layers=3, lru_width=64),
     "'linear_attention' \\(layers 0, 1\\)"),
    ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(TINY), "_supports_attention_backend = False"),
])  # fmt: skip
def test_a_model_cpref_cannot_run_is_refused_when_built(model_cls, config_cls, kw, match):
    with pytest.raises(cpref.CPInputError, match=match):
        built(model_cls, config_cls, **kw)


def test_from_pretrained_and_set_attn_implementation_are_checked_too(tmp_path):
    """The two other ways a model gets the name: loading with it, and switching an eager model to it."""
    config = transformers.StableLmConfig(**TINY)
    transformers.StableLmForCausalLM(config).save_pretrained(tmp_path)
    cpref.hf.register()
    with pytest.raises(cpref.CPInputError, match="StableLmForCausalLM cannot run"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=cpref.hf.NAME)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert not eager._forward_pre_hooks  # other names: answered as before, no check installed
    with pytest.raises(cpref.CPInputError, match="StableLmForCausalLM cannot run"):
        eager.set_attn_implementation(cpref.hf.NAME)


@pytest.mark.parametrize("model_cls, config_cls, kw, match", [
    ("BertModel", "BertConfig", dict(TINY, max_position_embeddings=32), r"its pooler \(pooler\) reads the first token"),
])  # fmt: skip
def test_layers_only_a_built_model_shows_are_refused_at_its_first_forward(model_cls, config_cls, kw, match):
    model = built(model_cls, config_cls, **kw).eval()
    cp = cpref.hf.CP(cpref.SingleRank(), cpref.Sharding([0, 8], cp_size=1))
    with pytest.raises(cpref.CPInputError, match=match):
        model(torch.ones(1, 8, dtype=torch.long), cp=cp)


def test_a_llama4_text_model_with_full_layers_and_no_temperature_tuning_gives_hugging_faces_logits():
    """Llama 4 with every layer full and attn_temperature_tuning off (a NoPE layer stays): CP = 2 and 4 over its
    MoE layers give the logits of Hugging Face's eager attention on each document alone."""
    cpref.hf.register()
    kw = dict(LLAMA4, layer_types=["full_attention"] * 4, attn_temperature_tuning=False, pad_token_id=0)
    ref = random_hf_model("Llama4ForCausalLM", transformers.Llama4TextConfig(**kw, attn_implementation="eager"))
    base = random_hf_model("Llama4ForCausalLM", transformers.Llama4TextConfig(**kw, attn_implementation=cpref.hf.NAME))
    cu = [0, 11, 30]
    tokens = torch.randint(1, 300, (cu[-1],), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.cat([ref(tokens[a:b][None], use_cache=False).logits[0] for a, b in zip(cu, cu[1:])])
    for P, mode, layout in [(2, "p2p", "zigzag"), (4, "a2a", "balanced")]:

        def rank(comm, P=P, mode=mode, layout=layout):  # this case's, bound
            b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=P, rank=comm.rank,
                                                layout=layout)  # fmt: skip
            cp = cpref.hf.CP(comm, b["sharding"], mode, cpref.MODES[mode].example_options(P))
            with torch.no_grad():
                return copy.deepcopy(base)(b["tokens"][None], use_cache=False, cp=cp).logits[0], b["sharding"]

        results = SimCluster(P).run(rank)
        sharding = results[0][1]
        assert_close(sharding.unpad(sharding.unshard([r[0] for r in results])), want, torch.float32, msg=f"P={P}")


def test_register_is_idempotent_and_wraps_once():
    from transformers import PreTrainedModel

    cpref.hf.register()
    method = PreTrainedModel._check_and_adjust_attn_implementation
    assert cpref.hf.register() == cpref.hf.NAME
    assert PreTrainedModel._check_and_adjust_attn_implementation is method
    model = built("LlamaForCausalLM", "LlamaConfig", **TINY)
    assert len(model._forward_pre_hooks) == 1
    model.set_attn_implementation(cpref.hf.NAME)  # asked again: still one check
    assert len(model._forward_pre_hooks) == 1


@pytest.mark.parametrize("options, match", [
    ({"causal": False}, r"options may not set causal=False: every layer gives its own \(its is_causal\)"),
    ({"softmax_scale": 0.1}, r"softmax_scale=0.1: every layer gives its own \(its scaling\)"),
    ({"window": (3, 0)}, r"window=\(3, 0\): every layer gives its own \(its sliding_window\)"),
])  # fmt: skip
def test_cp_options_that_collide_with_a_layers_own_are_refused_by_name(options, match):
    """On main these were a TypeError (got multiple values for keyword argument) at the first layer."""
    with pytest.raises(cpref.CPInputError, match=match):
        cpref.hf.CP(cpref.SingleRank(), cpref.Sharding([0, 8], cp_size=1), "p2p", options)


@pytest.mark.parametrize("args, match", [
    (("comm", cpref.Sharding([0, 8], cp_size=1)), "comm must be the CP group's collectives"),
    ((cpref.SingleRank(), [0, 8]), "sharding must be the batch's cpref.Sharding, got list"),
    ((cpref.SingleRank(), cpref.Sharding([0, 8], cp_size=2)), "the sharding is over cp_size=2 but the CP group has 1"),
    ((cpref.SingleRank(), cpref.Sharding([0, 8], cp_size=1), "ring"), "unknown mode 'ring'"),
])  # fmt: skip
def test_a_cp_of_wrong_parts_is_refused_when_made(args, match):
    with pytest.raises(cpref.CPInputError, match=match):
        cpref.hf.CP(*args)


def test_ranks_that_load_at_once_leave_weight_tying_on(tmp_path):
    """`from_pretrained` turns tying off by replacing `PreTrainedModel.tie_weights` for its duration; four threads
    loading at once (a simulated cluster's ranks) used to leave it replaced for good, and every model built afterwards
    in the process with an untied output layer (tests/models/test_hf_parity failed after the docs' example ran).
    With cpref.hf registered, loading is serialized: tying is on afterwards, and the loaded and new models are tied."""
    import threading

    from transformers import PreTrainedModel

    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    cpref.hf.register()
    tie, loaded = PreTrainedModel.tie_weights, []

    def load():
        for _ in range(3):
            loaded.append(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
            loaded.append(transformers.GPT2LMHeadModel(config))  # built directly while the others load

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert PreTrainedModel.tie_weights is tie
    new = transformers.GPT2LMHeadModel(config)
    assert all(m.lm_head.weight is m.transformer.wte.weight for m in [*loaded, new])
