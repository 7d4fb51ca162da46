"""Hugging Face models through `cpref.hf`: logits, loss and every parameter's gradient equal Hugging Face's own.

Tiny random models built from configs (nothing downloaded; 2 layers, hidden 64, 4 heads): Llama with
scaled RoPE (`rope_type: llama3`, positions past `original_max_position_embeddings`), Qwen3 with a
sliding-window layer and a full one (GQA, `head_dim` 24 != 64 / 4), Mistral with `sliding_window` on
every layer, and GPT-2 (MHA, learned positions, each layer's scores scaled by the inverse of its
index: a `scaling` of its own); and the attention variants: Gemma 2 (logit soft-capping on a
sliding and a full layer), GPT-OSS (learnable sinks, whose gradient is compared too, and MoE),
Llama 4's text model (a chunked layer and a full NoPE one), Gemma 3 (sliding and full). The reference is Hugging Face's eager attention on
every document of the pack alone (positions from 0, its own causal and sliding masks); cpref's run
is the same weights with `attn_implementation="cpref"` on the packed batch, sharded by
`cpref.get_batch_on_this_cp_rank`, at CP = 1, 2 and 4 on the simulated cluster, every mode at
P = 2 and 4, each with another layout (a Latin square over the four). Logits (real rows, put back
together), the loss and every parameter's gradient, summed over the ranks (each its own replica,
`cpref.cp_loss`), agree within fp32's tolerance, 1e-5 (atol = rtol, `sim.oracle.TOL`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cpref
import cpref.hf
from cpref.hf.layer import Checked
from sim import SimCluster
from sim.cluster.harness import CountingKernel
from tests.helpers import assert_close
from tests.models.cases import assert_hf_parity
from tests.models.test_hf_parity import random_hf_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, W = 300, 8  # W: Hugging Face's sliding_window, keys a query sees, itself included
LENGTHS = [13, 7, 20]  # documents longer than W, none a multiple of 2P
COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # fmt: skip
MODELS = {  # name -> (config class, model class, config kwargs)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(**SIZES, rope_parameters=LLAMA3)),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM", dict(**SIZES, head_dim=24, use_sliding_window=True,
                      sliding_window=W, layer_types=["sliding_attention", "full_attention"])),  # fmt: skip
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(**SIZES, sliding_window=W)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                   scale_attn_by_inverse_layer_idx=True)),  # fmt: skip
    # the attention variants (issue 45): Gemma 2's logit soft-capping (at 5, so that the random logits reach it) on a
    # sliding and a full layer; GPT-OSS's sinks (set by `build` to logits as large as the scores') and MoE; Llama 4's
    # chunked layer (chunks of 6 positions, cutting every document) and a full NoPE one; Gemma 3's sliding and full
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(**SIZES, head_dim=16, sliding_window=W, attn_logit_softcapping=5.0,
                                                         final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(**SIZES, head_dim=16, sliding_window=W, num_local_experts=4,
                                                         num_experts_per_tok=2)),  # fmt: skip
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(**SIZES, head_dim=16, intermediate_size_mlp=96,
                                                             num_local_experts=2, attention_chunk_size=6,
                                                             layer_types=["chunked_attention", "full_attention"],
                                                             no_rope_layers=[1, 0], attn_temperature_tuning=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(**SIZES, head_dim=16, sliding_window=W,
                                                            layer_types=["sliding_attention", "full_attention"])),
}
SINKS = torch.tensor([4.0, -3.0, 6.0, 0.5])  # GPT-OSS's sinks per head, each layer: as large as the scores or more
MODES = sorted(cpref.MODES)
CASES = [(name, 1, "p2p", "zigzag") for name in MODELS] + [
    (name, P, mode, cpref.LAYOUTS[(i + j + P) % len(cpref.LAYOUTS)])
    for j, name in enumerate(MODELS) for P in (2, 4) for i, mode in enumerate(MODES)
]  # fmt: skip


def build(name: str, implementation: str):
    """The model `name` with `test_hf_parity`'s random weights, the same for every attention implementation."""
    config_cls, model_cls, kw = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **kw)
    config._attn_implementation = implementation
    model = random_hf_model(model_cls, config)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(getattr(layer, "sinks", None), torch.nn.Parameter):
                layer.sinks.copy_(SINKS)
    return model


