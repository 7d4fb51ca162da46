"""Train a Hugging Face model with cpref's context parallelism, over torchrun.

    torchrun --standalone --nproc-per-node 4 examples/hf_model.py --cp 2    # DP 2 x CP 2, gloo on CPU

(from the repository root, after `make test` or `make demo` has made .venv: `.venv/bin/torchrun`).
Every process builds the same tiny Llama (scaled RoPE, as Llama 3.1+ checkpoints have it; a real
model: `AutoModelForCausalLM.from_pretrained(path, attn_implementation="cpref")`) and trains it
with `cpref.training.train` on packs of standard-library text, documents packed end to end. Then
rank 0 trains the same model on the same packs on one device, without CP, and prints both loss
curves and their largest relative difference (the exit status is 1 above 1e-5).
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

# --8<-- [start:hf]
import cpref
import cpref.hf
from cpref.packing import BYTE_VOCAB, stdlib_documents
from cpref.training import PackSource, Topology, TrainConfig, train

cpref.hf.register()  # attn_implementation="cpref": every attention layer runs cpref.attention


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.0, attn_implementation="cpref",
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.LlamaForCausalLM(config)


def documents():  # byte tokens of many short documents
    return (doc[: 8 + (n * 37) % 300] for n, doc in enumerate(stdlib_documents()))


def run(world, cp: int, mode: str, steps: int, packs_per_step: int) -> list[float]:
    """Train on `world` (DP x CP ranks, CP groups of `cp` consecutive ranks); the loss of every step."""
    dp = world.size // cp
    cp_group = world.split([list(range(d * cp, (d + 1) * cp)) for d in range(dp)])
    topo = Topology(cp=cp_group, world=world, dp_rank=world.rank // cp, dp_size=dp)
    config = TrainConfig(mode=mode, layout="balanced", options=cpref.MODES[mode].example_options(cp),
                         micro_batches=packs_per_step // dp, lr=1e-3)  # fmt: skip
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    stats = train(model, optimizer, PackSource(documents, 128), topo, config, steps, forward=cpref.hf.forward)
    return [s.loss for s in stats]
# --8<-- [end:hf]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="CP group size (the world size over it is DP)")
    parser.add_argument("--mode", default="p2p", choices=sorted(cpref.MODES))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.distributed.init_process_group("gloo")
    from cpref.backends import TorchComm

    world = TorchComm()
    if world.size % args.cp:
        parser.error(f"--cp {args.cp} does not divide the {world.size} processes")
    packs = world.size // args.cp  # per step: one pack per DP replica
    losses = run(world, args.cp, args.mode, args.steps, packs)
    status = 0
    if world.rank == 0:
        alone = run(cpref.SingleRank(), 1, args.mode, args.steps, packs)  # the same packs, one device
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, alone))
        for step, (a, b) in enumerate(zip(losses, alone)):
            print(f"step {step:2d}  loss with CP {a:.6f}  without {b:.6f}")
        print(f"DP {world.size // args.cp} x CP {args.cp}, mode {args.mode}: largest relative difference {worst:.1e}")
        status = int(worst > 1e-5)
    torch.distributed.barrier()  # tear down together: gloo can abort a rank that leaves while its peer still works
    torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
