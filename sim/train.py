"""Train a model with CP: `python -m sim train`, GPT-2, LLaMA or Qwen3 style, on packed documents.

This page runs the training loop of [`cpref.training`](training.md) with the models of
[`cpref.models`](models.md) on real text: the source files of the Python standard library this
interpreter runs, byte-level tokens, packed into fixed-size packs with an end-of-document token
(`cpref.packing`). Everything is deterministic: the same command prints the same losses.

## On the simulated cluster

```bash
.venv/bin/python -m sim train --model llama --cp 4 --mode p2p --layout zigzag --steps 20
```

runs every rank as a thread of one process and prints one line per step from rank 0:

```text
step 0 loss 5.5511827 grad_norm 2.0472 tokens_per_s 1815
step 1 loss 5.4126663 grad_norm 3.5175 tokens_per_s 1968
```

`--model gpt2|llama|qwen3` chooses the family (small presets that train in seconds on a CPU),
`--mode` and `--layout` the CP algorithm, `--a2a-size` the hierarchical mode's group,
`--dp M` adds data parallelism (a world of `M x N` ranks; `--strided` puts non-consecutive ranks
in a CP group), `--micro-batches` accumulates gradients, `--dtype bf16` runs the forward under
bfloat16 autocast, `--pack-tokens` sets the pack size.

## On real processes

```bash
.venv/bin/python -m sim train --backend gloo --model qwen3 --cp 2 --dp 2 --steps 20
torchrun --nproc-per-node 4 -m sim train --backend gloo --cp 2 --dp 2   # the same, launched by torchrun
```

starts `dp x cp` gloo processes (`sim.launch`; under torchrun, torchrun's), each a replica of the
model, and runs the same loop over `cpref.backends.TorchComm`.

## The run does not depend on the CP size

The loss of a step is the mean over every loss token of the step on every rank
(`cpref.training`), and attention is exact at any CP size, so a run at CP = 4 is the run at
CP = 1, up to rounding. The figure below shows two real runs, and the test suite checks the
loss and gradient norm of 10 steps of every family in every mode and layout, at CP = 2, CP = 4
and DP 2 x CP 2, against CP = 1: within 1e-5 (fp32), and 1e-2 under bf16 autocast.

## Checkpoints, and resuming at another CP size

```bash
.venv/bin/python -m sim train --cp 2 --steps 10 --save ckpt
.venv/bin/python -m sim train --cp 4 --mode a2a --steps 20 --resume ckpt
```

The first run writes a checkpoint after step 10 (`torch.save` on the simulated cluster,
`torch.distributed.checkpoint` with `--backend gloo`); the second continues at step 10 on 4
ranks, in another mode, exactly as the first run would have continued (tested step for step).
CP splits the sequence, never the parameters, so a checkpoint fits any CP size; it is refused,
with the reason, if the model or the packs per step (`dp x micro_batches`) differ, or if its
files do not match their SHA-256 sums ([Checkpoints](checkpoint.md)).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

import cpref
from cpref.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from cpref.models import CausalLM, ModelConfig
from cpref.packing import BYTE_VOCAB, stdlib_documents
from cpref.training import PackSource, StepStats, Topology, TrainConfig, train

__all__ = ["RunSpec", "PRESETS", "run_rank", "run_sim", "main"]

# Small models that train in seconds on a CPU; every size divisible by the CP sizes used.
PRESETS = {
    "gpt2": dict(family="gpt2", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=8, max_positions=4096),
    "llama": dict(family="llama", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2),
    "qwen3": dict(family="qwen3", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16),
}


def short_documents(limit: int = 2000, longest: int = 300) -> Iterator[torch.Tensor]:
    """Standard-library files cut to a deterministic spread of lengths, so that packs hold many documents."""
    for n, doc in enumerate(stdlib_documents(limit)):
        yield doc[: 8 + (n * 37) % longest]


@dataclass(frozen=True)
class RunSpec:
    """One training run (see `python -m sim train --help`)."""

    model: str = "llama"
    cp: int = 2
    dp: int = 1
    steps: int = 10
    pack_tokens: int = 512
    seed: int = 0
    strided: bool = False  # CP groups of non-consecutive ranks: {0, dp, 2 dp, ...}
    train: TrainConfig = field(default_factory=TrainConfig)
    save: str | None = None
    resume: str | None = None
    documents: Callable[[], Iterator[torch.Tensor]] = short_documents

    def model_config(self) -> ModelConfig:
        """The preset of `model`, over the byte-level vocabulary."""
        return ModelConfig(vocab_size=BYTE_VOCAB, **PRESETS[self.model])

    def meta(self, step: int) -> CheckpointMeta:
        """What a checkpoint of this run at `step` records."""
        c = self.model_config()
        return CheckpointMeta(step, self.dp, self.cp, self.train.mode, self.train.layout, self.train.micro_batches,
                              {k: v for k, v in c.__dict__.items()})  # fmt: skip


def topology(world: Any, spec: RunSpec) -> Topology:
    """The CP group of this rank and its DP index: consecutive ranks, or strided ones."""
    if spec.strided:
        groups = [list(range(d, spec.dp * spec.cp, spec.dp)) for d in range(spec.dp)]
    else:
        groups = [list(range(d * spec.cp, (d + 1) * spec.cp)) for d in range(spec.dp)]
    dp_rank = next(d for d, g in enumerate(groups) if world.rank in g)
    return Topology(world.split(groups), world, dp_rank, spec.dp)


def run_rank(world: Any, spec: RunSpec, payload: Any = None, on_step: Callable[[StepStats], Any] | None = None) -> list[StepStats]:
    """Everything one rank does: topology, model, optimizer, data, (resume,) train, (save)."""
    topo = topology(world, spec)
    model = CausalLM(spec.model_config(), seed=spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr)
    start = 0
    if spec.resume:
        start = load_checkpoint(spec.resume, model, optimizer, expect=spec.meta(0), payload=payload).step
    source = PackSource(spec.documents, spec.pack_tokens)
    stats = train(model, optimizer, source, topo, spec.train, spec.steps, start=start,
                  on_step=on_step if world.rank == 0 else None)  # fmt: skip
    if spec.save:
        save_checkpoint(spec.save, model, optimizer, spec.meta(spec.steps), world, payload)
    return stats


def run_sim(spec: RunSpec, on_step: Callable[[StepStats], Any] | None = None) -> list[StepStats]:
    """The run on the simulated cluster (one process); rank 0's stats."""
    from sim import SimCluster

    return SimCluster(spec.dp * spec.cp, timeout=600.0).run(lambda world: run_rank(world, spec, on_step=on_step))[0]