def pack(seed: int = 0):
    """`(cu_seqlens, tokens, labels, loss_mask)`: labels the next token of the same document, the last one masked."""
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    tokens = torch.randint(1, VOCAB, (cu[-1],), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(cu[-1])
    mask[torch.tensor(cu[1:]) - 1] = 0.0
    return cu, tokens, tokens.roll(-1), mask


def reference(name: str):
    """Hugging Face eager on each document alone: `(logits (T, V), loss, {parameter: gradient})`."""
    model = build(name, "eager")
    cu, tokens, labels, mask = pack()
    logits = torch.cat([model(tokens[a:b][None], use_cache=False).logits[0] for a, b in zip(cu, cu[1:])])
    loss = (F.cross_entropy(logits, labels, reduction="none") * mask).sum() / mask.sum()
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references():
    return {}


def run_cp(name: str, P: int, mode: str, layout: str, checkpointing: bool = False, kernels=None):
    """Per rank: `(logits (T_l, V), loss share, {parameter: gradient}, sharding)` through `cpref.hf`; with
    `checkpointing`, in training mode with Hugging Face's gradient checkpointing (every layer's forward again in
    the backward, with the call's keyword arguments); `kernels[r]`: rank r's attention kernel."""
    cpref.hf.register()
    base = build(name, cpref.hf.NAME)
    cu, tokens, labels, mask = pack()

    def rank(comm):
        model = copy.deepcopy(base)
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
            model.train()
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask}, cu, cp_size=P,
                                            rank=comm.rank, layout=layout)  # fmt: skip
        options = cpref.MODES[mode].example_options(P) | ({"kernel": kernels[comm.rank]} if kernels else {})
        cp = cpref.hf.CP(comm, b["sharding"], mode, options)
        logits = model(b["tokens"][None], position_ids=b["position_ids"][None], use_cache=False, cp=cp).logits[0]
        loss = cpref.cp_loss(F.cross_entropy(logits, b["labels"], reduction="none"), b["loss_mask"], comm)
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}, b["sharding"]

    return SimCluster(P).run(rank)


@pytest.mark.sweep
@pytest.mark.parametrize("name, P, mode, layout", CASES)
def test_logits_loss_and_gradients_equal_hugging_faces(references, name, P, mode, layout):
    if name not in references:
        references[name] = reference(name)
    assert_hf_parity(run_cp(name, P, mode, layout), references[name], f"{name} P={P} {mode} {layout}")


class _Layer(torch.nn.Module):
    is_causal = True


def _call(**kw):
    """`cpref.hf.attention` on a tiny shard of one simulated rank (no communication happens before a refusal)."""
    from sim.cluster.simcluster import SimCluster as Cluster

    def rank(comm):
        sharding = cpref.Sharding([0, 4], cp_size=1, layout="contiguous")
        q = torch.zeros(1, 2, 4, 8)
        args = dict(module=_Layer(), query=q, key=q, value=q, attention_mask=None, cp=Checked(comm, sharding))
        args.update(kw)
        return cpref.hf.attention(**args)

    return Cluster(1).run(rank)[0]


@pytest.mark.parametrize("change, match", [
    (dict(cp=None), r"model\(\.\.\., cp=cpref\.hf\.CP"),
    (dict(cp="p2p"), "must be a cpref.hf.CP, got str"),
    (dict(cp=cpref.hf.CP(cpref.SingleRank(), cpref.Sharding([0, 4], cp_size=1))), "without the model-level checks"),
    (dict(query=torch.zeros(2, 2, 4, 8)), "batch size 2"),
    (dict(key=torch.zeros(1, 2, 6, 8), value=torch.zeros(1, 2, 6, 8)), "use_cache=False"),
    (dict(attention_mask=torch.zeros(1, 1, 4, 4)), "call the model without attention_mask"),
    (dict(attention_mask=torch.ones(1, 4, dtype=torch.bool)), r"mask of shape \(1, 4\) reached the layer"),
])  # fmt: skip
def test_what_cpref_cannot_do_is_refused_by_name(change, match):
    with pytest.raises(cpref.CPInputError, match=match):
        _call(**change)


def test_dropout_and_a_cache_in_training_and_a_bidirectional_window_are_refused():
    layer = _Layer().train()
    with pytest.raises(cpref.CPInputError, match="attention dropout 0.1 in training"):
        _call(module=layer, dropout=0.1)
    with pytest.raises(cpref.CPInputError, match="use_cache=True in training"):
        _call(module=layer, use_cache=True)
    assert _call(module=layer.eval(), dropout=0.1)[0].shape == (1, 4, 2, 8)  # evaluation: no dropout is applied
    bidirectional = _Layer()
    bidirectional.is_causal = False
    with pytest.raises(cpref.CPInputError, match="sliding window without a causal mask"):
        _call(module=bidirectional, sliding_window=4)


def test_a_model_call_without_cp_is_refused_and_importing_cpref_imports_no_transformers():
    import subprocess
    import sys

    cpref.hf.register()
    model = build("llama3", cpref.hf.NAME)
    with pytest.raises(cpref.CPInputError, match="needs the CP arguments of this forward"):
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    code = "import sys, cpref, cpref.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["llama3", "qwen3-sliding"])
def test_gradient_checkpointing_recomputes_through_cp(references, name):
    """With gradient checkpointing (training mode, dropout 0) the layers run again in the backward and find the
    CP arguments in their keyword arguments: the same loss and gradients as Hugging Face's eager run."""
    if name not in references:
        references[name] = reference(name)
    _, want_loss, want_grads = references[name]
    plain, again = [CountingKernel() for _ in range(2)], [CountingKernel() for _ in range(2)]
    run_cp(name, 2, "p2p", "zigzag", kernels=plain)
    results = run_cp(name, 2, "p2p", "zigzag", checkpointing=True, kernels=again)
    assert [k.forward_calls for k in again] == [2 * k.forward_calls for k in plain]  # each layer ran twice
    assert_close(sum(r[1] for r in results), want_loss, torch.float32, msg=f"{name}: loss")
    for n, g in want_grads.items():
        assert_close(sum(r[2][n] for r in results), g, torch.float32, msg=f"{name}: gradient of {n}")
