"""A step whose loss or gradient norm is not finite stops the run, on every rank alike, before it touches the weights.

Was: an in-range but too large learning rate (3e37) trained on to NaN, every step reported `loss nan`, and
`--save-every` replaced the last good checkpoint with NaN weights.
"""

from __future__ import annotations

import math

import pytest
import torch

import cpref.train.checkpoint as ck
from cpref.base.errors import NonFiniteStepError
from cpref.train.training import PackSource, Topology, TrainConfig, train
from sim import SimCluster
from sim.tools.train import main
from tests.training.test_parity import TINY, BiasOnly, V


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)


def two_steps_dp2_cp2(poison: tuple[int, float], config: TrainConfig):
    """Two steps at DP 2 x CP 2 of `BiasOnly` (SGD, lr 1); before the second, rank 3 alone writes `poison` (a token,
    a value) into its replica's bias. Each rank's result: `(stats, error, bias before the second step, bias
    after it, the optimizer's state)`."""

    def rank_fn(world):
        topo = Topology(world.split([[0, 1], [2, 3]]), world, world.rank // 2, 2)
        model, stats = BiasOnly(), []
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
        source = PackSource(lambda: iter([torch.full((31,), 5)]), 8)
        stats += train(model, optimizer, source, topo, config, 1)
        if world.rank == 3:
            with torch.no_grad():
                model.b[poison[0]] = poison[1]
        before = model.b.detach().clone()
        try:
            stats += train(model, optimizer, source, topo, config, 2, start=1)
            error = None
        except NonFiniteStepError as exc:
            error = exc
        return stats, error, before, model.b.detach().clone(), optimizer.state_dict()["state"]

    return SimCluster(4, timeout=60.0).run(rank_fn)


POISONS = {"nan": ((7, math.nan), "nan", "nan"), "inf": ((7, math.inf), "nan", "nan"),
           # the label's own logit -inf: the loss is infinite, its gradient (softmax - one-hot) finite
           "loss only": ((5, -math.inf), "inf", "0.9")}  # fmt: skip


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_a_non_finite_step_raises_on_every_rank_and_leaves_the_weights_and_the_optimizer_alone(poison, grad_clip):
    where, loss, norm = POISONS[poison]
    results = two_steps_dp2_cp2(where, TrainConfig(mode="p2p", layout="zigzag", micro_batches=1, grad_clip=grad_clip))
    messages = {str(error) for _, error, _, _, _ in results}
    assert len(messages) == 1 and None not in {error for _, error, _, _, _ in results}  # every rank, the same words
    (message,) = messages
    assert message.startswith(f"step 1: the loss is {loss} and the gradients' norm {norm}")
    assert ", not finite; the step is not taken" in message
    assert "lower the learning rate (lr=0.003)" in message
    assert ("clip the gradients (grad_clip=None)" in message) == (grad_clip is None)
    for stats, _, before, after, state in results:
        assert [s.step for s in stats] == [0] and math.isfinite(stats[0].loss)
        assert torch.equal(before.nan_to_num(), after.nan_to_num())  # not stepped (NaN != NaN: compared as 0)
        assert all(torch.isfinite(s["momentum_buffer"]).all() for s in state.values())  # the first step's, kept


def test_a_finite_step_is_taken_as_before():
    """The check reads the all-reduced loss and norm only: a finite run steps as it did (the bias moves)."""
    results = two_steps_dp2_cp2((7, 0.0), TrainConfig(mode="p2p", layout="zigzag", micro_batches=1))
    for stats, error, before, after, _ in results:
        assert error is None and [s.step for s in stats] == [0, 1] and not torch.equal(before, after)
        assert stats[1].loss < math.log(V)  # learning


def test_the_command_stops_in_one_line_and_keeps_the_last_finite_checkpoint(tmp_path, capsys):
    """`--lr 3e37` (AdamW can step float32 by it, so it is not refused up front): step 0 is finite, its update
    overflows, step 1's gradient norm is NaN (its loss still finite: the norm alone must stop it). The command exits
    with status 1 and one line; the checkpoint `--save-every 1` wrote after step 0 is still there, its weights finite
    (not replaced by the NaN step's: whether weights stepped by 3e37 are worth resuming is another matter)."""
    save = tmp_path / "ckpt"
    argv = ["--model", "llama", "--steps", "4", "--pack-tokens", "64", "--lr", "3e37", "--save", str(save),
            "--save-every", "1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m sim train: error: step 1: the loss is ") and "gradients' norm nan" in err[-1]
    assert "lower the learning rate (lr=3e+37)" in err[-1] and not any("step 1 loss" in line for line in err)
    assert ck.read_meta(save).step == 1
    weights = torch.load(save / "state.pt", weights_only=True)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