def _gloo_rank(spec: RunSpec) -> list[StepStats]:
    from cpref.backends import TorchComm
    from cpref.backends.checkpoint import DcpPayload

    return run_rank(TorchComm(), spec, DcpPayload(), on_step=_print_step)


def _print_step(s: StepStats) -> None:
    print(f"step {s.step} loss {s.loss:.7f} grad_norm {s.grad_norm:.4f} tokens_per_s {s.tokens_per_s:.0f}", flush=True)


def parse(argv: Sequence[str] | None, prog: str = "python -m sim train") -> tuple[RunSpec, str]:
    """`(spec, backend)` from the command line."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="llama")
    p.add_argument("--cp", type=int, default=2, help="CP size")
    p.add_argument("--dp", type=int, default=1, help="DP size (world = dp x cp)")
    p.add_argument("--mode", choices=sorted(cpref.MODES), default="p2p")
    p.add_argument("--a2a-size", type=int, default=None, help="a2a group size of mode a2a+p2p")
    p.add_argument("--layout", choices=cpref.LAYOUTS, default="zigzag")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--pack-tokens", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: the forward under bfloat16 autocast")
    p.add_argument("--backend", choices=["sim", "gloo"], default="sim")
    p.add_argument("--strided", action="store_true", help="CP groups of non-consecutive ranks")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="continue from this checkpoint")
    a = p.parse_args(argv)
    options = {"a2a_size": a.a2a_size if a.a2a_size else (2 if a.cp % 2 == 0 else 1)} if a.mode == "a2a+p2p" else {}
    config = TrainConfig(mode=a.mode, layout=a.layout, options=options, micro_batches=a.micro_batches, lr=a.lr,
                         bf16=a.dtype == "bf16")  # fmt: skip
    spec = RunSpec(a.model, a.cp, a.dp, a.steps, a.pack_tokens, strided=a.strided, train=config, save=a.save, resume=a.resume)
    return spec, a.backend


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim train") -> int:
    """Run the training the arguments describe; rank 0 prints one line per step."""
    spec, backend = parse(argv, prog)
    print(f"training {spec.model} with {spec.train.mode}/{spec.train.layout} at DP {spec.dp} x CP {spec.cp} "
          f"on {backend}, {spec.pack_tokens}-token packs", file=sys.stderr)  # fmt: skip
    if backend == "sim":
        run_sim(spec, on_step=_print_step)
    else:
        from sim.launch import launch

        launch(_gloo_rank, spec.dp * spec.cp, args=(spec,), timeout=600.0)
    return 0
