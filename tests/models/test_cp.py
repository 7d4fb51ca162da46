"""At CP = 2 and 4, every mode and layout, each rank's logits are its shard of the CP = 1 logits (fp64, 1e-10).

Tokens and positions are padded and sliced by `cpref.get_batch_on_this_cp_rank`, as a training
loop does. Each rank's logits, padding rows included, must equal its shard of the CP = 1 run on
the same padded stream; the real rows, put back together, must equal the CP = 1 run on the
unpadded stream (padding is invisible). The backward as well: parameter gradients summed over
the ranks (each rank its own replica, the loss `cpref.cp_loss`) equal those at CP = 1.

With sliding-window layers (`cases.WINDOWED`) the same holds in every mode that takes a window,
and a mode that does not refuses the model by name before any communication.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import cpref
from cpref.models import CPContext
from sim import SimCluster
from tests.helpers import assert_close
from tests.models.cases import (
    FAMILIES,
    WINDOW_MODES,
    WINDOWED,
    forward_on_rank,
    options,
    packed,  # fmt: skip
    run_cp,
    tiny_model,
    whole,
    windowed_model,
)

LENGTHS = [13, 7, 20]  # none a multiple of 2P: every document is padded


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES} | {name: windowed_model(name) for name in WINDOWED}


MODES = sorted(cpref.MODES)
GRID = [(P, layout) for P in (2, 4) for layout in cpref.LAYOUTS]
# Qwen3 (GQA, head_dim != E / Hq, q/k norm, RoPE) over the whole grid of P x mode x layout; GPT-2
# (MHA, learned positions) and LLaMA over every (P, layout) once and every mode once, in a
# Latin-square pairing (the family only changes per-token work; the mode only the attention).
CASES = [("qwen3", P, mode, layout) for P, layout in GRID for mode in MODES] + [
    (family, P, MODES[(i + shift) % len(MODES)], layout)
    for family, shift in (("gpt2", 0), ("llama", 2))
    for i, (P, layout) in enumerate(GRID)
] + [(name, P, mode, layout) for name in WINDOWED for P, layout in GRID for mode in WINDOW_MODES]


@pytest.mark.sweep
@pytest.mark.parametrize("family, P, mode, layout", CASES)
def test_each_rank_gets_its_shard_of_the_cp1_logits(models, family, layout, mode, P):
    model = models[family]
    cu, tokens = packed(LENGTHS, seed=P)
    results = run_cp(model, tokens, cu, P=P, mode=mode, layout=layout)
    sharding = results[0][1]
    assert sharding == cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout)
    reference = whole(model, sharding.pad(tokens), cu, sharding.cu_seqlens_padded)  # (T_pad, V) at CP = 1
    for r, (logits, _) in enumerate(results):
        want = sharding.shard(reference, r)  # (T_pad/P, V)
        assert_close(logits, want, torch.float64, msg=f"{family} {mode} {layout} P={P} rank {r}")
    real = sharding.unpad(sharding.unshard([logits for logits, _ in results]))  # (T, V)
    assert_close(real, whole(model, tokens, cu), torch.float64, msg="real rows vs the unpadded CP = 1 run")


GRAD_CASES = [("qwen3", 4, "a2a+p2p", "zigzag"), ("gpt2", 2, "all_gather", "contiguous"),
              ("qwen3-window", 4, "a2a", "zigzag"), ("mistral", 2, "all_gather", "contiguous")]  # fmt: skip


@pytest.mark.parametrize("case, P, mode, layout", GRAD_CASES)
def test_gradients_summed_over_ranks_equal_cp1(models, case, P, mode, layout):
    """The backward runs through the model at CP > 1 (each rank its own replica, `cpref.cp_loss`)."""
    model = models[case]
    cu, tokens = packed(LENGTHS, seed=5)
    labels = tokens.roll(-1)

    def rank_grads(comm):
        replica = copy.deepcopy(model)
        b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, cu, cp_size=P, rank=comm.rank,
                                            layout=layout)  # fmt: skip
        cp = CPContext(comm=comm, sharding=b["sharding"], mode=mode, options=options(mode, P))
        logits = replica(b["tokens"], b["position_ids"], cp)  # (T_l, V)
        token_loss = F.cross_entropy(logits, b["labels"], reduction="none")  # (T_l,)
        cpref.cp_loss(token_loss, b["loss_mask"].double(), comm).backward()
        return {n: p.grad for n, p in replica.named_parameters()}

    per_rank = SimCluster(P).run(rank_grads)
    reference = copy.deepcopy(model)
    single = CPContext.single(cu)
    F.cross_entropy(reference(tokens, single.sharding.positions(0), single), labels).backward()
    for name, p in reference.named_parameters():
        assert_close(sum(g[name] for g in per_rank), p.grad, torch.float64, msg=name)


def test_a_mode_without_windows_refuses_a_sliding_window_model_before_communicating(models, monkeypatch):
    """Not a hang, not silent full attention: every rank raises, naming the sliding layers and the modes that take
    a window, before the first layer (the Qwen3 case's full layer 0 would otherwise communicate first). Every
    built mode takes a window, so p2p is declared without one here."""
    import dataclasses
    from types import MappingProxyType

    import cpref.api
    import cpref.models.model

    modes = dict(cpref.api.MODES)
    modes["p2p"] = dataclasses.replace(modes["p2p"], windows=False)
    for module in (cpref.api, cpref.models.model):
        if hasattr(module, "MODES"):
            monkeypatch.setattr(module, "MODES", MappingProxyType(modes))
    mode, takes = "p2p", [m for m in modes if m != "p2p"]
    cu, tokens = packed(LENGTHS)
    cluster = SimCluster(2)
    for name, sliding in (("qwen3-window", [1]), ("mistral", [0, 1])):
        match = re.escape(f"layers {sliding} of this model attend in a sliding window") + ".*" + re.escape(
            f"mode={mode!r} does not take yet; run it with a mode that does: {takes}")  # fmt: skip
        with pytest.raises(cpref.CPInputError, match=match):
            cluster.run(lambda comm, name=name: forward_on_rank(models[name], tokens, cu, comm, mode=mode, layout="zigzag"))
    assert cluster.trace == []  # not even the ranks' comparison of the arguments
