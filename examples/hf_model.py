"""Train a Hugging Face model with cpref's context parallelism, on the batches transformers makes.

    .venv/bin/python examples/hf_model.py --cp 2              # launches itself: 4 processes, DP 2 x CP 2, gloo on CPU
    .venv/bin/python examples/hf_model.py --nproc 2 --cp 2    # 2 processes: CP 2 alone
    .venv/bin/torchrun --standalone --nproc-per-node 4 examples/hf_model.py --cp 2    # the same, by hand

Every process builds the same tiny Llama (scaled RoPE, as Llama 3.1+ checkpoints have it; a real
model: `AutoModelForCausalLM.from_pretrained(path, attn_implementation="cpref")`). Each step, every
DP replica collates its documents (standard-library text, byte tokens) with transformers'
`DataCollatorWithFlattening`, the padding-free batch of packed training (`position_ids` restart at
every document); `cpref.hf.shard_batch` turns it into this rank's shard. Then rank 0 trains the same
model on the same batches on one device, without CP, with transformers' own attention and loss
(`model(**batch, num_items_in_batch=...)`), and prints both loss curves and their largest relative
difference (the exit status is 1 above 1e-5).
"""

from __future__ import annotations

import argparse
import os
import sys

# --8<-- [start:hf]
from itertools import islice

import torch
import torch.nn.functional as F
import transformers

import cpref
import cpref.hf
from cpref.comm import TorchComm
from cpref.train.packing import BYTE_VOCAB, stdlib_documents

# attn_implementation="cpref": every attention layer runs cpref.attention
cpref.hf.register()
# input_ids, labels, position_ids: (1, T) each
collate = transformers.DataCollatorWithFlattening()


def tiny_llama(attn_implementation: str) -> transformers.LlamaForCausalLM:
    rope = {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = transformers.LlamaConfig(
        vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attention_dropout=0.0, attn_implementation=attn_implementation,
        rope_parameters=rope,
    )
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.LlamaForCausalLM(config)


def features(step: int, replica: int, dp: int) -> list[dict]:
    """The documents DP replica `replica` trains on at `step`: four of many
    short ones.
    """
    first = 4 * (step * dp + replica)
    docs = islice(stdlib_documents(), first, first + 4)
    return [
        {"input_ids": doc[: 8 + (n * 37) % 120].tolist()}
        for n, doc in enumerate(docs, start=first)
    ]


def train(world, cp: int, mode: str, steps: int) -> list[float]:
    """DP x CP training on `world` (CP groups of `cp` consecutive ranks): every
    step's loss.
    """
    dp = world.size // cp
    groups = [list(range(d * cp, (d + 1) * cp)) for d in range(dp)]
    group = world.split(groups)  # this rank's CP group
    model = tiny_llama("cpref")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        # this replica's batch, as transformers makes it
        batch = collate(features(step, world.rank // cp, dp))
        # this rank's shard
        b = cpref.hf.shard_batch(
            batch, cp_size=cp, rank=group.rank, layout="balanced"
        )
        # the loss tokens of every replica
        count = world.all_reduce(b["loss_mask"].sum().reshape(1))
        options = cpref.MODES[mode].example_options(cp)
        cp_args = cpref.hf.CP(group, b["sharding"], mode, options)
        logits = model(
            b["tokens"][None],
            position_ids=b["position_ids"][None],
            use_cache=False,
            cp=cp_args,
        ).logits[0]
        token_loss = F.cross_entropy(logits, b["labels"], reduction="none")
        loss = cpref.cp_loss(token_loss, b["loss_mask"], world, count=count)
        optimizer.zero_grad()
        loss.backward()
        # every rank holds a replica: the gradient of the mean loss is the SUM of
        # the ranks' gradients
        params = list(model.parameters())
        grads = world.all_reduce(torch.cat([p.grad.flatten() for p in params]))
        for p, g in zip(params, grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        optimizer.step()
        losses.append(float(world.all_reduce(loss.detach().reshape(1))))
    return losses


def join() -> TorchComm:
    """On every process torchrun starts: join them (its environment gives each
    its rank) as one world.
    """
    torch.distributed.init_process_group("gloo")  # NCCL on GPUs
    return TorchComm()  # every process; train() splits it into the CP groups
# --8<-- [end:hf]


def without_cp(dp: int, steps: int) -> list[float]:
    """The same model and batches on one device: transformers' own attention and loss."""
    model = tiny_llama("sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batches = [collate(features(step, r, dp)) for r in range(dp)]
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # the loss tokens of the step
        optimizer.zero_grad()
        loss = sum(model(**b, num_items_in_batch=count, use_cache=False).loss for b in batches)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="CP group size (the world size over it is DP)")
    parser.add_argument("--mode", default="p2p", choices=sorted(cpref.MODES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4, help="processes to launch when started without torchrun")
    return parser


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's command line that runs this script on `args.nproc` processes with the same options.

    The script's options are written out by their full names and `--nproc` (this launcher's own) is left out:
    torchrun reads every option of its command line, the script's too, and takes `--nproc` for an
    abbreviation of its `--nproc-per-node` ("ambiguous option")."""
    script = ["--cp", str(args.cp), "--mode", args.mode, "--steps", str(args.steps)]
    return ["--standalone", "--nproc-per-node", str(args.nproc), __file__, *script]


def launch_self(args: argparse.Namespace) -> int:
    """Run this script under torchrun (it was started without it); its exit status."""
    import subprocess

    launch = torchrun_args(args)
    print("launching: torchrun " + " ".join(launch), flush=True)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *launch])


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        if args.nproc < 1 or args.cp < 1 or args.nproc % args.cp:
            parser.error(f"--cp {args.cp} must divide --nproc {args.nproc} (both positive)")
        return launch_self(args)
    world = join()
    if world.size % args.cp:
        parser.error(f"--cp {args.cp} does not divide the {world.size} processes")
    losses = train(world, args.cp, args.mode, args.steps)
    status = 0
    if world.rank == 0:
        alone = without_cp(world.size // args.cp, args.steps)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, alone))
        for step, (a, b) in enumerate(zip(losses, alone)):
            print(f"step {step:2d}  loss with CP {a:.6f}  without {b:.6f}")
        print(f"DP {world.size // args.cp} x CP {args.cp}, mode {args.mode}: largest relative difference {worst:.1e}")
        status = int(worst > 1e-5)
    torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
