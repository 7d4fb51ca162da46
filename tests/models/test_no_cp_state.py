"""The model holds no CP state (field bug 9): two models with different CP settings share a process.

On one simulated cluster of 4 ranks, model A (LLaMA, Hq 4, Hkv 2, D 8) runs at CP = 4 (zigzag,
a2a+p2p), and model B (GPT-2, Hq 8, D 4: other head counts) at CP = 2 (contiguous, a2a) on the
sub-groups {0, 1} and {2, 3}, alternating A, B, A, B on every rank, on the same boundary
tensor. Each call must give its own CP = 1 shard, bitwise the same every time; one model
under both settings in turn as well; and no module keeps a context or a group afterwards.
"""

from __future__ import annotations

import torch

import cpref
from cpref.comm.protocol import Collectives
from cpref.models import CPContext
from sim import SimCluster
from tests.helpers import assert_close
from tests.models.cases import forward_on_rank, packed, tiny_model, whole

LENGTHS = [16, 8, 24]  # multiples of 2P for P = 2 and 4: no padding, one boundary tensor for both settings
A = dict(mode="a2a+p2p", layout="zigzag", a2a_size=2)
B = dict(mode="a2a", layout="contiguous")


def expected_shard(model, tokens, cu, P, rank, layout):
    return cpref.Sharding(cu, cp_size=P, layout=layout).shard(whole(model, tokens, cu), rank)


def test_two_models_with_different_cp_settings_interleave():
    a, b = tiny_model("llama"), tiny_model("gpt2", num_heads=8, seed=1)
    cu, tokens = packed(LENGTHS)

    def rank_fn(comm):
        pair = comm.split([[0, 1], [2, 3]])  # CP = 2 groups for model B
        runs = [(name, forward_on_rank(m, tokens, cu, g, **kw)[0])
                for _ in range(2) for name, m, g, kw in (("a", a, comm, A), ("b", b, pair, B))]  # fmt: skip
        return comm.rank, pair.rank, runs

    for rank, pair_rank, runs in SimCluster(4).run(rank_fn):
        want = {"a": expected_shard(a, tokens, cu, 4, rank, "zigzag"),
                "b": expected_shard(b, tokens, cu, 2, pair_rank, "contiguous")}  # fmt: skip
        first = {}
        for name, logits in runs:
            assert_close(logits, want[name], torch.float64, msg=f"model {name} on rank {rank}")
            assert torch.equal(first.setdefault(name, logits), logits)


def test_one_model_under_two_cp_settings_in_turn():
    model = tiny_model("qwen3")
    cu, tokens = packed(LENGTHS, seed=3)

    def rank_fn(comm):
        pair = comm.split([[0, 1], [2, 3]])
        return [forward_on_rank(model, tokens, cu, g, **kw)[0] for g, kw in ((comm, A), (pair, B), (comm, A))]

    for rank, (at4, at2, again) in enumerate(SimCluster(4).run(rank_fn)):
        assert_close(at4, expected_shard(model, tokens, cu, 4, rank, "zigzag"), torch.float64)
        assert_close(at2, expected_shard(model, tokens, cu, 2, rank % 2, "contiguous"), torch.float64)
        assert torch.equal(at4, again)
    kept = [(m, k) for m in model.modules() for k, v in vars(m).items() if isinstance(v, (CPContext, Collectives))]
    assert kept == []
