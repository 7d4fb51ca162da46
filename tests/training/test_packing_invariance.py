"""Packing invariance: extra padding, or another order of the documents in a pack, leaves every
document's loss unchanged (CP = 2 on the simulated cluster, float64 model, 1e-10)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpref
from cpref.models import CausalLM, CPContext, ModelConfig
from cpref.packing import EOD, Pack, labels_for
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
    (tok_p, cu_p), (lab_p, _), (mask_p, _) = (cpref.pad_to_multiple(x, cu, multiple) for x in (tokens, labels, mask))
    model = CausalLM(CONFIG, seed=0).double()

    def rank_fn(comm):
        shard = lambda x: cpref.shard(x, cu_p, cp_size=P, rank=comm.rank, layout=layout)  # noqa: E731
        pos = cpref.positions(cu_p, cp_size=P, rank=comm.rank, layout=layout)
        ctx = CPContext(comm=comm, cu_seqlens=cu, cu_seqlens_padded=cu_p, mode=mode, layout=layout,
                        options={"a2a_size": 2} if mode == "a2a+p2p" else {})  # fmt: skip
        logits = model(shard(tok_p), pos, ctx)
        return (F.cross_entropy(logits, shard(lab_p), reduction="none") * shard(mask_p)).detach()

    per_token = cpref.unshard(SimCluster(P).run(rank_fn), cu_p, layout=layout)  # (T_padded,)
    masks = cpref.unshard([cpref.shard(mask_p, cu_p, cp_size=P, rank=r, layout=layout) for r in range(P)], cu_p, layout=layout)
    out = {}
    for slot, i in enumerate(order):
        rows = slice(int(cu_p[slot]), int(cu_p[slot + 1]))
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
