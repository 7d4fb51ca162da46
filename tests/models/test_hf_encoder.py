"""A bidirectional Hugging Face encoder through `cpref.hf`: BERT's layers are not causal, and cpref attends so.

A tiny random BERT (2 layers, hidden 64, 4 heads, no dropout); the reference is Hugging Face's eager
attention on every document alone; cpref's run the same weights with `attn_implementation="cpref"` on
the packed batch at CP = 2 and 4: the last hidden states (real rows) and every parameter's gradient of a
fixed linear function of them (the pooler dropped: it reads the first token, and is refused), summed over the ranks, within fp32's tolerance (1e-5). A causal mask
would give other states: each token would miss the ones after it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cpref
import cpref.hf
from sim import SimCluster
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CU = [0, 13, 20, 40]


def bert(implementation: str):
    config = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     max_position_embeddings=64)  # fmt: skip
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.pooler = None  # it reads the shard's first token: refused (dropped here, after the weights are drawn)
    return model


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 300, (CU[-1],), generator=g), torch.randn(CU[-1], 64, generator=g)  # tokens, weights


@pytest.mark.parametrize("P, mode, layout", [(2, "p2p", "zigzag"), (4, "a2a", "balanced"), (4, "all_gather", "stream"),
                                             (4, "a2a+p2p", "contiguous")])  # fmt: skip
def test_bert_states_and_gradients_equal_hugging_faces(P, mode, layout):
    tokens, weights = inputs()
    ref = bert("eager")
    states = torch.cat([ref(tokens[a:b][None]).last_hidden_state[0] for a, b in zip(CU, CU[1:])])  # (T, 64)
    (states * weights).sum().backward()
    cpref.hf.register()
    base = bert(cpref.hf.NAME)

    def rank(comm):
        model = copy.deepcopy(base)
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens, "weights": weights}, CU, cp_size=P,
                                            rank=comm.rank, layout=layout)  # fmt: skip
        cp = cpref.hf.CP(comm, b["sharding"], mode, cpref.MODES[mode].example_options(P))
        out = model(b["tokens"][None], position_ids=b["position_ids"][None], cp=cp).last_hidden_state[0]
        (out * b["weights"]).sum().backward()  # padding rows weigh 0
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}, b["sharding"]

    results = SimCluster(P).run(rank)
    sharding = results[0][2]
    got = sharding.unpad(sharding.unshard([r[0] for r in results]))
    assert_close(got, states.detach(), torch.float32, msg=f"{mode} {layout} P={P}: states")
    for n, p in ref.named_parameters():
        assert_close(sum(r[1][n] for r in results), p.grad, torch.float32, msg=f"{mode} {layout} P={P}: gradient of {n}")
