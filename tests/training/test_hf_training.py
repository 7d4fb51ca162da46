"""A Hugging Face model trains with CP as on one device: `cpref.train.training` with `forward=cpref.hf.forward`.

A tiny Llama with scaled RoPE (`tests.models.test_hf_attention`'s, random weights), 20 AdamW steps on packs
of 64 tokens of standard-library text (many documents a pack), at CP = 2 and CP = 4 and DP 2 x CP 2 on the
simulated cluster, each with its mode and layout: every step's loss and gradient norm within 1e-5 relative
of the run at CP = 1 that sees the same packs (fp32). The gradients are summed over the DP x CP group, one
flattened all-reduce (`cpref.train.training`'s step 3), so every replica stays the same model.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest
import torch

import cpref
import cpref.hf
from cpref.train.training import PackSource, Topology, TrainConfig, train
from sim import SimCluster
from sim.tools.train import short_documents

pytest.importorskip("transformers")
from tests.models.test_hf_attention import build  # noqa: E402

STEPS, PACK = 20, 64
RUNS = [(2, 1, "p2p", "zigzag"), (4, 1, "a2a+p2p", "balanced"), (2, 2, "all_gather", "stream"), (4, 1, "a2a", "contiguous")]


@lru_cache(maxsize=None)
def model():
    cpref.hf.register()
    return build("llama3", cpref.hf.NAME)


def run(cp: int, dp: int, mode: str, layout: str) -> list[tuple[float, float]]:
    """Rank 0's `(loss, grad norm)` per step of a DP x CP run (consecutive CP groups)."""
    config = TrainConfig(mode=mode, layout=layout, options=cpref.MODES[mode].example_options(cp), micro_batches=2 // dp,
                         lr=1e-3)  # fmt: skip

    def rank(world):
        groups = [list(range(d * cp, (d + 1) * cp)) for d in range(dp)]
        topo = Topology(world.split(groups) if dp > 1 else world, world, world.rank // cp, dp)
        replica = copy.deepcopy(model())
        optimizer = torch.optim.AdamW(replica.parameters(), lr=config.lr)
        stats = train(replica, optimizer, PackSource(short_documents, PACK), topo, config, STEPS, forward=cpref.hf.forward)
        return [(s.loss, s.grad_norm) for s in stats], [p.detach().clone() for p in replica.parameters()]

    results = SimCluster(cp * dp, timeout=600.0).run(rank)
    for _, params in results[1:]:  # every replica the same model after the last step
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1]))
    return results[0][0]


@lru_cache(maxsize=None)
def reference() -> list[tuple[float, float]]:
    return run(1, 1, "p2p", "zigzag")


@pytest.mark.sweep(strength=1)  # every size, mode and layout once; every run in test-all
@pytest.mark.parametrize("cp, dp, mode, layout", RUNS)
def test_twenty_steps_match_the_run_without_cp(cp, dp, mode, layout):
    got, want = run(cp, dp, mode, layout), reference()
    assert len(got) == len(want) == STEPS
    for step, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(loss_ref, rel=1e-5), f"step {step}: loss {loss} vs {loss_ref}"
        assert norm == pytest.approx(norm_ref, rel=1e-5), f"step {step}: grad norm {norm} vs {norm_ref}"
    assert want[-1][0] < want[0][0]  # it learns: the loss falls over the 20 steps


@pytest.mark.full
def test_the_example_launches_itself_and_trains_dp2_x_cp2_as_transformers_does_without_cp():
    """`python examples/hf_model.py` without torchrun (on main: a torch.distributed RANK traceback) launches itself
    on 4 gloo processes (DP 2 x CP 2, a2a+p2p over the balanced layout, transformers' DataCollatorWithFlattening
    batches through cpref.hf.shard_batch) and exits 0: its 20 losses within 1e-5 relative of transformers' own
    attention and loss without CP, which it prints. Its own `--nproc=4` is not handed to torchrun (which refused
    it: "ambiguous option: --nproc could match --nproc-per-node")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "examples/hf_model.py", "--nproc=4", "--cp", "2", "--mode", "a2a+p2p"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.startswith("launching: torchrun --standalone --nproc-per-node 4 ")
    lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == [str(s) for s in range(STEPS)]
    assert "DP 2 x CP 2, mode a2a+p2p: largest relative difference" in out.stdout


@pytest.mark.parametrize("argv", [["--nproc", "2"], ["--nproc=2", "--cp", "1", "--mode", "a2a", "--steps", "3"],
                                  ["--steps=5", "--nproc", "6", "--cp=3"]])  # fmt: skip
def test_the_examples_own_options_reach_it_through_torchrun(argv):
    """The launcher's command line, read by torchrun's own parser: `--nproc` becomes torchrun's process count and
    not an option of the script (on main torchrun refused the whole line), and the script gets its other options."""
    from torch.distributed.run import get_args_parser

    from examples import hf_model

    args = hf_model.make_parser().parse_args(argv)
    launch = get_args_parser().parse_args(hf_model.torchrun_args(args))
    assert launch.standalone and launch.nproc_per_node == str(args.nproc)
    assert launch.training_script == hf_model.__file__ and "--nproc" not in " ".join(launch.training_script_args)
    again = hf_model.make_parser().parse_args(launch.training_script_args)
    assert vars(again) == vars(args) | {"nproc": again.nproc}  # every option but the launcher's own
