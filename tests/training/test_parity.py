"""Loss parity: a run at CP = 2, CP = 4 or DP 2 x CP 2 is the run at CP = 1, step for step.

Every family, every mode and layout, 10 steps of tiny models on packed standard-library text:
per-step loss and gradient norm within 1e-5 relative in fp32, 1e-2 under bf16 autocast.

The bf16 runs use lr 1e-3: at 3e-3 these tiny models are in a regime where one bf16 rounding
of 2^-9 grows into a percent of gradient norm within a few steps. There all-gather, whose
dK/dV are rounded twice (before its bf16 reduce-scatter, as on NCCL/HCCL, and after), drifts
1.2% at one step, the other modes 0.1%; at 1e-3 every mode stays within 5e-4.

Parity between runs cannot see a mistake every run makes alike (a loss scaled by 2, no clipping),
so the loop's own values are also checked exactly, on a bias-only model whose loss and gradient
are known in closed form; with which packs a step takes and the argument checks.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.comm.protocol import SingleRank
from cpref.train.training import PackSource, StepStats, Topology, TrainConfig, step_packs, train
from sim import SimCluster
from sim.tools.train import RunSpec, run_sim

FAMILIES = ("gpt2", "llama", "qwen3")
MODES = sorted(cpref.MODES)
TOPOLOGIES = {"cp2": (2, 1, False), "cp4": (4, 1, False), "dp2xcp2": (2, 2, False), "dp2xcp2-strided": (2, 2, True)}
PACKS_PER_STEP = 2  # the CP = 1 reference takes 2 micro-batches; DP 2 takes one pack per replica
TINY = {
    "gpt2": dict(family="gpt2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, max_positions=128),
    "llama": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
    "qwen3": dict(family="qwen3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
    "sliding": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, layer_windows=(7, None)),
}


def spec(family: str, cp: int, dp: int, mode: str, layout: str, *, strided=False, bf16=False, steps=10) -> RunSpec:
    options = cpref.MODES[mode].example_options(cp)
    config = TrainConfig(mode=mode, layout=layout, options=options, micro_batches=PACKS_PER_STEP // dp, bf16=bf16,
                         lr=1e-3 if bf16 else 3e-3)  # fmt: skip
    return RunSpec(model=family, cp=cp, dp=dp, steps=steps, pack_tokens=64, strided=strided, train=config)


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)


@lru_cache(maxsize=None)
def reference(family: str, bf16: bool) -> list[tuple[float, float]]:
    """CP = 1, one device: the run every other topology must reproduce."""
    import sim.tools.train

    saved, sim.tools.train.PRESETS = sim.tools.train.PRESETS, TINY
    try:
        return [(s.loss, s.grad_norm) for s in run_sim(spec(family, 1, 1, "all_gather", "contiguous", bf16=bf16))]
    finally:
        sim.tools.train.PRESETS = saved


def assert_parity(got, want, rtol):
    for step, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(got, want)):
        assert abs(loss - loss_ref) <= rtol * abs(loss_ref), f"step {step}: loss {loss} vs {loss_ref}"
        assert abs(norm - norm_ref) <= rtol * abs(norm_ref), f"step {step}: grad norm {norm} vs {norm_ref}"
    assert len(got) == len(want) == 10


# every family x mode x layout at CP 2, CP 4 and DP 2 x CP 2; non-consecutive CP groups for one family
CASES = [(f, m, lay, t) for f in FAMILIES for m in MODES for lay in cpref.LAYOUTS for t in ("cp2", "cp4", "dp2xcp2")]
CASES += [("llama", m, "zigzag", "dp2xcp2-strided") for m in MODES]
# a sliding layer (a window of 8 keys, in packs of 64 tokens: it matters) beside a full one, every mode and layout
CASES += [("sliding", m, lay, t) for m in MODES for lay in cpref.LAYOUTS for t in ("cp2", "cp4")]


@pytest.mark.sweep
@pytest.mark.parametrize("family, mode, layout, topology", CASES, ids=["-".join(c) for c in CASES])
def test_fp32_loss_and_grad_norm_match_cp1_for_10_steps(family, mode, layout, topology):
    cp, dp, strided = TOPOLOGIES[topology]
    got = [(s.loss, s.grad_norm) for s in run_sim(spec(family, cp, dp, mode, layout, strided=strided))]
    assert_parity(got, reference(family, False), 1e-5)
    assert got[-1][0] < got[0][0]  # and it learns


BF16_CASES = [(f, m, "cp4") for f in FAMILIES for m in MODES] + [(f, "p2p", t) for f in FAMILIES for t in ("cp2", "dp2xcp2")]
BF16_CASES += [("sliding", m, "cp4") for m in MODES]


@pytest.mark.sweep(strength=1)  # every family and mode in bf16 once (each case is slow); the rest in test-all
@pytest.mark.parametrize("family, mode, topology", BF16_CASES, ids=["-".join(c) for c in BF16_CASES])
def test_bf16_loss_and_grad_norm_match_cp1_within_1e_2(family, mode, topology):
    cp, dp, _ = TOPOLOGIES[topology]
    got = [(s.loss, s.grad_norm) for s in run_sim(spec(family, cp, dp, mode, "zigzag", bf16=True))]
    assert_parity(got, reference(family, True), 1e-2)


# --- the loop's exact values, on a model whose loss and gradient are known in closed form ---

V = 257  # byte vocabulary and EOD (id 256)


class BiasOnly(torch.nn.Module):
    """Logits = one learnt bias for every token: at bias 0 every token's loss is ln V, and the
    gradient of the mean loss is d/db_j = 1/V - (loss tokens labelled j) / (loss tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(V))

    def forward(self, tokens, position_ids, ctx):
        return self.b.expand(len(tokens), V)


