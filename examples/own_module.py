"""Your own `nn.Module` with cpref's context parallelism, over torchrun: shard, attend, loss, gradients.

    torchrun --standalone --nproc-per-node 2 examples/own_module.py          # CP 2, gloo on CPU

(from the repository root, with `.venv/bin/torchrun`). A one-layer attention model written against
`cpref.attention` trains a few steps on one packed batch of three documents, every process holding
its shard; rank 0 then trains the same model on the whole batch alone (`cpref.SingleRank()`: CP = 1)
and prints both losses per step and their largest relative difference (exit status 1 above 1e-5).
"""

from __future__ import annotations

import sys

# --8<-- [start:own]
import torch
import torch.nn.functional as F

import cpref
from cpref.comm import TorchComm


class TinyLM(torch.nn.Module):
    """Embedding, one causal attention layer (4 query heads, 2 key/value heads),
    output head.
    """

    def __init__(
        self, vocab: int = 64, width: int = 32, heads: int = 4, kv_heads: int = 2
    ) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.q = torch.nn.Linear(width, heads * self.d)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.d)
        self.out = torch.nn.Linear(heads * self.d, vocab)

    def forward(self, tokens, sharding: cpref.Sharding, comm) -> torch.Tensor:
        x = self.embed(tokens)  # (T_l, width): this rank's shard only
        q = self.q(x).view(-1, self.heads, self.d)  # (T_l, Hq, D)
        kv = self.kv(x).view(-1, 2, self.kv_heads, self.d)  # (T_l, 2, Hkv, D)
        k, v = kv.unbind(1)  # (T_l, Hkv, D) each
        # the only line CP changes
        o = cpref.attention(q, k, v, sharding, comm=comm, mode="p2p")
        return self.out(o.flatten(1))  # (T_l, vocab)


def train(comm, steps: int = 5) -> list[float]:
    # 1) the batch: three documents packed end to end; labels are the next token
    #    of the same document
    cu_seqlens = [0, 21, 30, 64]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (64,), generator=generator)
    loss_mask = torch.ones(64)
    # a document's last token predicts nothing
    loss_mask[torch.tensor(cu_seqlens[1:]) - 1] = 0.0
    whole = {"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": loss_mask}
    batch = cpref.get_batch_on_this_cp_rank(
        whole, cu_seqlens, cp_size=comm.size, rank=comm.rank
    )
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        # 2) forward on the shard; the loss share of this rank (its sum over the
        #    ranks is the global mean)
        logits = model(batch["tokens"], batch["sharding"], comm)
        token_loss = F.cross_entropy(logits, batch["labels"], reduction="none")
        loss = cpref.cp_loss(token_loss, batch["loss_mask"], comm)
        optimizer.zero_grad()
        loss.backward()
        # 3) every rank holds a replica: the gradient is the sum of the ranks'
        #    (one all-reduce, flattened)
        params = list(model.parameters())
        flat = comm.all_reduce(torch.cat([p.grad.flatten() for p in params]))
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        optimizer.step()
        losses.append(float(comm.all_reduce(loss.detach().reshape(1))))
    return losses


def train_with_cp() -> tuple[list[float], TorchComm]:
    """On every process torchrun starts: join them (torchrun's environment gives
    each its rank), then train.
    """
    torch.distributed.init_process_group("gloo")  # NCCL on GPUs
    comm = TorchComm()  # the CP group: here every process
    return train(comm), comm
# --8<-- [end:own]


def main() -> int:
    losses, comm = train_with_cp()
    status = 0
    if comm.rank == 0:
        alone = train(cpref.SingleRank())
        for step, (a, b) in enumerate(zip(losses, alone)):
            print(f"step {step}  loss with CP {a:.6f}  without {b:.6f}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, alone))
        print(f"CP {comm.size}: largest relative difference {worst:.1e}")
        status = int(worst > 1e-5)
    torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
