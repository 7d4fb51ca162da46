"""Training under a mask: DP 2 x CP 2 steps of a small cpref model on shared-prompt packs (GRPO-style groups: one
prompt, several answers that see the prompt and themselves only) equal the same steps without CP (issue 57).

Per step, the loss and the gradient norm within 1e-5 relative (the parity suite's fp32 tolerance), every mode, in
zigzag and in the layout balanced by the mask; and the masked run is not the causal one (the mask reaches every
layer: a context that dropped it would train on causal documents and pass a parity test between runs that both
dropped it). What a bug would look like: the mask applied at CP = 1 but lost in a mode's path, the balanced
sharding of one rank built without the mask, a DP replica whose packs carry no mask.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.models import CausalLM, CPContext, ModelConfig
from cpref.train.packing import Pack
from cpref.train.training import Topology, TrainConfig, step_packs, train_step
from sim import SimCluster

STEPS, CONFIG = 3, dict(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
GROUPS = [(16, [12, 20, 16]), (10, [22, 8, 24]), (20, [14, 30]), (8, [16, 16, 24])]  # (prompt, answers) per pack


def packs(masked: bool = True) -> list[Pack]:
    """Pack i: group i's prompt then its answers as documents, random tokens; with the shared-prompt mask."""
    out, g = [], torch.Generator().manual_seed(5)
    for step in range(STEPS):
        for prompt, answers in GROUPS[2 * (step % 2) : 2 * (step % 2) + 2]:
            lengths = [prompt, *answers]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
            mask = cpref.Mask.shared_prompt([(prompt, answers)]) if masked else None
            out.append(Pack(torch.randint(0, 64, (sum(lengths),), generator=g), cu, mask))
    return out


def run(topo: Topology, config: TrainConfig, source: list[Pack]) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**CONFIG), seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for step in range(STEPS):
        stats = train_step(model, optimizer, step_packs(source, step, topo, config.micro_batches), topo, config, step)
        out.append((stats.loss, stats.grad_norm))
    return out


def reference(masked: bool = True) -> list[tuple[float, float]]:
    return run(Topology.single(), TrainConfig(micro_batches=2), packs(masked))


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
def test_dp2_x_cp2_steps_on_shared_prompt_packs_are_the_steps_without_cp(mode, layout):
    config = TrainConfig(mode=mode, layout=layout, options=cpref.MODES[mode].example_options(2))
    source = packs()

    def rank(world):
        groups = [[0, 1], [2, 3]]
        d = world.rank // 2
        return run(Topology(world.split(groups), world, d, 2), config, source)

    got, want = SimCluster(4, timeout=120.0).run(rank)[0], reference()
    for step, ((loss, norm), (loss0, norm0)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(loss0, rel=1e-5) and norm == pytest.approx(norm0, rel=1e-5), f"step {step}"


def test_the_mask_reaches_every_layer_and_the_balanced_sharding():
    """The masked run's losses are not the causal run's; a packed batch's sharding under `balanced` is the one
    balanced by its mask, and a context refuses a mask over another batch by name."""
    masked, causal = reference(), reference(masked=False)
    assert all(abs(a[0] - b[0]) > 1e-4 for a, b in zip(masked, causal))
    pack = packs()[0]
    batch = cpref.get_batch_on_this_cp_rank({"tokens": pack.tokens, "labels": pack.tokens}, pack.cu_seqlens, cp_size=2,
                                            rank=0, layout="balanced", mask=pack.mask)  # fmt: skip
    assert batch["sharding"].mask == pack.mask
    other = cpref.Mask.causal_documents([0, 5])
    with pytest.raises(cpref.CPInputError, match="the mask is over a batch of 5 tokens, this batch has 64"):
        CPContext(comm=cpref.SingleRank(), sharding=cpref.Sharding(pack.cu_seqlens, cp_size=1), mode="p2p", mask=other)