def fifteen_fives():
    """One document of 15 tokens `5`; with its EOD, 16 tokens: pack 0 = 5 x 8 (a cut piece: its
    last token predicts nothing, 7 loss tokens labelled 5), pack 1 = 5 x 7 + EOD (6 labelled 5,
    one labelled EOD, the EOD itself predicts nothing). The step's 14 loss tokens: 13 x 5, 1 x EOD."""
    return iter([torch.full((15,), 5)])


GRAD = [1 / V] * V
GRAD[5], GRAD[256] = 1 / V - 13 / 14, 1 / V - 1 / 14
NORM = math.sqrt(sum(g * g for g in GRAD))  # about 0.93


def one_step_dp2_cp2(grad_clip):
    def rank_fn(world):
        topo = Topology(world.split([[0, 1], [2, 3]]), world, world.rank // 2, 2)
        model = BiasOnly()
        config = TrainConfig(mode="p2p", layout="zigzag", micro_batches=1, grad_clip=grad_clip)
        (stats,) = train(model, torch.optim.SGD(model.parameters(), lr=1.0), PackSource(fifteen_fives, 8), topo, config, 1)
        return stats, model.b.detach().clone()

    return SimCluster(4, timeout=60.0).run(rank_fn)


def test_a_step_reports_the_mean_loss_over_every_loss_token_and_the_global_gradient_norm():
    for stats, b in one_step_dp2_cp2(grad_clip=None):
        assert stats.loss == pytest.approx(math.log(V), rel=1e-6)  # uniform logits: ln V per token
        assert stats.grad_norm == pytest.approx(NORM, rel=1e-6)
        assert stats.tokens == 16  # both replicas' packs of 8
        assert b.tolist() == pytest.approx([-g for g in GRAD], rel=1e-5, abs=1e-8)  # SGD lr 1: b = -grad


def test_gradients_are_scaled_to_the_clip_when_the_global_norm_exceeds_it():
    for stats, b in one_step_dp2_cp2(grad_clip=0.5):
        assert stats.grad_norm == pytest.approx(NORM, rel=1e-6)  # the norm before clipping
        assert b.tolist() == pytest.approx([-g * 0.5 / NORM for g in GRAD], rel=1e-5, abs=1e-8)


class Sized(SingleRank):
    """A communicator of `size` ranks that is never called (the topology's arithmetic only)."""

    def __init__(self, size: int) -> None:
        self.size = size


def test_the_packs_of_a_step_are_the_next_dp_times_micro_batches_split_disjointly():
    topos = [Topology(SingleRank(), Sized(2), r, 2) for r in (0, 1)]
    mine = [step_packs(range(100), 1, t, 2) for t in topos]  # step 1 of 2 x 2 packs a step: packs 4..7
    assert sorted(mine[0] + mine[1]) == [4, 5, 6, 7]


def test_training_from_a_start_step_takes_that_steps_packs_and_reports_its_number():
    asked = []

    class Recording(PackSource):
        def __getitem__(self, n):
            asked.append(n)
            return super().__getitem__(n)

    source = Recording(lambda: iter([torch.full((100,), 5)]), 8)  # 101 tokens: 12 packs
    model = BiasOnly()
    stats = train(model, torch.optim.SGD(model.parameters(), lr=0.1), source, Topology.single(), TrainConfig(micro_batches=2), 3, start=1)
    assert [s.step for s in stats] == [1, 2] and asked == [2, 3, 4, 5]  # steps 1 and 2: packs 2, 3 then 4, 5


def test_tokens_per_second_is_tokens_over_seconds_and_infinite_for_a_zero_time():
    assert StepStats(0, 1.0, 1.0, 16, 2.0).tokens_per_s == 8.0
    assert StepStats(0, 1.0, 1.0, 16, 0.0).tokens_per_s == float("inf")


def test_a_parameter_no_pack_reaches_takes_part_in_the_sum_as_zeros():
    class WithUnused(BiasOnly):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.ones(3))  # never in the graph: its grad stays None

    def rank_fn(world):
        topo = Topology(world, world)  # CP = 2, no DP
        model = WithUnused()
        train(model, torch.optim.SGD(model.parameters(), lr=1.0), PackSource(fifteen_fives, 8), topo, TrainConfig(mode="p2p"), 1)
        return model.unused.grad.tolist(), model.unused.detach().tolist()

    assert SimCluster(2, timeout=60.0).run(rank_fn) == [([0.0] * 3, [1.0] * 3)] * 2


