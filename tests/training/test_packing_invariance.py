"""Packing invariance: extra padding, or another order of the documents in a pack, leaves every
document's loss unchanged (CP = 2 on the simulated cluster, float64 model, 1e-10)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import cpref
from cpref.models import CausalLM, CPContext, ModelConfig
from cpref.train.packing import EOD, Pack, labels_for
from sim import SimCluster

P = 2
CONFIG = ModelConfig(family="qwen3", vocab_size=257, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
DOCS = [torch.arange(5, 5 + n) % 250 for n in (7, 13, 4, 20)]


def document_losses(order: list[int], multiple: int, mode: str, layout: str) -> dict[int, float]:
    """Mean loss of each document (by its index in DOCS) in a pack of `order`, padded to `multiple`."""
    docs = [torch.cat([DOCS[i], torch.tensor([EOD])]) for i in order]
    tokens = torch.cat(docs)
    cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
    labels, mask = labels_for(Pack(tokens, cu))
    cu_p = [0, *itertools.accumulate(-(-len(d) // multiple) * multiple for d in docs)]  # each document padded at its end
    sharding = cpref.Sharding(cu, cp_size=P, layout=layout, cu_seqlens_padded=cu_p)
    tok_p, lab_p, mask_p = (sharding.pad(x) for x in (tokens, labels, mask))  # (T_padded,)
    model = CausalLM(CONFIG, seed=0).double()

    def rank_fn(comm):
        shard = lambda x: sharding.shard(x, comm.rank)  # noqa: E731
        ctx = CPContext(comm=comm, sharding=sharding, mode=mode, options={"a2a_size": 2} if mode == "a2a+p2p" else {})
        logits = model(shard(tok_p), sharding.positions(comm.rank), ctx)
        return (F.cross_entropy(logits, shard(lab_p), reduction="none") * shard(mask_p)).detach()

    per_token = sharding.unshard(SimCluster(P).run(rank_fn))  # (T_padded,)
    masks = sharding.unshard([sharding.shard(mask_p, r) for r in range(P)])
    out = {}
    for slot, i in enumerate(order):
        rows = slice(cu_p[slot], cu_p[slot + 1])
        out[i] = float(per_token[rows].sum() / masks[rows].sum())
    return out


@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
def test_order_and_extra_padding_leave_each_documents_loss_unchanged(mode, layout):
    mult = 2 * P if layout == "zigzag" else P
    base = document_losses([0, 1, 2, 3], mult, mode, layout)
    for order, multiple in (([2, 0, 3, 1], mult), ([0, 1, 2, 3], 4 * mult), ([3, 2, 1, 0], 3 * mult)):
        other = document_losses(order, multiple, mode, layout)
        for i in base:
            assert abs(other[i] - base[i]) <= 1e-10, (order, multiple, i)