def test_a_topology_and_a_config_that_cannot_be_are_refused():
    cp2, world4 = Sized(2), Sized(4)
    with pytest.raises(CPInputError, match=r"world has 4 ranks but dp_size 1 x cp 2 = 2"):
        Topology(cp2, world4)
    with pytest.raises(CPInputError, match=r"dp_rank=2 is outside \[0, 2\)"):
        Topology(cp2, world4, dp_rank=2, dp_size=2)
    with pytest.raises(CPInputError, match=r"lr must be a finite number > 0, got 0"):
        TrainConfig(lr=0)
    with pytest.raises(CPInputError, match=r"micro_batches=0 is outside \[1, inf\)"):
        TrainConfig(micro_batches=0)


def test_a_pack_source_makes_packs_of_the_size_asked():
    source = PackSource(lambda: iter([torch.arange(20)]), 8)  # 21 tokens with the EOD: packs 0..7, 8..15
    assert [source[n].tokens.tolist() for n in (0, 1)] == [list(range(8)), list(range(8, 16))]


def test_a_run_the_documents_cannot_fill_is_refused_before_its_first_step():
    """On main a run past the data's last pack trained every step it had packs for, then raised."""
    source = PackSource(lambda: iter([torch.full((100,), 5)]), 8)  # 101 tokens: 12 packs
    seen, model = [], BiasOnly()
    with pytest.raises(CPInputError, match=r"7 steps of 1 x 2 packs \(dp_size x micro_batches\) take 14 packs of 8 "
                                           r"tokens, but the documents \(101 tokens\) fill only 12: train at most 6 "
                                           r"steps, or make packs of at most 7 tokens, or give more documents"):  # fmt: skip
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), source, Topology.single(), TrainConfig(micro_batches=2),
              7, on_step=seen.append)  # fmt: skip
    assert seen == [] and model.b.abs().sum() == 0
    assert len(train(model, torch.optim.SGD(model.parameters(), lr=0.1), source, Topology.single(),
                     TrainConfig(micro_batches=2), 6)) == 6  # fmt: skip
